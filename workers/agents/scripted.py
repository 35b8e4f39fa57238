"""The scripted harness: a test-double coding agent that follows a JSON script, with no model.

It runs every flow of the system (approvals, questions, held and parked waits, resume turns,
grants, failures) with no model and no network, so tests, demos and benchmarks can drive real
replicas. It goes through the same interface as a real harness (`workers.agents.harness`): it asks a
person through `turn.handle.ask`, scores approvals with the shared `broker.answers.verdict`, and
keeps nothing in memory between turns.

This module runs the turns; the script's model, its checking and loading (`parse_script`,
`validate_config`, `load_script`) are in `workers.agents.scripted_script`, their names importable
from here too (`__all__`).

Config
------
The thread's harness config is one of:

- `{"script": {...}}`: the script inline, checked when the thread is created.
- `{"script_file": "/abs/path.json"}`: the script in a JSON file, re-read at the start of every
  turn (so a test can change it between turns). The path must be absolute. The file is checked at
  creation when it can be read there; a file that cannot be read or parsed when a turn starts
  fails that turn, saying why.
- `{}`: the default script (`DEFAULT_SCRIPT`): one `ask_user_question` "Pick one" with options
  `A` and `B`, whose answer the agent says back (`Pick one: A`), then the turn completes.

Any other key, or both keys at once, is refused.

Script
------
```
{"turns": [{"match": "deploy", "steps": [...]},     # used when "deploy" is in the prompt
           {"steps": [...]}]}                          # otherwise: the first entry with no match
```

A turn runs one entry: the first whose `match` is a substring of the turn's prompt, else the first
entry without `match`; if there is none, the turn completes with no output. The entry's steps run
in order, each an object with exactly one of these keys:

- `{"say": "text"}`: the agent outputs `text`.
- `{"tool": "Bash", "input": {"command": "make deploy"}, "output": "deployed"}`: a tool call
  (`input` defaults to `{}`, `output` to `""`). Under `autonomous` permissions it just runs: the
  agent outputs ``Ran Bash `make deploy`:`` and the output. Under `guarded` it first asks the
  turn's policy gate (tool names are Claude Code's, see `workers.agents.policy`): `allow` runs it
  with no prompt, `deny` does not (``Did not run Bash `rm -rf /`: Denied by policy rule 'no-rm'.``;
  the replica posts the `policy_denied` item), `ask` goes on as under `approval`, which is also
  what happens when a guarded turn has no gate. Under `approval` it first asks an
  `approval` prompt built by `workers.agents.harness.approval_question` (subject `Bash`, grant key
  `Bash:make deploy`). Approve: it runs. Deny: ``Did not run Bash `make deploy`: the person
  denied it.`` If the prompt is cancelled or cannot be delivered, the call is not run, and the
  agent says so and that nobody refused it. The next step runs in every case.
  With `"shell": true` the call really runs: `input.command` under `/bin/sh` in the work folder
  (at most `MAX_SHELL` seconds), and its output replaces `output` (`(exit code N)` is added
  when it is not 0). It runs under a supervisor, so it and whatever it starts die with the
  replica (SIGKILL included) or with the turn. Every call that runs is logged in the agent
  store (`CALLS`) as it starts and as it ends, so a turn cut off in between is told truthfully
  (`describe_interruption`).
- `{"ask": [question, ...]}`: an `ask_user_question` prompt of one or more questions, each a
  `broker.models.Question` (`question`, `header`, `options` of `{label, description}`,
  `multiSelect`; no options means free text). The agent outputs one line per question, the
  question (then `: ` unless it ends in `?` or `:`) then its answer's labels joined by `, `
  (`Pick one: A`, `Which cards? KPI cards, Table`; `(no answer)` for none). A cancelled
  or undelivered question is reported as unanswered, and that nobody refused it.
- `{"fail": "message"}`: the turn fails with `message`; later steps do not run.
- `{"sleep": seconds}`: simulated work; waits that long, at most `MAX_SLEEP` (60) seconds.

Unknown keys anywhere, a step with no or several of these keys, and wrong types (JSON types are
taken strictly: `"5"` is not a number, `1` is not `true`) are refused with `broker.BadItem`
naming the field, e.g. `config.script.turns[0].steps[2].tool`.

Parking and resuming
--------------------
When a prompt parks (`PromptParked`: nobody has answered and the replica stopped holding the
call), the turn ends at once with status `parked` and `state = {"turn": <entry index>, "step":
<step index>, "prompt_id", "kind", "subject"}`. That is all the harness needs to continue, on any
replica. The answer arrives as a later turn with that `state` and `turn.resume`:

- parked `tool` step, verdict approve: the agent re-attempts the call, asking for approval again
  exactly as the first time (the replica answers it from the one-shot grant), then runs it.
- parked `tool` step, verdict deny: the agent reports the person's denial, quoting their words
  (the turn's prompt, unless it is empty or a bare negative such as `no`), and does not retry.
- parked `ask` step: the agent reports `resume.answers` as it would a held answer.

Then the entry's remaining steps run. If the script changed so that the saved position no longer
holds a step of the parked kind, the turn completes with a line saying so. A new turn that is not
a resume starts afresh from the matching entry, whatever `state` it carries.

Interrupted turns
-----------------
A turn cut off before it ended is never replayed. The next turn carries `turn.interrupted`; the
agent first says ``My previous turn was interrupted before it ended.``, what it had been handed
(``It had been handed the person approved `Bash` (prompt prm_...).``), what is known of its last
call (``Bash `make deploy` ran, exit code 0.``, or that it was interrupted and may or may not have
taken effect), and ``I will not repeat anything of it unasked.``; then the turn runs as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from broker import Answer, BadItem, PromptCancelled, PromptUnavailable, Question, verdict
from broker.answers import NEGATIVE
from workers.agents import claude_launch
from workers.agents.harness import (
    AgentStore,
    Interruption,
    PromptParked,
    Resume,
    Turn,
    TurnResult,
    approval_question,
    describe_delivered,
)
from workers.agents.policy import refusal
from workers.agents.scripted_script import (
    DEFAULT_SCRIPT,
    Ask,
    Entry,
    Fail,
    Say,
    Script,
    Sleep,
    Step,
    Tool,
    load_script,
    parse_script,
    validate_config,
)

__all__ = [
    "DEFAULT_SCRIPT",
    "MAX_SLEEP",
    "Ask",
    "Entry",
    "Fail",
    "Say",
    "Script",
    "ScriptedHarness",
    "Sleep",
    "Step",
    "Tool",
    "load_script",
    "parse_script",
    "validate_config",
]

#: The longest a `sleep` step waits, in seconds.
MAX_SLEEP = 60.0
#: The longest a `shell` tool call runs, in seconds.
MAX_SHELL = 60.0
#: The agent store key of the harness's call log: each call as it starts and as it ends, and
#: each turn's end, so an interrupted turn's last call can be told truthfully.
CALLS = "scripted-calls"


# -- what the agent says -------------------------------------------------------------------------


def _call(step: Tool) -> str:
    for key in ("command", "file_path", "path"):  # the detail approval_question shows
        value = step.input.get(key)
        if isinstance(value, str) and value:
            return f"{step.tool} `{value}`"
    return step.tool


def _ran(step: Tool, output: str | None = None, code: int = 0) -> str:
    output = step.output if output is None else output
    ran = f"Ran {_call(step)}" + (f" (exit code {code})" if code else "")
    if output:
        return f"{ran}:\n{output}"
    return f"{ran} (no output)."


def _denied(step: Tool, words: str | None) -> str:
    said = f' They said: "{words}"' if words else ""
    return f"Did not run {_call(step)}: the person denied it.{said}"


def _words(prompt: str) -> str | None:
    """The person's words from a resume prompt, unless there are none beyond a bare negative."""
    words = prompt.strip()
    return words if words and words.casefold() not in NEGATIVE else None


def _topic(questions: Sequence[Question]) -> str:
    quoted = ", ".join(f'"{_first_line(q.question)}"' for q in questions)
    return f"The question {quoted}" if len(questions) == 1 else f"The questions {quoted}"


def _it(questions: Sequence[Question]) -> str:
    return "it was" if len(questions) == 1 else "they were"


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _render(questions: Sequence[Question], answers: Sequence[Answer]) -> str:
    """One line per question: the question, then its answer's labels joined by `, `."""
    lines = []
    for i, q in enumerate(questions):
        text = _first_line(q.question)
        labels = ", ".join(answers[i].answer) if i < len(answers) else ""
        sep = " " if text.endswith(("?", ":")) else ": "
        lines.append(f"{text}{sep}{labels or '(no answer)'}")
    return "\n".join(lines)


def _cancelled(what: str, e: PromptCancelled) -> str:
    return f"{what} cancelled ({e.reason or 'no reason given'}) before anyone answered"


def _undelivered(what: str, e: PromptUnavailable) -> str:
    return f"{what} not delivered to a person ({e.cause})"


# -- running a turn ------------------------------------------------------------------------------


async def _shell(command: str, work_folder: str) -> tuple[str, int]:
    """Run a `shell` tool call's command: (its output, its exit code).

    Under the same supervisor as the Claude Code CLI (`workers.agents.claude_launch`): the command
    and everything it starts die with the replica, however the replica dies, and with the turn when
    the turn is cancelled (a lost thread, a shutdown past its grace).
    """
    env = {**os.environ, claude_launch.PARENT_ENV: str(os.getpid())}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        claude_launch.__file__,
        "/bin/sh",
        "-c",
        command,
        cwd=work_folder or None,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(MAX_SHELL):
            out, _ = await proc.communicate()
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(claude_launch.KILL_TREE)
        await asyncio.shield(proc.wait())
        if isinstance(e, TimeoutError):
            return f"(stopped after {MAX_SHELL:g} s)", -9
        raise
    return out.decode(errors="replace").rstrip("\n"), proc.returncode or 0


def _position(state: dict[str, Any] | None) -> tuple[int, int] | None:
    if not state:
        return None
    entry, step = state.get("turn"), state.get("step")
    if type(entry) is int and type(step) is int:  # not bool, not str
        return entry, step
    return None


class _Run:
    """One turn: the steps of one entry, from a position, until the end, a failure or a park."""

    def __init__(self, turn: Turn, script: Script) -> None:
        self.turn = turn
        self.script = script
        self.at: dict[str, int] = {}  # the step running now: saved with every ask it makes

    async def emit(self, text: str) -> None:
        await self.turn.emit(text)

    async def record(self, entry: dict[str, Any]) -> None:
        """Log a call's start or end, or the turn's end, as it happens (see `CALLS`)."""
        if self.turn.store is not None:
            await self.turn.store.append(CALLS, [entry])

    async def run_tool(self, step: Tool) -> None:
        """Run an allowed call: recorded before it starts and when it ends, then reported."""
        call = _call(step)
        await self.record({"call": call})
        output, code = step.output, 0
        if step.shell:
            output, code = await _shell(str(step.input.get("command", "")), self.turn.work_folder)
        await self.record({"call": call, "exit": code})
        await self.emit(_ran(step, output, code))

    async def tell_interruption(self, interrupted: Interruption) -> None:
        """What the agent is told first when its previous turn was cut off: what it had been
        handed, and what is known of its call in flight. Nothing of that turn is redone."""
        told = ["My previous turn was interrupted before it ended."]
        if interrupted.delivered is not None:
            told.append(f"It had been handed {describe_delivered(interrupted.delivered)}.")
        if interrupted.note:
            told.append(interrupted.note.rstrip(".") + ".")
        told.append("I will not repeat anything of it unasked.")
        await self.emit(" ".join(told))

    async def steps(self, entry: int, start: int) -> TurnResult:
        steps = self.script.turns[entry].steps
        for index in range(start, len(steps)):
            self.at = {"turn": entry, "step": index}
            try:
                failure = await self.step(steps[index])
            except PromptParked as parked:
                return self.parked(entry, index, parked)
            if failure is not None:
                return TurnResult(status="failed", error=failure)
        return TurnResult(status="completed")

    def parked(self, entry: int, index: int, parked: PromptParked) -> TurnResult:
        state = {
            "turn": entry,
            "step": index,
            "prompt_id": parked.prompt_id,
            "kind": parked.kind,
            "subject": parked.subject,
        }
        return TurnResult(status="parked", state=state, parked=parked)

    async def step(self, step: Step) -> str | None:
        """Run one step; returns the failure message of a `fail` step."""
        match step:
            case Say():
                await self.emit(step.say)
            case Tool():
                await self.tool(step)
            case Ask():
                await self.ask(step)
            case Sleep():
                await asyncio.sleep(min(step.sleep, MAX_SLEEP))
            case Fail():
                return step.fail
        return None

    async def tool(self, step: Tool) -> None:
        if self.turn.permissions == "autonomous":
            await self.run_tool(step)
            return
        if self.turn.permissions == "guarded" and self.turn.gate is not None:
            gate = await self.turn.gate("scripted", step.tool, dict(step.input))
            if gate.action == "allow":
                await self.run_tool(step)
                return
            if gate.action == "deny":
                await self.emit(f"Did not run {_call(step)}: {refusal(gate)}.")
                return
        question = approval_question(step.tool, step.input)
        try:
            answers = await self.turn.handle.ask("approval", [question], state=self.at)
        except PromptCancelled as e:
            why = _cancelled("the approval request was", e)
        except PromptUnavailable as e:
            why = "approval was unavailable: " + _undelivered("the request was", e)
        else:
            if verdict(answers) == "approve":
                await self.run_tool(step)
            else:
                await self.emit(_denied(step, None))
            return
        await self.emit(f"Did not run {_call(step)}: {why}. Nobody refused it.")

    async def ask(self, step: Ask) -> None:
        try:
            answers = await self.turn.handle.ask("ask_user_question", step.ask, state=self.at)
        except PromptCancelled as e:
            why = _cancelled(_it(step.ask), e)
        except PromptUnavailable as e:
            why = _undelivered(_it(step.ask), e)
        else:
            await self.emit(_render(step.ask, answers))
            return
        them = "it" if len(step.ask) == 1 else "them"
        await self.emit(f"{_topic(step.ask)} went unanswered: {why}. Nobody refused {them}.")

    async def resume(self, resume: Resume) -> TurnResult:
        """Continue the entry at the parked step, taking the answer that ended the wait."""
        where = _position(self.turn.state)
        if where is None:
            await self.emit(
                f"The answer to prompt {resume.prompt_id} came back, but this session has no "
                "saved script position to continue from, so there is nothing more to do."
            )
            return TurnResult(status="completed")
        entry, index = where
        self.at = {"turn": entry, "step": index}
        step = self.script.step_at(entry, index)
        expected = {"approval": Tool, "ask_user_question": Ask}.get(resume.kind)
        if expected is None or not isinstance(step, expected):
            await self.emit(
                f"The script changed while prompt {resume.prompt_id} waited for an answer: "
                f"turns[{entry}].steps[{index}] is no longer the {resume.kind} step that asked "
                "it, so there is nothing to continue."
            )
            return TurnResult(status="completed")
        try:
            await self.resumed(step, resume)
        except PromptParked as parked:
            return self.parked(entry, index, parked)
        return await self.steps(entry, index + 1)

    async def resumed(self, step: Step, resume: Resume) -> None:
        if isinstance(step, Ask):
            await self.emit(_render(step.ask, resume.answers))
        elif isinstance(step, Tool):
            if (resume.verdict or verdict(resume.answers)) == "approve":
                await self.tool(step)  # the re-attempt asks again; the grant answers it
            else:
                await self.emit(_denied(step, _words(resume.text)))


class ScriptedHarness:
    """A coding agent that follows a JSON script (see the module docstring)."""

    name = "scripted"

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        """The last call of the cut-off turn, from the call log (`CALLS`): "ran, exit code N"
        when its end was recorded, else that it may or may not have taken effect."""
        if store is None:
            return ""
        try:
            log = await store.load(CALLS) or []
        except Exception:  # say what is not known, never raise
            return "What the interrupted turn was doing is not known: its call log is unreadable."
        last: dict[str, Any] | None = None
        for entry in log:
            if not isinstance(entry, dict):
                continue
            if entry.get("ended"):
                last = None  # calls of turns that ended are not in flight
            elif isinstance(entry.get("call"), str):
                last = entry
        if last is None:
            return ""
        if type(last.get("exit")) is int:
            return f"{last['call']} ran, exit code {last['exit']}"
        return (
            f"{last['call']} was interrupted; it may or may not have taken effect; check before "
            "running it again"
        )

    async def run_turn(self, turn: Turn) -> TurnResult:
        try:
            script = await load_script(turn.config)
        except BadItem as e:
            return TurnResult(status="failed", error=f"the scripted harness has no script: {e}")
        run = _Run(turn, script)
        if turn.interrupted is not None:
            await run.tell_interruption(turn.interrupted)
        result = await self._run(run, turn, script)
        await run.record({"ended": result.status})
        return result

    async def _run(self, run: _Run, turn: Turn, script: Script) -> TurnResult:
        if turn.resume is not None:
            return await run.resume(turn.resume)
        entry = script.pick(turn.prompt)
        if entry is None:
            return TurnResult(status="completed")
        return await run.steps(entry, 0)
