"""Server-Sent Events: the prompt event log (`broker.events`) fanned out to every open stream.

One reader per process follows the log with a blocking XREAD and hands each event to every
subscriber's queue, so a thousand open pages cost one Redis connection, not a thousand. A
client that reconnects with `Last-Event-ID` is first replayed what it missed from the log
(subscribed before the replay, so nothing falls between the two); one whose last event was
trimmed away, or that lagged so far its queue filled, is sent `reset` and refetches the snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import events
from broker.errors import BadItem
from broker.keys import Keys
from web import metrics
from web.errors import dumps

__all__ = ["EventHub", "stream"]

logger = logging.getLogger("web.sse")

_QUEUE = 1000  # events a slow client may lag before it is reset
_BLOCK_MS = 2000
_RETRY_MS = 2000


class Subscription:
    """One open stream's queue of `(event, its frame)`; `lagged` once it overflowed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[events.Event, bytes]] = asyncio.Queue(_QUEUE)
        self.lagged = False

    def put(self, event: events.Event, frame: bytes | None = None) -> None:
        try:
            self.queue.put_nowait((event, frame or _frame(event.name, _data(event), event.id)))
        except asyncio.QueueFull:
            self.lagged = True


class EventHub:
    """Follows the event log with one blocking reader and fans it out to subscribers."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._subs: set[Subscription] = set()
        self._task: asyncio.Task[None] | None = None
        self.last_id = "0-0"

    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            self.last_id = await events.last_event_id(self.redis, self.keys)
        self._task = asyncio.create_task(self._follow())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def subscribe(self) -> Subscription:
        sub = Subscription()
        self._subs.add(sub)
        metrics.EVENT_STREAMS.inc()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.discard(sub)
            metrics.EVENT_STREAMS.dec()

    async def _follow(self) -> None:
        while True:
            try:
                batch = await events.read_new(self.redis, self.keys, self.last_id, _BLOCK_MS)
            except (RedisError, OSError) as e:
                # Redis is away: keep our place and try again; nothing after last_id is lost
                # unless the log is trimmed past it meanwhile (then subscribers are not told,
                # but their next reconnect is; the snapshot stays the truth).
                logger.warning("sse.follow_failed", extra={"error": repr(e)})
                await asyncio.sleep(0.5)
                continue
            for event in batch:
                self.last_id = event.id
                frame = _frame(event.name, _data(event), event.id)  # once, for every stream
                for sub in list(self._subs):
                    sub.put(event, frame)


def _frame(name: str, data: object, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {name}\ndata: ".encode() + dumps(data) + b"\n\n"


def _data(event: events.Event) -> dict[str, object]:
    return {
        "thread_id": event.thread_id,
        "prompt_id": event.prompt_id,
        "at": datetime.fromtimestamp(event.at_ms / 1000, UTC),
        **event.data,
    }


def _newer(a: str, b: str) -> bool:
    """Whether stream id `a` comes after `b`."""
    ams, _, aseq = a.partition("-")
    bms, _, bseq = b.partition("-")
    return (int(ams), int(aseq)) > (int(bms), int(bseq))


async def _replay(hub: EventHub, last_event_id: str | None) -> tuple[str, bool, list[events.Event]]:
    """Where the client stands: `(last id sent, resumed, events to replay)`; resumed is False
    with no `Last-Event-ID`, and None-like (a reset) when its place was trimmed away."""
    if last_event_id is None:
        return hub.last_id, False, []
    try:
        held = await events.still_held(hub.redis, hub.keys, last_event_id)
    except BadItem:
        held = False  # not an id we gave out: the client cannot know what it missed
    if not held:
        raise _Behind
    sent, replay = last_event_id, []
    while True:  # the log past the client's place, in pages
        page = await events.read_after(hub.redis, hub.keys, sent)
        replay.extend(page)
        if page:
            sent = page[-1].id
        if len(page) < 1000:
            return sent, True, replay


class _Behind(Exception):
    """The client's last event is no longer in the log."""


async def stream(
    hub: EventHub,
    last_event_id: str | None,
    visible: Callable[[events.Event], Awaitable[bool]],
    heartbeat: float,
) -> AsyncIterator[bytes]:
    """The bytes of one SSE response: `ready`, the replay or a `reset`, then live events (those
    `visible` says the caller may see: its threads', and prompts escalated to its groups)."""
    sub = hub.subscribe()  # before the replay is read, so nothing falls between the two
    try:
        yield f"retry: {_RETRY_MS}\n\n".encode()
        try:
            sent, resumed, replay = await _replay(hub, last_event_id)
        except (RedisError, OSError):
            # Redis is away: say so in the stream's own words and end it; EventSource
            # reconnects after `retry` and the page polls meanwhile.
            yield _frame("reset", {"reason": "unavailable"})
            return
        except _Behind:
            yield _frame("ready", {"last_event_id": hub.last_id, "resumed": False})
            yield _frame("reset", {"reason": "behind"})
            sent, replay = hub.last_id, []
        else:
            yield _frame("ready", {"last_event_id": sent, "resumed": resumed})
        for event in replay:
            if await visible(event):
                yield _frame(event.name, _data(event), event.id)
        async for frame in _live(sub, sent, visible, heartbeat):
            yield frame
    finally:
        hub.unsubscribe(sub)


async def _live(
    sub: Subscription,
    sent: str,
    visible: Callable[[events.Event], Awaitable[bool]],
    heartbeat: float,
) -> AsyncIterator[bytes]:
    """Live events after `sent`, a heartbeat when there are none; a `reset` if it lagged."""
    while not sub.lagged:
        try:
            event, frame = await asyncio.wait_for(sub.queue.get(), heartbeat)
        except TimeoutError:
            yield b": ping\n\n"
            continue
        if not _newer(event.id, sent):
            continue  # already replayed
        sent = event.id
        if await visible(event):
            yield frame
    # Its queue overflowed: events were dropped. It reconnects (EventSource does) and is
    # replayed from its last id, or told to refetch if that is gone too.
    yield _frame("reset", {"reason": "behind"})
