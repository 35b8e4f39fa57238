"""Timings over HTTP and escalation's wider answering: the timing routes, the prompt JSON's
`timing`, `deadline_at` and `escalated_to`, group members reaching an escalated prompt outside
their glob (and nothing else), the two timekeeper events on the streams and webhooks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest

from broker import BadItem, Broker, Timing, events
from tests.web.test_web_events import open_stream, said
from web.app import create_app
from web.settings import ApiSettings, Identity
from web.testing import serving
from workers.runtime.timekeeper import Timekeeper

APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
ALICE = "alice-token-0123456789"
READER = "reader-token-0123456789"
ONCALL = "oncall-token-0123456789"  # team-a's threads, and the oncall group
OTHER = "other-token-01234567890"  # team-a's threads, and another group
SECRET = "a-webhook-secret-0123456789"


def identities() -> tuple[Identity, ...]:
    return tuple(
        Identity.model_validate(i)
        for i in (
            {"name": "alice", "token": ALICE, "scopes": ["read", "answer"]},
            {"name": "reader", "token": READER, "scopes": ["read"]},
            {
                "name": "bob",
                "token": ONCALL,
                "scopes": ["read", "answer"],
                "threads": "team-a-*",
                "groups": ["oncall", "leads"],
            },
            {
                "name": "carol",
                "token": OTHER,
                "scopes": ["read", "answer"],
                "threads": "team-a-*",
                "groups": ["db"],
            },
        )
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def url(broker: Broker) -> AsyncIterator[str]:
    app = create_app(ApiSettings(tokens=identities(), heartbeat=0.3), broker=broker)
    async with serving(app) as base:
        yield base


@pytest.fixture
async def http(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, headers=bearer(ALICE)) as client:
        yield client


async def next_event(stream: Any, within: float = 5.0) -> Any:
    """The stream's next event; a TimeoutError, not a wait forever, when none comes (its
    heartbeats alone would keep `Stream.event` waiting)."""
    async with asyncio.timeout(within):
        return await stream.event()


async def escalate(broker: Broker, thread_id: str, prompt_id: str, to: str = "oncall") -> None:
    """Give the prompt a timing that escalates it at once, and let a timekeeper take it."""
    await broker.set_timing(
        thread_id, Timing(escalate=0.01, escalate_to=to, remind=(0.005,)), prompt_id=prompt_id
    )
    await asyncio.sleep(0.03)
    await Timekeeper(broker).once()
    assert (await broker.get_prompt(thread_id, prompt_id)).escalated_to == to


# -- the timing routes -------------------------------------------------------------------------


async def test_put_and_get_a_threads_and_a_prompts_timing(
    http: httpx.AsyncClient, broker: Broker
) -> None:
    """PUT sets it (seconds, or durations as text), GET reads it back; a prompt's effective
    timing is its own, else its thread's, with `deadline_at`; `null` clears it."""
    p = await broker.ask("t", "approval", [APPROVAL])
    r = await http.get("/v1/threads/t/timing")
    assert r.status_code == 200 and r.json() == {
        "thread_id": "t",
        "timing": None,
        "deadline_at": None,
    }
    body = {"deadline": "2h", "remind": ["15m", 3600], "escalate": "90m", "escalate_to": "oncall"}
    r = await http.put("/v1/threads/t/timing", json=body)
    assert r.status_code == 200, r.text
    thread = {
        "deadline": 7200.0,
        "remind": [900.0, 3600.0],
        "escalate": 5400.0,
        "escalate_to": "oncall",
    }
    assert r.json()["timing"] == thread
    assert await broker.get_timing("t") == Timing.model_validate(thread)
    assert (await http.get("/v1/threads/t/timing")).json()["timing"] == thread
    r = await http.get(f"/v1/threads/t/prompts/{p.prompt_id}/timing")
    assert r.json()["timing"] == thread
    assert datetime.fromisoformat(r.json()["deadline_at"]) == p.created_at + timedelta(hours=2)
    r = await http.put(f"/v1/threads/t/prompts/{p.prompt_id}/timing", json={"deadline": 60})
    assert r.status_code == 200 and r.json()["timing"] == {"deadline": 60.0, "remind": []}
    assert await broker.get_timing("t", p.prompt_id) == Timing(deadline=60)
    listed = (await http.get("/v1/prompts")).json()["prompts"][0]
    assert listed["timing"] == {"deadline": 60.0, "remind": []}
    assert datetime.fromisoformat(listed["deadline_at"]) == p.created_at + timedelta(seconds=60)
    assert listed["escalated_to"] is None
    r = await http.put(f"/v1/threads/t/prompts/{p.prompt_id}/timing", content=b"null")
    assert r.status_code == 200 and r.json()["timing"] == thread  # the thread's applies again
    assert (await http.put("/v1/threads/t/timing", content=b"null")).json()["timing"] is None
    one = (await http.get(f"/v1/threads/t/prompts/{p.prompt_id}")).json()
    assert one["timing"] is None and one["deadline_at"] is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"deadline": -1}, "timing.deadline"),
        ({"deadline": "soon"}, "timing.deadline"),
        ({"remind": [60, "later"]}, "timing.remind.1"),
        ({"escalate": 5, "escalate_to": "on call!"}, "timing.escalate_to"),
        ({"deadline": 60, "approve_at": 30}, "timing.approve_at"),
        ({}, "timing"),
        ([60], "timing"),
    ],
)
async def test_a_bad_timing_is_422_naming_the_field(
    http: httpx.AsyncClient, broker: Broker, body: Any, field: str
) -> None:
    await broker.ask("t", "approval", [APPROVAL])
    r = await http.put("/v1/threads/t/timing", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field
    assert await broker.get_timing("t") is None


async def test_timing_refusals(http: httpx.AsyncClient, broker: Broker) -> None:
    """Unknown thread or prompt 404, a settled prompt 404, a closed thread 409, bad JSON 422,
    the read scope may read but not set it."""
    p = await broker.ask("t", "approval", [APPROVAL])
    t = {"deadline": 60}
    assert (await http.put("/v1/threads/nobody/timing", json=t)).status_code == 404
    assert (await http.get("/v1/threads/nobody/timing")).status_code == 404
    missing = "/v1/threads/t/prompts/prm_00000000000000000000000000/timing"
    assert (await http.get(missing)).status_code == 404
    assert (await http.put(missing, json=t)).status_code == 404
    r = await http.put("/v1/threads/t/timing", content=b"{")
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    reader = bearer(READER)
    assert (await http.get("/v1/threads/t/timing", headers=reader)).status_code == 200
    assert (await http.put("/v1/threads/t/timing", json=t, headers=reader)).status_code == 403
    await broker.post_item("t", {"author": "alice", "content": [{"type": "text", "text": "1"}]})
    r = await http.put(f"/v1/threads/t/prompts/{p.prompt_id}/timing", json=t)
    assert r.status_code == 404 and r.json()["error"]["code"] == "prompt_not_found"
    await broker.sessions.create("c", "scripted", "approval", {}, work_folder="/w")
    await broker.sessions.close("c")
    r = await http.put("/v1/threads/c/timing", json=t)
    assert r.status_code == 409 and r.json()["error"]["code"] == "thread_closed"


# -- escalation --------------------------------------------------------------------------------


async def test_an_escalated_prompt_is_open_to_its_group_and_nothing_else(
    url: str, broker: Broker
) -> None:
    """Before escalation a group member outside the glob gets the glob's 403 everywhere; after
    it, it reads the prompt and its thread and answers it (as itself), while the thread's other
    prompts, its timing, a cancel and a message stay 403; another group's member sees nothing."""
    old = await broker.ask("team-b-1", "approval", [APPROVAL])
    p = await broker.ask("team-b-1", "approval", [APPROVAL])  # supersedes the first
    # A later millisecond: the listing is oldest first, and asks in one millisecond come in the
    # order of their members ("team-a-1/..." first), which is not what this test is about.
    await asyncio.sleep(0.005)
    mine = await broker.ask("team-a-1", "approval", [APPROVAL])
    prompt_path = f"/v1/threads/team-b-1/prompts/{p.prompt_id}"
    answer = {
        "content": [{"type": "text", "text": "approve"}],
        "metadata": {"prompt_id": p.prompt_id},
    }
    async with (
        httpx.AsyncClient(base_url=url, headers=bearer(ONCALL)) as bob,
        httpx.AsyncClient(base_url=url, headers=bearer(OTHER)) as carol,
    ):

        async def listed(c: httpx.AsyncClient) -> list[str]:
            return [x["prompt_id"] for x in (await c.get("/v1/prompts")).json()["prompts"]]

        for path in (prompt_path, "/v1/threads/team-b-1", prompt_path + "/timing"):
            assert (await bob.get(path)).status_code == 403, path
        assert (await bob.post("/v1/threads/team-b-1/items", json=answer)).status_code == 403
        assert await listed(bob) == [mine.prompt_id]
        await escalate(broker, "team-b-1", p.prompt_id)

        got = await bob.get(prompt_path)
        assert got.status_code == 200 and got.json()["escalated_to"] == "oncall"
        assert got.json()["timing"]["escalate_to"] == "oncall"
        view = await bob.get("/v1/threads/team-b-1")
        assert view.status_code == 200 and view.json()["active_prompt"]["prompt_id"] == p.prompt_id
        assert (await bob.get(prompt_path + "/timing")).status_code == 200
        assert await listed(bob) == [p.prompt_id, mine.prompt_id]
        # The rest of that thread stays out of reach, with the glob's own 403.
        written = len(await broker.items("team-b-1"))
        refused = [
            await bob.get(f"/v1/threads/team-b-1/prompts/{old.prompt_id}"),
            await bob.get("/v1/threads/team-b-1/prompts/prm_00000000000000000000000000"),
            await bob.get("/v1/threads/team-b-1/timing"),
            await bob.put(prompt_path + "/timing", json={"deadline": 3600}),
            await bob.put("/v1/threads/team-b-1/timing", json={"deadline": 3600}),
            await bob.post("/v1/threads/team-b-1/cancel"),
            await bob.get("/v1/threads/team-b-1/events"),
            await bob.post("/v1/threads/team-b-1/items", json={"content": answer["content"]}),
            await bob.post(
                "/v1/threads/team-b-1/items",
                json={**answer, "metadata": {"prompt_id": old.prompt_id}},
            ),
        ]
        assert [r.status_code for r in refused] == [403] * len(refused)
        assert {r.json()["error"]["code"] for r in refused} == {"forbidden"}
        for path in (prompt_path, "/v1/threads/team-b-1"):
            assert (await carol.get(path)).status_code == 403
        assert (await carol.post("/v1/threads/team-b-1/items", json=answer)).status_code == 403
        assert await listed(carol) == [mine.prompt_id]
        assert len(await broker.items("team-b-1")) == written  # nothing, by any refusal

        r = await bob.post("/v1/threads/team-b-1/items", json=answer)
        assert r.status_code == 200 and r.json()["outcome"] == "answered", r.text
        done = await broker.get_prompt("team-b-1", p.prompt_id)
        assert done.state == "answered" and done.answered_by == "bob"
        assert (await broker.items("team-b-1"))[-1].author == "bob"
        again = await bob.post("/v1/threads/team-b-1/items", json=answer)
        assert again.status_code == 409 and again.json()["error"]["prompt"]["answered_by"] == "bob"
        assert (await bob.get(prompt_path)).status_code == 200  # still its to read
        assert (await bob.get("/v1/threads/team-b-1")).status_code == 403  # no longer active
        assert await listed(bob) == [mine.prompt_id]


async def test_a_read_only_group_member_reads_but_cannot_answer(broker: Broker) -> None:
    ident = Identity.model_validate(
        {"name": "ro", "token": ALICE, "scopes": ["read"], "threads": "x-*", "groups": ["oncall"]}
    )
    app = create_app(ApiSettings(tokens=(ident,)), broker=broker)
    p = await broker.ask("t", "approval", [APPROVAL])
    await escalate(broker, "t", p.prompt_id)
    answer = {"content": [{"type": "text", "text": "1"}], "metadata": {"prompt_id": p.prompt_id}}
    async with serving(app) as base, httpx.AsyncClient(base_url=base, headers=bearer(ALICE)) as c:
        assert (await c.get(f"/v1/threads/t/prompts/{p.prompt_id}")).status_code == 200
        assert (await c.post("/v1/threads/t/items", json=answer)).status_code == 403
    assert (await broker.get_prompt("t", p.prompt_id)).state == "pending"


def test_groups_are_checked_names() -> None:
    entry = {"name": "a", "token": ALICE, "scopes": ["read"], "groups": ["on call"]}
    with pytest.raises(BadItem) as e:
        ApiSettings.from_env({"PROMPT_BROKER_API_TOKENS": orjson.dumps([entry]).decode()})
    assert e.value.field == "PROMPT_BROKER_API_TOKENS[0][groups][0]"
    ok = ApiSettings.from_env(
        {"PROMPT_BROKER_API_TOKENS": orjson.dumps([{**entry, "groups": ["oncall"]}]).decode()}
    )
    assert ok.tokens[0].groups == ("oncall",)


async def test_whoami_says_the_groups(http: httpx.AsyncClient) -> None:
    assert (await http.get("/v1/session", headers=bearer(ONCALL))).json()["groups"] == [
        "oncall",
        "leads",
    ]


# -- events: the streams and webhooks ------------------------------------------------------------


async def test_the_streams_carry_reminders_and_escalations(url: str, broker: Broker) -> None:
    """`prompt.reminder` and `prompt.escalated` reach the streams that see the thread; a group
    member's stream shows an out-of-glob prompt from its escalation on (its answer too), and
    one escalated before the stream opened once its next event comes."""
    before = await broker.ask("team-b-0", "approval", [APPROVAL])
    await escalate(broker, "team-b-0", before.prompt_id, to="leads")
    async with open_stream(url) as everyone, open_stream(url, token=ONCALL) as bob:
        await everyone.event()
        await bob.event()
        p = await broker.ask("team-b-1", "approval", [APPROVAL])
        mine = await broker.ask("team-a-1", "approval", [APPROVAL])
        await escalate(broker, "team-b-1", p.prompt_id)
        got = [await next_event(everyone) for _ in range(4)]
        assert [(f.event, f.data["prompt_id"]) for f in got] == [
            ("prompt.opened", p.prompt_id),
            ("prompt.opened", mine.prompt_id),
            ("prompt.reminder", p.prompt_id),
            ("prompt.escalated", p.prompt_id),
        ]
        assert got[2].data["reminder"] == 1 and got[2].data["of"] == 1
        assert got[3].data["to"] == "oncall" and got[3].data["age_s"] >= 0.01
        first = await next_event(bob)
        assert (first.event, first.data["prompt_id"]) == ("prompt.opened", mine.prompt_id)
        seen = await next_event(bob)  # not team-b-1's opening nor its reminder: its escalation
        assert (seen.event, seen.data["to"]) == ("prompt.escalated", "oncall")
        body = {"author": "x", "content": [{"type": "text", "text": "1"}]}
        await broker.post_item("team-b-1", body)
        await broker.post_item("team-b-0", body)
        answered = [await next_event(bob), await next_event(bob)]
        assert [(f.event, f.data["prompt_id"]) for f in answered] == [
            ("prompt.answered", p.prompt_id),
            ("prompt.answered", before.prompt_id),
        ]
        with pytest.raises(TimeoutError):
            await next_event(bob, 1.0)  # only heartbeats: nothing else of those threads


async def test_webhooks_take_the_new_events_and_the_receiver_says_them(broker: Broker) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Route

    from web.receiver import Receiver
    from web.webhooks import Webhook

    receiver = Receiver(SECRET, "http://inbox.example")
    target = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    async with serving(target) as hook_base:
        hook = Webhook(
            id="chat",
            url=f"{hook_base}/hook",
            secret=SECRET,
            events=("prompt.opened", "prompt.reminder", "prompt.escalated"),
        )
        admin = Identity.model_validate({"name": "root", "token": ALICE, "scopes": ["admin"]})
        app = create_app(ApiSettings(tokens=(admin,), webhooks=(hook,)), broker=broker)
        async with serving(app):
            p = await broker.ask("t", "approval", [APPROVAL])
            await said(receiver, 1, "the opening")  # first (deliveries are concurrent)
            await escalate(broker, "t", p.prompt_id)
            await said(receiver, 3, "the reminder and the escalation")
    link = f"http://inbox.example/#/threads/t/prompts/{p.prompt_id}"
    assert receiver.messages[0] == f"[t] a approval waits on you: answer at {link}"
    assert sorted(receiver.messages[1:]) == [  # sent together, so in either order
        f"[t] escalated to oncall: a approval has waited 0s: answer at {link}",
        f"[t] reminder 1 of 1: a approval has waited 0s: answer at {link}",
    ]


def test_the_receivers_words_for_reminders_and_escalations() -> None:
    from web.receiver import Receiver

    r = Receiver(SECRET, "http://inbox")
    base = {"thread_id": "t", "prompt_id": "prm_1"}
    link = "http://inbox/#/threads/t/prompts/prm_1"
    reminder = {**base, "event": events.REMINDER, "reminder": 1, "of": 2, "age_s": 900.2}
    assert r.message(reminder) == f"[t] reminder 1 of 2: a prompt has waited 15m: answer at {link}"
    r.message({**base, "event": events.OPENED, "kind": "approval"})
    escalated = {**base, "event": events.ESCALATED, "to": "oncall", "age_s": 5400}
    assert (
        r.message(escalated)
        == f"[t] escalated to oncall: a approval has waited 1h 30m: answer at {link}"
    )
    later = r.message({**reminder, "age_s": 2 * 86400 + 3600})
    assert later is not None and later.startswith(
        "[t] reminder 1 of 2: a approval has waited 2d 1h"
    )
