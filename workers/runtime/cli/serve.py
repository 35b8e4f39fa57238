"""`serve`, `token`, `webhooks`: the HTTP side (the `web` package, imported only when one runs).

`serve` runs the HTTP API, its event streams and the web inbox under uvicorn (stopping on
SIGTERM/SIGINT with status 0); `token new` makes an API identity's token and configuration line;
`webhooks list|replay` shows the subscriptions and failed deliveries, or queues one again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

import orjson
from pydantic import ValidationError

from broker import BadItem, Broker, Settings
from broker.cli import CliError, Command, global_args
from workers.runtime.cli.common import _HANDED, _level, _me
from workers.runtime.logs import configure

logger = logging.getLogger("workers.runtime.cli")


def _serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="the port (default 8420)")
    parser.add_argument(
        "--tokens",
        default=None,
        metavar="FILE",
        help="the identities, a JSON file (default: PROMPT_BROKER_API_TOKENS)",
    )


async def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    # The web package is imported here only: the rest of the CLI does not need Starlette.
    import uvicorn

    from web.app import create_app
    from web.settings import ApiSettings

    configure(_level(args))
    api = ApiSettings.from_env(host=args.host, port=args.port, tokens=_token_file(args.tokens))
    if not api.tokens:
        logger.warning("serve.no_tokens")  # every /v1 request will be refused: 401
    config = uvicorn.Config(
        create_app(api, settings),
        host=api.host,
        port=api.port,
        log_config=None,  # ours, configured above; the access log shows no token (none in URLs)
        lifespan="on",
        # Open event streams never end by themselves: on SIGTERM they are cut after this.
        timeout_graceful_shutdown=3,
    )
    await _server_class()(config).serve()
    return 0


def _server_class() -> type[Any]:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, stopping on SIGTERM/SIGINT with status 0: uvicorn's own handling raises
        the signal again once it has shut down, so the process would die of it."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


def _token_file(path: str | None) -> Any:
    if path is None:
        return None
    from web.settings import load_tokens

    return load_tokens(path)


def _token_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    new = sub.add_parser("new", help="make a token and print its configuration line")
    new.add_argument("name", metavar="NAME", help="whose token: the author of what it posts")
    new.add_argument(
        "--scopes",
        required=True,
        help="comma-separated: read (GETs, events), answer (post, cancel), admin (everything)",
    )
    new.add_argument("--threads", default=None, metavar="GLOB", help="only these threads")
    new.add_argument(
        "--groups",
        default=None,
        metavar="G1,G2",
        help="the groups it answers escalated prompts for, on any thread",
    )


async def cmd_token(args: argparse.Namespace, settings: Settings) -> int:
    import secrets

    from web.settings import Identity

    token = "pb_" + secrets.token_urlsafe(32)
    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    entry: dict[str, Any] = {"name": args.name, "token": token, "scopes": scopes}
    if args.threads is not None:
        entry["threads"] = args.threads
    if args.groups is not None:
        entry["groups"] = [g.strip() for g in args.groups.split(",") if g.strip()]
    try:
        identity = Identity.model_validate(entry)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(f"--{p}" if i == 0 else str(p) for i, p in enumerate(err["loc"]))
        raise BadItem(where or "token", err["msg"]) from None
    if identity.name == settings.identity:
        raise BadItem("name", f"{identity.name!r} is the broker's own identity")
    print(token)
    print(orjson.dumps(identity.model_dump(exclude_defaults=True)).decode())
    print(
        f"{_me()}: the first line is the token, shown once: give it to {identity.name}. Add "
        "the second line to the list in PROMPT_BROKER_API_TOKENS (or its file).",
        file=sys.stderr,
    )
    return 0


# -- webhooks ----------------------------------------------------------------------------------


def _webhooks_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser(
        "list", help="the subscriptions and the deliveries that failed for good"
    )
    listing.add_argument("--json", action="store_true", help="print one JSON document instead")
    replay = sub.add_parser(
        "replay", help="queue a failed delivery again (a running serve sends it)"
    )
    replay.add_argument("delivery", metavar="DELIVERY_ID", help="as `webhooks list` shows it")
    for action in (listing, replay):
        global_args(action)


def _failed_line(record: dict[str, Any]) -> str:
    payload = record.get("payload") or {}
    return (
        f"  {record['delivery']}  {payload.get('event', '?')}  thread {payload.get('thread_id')}"
        f"  {record.get('tries')} tries  last error: {record.get('error')}"
    )


async def cmd_webhooks(args: argparse.Namespace, settings: Settings) -> int:
    from web.settings import ApiSettings
    from web.webhooks import Dispatcher

    subscriptions = ApiSettings.from_env().webhooks
    async with Broker.from_url(settings=settings, socket_connect_timeout=5) as b:
        # The server's own reader and writer of the failed deliveries, so both see one record.
        hooks = Dispatcher(b.redis, b.keys, subscriptions, queue_redis=b.queue_redis)
        try:
            if args.action == "replay":
                if not await hooks.replay(args.delivery):
                    raise CliError(
                        f"DELIVERY_ID: no failed delivery {args.delivery!r} "
                        "(`webhooks list` shows those kept)"
                    )
                print(f"delivery {args.delivery} queued again: a running `serve` sends it")
                return 0
            failed = await hooks.failures()
        finally:
            await hooks.aclose()
    # Never the secret: the same fields `GET /v1/webhooks` shows.
    subscribed = [{"id": h.id, "url": h.url, "events": list(h.events)} for h in subscriptions]
    if args.json:
        document = {"webhooks": subscribed, "failed": failed}
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
        return 0
    lines = [f"subscriptions ({len(subscribed)}):"]
    lines += [f"  {s['id']}  {s['url']}  {', '.join(s['events'])}" for s in subscribed]
    if not subscribed:
        lines.append("  none (PROMPT_BROKER_API_WEBHOOKS is empty)")
    lines.append(f"failed deliveries ({len(failed)}):")
    lines += [_failed_line(r) for r in failed] or ["  none"]
    print("\n".join(lines))
    return 0


#: The HTTP side's commands.
COMMANDS: dict[str, Command] = {
    "serve": Command(
        "serve the HTTP API and the web inbox until SIGTERM/SIGINT",
        _serve_args,
        cmd_serve,
        0,
    ),
    "token": Command(
        "make an API token", _token_args, cmd_token, finds_fleet=False, redis_help=_HANDED
    ),
    "webhooks": Command(
        "list webhook subscriptions and failed deliveries, or replay one",
        _webhooks_args,
        cmd_webhooks,
    ),
}
