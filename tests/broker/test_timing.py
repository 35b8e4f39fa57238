"""A thread's or a prompt's timing (broker/timing.py): checked input, the records, and each step
taken once on server time (step.lua), over fakeredis and a real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker import (
    BadItem,
    Broker,
    PromptCancelled,
    PromptNotFound,
    ThreadClosed,
    ThreadNotFound,
    Timing,
    parse_duration,
)
from broker.timing import MAX_REMINDERS
from tests.helpers import index_score

Q = {"question": "Target?", "options": [{"label": "staging"}, {"label": "production"}]}


def text(t: str) -> dict[str, Any]:
    return {"author": "alice", "content": [{"type": "text", "text": t}]}


@pytest.mark.parametrize(
    ("given", "seconds"),
    [("90", 90), ("90s", 90), ("15m", 900), ("1.5h", 5400), ("2d", 172800), ("1w", 604800),
     ("250ms", 0.25)],
)  # fmt: skip
def test_durations(given: str, seconds: float) -> None:
    assert parse_duration(given) == seconds


@pytest.mark.parametrize("given", ["", "soon", "-5m", "0", "10y", "400d", "5 m s"])
def test_bad_durations_say_where(given: str) -> None:
    with pytest.raises(BadItem) as e:
        parse_duration(given, "--deadline")
    assert e.value.field == "--deadline"


@pytest.mark.parametrize(
    ("timing", "field", "says"),
    [
        ({}, "timing", "empty"),
        ({"deadline": 60, "remind": [60]}, "timing", "before the deadline"),
        (
            {"deadline": 60, "escalate": 90, "escalate_to": "oncall"},
            "timing",
            "before the deadline",
        ),
        ({"escalate": 30}, "timing", "go together"),
        ({"remind": [10, 10]}, "timing", "same time"),
        ({"remind": list(range(1, MAX_REMINDERS + 2))}, "timing", "at most"),
        ({"deadline": -1}, "timing.deadline", "greater than 0"),
        ({"deadline": "soon"}, "timing.deadline", "number"),
        ({"escalate": 5, "escalate_to": "on call!"}, "timing.escalate_to", "pattern"),
        ({"deadline": 60, "approve_at": 30}, "timing.approve_at", "Extra"),
    ],
)
def test_a_timing_that_does_not_hold_is_refused(timing: Any, field: str, says: str) -> None:
    with pytest.raises(BadItem) as e:
        Timing.parse(timing)
    assert e.value.field == field and says in str(e.value), str(e.value)


def test_steps_in_order_with_the_deadline_last() -> None:
    t = Timing(deadline=600, remind=(300, 60), escalate=120, escalate_to="oncall")
    assert t.steps() == [
        [60_000, "remind", 1],
        [120_000, "escalate", "oncall"],
        [300_000, "remind", 2],
        [600_000, "expire", 0],
    ]


async def test_unknown_and_closed_threads_and_settled_prompts_are_refused(broker: Broker) -> None:
    t = Timing(deadline=60)
    with pytest.raises(ThreadNotFound):
        await broker.set_timing("nobody", t)
    p = await broker.ask("t", "ask_user_question", [Q])
    await broker.post_item("t", text("1"))
    with pytest.raises(PromptNotFound):
        await broker.set_timing("t", t, prompt_id=p.prompt_id)
    with pytest.raises(BadItem):
        await broker.set_timing("t", {"deadline": 0})
    await broker.sessions.create("c", "scripted", "approval", {}, work_folder="/w")
    await broker.sessions.close("c")
    with pytest.raises(ThreadClosed):
        await broker.set_timing("c", t)
    assert await broker.redis.exists(broker.thread("c").timing) == 0  # nothing written


async def test_set_read_and_clear(broker: Broker) -> None:
    await broker.ask("t", "ask_user_question", [Q])
    thread = Timing(deadline=3600, remind=(600,))
    await broker.set_timing("t", thread)
    assert await broker.get_timing("t") == thread
    p = await broker.ask("t", "ask_user_question", [Q])
    assert await broker.get_timing("t", p.prompt_id) == thread  # the thread's applies
    own = Timing(deadline=30)
    await broker.set_timing("t", own, prompt_id=p.prompt_id)
    assert await broker.get_timing("t", p.prompt_id) == own  # the prompt's own wins
    assert await broker.get_timing("t") == thread
    await broker.set_timing("t", None)
    assert await broker.get_timing("t") is None
    # Setting one names the prompt it applies to in the due index, for a timekeeper to look at.
    assert await index_score(broker, "due", f"t/{p.prompt_id}") is not None


async def test_each_step_is_taken_once_on_server_time(broker: Broker) -> None:
    p = await broker.ask("t", "ask_user_question", [Q])
    await broker.set_timing(
        "t", Timing(deadline=0.9, remind=(0.2, 0.4), escalate=0.3, escalate_to="oncall")
    )
    early = await broker.step_timing("t", p.prompt_id)
    assert early.outcome == "early" and early.reminders == 2 and early.next_ms is not None
    await asyncio.sleep(0.25)
    first = await broker.step_timing("t", p.prompt_id)
    assert (first.outcome, first.kind, first.reminder) == ("fired", "remind", 1)
    again = await broker.step_timing("t", p.prompt_id)
    assert again.outcome == "early"  # taken once, whoever looks next
    await asyncio.sleep(0.2)  # past the escalation and the second reminder: one step, both taken
    caught = await broker.step_timing("t", p.prompt_id)
    assert (caught.outcome, caught.reminder, caught.escalated_to) == ("fired", 2, "oncall")
    assert (await broker.get_prompt("t", p.prompt_id)).escalated_to == "oncall"
    assert (await broker.step_timing("t", p.prompt_id)).outcome == "early"
    await asyncio.sleep(0.5)
    due = await broker.step_timing("t", p.prompt_id)
    assert due.outcome == "expire" and due.age_ms >= 900
    # Expiry is never recorded as taken: until the prompt is cancelled, it says so again.
    assert (await broker.step_timing("t", p.prompt_id)).outcome == "expire"
    waiting = asyncio.create_task(broker.wait("t", p.prompt_id, timeout=5))
    await asyncio.sleep(0.05)
    await broker.cancel("t", "expired", prompt_id=p.prompt_id)
    with pytest.raises(PromptCancelled) as e:
        await waiting
    assert e.value.reason == "expired"
    assert (await broker.step_timing("t", p.prompt_id)).outcome == "gone"


async def test_racing_lookers_take_a_step_once(broker: Broker) -> None:
    p = await broker.ask("t", "ask_user_question", [Q])
    await broker.set_timing("t", Timing(remind=(0.1,)), prompt_id=p.prompt_id)
    await asyncio.sleep(0.15)
    steps = await asyncio.gather(*(broker.step_timing("t", p.prompt_id) for _ in range(20)))
    assert sorted(s.outcome for s in steps) == ["early"] * 19 + ["fired"]
    assert [s.next_ms for s in steps] == [None] * 20  # nothing comes after


async def test_without_timing_nothing_happens(broker: Broker) -> None:
    p = await broker.ask("t", "ask_user_question", [Q])
    assert (await broker.step_timing("t", p.prompt_id)).outcome == "none"
    assert await broker.get_timing("t", p.prompt_id) is None


async def test_a_later_timing_never_repeats_a_step_already_past(broker: Broker) -> None:
    p = await broker.ask("t", "ask_user_question", [Q])
    await broker.set_timing("t", Timing(remind=(0.1,)))
    await asyncio.sleep(0.15)
    assert (await broker.step_timing("t", p.prompt_id)).outcome == "fired"
    await broker.set_timing("t", Timing(remind=(0.05, 0.1, 0.6)))  # two at or before the last
    assert (await broker.step_timing("t", p.prompt_id)).outcome == "early"
    await asyncio.sleep(0.5)
    last = await broker.step_timing("t", p.prompt_id)
    assert (last.outcome, last.reminder) == ("fired", 3)


async def test_a_closed_threads_timing_expires_with_it(broker: Broker) -> None:
    await broker.sessions.create("c", "scripted", "approval", {}, work_folder="/w")
    await broker.set_timing("c", Timing(deadline=60))
    await broker.sessions.close("c")
    ttl = await broker.redis.ttl(broker.thread("c").timing)
    assert 0 < ttl <= broker.settings.closed_ttl
