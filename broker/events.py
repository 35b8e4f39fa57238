"""The prompt event log: a capped Redis stream saying when prompts open, are answered or cancelled.

Surfaces that show prompts live (the HTTP API's Server-Sent Events, webhooks) read it; the
broker writes it in the same pipeline as the thread's script, whichever surface acted (an
answer's `prompt.answered`, on one server, inside route.lua's own step when post_item passes it
the stream: on a cluster the stream lives in another slot, and the event follows). It only
says *when to look*: the per-thread records stay the truth, and a reader that fell behind the
cap (its last event was trimmed away) is told so and refetches the snapshot.

`<prefix>:events` (stream), one entry per event, fields:

- `event`: `prompt.opened`, `prompt.answered`, `prompt.cancelled`, `prompt.reminder` or
  `prompt.escalated` (the last two from a timekeeper: broker/timing.py);
- `thread`, `prompt`: the ids;
- `data`: JSON of what else the event says (`kind`, `source`, `answered_by`, `reason`).

The entry id is the event id (SSE `id:`), its time the event's time (the Redis server's clock).
The stream is trimmed with `MAXLEN ~ EVENTS_MAXLEN` at every write, so it costs O(1) and holds
at least the last `EVENTS_MAXLEN` events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson
from redis.asyncio import Redis

from broker.errors import BadItem
from broker.keys import Keys

__all__ = [
    "ANSWERED",
    "CANCELLED",
    "ESCALATED",
    "EVENTS_MAXLEN",
    "OPENED",
    "REMINDER",
    "Event",
    "EventName",
    "append_event",
    "check_event_id",
    "event_key",
    "last_event_id",
    "queue_event",
    "read_after",
    "read_new",
    "still_held",
]

EventName = Literal[
    "prompt.opened", "prompt.answered", "prompt.cancelled", "prompt.reminder", "prompt.escalated"
]
OPENED: Final = "prompt.opened"
ANSWERED: Final = "prompt.answered"
CANCELLED: Final = "prompt.cancelled"
#: Written by a timekeeper (broker/timing.py): a prompt's reminder came, or its escalation.
REMINDER: Final = "prompt.reminder"
ESCALATED: Final = "prompt.escalated"
_NAMES = frozenset({OPENED, ANSWERED, CANCELLED, REMINDER, ESCALATED})

#: The cap (approximate, as Redis trims whole nodes): a reader further behind gets a reset.
EVENTS_MAXLEN = 10_000
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def event_key(keys: Keys) -> str:
    """The event stream's key: one per prefix, beside `<prefix>:open` (a discovery index too)."""
    return f"{keys.prefix}:events"


@dataclass(frozen=True, slots=True)
class Event:
    """One prompt event, as read back from the stream."""

    id: str
    name: str
    thread_id: str
    prompt_id: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def at_ms(self) -> int:
        """The event's time: the Redis server's clock when it was written (ms)."""
        return int(self.id.partition("-")[0])


_Fields = dict[str | bytes, str | bytes]


def _fields(name: str, thread_id: str, prompt_id: str, data: dict[str, Any]) -> _Fields:
    if name not in _NAMES:
        raise BadItem("event", f"{name!r} is not a prompt event")
    return {
        "event": name,
        "thread": thread_id,
        "prompt": prompt_id,
        "data": orjson.dumps({k: v for k, v in data.items() if v is not None}),
    }


def queue_event(
    pipe: Any, keys: Keys, name: str, thread_id: str, prompt_id: str, **data: Any
) -> None:
    """Queue the event's XADD in `pipe` (a pipeline the caller runs beside the thread's script)."""
    pipe.xadd(
        event_key(keys),
        _fields(name, thread_id, prompt_id, data),
        maxlen=EVENTS_MAXLEN,
        approximate=True,
    )


async def append_event(
    redis: Redis, keys: Keys, name: str, thread_id: str, prompt_id: str, **data: Any
) -> str:
    """Write one event now (when there is no pipeline to put it in); returns its id."""
    event_id = await redis.xadd(
        event_key(keys),
        _fields(name, thread_id, prompt_id, data),  # type: ignore[arg-type]
        maxlen=EVENTS_MAXLEN,
        approximate=True,
    )
    return _text(event_id)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _event(entry_id: str | bytes, fields: dict[Any, Any]) -> Event:
    f = {_text(k): _text(v) for k, v in fields.items()}
    try:
        data = orjson.loads(f.get("data") or "{}")
    except orjson.JSONDecodeError:
        data = {}
    return Event(
        id=_text(entry_id),
        name=f.get("event", ""),
        thread_id=f.get("thread", ""),
        prompt_id=f.get("prompt", ""),
        data=data if isinstance(data, dict) else {},
    )


def check_event_id(value: object, field: str = "Last-Event-ID") -> str:
    """`value` if it is a stream id (`<ms>-<seq>`), else `BadItem` naming `field`."""
    if not isinstance(value, str) or not _STREAM_ID.fullmatch(value):
        raise BadItem(field, f"{value!r} is not an event id (<ms>-<seq>)")
    return value


async def read_after(redis: Redis, keys: Keys, after: str, count: int = 1000) -> list[Event]:
    """Up to `count` events after id `after` (exclusive), oldest first: a reconnect's replay."""
    check_event_id(after, "after")
    entries = await redis.xrange(event_key(keys), f"({after}", "+", count=count)
    return [_event(i, f) for i, f in entries]


async def read_new(
    redis: Redis, keys: Keys, after: str, block_ms: int, count: int = 1000
) -> list[Event]:
    """Block up to `block_ms` for events after `after` (`$`: from now); [] on timeout."""
    if after != "$":
        check_event_id(after, "after")
    reply = await redis.xread({event_key(keys): after}, block=block_ms, count=count)
    return [_event(i, f) for _, entries in reply or [] for i, f in entries]


async def last_event_id(redis: Redis, keys: Keys) -> str:
    """The newest event's id, or `0-0` when there is none: where a new reader starts."""
    entries = await redis.xrevrange(event_key(keys), "+", "-", count=1)
    return _text(entries[0][0]) if entries else "0-0"


async def still_held(redis: Redis, keys: Keys, event_id: str) -> bool:
    """True when a reader whose last event was `event_id` missed nothing to trimming.

    Trimming drops the oldest entries first, so if the reader's own last event is still in the
    stream, everything after it is too. If it is gone (trimmed, or never there) the reader may
    have missed events and must refetch the snapshot. `0-0` (a reader that saw nothing yet)
    holds only while nothing was ever trimmed: the stream then starts at its first entry.
    """
    check_event_id(event_id)
    key = event_key(keys)
    if event_id == "0-0":
        length = await redis.xlen(key)
        return int(length) < EVENTS_MAXLEN
    found = await redis.xrange(key, event_id, event_id, count=1)
    return bool(found)
