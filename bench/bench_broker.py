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
import multiprocessing
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import redis
from private_redis import free_port, private_redis, server_cpu_seconds
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.utils import HIREDIS_AVAILABLE

from broker import Broker, Keys, Question, Settings
from broker._codec import pending_body
from broker.keys import ThreadKeys
from workers.runtime.redis_server import RedisServer

if TYPE_CHECKING:
    from tests.conftest import RedisClusterNodes

#: The project's root, for the test suite's cluster helpers (tests/conftest.py).
_ROOT = str(Path(__file__).resolve().parent.parent)

T = TypeVar("T")

#: The typical prompt: a Claude Code approval, as the harnesses build it.
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
#: Agent output already on a thread before it asks (posted as the broker: never an answer).
AGENT_OUTPUT = {
    "author": Settings().identity,
    "content": [{"type": "text", "text": "The build directory is stale; cleaning it first."}],
}

WAKE_TARGET_RATIO = 2.0
SCALING_TARGET = 2.5
ROUND_TRIP_TARGET = 4
MEMORY_TARGET_BYTES = 1536


# -- a private redis-server ----------------------------------------------------------------------


def _client(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=True)


def _broker(url: str, prefix: str, **settings: Any) -> Broker:
    return Broker.from_url(url, Settings(key_prefix=prefix, **settings))


#: No step of a lifecycle should take this long; past it the run stops with an error, not a hang.
STEP_TIMEOUT = 10.0
HANG = "{what} did not finish in {seconds:.0f} s: the Broker is stuck (a bug), or the machine is."


async def bounded(aw: Awaitable[T], what: str, seconds: float = STEP_TIMEOUT) -> T:
    """`aw`, or a RuntimeError naming `what` after `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            return await aw
    except TimeoutError:
        raise RuntimeError(HANG.format(what=what, seconds=seconds)) from None


# -- small helpers -------------------------------------------------------------------------------


def pct(samples: list[float], p: float) -> float:
    """The nearest-rank percentile `p` (0-100) of `samples`."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.0f} us"


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def _wake_message() -> bytes:
    """The bell route.lua rings for an answered approval (same shape, same size)."""
    return orjson.dumps(
        {
            "prompt_id": "prm_" + "0" * 26,
            "state": "answered",
            "answers": [{"question": QUESTION.question, "answer": ["Approve"]}],
        }
    )


# -- one lifecycle -------------------------------------------------------------------------------

#: Posts an answer on a thread (or publishes the floor's message); returns (t0, t1): perf_counter
#: just before the call and just after it returned. CLOCK_MONOTONIC, so comparable across
#: processes on one machine.
Post = Callable[[str], Awaitable[tuple[float, float]]]
Publish = Callable[[str, bytes], Awaitable[tuple[float, float]]]

#: The lifecycle step running now, for the round-trip counter (tasks inherit it).
_STEP: contextvars.ContextVar[str] = contextvars.ContextVar("bench_step", default="other")


async def in_step(step: str, aw: Awaitable[T]) -> T:
    token = _STEP.set(step)
    try:
        return await aw
    finally:
        _STEP.reset(token)


@dataclass
class Lifecycle:
    prompt_id: str
    posting: float  # perf_counter just before post_item was called
    posted: float  # post_item returned
    returned: float  # wait() returned


async def lifecycle(asker: Broker, thread: str, post: Post, settle: float) -> Lifecycle:
    """ask; start wait() and let it settle (subscribed and registered); post the answer; wait()
    returns the answer."""
    prompt = await in_step("ask", bounded(asker.ask(thread, "approval", [QUESTION]), "an ask"))
    waiting = asyncio.create_task(in_step("wait", _timed_wait(asker, thread, prompt.prompt_id)))
    await asyncio.sleep(settle)
    try:
        if prompt.prompt_id not in asker._waiter._waits:
            raise RuntimeError("wait() had not started before the post: raise --settle-ms")
        t0, t1 = await in_step("post_item", post(thread))
    except BaseException:
        waiting.cancel()
        raise
    return Lifecycle(prompt.prompt_id, t0, t1, await waiting)


async def _timed_wait(asker: Broker, thread: str, prompt_id: str) -> float:
    await asker.wait(thread, prompt_id, timeout=STEP_TIMEOUT)
    returned = time.perf_counter()
    # An unfenced wait records the delivery after the hand-over: its round trip is counted
    # with the wait step, not timed in the wake, and done before the next lifecycle starts.
    await asker.settle()
    return returned


# -- 1. wake latency -----------------------------------------------------------------------------


@dataclass
class Samples:
    floor: list[float] = field(default_factory=list)  # PUBLISH called -> the subscriber has it
    wake: list[float] = field(default_factory=list)  # post_item called -> wait() returned
    posted: list[float] = field(default_factory=list)  # post_item called -> post_item returned
    # post_item called -> the waiter had the answer: from the post's reply on one loop
    # (`hand_over`), else from the bell
    heard: list[float] = field(default_factory=list)
    written: list[float] = field(default_factory=list)  # post_item called -> route.lua written
    floor_written: list[float] = field(default_factory=list)  # PUBLISH called -> written


class Floor:
    """redis-py's own pub/sub, read the way the broker's waiter reads: one reader task calling
    get_message with a timeout, JSON-decoding each message and handing it to a future."""

    def __init__(self, url: str, channel: str) -> None:
        self.sub, self.channel = _client(url), channel
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

    async def sample(self, payload: bytes, publish: Publish) -> float:
        self.future = asyncio.get_running_loop().create_future()
        t0, _ = await publish(self.channel, payload)
        return await self.future - t0

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.pubsub.aclose()
        await self.sub.aclose()


class Asker:
    """The asking Broker: ask, start wait(), let it settle, have someone post the answer."""

    def __init__(self, url: str, prefix: str, settle: float) -> None:
        self.broker, self.settle = _broker(url, prefix), settle
        self.heard: dict[str, float] = {}
        # Note when the waiter has each answer, from the bell or (one loop) from the post's reply
        # (an instance patch, only for the breakdown).
        waiter = self.broker._waiter
        resolve = waiter._resolve

        def noting_resolve(wake: dict[str, Any]) -> bool:
            self.heard.setdefault(wake.get("prompt_id", ""), time.perf_counter())
            return resolve(wake)

        waiter._resolve = noting_resolve  # type: ignore[method-assign]

    async def sample(self, thread: str, post: Post, out: Samples | None) -> None:
        run = await lifecycle(self.broker, thread, post, self.settle)
        heard = self.heard.pop(run.prompt_id)
        if out is not None:
            out.posted.append(run.posted - run.posting)
            out.heard.append(heard - run.posting)
            out.wake.append(run.returned - run.posting)


def _note_writes(client: Redis, writes: list[float]) -> None:
    """Every connection `client`'s pool makes from now on appends the time (perf_counter) of
    each write to `writes`: for the breakdown only (when a call's command left the client)."""
    pool: Any = client.connection_pool
    make = pool.make_connection

    def making() -> Any:
        conn = make()
        send = conn.send_packed_command

        async def noting(command: Any, check_health: bool = True) -> None:
            writes.append(time.perf_counter())
            await send(command, check_health)

        conn.send_packed_command = noting
        return conn

    pool.make_connection = making


class LocalSurface:
    """The surface Broker and a plain publisher on this process's event loop. `written`: how
    long after its call the latest post's or publish's command was written (its first write)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.broker, self.pub = _broker(url, prefix), _client(url)
        self._writes: list[float] = []
        _note_writes(self.broker.redis, self._writes)
        _note_writes(self.pub, self._writes)
        self.written = 0.0

    async def post(self, thread: str) -> tuple[float, float]:
        self._writes.clear()
        t0 = time.perf_counter()
        routed = await self.broker.post_item(thread, ANSWER)
        t1 = time.perf_counter()
        self.written = (self._writes or [t1])[0] - t0
        _check_answered(routed.outcome)
        return t0, t1

    async def publish(self, channel: str, payload: bytes) -> tuple[float, float]:
        self._writes.clear()
        t0 = time.perf_counter()
        await self.pub.publish(channel, payload)
        t1 = time.perf_counter()
        self.written = (self._writes or [t1])[0] - t0
        return t0, t1

    async def aclose(self) -> None:
        await self.broker.aclose()
        await self.pub.aclose()


def _check_answered(outcome: str) -> None:
    if outcome != "answered":
        raise RuntimeError(f"the answer was {outcome}, not answered")


def _surface_process(conn: PipeEnd, url: str, prefix: str) -> None:
    """A surface in its own process: posts and publishes on request, replies with (t0, t1,
    written)."""
    asyncio.run(_serve_surface(conn, url, prefix))


async def _serve_surface(conn: PipeEnd, url: str, prefix: str) -> None:
    surface = LocalSurface(url, prefix)
    try:
        while True:
            # Blocking is fine: this process does nothing else while it waits for a request.
            request = conn.recv()
            if request[0] == "post":
                conn.send((*await surface.post(request[1]), surface.written))
            elif request[0] == "publish":
                conn.send((*await surface.publish(request[1], request[2]), surface.written))
            else:
                break
    finally:
        await surface.aclose()


class RemoteSurface:
    """Drives `_surface_process` over a pipe, its replies read through this event loop."""

    def __init__(self, url: str, prefix: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_surface_process, args=(child, url, prefix), daemon=True)
        self.proc.start()
        child.close()
        self.written = 0.0  # as LocalSurface.written, measured in the surface's process

    async def _request(self, *request: Any) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[tuple[float, float, float]] = loop.create_future()
        fd = self.conn.fileno()

        def on_readable() -> None:
            answer = self.conn.recv()
            if not reply.done():
                reply.set_result(answer)

        loop.add_reader(fd, on_readable)
        try:
            self.conn.send(request)
            t0, t1, self.written = await reply
            return t0, t1
        finally:
            loop.remove_reader(fd)

    async def post(self, thread: str) -> tuple[float, float]:
        return await self._request("post", thread)

    async def publish(self, channel: str, payload: bytes) -> tuple[float, float]:
        return await self._request("publish", channel, payload)

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


async def bench_wake(url: str, n: int, settle: float) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    payload = _wake_message()
    asker, floor = Asker(url, prefix, settle), Floor(url, f"{prefix}:floor")
    local, remote, ping = LocalSurface(url, prefix), RemoteSurface(url, prefix), _client(url)
    await floor.start()
    same, apart, pings = Samples(), Samples(), []
    try:
        warmup = max(20, n // 20)
        for i in range(-warmup, n):
            # Interleaved, so drift on the machine hits every figure and its floor alike.
            keep = i >= 0
            for tag, surface, out in (("a", local, same), ("b", remote, apart)):
                thread = f"wake-{tag}-{i + warmup:06d}"
                await asker.sample(thread, surface.post, out if keep else None)
                written = surface.written
                # The same pause before the floor's PUBLISH as before the wake's post (the
                # wait's settling): each starts from an idle Redis and an idle loop alike.
                await asyncio.sleep(settle)
                floor_s = await floor.sample(payload, surface.publish)
                if keep:
                    out.floor.append(floor_s)
                    out.written.append(written)
                    out.floor_written.append(surface.written)
            t0 = time.perf_counter()
            await ping.ping()
            if keep:
                pings.append(time.perf_counter() - t0)
    finally:
        await asker.broker.aclose()
        for closing in (floor, local, remote, ping):
            await closing.aclose()
    print(
        f"\n1. Wake latency: post_item (surface) -> wait() returns (asker)   N={n} sequential "
        "lifecycles each way, one fresh thread each"
    )
    print(
        f"   one PING round trip on the same server, for scale: p50 {us(pct(pings, 50))}, "
        f"p99 {us(pct(pings, 99))}"
    )
    print_wake(
        "a) surface and asker on one event loop (two Brokers, one process):", same, len(payload)
    )
    print_wake(
        "b) surface in its own process (as deployed; floor publisher there too):",
        apart,
        len(payload),
    )


def print_wake(title: str, s: Samples, size: int) -> None:
    print(f"   {title}")
    print(f"     {'':46} {'p50':>11} {'p99':>11}")
    rows = [
        (f"floor: redis-py PUBLISH -> received ({size} B)", s.floor),
        ("wake:  post_item called -> wait() returned", s.wake),
    ]
    for label, xs in rows:
        print(f"     {label:46} {us(pct(xs, 50))}  {us(pct(xs, 99))}")
    r50 = pct(s.wake, 50) / pct(s.floor, 50)
    r99 = pct(s.wake, 99) / pct(s.floor, 99)
    print(
        f"     {'ratio wake / floor':46} {r50:10.2f}x  {r99:10.2f}x   "
        f"target p50 <= {WAKE_TARGET_RATIO:.0f}x: {verdict(r50 <= WAKE_TARGET_RATIO)}"
    )
    deliver = [w - h for w, h in zip(s.wake, s.heard, strict=True)]
    for label, xs in [
        ("  the floor's PUBLISH written (redis-py)", s.floor_written),
        ("  post_item's route.lua written", s.written),
        ("  post_item returned (route.lua, 1 RT)", s.posted),
        ("  the asker's waiter had the answer", s.heard),
        ("  had it -> wait() returned", deliver),
    ]:
        print(f"     {label:46} {us(pct(xs, 50))}  {us(pct(xs, 99))}")


# -- 2. round trips ------------------------------------------------------------------------------

_CONNECTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "bench_connecting", default=False
)
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
        self._originals: tuple[Any, Any] | None = None

    def install(self) -> None:
        send, on_connect = Connection.send_packed_command, Connection.on_connect
        self._originals = send, on_connect
        counter = self

        async def counting_send(conn: Connection, command: Any, check_health: bool = True) -> None:
            if not conn.is_connected:
                await conn.connect()  # as `send` would: its handshake is noted before the command
            if counter.counting:
                counter._note(command, _CONNECTING.get())
            await send(conn, command, check_health)

        async def flagged_on_connect(conn: Connection) -> None:
            # What a new connection writes before its first command (CLIENT SETINFO, ...).
            token = _CONNECTING.set(True)
            try:
                await on_connect(conn)
            finally:
                _CONNECTING.reset(token)

        Connection.send_packed_command = counting_send  # type: ignore[method-assign]
        Connection.on_connect = flagged_on_connect  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._originals is not None:
            send, on_connect = self._originals
            Connection.send_packed_command = send  # type: ignore[method-assign]
            Connection.on_connect = on_connect  # type: ignore[method-assign]

    def _note(self, command: Any, setup: bool) -> None:
        task = asyncio.current_task()
        step = "waiter reader" if task and task.get_name() == _WAITER_TASK else _STEP.get()
        names = []
        for args in parse_commands(command):
            name = args[0].decode().upper()
            if name == "EVALSHA":
                name += " " + self.script_names.get(args[1].decode(), "?")
            names.append(name)
        self.sends.append(Send(step, names, setup))

    @contextlib.contextmanager
    def counting_sends(self) -> Iterator[list[Send]]:
        self.sends, self.counting = [], True
        try:
            yield self.sends
        finally:
            self.counting = False


def describe(sends: list[Send]) -> str:
    parts = []
    for s in sends:
        text = s.commands[0] if len(s.commands) == 1 else f"pipeline[{', '.join(s.commands)}]"
        parts.append(("(handshake) " if s.setup else "") + text)
    return " | ".join(parts)


def print_sends(title: str, sends: list[Send], steps: list[str], target: int | None) -> None:
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


async def bench_round_trips(url: str, settle: float) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    asker, surface = _broker(url, prefix), LocalSurface(url, prefix)
    names = {s.sha: s.name for s in asker._scripts.by_name.values()}
    counter = RoundTripCounter(names)
    counter.install()
    steps = ["ask", "post_item", "wait"]
    print("\n2. Client round trips per lifecycle (ask -> post_item -> wait returns)")
    print("   counted as Connection.send_packed_command calls: one request written, one wait for")
    print("   its replies; a pipeline is one. Steps run as ask; wait() started; post_item.")
    try:
        # Cold: new Brokers (no connections yet) on a server that has not seen the scripts.
        async with _client(url) as r:
            await r.script_flush()
        with counter.counting_sends() as cold:
            run = await lifecycle(asker, "rt-cold", surface.post, settle)
        # Loads audit.lua, uncounted: the audit figure below is the steady state.
        await surface.broker.post_resolution("rt-cold", run.prompt_id)
        with counter.counting_sends() as fresh:
            run = await lifecycle(asker, "rt-thread", surface.post, settle)
        with counter.counting_sends() as again:
            await lifecycle(asker, "rt-thread", surface.post, settle)
        with counter.counting_sends() as audit:
            resolution = surface.broker.post_resolution("rt-thread", run.prompt_id)
            item = await in_step("post_resolution", resolution)
        if item is None:
            raise RuntimeError("post_resolution posted nothing for a delivered answer")
    finally:
        counter.uninstall()
        await asker.aclose()
        await surface.aclose()
    print_sends(
        "lifecycle on a fresh thread (warm Brokers: connections open, scripts loaded):",
        fresh,
        steps,
        ROUND_TRIP_TARGET,
    )
    print_sends(
        "second lifecycle on the same thread (its wake channel already subscribed):",
        again,
        steps,
        ROUND_TRIP_TARGET,
    )
    print_sends(
        "for context, the very first lifecycle of two new Brokers after SCRIPT FLUSH:",
        cold,
        steps,
        None,
    )
    print("   background, not in the lifecycle target: the audit job's Broker.post_resolution")
    print_sends(
        "(arq's own dequeue/result bookkeeping around the job is not counted here):",
        audit,
        ["post_resolution"],
        None,
    )


# -- 3. memory per open prompt --------------------------------------------------------------------


async def _settled_memory(r: Redis, clients: int) -> int:
    """used_memory once only `clients` connections remain and the keyspace stopped rehashing."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if int((await r.info("clients"))["connected_clients"]) <= clients:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # serverCron finishes freeing clients and the incremental rehash
    return int((await r.info("memory"))["used_memory"])


async def in_batches(
    make: Callable[[int], Awaitable[T]], count: int, batch: int
) -> tuple[float, T]:
    """Run make(0..count-1), `batch` at a time; (seconds taken, the first result)."""
    t0 = time.perf_counter()
    first: list[T] = []
    for start in range(0, count, batch):
        batch_done = asyncio.gather(*(make(i) for i in range(start, min(count, start + batch))))
        done = await bounded(batch_done, f"a batch of {batch}", 60)
        first = first or done[:1]
    return time.perf_counter() - t0, first[0]


@dataclass
class OpenPrompts:
    """What opening `count` prompts cost the server."""

    count: int
    before: int  # used_memory, settled, the asking Broker not yet connected
    after: int  # used_memory, settled, the asking Broker closed
    live: int  # used_memory while the asking Broker was still connected
    clients: int  # connected clients then
    channels: int  # wake channels subscribed then
    seconds: float
    prompt_id: str  # the first thread's prompt

    @property
    def per_prompt(self) -> float:
        return (self.after - self.before) / self.count


async def open_prompts(
    url: str, r: Redis, prefix: str, *, name: str, count: int, batch: int
) -> OpenPrompts:
    """Ask one approval on each thread `<name>-000000`.., `batch` at a time, on one Broker."""
    clients = int((await r.info("clients"))["connected_clients"])
    before = await _settled_memory(r, clients)
    asker = _broker(url, prefix)
    try:
        seconds, first = await in_batches(
            lambda i: asker.ask(f"{name}-{i:06d}", "approval", [QUESTION]), count, batch
        )
        info = await r.info()
    finally:
        await asker.aclose()
    after = await _settled_memory(r, clients)
    return OpenPrompts(
        count,
        before,
        after,
        int(info["used_memory"]),
        int(info["connected_clients"]),
        int(info["pubsub_channels"]),
        seconds,
        first.prompt_id,
    )


SCRATCH_ENTRIES = 600


async def stream_entry_cost(r: Redis, items: str, scratch: str) -> float:
    """used_memory per entry of a stream holding SCRATCH_ENTRIES copies of `items`' first entry
    (a pending_prompt): its cost in a long thread, where stream nodes fill up."""
    ((_, fields),) = await r.xrange(items, count=1)
    clients = int((await r.info("clients"))["connected_clients"])
    before = await _settled_memory(r, clients)
    pipe = r.pipeline(transaction=False)
    for _ in range(SCRATCH_ENTRIES):
        pipe.xadd(scratch, fields)
    await pipe.execute()
    after = await _settled_memory(r, clients)
    await r.delete(scratch)
    return (after - before) / SCRATCH_ENTRIES


async def where_the_bytes_go(
    r: Redis, keys: Keys, tk: ThreadKeys, prompt_id: str
) -> tuple[int, list[tuple[str, float, str]]]:
    """How many keys the thread has, and (label, bytes, note) for each key of its prompt."""
    rows: list[tuple[str, float, str]] = []
    for label, key in [
        ("items stream", tk.items),
        ("prompt hash", tk.prompt(prompt_id)),
        ("active string", tk.active),
    ]:
        rows.append((label, await _usage(r, key), await r.object("encoding", key)))
    entries = int(await r.zcard(keys.open))
    rows.append(
        (
            "the global open sorted set, per entry",
            await _usage(r, keys.open) / max(1, entries),
            f"{await r.object('encoding', keys.open)}, {entries:,} entries",
        )
    )
    return len(await r.keys(tk.base + "*")), rows


async def _usage(r: Redis, key: str) -> int:
    return int(await r.memory_usage(key, samples=0) or 0)


async def bench_memory(
    url: str, count: int, batch: int, parked: list[tuple[str, float]] | None = None
) -> None:
    parked = parked or []
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    r = _client(url)
    try:
        fresh = await open_prompts(url, r, prefix, name="new", count=count, batch=batch)
        tk = keys.thread("new-000000")
        found, rows = await where_the_bytes_go(r, keys, tk, fresh.prompt_id)

        # The same again on threads that already hold an item (agent output): what the prompt
        # itself adds, once the thread's stream exists.
        poster = _broker(url, prefix)
        try:
            post_seconds, _ = await in_batches(
                lambda i: poster.post_item(f"old-{i:06d}", AGENT_OUTPUT), count, batch
            )
        finally:
            await poster.aclose()
        old_items = keys.thread("old-000000").items
        stream_before = await _usage(r, old_items)
        existing = await open_prompts(url, r, prefix, name="old", count=count, batch=batch)
        stream_after = await _usage(r, old_items)
        stream_entry = await stream_entry_cost(r, tk.items, f"{prefix}:scratch-stream")
        config = await r.config_get("hash-max-listpack-*")
        config.update(await r.config_get("stream-node-max-*"))
    finally:
        await r.aclose()
    floor = len(pending_body(fresh.prompt_id, "approval", [QUESTION]))
    print(
        f"\n3. Memory per open prompt: {count:,} open approval prompts, asked {batch} at a time "
        "by one Broker"
    )
    print(f"   server: {_fmt(config)}")
    print(f"   {'floor: the pending_prompt item body JSON':54} {floor:7,} B")
    print("   a) each on a new thread (the issue's figure):")
    print(f"     asked in {fresh.seconds:.1f} s: {count / fresh.seconds:,.0f} asks/s")
    _print_open(fresh, floor, judged=True)
    print(
        f"     where the bytes go (MEMORY USAGE SAMPLES 0 on one thread, which has {found} keys):"
    )
    for label, usage, note in rows:
        print(f"       {label:50} {usage:9,.0f} B   {note}")
    attributed = sum(usage for _, usage, _ in rows)
    print(f"       {'sum':50} {attributed:9,.0f} B")
    print(
        f"       {'used_memory delta - sum':50} {fresh.per_prompt - attributed:9,.0f} B   "
        "(keyspace table slots, allocator rounding; MEMORY USAGE is an estimate)"
    )
    print("   b) each on a thread that already holds one item (what the prompt itself adds):")
    print(
        f"     threads made in {post_seconds:.1f} s ({count / post_seconds:,.0f} posts/s), "
        f"asked in {existing.seconds:.1f} s: {count / existing.seconds:,.0f} asks/s"
    )
    _print_open(existing, floor, judged=False)
    print(
        f"       {'items stream of one thread grew':50} {stream_after - stream_before:7,} B   "
        f"({stream_before:,} -> {stream_after:,} B: the entry took preallocated space)"
    )
    print(
        f"       {'+ its pending_prompt entry, amortized':50} {stream_entry:9,.0f} B   "
        f"(used_memory / {SCRATCH_ENTRIES} such entries on one scratch stream)"
    )
    amortized = existing.per_prompt + stream_entry
    _print_per_prompt("per open prompt, its stream entry amortized", amortized, floor, True)
    print_capacity(fresh.per_prompt, amortized, parked)


def print_capacity(new_thread: float, old_thread: float, parked: list[tuple[str, float]]) -> None:
    """What one GiB of Redis holds, from the figures above (and parked sessions measured by
    bench_claude.py / bench_codex.py, passed in with --parked)."""
    gib = 1 << 30
    print("   capacity per GiB of used_memory (from the figures above):")
    rows = [
        ("open prompts, each on a thread of its own", new_thread),
        ("open prompts on threads that already exist", old_thread),
        *((f"parked {label} sessions with their transcripts", b) for label, b in parked),
    ]
    for label, per in rows:
        print(f"     {label:52} {gib / per:12,.0f}   ({per:,.0f} B each)")


def _print_open(o: OpenPrompts, floor: int, *, judged: bool) -> None:
    print(
        f"     used_memory {o.before:,} -> {o.after:,} B (measured with the asking Broker closed)"
    )
    _print_per_prompt("per open prompt: used_memory delta / count", o.per_prompt, floor, judged)
    live = (o.live - o.before) / o.count
    print(
        f"     {'  the same while the asking Broker was connected':52} {live:9,.0f} B   "
        f"({o.clients} clients, {o.channels:,} wake channels subscribed)"
    )


def _print_per_prompt(label: str, value: float, floor: int, judged: bool) -> None:
    goal = f"   target <= {MEMORY_TARGET_BYTES} B: {verdict(value <= MEMORY_TARGET_BYTES)}"
    print(f"     {label:52} {value:9,.0f} B   {value / floor:.1f}x floor{goal if judged else ''}")


def _fmt(config: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(config.items()))


# -- 4. one primary against a cluster of three ------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What every client process of a run drives: where, for how long, under which prefix."""

    url: str
    cluster: bool
    seconds: float
    prefix: str
    queue_url: str = ""  # arq's queue on a redis-server of its own (PROMPT_BROKER_QUEUE_URL)
    threads: int = field(kw_only=True)  # threads each client process drives at once


def _throughput_process(conn: PipeEnd, load: Load, name: str) -> None:
    try:
        conn.send(asyncio.run(_lifecycles_for(conn, load, name)))
    except Exception as e:  # said to the parent, which stops the figure with it
        conn.send(f"{name}: {e!r}")
    finally:
        conn.close()


async def _lifecycles_for(conn: PipeEnd, load: Load, name: str) -> int:
    """Lifecycles (ask, answer, wait returning) done in `load.seconds` from the parent's go,
    `load.threads` at a time, on threads of their own (`name`) under the fleet's prefix."""
    answer = {"content": [{"type": "text", "text": "yes"}]}
    settings = Settings(key_prefix=load.prefix, queue_url=load.queue_url)
    async with Broker.from_url(load.url, settings, cluster=load.cluster) as b:
        await b.redis.ping()  # connected, before the clock starts
        conn.send("ready")
        await asyncio.to_thread(conn.recv)  # go
        done = 0
        deadline = time.monotonic() + load.seconds

        async def one_thread(thread: str) -> None:
            nonlocal done
            while time.monotonic() < deadline:
                p = await b.ask(thread, "approval", [QUESTION])
                waiting = asyncio.create_task(b.wait(thread, p.prompt_id, timeout=STEP_TIMEOUT))
                await asyncio.sleep(0)
                await b.post_item(thread, answer)
                await waiting
                # Only what ended within the time: a lifecycle still in flight at the deadline
                # (each client holds `load.threads`, a second's worth and more on a slow
                # setup) ends after the servers' counts were read, and is not counted either.
                done += time.monotonic() <= deadline

        await asyncio.gather(*(one_thread(f"{name}-{i}") for i in range(load.threads)))
        return done


#: Threads each client process drives at once, one load after another: a setup's capacity is
#: its best lifecycles/s over them (more threads, bigger batches a round trip: three primaries
#: reach their best at a higher load than one does).
LOADS = (20, 50, 100)


def lifecycles_per_second(
    url: str,
    cluster: bool,
    processes: int,
    seconds: float,
    started: Callable[[], None] = lambda: None,
    *,
    queue_url: str = "",
    threads: int,
    ended: Callable[[], None] = lambda: None,
) -> float:
    """Every process drives its threads for `seconds`, all from one go (`started` is called
    just before it, `ended` `seconds` after it), under the default key prefix as one fleet
    would: the aggregate lifecycles/s of the lifecycles that ended within those seconds."""
    ctx = multiprocessing.get_context("spawn")
    # The default prefix (each setup is a fresh server): on a cluster its fixed-slot keys (the
    # event stream, arq's queue) fall where a default deployment's do.
    prefix = Settings().key_prefix
    pipes = []
    for i in range(processes):
        parent, child = ctx.Pipe()
        load = Load(url, cluster, seconds, prefix, queue_url, threads=threads)
        proc = ctx.Process(target=_throughput_process, args=(child, load, f"{prefix}-p{i}"))
        proc.start()
        pipes.append((parent, proc))
    for parent, _ in pipes:
        if (said := parent.recv()) != "ready":
            raise RuntimeError(f"a client process did not start: {said}")
    started()
    go = time.monotonic()
    for parent, _ in pipes:
        parent.send("go")
    time.sleep(max(0.0, go + seconds - time.monotonic()))
    ended()
    total = 0
    for parent, proc in pipes:
        done = parent.recv()
        proc.join(60)
        if not isinstance(done, int):
            raise RuntimeError(f"a client process failed: {done}")
        total += done
    return total / seconds


def _server_counts(port: int) -> tuple[float, int]:
    """A redis-server's CPU time so far, and how many reads of its clients' sockets it has
    processed (each a batch of commands, one or more)."""
    with redis.Redis(port=port) as r:
        cpu, stats = r.info("cpu"), r.info("stats")
    return server_cpu_seconds(cpu), int(stats["total_reads_processed"])


@dataclass
class Shard:
    """One setup of the figure, summed over its rounds: lifecycles, and what its primaries
    (and the queue's own server, when it has one) did meanwhile."""

    label: str
    url: str
    cluster: bool
    primaries: list[int]
    queue: RedisServer | None = None
    threads: int = field(kw_only=True)  # each client process's threads
    lifecycles: int = 0
    seconds: float = 0.0
    cpu: list[float] = field(default_factory=list)  # each primary's CPU seconds
    reads: int = 0  # socket reads the primaries processed
    queue_cpu: float = 0.0
    rates: list[float] = field(default_factory=list)  # each round's lifecycles/s

    @property
    def rate(self) -> float:
        return self.lifecycles / self.seconds

    @property
    def per_lifecycle(self) -> tuple[float, float]:
        """The primaries' CPU seconds and socket reads per lifecycle."""
        done = max(1, self.lifecycles)
        return sum(self.cpu) / done, self.reads / done


def _drive(shard: Shard, processes: int, seconds: float) -> None:
    """One round of `shard`'s setup, added to it."""
    ports = [*shard.primaries, *([shard.queue.port] if shard.queue is not None else [])]
    before: list[tuple[float, int]] = []
    after: list[tuple[float, int]] = []

    def started() -> None:
        before.extend(_server_counts(p) for p in ports)

    def ended() -> None:  # at the deadline: the in-flight lifecycles' ends are not counted
        after.extend(_server_counts(p) for p in ports)

    queue_url = shard.queue.url if shard.queue is not None else ""
    rate = lifecycles_per_second(
        shard.url,
        shard.cluster,
        processes,
        seconds,
        started,
        queue_url=queue_url,
        threads=shard.threads,
        ended=ended,
    )
    spent = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    reads = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    n = len(shard.primaries)
    # The counts were read at the go and `seconds` after it (each server's a moment apart).
    shard.lifecycles += round(rate * seconds)
    shard.seconds += seconds
    shard.cpu = [x + y for x, y in zip(shard.cpu or [0.0] * n, spent[:n], strict=True)]
    shard.reads += sum(reads[:n])
    shard.queue_cpu += sum(spent[n:])
    shard.rates.append(rate)


def _one_shard(root: Path) -> RedisClusterNodes:
    """A Redis Cluster of one primary holding every slot, with one replica: the same shape as
    the test cluster's shards (start_cluster), one of them. redis-cli --cluster create wants
    three primaries at least, so the slots are given and the replica attached by hand."""
    sys.path.insert(0, _ROOT)
    from tests.conftest import start_cluster_nodes

    cluster = start_cluster_nodes(root, 2)
    nodes = cluster.nodes
    try:
        with redis.Redis(port=nodes[0].port) as primary, redis.Redis(port=nodes[1].port) as other:
            primary.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            other.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
            me = primary.execute_command("CLUSTER", "MYID")
            deadline, attached = time.monotonic() + 30, False
            while time.monotonic() < deadline:
                if not attached:  # once only: each REPLICATE starts its sync over
                    with contextlib.suppress(redis.ResponseError):  # not met yet: unknown node
                        attached = other.execute_command("CLUSTER", "REPLICATE", me) == b"OK"
                if (
                    attached
                    and other.info("replication").get("master_link_status") == "up"
                    and all(r.cluster("info")["cluster_state"] == "ok" for r in (primary, other))
                ):
                    return cluster
                time.sleep(0.1)
        raise RuntimeError("the one-shard cluster did not reach cluster_state:ok")
    except BaseException:
        cluster.stop()
        raise


def _primaries(cluster: RedisClusterNodes) -> list[int]:
    ports = []
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as r:
            if r.info("replication")["role"] == "master":
                ports.append(node.port)
    return ports


def bench_cluster(
    exe: str,
    processes: int,
    seconds: float,
    redis_cpu: float | None,
    rounds: int = 3,
    *,
    loads: Sequence[int] = LOADS,
) -> None:
    """Aggregate lifecycles/s from several client processes: one primary, then three.

    The target compares like with like: a cluster of one shard (a primary and its replica)
    against one of three such shards, each with arq's queue in the cluster and then on a
    redis-server of its own (PROMPT_BROKER_QUEUE_URL). One redis-server on its own (the
    default deployment) is printed for reference. With `redis_cpu`, every redis-server (the
    queue's too) is held to that share of one CPU, so the servers, not the machine, are the
    limit. Every setup is driven at each of `loads` (threads per client process), and its
    capacity is its best: the scaling compares capacities. The setups and loads take turns,
    `rounds` times `seconds / rounds` each: a host whose speed drifts (this one's did by a
    fifth within minutes) slows them all alike."""
    from cpu_cap import cpu_capped
    from private_redis import PrivateRedis

    sys.path.insert(0, _ROOT)
    from tests.conftest import start_cluster

    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        root = Path(d)
        servers: list[RedisServer] = []
        for name in ("single", "queue"):
            server = PrivateRedis(exe, free_port(), root / name)
            server.dir.mkdir()
            server.start()
            stack.callback(server.stop)
            servers.append(server)
        single, queue = servers
        clusters = []
        for start in (_one_shard, start_cluster):
            (root / start.__name__).mkdir()
            cluster = start(root / start.__name__)
            stack.callback(cluster.stop)
            clusters.append(cluster)
            servers.extend(cluster.nodes)
        one, three = ((c.url, True, _primaries(c)) for c in clusters)
        one_label = "a cluster of one primary (and its replica):"
        three_label = "a cluster of three primaries (a replica each):"
        by_load = {
            n: [
                Shard(
                    "one redis-server, no replica (reference):",
                    single.url,
                    False,
                    [single.port],
                    threads=n,
                ),
                Shard(one_label, *one, threads=n),
                Shard(three_label, *three, threads=n),
                Shard("  " + one_label, *one, queue, threads=n),
                Shard("  " + three_label, *three, queue, threads=n),
            ]
            for n in loads
        }
        pids = [n.proc.pid for n in servers if n.proc is not None]
        with cpu_capped(pids, redis_cpu) if redis_cpu else contextlib.nullcontext():
            for _ in range(rounds):
                for shards in by_load.values():
                    for shard in shards:
                        _drive(shard, processes, seconds / rounds)
    for shards in by_load.values():
        _print_cluster(shards, processes, seconds, redis_cpu, rounds)
    _print_capacity(by_load)


#: The cluster figure's setups, in the order each load's list of Shards holds them: the lone
#: server, one primary and three with arq's queue in the cluster, then both with the queue on a
#: server of its own.
SETUPS = ("alone", "one", "three", "one_q", "three_q")


def _setups(shards: list[Shard]) -> dict[str, Shard]:
    return dict(zip(SETUPS, shards, strict=True))


def _print_cluster(
    shards: list[Shard], processes: int, seconds: float, redis_cpu: float | None, rounds: int
) -> None:
    from cpu_cap import quota_percent

    alone, one, three, one_q, three_q = _setups(shards).values()
    cap = (
        f"each redis-server held to {quota_percent(redis_cpu):g}% of one CPU (a cgroup quota)"
        if redis_cpu
        else "no CPU cap on the servers"
    )
    print(
        f"\n4. Lifecycles per second, {processes} client processes of {alone.threads} "
        f"threads each, one key prefix (one fleet), {seconds:g} s a setup in {rounds} turns; "
        f"{cap}"
    )
    print(
        f"   {'':48} {'lifecycles/s':>12} {'primary CPU/lifecycle':>22} {'reads/lifecycle':>16}"
        "  each primary busy"
    )
    for shard in shards:
        if shard is one_q:
            print("   arq's queue on a redis-server of its own (PROMPT_BROKER_QUEUE_URL):")
        cpu, reads = shard.per_lifecycle
        busy = " ".join(f"{c / shard.seconds * 100:4.1f}%" for c in shard.cpu)
        if shard.queue is not None:
            busy += f"   queue's server {shard.queue_cpu / shard.seconds * 100:.1f}%"
        print(f"   {shard.label:48} {shard.rate:12,.0f} {cpu * 1e6:19.1f} us {reads:16.2f}  {busy}")
    for where, a, b in (("in the cluster", one, three), ("on its own server", one_q, three_q)):
        turns = [y / x for x, y in zip(a.rates, b.rates, strict=True)]
        print(
            f"   at this load, three primaries / one, arq's queue {where}: {b.rate / a.rate:.2f}x "
            f"(turns {min(turns):.2f}-{max(turns):.2f}x)"
        )
    print(f"   (three primaries against the lone server: {three.rate / alone.rate:.2f}x; the")
    print("   primaries' CPU and reads per lifecycle leave the queue's own server out)")
    print(f"   on {multiprocessing.cpu_count()} CPUs shared by the clients and every server")
    if not redis_cpu:
        print(
            "   (no cap: the servers share the machine's CPUs with the clients, so this shows "
            "what the machine does, not what more primaries give; see --redis-cpu)"
        )


def _print_capacity(by_load: dict[int, list[Shard]]) -> None:
    """Each setup's capacity, its best lifecycles/s over the loads, and the scaling of it."""
    print(
        "\n   capacity: each setup's best lifecycles/s over the loads "
        f"({', '.join(str(n) for n in by_load)} threads per client process)"
    )

    def best(name: str) -> Shard:
        return max((_setups(shards)[name] for shards in by_load.values()), key=lambda s: s.rate)

    for where, one, three in (
        ("in the cluster", "one", "three"),
        ("on its own server", "one_q", "three_q"),
    ):
        a, b = best(one), best(three)
        ratio = b.rate / a.rate
        print(
            f"   arq's queue {where}: one primary {a.rate:,.0f}/s (at {a.threads}), three "
            f"{b.rate:,.0f}/s (at {b.threads}): {ratio:.2f}x   target >= {SCALING_TARGET:g}x: "
            f"{verdict(ratio >= SCALING_TARGET)}"
        )


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_broker.py",
        description="Benchmark prompt-broker on a private redis-server: wake latency beside "
        "redis-py's PUBLISH->receive floor, client round trips per ask/answer/wake lifecycle, "
        "and memory per open prompt beside the size of its item body. Exits 0 either way.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller counts (200 lifecycles, 10,000 prompts): well under a minute",
    )
    parser.add_argument(
        "--lifecycles",
        type=int,
        default=None,
        metavar="N",
        help="sequential lifecycles timed for the wake latency (default 2000, quick 200)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        metavar="N",
        help="open prompts created for the memory figure (default 100000, quick 10000)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=500,
        metavar="N",
        help="asks run concurrently while creating them (default 500)",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=2.0,
        metavar="MS",
        help="sleep between starting wait() and posting the answer (default 2)",
    )
    parser.add_argument(
        "--redis-server",
        default=shutil.which("redis-server"),
        metavar="PATH",
        help="the redis-server binary to start (default: the one on PATH)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="port for the private redis-server (default: a free one)",
    )
    parser.add_argument(
        "--redis-config",
        action="append",
        default=[],
        metavar="'NAME VALUE'",
        help="an extra redis.conf directive for the private server, for what-if runs "
        "(repeatable), e.g. --redis-config 'hash-max-listpack-value 1024'",
    )
    parser.add_argument(
        "--only",
        choices=["wake", "round-trips", "memory", "cluster"],
        action="append",
        help="run only this figure (repeatable; default: all three)",
    )
    parser.add_argument(
        "--processes", type=int, default=4, help="client processes for --only cluster"
    )
    parser.add_argument(
        "--loads",
        default=",".join(str(n) for n in LOADS),
        metavar="N,N",
        help="for --only cluster: threads per client process, each a load every setup is "
        f"driven at; a setup's capacity is its best (default {','.join(map(str, LOADS))})",
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="how long --only cluster drives each setup"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="turns the setups of --only cluster take, each driven --seconds / --rounds a turn",
    )
    parser.add_argument(
        "--redis-cpu",
        type=float,
        default=None,
        metavar="PERCENT",
        help="for --only cluster: hold every redis-server to this share of one CPU (a cgroup "
        "quota; needs a writable cgroup CPU controller), so the servers are the limit, not "
        "the machine's cores shared with the clients",
    )
    parser.add_argument(
        "--parked",
        action="append",
        default=[],
        metavar="LABEL=BYTES",
        help="a parked session's Redis bytes, for the capacity table (repeatable), e.g. "
        "--parked 'Claude Code=14000' from bench_claude.py's figure",
    )
    args = parser.parse_args(argv)
    try:
        args.parked = [(k, float(v)) for k, _, v in (p.rpartition("=") for p in args.parked)]
    except ValueError:
        parser.error("--parked takes LABEL=BYTES")
    try:
        args.loads = tuple(int(n) for n in args.loads.split(","))
    except ValueError:
        parser.error("--loads takes whole numbers separated by commas, e.g. 20,50")
    if min(args.loads) < 1:
        parser.error("--loads must be positive")
    args.lifecycles = args.lifecycles or (200 if args.quick else 2000)
    args.prompts = args.prompts or (10_000 if args.quick else 100_000)
    if args.redis_server is None:
        parser.error("redis-server is not on PATH: pass --redis-server")
    if min(args.lifecycles, args.prompts, args.batch) < 1:
        parser.error("counts must be positive")
    return args


async def run(args: argparse.Namespace, url: str) -> None:
    only = set(args.only or ["wake", "round-trips", "memory"])  # the cluster figure on request
    settle = args.settle_ms / 1000
    async with _client(url) as r:
        version = (await r.info("server"))["redis_version"]
    print(
        f"prompt-broker benchmark: private redis-server {version} at {url}; python "
        f"{platform.python_version()}, redis-py {redis.__version__}, hiredis "
        f"{'yes' if HIREDIS_AVAILABLE else 'no'}" + "".join(f"; {c}" for c in args.redis_config)
    )
    # Round trips first: its cold lifecycle wants a server that has not loaded the scripts yet.
    if "round-trips" in only:
        await bench_round_trips(url, settle)
    if "wake" in only:
        await bench_wake(url, args.lifecycles, settle)
    if "memory" in only:
        await bench_memory(url, args.prompts, args.batch, args.parked)
    if "cluster" in only:
        await asyncio.to_thread(
            bench_cluster,
            args.redis_server,
            args.processes,
            args.seconds,
            args.redis_cpu,
            args.rounds,
            loads=args.loads,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with private_redis(args.redis_server, args.port or free_port(), args.redis_config) as url:
        asyncio.run(run(args, url))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
