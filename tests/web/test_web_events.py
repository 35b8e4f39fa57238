"""Server-Sent Events from the prompt event log: live, resumed with Last-Event-ID, reset."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import redis

from broker import Broker, events
from tests.conftest import BrokerFactory
from tests.helpers import truthy, until
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


# -- webhooks ----------------------------------------------------------------------------------

SECRET = "hook-secret-0123456789"


class Flaky:
    """Wraps the example receiver: fails the first `fail` deliveries with a 500."""

    def __init__(self, receiver: Any, fail: int) -> None:
        self.receiver, self.fail, self.calls = receiver, fail, 0

    async def handle(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        self.calls += 1
        if self.calls <= self.fail:
            return PlainTextResponse("down", 500)
        return await self.receiver.handle(request)


def deliveries(outcome: str) -> float:
    """The webhook deliveries this process counted with `outcome` (`serve`'s /metrics)."""
    from web import metrics

    labels = {"hook": "chat", "outcome": outcome}
    return (
        metrics.REGISTRY.get_sample_value("prompt_broker_webhook_deliveries_total", labels) or 0.0
    )


async def said(receiver: Any, n: int = 1, what: str = "the receiver's messages") -> None:
    """Until the example receiver has said at least `n` messages (10 s at the most)."""
    await until(lambda: truthy(len(receiver.messages) >= n), what, within=10)


async def _with_hooks(broker: Broker, hook_url: str, tries: int = 4, **options: Any) -> Any:
    from web.webhooks import Webhook

    hook = Webhook(id="chat", url=hook_url, secret=SECRET)
    admin = Identity.model_validate({"name": "root", "token": ALICE, "scopes": ["admin"]})
    return create_app(
        ApiSettings(tokens=(admin,), webhooks=(hook,)),
        broker=broker,
        webhook_options={"retry_delay": 0.1, "tries": tries, **options},
    )


@contextlib.asynccontextmanager
async def _hooked(broker: Broker, handle: Any, **options: Any) -> AsyncIterator[str]:
    """A subscriber answering `POST /hook` with `handle`, and a `serve` app (`_with_hooks`
    `options`) delivering to it; yields the app's base URL."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    target = Starlette(routes=[Route("/hook", handle, methods=["POST"])])
    async with (
        serving(target) as hook_base,
        serving(await _with_hooks(broker, f"{hook_base}/hook", **options)) as base,
    ):
        yield base


async def test_webhooks_signed_retried_and_deduplicated(broker: Broker) -> None:
    """Prompt events reach a subscriber signed; failed attempts are retried with the same
    delivery id; the example receiver turns them into chat messages with answer links."""

    from web.receiver import Receiver

    receiver = Receiver(SECRET, "http://inbox.example")
    flaky = Flaky(receiver, fail=2)
    before = {o: deliveries(o) for o in ("delivered", "retried", "failed")}
    async with _hooked(broker, flaky.handle):
        p = await broker.ask("t", "approval", [APPROVAL])
        # A person answers once the chat asked them (deliveries are concurrent, so an answer
        # given at once could overtake the opening: the receiver would drop the late opening).
        await said(receiver, 1, "the opening")
        await broker.post_item("t", {"author": "bob", "content": [{"type": "text", "text": "1"}]})
        await said(receiver, 2, "the answer")
    assert receiver.messages == [
        f"[t] a approval waits on you: answer at http://inbox.example/#/threads/t/prompts/{p.prompt_id}",
        f"[t] answered by bob (http://inbox.example/#/threads/t/prompts/{p.prompt_id})",
    ]
    assert flaky.calls >= 4  # two failures, retried, then both delivered
    assert deliveries("delivered") - before["delivered"] == 2  # serve's /metrics counts them
    assert deliveries("retried") - before["retried"] == flaky.calls - 2
    assert deliveries("failed") == before["failed"]


async def test_webhook_jobs_go_to_the_queue_redis_of_their_own(
    make_broker: BrokerFactory, redis_server_factory: Callable[..., Any]
) -> None:
    """With `queue_url` the deliveries' arq jobs are queued and worked on that Redis: both
    events reach the subscriber, and the queue's server took their jobs."""
    from web.receiver import Receiver

    queue_server = redis_server_factory(appendonly=False)
    broker = await make_broker(queue_url=queue_server.url)
    receiver = Receiver(SECRET, "http://inbox.example")
    async with _hooked(broker, receiver.handle):
        await broker.ask("q", "approval", [APPROVAL])
        await said(receiver, 1, "the opening")
        await broker.post_item("q", {"author": "bob", "content": [{"type": "text", "text": "1"}]})
        await said(receiver, 2, "the answer")
    with redis.Redis(port=queue_server.port) as queue:
        stats = queue.info("commandstats")
        # arq's enqueue (a MULTI with ZADD) per delivery, and its worker's poll of the queue.
        assert stats["cmdstat_zadd"]["calls"] >= 2, stats
        assert stats["cmdstat_zrangebyscore"]["calls"] >= 1, stats
        assert queue.zcard(f"{broker.keys.audit_slot}{broker.keys.prefix}:webhooks:queue") == 0


async def test_the_receiver_checks_signatures_and_dedupes() -> None:
    """The example receiver refuses a bad signature or an old timestamp, and says a repeated
    delivery (a retry whose first attempt did arrive) once."""
    from web.receiver import Receiver
    from web.webhooks import sign

    receiver = Receiver(SECRET, "http://inbox")
    app = receiver.app()
    async with serving(app) as base, httpx.AsyncClient(base_url=base) as c:
        now = int(time.time())
        body = b'{"event": "prompt.opened"}'
        good = {"X-Prompt-Broker-Timestamp": str(now), "X-Prompt-Broker-Delivery": "d1"}
        bad = await c.post(
            "/hook", content=body, headers={**good, "X-Prompt-Broker-Signature": "v1=00"}
        )
        assert bad.status_code == 401
        old = {**good, "X-Prompt-Broker-Timestamp": str(now - 3600)}
        old["X-Prompt-Broker-Signature"] = sign(SECRET, now - 3600, body)
        assert (await c.post("/hook", content=body, headers=old)).status_code == 400
        signed = {**good, "X-Prompt-Broker-Signature": sign(SECRET, now, body)}
        assert (await c.post("/hook", content=body, headers=signed)).status_code == 200
        assert (await c.post("/hook", content=body, headers=signed)).status_code == 200
        assert len(receiver.messages) == 1


async def test_the_receiver_drops_what_arrives_after_a_prompts_end() -> None:
    """Deliveries are concurrent, so an answer can overtake its prompt's opening: the late
    opening (and a late reminder) is acknowledged but not said; another prompt's is."""
    from web.receiver import Receiver
    from web.webhooks import sign

    receiver = Receiver(SECRET, "http://inbox")

    async def deliver(c: httpx.AsyncClient, delivery: str, event: dict[str, Any]) -> str:
        body = orjson.dumps(event)
        now = int(time.time())
        headers = {
            "X-Prompt-Broker-Timestamp": str(now),
            "X-Prompt-Broker-Delivery": delivery,
            "X-Prompt-Broker-Signature": sign(SECRET, now, body),
        }
        r = await c.post("/hook", content=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.text

    one = {"thread_id": "t", "prompt_id": "prm_1"}
    async with serving(receiver.app()) as base, httpx.AsyncClient(base_url=base) as c:
        await deliver(c, "chat:2-0", {**one, "event": "prompt.answered", "answered_by": "bob"})
        said = await deliver(c, "chat:1-0", {**one, "event": "prompt.opened", "kind": "approval"})
        assert "not said" in said
        await deliver(c, "chat:3-0", {**one, "event": "prompt.reminder", "reminder": 1, "of": 1})
        two = {"thread_id": "t", "prompt_id": "prm_2", "event": "prompt.opened", "kind": "choice"}
        await deliver(c, "chat:4-0", two)
    assert receiver.messages == [
        "[t] answered by bob (http://inbox/#/threads/t/prompts/prm_1)",
        "[t] a choice waits on you: answer at http://inbox/#/threads/t/prompts/prm_2",
    ]


async def test_failed_deliveries_are_kept_listed_and_replayed(broker: Broker) -> None:
    """A subscriber that never answers 2xx: after the last try the delivery is kept, listed
    to an admin, and a replay delivers it once the subscriber is back."""

    from web.receiver import Receiver

    receiver = Receiver(SECRET, "http://inbox")
    flaky = Flaky(receiver, fail=10**9)
    failed_before = deliveries("failed")
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with (
        _hooked(broker, flaky.handle, tries=2) as base,
        httpx.AsyncClient(base_url=base, headers=headers) as c,
    ):
        p = await broker.ask("t", "approval", [APPROVAL])
        failed: list[Any] = []
        for _ in range(100):
            failed = (await c.get("/v1/webhooks")).json()["failed"]
            if failed:
                break
            await asyncio.sleep(0.05)
        assert len(failed) == 1 and failed[0]["payload"]["prompt_id"] == p.prompt_id
        assert failed[0]["tries"] == 2 and failed[0]["error"] == "HTTP 500"
        assert deliveries("failed") - failed_before == 1
        flaky.fail = 0
        delivery = failed[0]["delivery"]
        assert (await c.post(f"/v1/webhooks/failed/{delivery}/replay")).status_code == 200
        for _ in range(100):
            if receiver.messages:
                break
            await asyncio.sleep(0.05)
        assert len(receiver.messages) == 1 and p.prompt_id in receiver.messages[0]
        assert (await c.get("/v1/webhooks")).json()["failed"] == []
        assert (await c.post(f"/v1/webhooks/failed/{delivery}/replay")).status_code == 404


async def test_an_event_a_dead_copy_took_is_delivered(broker: Broker) -> None:
    """An event another serve copy read from the group but never acknowledged (it died) is
    claimed and delivered by a live one."""

    from web.receiver import Receiver

    p = await broker.ask("t", "approval", [APPROVAL])
    key = events.event_key(broker.keys)
    await broker.redis.xgroup_create(key, "webhooks", id="0", mkstream=True)
    taken = await broker.redis.xreadgroup("webhooks", "dead-copy", {key: ">"}, 10)
    assert taken and taken[0][1]  # the dead copy holds it, unacknowledged
    receiver = Receiver(SECRET, "http://inbox")
    async with _hooked(broker, receiver.handle, claim_idle_ms=0, claim_every=0.1):
        await said(receiver, 1, "the claimed event")
    assert len(receiver.messages) == 1 and p.prompt_id in receiver.messages[0]


async def test_an_event_read_but_not_enqueued_goes_out_when_redis_answers(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis fails between reading an event from the group and enqueueing its delivery (a
    failover, say): the event stays pending on this copy, which takes its own pending entries
    again after the failure, so it goes out within seconds, not after the claim of abandoned
    entries (here never: claims are off)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from web.receiver import Receiver
    from web.webhooks import Dispatcher

    real, calls = Dispatcher._enqueue, []

    async def failing_once(self: Dispatcher, event: Any, **kwargs: Any) -> None:
        calls.append(event.id)
        if len(calls) == 1:
            raise RedisConnectionError("Connection closed by server.")
        await real(self, event, **kwargs)

    monkeypatch.setattr(Dispatcher, "_enqueue", failing_once)
    receiver = Receiver(SECRET, "http://inbox")
    async with _hooked(broker, receiver.handle, claim_idle_ms=10**9, claim_every=10**9):
        p = await broker.ask("t", "approval", [APPROVAL])
        await said(receiver, 1, "the event taken again")
    assert len(calls) == 2 and calls[0] == calls[1]  # the same event, taken again
    assert len(receiver.messages) == 1 and p.prompt_id in receiver.messages[0]


async def test_the_delivery_worker_outlives_a_bug(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something unexpected out of arq's worker (a bug, not an outage) is logged and the worker
    started again: the copy's deliveries do not stop for good."""

    from web.receiver import Receiver
    from web.webhooks import Dispatcher

    real, made = Dispatcher._new_worker, []

    def crashing_once(self: Dispatcher, pool: Any) -> Any:
        made.append(pool)
        if len(made) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return real(self, pool)

    monkeypatch.setattr(Dispatcher, "_new_worker", crashing_once)
    receiver = Receiver(SECRET, "http://inbox")
    async with _hooked(broker, receiver.handle):
        p = await broker.ask("t", "approval", [APPROVAL])
        await said(receiver, 1, "a delivery after the worker's restart")
    assert len(made) >= 2
    assert len(receiver.messages) == 1 and p.prompt_id in receiver.messages[0]


async def test_a_delivery_in_flight_finishes_when_the_copy_stops(broker: Broker) -> None:
    """A `serve` copy stopping while a delivery waits on a slow subscriber lets it finish (a
    short drain) and stops cleanly: closing raises nothing and the delivery is not cut off."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from web.webhooks import Dispatcher, Webhook

    started, finished = asyncio.Event(), asyncio.Event()

    async def slow(request: Any) -> Any:
        await request.body()
        started.set()
        await asyncio.sleep(0.5)
        finished.set()
        return PlainTextResponse("ok")

    target = Starlette(routes=[Route("/hook", slow, methods=["POST"])])
    async with serving(target) as hook_base:
        hook = Webhook(id="chat", url=f"{hook_base}/hook", secret=SECRET)
        hooks = Dispatcher(broker.redis, broker.keys, (hook,), retry_delay=0.1)
        await hooks.start()
        try:
            await broker.ask("t", "approval", [APPROVAL])
            await asyncio.wait_for(started.wait(), 10)
        finally:
            await hooks.aclose()  # with the subscriber still answering
        assert finished.is_set()
    assert await broker.redis.zcard(hooks.queue) == 0  # done, not left to be sent again
