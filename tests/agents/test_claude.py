"""The Claude Code harness against the REAL Claude Code CLI (bundled in claude-agent-sdk), offline.

Every end-to-end test runs in-process replicas (`workers.runtime.replica.Replica`) on the real
redis-server (each test its own key prefix), a "person" answering through a Broker, and the real
CLI talking to `workers.demo.fakes.anthropic` on 127.0.0.1: a scripted model whose requests are
recorded, so each test checks what the model was told (the `tool_result`s). Each replica gets its
own scratch root, so a session resumed on another replica can only come from Redis.

The pure parts are tested without the CLI, each beside its module: the answer shapes in
test_claude_answers.py, the config in test_claude_config.py, the transcript store in
test_claude_store.py, the call log's reading in test_claude_calls.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "claude_agent_sdk",
    reason="claude-agent-sdk is not installed (the `claude` extra): the Claude Code harness and "
    "its bundled CLI are unavailable, so its tests are skipped",
)

from broker import Answer, Broker, Item, Prompt, PromptCancelled, PromptUnavailable
from tests.agents.test_claude_answers import DB, HOST, SIGNALS
from tests.agents.test_claude_store import MemoryStore
from tests.helpers import of_type, outputs, truthy, until
from tests.runtime.test_replica import Fleet, Running, session, status_is
from workers.agents import claude_calls
from workers.agents.claude import ClaudeHarness
from workers.agents.claude_answers import PARKED_APPROVAL
from workers.agents.claude_launch import descendants
from workers.agents.harness import GateVerdict, Interruption, Turn, TurnResult
from workers.demo.fakes.anthropic import (
    FakeAnthropic,
    Reply,
    Script,
    last_user_text,
    text,
    tool_results_in,
    tool_use,
)
from workers.runtime.fleet import Fleet as ProcessFleet

pytestmark = [
    pytest.mark.real_redis,
    # bypassPermissions shadows the callback on purpose (the harness filters this at import;
    # pytest's per-test warning capture resets that filter)
    pytest.mark.filterwarnings("ignore::claude_agent_sdk.CanUseToolShadowedWarning"),
]

#: Claude Code runs take a second or so; give every wait room on a loaded box.
SLOW = 30.0


@pytest.fixture
def backend() -> str:
    """These tests drive real processes: the real redis-server only (no fakeredis run)."""
    return "real"


# -- rig -----------------------------------------------------------------------------------------


@pytest.fixture
def fake() -> Any:
    server = FakeAnthropic(Script({})).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


async def start(
    fleet: Fleet, tmp_path: Path, name: str, harness: Any = None, **settings: Any
) -> Running:
    """A replica whose Claude harness has its own scratch root (nothing shared on disk)."""
    harness = harness or ClaudeHarness(scratch_root=tmp_path / f"scratch-{name}")
    return await fleet.start(name, harnesses={"claude_code": harness}, **settings)


async def new_thread(
    person: Broker,
    fake: FakeAnthropic,
    thread_id: str,
    *,
    marker: str,
    replies: list[Reply],
    work: Path,
    permissions: str = "approval",
    policy: dict[str, Any] | None = None,
) -> None:
    fake.script.conversations[marker] = replies
    config = {"base_url": fake.url, "api_key": "sk-ant-dummy-offline"}
    await person.sessions.create(
        thread_id, "claude_code", permissions, config, work_folder=str(work), policy=policy
    )
    await person.post_item(thread_id, {"content": [{"type": "text", "text": f"{marker}: go"}]})


Begin = Callable[..., Awaitable[Running]]


@pytest.fixture
def begin(fleet: Fleet, person: Broker, fake: FakeAnthropic, tmp_path: Path, work: Path) -> Begin:
    """The usual opening: replica `r1` (with `settings`, and `harness` if given) starts, then
    thread `t1` (in `work`) starts a turn whose model plays `replies`. Returns the replica."""

    async def go(
        marker: str,
        replies: list[Reply],
        *,
        permissions: str = "approval",
        policy: dict[str, Any] | None = None,
        harness: Any = None,
        **settings: Any,
    ) -> Running:
        r1 = await start(fleet, tmp_path, "r1", harness, **settings)
        await new_thread(
            person,
            fake,
            "t1",
            marker=marker,
            replies=replies,
            work=work,
            permissions=permissions,
            policy=policy,
        )
        return r1

    return go


def exists(path: Path) -> bool:
    return path.exists()


def content(path: Path) -> str:
    return path.read_text()


def wrote(marker: Path) -> bool:
    """The command has written its line (the shell creates the file a moment before)."""
    return marker.exists() and marker.read_text() == "RAN\n"


def claude_children() -> list[int]:
    """The Claude Code CLIs (and their supervisors) this test process started, still running."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            exe = Path(f"/proc/{pid}/exe").resolve().name
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if exe == "claude" or b"claude_launch.py" in cmdline:
            found.append(pid)
    return found


async def no_cli_left() -> None:
    await until(lambda: truthy(not claude_children()), "every Claude Code CLI to exit", within=SLOW)


def say(words: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": words}]}


def answers(*labels: list[str]) -> dict[str, Any]:
    """A structured answer set (and some text that must be ignored)."""
    return {
        "content": [{"type": "text", "text": "see my picks"}],
        "metadata": {"answers": [{"answer": list(a)} for a in labels]},
    }


async def ended(person: Broker, thread_id: str, n: int = 1) -> list[Item]:
    """The thread's items once it has `n` turn_end items and is idle."""

    async def check() -> list[Item] | None:
        items = await person.items(thread_id)
        s = await session(person, thread_id)
        return items if len(of_type(items, "turn_end")) >= n and s.status == "idle" else None

    return await until(check, f"{n} turn_end on {thread_id}", within=SLOW)


async def completed_turn(person: Broker, thread_id: str = "t1") -> list[Item]:
    """The thread's items once its one turn has ended, which must be as `completed`."""
    items = await ended(person, thread_id)
    assert [i.metadata.get("status") for i in of_type(items, "turn_end")] == ["completed"]
    return items


async def prompt_on(person: Broker, what: str, thread_id: str = "t1") -> Prompt:
    """The thread's open prompt, once there is one."""
    return await until(lambda: person.active_prompt(thread_id), what, within=SLOW)


def bash(command: str, description: str = "run it") -> dict[str, Any]:
    return tool_use("Bash", {"command": command, "description": description})


def result_of(fake: FakeAnthropic, tool_id: str) -> dict[str, Any]:
    """The (last) tool_result the model received for a call."""
    results = fake.tool_results(tool_id)
    assert results, f"the model never received a tool_result for {tool_id}"
    return results[-1]


def only_result(fake: FakeAnthropic, tool: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's one call of `tool`, and the (last) tool_result it received for it."""
    (call,) = fake.tool_uses(tool)
    return call, result_of(fake, call["id"])


def ask(*questions: dict[str, Any]) -> dict[str, Any]:
    return tool_use("AskUserQuestion", {"questions": list(questions)})


# -- approvals, held -----------------------------------------------------------------------------


async def test_bash_approved_runs(
    begin: Begin, person: Broker, fake: FakeAnthropic, work: Path
) -> None:
    """A Bash call that writes reaches the permission callback as an `approval` prompt shaped
    like the replica's grants; approving it runs the command, and the model sees its result."""
    out = work / "approved.txt"
    script: list[Reply] = [
        [text("Writing the file."), bash(f"echo hi > {out}", "Write hi")],
        [text("Wrote it.")],
    ]
    await begin("APPROVE", script)

    p = await prompt_on(person, "the approval prompt")
    assert p.kind == "approval"
    (q,) = p.questions
    assert q.subject == "Bash"
    assert q.grant_key == f"Bash:echo hi > {out}"
    assert q.question == f"Allow Claude to use `Bash`?\n\n`echo hi > {out}`"
    assert [o.label for o in q.options] == ["Approve", "Deny"]
    assert not exists(out)

    await person.post_item("t1", say("yes"))
    items = await completed_turn(person)
    assert content(out) == "hi\n"
    _, got = only_result(fake, "Bash")
    assert not got.get("is_error")
    assert "Bash completed" in got["text"]
    assert outputs(items) == ["Writing the file.", "Wrote it."]
    state = (await session(person, "t1")).state
    assert state is not None and re.fullmatch(r"[0-9a-f-]{36}", state["session_id"])


async def test_bash_denied_is_not_run_and_the_model_hears_the_words(
    begin: Begin, person: Broker, fake: FakeAnthropic, work: Path
) -> None:
    """A person's denial refuses the call (it never runs), saying the person denied it, with
    their words; it never reads as 'unavailable'."""
    out = work / "denied.txt"
    script: list[Reply] = [[bash(f"touch {out}")], [text("Understood, I will not.")]]
    await begin("DENY", script)
    await prompt_on(person, "the approval prompt")

    await person.post_item("t1", answers(["Deny", "use the staging box instead"]))
    items = await completed_turn(person)
    assert not exists(out)
    _, got = only_result(fake, "Bash")
    assert got["is_error"] is True
    assert got["text"].startswith("The person denied this Bash call.")
    assert 'Their words: "use the staging box instead"' in got["text"]
    assert "unavailable" not in got["text"].lower()
    assert outputs(items) == ["Understood, I will not."]


# -- AskUserQuestion -----------------------------------------------------------------------------


async def test_questions_answered_by_text(
    begin: Begin, person: Broker, fake: FakeAnthropic
) -> None:
    """AskUserQuestion raises `ask_user_question`; a typed number picks a single-select label,
    typed labels pick a multi-select's, and the model gets the SDK's answer shape (exact
    question text = label, multi-select labels joined by ', ')."""
    script: list[Reply] = [[ask(DB)], [ask(SIGNALS)], [text("Thanks.")]]
    await begin("ASK-TEXT", script)

    p1 = await prompt_on(person, "the first question")
    assert p1.kind == "ask_user_question"
    assert [q.question for q in p1.questions] == ["Which database?"]
    assert [o.label for o in p1.questions[0].options] == ["SQLite", "Postgres"]
    assert p1.questions[0].header == "Database"
    await person.post_item("t1", say("2"))

    async def second() -> Any:
        p = await person.active_prompt("t1")
        return p if p is not None and p.prompt_id != p1.prompt_id else None

    p2 = await until(second, "the second question", within=SLOW)
    assert p2.questions[0].multiSelect is True
    await person.post_item("t1", say("Metrics, Logs"))
    await completed_turn(person)

    first, then = fake.tool_uses("AskUserQuestion")
    got1, got2 = result_of(fake, first["id"]), result_of(fake, then["id"])
    assert not got1.get("is_error") and not got2.get("is_error")
    assert '"Which database?"="Postgres"' in got1["text"]
    assert '"Which signals should we collect?"="Metrics, Logs"' in got2["text"]


async def test_questions_answered_by_structured_answers(
    begin: Begin, person: Broker, fake: FakeAnthropic
) -> None:
    """Structured answers for three questions at once: a label with a note (an annotation, and
    the picked option's preview), multi-select labels, and free text."""
    script: list[Reply] = [[ask(DB, SIGNALS, HOST)], [text("Noted.")]]
    await begin("ASK-STRUCT", script)
    p = await prompt_on(person, "the questions")
    assert len(p.questions) == 3

    routed = await person.post_item(
        "t1",
        answers(["SQLite", "small deployment"], ["Metrics", "Logs"], ["on the build server"]),
    )
    assert routed.source == "structured"
    await completed_turn(person)

    _, got = only_result(fake, "AskUserQuestion")
    assert not got.get("is_error")
    assert '"Which database?"="SQLite"' in got["text"]
    assert "notes: small deployment" in got["text"]
    assert '"Which signals should we collect?"="Metrics, Logs"' in got["text"]
    assert '"Where should it run?"="on the build server"' in got["text"]
    assert "see my picks" not in got["text"]


async def test_duplicate_question_texts_never_reach_a_person(
    begin: Begin, person: Broker, fake: FakeAnthropic
) -> None:
    """Claude Code 2.1.332 refuses an AskUserQuestion whose question texts repeat (answers are
    keyed by text) before any permission callback: no prompt is posted, and the model is told
    why. (The harness still maps such answers deliberately: see the unit test below.)"""
    twin = {
        **HOST,
        "options": [{"label": "Here", "description": "a"}, {"label": "There", "description": "b"}],
    }
    script: list[Reply] = [[ask(HOST, twin)], [text("I will ask one at a time.")]]
    await begin("ASK-TWINS", script)
    items = await completed_turn(person)
    assert of_type(items, "pending_prompt") == []
    _, got = only_result(fake, "AskUserQuestion")
    assert got["is_error"] is True and "Question texts must be unique" in got["text"]


# -- parked waits: Claude Code's deferral, resumed on another replica ---------------------------


def request_carrying(fake: FakeAnthropic, tool_id: str) -> dict[str, Any]:
    found = fake.first_request_with(tool_id)
    assert found is not None
    return found.body


async def test_stopped_replica_defers_a_question_and_another_replica_resumes_it(
    begin: Begin, fleet: Fleet, person: Broker, fake: FakeAnthropic, tmp_path: Path
) -> None:
    """A question held in the PreToolUse hook; the replica stops cleanly, which parks the wait:
    the hook defers, the Claude session pauses with the call pending, and the transcript is in
    Redis. The answer comes later; another replica (nothing on its disk) resumes the SAME
    session, Claude Code replays the same tool_use_id, and the model gets the answer as that
    call's tool_result."""
    script: list[Reply] = [[text("One question first."), ask(DB)], [text("SQLite it is.")]]
    r1 = await begin("DEFER-ASK", script, lease_ttl=5.0)
    p = await prompt_on(person, "the question")
    await until(lambda: truthy(r1.replica.held_count() == 1), "the held wait", within=SLOW)

    await fleet.stop(r1)
    s = await status_is(person, "t1", "parked")
    await no_cli_left()  # a parked agent keeps no process
    (call,) = fake.tool_uses("AskUserQuestion")
    assert s.state is not None
    session_id = s.state["session_id"]
    assert s.state["pending"]["deferred"] == call["id"]
    assert s.state["pending"]["prompt_id"] == p.prompt_id
    assert fake.tool_results(call["id"]) == []  # nothing answered it yet
    assert (await person.get_prompt("t1", p.prompt_id)).state == "pending"
    stored = await person.redis.llen(person.thread("t1").agent(f"claude:{session_id}"))
    assert stored > 0

    await start(fleet, tmp_path, "r2", lease_ttl=5.0)
    await person.post_item("t1", say("SQLite"))
    items = await completed_turn(person)
    got = result_of(fake, call["id"])
    assert '"Which database?"="SQLite"' in got["text"]
    assert not got.get("is_error")
    # the replay path: Claude Code's own "continue" after the pending call, not a new message
    assert "Continue from where you left off." in last_user_text(
        request_carrying(fake, call["id"])["messages"]
    )
    assert (await session(person, "t1")).state == {"session_id": session_id}
    assert (await session(person, "t1")).owner == "r2"
    assert outputs(items) == ["One question first.", "SQLite it is."]
    assert not (tmp_path / "scratch-r2" / "runs").exists() or not any(
        (tmp_path / "scratch-r2" / "runs").iterdir()
    )


def retry_if_unavailable(command: str) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The model's move after its Bash call: retry it when told approval was unavailable."""

    def reply(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results = tool_results_in(messages)
        last = list(results.values())[-1]["text"] if results else ""
        if last.startswith("Approval unavailable"):
            return [text("Retrying."), bash(command)]
        return [text(f"Result: {last}")]

    return reply


@dataclass
class Parked:
    session_id: str
    first: dict[str, Any]  # the Bash call refused as unavailable
    retry: dict[str, Any]  # the agent's retry of it, deferred
    out: Path  # what the command writes


@pytest.fixture
async def parked_approval(  # noqa: PLR0917 - fixtures
    begin: Begin, fleet: Fleet, person: Broker, fake: FakeAnthropic, tmp_path: Path, work: Path
) -> Parked:
    """Park a Bash approval on r1 (wait mode parked), stop r1, start r2."""
    out = work / "parked.txt"
    command = f"echo parked > {out}"
    script: list[Reply] = [
        [bash(command)],
        retry_if_unavailable(command),
        retry_if_unavailable(command),
        [text("Done.")],
    ]
    r1 = await begin("PARK-BASH", script, wait_mode="parked", lease_ttl=5.0)
    s = await status_is(person, "t1", "parked")
    await until(
        lambda: truthy(len(fake.tool_uses("Bash")) == 2), "the retry to be deferred", within=SLOW
    )
    s = await status_is(person, "t1", "parked")
    first, retry = fake.tool_uses("Bash")
    assert s.state is not None and s.state["pending"]["deferred"] == retry["id"]
    got = result_of(fake, first["id"])
    assert got["text"] == PARKED_APPROVAL and got["is_error"] is True
    assert fake.tool_results(retry["id"]) == []
    assert not exists(out)
    await fleet.stop(r1)
    await start(fleet, tmp_path, "r2", lease_ttl=5.0)
    return Parked(s.state["session_id"], first, retry, out)


async def test_parked_approval_resumes_the_deferred_retry_on_another_replica(
    parked_approval: Parked, person: Broker, fake: FakeAnthropic
) -> None:
    """Wait mode parked: the approval is refused as unavailable (nobody refused), the agent
    retries, the hook defers the retry, and the turn parks. Approved later, another replica
    resumes the same session; the replayed retry asks again and the one-shot grant answers it;
    Bash runs and the model gets its result under the retry's tool_use_id."""
    await person.post_item("t1", say("yes"))
    items = await completed_turn(person)
    assert content(parked_approval.out) == "parked\n"
    got = result_of(fake, parked_approval.retry["id"])
    assert "Bash completed" in got["text"] and not got.get("is_error")
    (granted,) = of_type(items, "approval_granted")
    assert granted.metadata["subject"] == "Bash"
    assert len(of_type(items, "pending_prompt")) == 1  # the retry did not ask a person again
    assert (await session(person, "t1")).state == {"session_id": parked_approval.session_id}
    assert (await session(person, "t1")).grant is None


async def test_parked_approval_denied_later_refuses_the_retry_with_the_words(
    parked_approval: Parked, person: Broker, fake: FakeAnthropic
) -> None:
    """The same, denied with words: the replayed retry is refused as the person's denial, with
    their words, and never runs; no grant is recorded."""
    await person.post_item("t1", say("no, not on a Friday"))
    items = await completed_turn(person)
    assert not exists(parked_approval.out)
    _, retry = fake.tool_uses("Bash")
    got = result_of(fake, retry["id"])
    assert got["is_error"] is True
    assert got["text"].startswith("The person denied this Bash call.")
    assert 'Their words: "no, not on a Friday"' in got["text"]
    assert of_type(items, "approval_granted") == []


async def test_crashed_replica_resumes_by_message_on_another_replica(  # noqa: PLR0917 - fixtures
    begin: Begin, fleet: Fleet, person: Broker, fake: FakeAnthropic, tmp_path: Path, work: Path
) -> None:
    """A replica dies (no clean stop: its CLI is killed, its lease runs out) while Claude Code
    holds an approval. Another replica adopts the open prompt as parked; the answer resumes the
    same session from Redis with the resume text; Claude Code closes the interrupted call
    itself, the agent retries, and the grant answers the retry."""
    out = work / "crash.txt"
    command = f"echo crash > {out}"

    def after(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if "APPROVED" in last_user_text(messages):
            return [bash(command)]
        return [text("Done.")]

    script: list[Reply] = [[bash(command)], after, after]
    r1 = await begin("CRASH", script)
    p = await prompt_on(person, "the approval prompt")
    await until(lambda: truthy(r1.replica.held_count() == 1), "the held wait", within=SLOW)

    assert claude_children()  # the held wait keeps its CLI running
    await crash(fleet, r1)
    await no_cli_left()
    await start(fleet, tmp_path, "r2")
    await until(lambda: _owner_is(person, "t1", "r2"), "r2 to adopt the thread", within=SLOW)
    await person.post_item("t1", say("yes"))
    items = await completed_turn(person)
    assert content(out) == "crash\n"
    first, retry = fake.tool_uses("Bash")
    assert "interrupted" in result_of(fake, first["id"])["text"]
    assert "Bash completed" in result_of(fake, retry["id"])["text"]
    assert len(of_type(items, "approval_granted")) == 1
    assert (await person.get_prompt("t1", p.prompt_id)).state == "answered"
    await no_cli_left()


async def _owner_is(person: Broker, thread_id: str, owner: str) -> bool:
    s = await session(person, thread_id)
    return s.owner == owner and s.status == "parked"


async def crash(fleet: Fleet, r: Running) -> None:
    """Kill a replica in process: every task cancelled, no clean stop, its lease left to run out
    (the harness kills its CLI on cancellation, as the OS would with the process)."""
    replica = r.replica

    async def no_shutdown() -> None:
        return None

    replica.shutdown = no_shutdown  # type: ignore[method-assign]
    tasks = [*replica._tasks, *(t.task for t in replica.threads.values() if t.task is not None)]
    for task in tasks:
        task.cancel()
    r.task.cancel()
    await asyncio.gather(*tasks, r.task, return_exceptions=True)
    fleet.running.remove(r)
    await r.broker.aclose()


async def test_every_deferred_question_resumes_whether_or_not_the_hook_fires(
    begin: Begin, person: Broker, fake: FakeAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    """claude-agent-sdk-python #993: on resume, the PreToolUse hook fires only sometimes. Six
    questions in a row, each parked by deferral and resumed: every one is answered once, as its
    own call's tool_result, and none is deferred twice, whichever way each resume went."""
    caplog.set_level(logging.INFO, logger="workers.agents.claude")
    rounds = 6
    questions = [{**DB, "question": f"Which database for service {i}?"} for i in range(rounds)]
    script: list[Reply] = [[ask(q)] for q in questions] + [[text("All chosen.")]]
    await begin("RACE", script, wait_mode="parked")
    seen: set[str] = set()
    for i in range(rounds):

        async def parked_on_a_new_prompt() -> Any:
            s = await session(person, "t1")
            fresh = s.waiting is not None and s.waiting.prompt_id not in seen
            return s if s.status == "parked" and fresh else None

        s = await until(parked_on_a_new_prompt, f"question {i} to park", within=SLOW)
        assert s.waiting is not None and s.state is not None
        seen.add(s.waiting.prompt_id)
        assert s.state["pending"]["deferred"] == fake.tool_uses("AskUserQuestion")[i]["id"]
        await person.post_item("t1", say("1" if i % 2 == 0 else "2"))
    items = await completed_turn(person)
    calls = fake.tool_uses("AskUserQuestion")
    assert len(calls) == rounds
    for i, call in enumerate(calls):
        want = "SQLite" if i % 2 == 0 else "Postgres"
        assert f'"Which database for service {i}?"="{want}"' in result_of(fake, call["id"])["text"]
    assert len(of_type(items, "pending_prompt")) == rounds
    fired = sum(1 for r in caplog.records if r.getMessage() == "claude.replay_hook")
    print(f"#993: the hook fired on {fired} of {rounds} resumes")  # either way is correct


class Wrapped:
    """The Claude harness (scratch root `scratch-r1`, as `start` gives replica r1), each turn
    changed first by `adapt`."""

    name = "claude_code"

    def __init__(self, tmp_path: Path) -> None:
        self.inner = ClaudeHarness(scratch_root=tmp_path / "scratch-r1")

    def adapt(self, turn: Turn) -> None:
        raise NotImplementedError

    async def run_turn(self, turn: Turn) -> TurnResult:
        self.adapt(turn)
        return await self.inner.run_turn(turn)


class Refusing(Wrapped):
    """The Claude harness with a prompt handle that cannot deliver approvals and whose questions
    are cancelled."""

    async def ask(self, kind: str, questions: Any, *, state: Any = None) -> list[Answer]:
        if kind == "approval":
            raise PromptUnavailable("t1", "redis is down")
        raise PromptCancelled("prm_x", "superseded")

    def adapt(self, turn: Turn) -> None:
        turn.handle = self


async def test_unavailable_and_cancelled_say_nobody_refused(
    begin: Begin, person: Broker, fake: FakeAnthropic, tmp_path: Path, work: Path
) -> None:
    """An approval that could not be delivered and a cancelled question are refused with
    messages saying nobody refused (so the agent asks again), never as a person's denial."""
    out = work / "never.txt"
    harness = Refusing(tmp_path)
    script: list[Reply] = [[bash(f"touch {out}")], [ask(DB)], [text("I will ask again later.")]]
    await begin("REFUSE", script, harness=harness)
    await completed_turn(person)
    assert not exists(out)
    _, got = only_result(fake, "Bash")
    assert got["text"].startswith(
        "Approval unavailable: the request could not be delivered to a person (redis is down)."
    )
    assert "Nobody refused this call" in got["text"] and "denied" not in got["text"]
    (question,) = fake.tool_uses("AskUserQuestion")
    got = result_of(fake, question["id"])
    assert got["text"].startswith(
        "Unanswered: the question was cancelled (superseded) before anyone answered."
    )
    assert "Nobody refused to answer" in got["text"]


# -- permission modes ----------------------------------------------------------------------------


async def test_autonomous_runs_tools_silently_but_still_asks_questions(
    begin: Begin, person: Broker, fake: FakeAnthropic, work: Path
) -> None:
    """Autonomous: Bash runs with no approval prompt (bypassPermissions, IS_SANDBOX=1 as root),
    and AskUserQuestion still reaches a person."""
    out = work / "auto.txt"
    script: list[Reply] = [[bash(f"echo auto > {out}")], [ask(DB)], [text("Done.")]]
    await begin("AUTO", script, permissions="autonomous")
    p = await prompt_on(person, "the question")
    assert p.kind == "ask_user_question"
    assert content(out) == "auto\n"
    await person.post_item("t1", say("1"))
    items = await completed_turn(person)
    assert [i.metadata["prompt"]["kind"] for i in of_type(items, "pending_prompt")] == [
        "ask_user_question"
    ]
    (call,) = fake.tool_uses("AskUserQuestion")
    assert '"Which database?"="SQLite"' in result_of(fake, call["id"])["text"]


class Gated(Wrapped):
    """The Claude harness under `guarded`, with a policy gate of the test's own."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def gate(self, harness: str, tool: str, tool_input: dict[str, Any]) -> GateVerdict:
        self.calls.append((harness, tool, tool_input))
        command = str(tool_input.get("command", ""))
        if "forbidden" in command:
            return GateVerdict("deny", rule="no-forbidden", effect="write", detail=command)
        if "allowed" in command:
            return GateVerdict("allow", rule="ok-allowed", effect="write", detail=command)
        return GateVerdict("ask", rule="ask-rest", effect="write", detail=command)

    def adapt(self, turn: Turn) -> None:
        turn.permissions = "guarded"
        turn.gate = self.gate


async def test_guarded_gate_allows_denies_and_asks(
    begin: Begin, person: Broker, fake: FakeAnthropic, tmp_path: Path, work: Path
) -> None:
    """Guarded: the gate is asked first; allow runs silently, deny refuses naming the rule,
    ask raises an ordinary approval prompt."""
    gated = Gated(tmp_path)
    allowed, forbidden, other = work / "allowed.txt", work / "forbidden.txt", work / "other.txt"
    script: list[Reply] = [
        [bash(f"touch {allowed}")],
        [bash(f"touch {forbidden}")],
        [bash(f"touch {other}")],
        [text("Done.")],
    ]
    await begin("GUARDED", script, permissions="approval", harness=gated)
    p = await prompt_on(person, "the approval prompt")
    assert p.questions[0].grant_key == f"Bash:touch {other}"
    await person.post_item("t1", say("yes"))
    items = await completed_turn(person)
    assert exists(allowed) and exists(other) and not exists(forbidden)
    _, denied, _ = fake.tool_uses("Bash")
    got = result_of(fake, denied["id"])
    assert got["text"] == "Denied by policy rule 'no-forbidden'" and got["is_error"] is True
    assert [c[:2] for c in gated.calls] == [("claude_code", "Bash")] * 3
    assert len(of_type(items, "pending_prompt")) == 1


async def test_guarded_routes_read_only_calls_through_the_gate(
    begin: Begin, person: Broker, fake: FakeAnthropic, work: Path
) -> None:
    """Guarded: calls Claude Code's own engine allows silently (a Read inside the work folder, a
    read-only `echo`) reach the gate too, so the worker's deny rules bind them: both are refused
    naming the rule, each with a `policy_denied` item, and the file's text never reaches the
    model; a call the rules allow still runs."""
    notes = work / "notes.txt"
    notes.write_text("the secret is XYZZY-7731\n")
    worker = [
        {"id": "w-no-read", "effect": "read", "action": "deny"},
        {"id": "w-no-echo", "effect": "exec", "action": "deny", "command": ["echo *"]},
    ]
    script: list[Reply] = [
        [tool_use("Read", {"file_path": str(notes)}), bash("echo two"), bash("pwd")],
        [text("Done.")],
    ]
    await begin(
        "GUARD-READ",
        script,
        permissions="guarded",
        policy={"default": "allow"},
        policy_rules=worker,
    )
    items = await completed_turn(person)
    (read,) = fake.tool_uses("Read")
    echo, pwd = fake.tool_uses("Bash")
    got = result_of(fake, read["id"])
    assert got["is_error"] is True and got["text"] == "Denied by policy rule 'w-no-read'"
    got = result_of(fake, echo["id"])
    assert got["is_error"] is True and got["text"] == "Denied by policy rule 'w-no-echo'"
    assert str(work) in result_of(fake, pwd["id"])["text"]  # allowed: it ran
    assert "XYZZY-7731" not in str([r.body for r in fake.main_requests()])
    assert sorted(i.metadata["rule"] for i in of_type(items, "policy_denied")) == [
        "w-no-echo",
        "w-no-read",
    ]
    assert of_type(items, "pending_prompt") == []


async def test_guarded_question_still_parks_by_deferral_and_resumes(
    begin: Begin, fleet: Fleet, person: Broker, fake: FakeAnthropic, tmp_path: Path
) -> None:
    """Guarded's ask-every-call hook does not outvote the harness's deferral: a parked question
    still pauses the session with the call pending, and the answer resumes it on another
    replica as that call's tool_result."""
    script: list[Reply] = [[ask(DB)], [text("SQLite it is.")]]
    r1 = await begin(
        "GUARD-PARK", script, permissions="guarded", policy={"default": "allow"}, wait_mode="parked"
    )
    s = await status_is(person, "t1", "parked")
    (call,) = fake.tool_uses("AskUserQuestion")
    assert s.state is not None and s.state["pending"]["deferred"] == call["id"]
    await fleet.stop(r1)
    await start(fleet, tmp_path, "r2")
    await person.post_item("t1", say("SQLite"))
    await completed_turn(person)
    assert '"Which database?"="SQLite"' in result_of(fake, call["id"])["text"]


# -- the pure parts ------------------------------------------------------------------------------


@pytest.fixture
def memory() -> MemoryStore:
    """A thread's agent store, in memory."""
    return MemoryStore()


@pytest.fixture
def harness(tmp_path: Path) -> ClaudeHarness:
    """A Claude harness run directly (no replica), with a scratch root of its own."""
    return ClaudeHarness(scratch_root=tmp_path / "scratch")


def test_quiet_env_is_the_four_quieting_variables() -> None:
    """The quieting variables are the notes' four."""
    from workers.agents.claude import QUIET_ENV

    assert set(QUIET_ENV) == {
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "DISABLE_TELEMETRY",
        "DISABLE_AUTOUPDATER",
        "DISABLE_ERROR_REPORTING",
    }


# -- real replica processes: the CLI dies with its replica ---------------------------------------


def started_under(root: Path) -> dict[int, str]:
    """Live processes (pid -> name) whose environment points into `root`: the supervisor, the
    CLI and every command it ran inherit the run's scratch HOME, wherever they were re-parented."""
    found = {}
    needle = str(root).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        name, state = (
            stat[stat.index("(") + 1 : stat.rindex(")")],
            stat.rsplit(")", 1)[1].split()[0],
        )
        if state != "Z" and any(v.startswith(b"HOME=" + needle) for v in environ.split(b"\0")):
            found[int(entry)] = name
    return found


@contextlib.asynccontextmanager
async def process_fleet(
    person: Broker, real_redis_url: str, tmp_path: Path, workers: int = 1
) -> AsyncIterator[tuple[ProcessFleet, Path]]:
    """Real replica processes (`python -m workers.runtime.cli worker`, the default harnesses) on the
    test's Redis and key prefix, lease TTL 2 s; the Claude scratch root under `tmp_path`."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    settings = person.settings.model_copy(
        update={
            "redis_url": real_redis_url,
            "lease_ttl": 2.0,
            "adopt_interval": 0.1,
            "sweep_interval": 1.0,
        }
    )
    logs = tmp_path / "logs"
    fleet = ProcessFleet(
        settings, workers=workers, env={"TMPDIR": str(tmp)}, restart=False, log_dir=logs
    )
    try:
        await fleet.start()
        await fleet.ready()
        yield fleet, tmp / "prompt-broker-claude"
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            print(f"===== {log.name}\n{log.read_text(errors='replace')[-6000:]}")
        raise
    finally:
        await fleet.stop()


async def test_sigkilled_replica_takes_its_cli_and_the_command_with_it(
    person: Broker, fake: FakeAnthropic, real_redis_url: str, tmp_path: Path, work: Path
) -> None:
    """A real replica process runs a real Claude Code turn whose Bash command is still running
    (in a session of its own, as Claude Code starts every command); SIGKILL the replica: one
    second later no process it started is alive (the supervisor's parent-death signal)."""
    marker = work / "marker"
    async with process_fleet(person, real_redis_url, tmp_path) as (fleet, root):
        script: list[Reply] = [[bash(f"echo RAN >> {marker}; sleep 30")], [text("Done.")]]
        await new_thread(
            person, fake, "t1", marker="KILL-9", replies=script, work=work, permissions="autonomous"
        )
        await until(
            lambda: truthy("sleep" in started_under(root).values()), "the command", within=SLOW
        )
        before = started_under(root)
        assert "claude" in before.values() and "sleep" in before.values(), before
        fleet.kill("replica-1", signal.SIGKILL)
        await asyncio.sleep(1.0)  # the window is the requirement: nothing alive 1 s after the kill
        assert started_under(root) == {}
    assert content(marker) == "RAN\n"


# -- a call in flight when the turn is cut off ---------------------------------------------------


class Approving:
    """A prompt handle that approves every approval at once."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def ask(self, kind: str, questions: Any, *, state: Any = None) -> list[Answer]:
        self.asked.append(kind)
        return [Answer(question=questions[0].question, answer=["Approve"])]


def direct_turn(
    fake: FakeAnthropic, work: Path, store: MemoryStore, prompt: str, **fields: Any
) -> Turn:
    async def emit(line: str) -> None:
        return None

    return Turn(
        thread_id="t1",
        prompt=prompt,
        permissions="approval",
        config={"base_url": fake.url, "api_key": "sk-ant-dummy-offline"},
        state=None,
        handle=Approving(),
        emit=emit,
        work_folder=str(work),
        store=store,
        **fields,
    )


async def cut_off(harness: ClaudeHarness, turn: Turn, ready: Callable[[], bool], what: str) -> None:
    """Run a turn until `ready`, then cancel it as a lost lease would: the harness kills the
    CLI and every command it started."""
    task = asyncio.create_task(harness.run_turn(turn))
    await until(lambda: truthy(ready() or task.done()), what, within=SLOW)
    assert not task.done(), task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await no_cli_left()
    assert started_under(harness.root) == {}  # the command went with its CLI


def hold_reply(
    gate: threading.Event, asked: threading.Event
) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The model's reply, the first time held until `gate` is set (`asked` says it is
    pending); later asks (the resumed session's) are answered at once."""

    def reply(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not asked.is_set():
            asked.set()
            gate.wait(SLOW)
        return [text("Done.")]

    return reply


async def test_a_call_cut_off_while_running_is_said_interrupted_and_the_agent_is_told_first(
    fake: FakeAnthropic, harness: ClaudeHarness, memory: MemoryStore, work: Path
) -> None:
    """The turn is cut off while its approved command runs: the call log has it allowed with no
    result, so it is "interrupted; it may or may not have taken effect", never "aborted" or
    "failed". The next turn continues the same session and tells the model that note before
    its input; the command ran once."""
    marker = work / "marker"
    command = f"echo RAN >> {marker}; sleep 8"
    fake.script.conversations["CUT-RUN"] = [[bash(command)], [text("Done.")]]
    fake.script.conversations["CUT-RUN"].append([text("I will check the marker first.")])
    turn = direct_turn(fake, work, memory, "CUT-RUN: go")
    await cut_off(harness, turn, lambda: wrote(marker), "the command to write")

    note = await harness.describe_interruption("t1", None, memory)
    assert note == (
        f"Bash `{command}` was interrupted; it may or may not have taken effect; check before "
        "running it again"
    )
    sent = len(fake.main_requests())
    nxt = direct_turn(
        fake, work, memory, "What now?", interrupted=Interruption(delivered=None, note=note)
    )
    result = await harness.run_turn(nxt)
    assert result.status == "completed", result
    told = last_user_text(fake.main_requests()[sent].messages)
    assert told.startswith("[Your previous turn was cut off before it ended")
    assert note in told and told.endswith("What now?")
    assert told.index(note) < told.index("What now?")
    (call,) = fake.tool_uses("Bash")
    seen = " ".join(r["text"] for r in fake.tool_results(call["id"])).lower()
    assert "aborted" not in seen and "failed" not in seen
    assert content(marker) == "RAN\n"  # once: nothing re-ran it
    assert result.state is not None  # the same session went on
    assert result.state["session_id"] == claude_calls.last_session(memory.data[claude_calls.CALLS])


async def test_a_call_whose_result_was_recorded_is_said_to_have_run_with_its_exit_code(
    fake: FakeAnthropic, harness: ClaudeHarness, memory: MemoryStore, work: Path
) -> None:
    """The turn is cut off after the command finished, while the model's next reply is
    pending: its result was recorded as it arrived, so it "ran, exit code N"."""
    marker = work / "marker"
    command = f"echo RAN >> {marker}; exit 3"
    gate, asked = threading.Event(), threading.Event()
    fake.script.conversations["CUT-AFTER"] = [[bash(command)], hold_reply(gate, asked)]
    turn = direct_turn(fake, work, memory, "CUT-AFTER: go")
    try:
        await cut_off(harness, turn, asked.is_set, "the model's next request")
    finally:
        gate.set()
    assert await harness.describe_interruption("t1", None, memory) == (
        f"Bash `{command}` ran, exit code 3"
    )
    assert content(marker) == "RAN\n"


async def test_describe_interruption_says_what_is_not_known_when_the_log_cannot_be_read(
    harness: ClaudeHarness, memory: MemoryStore
) -> None:
    class Broken:
        async def append(self, key: str, entries: Any) -> None:
            raise OSError("down")

        async def load(self, key: str) -> list[Any] | None:
            raise OSError("down")

    note = await harness.describe_interruption("t1", None, Broken())
    assert "may or may not have taken effect" in note
    assert await harness.describe_interruption("t1", None, None) == ""
    assert await harness.describe_interruption("t1", None, memory) == ""


# -- end to end: two replica processes, the one running an approved command SIGKILLed ------------

RAN_COMMAND = "echo RAN >> {marker}; sleep 8"


async def owner_of(person: Broker, thread_id: str) -> str:
    async def owned() -> str | None:
        return (await session(person, thread_id)).owner or None

    return await until(owned, f"an owner for {thread_id}", within=SLOW)


async def interrupted_item(person: Broker, thread_id: str) -> Item:
    async def found() -> Item | None:
        marked = [i for i in await person.items(thread_id) if i.metadata.get("interrupted")]
        return marked[0] if marked else None

    return await until(found, "the interruption item", within=SLOW)


async def crash_an_approved_command(
    person: Broker,
    fake: FakeAnthropic,
    real_redis_url: str,
    tmp_path: Path,
    work: Path,
    *,
    marker_name: str,
    kill_when: Callable[[], Awaitable[bool]],
    then: Reply,
) -> tuple[Item, str, dict[str, Any]]:
    """Two replica processes; a person approves `echo RAN >> marker; sleep 8`; the replica
    running it is SIGKILLed when `kill_when()`; the other adopts the thread and the person sends
    one more message. Returns the interruption item, what the model was told next (the text
    of the request carrying that message) and the Bash call."""
    marker = work / "marker"
    command = RAN_COMMAND.format(marker=marker)
    async with process_fleet(person, real_redis_url, tmp_path, workers=2) as (fleet, root):
        script: list[Reply] = [[bash(command)], then, [text("I will check the marker.")]]
        await new_thread(person, fake, "t1", marker=marker_name, replies=script, work=work)
        await prompt_on(person, "the approval prompt")
        owner = await owner_of(person, "t1")
        await person.post_item("t1", say("yes"))
        await until(kill_when, "the moment to kill", within=SLOW)
        fleet.kill(owner, signal.SIGKILL)
        item = await interrupted_item(person, "t1")
        assert (await session(person, "t1")).owner != owner
        sent = len(fake.main_requests())
        await person.post_item("t1", say("What now?"))
        await ended(person, "t1")
        told = [last_user_text(r.messages) for r in fake.main_requests()[sent:]]
        await asyncio.sleep(1.0)  # a negative window: nothing runs the command again meanwhile
        assert not [n for n in started_under(root).values() if n == "sleep"]
    (call,) = fake.tool_uses("Bash")
    assert content(marker) == "RAN\n"  # it ran once, and nothing ran it again
    assert told and "What now?" in told[0]
    return item, told[0], call


async def test_replica_killed_while_an_approved_command_runs(
    person: Broker, fake: FakeAnthropic, real_redis_url: str, tmp_path: Path, work: Path
) -> None:
    """Killed mid-command: the person's thread item and the model's next message both say the
    call was interrupted and may or may not have taken effect (never aborted or failed), and
    what the turn had been handed (the approval); the command ran once."""
    marker = work / "marker"
    item, told, call = await crash_an_approved_command(
        person,
        fake,
        real_redis_url,
        tmp_path,
        work,
        marker_name="E2E-DURING",
        kill_when=lambda: truthy(wrote(marker)),
        then=[text("Done.")],
    )
    note = (
        f"Bash `{RAN_COMMAND.format(marker=marker)}` was interrupted; it may or may not have "
        "taken effect; check before running it again"
    )
    words = outputs([item])[0]
    assert note in words and "approved `Bash`" in words
    assert item.metadata["interrupted"]["note"] == note
    assert told.startswith("[Your previous turn was cut off") and note in told
    assert told.index(note) < told.index("What now?")
    seen = " ".join(r["text"] for r in fake.tool_results(call["id"])).lower()
    assert "aborted" not in seen and "failed" not in seen


async def test_replica_killed_after_the_command_while_the_model_reply_is_pending(
    person: Broker, fake: FakeAnthropic, real_redis_url: str, tmp_path: Path, work: Path
) -> None:
    """Killed after the command finished, while the model's next reply is pending: its result
    was recorded as it arrived, so the item and the model's next message say it ran, exit
    code 0; the command ran once."""
    gate, asked = threading.Event(), threading.Event()

    async def result_recorded() -> bool:
        # the model has been asked again, and the replica has recorded the result it sent
        # (on a loaded box the replica may record it a moment after the request goes out)
        raw = await person.redis.lrange(person.thread("t1").agent(claude_calls.CALLS), 0, -1)
        return asked.is_set() and any(b'"e":"result"' in r.encode() for r in raw)

    try:
        item, told, call = await crash_an_approved_command(
            person,
            fake,
            real_redis_url,
            tmp_path,
            work,
            marker_name="E2E-AFTER",
            kill_when=result_recorded,
            then=hold_reply(gate, asked),
        )
    finally:
        gate.set()
    note = f"Bash `{RAN_COMMAND.format(marker=work / 'marker')}` ran, exit code 0"
    assert note in outputs([item])[0]
    assert item.metadata["interrupted"]["note"] == note
    assert note in told and told.index(note) < told.index("What now?")
    assert "Bash completed" in result_of(fake, call["id"])["text"]


def test_a_replica_imports_the_claude_sdk_on_first_use_not_at_start() -> None:
    """`default_harnesses` registers claude_code without importing the SDK (most of a
    replica's start); the first use imports it, and `warm` does so on a thread of its own."""
    import subprocess
    import sys

    code = """
import sys, time
from workers.runtime.replica import OnFirstUse, default_harnesses
h = default_harnesses()["claude_code"]
assert isinstance(h, OnFirstUse) and h.name == "claude_code" and not h.loaded
assert "claude_agent_sdk" not in sys.modules and "workers.agents.claude" not in sys.modules
h.warm()
deadline = time.monotonic() + 60
while not h.loaded and time.monotonic() < deadline:
    time.sleep(0.01)
from workers.agents.claude import ClaudeHarness
assert isinstance(h.load(), ClaudeHarness) and h.load() is h.load()
assert h.root == h.load().root  # the harness's own attributes, through it
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
