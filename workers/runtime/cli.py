"""The command line, with the runtime's commands added to the library's (`broker.cli`).

prompt-broker worker [--id NAME]         one replica, until SIGTERM/SIGINT
prompt-broker audit                      the arq audit worker
prompt-broker up [--workers N] [--data-dir DIR]
                                         a local fleet: N replicas + the audit worker, on its
                                         own Redis (data kept in DIR) unless one is given
prompt-broker demo [--workers N]         a self-driving scenario on a throwaway local fleet
       [--harness scripted|claude_code|codex]   (the real agent CLIs against a fake model)
prompt-broker thread new THREAD [...]    create a thread and its agent session
prompt-broker thread close THREAD        end a thread (its open prompt is cancelled)
prompt-broker thread status THREAD [--json]   who holds it, its lease, what it waits on
prompt-broker serve [--host H] [--port P] [--tokens FILE]
                                         the HTTP API, its event streams and the web inbox
prompt-broker token new NAME --scopes read,answer [--threads GLOB]
                                         make a token; prints it, then its line for the config
prompt-broker webhooks list [--json]     the subscriptions and the deliveries that failed
prompt-broker webhooks replay DELIVERY_ID
                                         queue a failed delivery again
prompt-broker status [--json]            the fleet: replicas, threads, waits, prompts, audit backlog
prompt-broker health worker|audit|serve [--port P] [--live]
                                         probe a process's health endpoint (exit 0 when ready)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from broker import BadItem, Broker, BrokerError, Settings, ThreadNotFound
from broker.cli import COMMANDS, CliError, Command, data_home, fleet_record, global_args
from broker.cli import main as broker_main
from broker.sessions import Session
from workers.agents.policy import validate as validate_policy
from workers.runtime import audit
from workers.runtime.fleet import Fleet
from workers.runtime.logs import configure
from workers.runtime.replica import default_harnesses
from workers.runtime.run import run_replica

__all__ = ["RUNTIME", "main"]

logger = logging.getLogger("workers.runtime.cli")


def _level(args: argparse.Namespace) -> int:
    return logging.DEBUG if args.verbose >= 2 else logging.INFO


def _me() -> str:
    """How to run this command again: the console script's path, or `prompt-broker`."""
    argv0 = Path(sys.argv[0])
    return str(argv0) if argv0.name == "prompt-broker" else "prompt-broker"


#: The agent harnesses `thread new --harness` takes (claude_code needs the `claude` extra).
HARNESSES = ("scripted", "claude_code", "codex")
#: The demos `demo --harness` runs (`workers.demo.scenario.HARNESSES`, imported only when one runs).
DEMO_HARNESSES = ("scripted", "claude_code", "codex")


def _explicit_redis(args: argparse.Namespace) -> bool:
    return args.redis_url is not None or "PROMPT_BROKER_REDIS_URL" in os.environ


# -- worker, audit -------------------------------------------------------------------------


def _parent_arg(parser: argparse.ArgumentParser) -> None:
    # How a fleet starts its processes: not for people, so not in --help.
    parser.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)


def _worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id", default=None, help="this replica's name (default: host-pid-random)")
    _parent_arg(parser)


def _stop_with_parent(parent: int | None) -> None:
    """A fleet's process gets SIGTERM when the fleet dies, even by kill -9: none outlives it.

    Linux only (prctl PR_SET_PDEATHSIG); elsewhere the fleet's own stop is all there is.
    """
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the fleet died before we asked to follow it
        raise CliError(f"the fleet (pid {parent}) that started this process is gone")


async def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    _stop_with_parent(args.parent)
    await run_replica(settings, replica_id=args.id)
    return 0


async def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    _stop_with_parent(args.parent)
    await audit.serve(settings)
    return 0


# -- up ---------------------------------------------------------------------------------------

UP_REDIS = (
    "the Redis server (default: PROMPT_BROKER_REDIS_URL, else a private redis-server of the "
    "fleet's own, AOF on, its data kept in --data-dir and its address the same every time; "
    "with no redis-server on PATH, an embedded fakeredis server that keeps nothing)"
)
DEMO_REDIS = (
    "the Redis server (default: PROMPT_BROKER_REDIS_URL, else a throwaway private "
    "redis-server, or an embedded fakeredis server when none is on PATH: nothing is kept)"
)


def _fleet_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=3, metavar="N", help="replicas (default 3)")
    parser.add_argument(
        "--logs", type=Path, default=None, metavar="DIR", help="write each process's log here"
    )


def _up_args(parser: argparse.ArgumentParser) -> None:
    _fleet_args(parser)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where the fleet's own Redis keeps its data and records its address (default: "
        f"{data_home()}, from $XDG_DATA_HOME; the other commands look for the fleet there)",
    )


async def _status(fleet: Fleet, settings: Settings) -> str:
    alive = sum(1 for p in fleet.processes if p.proc is not None and p.proc.poll() is None)
    try:
        async with Broker.from_url(fleet.url, settings, socket_connect_timeout=5) as b:
            holders = await b.sessions.holders()
            waiting = len(await b.open_prompts())
    except (BrokerError, redis_errors.RedisError, OSError) as e:
        # Redis away is worth saying, not worth stopping the fleet for: the replicas ride it out.
        return f"{alive} processes up; cannot reach Redis at {fleet.url} ({e})"
    return f"{alive} processes up, {len(holders)} threads, {waiting} prompts waiting on a person"


async def _reachable(url: str) -> None:
    """PING before anything is started: an unreachable Redis is one line, and no orphans."""
    try:
        client = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    except ValueError as e:
        raise CliError(f"--redis-url / PROMPT_BROKER_REDIS_URL {url}: {e}") from None
    try:
        await client.ping()
    finally:
        await client.aclose()


async def _ready_unless(fleet: Fleet, stop: asyncio.Event) -> bool:
    """Wait for every replica to say it is alive; False if asked to stop meanwhile."""
    ready = asyncio.ensure_future(fleet.ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not ready.done():
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready
        return False
    ready.result()  # its failure, if it failed
    return True


def _banner(fleet: Fleet, args: argparse.Namespace, data_dir: Path) -> list[str]:
    embedded = fleet.embedded
    where = embedded.kind if embedded else fleet.url
    me = _me()
    lines = [f"fleet up: {args.workers} replicas and the audit worker on {where}"]
    if embedded is None:
        lines.append(f"  try:  export PROMPT_BROKER_REDIS_URL={fleet.url}")
    else:
        lines += [
            f"  the other commands find this fleet by themselves (its address is in "
            f"{fleet_record(data_dir)}); elsewhere: PROMPT_BROKER_REDIS_URL={fleet.url}",
            f"  try:  {me} open",
        ]
    lines += [
        f"        {me} thread new t1 --message hello   # its agent asks 'Pick one'",
        f"        {me} answer t1 2 && {me} show t1",
    ]
    if embedded is None:
        lines.append("  Ctrl-C stops the fleet (prompts stay open in Redis)")
    elif embedded.keeps_data:
        lines.append(
            f"  Ctrl-C stops the fleet; its threads and open prompts are kept in {data_dir} "
            "and come back, at the same address, with the next start"
        )
    else:
        lines.append(
            "  Ctrl-C stops the fleet and LOSES every thread and open prompt: the embedded "
            "fakeredis server keeps nothing (install redis-server to keep them)"
        )
    return lines


async def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    if args.workers < 1:
        raise CliError("--workers: at least 1")
    explicit = _explicit_redis(args)
    if explicit:
        await _reachable(settings.redis_url)
    data_dir: Path = args.data_dir if args.data_dir is not None else data_home()
    fleet = Fleet(settings, args.workers, log_dir=args.logs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.start(embedded=not explicit, data_dir=None if explicit else data_dir)
        if not await _ready_unless(fleet, stop):
            print("stopping before the fleet was up...", flush=True)
            return 0
        for line in _banner(fleet, args, data_dir):
            print(line, flush=True)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 10)
            except TimeoutError:
                print(f"status: {await _status(fleet, settings)}", flush=True)
        print("stopping: replicas park their waits and release their threads...", flush=True)
    except (OSError, RuntimeError) as e:
        raise CliError(f"up: {e}") from None
    finally:
        # Whatever failed, nothing this command started outlives it.
        await fleet.stop()
    return 0


def _demo_args(parser: argparse.ArgumentParser) -> None:
    _fleet_args(parser)
    parser.add_argument(
        "--harness",
        default="scripted",
        choices=DEMO_HARNESSES,
        help="the agents: scripted (default), or a real CLI against a fake model: claude_code "
        "(pip install -e '.[claude]'), codex (npm ci)",
    )


async def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from workers.demo.scenario import HARNESSES, run_demo

    if args.harness not in HARNESSES:
        raise CliError(f"--harness: no demo for {args.harness!r} (have: {', '.join(HARNESSES)})")
    if args.harness != "scripted":
        from workers.demo.cases import missing_cli

        missing = missing_cli(args.harness)
        if missing is not None:
            raise CliError(missing)
    configure(logging.DEBUG if args.verbose >= 2 else logging.WARNING, json=False)
    ok = await run_demo(
        settings,
        args.workers,
        embedded=not _explicit_redis(args),
        logs=args.logs,
        harness=args.harness,
    )
    return 0 if ok else 1


# -- thread -----------------------------------------------------------------------------------


def _thread_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    new = sub.add_parser("new", help="create a thread and its agent session")
    new.add_argument("thread", metavar="THREAD")
    new.add_argument(
        "--harness",
        default="scripted",
        choices=HARNESSES,
        help="the agent harness (default scripted; claude_code needs pip install -e '.[claude]')",
    )
    new.add_argument(
        "--permissions",
        default="approval",
        choices=["approval", "autonomous", "guarded"],
        help="approval: every gated call asks a person (default); autonomous: none do; "
        "guarded: a policy decides each call (needs --policy)",
    )
    new.add_argument(
        "--policy",
        metavar="FILE|JSON",
        help=(
            "the guarded policy block: a JSON file, or the JSON itself"
            " (see workers/agents/policy.py)"
        ),
    )
    group = new.add_mutually_exclusive_group()
    group.add_argument("--script", type=Path, metavar="FILE", help="a scripted agent's JSON script")
    group.add_argument("--config", metavar="JSON", help="the harness config, as JSON")
    new.add_argument("--work-folder", default="", metavar="DIR", help="the agent's work folder")
    new.add_argument("--message", metavar="TEXT", help="post this first message at once")
    close = sub.add_parser("close", help="end a thread: its open prompt is cancelled")
    close.add_argument("thread", metavar="THREAD")
    close.add_argument("--reason", default="thread_closed", help="default: %(default)s")
    status = sub.add_parser("status", help="who holds the thread and what it waits on")
    status.add_argument("thread", metavar="THREAD")
    status.add_argument("--json", action="store_true", help="print one JSON document instead")
    for action in (new, close, status):
        global_args(action)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    if args.script is not None:
        try:
            return {"script": orjson.loads(args.script.read_bytes())}
        except OSError as e:
            raise CliError(f"--script: cannot read {args.script}: {e.strerror}") from None
        except orjson.JSONDecodeError as e:
            raise CliError(f"--script: {args.script} is not valid JSON ({e})") from None
    if args.config is not None:
        try:
            config = orjson.loads(args.config)
        except orjson.JSONDecodeError as e:
            raise CliError(f"--config: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CliError("--config: expected a JSON object")
        return config
    return {}


def _policy(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `--policy` block, checked: a malformed one names the offending rule."""
    if args.policy is None:
        if args.permissions == "guarded":
            raise CliError("--policy: POLICY_MISSING: --permissions guarded needs a policy block")
        return None
    if args.permissions != "guarded":
        raise CliError(
            f"--policy: only --permissions guarded takes a policy, not {args.permissions}"
        )
    raw: bytes | str = args.policy
    if not args.policy.lstrip().startswith("{"):
        try:
            raw = Path(args.policy).read_bytes()
        except OSError as e:
            raise CliError(f"--policy: cannot read {args.policy}: {e.strerror}") from None
    try:
        block = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise CliError(f"--policy: not valid JSON ({e})") from None
    validate_policy(block)
    checked: dict[str, Any] = block
    return checked


def _thread_id(args: argparse.Namespace) -> str:
    from broker.keys import check_thread_id

    return check_thread_id(args.thread, "THREAD")


async def _thread_new(b: Broker, args: argparse.Namespace) -> None:
    config = _config(args)
    policy = _policy(args)
    harness = default_harnesses().get(args.harness)
    if harness is None:
        have = ", ".join(sorted(default_harnesses()))
        raise CliError(f"--harness: {args.harness} is not installed here (have: {have})")
    validate = getattr(sys.modules[type(harness).__module__], "validate_config", None)
    if validate is not None:
        validate(config)
    try:
        session = await b.sessions.create(
            args.thread, args.harness, args.permissions, config, args.work_folder, policy=policy
        )
    except BadItem as e:
        raise BadItem("THREAD" if e.field == "thread_id" else e.field, e.problem) from None
    print(f"thread {session.thread_id}: {session.harness} agent, {session.permissions}")
    if args.message:
        await b.post_item(args.thread, {"content": [{"type": "text", "text": args.message}]})
        print("message posted: a replica will pick it up")


async def _session(b: Broker, thread_id: str) -> Session:
    """The thread's session; an unknown thread, or one with no session, is an error."""
    try:
        found = await b.sessions.get(thread_id)
    except (KeyError, ValueError, ValidationError) as e:
        raise CliError(
            f"THREAD: the session record of thread {thread_id} is damaged ({e})"
        ) from None
    if found is not None:
        return found
    if not await b.thread_exists(thread_id):
        raise ThreadNotFound(thread_id)
    raise CliError(f"THREAD: thread {thread_id} has items but no agent session")


async def _thread_close(b: Broker, args: argparse.Namespace) -> None:
    thread_id = _thread_id(args)
    # Checked first: closing an unknown thread must write nothing (no partial record).
    session = await _session(b, thread_id)
    if session.status == "closed":
        print(f"thread {thread_id} was already closed")
        return
    await b.sessions.close(thread_id, args.reason)
    print(f"thread {thread_id} closed")


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _status_lines(session: Session, active: str | None) -> list[str]:
    """`thread status` for people: one fact a line."""
    s = session
    holder = (
        f"{s.owner} (lease until {_when(s.lease_until)})"
        if s.owner
        else "no replica (the next adoption sweep gives it one)"
        if s.status != "closed"
        else "no replica (closed)"
    )
    waiting = f"{s.waiting.prompt_id} ({s.waiting.kind})" if s.waiting else "nothing"
    lines = [
        f"thread {s.thread_id}: {s.harness} agent, {s.permissions}, {s.status}",
        f"  held by:       {holder}",
        f"  epoch:         {s.epoch}",
        f"  waiting on:    {waiting}",
        f"  active prompt: {active or 'none'}",
        f"  created:       {_when(s.created_at)}",
    ]
    if s.work_folder:
        lines.append(f"  work folder:   {s.work_folder}")
    if s.grant is not None:
        lines.append(f"  grant:         {s.grant.subject} (by {s.grant.granted_by}, unspent)")
    if s.error:
        lines.append(f"  error:         {s.error}")
    return lines


async def _thread_status(b: Broker, args: argparse.Namespace) -> None:
    thread_id = _thread_id(args)
    session = await _session(b, thread_id)
    if args.json:
        document = session.model_dump(mode="json", exclude={"grant_raw"})
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
        return
    active = await b.active_prompt(thread_id)
    shown = f"{active.prompt_id} ({active.kind}, {active.state})" if active else None
    print("\n".join(_status_lines(session, shown)))


async def cmd_thread(args: argparse.Namespace, settings: Settings) -> int:
    actions = {"new": _thread_new, "close": _thread_close, "status": _thread_status}
    async with Broker.from_url(settings=settings, socket_connect_timeout=5) as b:
        await actions[args.action](b, args)
    return 0


# -- serve, token ------------------------------------------------------------------------------


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


async def cmd_token(args: argparse.Namespace, settings: Settings) -> int:
    import secrets

    from web.settings import Identity

    token = "pb_" + secrets.token_urlsafe(32)
    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    entry: dict[str, Any] = {"name": args.name, "token": token, "scopes": scopes}
    if args.threads is not None:
        entry["threads"] = args.threads
    try:
        identity = Identity.model_validate(entry)
    except ValidationError as e:
        err = e.errors()[0]
        raise BadItem(str(err["loc"][0]) if err["loc"] else "token", err["msg"]) from None
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
        hooks = Dispatcher(b.redis, b.keys, subscriptions)
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


# -- status, health (ops) ----------------------------------------------------------------------


def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


async def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from workers.runtime.ops_status import fleet_status, render

    async with Broker.from_url(settings=settings, socket_connect_timeout=5) as b:
        found = await fleet_status(b.redis, b.keys, int(settings.lease_ttl * 1000))
    print(render(found, as_json=args.json))
    return 0


def _health_args(parser: argparse.ArgumentParser) -> None:
    from workers.runtime.health import DEFAULT_PORT

    parser.add_argument(
        "process",
        choices=["worker", "audit", "serve"],
        help="the process to probe (worker and audit: their ops endpoint; serve: its own port)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"its port (default: PROMPT_BROKER_OPS_PORT, else {DEFAULT_PORT}; serve: "
        "PROMPT_BROKER_API_PORT, else 8420)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="its address (default: 127.0.0.1)")
    parser.add_argument("--live", action="store_true", help="liveness only, not readiness")


def _health_port(args: argparse.Namespace) -> int:
    from workers.runtime.health import DEFAULT_PORT, ops_port

    if args.port is not None:
        return int(args.port)
    if args.process == "serve":
        from web.settings import ApiSettings

        return ApiSettings.from_env().port
    return ops_port() or DEFAULT_PORT


async def cmd_health(args: argparse.Namespace, settings: Settings) -> int:
    from workers.runtime.health import probe

    live = "/healthz" if args.process == "serve" else "/livez"
    status, body = await probe(_health_port(args), live if args.live else "/readyz", args.host)
    if status == 200:
        print(f"{args.process}: {body}")
        return 0
    what = "live" if args.live else "ready"
    print(f"{_me()}: {args.process} not {what}: {body or status}", file=sys.stderr)
    return 1


#: What a fleet's own processes are handed (PROMPT_BROKER_REDIS_URL): they never look around.
_HANDED = "the Redis server (default: PROMPT_BROKER_REDIS_URL, else redis://127.0.0.1:6379/0)"

RUNTIME: dict[str, Command] = {
    "worker": Command(
        "run one replica until SIGTERM/SIGINT",
        _worker_args,
        cmd_worker,
        0,
        finds_fleet=False,
        redis_help=_HANDED,
    ),
    "audit": Command(
        "run the audit worker (arq)",
        _parent_arg,
        cmd_audit,
        0,
        finds_fleet=False,
        redis_help=_HANDED,
    ),
    "up": Command(
        "run a local fleet: replicas and the audit worker",
        _up_args,
        cmd_up,
        0,
        finds_fleet=False,
        redis_help=UP_REDIS,
    ),
    "demo": Command(
        "a self-driving scenario on a throwaway local fleet",
        _demo_args,
        cmd_demo,
        finds_fleet=False,
        redis_help=DEMO_REDIS,
    ),
    "thread": Command("create, close or inspect a thread", _thread_args, cmd_thread),
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
    "status": Command(
        "print the fleet: replicas, waits, prompts, audit backlog", _status_args, cmd_status
    ),
    "health": Command(
        "probe a fleet process's health endpoint (exit 0 when ready)",
        _health_args,
        cmd_health,
        finds_fleet=False,
        redis_help="unused: the probe asks the process, not Redis",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The `prompt-broker` command: the library's commands and the runtime's."""
    return broker_main(argv, {**COMMANDS, **RUNTIME})


if __name__ == "__main__":
    raise SystemExit(main())
