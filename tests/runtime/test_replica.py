"""Replicas end to end, in process, on both backends: held and parked waits, grants, resume turns,
clean stops, fencing, adoption and lost leases.

Every replica runs as an asyncio task (`Replica.run(stop)`) on its own Broker, with short leases
and fast adoption; the `fleet` fixture stops every replica it started. A "person" answers through
another Broker with `post_item`. Synchronisation is by polling the Redis records with deadlines.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fakeredis
import pytest
from redis.exceptions import BusyLoadingError

from broker import (
    Answer,
    Broker,
    Fenced,
    Item,
    Kind,
    Option,
    Prompt,
    PromptCancelled,
    Question,
    Session,
    Settings,
    ThreadNotFound,
    verdict,
)
from tests.conftest import BrokerFactory
from tests.helpers import of_type, outputs, stays, text, truthy, until
from workers.agents.harness import (
    AgentStore,
    PromptParked,
    Resume,
    Turn,
    TurnResult,
    approval_question,
)
from workers.agents.scripted import ScriptedHarness
from workers.runtime.replica import Replica

#: Settings every replica test runs with: short leases, fast adoption, a quick sweep.
FAST: dict[str, Any] = {"lease_ttl": 1.0, "adopt_interval": 0.05, "sweep_interval": 0.5}

T = TypeVar("T")


# -- helpers ---------------------------------------------------------------------------------


def pick(question: str = "Pick one") -> dict[str, Any]:
    return {"question": question, "header": "pick", "options": [{"label": "A"}, {"label": "B"}]}


def tool(command: str, output: str) -> dict[str, Any]:
    return {"tool": "Bash", "input": {"command": command}, "output": output}


def script(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"script": {"turns": [{"steps": list(steps)}]}}


#: Say something, ask one question, say something: the basic held or parked wait.
ASK = script({"say": "starting"}, {"ask": [pick()]}, {"say": "done"})


@dataclass
class TurnLog:
    """One turn a replica ran: where, for which thread, with what input."""

    replica: str
    thread_id: str
    prompt: str
    resume: Resume | None


class Recorder:
    """The scripted harness, recording every turn it is given."""

    name = "scripted"

    def __init__(self, replica_id: str, log: list[TurnLog]) -> None:
        self.replica_id = replica_id
        self.log = log
        self.inner = ScriptedHarness()

    async def run_turn(self, turn: Turn) -> TurnResult:
        self.log.append(TurnLog(self.replica_id, turn.thread_id, turn.prompt, turn.resume))
        return await self.inner.run_turn(turn)

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        return await self.inner.describe_interruption(thread_id, state, store)


@dataclass
class Running:
    replica: Replica
    broker: Broker
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def id(self) -> str:
        return self.replica.id


@dataclass
class Fleet:
    """Replicas started by a test; `aclose` stops every one still running."""

    make_broker: BrokerFactory
    running: list[Running] = field(default_factory=list)
    turns: list[TurnLog] = field(default_factory=list)

    async def start(
        self, replica_id: str, harnesses: dict[str, Any] | None = None, **overrides: Any
    ) -> Running:
        b = await self.make_broker(**(FAST | overrides))
        if harnesses is None:
            harnesses = {"scripted": Recorder(replica_id, self.turns)}
        replica = Replica(b, harnesses=harnesses, replica_id=replica_id)
        stop = asyncio.Event()
        task = asyncio.create_task(replica.run(stop), name=f"replica {replica_id}")
        r = Running(replica, b, stop, task)
        self.running.append(r)
        return r

    async def stop(self, r: Running) -> None:
        r.stop.set()
        await asyncio.wait_for(r.task, 15)

    async def aclose(self) -> None:
        for r in self.running:
            r.stop.set()
        for r in self.running:
            try:
                await asyncio.wait_for(r.task, 15)
            except Exception:
                logging.getLogger(__name__).exception("replica %s did not stop cleanly", r.id)

    def turns_of(self, thread_id: str) -> list[TurnLog]:
        return [t for t in self.turns if t.thread_id == thread_id]


async def start_thread(
    b: Broker, thread_id: str, config: dict[str, Any], permissions: str = "approval"
) -> None:
    await b.sessions.create(thread_id, "scripted", permissions, config, work_folder="/work/proj")
    await b.post_item(thread_id, text("go"))


async def session(b: Broker, thread_id: str) -> Session:
    s = await b.sessions.get(thread_id)
    assert s is not None
    return s


async def active(b: Broker, thread_id: str) -> Prompt:
    """The thread's active prompt, once there is one."""
    return await until(lambda: b.active_prompt(thread_id), f"a prompt on {thread_id}")


async def status_is(b: Broker, thread_id: str, *statuses: str) -> Session:
    async def check() -> Session | None:
        s = await session(b, thread_id)
        return s if s.status in statuses else None

    return await until(check, f"{thread_id} to be {'/'.join(statuses)}")


async def turn_ends(b: Broker, thread_id: str, n: int = 1) -> list[Item]:
    """Wait until the thread has `n` `turn_end` items and its session is idle; its items."""

    async def check() -> list[Item] | None:
        items = await b.items(thread_id)
        s = await session(b, thread_id)
        return items if len(of_type(items, "turn_end")) >= n and s.status == "idle" else None

    return await until(check, f"{n} turn_end on {thread_id}")


def delivered_logs(caplog: pytest.LogCaptureFixture, prompt_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "prompt.delivered" and getattr(r, "prompt_id", None) == prompt_id
    ]


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


# -- clean stop and adoption -----------------------------------------------------------------


async def test_clean_stop_parks_releases_and_another_replica_resumes(
    fleet: Fleet, person: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A clean stop never cancels: the held wait is parked and released, a second replica adopts
    it at once, and the answer is delivered once and resumes the turn there."""
    caplog.set_level(logging.INFO, logger="broker")
    slow: dict[str, Any] = {"lease_ttl": 5.0}  # adoption must not wait out the lease
    a = await fleet.start("ra", **slow)
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")

    await fleet.stop(a)
    assert (await person.get_prompt("t1", p.prompt_id)).state == "pending"
    assert (await person.active_prompt("t1")) is not None
    s = await session(person, "t1")
    assert s.status == "parked"
    assert s.owner == ""
    assert s.waiting is not None and s.waiting.prompt_id == p.prompt_id
    assert of_type(await person.items("t1"), "turn_end") == []

    loop = asyncio.get_running_loop()
    began = loop.time()
    b = await fleet.start("rb", **slow)

    async def adopted() -> Session | None:
        s = await session(person, "t1")
        return s if s.owner == "rb" and "t1" in b.replica.threads else None

    await until(adopted, "rb to adopt t1", within=3.0)
    assert loop.time() - began < 2.5  # well inside the 5 s lease
    s = await session(person, "t1")
    assert s.status == "parked"  # still waiting for a person: no turn was started

    await person.post_item("t1", text("2"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["starting", "Pick one: B", "done"]
    prompt = await person.get_prompt("t1", p.prompt_id)
    assert prompt.state == "answered"
    assert prompt.delivered_at is not None
    assert delivered_logs(caplog, p.prompt_id) == []  # ra never delivered it
    turns = [(t.replica, t.resume is not None) for t in fleet.turns_of("t1")]
    assert turns == [("ra", False), ("rb", True)]
    assert (await session(person, "t1")).owner == "rb"


async def test_demotion_during_delivery_loses_no_answer(fleet: Fleet, person: Broker) -> None:
    """A hold demoted just as its answer's delivery commits still hands the answer to the agent."""
    a = await fleet.start("ra")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")

    deliver = a.broker._deliver

    async def committed_but_reply_slow(tk: Any, prompt_id: str, epoch: int | None) -> None:
        await deliver(tk, prompt_id, epoch)  # the script commits the delivery ...
        await asyncio.sleep(1.0)  # ... and its reply is slow to come back

    a.broker._deliver = committed_but_reply_slow  # type: ignore[method-assign]
    await person.post_item("t1", text("2"))

    async def delivered() -> bool:
        return (await person.get_prompt("t1", p.prompt_id)).delivered_at is not None

    await until(delivered, "the delivery to commit")
    await fleet.stop(a)  # demotes the hold while the reply is outstanding
    await fleet.start("rb")

    async def settled() -> list[Item] | None:
        s = await session(person, "t1")
        if s.owner == "" or s.status != "idle":
            return None
        return await person.items("t1")

    items = await until(settled, "t1 to settle")
    assert "Pick one: B" in outputs(items)


async def test_parked_answer_then_queued_message_both_run(fleet: Fleet, person: Broker) -> None:
    """A message queued after a parked prompt's answer runs right after the resume turn."""
    # A sweep far away: only bells and the records may drive the follow-up turn.
    config = {
        "script": {
            "turns": [
                {"match": "follow-up", "steps": [{"say": "follow-up seen"}]},
                {"steps": [{"ask": [pick()]}]},
            ]
        }
    }
    a = await fleet.start("ra", wait_mode="parked", sweep_interval=30.0)
    await start_thread(person, "t1", config)
    await status_is(person, "t1", "parked")
    await fleet.stop(a)
    await person.post_item("t1", text("1"))  # answers the parked prompt
    routed = await person.post_item("t1", text("a follow-up"))
    assert routed.outcome == "queued"

    await fleet.start("rb", sweep_interval=30.0)
    await turn_ends(person, "t1", 1)  # the resume turn

    async def followed_up() -> list[str] | None:
        out = outputs(await person.items("t1"))
        return out if "follow-up seen" in out else None

    out = await until(followed_up, "the follow-up turn", within=2.0)
    assert out == ["Pick one: A", "follow-up seen"]


async def claim_as(
    person: Broker, thread_id: str, replica: str, ttl_ms: int = 30_000
) -> int | None:
    """Claim the thread as a new incarnation of `replica`, alive for `ttl_ms`: its epoch."""
    incarnation, _, _ = await person.sessions.join(replica, ttl_ms)
    return await person.sessions.claim(thread_id, replica, incarnation)


# -- fencing ---------------------------------------------------------------------------------


async def test_stale_epoch_is_fenced(fleet: Fleet, person: Broker) -> None:
    """Once another replica claimed the thread, the old epoch's ask, post, deliver and session
    update are refused, and the holder drops the thread without delivering."""
    a = await fleet.start("ra")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")
    old = (await session(person, "t1")).epoch
    assert a.replica.threads["t1"].epoch == old

    # ra is paused: its heartbeat stops, and once its lease ran out "rb" claims the thread
    for task in a.replica._tasks:
        if task.get_name() == "beat":
            task.cancel()
    new = await until(lambda: claim_as(person, "t1", "rb"), "ra's record to run out", within=5)
    assert new > old
    before = await person.items("t1")

    agent_item = {
        "content": [{"type": "text", "text": "stale output"}],
        "metadata": {"type": "agent_output"},
        "author": person.identity,
    }
    with pytest.raises(Fenced) as e:
        await person.post_item("t1", agent_item, epoch=old)
    assert e.value.current == new
    with pytest.raises(Fenced):
        await person.post_item("t1", text("stale message"), epoch=old)
    with pytest.raises(Fenced):
        await person.sessions.update("t1", old, status="idle")
    assert (await person.items("t1")) == before
    assert (await person.active_prompt("t1")) == p
    s = await session(person, "t1")
    assert (s.owner, s.epoch, s.status) == ("rb", new, "running")

    # a person answers: the old epoch cannot deliver it, not even ra's own held wait
    await person.post_item("t1", text("1"))
    with pytest.raises(Fenced):
        await person.wait("t1", p.prompt_id, timeout=5, epoch=old)
    await until(lambda: truthy("t1" not in a.replica.threads), "ra to drop t1")
    assert (await person.get_prompt("t1", p.prompt_id)).delivered_at is None
    # the new holder delivers
    answers = await person.wait("t1", p.prompt_id, timeout=5, epoch=new)
    assert [x.answer for x in answers] == [["A"]]
    assert (await person.get_prompt("t1", p.prompt_id)).delivered_at is not None
    assert "Pick one: A" not in outputs(await person.items("t1"))


async def test_stale_epoch_ask_is_fenced(person: Broker) -> None:
    """An ask with the epoch of a replica whose thread another claimed is refused as Fenced,
    writing nothing."""
    await person.sessions.create("t1", "scripted", "approval", {})
    claimed = await claim_as(person, "t1", "ra", ttl_ms=1)
    assert claimed is not None
    old = claimed
    new = await until(lambda: claim_as(person, "t1", "rb"), "ra's record to run out", within=5)
    assert new > old
    with pytest.raises(Fenced) as e:
        await person.ask("t1", "text", [Question(question="Anything else?")], epoch=old)
    assert e.value.current == new
    assert await person.items("t1") == []
    assert await person.active_prompt("t1") is None
    assert await person.redis.zcard(person.keys.open) == 0
    # the holder's epoch asks
    p = await person.ask("t1", "text", [Question(question="Anything else?")], epoch=new)
    assert (await person.active_prompt("t1")) == p


async def test_lost_lease_is_dropped_and_written_no_more(fleet: Fleet, person: Broker) -> None:
    """A replica whose thread another claimed finds it lost at its heartbeat, drops it, and
    writes nothing more for it."""
    a = await fleet.start("ra")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")
    key = person.thread("t1").session

    async def steal() -> int | None:
        # as if ra had been paused past its deadline: its record ran out and "rb" claimed it
        record = f"{a.replica.incarnation}|0"
        await person.redis.hset(person.keys.replica_records, "ra", record)  # type: ignore[misc]
        return await claim_as(person, "t1", "rb")

    await until(steal, "rb's claim")
    await until(lambda: truthy("t1" not in a.replica.threads), "ra's heartbeat to drop t1")
    assert a.replica.held_count() == 0
    snapshot = await person.redis.hgetall(key)  # type: ignore[misc]
    assert snapshot["owner"] == "rb"

    # the person answers: ra, which held the call, must neither deliver nor write anything
    await person.post_item("t1", text("1"))
    after_answer = await person.items("t1")

    async def untouched() -> bool:
        return (
            await person.redis.hgetall(key) == snapshot  # type: ignore[misc]
            and await person.items("t1") == after_answer
            and (await person.get_prompt("t1", p.prompt_id)).delivered_at is None
            and "t1" not in a.replica.threads
        )

    await stays(untouched, "ra wrote for a thread it lost", duration=1.0)
    assert outputs(after_answer) == ["starting"]


async def test_adoption_race_each_thread_claimed_once(fleet: Fleet, person: Broker) -> None:
    """Two replicas started together on 20 new threads: each thread is claimed by exactly one,
    and runs its turn once."""
    threads = [f"t{i:02d}" for i in range(20)]
    for t in threads:
        await start_thread(person, t, script({"ask": [pick()]}))
    slow: dict[str, Any] = {
        "lease_ttl": 3.0
    }  # no lease may run out under load: epochs count the claims
    a, b = await asyncio.gather(fleet.start("ra", **slow), fleet.start("rb", **slow))

    async def all_asked() -> bool:
        return all([await person.active_prompt(t) is not None for t in threads])

    await until(all_asked, "every thread to ask", within=15)
    held_a, held_b = set(a.replica.threads), set(b.replica.threads)
    assert held_a.isdisjoint(held_b)
    assert held_a | held_b == set(threads)
    for t in threads:
        s = await session(person, t)
        assert s.owner == ("ra" if t in held_a else "rb")
        assert s.epoch == 1, f"{t} was claimed more than once"

    for t in threads:
        await person.post_item(t, text("1"))
    for t in threads:
        items = await turn_ends(person, t)
        assert len(of_type(items, "turn_end")) == 1
        assert len(of_type(items, "pending_prompt")) == 1
        assert outputs(items) == ["Pick one: A"]
        fresh = [x for x in fleet.turns_of(t) if x.resume is None]
        assert len(fresh) == 1, f"{t} ran {len(fresh)} fresh turns"
        assert fresh[0].replica == (await session(person, t)).owner


async def test_sweep_finds_work_whose_bell_was_missed(fleet: Fleet, person: Broker) -> None:
    """A message whose bell nobody heard (the pub/sub connection was down) is found by the look
    its resubscription brings, and runs a turn."""
    r = await fleet.start("r1")
    await start_thread(person, "t1", script({"say": "hello"}))
    await turn_ends(person, "t1")
    await asyncio.sleep(0.3)  # the look its first subscription brought is over
    held = r.replica.threads["t1"]
    r.replica.broker.unlisten("t1", held.listener)  # the bell now rings to nobody
    await person.post_item("t1", text("again"))
    await asyncio.sleep(0.5)
    assert outputs(await person.items("t1")) == ["hello"]  # nobody heard it
    held.listener("wake", {"resubscribed": True})  # what the waiter says once back
    items = await turn_ends(person, "t1", n=2)
    assert outputs(items) == ["hello", "hello"]


# -- closing ---------------------------------------------------------------------------------


async def test_close_an_unknown_thread_writes_nothing(person: Broker) -> None:
    """Closing a thread that has no session raises ThreadNotFound and leaves no partial record:
    the thread can still be created afterwards."""
    with pytest.raises(ThreadNotFound):
        await person.sessions.close("nosuch")
    assert await person.redis.exists(person.thread("nosuch").session) == 0
    assert await person.sessions.get("nosuch") is None
    created = await person.sessions.create("nosuch", "scripted", "approval", ASK)
    assert created.status == "idle"


async def test_close_fences_the_holder_and_cancels_the_open_prompt(
    fleet: Fleet, person: Broker
) -> None:
    """Closing a held thread moves its epoch on (its holder is fenced), frees it, cancels its
    open prompt with the reason; closing it again changes nothing."""
    await fleet.start("r1")
    await start_thread(person, "c1", ASK)
    p = await active(person, "c1")
    before = await session(person, "c1")
    await person.sessions.close("c1", "done here")
    after = await session(person, "c1")
    assert after.status == "closed" and after.owner == "" and after.epoch == before.epoch + 1
    prompt = await person.get_prompt("c1", p.prompt_id)
    assert prompt.state == "cancelled" and prompt.reason == "done here"
    await person.sessions.close("c1")
    assert (await session(person, "c1")).epoch == after.epoch


async def test_a_new_thread_is_indexed_only_once_its_record_exists(settings: Settings) -> None:
    """On a server that has not loaded the scripts yet, a replica claiming from the lease index
    while `create` loads its script must not drop the new thread from the index for good."""
    server = fakeredis.FakeServer()  # fresh: no script loaded
    person = Broker(fakeredis.FakeAsyncRedis(server=server, decode_responses=True), settings)
    rival = Broker(fakeredis.FakeAsyncRedis(server=server, decode_responses=True), settings)
    load = person.redis.script_load

    async def load_while_a_replica_claims(source: str) -> Any:
        await rival.sessions.claim_many(["n1"], "r9", "i1")
        return await load(source)

    person.redis.script_load = load_while_a_replica_claims  # type: ignore[method-assign]
    try:
        await person.sessions.create("n1", "scripted", "approval", ASK)
        assert await person.redis.zscore(person.keys.leases, "n1") is not None
        assert await rival.sessions.claim_many(["n1"], "r9", "i1") == {"n1": 1}
    finally:
        await person.aclose()
        await rival.aclose()


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
