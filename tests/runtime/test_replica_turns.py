"""Replicas' turns (workers/runtime/turns.py): how a turn's end is written when its run fails, when
it completes with a prompt left open, when it ends on Redis trouble, or fails after its wait was
answered.

In process, on both backends, with the fleet and helpers of tests/runtime/test_replica.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import BusyLoadingError

from broker import (
    Answer,
    Broker,
    Kind,
    Option,
    PromptCancelled,
    Question,
)
from tests.helpers import of_type, text, truthy, until
from tests.runtime.test_replica import (
    Fleet,
    active,
    session,
    status_is,
    turn_ends,
)
from workers.agents.harness import (
    PromptParked,
    Turn,
    TurnResult,
    approval_question,
)

# -- run failure -----------------------------------------------------------------------------


class AskThenFail:
    """A harness whose turn starts a held ask in the background and then fails with "boom"."""

    name = "x"

    def __init__(self, watcher: Broker) -> None:
        self.watcher = watcher
        self.asks: list[asyncio.Task[list[Answer]]] = []

    async def run_turn(self, turn: Turn) -> TurnResult:
        q = Question(question="Proceed?", options=[Option(label="Yes"), Option(label="No")])
        kind: Kind = "ask_user_question"
        self.asks.append(asyncio.create_task(turn.handle.ask(kind, [q])))
        await until(lambda: self.watcher.active_prompt(turn.thread_id), "the background ask")
        return TurnResult("failed", error="boom")


async def test_run_failure_cancels_the_open_prompt(fleet: Fleet, person: Broker) -> None:
    """A failed turn cancels its open prompt with the failure message as the reason."""
    harness = AskThenFail(person)
    await fleet.start("r1", harnesses={"x": harness})
    await person.sessions.create("t1", "x", "approval", {})
    await person.post_item("t1", text("go"))

    items = await turn_ends(person, "t1")
    (end,) = of_type(items, "turn_end")
    assert end.metadata["status"] == "failed"
    assert "boom" in end.text
    (pending,) = of_type(items, "pending_prompt")
    prompt = await person.get_prompt("t1", pending.metadata["prompt"]["prompt_id"])
    assert prompt.state == "cancelled"
    assert prompt.reason == "boom"
    assert prompt.delivered_at is None
    assert await person.active_prompt("t1") is None
    s = await session(person, "t1")
    assert s.waiting is None
    assert s.error == "boom"
    (ask,) = harness.asks
    with pytest.raises(PromptCancelled) as e:
        await asyncio.wait_for(ask, 5)
    assert e.value.reason == "boom"


class AskThenComplete(AskThenFail):
    """A harness whose turn starts a held ask in the background and then completes."""

    async def run_turn(self, turn: Turn) -> TurnResult:
        await super().run_turn(turn)
        return TurnResult("completed")


async def test_completed_run_cancels_a_prompt_left_open(fleet: Fleet, person: Broker) -> None:
    """A turn that completes with its question still open cancels it: the run ended."""
    harness = AskThenComplete(person)
    await fleet.start("r1", harnesses={"x": harness})
    await person.sessions.create("t1", "x", "approval", {})
    await person.post_item("t1", text("go"))
    items = await turn_ends(person, "t1")
    (pending,) = of_type(items, "pending_prompt")
    prompt = await person.get_prompt("t1", pending.metadata["prompt"]["prompt_id"])
    assert (prompt.state, prompt.reason) == ("cancelled", "the run ended")
    (ask,) = harness.asks
    with pytest.raises(PromptCancelled):
        await asyncio.wait_for(ask, 5)


# -- a turn that ends on Redis trouble, or fails after its wait was answered -------------------


class EndsBadly:
    """Asks one approval; on a fresh turn, once the ask parked, either raises a Redis error (its
    own bookkeeping met Redis loading its data) or, after the person answered, reports failed.
    A resume turn completes; the prompts it was resumed with are recorded."""

    def __init__(self, how: str, person: Broker) -> None:
        self.how, self.person = how, person
        self.resumed: list[str] = []

    async def run_turn(self, turn: Turn) -> TurnResult:
        if turn.resume is not None:
            self.resumed.append(turn.resume.prompt_id)
            return TurnResult("completed")
        try:
            await turn.handle.ask("approval", [approval_question("Bash", {"command": "ls"})])
        except PromptParked as parked:
            prompt_id = parked.prompt_id
            if self.how == "redis":
                raise BusyLoadingError("Redis is loading the dataset in memory") from None

            async def answered() -> bool:
                p = await self.person.get_prompt(turn.thread_id, prompt_id)
                return p.state == "answered"

            await until(answered, "the person's answer")
            return TurnResult("failed", error="the agent fell over")
        return TurnResult("completed")

    async def describe_interruption(self, *_: Any) -> str:
        return ""


async def test_redis_trouble_at_a_turns_end_is_not_a_failed_turn(
    fleet: Fleet, person: Broker
) -> None:
    """A Redis error out of the harness (here: as its turn parks) cuts the turn off, as a
    stopped replica would: the prompt stays open, and its answer resumes the agent. Taken for a
    failed turn, the prompt was cancelled and the answer could never be given."""
    harness = EndsBadly("redis", person)
    await fleet.start("r1", harnesses={"bad": harness}, wait_mode="parked")
    await person.sessions.create("t1", "bad", "approval", {})
    await person.post_item("t1", text("go"))
    p = await active(person, "t1")
    await status_is(person, "t1", "parked")
    assert (await person.get_prompt("t1", p.prompt_id)).state == "pending"
    await person.post_item("t1", text("yes"))
    await until(lambda: truthy(harness.resumed == [p.prompt_id]), "the resume turn")
    items = await person.items("t1")
    assert not [i for i in of_type(items, "turn_end") if i.metadata.get("status") == "failed"]


async def test_a_failed_turn_keeps_a_wait_whose_answer_came(fleet: Fleet, person: Broker) -> None:
    """A turn that fails after the person answered what its agent waited on does not drop that
    answer: the session stays parked on it and a resume turn hands it over."""
    harness = EndsBadly("fail", person)
    await fleet.start("r1", harnesses={"bad": harness}, wait_mode="parked")
    await person.sessions.create("t1", "bad", "approval", {})
    await person.post_item("t1", text("go"))
    p = await active(person, "t1")
    await person.post_item("t1", text("yes"))
    await until(lambda: truthy(harness.resumed == [p.prompt_id]), "the resume turn")
    assert (await person.get_prompt("t1", p.prompt_id)).delivered_at is not None
