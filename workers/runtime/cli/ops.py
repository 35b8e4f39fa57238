"""`status` and `health`: what an operator asks of a running fleet.

`status` reads the fleet from Redis (replicas, threads, waits, prompts, audit backlog); `health`
probes one process's health endpoint, its exit status saying whether it is ready (or live).
"""

from __future__ import annotations

import argparse
import sys

from broker import Broker, Settings
from broker.cli import Command
from workers.runtime.cli.common import _me


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


#: The operator's commands.
COMMANDS: dict[str, Command] = {
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
