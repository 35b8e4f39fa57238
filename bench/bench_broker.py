"""Benchmark the broker's hot path: wake latency, client round trips, memory per open prompt.

Each figure is printed beside a floor measured in the same run on the same server:

1. wake latency (post_item -> wait() returns) beside redis-py's own PUBLISH -> receive latency;
2. client round trips per ask -> post_item -> wait lifecycle, counted on the client side;
3. server memory per open prompt beside the size of the pending_prompt item body itself.

Everything runs against a private `redis-server` started here on a free port (no persistence) and
stopped by its pid at the end, so no other user's traffic or keys pollute the figures. The
script exits 0 whether or not a target is met: it reports, CI only smoke-runs it (`--quick`).

    .venv/bin/python bench/bench_broker.py            # the issue's counts
    .venv/bin/python bench/bench_broker.py --quick    # well under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import math
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import redis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.utils import HIREDIS_AVAILABLE

from broker import Broker, Keys, Question, Settings
from broker._codec import pending_body

T = TypeVar("T")

#: The typical prompt: a Claude Code approval, as the adapters build it (reference-behaviour 1.1).
QUESTION = Question.model_validate(
    {
        "question": "Allow Claude to use `Bash`?\n\n`rm -rf build`",
        "header": "permission",
        "options": [
            {"label": "Approve", "description": "allow this Bash call"},
            {"label": "Deny", "description": "reject this call"},
        ],
        "subject": "Bash",
        "grant_key": "Bash:rm -rf build",
    }
)
#: The person's reply, as a surface posts it.
ANSWER = {"content": [{"type": "text", "text": "yes"}]}

WAKE_TARGET_RATIO = 2.0
ROUND_TRIP_TARGET = 4
MEMORY_TARGET_BYTES = 1536


# -- a private redis-server ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def private_redis(exe: str, port: int) -> Iterator[str]:
    """Start our own redis-server (no RDB, no AOF), yield its URL, stop it by its pid."""
    with tempfile.TemporaryDirectory(prefix="bench-broker-") as tmp:
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(port, proc)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            if redis.Redis(port=port, socket_timeout=0.5).ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")


def _client(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=True)


def _broker(url: str, prefix: str) -> Broker:
    return Broker(_client(url), Settings(key_prefix=prefix), owns_client=True)


# -- small helpers -------------------------------------------------------------------------------


def pct(samples: list[float], p: float) -> float:
    """The nearest-rank percentile `p` (0-100) of `samples`."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.0f} us"


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def _wake_message(answer_label: str) -> bytes:
    """The bell route.lua rings for an answered approval (same shape, same size)."""
    return orjson.dumps(
        {"prompt_id": "prm_" + "0" * 26, "state": "answered",
         "answers": [{"question": QUESTION.question, "answer": [answer_label]}]}
    )


# -- 1. wake latency -----------------------------------------------------------------------------


@dataclass
class WakeSamples:
    floor: list[float] = field(default_factory=list)  # PUBLISH -> the subscriber has it
    ping: list[float] = field(default_factory=list)  # one plain round trip, for context
    wake: list[float] = field(default_factory=list)  # post_item called -> wait() returned
    posted: list[float] = field(default_factory=list)  # post_item called -> post_item returned
    heard: list[float] = field(default_factory=list)  # post_item called -> the waiter heard it


class Floor:
    """redis-py's own pub/sub, read the way the broker's waiter reads: a reader task calling
    get_message with a timeout, handing each message (JSON-decoded) to a future."""

    def __init__(self, url: str, channel: str) -> None:
        self.sub, self.pub, self.channel = _client(url), _client(url), channel
        self.pubsub = self.sub.pubsub()
        self.future: asyncio.Future[float] | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.pubsub.subscribe(self.channel)
        while (await self.pubsub.get_message(timeout=5.0)) is None:
            pass  # the subscribe confirmation
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=15.0)
            if msg is not None and self.future is not None and not self.future.done():
                orjson.loads(msg["data"])
                self.future.set_result(time.perf_counter())

    async def sample(self, payload: bytes) -> float:
        self.future = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        await self.pub.publish(self.channel, payload)
        return await self.future - t0

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.pubsub.aclose()
        await self.sub.aclose()
        await self.pub.aclose()


class WakeBench:
    """Sequential lifecycles: ask, start wait(), settle, then time post_item -> wait() returns."""

    def __init__(self, url: str, prefix: str, settle: float) -> None:
        self.asker, self.surface = _broker(url, prefix), _broker(url, prefix)
        self.settle = settle
        self.heard: dict[str, float] = {}
        # Note when the asker's waiter hears each bell (an instance patch, for the breakdown).
        waiter = self.asker._waiter
        resolve = waiter._resolve

        def noting_resolve(wake: dict[str, Any]) -> None:
            self.heard.setdefault(wake.get("prompt_id", ""), time.perf_counter())
            resolve(wake)

        waiter._resolve = noting_resolve  # type: ignore[method-assign]

    async def _timed_wait(self, thread: str, prompt_id: str) -> float:
        await self.asker.wait(thread, prompt_id, timeout=10)
        return time.perf_counter()

    async def sample(self, thread: str, out: WakeSamples | None) -> None:
        prompt = await self.asker.ask(thread, "approval", [QUESTION])
        waiting = asyncio.create_task(self._timed_wait(thread, prompt.prompt_id))
        await asyncio.sleep(self.settle)
        if prompt.prompt_id not in self.asker._waiter._waits:
            raise RuntimeError("wait() had not started before the post: raise --settle-ms")
        t0 = time.perf_counter()
        routed = await self.surface.post_item(thread, ANSWER)
        t1 = time.perf_counter()
        t2 = await waiting
        if routed.outcome != "answered":
            raise RuntimeError(f"the answer was {routed.outcome}, not answered")
        if out is not None:
            out.posted.append(t1 - t0)
            out.heard.append(self.heard.pop(prompt.prompt_id) - t0)
            out.wake.append(t2 - t0)

    async def aclose(self) -> None:
        await self.asker.aclose()
        await self.surface.aclose()


async def bench_wake(url: str, n: int, settle: float) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    payload = _wake_message("Approve")
    bench, floor, ping = WakeBench(url, prefix, settle), Floor(url, f"{prefix}:floor"), _client(url)
    await floor.start()
    samples = WakeSamples()
    try:
        warmup = max(20, n // 20)
        for i in range(-warmup, n):
            # Interleaved, so drift on the machine hits the figure and its floor alike.
            keep = samples if i >= 0 else None
            await bench.sample(f"wake-{i + warmup:06d}", keep)
            floor_s = await floor.sample(payload)
            t0 = time.perf_counter()
            await ping.ping()
            ping_s = time.perf_counter() - t0
            if keep is not None:
                keep.floor.append(floor_s)
                keep.ping.append(ping_s)
    finally:
        await bench.aclose()
        await floor.aclose()
        await ping.aclose()
    print_wake(samples, n, len(payload))


def print_wake(s: WakeSamples, n: int, size: int) -> None:
    print(f"\n1. Wake latency: post_item (surface) -> wait() returns (asker)   N={n} sequential "
          "lifecycles, one fresh thread each")
    print(f"   {'':44} {'p50':>11} {'p99':>11}")
    rows = [
        (f"floor: redis-py PUBLISH -> receive ({size} B)", s.floor),
        ("wake:  post_item called -> wait() returned", s.wake),
    ]
    for label, xs in rows:
        print(f"   {label:44} {us(pct(xs, 50))}  {us(pct(xs, 99))}")
    r50 = pct(s.wake, 50) / pct(s.floor, 50)
    r99 = pct(s.wake, 99) / pct(s.floor, 99)
    print(f"   {'ratio wake / floor':44} {r50:10.2f}x  {r99:10.2f}x   "
          f"target p50 <= {WAKE_TARGET_RATIO:.0f}x floor: {verdict(r50 <= WAKE_TARGET_RATIO)}")
    print("   where the wake's time goes (from post_item called):")
    for label, xs in [
        ("  one PING round trip (context)", s.ping),
        ("  post_item returned (route.lua, 1 RT)", s.posted),
        ("  the waiter heard the bell", s.heard),
        ("  wait() returned (after deliver pipeline)", s.wake),
    ]:
        print(f"   {label:44} {us(pct(xs, 50))}  {us(pct(xs, 99))}")
    deliver = [w - h for w, h in zip(s.wake, s.heard, strict=True)]
    print(f"   {'  heard -> returned (deliver mark + enqueue)':44} {us(pct(deliver, 50))}  "
          f"{us(pct(deliver, 99))}")


# -- 2. round trips ------------------------------------------------------------------------------

_STEP: contextvars.ContextVar[str] = contextvars.ContextVar("bench_step", default="other")
_IN_SEND: contextvars.ContextVar[bool] = contextvars.ContextVar("bench_in_send", default=False)
_WAITER_TASK = "prompt-broker waiter"


def parse_commands(packed: bytes | str | Iterable[bytes | memoryview]) -> list[list[bytes]]:
    """The commands in one RESP write (several when it is a pipeline)."""
    if isinstance(packed, str):
        packed = packed.encode()
    buf = packed if isinstance(packed, bytes) else b"".join(packed)
    commands, i = [], 0
    while i < len(buf):
        end = buf.index(b"\r\n", i)
        n, i, args = int(buf[i + 1 : end]), end + 2, []
        for _ in range(n):
            end = buf.index(b"\r\n", i)
            size, i = int(buf[i + 1 : end]), end + 2
            args.append(buf[i : i + size])
            i += size + 2
        commands.append(args)
    return commands


@dataclass
class Send:
    step: str
    commands: list[str]
    setup: bool  # written while opening a connection (handshake), not by the caller


class RoundTripCounter:
    """Counts `Connection.send_packed_command` calls: one call is one request written and one
    wait for its replies (a pipeline writes all its commands in one call)."""

    def __init__(self, script_names: dict[str, str]) -> None:
        self.script_names = script_names  # sha -> script name
        self.sends: list[Send] = []
        self.counting = False
        self._original: Callable[..., Awaitable[None]] | None = None

    def install(self) -> None:
        original = self._original = Connection.send_packed_command
        counter = self

        async def send_packed_command(
            conn: Connection, command: Any, check_health: bool = True
        ) -> None:
            nested = _IN_SEND.get()
            if counter.counting:
                counter._note(command, nested)
            token = _IN_SEND.set(True)
            try:
                await original(conn, command, check_health)
            finally:
                _IN_SEND.reset(token)

        Connection.send_packed_command = send_packed_command  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._original is not None:
            Connection.send_packed_command = self._original  # type: ignore[method-assign]

    def _note(self, command: Any, nested: bool) -> None:
        task = asyncio.current_task()
        step = "waiter reader" if task and task.get_name() == _WAITER_TASK else _STEP.get()
        names = []
        for args in parse_commands(command):
            name = args[0].decode().upper()
            if name == "EVALSHA":
                name += " " + self.script_names.get(args[1].decode(), "?")
            names.append(name)
        self.sends.append(Send(step, names, nested))

    @contextlib.contextmanager
    def counting_sends(self) -> Iterator[list[Send]]:
        self.sends, self.counting = [], True
        try:
            yield self.sends
        finally:
            self.counting = False


async def in_step(step: str, aw: Awaitable[T]) -> T:
    token = _STEP.set(step)
    try:
        return await aw
    finally:
        _STEP.reset(token)


async def lifecycle(asker: Broker, surface: Broker, thread: str, settle: float) -> str:
    """ask -> wait() started -> post_item -> wait() returns; the prompt id."""
    prompt = await in_step("ask", asker.ask(thread, "approval", [QUESTION]))
    waiting = asyncio.create_task(
        in_step("wait", asker.wait(thread, prompt.prompt_id, timeout=10))
    )
    await asyncio.sleep(settle)
    await in_step("post_item", surface.post_item(thread, ANSWER))
    await waiting
    return prompt.prompt_id


def describe(sends: list[Send]) -> str:
    parts = []
    for s in sends:
        text = s.commands[0] if len(s.commands) == 1 else f"pipeline[{', '.join(s.commands)}]"
        parts.append(("(handshake) " if s.setup else "") + text)
    return " | ".join(parts)


def print_sends(title: str, sends: list[Send], steps: list[str], target: int | None) -> int:
    print(f"   {title}")
    total = 0
    for step in [*steps, *sorted({s.step for s in sends} - set(steps))]:
        mine = [s for s in sends if s.step == step]
        calls = [s for s in mine if not s.setup]
        total += len(calls)
        setup = len(mine) - len(calls)
        extra = f" (+{setup} connection-setup writes)" if setup else ""
        print(f"     {step:14} {len(calls):2}{extra:32} {describe(mine) or '-'}")
    goal = f"   target <= {target}: {verdict(total <= target)}" if target is not None else ""
    print(f"     {'total':14} {total:2}{goal}")
    return total


async def bench_round_trips(url: str, settle: float) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    asker, surface = _broker(url, prefix), _broker(url, prefix)
    names = {s.sha: s.name for s in asker._scripts.by_name.values()}
    counter = RoundTripCounter(names)
    counter.install()
    steps = ["ask", "post_item", "wait"]
    print("\n2. Client round trips per lifecycle (ask -> post_item -> wait returns)")
    print("   counted as Connection.send_packed_command calls: one request written, one wait for")
    print("   its replies; a pipeline is one. Steps run as ask; wait() started; post_item.")
    try:
        # Cold: new Brokers (no connections yet) on a server that has not seen the scripts.
        await asker.redis.script_flush()
        with counter.counting_sends() as cold:
            await lifecycle(asker, surface, "rt-cold", settle)
        with counter.counting_sends() as fresh:
            prompt_id = await lifecycle(asker, surface, "rt-thread", settle)
        with counter.counting_sends() as again:
            await lifecycle(asker, surface, "rt-thread", settle)
        with counter.counting_sends() as audit:
            item = await in_step("post_resolution", surface.post_resolution("rt-thread", prompt_id))
        if item is None:
            raise RuntimeError("post_resolution posted nothing for a delivered answer")
    finally:
        counter.uninstall()
        await asker.aclose()
        await surface.aclose()
    print_sends("lifecycle on a fresh thread (warm Brokers: connections open, scripts loaded):",
                fresh, steps, ROUND_TRIP_TARGET)
    print_sends("second lifecycle on the same thread (its wake channel already subscribed):",
                again, steps, ROUND_TRIP_TARGET)
    print_sends("for context, the very first lifecycle of two new Brokers after SCRIPT FLUSH:",
                cold, steps, None)
    print("   background, not in the lifecycle target: the audit job's Broker.post_resolution")
    print_sends("(arq's own dequeue/result bookkeeping around the job is not counted here):",
                audit, ["post_resolution"], None)


# -- 3. memory per open prompt --------------------------------------------------------------------


async def _used_memory(r: Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


async def _settled_memory(r: Redis, clients: int) -> int:
    """used_memory once only `clients` connections remain and the keyspace stopped rehashing."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if int((await r.info("clients"))["connected_clients"]) <= clients:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # serverCron finishes freeing clients and the incremental rehash
    return await _used_memory(r)


async def _ask_many(url: str, prefix: str, count: int, batch: int) -> tuple[float, str, dict[str, int]]:
    """Open `count` prompts, one per thread, `batch` at a time; (seconds, first prompt id,
    what the server held while the asking Broker was still connected)."""
    asker = _broker(url, prefix)
    first = ""
    t0 = time.perf_counter()
    try:
        for start in range(0, count, batch):
            prompts = await asyncio.gather(
                *(asker.ask(f"mem-{i:06d}", "approval", [QUESTION])
                  for i in range(start, min(count, start + batch)))
            )
            first = first or prompts[0].prompt_id
        seconds = time.perf_counter() - t0
        info = await asker.redis.info()
        live = {"used_memory": int(info["used_memory"]),
                "clients": int(info["connected_clients"]),
                "channels": int(info["pubsub_channels"])}
    finally:
        await asker.aclose()
    return seconds, first, live


async def bench_memory(url: str, count: int, batch: int) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    r = _client(url)
    try:
        clients = int((await r.info("clients"))["connected_clients"])
        before = await _settled_memory(r, clients)
        seconds, prompt_id, live = await _ask_many(url, prefix, count, batch)
        after = await _settled_memory(r, clients)
        tk = Keys(prefix).thread("mem-000000")
        keys = {"items stream": tk.items, "prompt hash": tk.prompt(prompt_id),
                "active string": tk.active}
        found = await r.keys(tk.base + "*")
        per_key = {}
        for label, key in keys.items():
            usage = await r.memory_usage(key, samples=0)
            per_key[label] = (int(usage or 0), await r.object("encoding", key))
        open_key = f"{prefix}:open"
        open_bytes = int(await r.memory_usage(open_key, samples=0) or 0)
        open_count = int(await r.zcard(open_key))
        open_encoding = await r.object("encoding", open_key)
        hash_config = await r.config_get("hash-max-listpack-*")
        stream_config = await r.config_get("stream-node-max-*")
    finally:
        await r.aclose()
    floor = len(pending_body(prompt_id, "approval", [QUESTION]))
    per_prompt = (after - before) / count
    print(f"\n3. Memory per open prompt   {count} open approval prompts, one thread each, "
          f"asked {batch} at a time")
    print(f"   asked in {seconds:.1f} s: {count / seconds:,.0f} asks/s "
          "(one Broker, one event loop)")
    print(f"   used_memory before {before:,} B, after {after:,} B (asking Broker closed)")
    print(f"   {'floor: the pending_prompt item body JSON':52} {floor:7,} B")
    print(f"   {'per open prompt: used_memory delta / count':52} {per_prompt:9,.0f} B   "
          f"{per_prompt / floor:.1f}x floor   target <= {MEMORY_TARGET_BYTES} B: "
          f"{verdict(per_prompt <= MEMORY_TARGET_BYTES)}")
    live_per = (live["used_memory"] - before) / count
    print(f"   {'  while the asking Broker was still connected':52} {live_per:9,.0f} B   "
          f"({live['clients']} clients, {live['channels']:,} wake channels subscribed)")
    print(f"   where the bytes go (MEMORY USAGE SAMPLES 0 on thread mem-000000; keys: {len(found)}):")
    attributed = 0.0
    for label, (usage, encoding) in per_key.items():
        attributed += usage
        print(f"     {label:50} {usage:7,} B   encoding {encoding}")
    entry = open_bytes / max(1, open_count)
    attributed += entry
    print(f"     {'global open sorted set, per entry':50} {entry:9,.0f} B   encoding "
          f"{open_encoding}, {open_count:,} entries")
    print(f"     {'sum of the above':50} {attributed:9,.0f} B")
    print(f"     {'not seen by MEMORY USAGE (delta - sum)':50} {per_prompt - attributed:9,.0f} B   "
          "(keyspace table slots, allocator slack)")
    print(f"   server config: {_fmt(hash_config)}, {_fmt(stream_config)}")


def _fmt(config: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(config.items()))


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_broker.py",
        description="Benchmark prompt-broker on a private redis-server: wake latency beside "
        "redis-py's PUBLISH->receive floor, client round trips per ask/answer/wake lifecycle, "
        "and memory per open prompt beside the size of its item body. Exits 0 either way.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smaller counts (200 lifecycles, 10,000 prompts): well under a minute")
    parser.add_argument("--lifecycles", type=int, default=None, metavar="N",
                        help="sequential lifecycles timed for the wake latency (default 2000, "
                        "quick 200)")
    parser.add_argument("--prompts", type=int, default=None, metavar="N",
                        help="open prompts created for the memory figure (default 100000, "
                        "quick 10000)")
    parser.add_argument("--batch", type=int, default=500, metavar="N",
                        help="asks run concurrently while creating them (default 500)")
    parser.add_argument("--settle-ms", type=float, default=2.0, metavar="MS",
                        help="sleep between starting wait() and posting the answer (default 2)")
    parser.add_argument("--redis-server", default=shutil.which("redis-server"), metavar="PATH",
                        help="the redis-server binary to start (default: the one on PATH)")
    parser.add_argument("--port", type=int, default=0,
                        help="port for the private redis-server (default: a free one)")
    parser.add_argument("--only", choices=["wake", "round-trips", "memory"], action="append",
                        help="run only this figure (repeatable; default: all three)")
    args = parser.parse_args(argv)
    args.lifecycles = args.lifecycles or (200 if args.quick else 2000)
    args.prompts = args.prompts or (10_000 if args.quick else 100_000)
    if args.redis_server is None:
        parser.error("redis-server is not on PATH: pass --redis-server")
    if min(args.lifecycles, args.prompts, args.batch) < 1:
        parser.error("counts must be positive")
    return args


async def run(args: argparse.Namespace, url: str) -> None:
    only = set(args.only or ["wake", "round-trips", "memory"])
    settle = args.settle_ms / 1000
    async with _client(url) as r:
        version = (await r.info("server"))["redis_version"]
    print(f"prompt-broker benchmark: private redis-server {version} at {url}; python "
          f"{platform.python_version()}, redis-py {redis.__version__}, hiredis "
          f"{'yes' if HIREDIS_AVAILABLE else 'no'}")
    # Round trips first: its cold lifecycle wants a server that has not loaded the scripts yet.
    if "round-trips" in only:
        await bench_round_trips(url, settle)
    if "wake" in only:
        await bench_wake(url, args.lifecycles, settle)
    if "memory" in only:
        await bench_memory(url, args.prompts, args.batch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with private_redis(args.redis_server, args.port or _free_port()) as url:
        asyncio.run(run(args, url))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
