"""The pub/sub waiter: one connection per Broker, thread channels on demand, futures per prompt.

Pub/sub is at-most-once: a message published while we reconnect is gone. So the record decides
and the bell only rings: every wait subscribes first, then reads the record, then waits; after
every (re)subscription the reader re-reads every prompt waited on that channel; and a slow sweep
re-reads them all. A message that carries the committed state (the script that commits it
publishes it) resolves the wait with no read at all.

Never deaf: the connection is made and SUBSCRIBE sent by a task of the waiter's own, which a
caller's cancellation (a timeout, a lost turn) cannot interrupt halfway; a PubSub is installed only
once it is connected; any failure of the reader, of whatever kind, is a disconnect (drop the
connection, back off, resubscribe every channel, re-read every wait); and the sweep is a task of
its own, so it re-reads whatever state the reader is in.

On a Redis Cluster the client it takes its PubSub from is broker/_sharded.py's `ShardedBells`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

logger = logging.getLogger("broker.waiter")

__all__ = ["Reader", "Waiter", "Wake", "hand_over", "nothing_received"]

#: A committed resolution: {"prompt_id", "state": "answered"|"cancelled", "answers"|"reason"}.
Wake = dict[str, Any]
#: Reads the records of (thread_id, prompt_id) pairs; returns the resolved ones as Wakes.
Reader = Callable[[list[tuple[str, str]]], Awaitable[dict[str, Wake]]]
#: Called with every message on a thread's channel (for replicas that watch threads).
Listener = Callable[[str, Wake], None]

_EXPECT_MAX = 10_000
_BACKOFF = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
#: Seconds one get_message blocks before the reader looks around again (`read_message`).
_READ_FOR = 5.0


#: The Waiters of this process with a wait on each prompt, with the loop each waits on.
_WAITING: dict[str, list[tuple[asyncio.AbstractEventLoop, Waiter]]] = {}


def hand_over(prompt_id: str, answers: str) -> bool:
    """Give a prompt's committed answers (`answers`: their JSON) to the waits of this process
    on it, on the running loop; True when one was woken.

    For the caller holding the reply of the script that committed them (post_item's
    route.lua), which also rang the bell with the same words: a wait on the same loop then has
    its answer without waiting for the bell, which Redis sends after that reply. The bell, when
    it comes, finds the wait done (`_resolve` ignores a resolved future). Nothing is decoded
    when no wait of this process is on the prompt."""
    waiting = _WAITING.get(prompt_id)
    if not waiting:
        return False
    loop = asyncio.get_running_loop()
    mine = [waiter for on, waiter in waiting if on is loop]
    if not mine:
        return False
    wake: Wake = {"prompt_id": prompt_id, "state": "answered", "answers": orjson.loads(answers)}
    woke = False
    for waiter in mine:
        woke = waiter._resolve(wake) or woke
    return woke


@dataclass
class _Channel:
    thread_id: str
    waits: int = 0  # open waits and listeners holding it subscribed
    requested: bool = False  # SUBSCRIBE sent on the current connection
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    # The waiter-wide count of confirmations at this channel's latest one. Waiter-wide, not per
    # channel: a channel dropped as idle and made again must never repeat a number, or a prompt
    # noted under the old subscription would skip its read under the new one.
    generation: int = 0
    idle_since: float = 0.0


@dataclass
class _Wait:
    thread_id: str
    channel: str
    futures: list[asyncio.Future[Wake]] = field(default_factory=list)


class Waiter:
    """Owns the Broker's pub/sub connection, the reader task and the sweep task."""

    def __init__(self, redis: Redis, read: Reader, sweep_interval: float) -> None:
        self._redis = redis
        self._read = read
        self._sweep_interval = sweep_interval
        self._channels: dict[str, _Channel] = {}
        self._waits: dict[str, _Wait] = {}
        self._listeners: dict[str, list[Listener]] = {}
        self._expected: dict[str, tuple[str, int, Wake | None]] = {}
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None  # the reader
        self._sweeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # subscriptions in flight
        self._changed = asyncio.Event()
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._confirmations = 0
        self.reconnects = 0

    # -- public ----------------------------------------------------------------------------

    async def subscribe(self, channel: str, thread_id: str) -> int:
        """Subscribe to a channel (if needed) and wait for the server's confirmation.

        Returns the channel's confirmation number. Every (re)subscription gives it a new one, so
        a caller that subscribed before something existed and later sees the same number missed
        nothing. Raises Redis's connection errors when the SUBSCRIBE itself could not be sent.
        """
        self._hold(channel, thread_id)  # the sweep drops only channels nobody holds
        try:
            ch = self._channels[channel]
            if not ch.requested:
                try:
                    await self._send_subscribe([channel])
                except (RedisError, OSError):
                    # The connection it went out on was already broken (and is dropped now):
                    # once more, on a new one. Failing again, Redis is unreachable.
                    if not ch.requested:
                        await self._send_subscribe([channel])
            await ch.confirmed.wait()
            return ch.generation
        finally:
            self._release(channel)

    def expect(self, prompt_id: str, channel: str, generation: int) -> None:
        """Note a prompt created while `channel` held confirmation number `generation`.

        Until it is waited on, a resolution heard for it is kept; and if the channel was not
        resubscribed since, its wait needs no read: nothing published can have been missed.
        The oldest notes are dropped past `_EXPECT_MAX`; their waits simply read.
        """
        self._expected[prompt_id] = (channel, generation, None)
        while len(self._expected) > _EXPECT_MAX:
            self._expected.pop(next(iter(self._expected)))

    async def wait(self, thread_id: str, prompt_id: str, channel: str) -> Wake:
        """Wait for a prompt's resolution; cancel the calling task (or time out) to stop."""
        fut: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
        self._waits.setdefault(prompt_id, _Wait(thread_id, channel)).futures.append(fut)
        self._hold(channel, thread_id)
        waiting = _WAITING.setdefault(prompt_id, [])
        entry = (asyncio.get_running_loop(), self)
        waiting.append(entry)
        try:
            generation = await self.subscribe(channel, thread_id)
            _, expected_generation, heard = self._expected.pop(prompt_id, (channel, None, None))
            if heard is not None:
                return heard
            if expected_generation != generation:
                # The bell may have rung before we listened: the record says.
                await self._reread([(thread_id, prompt_id)])
            return await fut
        finally:
            waiting.remove(entry)
            if not waiting and _WAITING.get(prompt_id) is waiting:
                del _WAITING[prompt_id]
            self._forget(prompt_id, fut)
            self._release(channel)

    async def listen_many(self, listeners: list[tuple[str, str, Listener]]) -> None:
        """Call each `listener` with every message on its `(thread_id, channel)` until
        `unlisten`; the new channels are subscribed in one SUBSCRIBE."""
        for thread_id, channel, listener in listeners:
            self._listeners.setdefault(channel, []).append(listener)
            self._hold(channel, thread_id)
        new = [c for _, c, _ in listeners if not self._channels[c].requested]
        if new:
            await self._send_subscribe(new)
        for _, channel, _ in listeners:
            await self._channels[channel].confirmed.wait()

    def unlisten(self, channel: str, listener: Listener) -> None:
        listeners = self._listeners.get(channel, [])
        if listener in listeners:
            listeners.remove(listener)
            self._release(channel)
        if not listeners:
            self._listeners.pop(channel, None)

    def _hold(self, channel: str, thread_id: str) -> None:
        ch = self._channels.get(channel)
        if ch is None:  # made only when new: a _Channel has an Event to make
            ch = self._channels[channel] = _Channel(thread_id)
        ch.waits += 1
        self._start()

    def _release(self, channel: str) -> None:
        ch = self._channels.get(channel)
        if ch is not None:
            ch.waits -= 1
            ch.idle_since = asyncio.get_running_loop().time()

    def _start(self) -> None:
        """Run the reader and the sweep (again, should either ever have ended)."""
        if self._closed:
            return
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run(), "prompt-broker waiter")
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = self._spawn(self._sweep_forever(), "prompt-broker sweep")
        self._changed.set()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        """Retrieve every background task's outcome, so none is left unretrieved in a log."""
        self._background.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, RedisError | OSError):
            logger.error("waiter.task_failed", exc_info=error, extra={"task": task.get_name()})

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in self._waits.values():
            for fut in w.futures:
                if not fut.done():
                    fut.cancel()
        async with self._connect_lock:
            await self._drop_connection_locked()

    # -- connection -------------------------------------------------------------------------

    async def _send_subscribe(self, channels: list[str]) -> None:
        """SUBSCRIBE, in a task of the waiter's own: a caller cancelled while it is in flight
        stops waiting for it, but never leaves a connection half made."""
        task = self._spawn(self._subscribe_now(channels), "prompt-broker subscribe")
        await asyncio.shield(task)

    async def _subscribe_now(self, channels: list[str]) -> None:
        async with self._connect_lock:
            if self._closed:
                raise RedisConnectionError("the waiter is closed")
            ps = self._pubsub
            if ps is None:
                ps = self._redis.pubsub()
                channels = list(self._channels)  # a new connection: everything, again
            for c in channels:
                if c in self._channels:
                    self._channels[c].requested = True
            try:
                if channels:
                    await ps.subscribe(*channels)
                if ps.connection is None:
                    raise RedisConnectionError("the pub/sub connection was not made")
            except BaseException:
                if ps is not self._pubsub:
                    await _close(ps)
                await self._drop_connection_locked()
                raise
            if self._pubsub is None:
                self._pubsub = ps  # installed only once connected
        self._start()

    async def _drop_connection(self, only: PubSub) -> None:
        """Drop the connection if it is still `only` (the one that failed), not a newer one."""
        async with self._connect_lock:
            if self._pubsub is only:
                await self._drop_connection_locked()

    async def _drop_connection_locked(self) -> None:
        ps, self._pubsub = self._pubsub, None
        for ch in self._channels.values():
            ch.confirmed.clear()
            ch.requested = False
        if ps is not None:
            await _close(ps)

    # -- the reader -------------------------------------------------------------------------

    async def _run(self) -> None:
        """Read the bells. Any failure at all is a disconnect: the connection is dropped and
        made again, and every channel resubscribed (each confirmation re-reads its waits)."""
        failures = 0
        while not self._closed:
            ps = self._pubsub
            try:
                if ps is None:
                    if not self._channels:
                        self._changed.clear()
                        await self._changed.wait()
                        continue
                    await self._subscribe_now(list(self._channels))
                    continue
                msg = await read_message(ps)
                while msg is not None:
                    woke = await self._handle(msg)
                    # What was read in already is handed out with no read, no timer: 10,000
                    # confirmations in a row cost a get_message each otherwise.
                    msg = await next_buffered(ps)
                    if msg is None and woke and nothing_received(ps.connection):
                        # A wait was just given its answer and no other bell is in: let it run
                        # before this task reads on (redis-py's next read would come first, on
                        # the wake's path). With more in, they are read first, all in this turn.
                        await asyncio.sleep(0)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = _BACKOFF[min(failures, len(_BACKOFF) - 1)]
                failures += 1
                self.reconnects += 1
                logger.warning("waiter.disconnected", extra={"error": repr(e), "retry_in": delay})
                if ps is not None:
                    await self._drop_connection(ps)
                await asyncio.sleep(delay)

    async def _handle(self, msg: dict[str, Any]) -> bool:
        """True when the message woke a wait."""
        kind, channel = msg["type"], msg["channel"]
        ch = self._channels.get(channel)
        if kind == "subscribe" and ch is not None:
            self._confirmations += 1
            ch.generation = self._confirmations
            ch.confirmed.set()
            # Anything on this channel may have been missed while it was not subscribed.
            await self._reread(
                [(w.thread_id, pid) for pid, w in self._waits.items() if w.channel == channel]
            )
            self._notify(channel, {"resubscribed": True})
        elif kind == "message":
            try:
                wake: Wake = orjson.loads(msg["data"])
            except orjson.JSONDecodeError:
                logger.warning("waiter.bad_message", extra={"channel": channel})
                return False
            woke = self._resolve(wake)
            self._notify(channel, wake)
            return woke
        return False

    def _notify(self, channel: str, wake: Wake) -> None:
        for listener in list(self._listeners.get(channel, ())):
            try:
                listener(channel, wake)
            except Exception:
                logger.exception("waiter.listener_failed", extra={"channel": channel})

    def _resolve(self, wake: Wake) -> bool:
        """Hand `wake` to the waits on its prompt; True when one was waiting."""
        prompt_id = wake.get("prompt_id", "")
        if wake.get("state") not in ("answered", "cancelled", "missing"):  # missing: from reads
            return False
        if prompt_id in self._expected:
            channel, generation, _ = self._expected[prompt_id]
            self._expected[prompt_id] = (channel, generation, wake)
        w = self._waits.get(prompt_id)
        if w is None:
            return False
        woke = False
        for fut in w.futures:
            if not fut.done():
                fut.set_result(wake)
                woke = True
        return woke

    async def _reread(self, pairs: Iterable[tuple[str, str]]) -> None:
        pairs = list(pairs)
        if not pairs:
            return
        for wake in (await self._read(pairs)).values():
            self._resolve(wake)

    # -- the sweep --------------------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        """The slow safety net, on its own task: whatever the reader is doing (reading,
        backing off, stuck on a dead socket), every waited prompt is re-read each interval."""
        while not self._closed:
            await asyncio.sleep(self._sweep_interval)
            try:
                await self._sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("waiter.sweep_failed", extra={"error": repr(e)})

    async def _sweep(self) -> None:
        """Re-read every waited prompt; drop channels nobody has needed for a while."""
        await self._reread([(w.thread_id, pid) for pid, w in self._waits.items()])
        now = asyncio.get_running_loop().time()
        async with self._connect_lock:
            idle = [
                c
                for c, ch in self._channels.items()
                if ch.waits <= 0 and now - ch.idle_since > self._sweep_interval
            ]
            for c in idle:
                del self._channels[c]
            if idle and self._pubsub is not None:
                try:
                    await self._pubsub.unsubscribe(*idle)
                except (RedisError, OSError):
                    await self._drop_connection_locked()  # the reader makes a new one

    def _forget(self, prompt_id: str, fut: asyncio.Future[Wake]) -> None:
        w = self._waits.get(prompt_id)
        if w is None:
            return
        if fut in w.futures:
            w.futures.remove(fut)
        if not w.futures:
            del self._waits[prompt_id]


async def read_message(ps: Any) -> dict[str, Any] | None:
    """The next message on pub/sub `ps`; None when `get_message` waited `_READ_FOR` for none.

    On a redis-py PubSub with hiredis and no health checks to send, it reads straight off the
    connection's parser: one read of the socket, then what that read completed
    (`next_buffered`), with no timer and none of get_message's layers, on the wake's path. It
    blocks until a message comes; a closed or failed connection raises, as in get_message, and
    the waiter makes a new one. Otherwise (a ShardedPubSub, which reads its nodes itself;
    another parser or a connection that reads another way, as fakeredis's; health checks,
    which get_message sends while it waits): get_message."""
    conn: Any = ps.connection if isinstance(ps, PubSub) else None
    parser: Any = getattr(conn, "_parser", None)
    if (
        not isinstance(parser, _AsyncHiredisParser)
        or not parser._connected
        # A connection reading some other way (fakeredis's) does not read through its parser.
        or type(conn).read_response is not AbstractConnection.read_response
        or conn.health_check_interval
    ):
        message: dict[str, Any] | None = await ps.get_message(
            ignore_subscribe_messages=False, timeout=_READ_FOR
        )
        return message
    while True:
        message = await next_buffered(ps)
        if message is not None:
            return message
        await parser.read_from_socket()  # type: ignore[no-untyped-call]


async def next_buffered(ps: Any) -> dict[str, Any] | None:
    """The next message pub/sub `ps` has read in whole already, or None: no socket read, no
    timer (redis-py's get_message arms a timeout on every call). A ShardedPubSub has its own
    queue; a redis-py PubSub's replies are in hiredis's reader, parsed. None when unsure (no
    connection, another parser): the caller reads the usual way."""
    take = getattr(ps, "take_buffered", None)
    if take is not None:
        message: dict[str, Any] | None = take()
        return message
    conn: Any = ps.connection
    parser: Any = getattr(conn, "_parser", None)
    reader: Any = getattr(parser, "_reader", None)
    if not isinstance(parser, _AsyncHiredisParser) or not parser._connected or reader is None:
        return None
    while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
        if isinstance(reply, Exception):  # an error reply, or the parser's: as redis-py would
            raise reply
        if conn.health_check_interval and reply in ps.health_check_response:
            continue  # redis-py hides its health check's PONG too
        message = await ps.handle_message(reply, ignore_subscribe_messages=False)
        if message is not None:
            return message
    return None


def nothing_received(conn: object) -> bool:
    """Nothing waits unread on redis-py connection `conn`: not in its stream's buffer, nor in
    hiredis's (its parser's), and its stream has not ended. False when unsure (another
    parser, no stream yet): the caller then goes redis-py's way. Also the pool's check of the
    Broker's connections (broker/client.py)."""
    parser: Any = getattr(conn, "_parser", None)
    stream: Any = getattr(conn, "_reader", None)
    reader: Any = getattr(parser, "_reader", None)
    return bool(
        stream is not None
        and getattr(parser, "_connected", False)
        and callable(getattr(reader, "has_data", None))
        and not getattr(stream, "_buffer", True)
        and not stream.at_eof()
        and stream.exception() is None
        and not reader.has_data()
        and getattr(parser, "_stream", None) is stream  # the parser reads this stream
    )


async def _close(ps: PubSub) -> None:
    with contextlib.suppress(RedisError, OSError, RuntimeError):
        await ps.aclose()  # type: ignore[no-untyped-call]
