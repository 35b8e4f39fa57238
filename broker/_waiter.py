"""The pub/sub waiter: one connection per Broker, thread channels on demand, futures per prompt.

Pub/sub is at-most-once: a message published while we reconnect is gone. So the record decides
and the bell only rings: every wait subscribes first, then reads the record, then waits; after
every (re)subscription the reader re-reads every prompt waited on that channel; and a slow sweep
re-reads them all. A message that carries the committed state (the script that commits it
publishes it) resolves the wait with no read at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger("broker.waiter")

__all__ = ["Reader", "Waiter", "Wake"]

#: A committed resolution: {"prompt_id", "state": "answered"|"cancelled", "answers"|"reason"}.
Wake = dict[str, Any]
#: Reads the records of (thread_id, prompt_id) pairs; returns the resolved ones as Wakes.
Reader = Callable[[list[tuple[str, str]]], Awaitable[dict[str, Wake]]]
#: Called with every message on a thread's channel (for replicas that watch threads).
Listener = Callable[[str, Wake], None]

_EXPECT_MAX = 10_000
_BACKOFF = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass
class _Channel:
    thread_id: str
    waits: int = 0  # open waits and listeners holding it subscribed
    requested: bool = False  # SUBSCRIBE sent on the current connection
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = 0  # how many times the server confirmed it: bumps on resubscription
    idle_since: float = 0.0


@dataclass
class _Wait:
    thread_id: str
    channel: str
    futures: list[asyncio.Future[Wake]] = field(default_factory=list)


class Waiter:
    """Owns the Broker's pub/sub connection and the reader task."""

    def __init__(self, redis: Redis, read: Reader, sweep_interval: float) -> None:
        self._redis = redis
        self._read = read
        self._sweep_interval = sweep_interval
        self._channels: dict[str, _Channel] = {}
        self._waits: dict[str, _Wait] = {}
        self._listeners: dict[str, list[Listener]] = {}
        self._expected: dict[str, tuple[str, int, Wake | None]] = {}
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self.reconnects = 0

    # -- public ----------------------------------------------------------------------------

    async def subscribe(self, channel: str, thread_id: str) -> int:
        """Subscribe to a channel (if needed) and wait for the server's confirmation.

        Returns the channel's confirmation count. Every (re)subscription bumps it, so a caller
        that subscribed before something existed and later sees the same count missed nothing.
        """
        self._hold(channel, thread_id)  # the sweep drops only channels nobody holds
        try:
            ch = self._channels[channel]
            if not ch.requested:
                ch.requested = True
                await self._send_subscribe([channel])
            await ch.confirmed.wait()
            return ch.generation
        finally:
            self._release(channel)

    def expect(self, prompt_id: str, channel: str, generation: int) -> None:
        """Note a prompt created while `channel` was confirmed `generation` times.

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
        try:
            generation = await self.subscribe(channel, thread_id)
            _, expected_generation, heard = self._expected.pop(prompt_id, (channel, None, None))
            if heard is not None:
                return heard
            if expected_generation != generation:
                await self._reread([(thread_id, prompt_id)])
            return await fut
        finally:
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
        self._channels.setdefault(channel, _Channel(thread_id))
        self._channels[channel].waits += 1

    def _release(self, channel: str) -> None:
        ch = self._channels.get(channel)
        if ch is not None:
            ch.waits -= 1
            ch.idle_since = asyncio.get_running_loop().time()

    async def aclose(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await self._task
        for w in self._waits.values():
            for fut in w.futures:
                if not fut.done():
                    fut.cancel()
        await self._drop_connection()

    # -- connection -------------------------------------------------------------------------

    async def _send_subscribe(self, channels: list[str]) -> None:
        async with self._connect_lock:
            if self._pubsub is None:
                self._pubsub = self._redis.pubsub()
                channels = list(self._channels)
            for c in channels:
                self._channels[c].requested = True
            try:
                await self._pubsub.subscribe(*channels)
            except (RedisError, OSError):
                await self._drop_connection_locked()
                raise
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="prompt-broker waiter")
        self._changed.set()

    async def _drop_connection(self) -> None:
        async with self._connect_lock:
            await self._drop_connection_locked()

    async def _drop_connection_locked(self) -> None:
        ps, self._pubsub = self._pubsub, None
        for ch in self._channels.values():
            ch.confirmed.clear()
            ch.requested = False
        if ps is not None:
            with contextlib.suppress(RedisError, OSError):
                await ps.aclose()  # type: ignore[no-untyped-call]

    # -- the reader -------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        loop = asyncio.get_running_loop()
        next_sweep = loop.time() + self._sweep_interval
        while not self._closed:
            try:
                if self._pubsub is None:
                    if not self._channels:
                        self._changed.clear()
                        await self._changed.wait()
                        continue
                    await self._send_subscribe(list(self._channels))
                msg = await self._pubsub.get_message(  # type: ignore[union-attr]
                    ignore_subscribe_messages=False,
                    timeout=max(0.0, next_sweep - loop.time()),
                )
                failures = 0
                if msg is not None:
                    await self._handle(msg)
                if loop.time() >= next_sweep:
                    next_sweep = loop.time() + self._sweep_interval
                    await self._sweep()
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                delay = _BACKOFF[min(failures, len(_BACKOFF) - 1)]
                failures += 1
                self.reconnects += 1
                logger.warning("waiter.disconnected", extra={"error": repr(e), "retry_in": delay})
                await self._drop_connection()
                await asyncio.sleep(delay)
            except Exception:
                logger.exception("waiter.error")
                await asyncio.sleep(0.1)

    async def _handle(self, msg: dict[str, Any]) -> None:
        kind, channel = msg["type"], msg["channel"]
        ch = self._channels.get(channel)
        if kind == "subscribe" and ch is not None:
            ch.generation += 1
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
                return
            self._resolve(wake)
            self._notify(channel, wake)

    def _notify(self, channel: str, wake: Wake) -> None:
        for listener in list(self._listeners.get(channel, ())):
            try:
                listener(channel, wake)
            except Exception:
                logger.exception("waiter.listener_failed", extra={"channel": channel})

    def _resolve(self, wake: Wake) -> None:
        prompt_id = wake.get("prompt_id", "")
        if wake.get("state") not in ("answered", "cancelled", "missing"):  # missing: from reads
            return
        if prompt_id in self._expected:
            channel, generation, _ = self._expected[prompt_id]
            self._expected[prompt_id] = (channel, generation, wake)
        w = self._waits.get(prompt_id)
        if w is None:
            return
        for fut in w.futures:
            if not fut.done():
                fut.set_result(wake)

    async def _reread(self, pairs: Iterable[tuple[str, str]]) -> None:
        pairs = list(pairs)
        if not pairs:
            return
        for wake in (await self._read(pairs)).values():
            self._resolve(wake)

    async def _sweep(self) -> None:
        """Re-read every waited prompt; drop channels nobody has needed for a while."""
        await self._reread([(w.thread_id, pid) for pid, w in self._waits.items()])
        now = asyncio.get_running_loop().time()
        idle = [
            c
            for c, ch in self._channels.items()
            if ch.waits <= 0 and now - ch.idle_since > self._sweep_interval
        ]
        if idle and self._pubsub is not None:
            for c in idle:
                del self._channels[c]
            await self._pubsub.unsubscribe(*idle)

    def _forget(self, prompt_id: str, fut: asyncio.Future[Wake]) -> None:
        w = self._waits.get(prompt_id)
        if w is None:
            return
        if fut in w.futures:
            w.futures.remove(fut)
        if not w.futures:
            del self._waits[prompt_id]
