"""`up` and `demo`: a local fleet (N replicas and the audit worker), kept or thrown away.

`up` runs the fleet on its own Redis (its data and address kept in `--data-dir`) unless one is
named, prints how to use it and its status every 10 s, and stops every process it started,
whatever failed. `demo` runs the self-driving scenario (`workers.demo.scenario`) on a throwaway one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from redis import exceptions as redis_errors
from redis.asyncio import Redis

from broker import Broker, BrokerError, Settings
from broker.cli import CliError, Command, data_home, fleet_record
from workers.runtime.cli.common import _explicit_redis, _level, _me
from workers.runtime.fleet import Fleet
from workers.runtime.logs import configure

#: The demos `demo --harness` runs (`workers.demo.scenario.HARNESSES`, imported only when one runs).
DEMO_HARNESSES = ("scripted", "claude_code", "codex")

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
    return status_line(alive, len(holders), waiting)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def status_line(alive: int, threads: int, waiting: int) -> str:
    """`3 processes up, 1 thread, 2 prompts waiting on a person`: what `up` prints now and then."""
    return (
        f"{_count(alive, 'process', 'processes')} up, {_count(threads, 'thread', 'threads')}, "
        f"{_count(waiting, 'prompt', 'prompts')} waiting on a person"
    )


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


#: The local fleet's commands.
COMMANDS: dict[str, Command] = {
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
}
