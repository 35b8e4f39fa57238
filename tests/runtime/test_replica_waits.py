"""Replicas' waits on a person (workers/runtime/waits.py, the resume turns of turns.py): held waits
that continue in place, parked ones resumed through a one-shot grant or with the person's words, and
the held-wait cap that demotes the oldest to parked.

In process, on both backends, with the fleet and helpers of tests/runtime/test_replica.py.
"""

from __future__ import annotations

import logging

import pytest

from broker import (
    Broker,
    Session,
    verdict,
)
from tests.helpers import of_type, outputs, text, truthy, until
from tests.runtime.test_replica import (
    ASK,
    Fleet,
    active,
    delivered_logs,
    pick,
    script,
    session,
    start_thread,
    status_is,
    tool,
    turn_ends,
)
from workers.agents.harness import (
    PromptParked,
    Turn,
    TurnResult,
    approval_question,
)

# -- held waits ------------------------------------------------------------------------------


async def test_held_wait_continues_in_the_same_turn(
    fleet: Fleet, person: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A held ask blocks the agent's call and the answer continues the same turn, delivered once."""
    caplog.set_level(logging.INFO, logger="broker")
    r = await fleet.start("r1")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    s = await session(person, "t1")
    assert s.owner == "r1"
    assert s.status == "running"
    assert s.waiting is not None and s.waiting.prompt_id == p.prompt_id
    await until(lambda: truthy(r.replica.held_count() == 1), "the held wait")

    routed = await person.post_item("t1", text("2"))
    assert routed.outcome == "answered" and routed.prompt_id == p.prompt_id
    items = await turn_ends(person, "t1")

    assert outputs(items) == ["starting", "Pick one: B", "done"]
    (end,) = of_type(items, "turn_end")
    assert end.metadata["status"] == "completed"
    assert items[-1].id == end.id
    assert len(of_type(items, "pending_prompt")) == 1
    prompt = await person.get_prompt("t1", p.prompt_id)
    assert prompt.state == "answered"
    assert prompt.delivered_at is not None
    (log,) = delivered_logs(caplog, p.prompt_id)
    assert log.first is True  # type: ignore[attr-defined]
    s = await session(person, "t1")
    assert s.status == "idle"
    assert s.waiting is None
    assert s.grant is None
    # one turn, no resume turn: the answer came back in place
    assert [(t.replica, t.resume) for t in fleet.turns_of("t1")] == [("r1", None)]
    assert r.replica.held_count() == 0


async def test_held_approval_runs_in_place_and_records_no_grant(
    fleet: Fleet, person: Broker
) -> None:
    """An approval answered during a held wait runs the call in place; no grant is recorded."""
    await fleet.start("r1")
    await start_thread(person, "t1", script(tool("make deploy", "deployed")))
    p = await active(person, "t1")
    assert p.kind == "approval"
    assert p.questions[0].grant_key == "Bash:make deploy"
    await person.post_item("t1", text("yes"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["Ran Bash `make deploy`:\ndeployed"]
    assert of_type(items, "approval_granted") == []
    assert (await session(person, "t1")).grant is None
    assert all(t.resume is None for t in fleet.turns_of("t1"))


async def test_autonomous_runs_tools_but_still_asks_questions(fleet: Fleet, person: Broker) -> None:
    """Under autonomous permissions tool calls run with no prompt; questions still ask a person."""
    await fleet.start("r1")
    config = script(tool("make deploy", "deployed"), {"ask": [pick()]}, {"say": "done"})
    await start_thread(person, "t1", config, permissions="autonomous")
    p = await active(person, "t1")
    assert p.kind == "ask_user_question"
    items = await person.items("t1")
    assert outputs(items) == ["Ran Bash `make deploy`:\ndeployed"]
    await person.post_item("t1", text("A"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["Ran Bash `make deploy`:\ndeployed", "Pick one: A", "done"]
    pending = of_type(items, "pending_prompt")
    assert [i.metadata["prompt"]["kind"] for i in pending] == ["ask_user_question"]


# -- parked waits, resume turns and grants ---------------------------------------------------


DEPLOY_THEN_CLEAN = script(
    tool("make deploy", "deployed"), tool("make clean", "cleaned"), {"say": "end"}
)


async def park_then_approve(fleet: Fleet, person: Broker) -> str:
    """Park the first call of DEPLOY_THEN_CLEAN, approve it, and return the second call's
    prompt id once it parked (asserting the grant path on the way)."""
    await fleet.start("r1", wait_mode="parked")
    await start_thread(person, "t1", DEPLOY_THEN_CLEAN)

    # the turn parks: prompt open, session parked and waiting on it, no turn_end
    s = await status_is(person, "t1", "parked")
    p1 = await active(person, "t1")
    assert s.waiting is not None and s.waiting.prompt_id == p1.prompt_id
    assert s.waiting.kind == "approval" and s.waiting.subject == "Bash"
    assert of_type(await person.items("t1"), "turn_end") == []
    assert (await person.get_prompt("t1", p1.prompt_id)).state == "pending"

    # approve: a resume turn retries the call, the grant answers it, the next call asks again
    await person.post_item("t1", text("yes"))

    async def parked_on_second() -> Session | None:
        s = await session(person, "t1")
        ok = s.status == "parked" and s.waiting and s.waiting.prompt_id != p1.prompt_id
        return s if ok else None

    s = await until(parked_on_second, "the second call to park")
    assert s.grant is None  # spent
    items = await person.items("t1")
    granted = of_type(items, "approval_granted")
    assert len(granted) == 1
    assert granted[0].metadata["granted_by"] == p1.prompt_id
    assert granted[0].metadata["subject"] == "Bash"
    pending = of_type(items, "pending_prompt")
    keys = [i.metadata["prompt"]["questions"][0]["grant_key"] for i in pending]
    assert keys == ["Bash:make deploy", "Bash:make clean"]  # no second prompt for the retry
    assert outputs(items) == ["Ran Bash `make deploy`:\ndeployed"]
    assert of_type(items, "turn_end") == []
    first = await person.get_prompt("t1", p1.prompt_id)
    assert first.state == "answered" and first.delivered_at is not None
    resumed = [t for t in fleet.turns_of("t1") if t.resume is not None]
    assert len(resumed) == 1
    assert resumed[0].resume is not None and resumed[0].resume.verdict == "approve"
    assert "APPROVED" in resumed[0].prompt
    assert s.waiting is not None
    return s.waiting.prompt_id


async def test_parked_approval_resumes_through_a_one_shot_grant(
    fleet: Fleet, person: Broker
) -> None:
    """Parked: the turn ends with the prompt open; its approval resumes the turn, the retried
    call spends a one-shot grant (one approval_granted, no second prompt), and a later,
    different call asks a person again."""
    p2 = await park_then_approve(fleet, person)
    second = await person.get_prompt("t1", p2)
    assert second.state == "pending"
    assert second.questions[0].grant_key == "Bash:make clean"
    assert (await person.active_prompt("t1")) == second


async def test_parked_denial_resumes_with_the_words_and_no_grant(
    fleet: Fleet, person: Broker
) -> None:
    """A parked approval denied with words resumes with the denial and those words, and records
    no grant."""
    p2 = await park_then_approve(fleet, person)
    await person.post_item("t1", text("no, not today"))
    items = await turn_ends(person, "t1")
    out = outputs(items)
    assert out == [
        "Ran Bash `make deploy`:\ndeployed",
        'Did not run Bash `make clean`: the person denied it. They said: "no, not today"',
        "end",
    ]
    assert len(of_type(items, "approval_granted")) == 1
    assert len(of_type(items, "pending_prompt")) == 2
    s = await session(person, "t1")
    assert s.grant is None
    assert s.waiting is None
    assert (await person.get_prompt("t1", p2)).delivered_at is not None
    resumed = [t for t in fleet.turns_of("t1") if t.resume is not None]
    assert len(resumed) == 2
    assert resumed[1].resume is not None and resumed[1].resume.verdict == "deny"
    assert "DENIED" in resumed[1].prompt and "no, not today" in resumed[1].prompt


async def test_parked_bare_denial_quotes_nothing(fleet: Fleet, person: Broker) -> None:
    """A parked approval denied with a bare `N` resumes with the denial, quoting nothing."""
    await fleet.start("r1", wait_mode="parked")
    await start_thread(person, "t1", script(tool("make deploy", "deployed")))
    await status_is(person, "t1", "parked")
    await person.post_item("t1", text("N"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["Did not run Bash `make deploy`: the person denied it."]
    assert (await session(person, "t1")).grant is None
    (resumed,) = [t for t in fleet.turns_of("t1") if t.resume is not None]
    assert "DENIED" in resumed.prompt and '"' not in resumed.prompt


class OneCallPerTurn:
    """A harness that asks approval for one Bash command per turn, the next from a list."""

    name = "calls"

    def __init__(self, *commands: str) -> None:
        self.commands = list(commands)

    async def run_turn(self, turn: Turn) -> TurnResult:
        command = self.commands.pop(0)
        question = approval_question("Bash", {"command": command})
        try:
            answers = await turn.handle.ask("approval", [question])
        except PromptParked as parked:
            return TurnResult("parked", parked=parked)
        await turn.emit(f"{command}: {verdict(answers)}")
        return TurnResult("completed")


async def test_grant_kept_when_it_does_not_cover_and_overwritten_by_a_newer_one(
    fleet: Fleet, person: Broker
) -> None:
    """A grant that does not cover the next call is kept while a person is asked; a newer
    approval overwrites it; a `cd <dir> && <command>` call inside the work folder spends it."""
    harness = OneCallPerTurn("make deploy", "make deploy --force", "cd sub && make deploy --force")
    await fleet.start("r1", harnesses={"calls": harness}, wait_mode="parked")
    await person.sessions.create("t1", "calls", "approval", {}, work_folder="/work/proj")
    await person.post_item("t1", text("go"))
    p1 = await active(person, "t1")
    await status_is(person, "t1", "parked")

    async def parked_again() -> Session | None:
        s = await session(person, "t1")
        ok = s.status == "parked" and s.waiting and s.waiting.prompt_id != p1.prompt_id
        return s if ok else None

    await person.post_item("t1", text("yes"))
    s = await until(parked_again, "the --force call to ask a person")
    assert s.grant is not None and s.grant.grant_key == "Bash:make deploy"  # kept, unspent
    assert s.grant.granted_by == p1.prompt_id
    assert of_type(await person.items("t1"), "approval_granted") == []
    assert s.waiting is not None
    p2 = s.waiting.prompt_id

    await person.post_item("t1", text("yes"))
    items = await turn_ends(person, "t1")
    (granted,) = of_type(items, "approval_granted")
    assert granted.metadata["granted_by"] == p2  # the newer grant was the one spent
    assert outputs(items) == ["cd sub && make deploy --force: approve"]
    assert len(of_type(items, "pending_prompt")) == 2
    assert (await session(person, "t1")).grant is None


async def test_parked_question_resumes_with_structured_answers(
    fleet: Fleet, person: Broker
) -> None:
    """A parked question answered by structured answers resumes with them, not the raw text."""
    await fleet.start("r1", wait_mode="parked")
    cards = {
        "question": "Which cards?",
        "multiSelect": True,
        "options": [{"label": "KPI cards"}, {"label": "Table"}, {"label": "Chart"}],
    }
    await start_thread(person, "t1", script({"ask": [cards]}, {"say": "built"}))
    await status_is(person, "t1", "parked")
    p = await active(person, "t1")
    routed = await person.post_item(
        "t1",
        {
            "content": [{"type": "text", "text": "whatever you think best"}],
            "metadata": {"answers": [{"question": "Which cards?", "answer": ["Table", "Chart"]}]},
        },
    )
    assert routed.source == "structured"
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["Which cards? Table, Chart", "built"]
    (resumed,) = [t for t in fleet.turns_of("t1") if t.resume is not None]
    assert resumed.resume is not None and resumed.resume.prompt_id == p.prompt_id
    assert [a.answer for a in resumed.resume.answers] == [["Table", "Chart"]]
    assert "Table, Chart" in resumed.prompt
    assert "whatever you think best" not in resumed.prompt
    assert (await person.get_prompt("t1", p.prompt_id)).delivered_at is not None


# -- the held-wait cap -----------------------------------------------------------------------


async def test_held_cap_demotes_the_oldest_to_parked(fleet: Fleet, person: Broker) -> None:
    """Past held_waits_max the oldest held wait is parked (prompt open, nobody refused) and its
    answer later resumes it; the newer wait stays held."""
    r = await fleet.start("r1", held_waits_max=1)
    await start_thread(person, "t1", ASK)
    p1 = await active(person, "t1")
    await until(lambda: truthy(r.replica.held_count() == 1), "t1 held")
    await start_thread(person, "t2", ASK)
    p2 = await active(person, "t2")

    s1 = await status_is(person, "t1", "parked")
    assert s1.waiting is not None and s1.waiting.prompt_id == p1.prompt_id
    assert (await person.get_prompt("t1", p1.prompt_id)).state == "pending"
    s2 = await session(person, "t2")
    assert s2.status == "running"
    assert s2.waiting is not None and s2.waiting.prompt_id == p2.prompt_id
    assert r.replica.held_count() == 1
    items1 = await person.items("t1")
    assert outputs(items1) == ["starting"]  # nothing said about a refusal
    assert of_type(items1, "turn_end") == []

    await person.post_item("t1", text("1"))
    items1 = await turn_ends(person, "t1")
    assert outputs(items1) == ["starting", "Pick one: A", "done"]
    assert (await person.get_prompt("t1", p1.prompt_id)).delivered_at is not None
    assert [t.resume is not None for t in fleet.turns_of("t1")] == [False, True]
    assert (await session(person, "t2")).status == "running"  # still held meanwhile

    await person.post_item("t2", text("2"))
    items2 = await turn_ends(person, "t2")
    assert outputs(items2) == ["starting", "Pick one: B", "done"]
    assert [t.resume is not None for t in fleet.turns_of("t2")] == [False]
