"""The agent interface: what a replica needs of a coding-agent harness, and what it gives one.

A harness runs one *turn* at a time: it gets the turn's input text and a prompt handle, posts its
output through `emit`, and asks a person through `handle.ask`. Whatever it needs to continue the
same agent session on a later turn (a harness session id, a script position) it returns as
`state`; the replica stores it in Redis, so the next turn may run on any replica.

`handle.ask(kind, questions)` returns the person's answers, or raises:

- `PromptParked`: nobody has answered yet and this replica stopped holding the call (held-wait
  cap, shutdown). The turn must end now; the prompt stays open, and its answer starts a resume
  turn (`Turn.resume`) wherever the thread is held. Nobody refused anything.
- `PromptCancelled`: the prompt was cancelled (superseded, the run ended). Nobody refused.
- `PromptUnavailable`: the question could not be delivered. Nobody refused; asking again retries.

Only answers are ever a person's denial; a harness must tell its agent the difference.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from broker import Answer, BrokerError, Kind, Option, Question

__all__ = [
    "AgentStore",
    "Gate",
    "GateVerdict",
    "Harness",
    "Interruption",
    "Permissions",
    "PromptHandle",
    "PromptParked",
    "Resume",
    "Turn",
    "TurnResult",
    "approval_question",
    "describe_delivered",
]

Permissions = Literal["approval", "autonomous", "guarded"]


@dataclass(frozen=True)
class GateVerdict:
    """What the guarded policy says of one call: run it, refuse it, or ask a person."""

    action: Literal["allow", "deny", "ask"]
    rule: str = ""  # the rule that decided ("" for the policy's default)
    effect: str = ""  # read | write | exec | network | "" (unmapped)
    detail: str = ""  # the command, else the path, else the tool name


#: The guarded policy's gate: `(harness name, tool or method, input) -> verdict`. The replica
#: builds it from the worker's and the thread's rules; on `deny` it has already posted the
#: `policy_denied` item, and an evaluator error comes back as `deny` with rule
#: `policy_evaluation_error` (and no item). Under `approval` and `autonomous` there is no gate.
Gate = Callable[[str, str, dict[str, Any]], Awaitable[GateVerdict]]


class AgentStore(Protocol):
    """Durable storage for a harness's own session data (e.g. Claude Code transcripts), kept in
    Redis under the thread's hash tag so any replica can resume the session."""

    async def append(self, key: str, entries: Sequence[Any]) -> None: ...

    async def load(self, key: str) -> list[Any] | None: ...


class PromptParked(BrokerError):
    """The turn must end: a person has not answered yet, and nobody refused.

    The prompt stays open; its answer will start a resume turn.
    """

    def __init__(self, prompt_id: str, kind: str, subject: str) -> None:
        self.prompt_id = prompt_id
        self.kind = kind
        self.subject = subject
        super().__init__(
            f"prompt {prompt_id} is waiting for a person; this turn ends here and nobody has "
            "refused anything. The answer will come back in a later turn, with whether to retry."
        )


class PromptHandle(Protocol):
    async def ask(
        self,
        kind: Kind,
        questions: Sequence[Question],
        *,
        state: dict[str, Any] | None = None,
    ) -> list[Answer]:
        """Ask a person; see the module docstring for what it raises.

        `state` is what the harness needs to continue the session from this question if the
        answer comes back in a resume turn (possibly on another replica, after this one died):
        it is stored with the prompt, atomically, and handed back as `Turn.state`.
        """
        ...


@dataclass(frozen=True)
class Resume:
    """Why a resume turn runs: the answer to a prompt the agent could not wait for in place."""

    prompt_id: str
    kind: Kind
    subject: str
    answers: list[Answer]
    verdict: Literal["approve", "deny"] | None  # approvals only
    text: str = ""  # the person's reply as they typed it (their words for a denial), if typed


@dataclass(frozen=True)
class Interruption:
    """The session's previous turn was cut off before it ended (its replica died, was paused past
    its lease, or lost Redis). Nothing of it is replayed: the next turn carries this instead, and
    the harness tells its agent what is known before it hands over the turn's input.

    `delivered` is the answer that turn had been handed (its resume, or the last held answer), if
    any: the agent already acted on it, and it is never handed over again. `note` is what the
    harness found of the call that was in flight, in words fit for the agent and the person (from
    `Harness.describe_interruption`): "ran, exit code N" when its result was recorded before the
    crash, else "interrupted; it may or may not have taken effect; check before running it
    again". Never "aborted" or "failed" for a call that may have run.
    """

    delivered: Resume | None = None
    note: str = ""


@dataclass
class Turn:
    """One turn of an agent session."""

    thread_id: str
    prompt: str  # the input: queued messages joined by blank lines, or the resume text
    permissions: Permissions
    config: dict[str, Any]  # the thread's harness config, as created
    state: dict[str, Any] | None  # what the harness returned from its last turn
    handle: PromptHandle
    emit: Callable[[str], Awaitable[None]]  # post agent output to the thread
    resume: Resume | None = None
    work_folder: str = ""
    gate: Gate | None = None  # set only under `guarded`
    store: AgentStore | None = None
    interrupted: Interruption | None = None  # the previous turn was cut off; tell the agent first


@dataclass
class TurnResult:
    status: Literal["completed", "parked", "failed"]
    state: dict[str, Any] | None = None
    error: str = ""
    parked: PromptParked | None = field(default=None, repr=False)


class Harness(Protocol):
    """A coding-agent harness. Implementations: `workers.agents.scripted.ScriptedHarness`."""

    name: str

    async def run_turn(self, turn: Turn) -> TurnResult: ...

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        """What is known of the call that was in flight when this session's turn was cut off.

        Called by the replica that finds the turn cut off (an adopter, or the same replica once
        Redis returns), before it posts the thread item that tells the person and before the
        next turn. `state` is the session's last stored state; `store` holds what the harness
        recorded as the turn went (tool results are recorded as they arrive). Returns one
        sentence: "`<call>` ran, exit code N" / "`<call>` was interrupted; it may or may not
        have taken effect; check before running it again" / "" when no call was in flight.
        Must not raise for missing or partial data: say what is not known instead.
        """
        ...


def describe_delivered(delivered: Resume) -> str:
    """The answer a cut-off turn had been handed, in a phrase fit for the agent and the person:
    "the person approved `Bash` (prompt prm_...)" or "the person's answer to prompt prm_...:
    Pick one: A"."""
    if delivered.kind == "approval" and delivered.subject:
        verb = "approved" if delivered.verdict == "approve" else "denied"
        return f"the person {verb} `{delivered.subject}` (prompt {delivered.prompt_id})"
    answers = "; ".join(
        f"{_first_line(a.question)}: {', '.join(a.answer) or '(no answer)'}"
        for a in delivered.answers
    )
    return f"the person's answer to prompt {delivered.prompt_id}: {answers}"


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _detail(tool_input: dict[str, Any]) -> str:
    for key in ("command", "file_path", "path"):
        value = tool_input.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def approval_question(tool: str, tool_input: dict[str, Any], agent: str = "the agent") -> Question:
    """The approval question for one tool call, shaped as the original worker's Claude adapter
    shapes it.

    `subject` is the tool's name and `grant_key` `<tool>:<detail>` (detail: the first non-empty of
    the input's `command`, `file_path`, `path`), so a grant covers exactly this call.
    """
    detail = _detail(tool_input)
    text = f"Allow {agent} to use `{tool}`?" + (f"\n\n`{detail}`" if detail else "")
    return Question(
        question=text,
        header="permission",
        options=[
            Option(label="Approve", description=f"allow this {tool} call"),
            Option(label="Deny", description="reject this call"),
        ],
        multiSelect=False,
        subject=tool,
        grant_key=f"{tool}:{detail}" if detail else tool,
    )
