"""The cost of metrics: lifecycles per second with and without them, in one run.

A lifecycle: a thread gets a message, its replica runs a scripted turn that asks a question, a
person answers as text, the turn ends. Each round runs `--threads` lifecycles at once through
one in-process replica on a private redis-server, and rounds alternate between metrics off and
on (so drift in the machine's load falls on both alike). "On" is everything a fleet process pays:
the harnesses wrapped (turn counters and histograms, the turn-timeout watchdog), the log event
counters, an ops endpoint scraped every 0.5 s, and the fleet sampler reading Redis every 0.5 s
(30x more often than its default).

    .venv/bin/python bench/bench_ops.py --rounds 10 --threads 3
    .venv/bin/python bench/bench_ops.py --deadlines 1000   # deadline accuracy instead
    .venv/bin/python bench/bench_ops.py --timings 1000     # thread timings, real audit workers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis.asyncio import Redis

from bench.private_redis import free_port, private_redis
from broker import Broker, Settings
from workers.runtime import metrics
from workers.runtime.health import probe, serve_ops
from workers.runtime.replica import Replica

TEXT = {"content": [{"type": "text", "text": "go"}]}
ANSWER = {"content": [{"type": "text", "text": "1"}]}


async def _ready() -> str | None:
    return None


async def _scraper(port: int) -> None:
    while True:
        await probe(port, "/metrics")
        await asyncio.sleep(0.5)


def _uncount_logs() -> None:
    """Take the log counters off again, so an "off" round pays nothing for them."""
    import logging

    for name in metrics._COUNTED_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, metrics.LogCounter)]:
            logger.removeFilter(f)
        logger.setLevel(logging.NOTSET)


async def one_round(url: str, n: int, on: bool, index: int) -> float:
    """Lifecycles per second of one round."""
    prefix = f"ops{index}{'m' if on else 'x'}"
    settings = Settings(key_prefix=prefix, lease_ttl=2.0, adopt_interval=0.05, sweep_interval=5.0)
    replica_broker = Broker(Redis.from_url(url, decode_responses=True), settings)
    person = Broker(Redis.from_url(url, decode_responses=True), settings)
    replica = Replica(replica_broker, None, f"bench-{prefix}")
    stack = contextlib.AsyncExitStack()
    if on:
        metrics.instrument(replica.harnesses, 1800)
        metrics.count_logs()
        stack.callback(_uncount_logs)
        port = await stack.enter_async_context(serve_ops(_ready, 0, host="127.0.0.1"))
        sampler = metrics.FleetSampler(person.redis, person.keys, 2000, 0.5)
        await stack.enter_async_context(metrics.sampling(sampler))
        scrape = asyncio.create_task(_scraper(port))
        stack.callback(scrape.cancel)
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    try:
        threads = [f"t{i}" for i in range(n)]
        for t in threads:
            await person.sessions.create(t, "scripted", "approval", {}, work_folder="/w")
        await asyncio.sleep(0.5)  # adopted before the clock starts
        started = time.perf_counter()
        await asyncio.gather(*(person.post_item(t, TEXT) for t in threads))
        answered: set[str] = set()
        while len(answered) < n:
            for p in await person.open_prompts():
                if p.thread_id not in answered and p.state == "pending":
                    await person.post_item(p.thread_id, ANSWER)
                    answered.add(p.thread_id)
            await asyncio.sleep(0.005)
        while True:
            sessions = await asyncio.gather(*(person.sessions.get(t) for t in threads))
            if all(s is not None and s.status == "idle" for s in sessions):
                break
            await asyncio.sleep(0.005)
        return n / (time.perf_counter() - started)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await stack.aclose()
        keys = [k async for k in person.redis.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await person.redis.delete(*keys)
        await replica_broker.aclose()
        await person.aclose()


QUESTION = {"question": "Go?", "options": [{"label": "yes"}, {"label": "no"}]}


async def bench_deadlines(url: str, n: int, deadline: float) -> None:
    """`n` prompts asked over about 2 s with a deadline of `deadline` s, two expirers running
    (as two audit workers would), one of them killed midway: how late each expiry came (its
    record's resolved minus created minus the deadline, both server time), none twice, none lost."""
    from workers.runtime.deadlines import EXPIRED, expiring

    settings = Settings(key_prefix="opsdl")
    asker = Broker(Redis.from_url(url, decode_responses=True), settings)
    expirers = [Broker(Redis.from_url(url, decode_responses=True), settings) for _ in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        first = contextlib.AsyncExitStack()
        await first.enter_async_context(expiring(expirers[0], deadline))
        await stack.enter_async_context(expiring(expirers[1], deadline))
        prompts = []
        for i in range(n):
            prompts.append(await asker.ask(f"d{i}", "ask_user_question", [QUESTION]))
            if i == n // 2:
                await first.aclose()  # one expirer gone midway
            if i % 50 == 0:
                await asyncio.sleep(0.1)
        for _ in range(int(deadline * 5) + 300):  # at most a minute past the deadline
            if not await asker.open_prompts():
                break
            await asyncio.sleep(0.2)
    late = []
    for p in prompts:
        got = await asker.get_prompt(p.thread_id, p.prompt_id)
        assert got is not None and got.state == "cancelled" and got.reason == EXPIRED, got
        assert got.resolved_at is not None
        late.append((got.resolved_at - got.created_at).total_seconds() - deadline)
    events = [f async for f in _cancel_events(asker)]
    late.sort()
    print(
        f"deadlines: {n} prompts, deadline {deadline:g} s, 2 expirers (one stopped midway): "
        f"late p50 {late[n // 2] * 1000:.0f} ms, p99 {late[int(n * 0.99)] * 1000:.0f} ms, "
        f"max {late[-1] * 1000:.0f} ms; cancellations {len(events)} for {n} prompts "
        f"({len(set(events))} distinct)"
    )
    await _drop_prefix(asker.redis, "opsdl")
    for b in (asker, *expirers):
        await b.aclose()


async def _step_floor(asker: Broker) -> list[float]:
    """What one due step and one cancel cost on this server, no waiting: 50 times."""
    from broker import Timing
    from workers.runtime.deadlines import EXPIRED

    floor = []
    for i in range(50):
        p = await asker.ask(f"floor{i}", "ask_user_question", [QUESTION])
        await asker.set_timing(f"floor{i}", Timing(deadline=0.001), prompt_id=p.prompt_id)
        await asyncio.sleep(0.002)
        t0 = time.perf_counter()
        step = await asker.step_timing(f"floor{i}", p.prompt_id)
        await asker.cancel(f"floor{i}", EXPIRED, prompt_id=p.prompt_id)
        floor.append(time.perf_counter() - t0)
        assert step.outcome == "expire"
    await asker.redis.delete(*asker.indexes.due.all_keys())
    return sorted(floor)


async def _timed_events(asker: Broker, created: dict[str, float], remind: float) -> Any:
    """(reminder lateness per prompt, ms; the prompts cancelled, in order)."""
    reminded: dict[str, list[float]] = {}
    cancels: list[str] = []
    for entry_id, fields in await asker.redis.xrange(f"{asker.keys.prefix}:events"):
        prompt_id = fields.get("prompt", "")
        if prompt_id not in created:
            continue
        if fields.get("event") == "prompt.reminder":
            at = int(entry_id.split("-")[0])
            reminded.setdefault(prompt_id, []).append(at - created[prompt_id] - remind * 1000)
        elif fields.get("event") == "prompt.cancelled":
            cancels.append(prompt_id)
    return reminded, cancels


def _audit_process(env: dict[str, str]) -> Any:
    """`prompt-broker audit` as its own process (it runs a timekeeper)."""
    import subprocess

    cli = [sys.executable, "-m", "workers.runtime.cli", "audit"]
    return subprocess.Popen(cli, env=env, stderr=subprocess.DEVNULL)


async def bench_timings(url: str, n: int, remind: float, deadline: float) -> None:
    """`n` prompts on threads whose timing reminds at `remind` s and expires at `deadline` s,
    asked over about 2 s, with two real audit worker processes (each runs a timekeeper), one of
    them killed with SIGKILL midway: how late each reminder and each expiry came (server time),
    none twice, none lost. The floor: one due step taken and one cancel, in this run, by hand."""
    import os
    import signal

    from broker import Timing
    from workers.runtime.deadlines import EXPIRED

    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    env |= {"PROMPT_BROKER_REDIS_URL": url, "PROMPT_BROKER_KEY_PREFIX": "opstm"}
    asker = Broker(Redis.from_url(url, decode_responses=True), Settings(key_prefix="opstm"))
    timing = Timing(remind=(remind,), deadline=deadline)
    floor = await _step_floor(asker)
    procs = [_audit_process(env) for _ in range(2)]
    try:
        await asyncio.sleep(2.0)  # both started (imports, connections)
        prompts = []
        for i in range(n):
            await asker.post_item(
                f"m{i}", {"author": "a", "content": [{"type": "text", "text": "hi"}]}
            )
            await asker.set_timing(f"m{i}", timing)
            prompts.append(await asker.ask(f"m{i}", "ask_user_question", [QUESTION]))
            if i == n // 2:
                procs[0].send_signal(signal.SIGKILL)  # one timekeeper gone midway
            if i % 50 == 0:
                await asyncio.sleep(0.1)
        for _ in range(int(deadline * 5) + 300):
            if not await asker.open_prompts():
                break
            await asyncio.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(15)
    created = {p.prompt_id: p.created_at.timestamp() * 1000 for p in prompts}
    reminded, cancels = await _timed_events(asker, created, remind)
    late = []
    for p in prompts:
        got = await asker.get_prompt(p.thread_id, p.prompt_id)
        assert got.state == "cancelled" and got.reason == EXPIRED and got.resolved_at, got
        late.append((got.resolved_at - got.created_at).total_seconds() - deadline)
    late.sort()
    rem = sorted(v[0] for v in reminded.values())
    print(
        f"timings: {n} prompts (remind {remind:g} s, deadline {deadline:g} s), 2 audit workers, "
        f"one killed with SIGKILL midway:\n"
        f"  expiry late p50 {late[n // 2] * 1000:.0f} ms, p99 {late[int(n * 0.99)] * 1000:.0f} ms, "
        f"max {late[-1] * 1000:.0f} ms; cancellations {len(cancels)} for {n} prompts "
        f"({len(set(cancels))} distinct)\n"
        f"  reminder late p50 {rem[len(rem) // 2]:.0f} ms, p99 {rem[int(len(rem) * 0.99)]:.0f} ms; "
        f"{len(rem)} of {n} prompts reminded, {sum(len(v) > 1 for v in reminded.values())} twice\n"
        f"  floor (one step and one cancel, no waiting): p50 {floor[25] * 1000:.2f} ms; the "
        f"timekeeper looks every 250 ms"
    )
    await _drop_prefix(asker.redis, "opstm")
    await asker.aclose()


async def _drop_prefix(redis: Any, prefix: str) -> None:
    """Delete this bench's keys (its prefix only), in batches."""
    keys = [k async for k in redis.scan_iter(match=f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 500):
        await redis.delete(*keys[i : i + 500])


async def _cancel_events(b: Broker) -> Any:
    for _, fields in await b.redis.xrange("opsdl:events"):
        if fields.get("event") == "prompt.cancelled":
            yield fields["prompt"]


async def main(args: argparse.Namespace) -> None:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("needs redis-server on PATH")
    with private_redis(exe, free_port()) as url:
        if args.deadlines:
            await bench_deadlines(url, args.deadlines, 2.0)
            return
        if args.timings:
            await bench_timings(url, args.timings, 1.0, 3.0)
            return
        results: dict[bool, list[float]] = {False: [], True: []}
        await one_round(url, args.threads, False, 99)  # warm-up (imports, script cache): unscored
        for i in range(args.rounds * 2):
            on = i % 2 == 1
            rate = await one_round(url, args.threads, on, i)
            results[on].append(rate)
            print(f"round {i + 1}: metrics {'on ' if on else 'off'} {rate:7.1f} lifecycles/s")
        off, on_ = statistics.median(results[False]), statistics.median(results[True])
        print(
            f"median of {args.rounds} rounds each, {args.threads} lifecycles a round: "
            f"off {off:.1f}/s, on {on_:.1f}/s ({(on_ - off) / off * 100:+.1f}%)"
        )


def _args(argv: Any = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each (default 6)")
    parser.add_argument(
        "--threads",
        type=int,
        default=3,
        help="lifecycles a round, at once (default 3)",
    )
    parser.add_argument(
        "--deadlines", type=int, default=0, metavar="N", help="measure N prompt deadlines instead"
    )
    parser.add_argument(
        "--timings",
        type=int,
        default=0,
        metavar="N",
        help="measure N thread timings (a reminder and a deadline) with real audit workers",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(_args()))
