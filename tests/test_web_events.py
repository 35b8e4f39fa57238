"""Server-Sent Events from the prompt event log: live, resumed with Last-Event-ID, reset."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from broker import Broker, events
from web import sse
from web.app import create_app
from web.settings import ApiSettings, Identity
from web.testing import serving

APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
ALICE = "alice-token-0123456789"
TEAM_A = "team-a-token-0123456789"


@dataclass
class Frame:
    event: str = ""
    data: Any = None
    id: str | None = None
    comment: str | None = None


class Stream:
    """Reads one SSE response frame by frame."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()

    async def next(self, within: float = 3.0) -> Frame:
        frame = Frame()
        seen = False
        async with asyncio.timeout(within):
            async for line in self._lines:
                if not line:
                    if seen:
                        return frame
                    continue
                seen = True
                if line.startswith(":"):
                    return Frame(comment=line[1:].strip())
                name, _, value = line.partition(": ")
                if name == "data":
                    frame.data = orjson.loads(value)
                elif name == "event":
                    frame.event = value
                elif name == "id":
                    frame.id = value
        raise EOFError("the stream ended")

    async def event(self, within: float = 3.0) -> Frame:
        """The next event, skipping heartbeats and `retry:` lines."""
        while True:
            frame = await self.next(within)
            if frame.comment is None and frame.event:
                return frame


@pytest.fixture
async def url(broker: Broker) -> AsyncIterator[str]:
    tokens = (
        Identity.model_validate({"name": "alice", "token": ALICE, "scopes": ["read", "answer"]}),
        Identity.model_validate(
            {"name": "a", "token": TEAM_A, "scopes": ["read"], "threads": "team-a-*"}
        ),
    )
    app = create_app(ApiSettings(tokens=tokens, heartbeat=0.3), broker=broker)
    async with serving(app) as base:
        yield base


@contextlib.asynccontextmanager
async def open_stream(
    url: str, path: str = "/v1/events", token: str = ALICE, last: str | None = None
) -> AsyncIterator[Stream]:
    headers = {"Authorization": f"Bearer {token}"}
    if last is not None:
        headers["Last-Event-ID"] = last
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as client,
        client.stream("GET", path, headers=headers) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        yield Stream(response)


async def emit(b: Broker, name: str, thread_id: str, prompt_id: str, **data: Any) -> str:
    return await events.append_event(b.redis, b.keys, name, thread_id, prompt_id, **data)


async def test_live_events_with_ids(url: str, broker: Broker) -> None:
    """An open stream says `ready`, then each event as it is written, with its id."""
    async with open_stream(url) as s:
        ready = await s.event()
        assert ready.event == "ready" and ready.data["resumed"] is False
        first = await emit(broker, events.OPENED, "t1", "prm_1", kind="approval")
        second = await emit(broker, events.ANSWERED, "t1", "prm_1", answered_by="bob")
        a, b = await s.event(1.0), await s.event(1.0)
    assert (a.event, a.id, a.data["kind"]) == ("prompt.opened", first, "approval")
    assert (b.event, b.id, b.data["answered_by"]) == ("prompt.answered", second, "bob")
    assert a.data["thread_id"] == "t1" and a.data["prompt_id"] == "prm_1"
    assert a.data["at"].endswith("Z")


async def test_resume_with_last_event_id_misses_nothing(url: str, broker: Broker) -> None:
    """Reconnecting with Last-Event-ID replays every event after it, in order, then goes live."""
    async with open_stream(url) as s:
        await s.event()
        seen = await emit(broker, events.OPENED, "t", "prm_1")
        assert (await s.event()).id == seen
    missed = [await emit(broker, events.CANCELLED, "t", f"prm_{i}", reason="x") for i in range(3)]
    async with open_stream(url, last=seen) as s:
        ready = await s.event()
        assert ready.data == {"last_event_id": missed[-1], "resumed": True}
        assert [(await s.event()).id for _ in missed] == missed
        live = await emit(broker, events.OPENED, "t", "prm_9")
        assert (await s.event()).id == live


async def test_behind_the_cap_gets_reset(url: str, broker: Broker) -> None:
    """A Last-Event-ID no longer in the log (trimmed, or not one of ours) gets `reset`."""
    await emit(broker, events.OPENED, "t", "prm_1")
    for last in ("1-0", "not-an-id"):
        async with open_stream(url, last=last) as s:
            ready, reset = await s.event(), await s.event()
            assert ready.data["resumed"] is False
            assert reset.event == "reset" and reset.data == {"reason": "behind"}
            live = await emit(broker, events.OPENED, "t", "prm_2")
            assert (await s.event()).id == live


async def test_heartbeat(url: str) -> None:
    """With nothing to say, the stream sends a comment every heartbeat."""
    async with open_stream(url) as s:
        await s.event()
        frame = await s.next(2.0)
        while frame.comment is None:
            frame = await s.next(2.0)
        assert frame.comment == "ping"


async def test_thread_stream_and_glob(url: str, broker: Broker) -> None:
    """The per-thread stream carries that thread only; the global one only the token's threads."""
    async with (
        open_stream(url, "/v1/threads/team-a-1/events") as one,
        open_stream(url, token=TEAM_A) as globbed,
    ):
        await one.event()
        await globbed.event()
        await emit(broker, events.OPENED, "team-b-1", "prm_1")
        await emit(broker, events.OPENED, "team-a-2", "prm_2")
        mine = await emit(broker, events.OPENED, "team-a-1", "prm_3")
        assert (await one.event()).id == mine
        assert (await globbed.event()).data["thread_id"] == "team-a-2"
        assert (await globbed.event()).id == mine


async def test_a_lagging_client_is_reset(broker: Broker) -> None:
    """A subscriber whose queue overflowed is sent `reset` (it then refetches the snapshot)."""
    hub = sse.EventHub(broker.redis, broker.keys)
    sub = hub.subscribe()
    for i in range(sse._QUEUE + 1):
        sub.put(events.Event(f"{i + 1}-0", events.OPENED, "t", "prm_x"))
    frames = [f async for f in sse._live(sub, "0-0", lambda t: True, 1.0)]
    assert frames[-1].startswith(b"event: reset")


async def test_the_log_is_capped(broker: Broker) -> None:
    """Every write trims the log to about EVENTS_MAXLEN entries."""
    pipe = broker.redis.pipeline(transaction=False)
    for i in range(events.EVENTS_MAXLEN + 500):
        events.queue_event(pipe, broker.keys, events.OPENED, "t", f"prm_{i}")
    await pipe.execute()
    length = await broker.redis.xlen(events.event_key(broker.keys))
    assert events.EVENTS_MAXLEN <= length < events.EVENTS_MAXLEN + 500
    first = (await broker.redis.xrange(events.event_key(broker.keys), count=1))[0][0]
    assert not await events.still_held(broker.redis, broker.keys, "1-0")
    assert await events.still_held(broker.redis, broker.keys, first)
    assert not await events.still_held(broker.redis, broker.keys, "0-0")


async def test_the_broker_writes_events_whoever_acts(url: str, broker: Broker) -> None:
    """Asked, answered by the library (as the CLI does) and cancelled: each reaches an open
    stream within a second."""
    async with open_stream(url) as s:
        await s.event()
        p = await broker.ask("t", "approval", [APPROVAL])
        opened = await s.event(1.0)
        assert (opened.event, opened.data["prompt_id"]) == ("prompt.opened", p.prompt_id)
        await broker.post_item(
            "t", {"author": "cli-user", "content": [{"type": "text", "text": "1"}]}
        )
        answered = await s.event(1.0)
        assert (answered.event, answered.data["prompt_id"]) == ("prompt.answered", p.prompt_id)
        q = await broker.ask("t", "approval", [APPROVAL])
        await s.event(1.0)
        await broker.cancel("t", "not needed")
        cancelled = await s.event(1.0)
        assert (cancelled.event, cancelled.data["prompt_id"]) == ("prompt.cancelled", q.prompt_id)
        assert cancelled.data["reason"] == "not needed"
