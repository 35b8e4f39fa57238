"""The command line, with the runtime's commands added to the library's (`broker.cli`).

prompt-broker worker [--id NAME]         one replica, until SIGTERM/SIGINT
prompt-broker audit                      the arq audit worker
prompt-broker up [--workers N]           a local fleet: N replicas + the audit worker
prompt-broker demo [--workers N]         a self-driving scenario on a local fleet
       [--harness scripted|claude_code|codex]   (the real agent CLIs against a fake model)
prompt-broker thread new THREAD [...]    create a thread and its agent session
prompt-broker thread close THREAD        end a thread (its open prompt is cancelled)
prompt-broker thread status THREAD       who holds it, its lease, what it waits on
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from broker import BadItem, Broker, Settings
from broker.cli import COMMANDS, CliError, Command
from broker.cli import main as broker_main
from workers import audit
from workers.fleet import Fleet
from workers.logs import configure
from workers.policy import validate as validate_policy
from workers.replica import default_harnesses
from workers.run import run_replica

__all__ = ["RUNTIME", "main"]

logger = logging.getLogger("workers.cli")


def _level(args: argparse.Namespace) -> int:
    return logging.DEBUG if args.verbose >= 2 else logging.INFO


def _me() -> str:
    """How to run this command again: the console script's path, or `prompt-broker`."""
    argv0 = Path(sys.argv[0])
    return str(argv0) if argv0.name == "prompt-broker" else "prompt-broker"


def _explicit_redis(args: argparse.Namespace) -> bool:
    return args.redis_url is not None or "PROMPT_BROKER_REDIS_URL" in os.environ


# -- worker, audit -------------------------------------------------------------------------


def _worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id", default=None, help="this replica's name (default: host-pid-random)")


async def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    await run_replica(settings, replica_id=args.id)
    return 0


async def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    await audit.serve(settings)
    return 0


# -- up ---------------------------------------------------------------------------------------


def _fleet_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=3, metavar="N", help="replicas (default 3)")
    parser.add_argument(
        "--logs", type=Path, default=None, metavar="DIR", help="write each process's log here"
    )


async def _status(fleet: Fleet, settings: Settings) -> str:
    async with Broker.from_url(fleet.url, settings) as b:
        holders = await b.sessions.holders()
        waiting = len(await b.open_prompts())
    alive = sum(1 for p in fleet.processes if p.proc is not None and p.proc.poll() is None)
    return f"{alive} processes up, {len(holders)} threads, {waiting} prompts waiting on a person"


async def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    if args.workers < 1:
        raise CliError("--workers: at least 1")
    fleet = Fleet(settings, args.workers, log_dir=args.logs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await fleet.start(embedded=not _explicit_redis(args))
    await fleet.ready()
    where = fleet.embedded.kind if fleet.embedded else fleet.url
    print(f"fleet up: {args.workers} replicas and the audit worker on {where}", flush=True)
    me = _me()
    print(f"  try:  export PROMPT_BROKER_REDIS_URL={fleet.url}", flush=True)
    print(f"        {me} thread new t1 --message hello   # its agent asks 'Pick one'", flush=True)
    print(f"        {me} answer t1 2 && {me} show t1", flush=True)
    print("  Ctrl-C stops the fleet (prompts stay open in Redis)", flush=True)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 10)
        except TimeoutError:
            print(f"status: {await _status(fleet, settings)}", flush=True)
    print("stopping: replicas park their waits and release their threads...", flush=True)
    await fleet.stop()
    return 0


def _demo_args(parser: argparse.ArgumentParser) -> None:
    _fleet_args(parser)
    parser.add_argument(
        "--harness",
        default="scripted",
        metavar="HARNESS",
        help="the agents: scripted (default), or a real CLI against a fake model: claude_code "
        "(pip install -e '.[claude]'), codex (npm ci)",
    )


async def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from workers.demo import HARNESSES, run_demo

    if args.harness not in HARNESSES:
        raise CliError(f"--harness: no demo for {args.harness!r} (have: {', '.join(HARNESSES)})")
    if args.harness != "scripted":
        from workers.demo_agents import missing_cli

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
    new.add_argument("--harness", default="scripted", help="the agent harness (default scripted)")
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
        help="the guarded policy block: a JSON file, or the JSON itself (see workers/policy.py)",
    )
    group = new.add_mutually_exclusive_group()
    group.add_argument("--script", type=Path, metavar="FILE", help="a scripted agent's JSON script")
    group.add_argument("--config", metavar="JSON", help="the harness config, as JSON")
    new.add_argument("--work-folder", default="", metavar="DIR", help="the agent's work folder")
    new.add_argument("--message", metavar="TEXT", help="post this first message at once")
    close = sub.add_parser("close", help="end a thread: its open prompt is cancelled")
    close.add_argument("thread", metavar="THREAD")
    close.add_argument("--reason", default="thread_closed")
    status = sub.add_parser("status", help="who holds the thread and what it waits on")
    status.add_argument("thread", metavar="THREAD")


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


async def cmd_thread(args: argparse.Namespace, settings: Settings) -> int:
    async with Broker.from_url(settings=settings, socket_connect_timeout=5) as b:
        if args.action == "new":
            config = _config(args)
            policy = _policy(args)
            harness = default_harnesses().get(args.harness)
            if harness is None:
                have = ", ".join(sorted(default_harnesses()))
                raise CliError(f"--harness: no harness {args.harness!r} (have: {have})")
            validate = getattr(sys.modules[type(harness).__module__], "validate_config", None)
            if validate is not None:
                validate(config)
            session = await b.sessions.create(
                args.thread, args.harness, args.permissions, config, args.work_folder, policy=policy
            )
            print(f"thread {session.thread_id}: {session.harness} agent, {session.permissions}")
            if args.message:
                await b.post_item(
                    args.thread, {"content": [{"type": "text", "text": args.message}]}
                )
                print("message posted: a replica will pick it up")
        elif args.action == "close":
            await b.sessions.close(args.thread, args.reason)
            print(f"thread {args.thread} closed")
        else:
            found = await b.sessions.get(args.thread)
            if found is None:
                raise BadItem("THREAD", f"no thread {args.thread}")
            print(
                orjson.dumps(
                    found.model_dump(mode="json", exclude={"grant_raw"}),
                    option=orjson.OPT_INDENT_2,
                ).decode()
            )
    return 0


RUNTIME: dict[str, Command] = {
    "worker": Command("run one replica until SIGTERM/SIGINT", _worker_args, cmd_worker, 0),
    "audit": Command("run the audit worker (arq)", lambda _p: None, cmd_audit, 0),
    "up": Command("run a local fleet: replicas and the audit worker", _fleet_args, cmd_up, 0),
    "demo": Command("a self-driving scenario on a local fleet", _demo_args, cmd_demo),
    "thread": Command("create, close or inspect a thread", _thread_args, cmd_thread),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The `prompt-broker` command: the library's commands and the runtime's."""
    return broker_main(argv, {**COMMANDS, **RUNTIME})


if __name__ == "__main__":
    raise SystemExit(main())
