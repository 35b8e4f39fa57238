"""The scripted harness: a test-double agent driven by a JSON script (workers/agents/scripted.py).

Pure unit tests: an in-memory prompt handle answers, parks, cancels or fails each `ask` as a test
scripts it, and `emit` collects the agent's output. No Redis, no replica.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from broker import (
    Answer,
    Kind,
    PromptCancelled,
    PromptUnavailable,
    Question,
    map_text,
    verdict,
)
from workers.agents import scripted
from workers.agents.harness import (
    AgentStore,
    Harness,
    Interruption,
    Permissions,
    PromptParked,
    Resume,
    Turn,
    TurnResult,
    approval_question,
)
from workers.agents.scripted import ScriptedHarness, validate_config

# -- helpers -------------------------------------------------------------------------------------

#: A reply the fake handle gives: typed text (mapped as the broker maps it), structured labels
#: (one list per question), or an exception to raise.
Reply = str | list[list[str]] | BaseException


class FakeHandle:
    """An in-memory prompt handle: records every ask and answers with the next scripted reply."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.asked: list[tuple[Kind, list[Question]]] = []
        self.states: list[dict[str, Any] | None] = []

    async def ask(
        self, kind: Kind, questions: Sequence[Question], *, state: dict[str, Any] | None = None
    ) -> list[Answer]:
        self.asked.append((kind, list(questions)))
        self.states.append(state)
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, str):
            return map_text(kind, questions, reply)
        return [
            Answer(question=q.question, answer=a) for q, a in zip(questions, reply, strict=True)
        ]


class Run:
    """One turn's inputs and what came out of it."""

    def __init__(self, result: TurnResult, out: list[str], handle: FakeHandle) -> None:
        self.result = result
        self.out = out
        self.handle = handle

    @property
    def text(self) -> str:
        return "\n".join(self.out)


async def run(
    config: dict[str, Any],
    *replies: Reply,
    prompt: str = "go",
    permissions: Permissions = "approval",
    state: dict[str, Any] | None = None,
    resume: Resume | None = None,
    store: AgentStore | None = None,
    interrupted: Interruption | None = None,
    work_folder: str = "",
) -> Run:
    """Run one turn on a fresh harness (as a replica would: nothing carried in memory)."""
    out: list[str] = []
    handle = FakeHandle(*replies)

    async def emit(text: str) -> None:
        out.append(text)

    turn = Turn(
        thread_id="thr_1",
        prompt=prompt,
        permissions=permissions,
        config=config,
        # through JSON, as Redis stores it
        state=orjson.loads(orjson.dumps(state)) if state is not None else None,
        handle=handle,
        emit=emit,
        resume=resume,
        store=store,
        interrupted=interrupted,
        work_folder=work_folder,
    )
    result = await ScriptedHarness().run_turn(turn)
    assert not handle.replies, "every scripted reply is used"
    return Run(result, out, handle)


def steps(*steps: dict[str, Any], match: str | None = None) -> dict[str, Any]:
    """An inline-script config with one entry."""
    entry: dict[str, Any] = {"steps": list(steps)}
    if match is not None:
        entry["match"] = match
    return {"script": {"turns": [entry]}}


DEPLOY = {"tool": "Bash", "input": {"command": "make deploy"}, "output": "deployed"}
PICK = {"question": "Target?", "options": [{"label": "staging"}, {"label": "production"}]}
CARDS = {
    "question": "Which cards?",
    "multiSelect": True,
    "options": [{"label": "KPI cards"}, {"label": "Table"}, {"label": "Chart"}],
}
NOTE = {"question": "Anything else?"}


def parked(kind: str = "approval", subject: str = "Bash") -> PromptParked:
    return PromptParked("prm_1", kind, subject)


def resume_of(kind: Kind, answers: list[Answer], subject: str = "Bash", text: str = "") -> Resume:
    """The Resume a replica builds from the answer to a parked prompt."""
    v = verdict(answers) if kind == "approval" else None
    return Resume(
        prompt_id="prm_1", kind=kind, subject=subject, answers=answers, verdict=v, text=text
    )


def says_nobody_refused(text: str) -> bool:
    """The line names no refusal or denial, other than to say nobody refused."""
    low = text.lower().replace("nobody refused", "")
    return not any(word in low for word in ("refus", "denied", "deny", "reject"))


# -- steps ---------------------------------------------------------------------------------------


async def test_harness_is_named_scripted() -> None:
    """ScriptedHarness satisfies the Harness protocol under the name `scripted`."""
    harness: Harness = ScriptedHarness()
    assert harness.name == "scripted"


async def test_say_emits_text_and_completes() -> None:
    """A say step posts its text as agent output; the turn completes with no state."""
    r = await run(steps({"say": "hello"}, {"say": "world"}))
    assert r.out == ["hello", "world"]
    assert r.result.status == "completed" and r.result.state is None


async def test_tool_asks_the_shared_approval_question() -> None:
    """Under approval permissions a tool step asks exactly `approval_question(tool, input)`."""
    r = await run(steps(DEPLOY), "yes")
    assert r.handle.asked == [("approval", [approval_question("Bash", {"command": "make deploy"})])]
    q = r.handle.asked[0][1][0]
    assert (q.subject, q.grant_key) == ("Bash", "Bash:make deploy")


async def test_tool_approved_by_typed_yes_runs() -> None:
    """A typed `yes` approves: the call runs and its output is shown, then the next step runs."""
    r = await run(steps(DEPLOY, {"say": "done"}), "yes")
    assert r.out == ["Ran Bash `make deploy`:\ndeployed", "done"]
    assert r.result.status == "completed"


async def test_tool_approved_by_structured_lowercase_approve() -> None:
    """A structured lowercase `approve` label approves (the shared verdict, not == "Approve")."""
    r = await run(steps(DEPLOY), [["approve"]])
    assert r.out == ["Ran Bash `make deploy`:\ndeployed"]


async def test_tool_denied_by_typed_no() -> None:
    """A typed `no` is a person's denial: the call does not run and the next step does."""
    r = await run(steps(DEPLOY, {"say": "next"}), "no")
    assert r.out == ["Did not run Bash `make deploy`: the person denied it.", "next"]
    assert "deployed" not in r.text
    assert r.result.status == "completed"


async def test_tool_with_prose_reply_is_denied() -> None:
    """Prose such as `yes, but not on main` is not an approval."""
    r = await run(steps(DEPLOY), "yes, but not on main")
    assert "the person denied it" in r.text


async def test_tool_without_detail_or_output() -> None:
    """A call with no command or path is named by its tool; no output is said so."""
    r = await run(steps({"tool": "WebFetch"}), "y")
    assert r.out == ["Ran WebFetch (no output)."]
    assert r.handle.asked[0][1][0].grant_key == "WebFetch"


async def test_autonomous_runs_without_asking() -> None:
    """Under autonomous permissions a tool call runs with no prompt."""
    r = await run(steps(DEPLOY), permissions="autonomous")
    assert r.handle.asked == []
    assert r.out == ["Ran Bash `make deploy`:\ndeployed"]


async def test_ask_single_select_by_number() -> None:
    """A single-select question answered `2` renders the second option's label."""
    r = await run(steps({"ask": [PICK]}), "2")
    assert r.handle.asked[0][0] == "ask_user_question"
    assert r.handle.asked[0][1] == [Question.model_validate(PICK)]
    assert r.out == ["Target? production"]


async def test_ask_multi_select_joins_labels() -> None:
    """A multi-select answer renders its labels joined by `, `."""
    r = await run(steps({"ask": [CARDS]}), "KPI cards, Table")
    assert r.out == ["Which cards? KPI cards, Table"]


async def test_ask_free_text() -> None:
    """A free-text question renders the text as typed."""
    r = await run(steps({"ask": [NOTE]}), "ship it friday")
    assert r.out == ["Anything else? ship it friday"]


async def test_ask_several_questions_one_line_each() -> None:
    """Several questions in one ask render one line each, in order."""
    qs = [PICK, CARDS, NOTE, {"question": "Branch", "options": [{"label": "main"}]}]
    r = await run(steps({"ask": qs}), [["staging"], ["Table", "Chart"], ["later"], []])
    assert r.out == [
        "Target? staging\nWhich cards? Table, Chart\nAnything else? later\nBranch: (no answer)"
    ]


@pytest.mark.parametrize(
    "error",
    [PromptCancelled("prm_1", "superseded"), PromptUnavailable("thr_1", "redis is down")],
    ids=["cancelled", "unavailable"],
)
async def test_unanswered_approval_never_says_anyone_refused(error: Exception) -> None:
    """A cancelled or undelivered approval: the call does not run, nobody refused, on we go."""
    r = await run(steps(DEPLOY, {"say": "next"}), error)
    line = r.out[0]
    assert line.startswith("Did not run Bash `make deploy`:")
    assert "Nobody refused it." in line
    assert says_nobody_refused(line)
    assert ("superseded" if isinstance(error, PromptCancelled) else "redis is down") in line
    assert r.out[1:] == ["next"]
    assert r.result.status == "completed"


@pytest.mark.parametrize(
    "error",
    [PromptCancelled("prm_1", "thread_restart"), PromptUnavailable("thr_1", "post failed")],
    ids=["cancelled", "unavailable"],
)
async def test_unanswered_question_never_says_anyone_refused(error: Exception) -> None:
    """A cancelled or undelivered question went unanswered; nobody refused it; the turn goes on."""
    r = await run(steps({"ask": [PICK]}, {"say": "next"}), error)
    line = r.out[0]
    assert line.startswith('The question "Target?" went unanswered:')
    assert "Nobody refused it." in line
    assert says_nobody_refused(line)
    assert r.out[1:] == ["next"]


async def test_fail_ends_the_turn() -> None:
    """A fail step fails the turn with its message; later steps do not run."""
    r = await run(steps({"say": "trying"}, {"fail": "compiler exploded"}, {"say": "never"}))
    assert r.result.status == "failed" and r.result.error == "compiler exploded"
    assert r.out == ["trying"]


async def test_sleep_waits_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleep step waits its seconds, capped at 60."""
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    r = await run(steps({"sleep": 0.5}, {"sleep": 3600}, {"say": "awake"}))
    assert slept == [0.5, 60.0]
    assert r.out == ["awake"]


# -- choosing the entry --------------------------------------------------------------------------


MULTI = {
    "script": {
        "turns": [
            {"match": "deploy", "steps": [{"say": "deploying"}]},
            {"steps": [{"say": "fallback"}]},
            {"match": "test", "steps": [{"say": "testing"}]},
            {"steps": [{"say": "second fallback"}]},
        ]
    }
}


@pytest.mark.parametrize(
    ("prompt", "said"),
    [
        ("please deploy now", "deploying"),
        ("run the test suite", "testing"),
        ("deploy after the test", "deploying"),  # first matching entry wins
        ("something else", "fallback"),  # first entry without match
    ],
)
async def test_entry_selection(prompt: str, said: str) -> None:
    """The first entry whose match is in the prompt runs, else the first entry without match."""
    r = await run(MULTI, prompt=prompt)
    assert r.out == [said]


async def test_no_entry_completes_silently() -> None:
    """With no matching entry and none without match, the turn completes with no output."""
    r = await run(steps({"say": "x"}, match="deploy"), prompt="hello")
    assert r.out == [] and r.result.status == "completed"


async def test_default_script_asks_pick_one() -> None:
    """An empty config runs the default script: "Pick one" with A and B, then says the answer."""
    r = await run({}, "B")
    kind, questions = r.handle.asked[0]
    assert kind == "ask_user_question"
    assert [q.question for q in questions] == ["Pick one"]
    assert [o.label for o in questions[0].options] == ["A", "B"]
    assert r.out == ["Pick one: B"]
    assert r.result.status == "completed"


# -- parking and resuming ------------------------------------------------------------------------


async def test_park_on_tool_ends_turn_with_position() -> None:
    """A parked approval ends the turn at once with its position and the exception."""
    exc = parked()
    r = await run(steps({"say": "before"}, DEPLOY, {"say": "after"}), exc)
    assert r.result.status == "parked"
    assert r.result.parked is exc
    assert r.result.state == {
        "turn": 0,
        "step": 1,
        "prompt_id": "prm_1",
        "kind": "approval",
        "subject": "Bash",
    }
    assert r.out == ["before"]
    assert orjson.loads(orjson.dumps(r.result.state)) == r.result.state


async def test_resume_approve_reasks_identical_question_then_runs() -> None:
    """Resumed with approve, the agent re-asks the identical approval, runs, and goes on."""
    config = {
        "script": {
            "turns": [
                {"match": "other", "steps": [{"say": "wrong entry"}]},
                {"match": "go", "steps": [{"say": "before"}, DEPLOY, {"say": "after"}]},
            ]
        }
    }
    first = await run(config, parked())
    answer = map_text("approval", first.handle.asked[0][1], "yes")
    second = await run(
        config,
        "Approve",  # the replica answers the re-attempt from the one-shot grant
        prompt="Your request to use Bash was APPROVED; retry it now.",
        state=first.result.state,
        resume=resume_of("approval", answer),
    )
    assert second.handle.asked == first.handle.asked
    q = second.handle.asked[0][1][0]
    assert (q.subject, q.grant_key) == ("Bash", "Bash:make deploy")
    assert second.out == ["Ran Bash `make deploy`:\ndeployed", "after"]
    assert second.result.status == "completed" and second.result.state is None


async def test_resume_approve_can_park_again() -> None:
    """If the re-attempt parks too, the turn parks again at the same position."""
    config = steps({"say": "a"}, DEPLOY)
    first = await run(config, parked())
    again = parked()
    second = await run(
        config,
        again,
        state=first.result.state,
        resume=resume_of("approval", [Answer(question="q", answer=["Approve"])]),
    )
    assert second.result.status == "parked" and second.result.parked is again
    assert second.result.state == first.result.state
    assert second.out == []


async def test_resume_deny_with_words() -> None:
    """Resumed with deny, the agent reports the person's denial and words, then goes on."""
    config = steps(DEPLOY, {"say": "after"})
    first = await run(config, parked())
    second = await run(
        config,
        prompt="Your request to use `Bash` was DENIED by the person.",
        state=first.result.state,
        resume=resume_of(
            "approval", [Answer(question="q", answer=["Deny"])], text="no, deploy to staging first"
        ),
    )
    assert second.handle.asked == []
    assert second.out == [
        'Did not run Bash `make deploy`: the person denied it. They said: "no, deploy to '
        'staging first"',
        "after",
    ]


async def test_resume_bare_deny_has_no_words() -> None:
    """A bare negative adds no quoted words to the denial."""
    config = steps(DEPLOY)
    first = await run(config, parked())
    second = await run(
        config,
        prompt="Your request to use `Bash` was DENIED by the person.",
        state=first.result.state,
        resume=resume_of("approval", [Answer(question="q", answer=["Deny"])], text="  No "),
    )
    assert second.out == ["Did not run Bash `make deploy`: the person denied it."]


async def test_park_on_ask_then_resume_with_answers() -> None:
    """A parked question resumes with the answers rendered as for a held answer."""
    config = steps({"ask": [PICK, CARDS]}, {"say": "after"})
    first = await run(config, parked("ask_user_question", ""))
    assert first.result.status == "parked"
    assert first.result.state is not None and first.result.state["step"] == 0
    answers = [
        Answer(question="Target?", answer=["production"]),
        Answer(question="Which cards?", answer=["KPI cards", "Chart"]),
    ]
    second = await run(
        config,
        prompt="production; KPI cards, Chart",
        state=first.result.state,
        resume=resume_of("ask_user_question", answers, subject=""),
    )
    assert second.handle.asked == []
    assert second.out == ["Target? production\nWhich cards? KPI cards, Chart", "after"]
    assert second.result.status == "completed"


async def test_fresh_turn_ignores_old_state() -> None:
    """A turn that is not a resume starts from its matching entry, whatever state it carries."""
    r = await run(steps({"say": "hi"}), state={"turn": 0, "step": 5})
    assert r.out == ["hi"]


async def test_resume_without_position_completes_with_note() -> None:
    """A resume with no readable saved position completes, saying there is nothing to continue."""
    r = await run(
        steps(DEPLOY),
        state={"turn": "0"},
        resume=resume_of("approval", [Answer(question="q", answer=["Approve"])]),
    )
    assert r.result.status == "completed" and r.handle.asked == []
    assert "no saved script position" in r.text


# -- script files --------------------------------------------------------------------------------


def write(path: Path, *steps: dict[str, Any]) -> None:
    path.write_bytes(orjson.dumps({"turns": [{"steps": list(steps)}]}))


async def test_script_file_is_reread_every_turn(tmp_path: Path) -> None:
    """A script_file is read afresh at every turn."""
    path = tmp_path / "script.json"
    config = {"script_file": str(path)}
    write(path, {"say": "one"})
    validate_config(config)
    assert (await run(config)).out == ["one"]
    write(path, {"say": "two"})
    assert (await run(config)).out == ["two"]


async def test_resume_after_script_file_changed_completes_with_note(tmp_path: Path) -> None:
    """If the parked position is gone from the re-read file, the turn completes, saying so."""
    path = tmp_path / "script.json"
    config = {"script_file": str(path)}
    write(path, {"say": "a"}, DEPLOY)
    first = await run(config, parked())
    write(path, {"say": "a"})
    second = await run(
        config,
        state=first.result.state,
        resume=resume_of("approval", [Answer(question="q", answer=["Approve"])]),
    )
    assert second.result.status == "completed" and second.handle.asked == []
    assert "The script changed" in second.text and "turns[0].steps[1]" in second.text


async def test_resume_when_step_changed_kind_completes_with_note(tmp_path: Path) -> None:
    """A parked approval whose step became a question is not resumed as one."""
    path = tmp_path / "script.json"
    config = {"script_file": str(path)}
    write(path, DEPLOY)
    first = await run(config, parked())
    write(path, {"ask": [PICK]})
    second = await run(
        config,
        state=first.result.state,
        resume=resume_of("approval", [Answer(question="q", answer=["Approve"])]),
    )
    assert second.handle.asked == [] and "The script changed" in second.text


@pytest.mark.parametrize("content", [b"{not json", b'{"turns": [{"steps": [{"sai": "x"}]}]}'])
async def test_bad_script_file_fails_the_turn(tmp_path: Path, content: bytes) -> None:
    """A script_file that is not a valid script fails the turn, saying where."""
    path = tmp_path / "script.json"
    path.write_bytes(content)
    r = await run({"script_file": str(path)})
    assert r.result.status == "failed"
    assert str(path) in r.result.error


async def test_missing_script_file_fails_the_turn(tmp_path: Path) -> None:
    """A script_file that cannot be read fails the turn (it was accepted at creation)."""
    config = {"script_file": str(tmp_path / "nope.json")}
    validate_config(config)
    r = await run(config)
    assert r.result.status == "failed" and "nope.json" in r.result.error


async def test_unanswered_questions_plural() -> None:
    """Several unanswered questions are reported together, still with nobody refusing."""
    r = await run(steps({"ask": [PICK, NOTE]}), PromptCancelled("prm_1", ""))
    assert r.out == [
        'The questions "Target?", "Anything else?" went unanswered: they were cancelled '
        "(no reason given) before anyone answered. Nobody refused them."
    ]


async def test_every_ask_carries_the_resume_position() -> None:
    """Each ask hands over the position a resume continues from, as a parked turn would save."""
    config = steps({"say": "x"}, DEPLOY, {"ask": [PICK]})
    r = await run(config, "yes", "A")
    assert r.handle.states == [{"turn": 0, "step": 1}, {"turn": 0, "step": 2}]
    crashed = await run(config, parked())
    assert crashed.result.state is not None
    assert {k: crashed.result.state[k] for k in ("turn", "step")} == {"turn": 0, "step": 1}


# -- calls as they run, and interrupted turns ------------------------------------------------------


class MemoryStore:
    """An agent store in memory, kept through JSON as Redis keeps it."""

    def __init__(self) -> None:
        self.lists: dict[str, list[bytes]] = {}

    async def append(self, key: str, entries: Sequence[Any]) -> None:
        self.lists.setdefault(key, []).extend(orjson.dumps(e) for e in entries)

    async def load(self, key: str) -> list[Any] | None:
        return [orjson.loads(e) for e in self.lists[key]] if key in self.lists else None


class BrokenStore:
    async def append(self, key: str, entries: Sequence[Any]) -> None:
        raise OSError("gone")

    async def load(self, key: str) -> list[Any] | None:
        raise OSError("gone")


def shell(command: str) -> dict[str, Any]:
    return {"tool": "Bash", "input": {"command": command}, "shell": True}


async def describe(store: AgentStore | None) -> str:
    return await ScriptedHarness().describe_interruption("thr_1", None, store)


async def test_a_shell_call_really_runs_and_is_logged(tmp_path: Path) -> None:
    """`shell: true` runs the command in the work folder; its output and exit code are shown, and
    the call is logged as it starts and as it ends."""
    store = MemoryStore()
    config = steps(shell("echo RAN >> marker; echo done"), shell("exit 3"))
    r = await run(config, permissions="autonomous", store=store, work_folder=str(tmp_path))
    assert (tmp_path / "marker").read_text() == "RAN\n"
    assert r.out == [
        "Ran Bash `echo RAN >> marker; echo done`:\ndone",
        "Ran Bash `exit 3` (exit code 3) (no output).",
    ]
    log = await store.load(scripted.CALLS)
    assert log is not None and [e.get("exit") for e in log] == [None, 0, None, 3, None]
    assert log[-1] == {"ended": "completed"}


async def test_an_approved_shell_call_runs_once_it_is_approved(tmp_path: Path) -> None:
    """Under approval the command runs only after the person approved it."""
    config = steps(shell("echo RAN >> marker"))
    await run(config, "no", work_folder=str(tmp_path))
    assert not (tmp_path / "marker").exists()
    await run(config, "yes", work_folder=str(tmp_path))
    assert (tmp_path / "marker").read_text() == "RAN\n"


async def test_describe_a_call_whose_end_was_recorded() -> None:
    """A turn cut off after its call ended: the call ran, with its exit code."""
    store = MemoryStore()
    await store.append(scripted.CALLS, [{"call": "Bash `a`"}, {"call": "Bash `a`", "exit": 0}])
    await store.append(scripted.CALLS, [{"ended": "completed"}, {"call": "Bash `b`"}])
    await store.append(scripted.CALLS, [{"call": "Bash `b`", "exit": 2}])
    assert await describe(store) == "Bash `b` ran, exit code 2"


async def test_describe_a_call_cut_off_while_it_ran() -> None:
    """A call whose end was never recorded may or may not have taken effect: never "aborted"."""
    store = MemoryStore()
    await store.append(scripted.CALLS, [{"call": "Bash `make deploy`"}])
    said = await describe(store)
    assert said == (
        "Bash `make deploy` was interrupted; it may or may not have taken effect; check before "
        "running it again"
    )
    assert "abort" not in said and "fail" not in said


async def test_describe_nothing_in_flight() -> None:
    """No store, no log, or only calls of turns that ended: nothing to say."""
    assert await describe(None) == ""
    store = MemoryStore()
    assert await describe(store) == ""
    await store.append(scripted.CALLS, [{"call": "Bash `a`"}, {"call": "Bash `a`", "exit": 0}])
    await store.append(scripted.CALLS, [{"ended": "completed"}, "junk", {"call": 5}])
    assert await describe(store) == ""


async def test_describe_never_raises() -> None:
    """An unreadable log is said to be so, not raised."""
    assert "not known" in await describe(BrokenStore())


async def test_the_next_turn_tells_the_interruption_first() -> None:
    """A turn after an interrupted one says what it had been handed and what is known of its
    call, before anything else; then it runs as usual (its call asks again)."""
    handed = resume_of("approval", [Answer(question="Allow?", answer=["Approve"])])
    interrupted = Interruption(delivered=handed, note="Bash `make deploy` ran, exit code 0")
    r = await run(steps(DEPLOY), "yes", interrupted=interrupted)
    assert r.out[0] == (
        "My previous turn was interrupted before it ended. It had been handed the person "
        "approved `Bash` (prompt prm_1). Bash `make deploy` ran, exit code 0. I will not repeat "
        "anything of it unasked."
    )
    assert r.out[1] == "Ran Bash `make deploy`:\ndeployed"
    assert len(r.handle.asked) == 1


async def test_a_cancelled_turn_kills_its_shell_call(tmp_path: Path) -> None:
    """A turn cancelled while its shell call runs (a lost thread, a shutdown) kills the command
    and whatever it started; the call is left logged as started, not ended."""
    pidfile = tmp_path / "pid"
    store = MemoryStore()
    config = steps(shell(f"sleep 30 & echo $! > {pidfile}; wait"))
    task = asyncio.create_task(run(config, permissions="autonomous", store=store))
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        await asyncio.sleep(0.02)
    pid = int(pidfile.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the shell call's child {pid} outlived its turn")
    assert "may or may not have taken effect" in await describe(store)
