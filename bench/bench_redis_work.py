"""Benchmark the Redis work of one lifecycle (ask, text answer, wait returning) beside a floor.

One run, on a private redis-server started here (no persistence) and stopped by its pid:

1. N lifecycles through the real Broker: `ask` -> `post_item` (a text answer) -> `wait`
   returns (its delivery recorded), `--threads` of them at once, in one process;
2. the floor: the same writes as two bare Lua calls, the first adding the prompt's hash, its
   stream entry and the thread's pointer to it, the second resolving the hash, dropping the
   pointer and PUBLISHing the answer to a subscriber that receives it, as many at once (each
   call its own round trip, as a plain redis-py client sends it: the targets' floor);
   and, for reference, the same floor with its calls coalesced into pipelines as the Broker
   sends its own (broker/_batch.py);
3. wake latency beside the PUBLISH -> receive floor (bench_broker.py's `--only wake` figure).

For 1 and 2: the server's CPU per lifecycle (INFO cpu: used_cpu_user + used_cpu_sys deltas),
commands per lifecycle (INFO commandstats calls; a script's own calls count too), throughput,
and the ratios against the floor; then, from a shorter pass with SLOWLOG recording every call,
where the time goes: each top-level command and each script by name, in us per lifecycle.
Exits 0 whether or not a target is met: it reports.

    .venv/bin/python bench/bench_redis_work.py               # 4,000 lifecycles, 50 at once
    .venv/bin/python bench/bench_redis_work.py --quick       # well under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis
from bench_broker import ANSWER, QUESTION, _wake_message, bench_wake, bounded
from private_redis import free_port, private_redis, server_cpu_seconds
from redis.asyncio import Redis

from broker import Broker, Settings
from broker._batch import Coalescer
from broker._codec import pending_body
from broker._scripts import Scripts

CPU_TARGET_RATIO = 2.0  # at most 2x the floor's Redis CPU per lifecycle
THROUGHPUT_TARGET_RATIO = 0.6  # at least 0.6 of the floor's lifecycles/s

#: The floor's first call: the prompt's hash, its stream entry, the thread's pointer to it.
FLOOR_ASK = """
local sid = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'author', ARGV[2],
  'type', 'pending_prompt', 'body', ARGV[3])
redis.call('HSET', KEYS[2], 'kind', 'approval', 'state', 'pending', 'item', ARGV[1], 'sid', sid)
redis.call('SET', KEYS[3], ARGV[4])
return sid
"""
#: The floor's second call: resolve the hash, drop the pointer, ring the bell.
FLOOR_ANSWER = """
redis.call('HSET', KEYS[1], 'state', 'answered', 'answers', ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""


def _client(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=True)


@dataclass
class Stats:
    """The server's counters at one moment."""

    cpu: float  # seconds, user + sys
    calls: Counter[str]
    usec: Counter[str]

    def minus(self, before: Stats) -> Stats:
        return Stats(self.cpu - before.cpu, self.calls - before.calls, self.usec - before.usec)


async def stats(r: Redis) -> Stats:
    cpu = await r.info("cpu")
    cmd = await r.info("commandstats")
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for key, v in cmd.items():
        name = key.removeprefix("cmdstat_")
        if name in ("info", "slowlog", "config"):
            continue  # the bench's own
        calls[name], usec[name] = int(v["calls"]), int(v["usec"])
    return Stats(server_cpu_seconds(cpu), calls, usec)


@dataclass
class Run:
    label: str
    n: int
    seconds: float
    work: Stats
    by_call: list[tuple[str, float]]  # (top-level command or script, us per lifecycle)

    @property
    def cpu_us(self) -> float:
        return self.work.cpu / self.n * 1e6

    @property
    def commands(self) -> float:
        return sum(self.work.calls.values()) / self.n

    @property
    def rate(self) -> float:
        return self.n / self.seconds


#: Runs `n` lifecycles, `threads` at once; returns when every one is done (and recorded).
Driver = Callable[[int, int], Awaitable[None]]


async def measure(  # noqa: PLR0917 - each one a figure of the run
    url: str, drivers: dict[str, Driver], n: int, threads: int, names: dict[str, str], rounds: int
) -> list[Run]:
    """Each driver's `n` lifecycles, in `rounds` interleaved parts (drift on the machine hits
    every figure alike), then a shorter pass each with every call in the SLOWLOG."""
    work = {label: Stats(0.0, Counter(), Counter()) for label in drivers}
    seconds = dict.fromkeys(drivers, 0.0)
    async with _client(url) as r:
        for drive in drivers.values():
            await drive(min(n, 200), threads)  # warm: scripts loaded, channels subscribed
        for k in range(rounds):
            part = n // rounds + (k < n % rounds)
            order = list(drivers.items())
            shift = k % len(order)  # each takes its turn first: whoever runs second is not favoured
            for label, drive in order[shift:] + order[:shift]:
                before = await stats(r)
                t0 = time.perf_counter()
                await drive(part, threads)
                seconds[label] += time.perf_counter() - t0
                w = (await stats(r)).minus(before)
                acc = work[label]
                work[label] = Stats(acc.cpu + w.cpu, acc.calls + w.calls, acc.usec + w.usec)
        sample = max(threads, n // 4)
        spent = {
            label: await _slowlog(r, drive, sample, threads, names)
            for label, drive in drivers.items()
        }
    return [
        Run(
            label,
            n,
            seconds[label],
            work[label],
            [(k, v / sample) for k, v in spent[label].most_common()],
        )
        for label in drivers
    ]


async def _slowlog(
    r: Redis, drive: Driver, sample: int, threads: int, names: dict[str, str]
) -> Counter[str]:
    """us per top-level command (scripts by name) over `sample` lifecycles, from the SLOWLOG."""
    await r.config_set("slowlog-log-slower-than", 0)
    await r.config_set("slowlog-max-len", sample * 20)
    await r.slowlog_reset()
    await drive(sample, threads)
    entries = await r.slowlog_get(sample * 20)
    await r.config_set("slowlog-log-slower-than", -1)
    await r.slowlog_reset()
    spent: Counter[str] = Counter()
    for e in entries:
        command = e["command"]
        words = (
            command.decode(errors="replace") if isinstance(command, bytes) else str(command)
        ).split(" ")
        name = words[0].lower()
        if name in ("slowlog", "config", "info"):
            continue
        if name in ("evalsha", "eval") and len(words) > 1:
            name = f"{name} {names.get(words[1], words[1][:8])}"
        spent[name] += int(e["duration"])
    return spent


# -- the real Broker ---------------------------------------------------------------------------


def broker_driver(b: Broker, prefix: str) -> Driver:
    async def one(thread: str, count: int) -> None:
        for _ in range(count):
            p = await bounded(b.ask(thread, "approval", [QUESTION]), "an ask")
            waiting = asyncio.create_task(b.wait(thread, p.prompt_id, timeout=10))
            await asyncio.sleep(0)
            routed = await bounded(b.post_item(thread, ANSWER), "a post")
            if routed.outcome != "answered":
                raise RuntimeError(f"the answer was {routed.outcome}, not answered")
            await waiting

    async def drive(n: int, threads: int) -> None:
        counts = [n // threads + (i < n % threads) for i in range(threads)]
        await asyncio.gather(*(one(f"{prefix}-{i}", c) for i, c in enumerate(counts) if c))
        await b.settle()  # every delivery recorded

    return drive


# -- the floor ---------------------------------------------------------------------------------


class Floor:
    """Two bare Lua calls per lifecycle, and one subscriber hearing the bell. `coalesced`: the
    calls go through the Broker's coalescer (broker/_batch.py), as the Broker's do (for
    reference: the target's floor is the plain one)."""

    def __init__(self, url: str, prefix: str, threads: int, coalesced: bool = False) -> None:
        self.r, self.sub = _client(url), _client(url)
        self.batch = Coalescer(self.r, Scripts()) if coalesced else None
        self.prefix, self.threads = prefix, threads
        self.pubsub = self.sub.pubsub()
        self.heard: dict[str, asyncio.Future[None]] = {}
        self.task: asyncio.Task[None] | None = None
        self.body = pending_body("prm_" + "0" * 26, "approval", [QUESTION])
        self.answer = _wake_message()

    async def start(self) -> None:
        self.sha_ask = await self.r.script_load(FLOOR_ASK)
        self.sha_answer = await self.r.script_load(FLOOR_ANSWER)
        channels = [self.channel(i) for i in range(self.threads)]
        await self.pubsub.subscribe(*channels)
        confirmed = 0
        while confirmed < len(channels):
            msg = await self.pubsub.get_message(timeout=5.0)
            confirmed += msg is not None and msg["type"] == "subscribe"
        self.task = asyncio.create_task(self._read())

    def channel(self, i: int) -> str:
        return f"{{{self.prefix}-{i}}}:wake"

    async def _read(self) -> None:
        import orjson

        while True:
            msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
            if msg is None:
                continue
            orjson.loads(msg["data"])  # as the waiter does
            fut = self.heard.get(msg["channel"])
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def one(self, i: int, count: int) -> None:
        base, channel = f"{{{self.prefix}-{i}}}:", self.channel(i)
        for _ in range(count):
            prompt_id, item_id = f"prm_{uuid.uuid4().hex}", f"itm_{uuid.uuid4().hex}"
            keys = [base + "items", base + "prompt:" + prompt_id, base + "active"]
            await self.evalsha(self.sha_ask, 3, *keys, item_id, "bench", self.body, prompt_id)
            fut = self.heard[channel] = asyncio.get_running_loop().create_future()
            await self.evalsha(
                self.sha_answer,
                2,
                keys[1],
                keys[2],
                '[{"answer":["Approve"]}]',
                channel,
                self.answer,
            )
            await bounded(fut, "the floor's bell")

    async def evalsha(self, *args: Any) -> Any:
        if self.batch is None:
            return await self.r.evalsha(*args)  # type: ignore[misc]
        (reply,) = await self.batch.submit([(("EVALSHA", *args), {})])
        return reply

    async def drive(self, n: int, threads: int) -> None:
        counts = [n // threads + (i < n % threads) for i in range(threads)]
        await asyncio.gather(*(self.one(i, c) for i, c in enumerate(counts) if c))

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.pubsub.aclose()
        await self.sub.aclose()
        await self.r.aclose()


# -- printing ----------------------------------------------------------------------------------


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def print_runs(real: Run, floor: Run, threads: int, top: int) -> None:
    print(
        f"\n1. Redis work per lifecycle (ask, text answer, wait returning), N={real.n:,}, "
        f"{threads} at once, one process"
    )
    print(f"   {'':38} {'Broker':>12} {'floor':>12} {'ratio':>8}")
    rows = [
        ("Redis CPU per lifecycle (INFO cpu)", real.cpu_us, floor.cpu_us, "us"),
        ("commands per lifecycle", real.commands, floor.commands, ""),
        ("throughput (lifecycles/s)", real.rate, floor.rate, ""),
    ]
    for label, a, b, unit in rows:
        print(f"   {label:38} {a:9,.1f} {unit:2} {b:9,.1f} {unit:2} {a / b:7.2f}x")
    cpu_ratio, rate_ratio = real.cpu_us / floor.cpu_us, real.rate / floor.rate
    print(
        f"   target: CPU <= {CPU_TARGET_RATIO:.0f}x the floor: "
        f"{verdict(cpu_ratio <= CPU_TARGET_RATIO)}; throughput >= {THROUGHPUT_TARGET_RATIO}x: "
        f"{verdict(rate_ratio >= THROUGHPUT_TARGET_RATIO)}"
    )
    for run in (real, floor):
        print(
            f"\n   {run.label}: commandstats per lifecycle (calls, us; "
            "a script's usec holds its own calls')"
        )
        ranked = sorted(run.work.usec, key=lambda k: -run.work.usec[k])
        for name in ranked[:top]:
            c, u = run.work.calls[name] / run.n, run.work.usec[name] / run.n
            print(f"     {name:24} {c:6.2f} calls {u:8.1f} us")
        print(f"   {run.label}: SLOWLOG us per lifecycle (scripts by name; their calls too)")
        for name, u in run.by_call[:top]:
            print(f"     {name:24} {u:8.1f} us")


def print_reference(real: Run, coalesced: Run) -> None:
    """The Broker beside the floor sent as it sends (not a target: what coalescing leaves)."""
    print("\n   for reference, the floor's calls coalesced as the Broker's are (broker/_batch.py):")
    rows = [
        ("Redis CPU per lifecycle (INFO cpu)", real.cpu_us, coalesced.cpu_us, "us"),
        ("throughput (lifecycles/s)", real.rate, coalesced.rate, ""),
    ]
    for label, a, b, unit in rows:
        print(f"   {label:38} {a:9,.1f} {unit:2} {b:9,.1f} {unit:2} {a / b:7.2f}x")


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_redis_work.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="500 lifecycles, 200 for the wake")
    parser.add_argument("--lifecycles", type=int, default=None, metavar="N", help="default 4000")
    parser.add_argument("--threads", type=int, default=50, help="lifecycles at once (default 50)")
    parser.add_argument(
        "--wake",
        type=int,
        default=None,
        metavar="N",
        help="sequential wake samples (default 1000; 0: skip)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="interleaved parts (default 4)")
    parser.add_argument("--top", type=int, default=12, help="rows of each breakdown")
    parser.add_argument("--settle-ms", type=float, default=2.0, help="for the wake figure")
    parser.add_argument("--redis-server", default=shutil.which("redis-server"), metavar="PATH")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--redis-config", action="append", default=[], metavar="'NAME VALUE'")
    args = parser.parse_args(argv)
    args.lifecycles = args.lifecycles or (500 if args.quick else 4000)
    args.wake = (200 if args.quick else 1000) if args.wake is None else args.wake
    if args.redis_server is None:
        parser.error("redis-server is not on PATH: pass --redis-server")
    return args


async def run(args: argparse.Namespace, url: str) -> None:
    async with _client(url) as r:
        version = (await r.info("server"))["redis_version"]
    print(
        f"prompt-broker Redis work: private redis-server {version} at {url}; python "
        f"{platform.python_version()}, redis-py {redis.__version__}"
    )
    names: dict[str, Any] = {s.sha: s.name for s in Scripts().by_name.values()}
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    floor = Floor(url, prefix + "-floor", args.threads)
    coalesced = Floor(url, prefix + "-coalesced", args.threads, coalesced=True)
    await floor.start()
    await coalesced.start()
    names[floor.sha_ask], names[floor.sha_answer] = "floor_ask", "floor_answer"
    try:
        async with Broker.from_url(url, Settings(key_prefix=prefix)) as b:  # as deployed
            drivers = {
                "Broker": broker_driver(b, prefix),
                "floor": floor.drive,
                "floor, coalesced": coalesced.drive,
            }
            real, bare, bare_coalesced = await measure(
                url, drivers, args.lifecycles, args.threads, names, args.rounds
            )
    finally:
        await floor.aclose()
        await coalesced.aclose()
    print_runs(real, bare, args.threads, args.top)
    print_reference(real, bare_coalesced)
    if args.wake:
        await bench_wake(url, args.wake, args.settle_ms / 1000)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with private_redis(args.redis_server, args.port or free_port(), args.redis_config) as url:
        asyncio.run(run(args, url))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
