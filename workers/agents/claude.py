"""The Claude Code harness: the real Claude Code CLI, through `claude-agent-sdk`, as an agent.

Optional: it needs the `claude` extra (`pip install 'prompt-broker[claude]'`, which pins
`claude-agent-sdk==0.2.189`; the SDK bundles the CLI). `workers.runtime.replica.default_harnesses`
registers it as `claude_code` only when the SDK imports.

Config
------
The thread's harness config is an object with any of these keys (anything else is refused with
`broker.BadItem` naming the field; `validate_config` checks one):

- `base_url`: the Anthropic API endpoint (`ANTHROPIC_BASE_URL`); tests point it at a fake.
- `api_key`: the key (`ANTHROPIC_API_KEY`); without it, the worker's own environment's is used.
- `model`: the model name; without it, Claude Code's default.
- `max_turns`: model round trips per turn (default `DEFAULT_MAX_TURNS`).

Every run is isolated: a scratch `CLAUDE_CONFIG_DIR` and `HOME` (under the harness's scratch
root) and `TMPDIR`/`XDG_RUNTIME_DIR` (a short temporary folder, so Claude Code's socket lands
there too), all removed after the run; no filesystem settings (`setting_sources=[]`), Claude
Code's own system prompt, the quieting variables (`QUIET_ENV`: no telemetry, no update checks,
no traffic but the model's), and the work folder as `cwd` (without one, a per-thread folder under
the harness's scratch root). Assistant text goes to the thread as agent output, one item per text
block.

Permissions
-----------
- `approval`: Claude Code's `default` mode. Calls its own engine allows (reads, read-only shell
  commands) run silently; every other call reaches the permission callback, which raises an
  `approval` prompt built by `workers.agents.harness.approval_question` (agent "Claude"), so its
  subject and grant key are the replica's grants'. An affirmative answer (`broker.verdict`) allows
  the call. A person's denial refuses it, saying the person denied it, with their words when the
  answer carried any beyond a bare "no" (a parked answer's typed text, or extra strings in a
  structured answer). A prompt that was not delivered, was cancelled or was parked refuses it
  with `Approval unavailable: ...`, saying that nobody refused it.
- `guarded`: every tool call reaches the permission callback, read-only ones included: a
  `PreToolUse` command hook in the CLI's flag settings (`ASK_EVERY_CALL`) answers "ask" for
  every call, so Claude Code's own engine allows nothing silently, and a worker's deny rules bind
  every call. The callback consults the policy gate (`Turn.gate`) first: `allow` allows, `deny`
  refuses with `Denied by policy rule '<id>'`, `ask` raises the approval prompt. A gate that
  raises denies (`policy_evaluation_error`). Questions are never gated.
- `autonomous`: `bypassPermissions` (with `IS_SANDBOX=1` when running as root, which Claude Code
  otherwise refuses): no approval prompts; `AskUserQuestion` still asks a person.

Questions
---------
Claude Code's own `AskUserQuestion` tool raises an `ask_user_question` prompt with its questions
(an option's `preview` is not shown to the person; it is echoed back in the annotations when that
option is the one picked). The answer goes back in the SDK's documented shape:
`Allow(updated_input={**input, "answers": {<exact question text>: <value>}})`, where the value is
the chosen label, multi-select labels joined by `", "`, or the person's free text. Answer strings
that are not labels, given next to a label (a structured answer), become the question's
`annotations[<text>]["notes"]`. A question with no answer is left out (Claude Code reports only
the answered ones). Answers are keyed by text, so questions sharing a text cannot be told apart
there: the person sees them numbered (`<text> [1/2]`, `<text> [2/2]`), and the one key gets every
answer in question order joined by `"; "`, with a note saying so. An unanswered question (not
delivered, cancelled) is refused with a message saying nobody refused to answer.

Held and parked waits
---------------------
A held wait blocks inside Claude Code's callback (the CLI keeps running, ~200 MB). When the
replica parks a wait (`PromptParked`: wait mode `parked`, the held-wait cap, a clean stop), the
turn ends and the Claude session pauses durably, in Claude Code's own way where it fits:

- Questions are asked from a `PreToolUse` hook, which can return `permissionDecision: "defer"`:
  the CLI stops with the call pending, and the turn ends `parked` with state
  `{"session_id", "pending": {..., "deferred": <tool_use_id>}}`.
- Approvals are asked from the permission callback (only the CLI knows which calls need one), which
  cannot defer: a parked approval is refused `Approval unavailable: ...` (asking the agent to make
  the same call again), and the hook defers the agent's next call, whatever it is. If the agent
  ends its turn instead, the turn ends `parked` with no deferred call.

The transcript lives in Redis: the SDK's `session_store` is backed by `Turn.store` (the thread's
agent store, mirrored eagerly; each ask first waits for the call's transcript entry to land), so
the session resumes on any replica. The answer starts a resume turn there:

- With a deferred call: the same session is resumed with no prompt (`ClaudeSDKClient(resume=...)`
  and `connect()`), and Claude Code replays the pending call with the same `tool_use_id`. If it
  is the call that asked (same question texts; same grant key): a question is answered from
  `Turn.resume`; an approval is refused with the person's denial, or (approved) asks again and the
  replica's one-shot grant answers it. Any other deferred call is refused "not run yet", with the
  resume text. Claude Code's hook may or may not fire on resume (claude-agent-sdk-python #993), so
  the hook never defers a call that has an answer, and the callback gives that same answer either
  way. If the answer did not reach the agent this way (nothing replayed within `REPLAY_GRACE`, or
  the replayed call needed no permission), the resume text (`Turn.prompt`) follows as a message.
  A new turn (not a resume: the prompt was cancelled) refuses the replayed call, saying nobody
  answered or refused it, then sends its message.
- Without one (the agent ended its turn, or a replica died while holding the wait and the state
  came from the ask): the session is resumed with the resume text as the message; Claude Code
  closes the interrupted call itself ("[Tool call interrupted ...]"), and the agent retries.

A run that keeps going after it parked is stopped after `PARK_SETTLE` seconds. A run that is
cancelled (a lost lease) kills its CLI at once, so nothing more is written to the transcript.

The CLI's life
--------------
On Linux the CLI runs under a small supervisor (`workers.agents.claude_launch`, the SDK's `cli_path`
points at a wrapper script that starts it): a child subreaper with a parent-death signal, so
the CLI and every command it started (Claude Code starts each Bash command in a session of its
own) die with the replica however it dies, SIGKILL included. The harness's own kill goes
through it too (`claude_launch.KILL_TREE`), so a killed CLI leaves no command running.

A turn cut off
--------------
Each call's progress is recorded in the thread's agent store as it happens
(`workers.agents.claude_calls`: seen, waiting for a person, allowed, refused, its result), and each
tool result is put into the stored transcript as it arrives (Claude Code's own copy lags the
next model call by about 0.1 s). `describe_interruption` reads that log: "Bash `<command>` ran,
exit code N" when the result was recorded, else "... was interrupted; it may or may not have
taken effect; check before running it again". The next turn (`Turn.interrupted`) continues the
same session and tells the agent what it had been handed and that note, in brackets, before its
input.

Every later turn of the thread continues the same Claude session (`TurnResult.state`'s
`session_id`); if the store no longer has it, a new session starts, and the agent says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import warnings
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from claude_agent_sdk import (
    AssistantMessage,
    CanUseToolShadowedWarning,
    ClaudeAgentOptions,
    ClaudeSDKClient,
    ClaudeSDKError,
    HookContext,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    PermissionResult,
    PermissionResultAllow,
    PermissionResultDeny,
    ResultMessage,
    SessionKey,
    SessionStore,
    SessionStoreEntry,
    SystemMessage,
    TextBlock,
    ToolPermissionContext,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)

from broker import Answer, BadItem, PromptCancelled, PromptUnavailable, verdict
from broker.models import Question
from workers.agents import claude_calls, claude_launch
from workers.agents.claude_answers import (
    AGENT,
    ASK_TOOL,
    PARKED_APPROVAL,
    PARKED_QUESTION,
    PAUSING,
    ask_questions,
    cancelled,
    denial_words,
    denied,
    not_delivered,
    question_key,
    updated_input,
)
from workers.agents.claude_config import (
    DEFAULT_MAX_TURNS,
    HARNESS,
    ClaudeConfig,
    parse_config,
    validate_config,
)
from workers.agents.claude_store import RedisSessionStore
from workers.agents.harness import AgentStore, PromptParked, Turn, TurnResult, approval_question

__all__ = [
    "DEFAULT_MAX_TURNS",
    "HARNESS",
    "QUIET_ENV",
    "ClaudeConfig",
    "ClaudeHarness",
    "RedisSessionStore",
    "ask_questions",
    "parse_config",
    "updated_input",
    "validate_config",
]

logger = logging.getLogger("workers.agents.claude")

# bypassPermissions (autonomous) shadows the callback for ordinary tools, on purpose; the SDK's
# warning is wrong for AskUserQuestion, which still reaches it.
warnings.filterwarnings("ignore", category=CanUseToolShadowedWarning)

#: A held question waits in the PreToolUse hook: give it a week (below the CLI's timer limit).
HOOK_TIMEOUT = 7 * 24 * 3600.0
#: How long a resumed session gets to start replaying its deferred call.
REPLAY_GRACE = 15.0
#: How long a run may go on after one of its waits parked.
PARK_SETTLE = 30.0
#: Claude Code's traffic is the model's only: no telemetry, update checks or error reports.
QUIET_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
#: Guarded mode's flag settings: a command hook that answers "ask" for every tool call, so that
#: Claude Code's own engine allows nothing silently (reads, read-only shell commands) and every
#: call reaches the permission callback, where the gate decides. A settings hook is loaded when
#: the CLI starts, so unlike the SDK's in-process hook it also sees a call replayed on resume.
ASK_EVERY_CALL = json.dumps(
    {
        "hooks": {
            "PreToolUse": [
                {
                    "matcher": "*",
                    "hooks": [
                        {
                            "type": "command",
                            "command": "echo "
                            + shlex.quote(
                                json.dumps(
                                    {
                                        "hookSpecificOutput": {
                                            "hookEventName": "PreToolUse",
                                            "permissionDecision": "ask",
                                        }
                                    }
                                )
                            ),
                        }
                    ],
                }
            ]
        }
    }
)


# -- one turn ------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """The call a parked prompt was about, and the call the session was deferred on."""

    call: str  # tool_use_id of the call that asked
    tool: str
    kind: str
    key: str | None  # what makes a later call "the same": the grant key, or the question texts
    prompt_id: str | None = None
    deferred: str | None = None

    def dump(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def load(cls, raw: object) -> _Pending | None:
        if not isinstance(raw, dict):
            return None
        try:
            return cls(
                call=str(raw["call"]),
                tool=str(raw["tool"]),
                kind=str(raw["kind"]),
                key=raw.get("key"),
                prompt_id=raw.get("prompt_id"),
                deferred=raw.get("deferred"),
            )
        except KeyError:
            return None


class _Run:
    """One turn of a Claude session: the CLI, its callbacks, and what the turn ends with."""

    def __init__(self, harness: ClaudeHarness, turn: Turn, config: ClaudeConfig) -> None:
        self.h = harness
        self.turn = turn
        self.config = config
        state = turn.state or {}
        sid = state.get("session_id")
        self.session_id: str | None = sid if isinstance(sid, str) and sid else None
        self.before = _Pending.load(state.get("pending"))  # what the last turn parked on
        self.store = RedisSessionStore(turn.store) if turn.store is not None else None
        self.parked: PromptParked | None = None
        self.pending: _Pending | None = None  # what this turn parked on
        self.parked_at = 0.0
        self.decided: dict[str, PermissionResult] = {}  # answers the hook got, for the callback
        self.replayed: str | None = None  # the deferred call this turn answers on replay
        self.told = False  # the replayed call's answer told the agent what the resume text says
        self.fatal: BaseException | None = None
        self.activity = asyncio.Event()
        self.stderr: deque[str] = deque(maxlen=40)
        self.client: ClaudeSDKClient | None = None
        self.tmpdir: Path | None = None
        self.logged: set[str] = set()  # calls in the call log this turn
        self.logged_session: str | None = None
        self.asked_in: dict[str, str] = {}  # tool_use id -> uuid of the assistant entry holding it
        self.transcript_meta: dict[str, Any] = {}  # cwd, version: as Claude Code writes them

    # -- the call log ----------------------------------------------------------------------

    async def log(self, **record: Any) -> None:
        """Append one record to the call log, awaited (so a crash right after it is known).
        A store that fails loses the record, never the call: `describe` then says less."""
        if self.turn.store is None:
            return
        try:
            await self.turn.store.append(claude_calls.CALLS, [record])
        except Exception:
            logger.warning("claude.call_log_failed", extra={"thread_id": self.turn.thread_id})

    async def log_call(self, call: str, tool: str, tool_input: object) -> None:
        if call and call not in self.logged and tool != ASK_TOOL:
            self.logged.add(call)
            await self.log_session()
            await self.log(e="call", id=call, tool=tool, detail=claude_calls.detail_of(tool_input))

    async def log_step(self, call: str, event: str) -> None:
        if call in self.logged:
            await self.log(e=event, id=call)

    async def log_session(self) -> None:
        if self.session_id and self.session_id != self.logged_session:
            self.logged_session = self.session_id
            await self.log(e="session", sid=self.session_id)

    async def log_results(self, message: UserMessage) -> None:
        content = message.content if isinstance(message.content, list) else []
        for block in content:
            if isinstance(block, ToolResultBlock) and block.tool_use_id in self.logged:
                raw = block.content
                text = raw if isinstance(raw, str) else ""
                if isinstance(raw, list):
                    text = "\n".join(str(c.get("text", "")) for c in raw if isinstance(c, dict))
                record = claude_calls.result_record(block.tool_use_id, block.is_error, text)
                await self.log(**record)
        await self.mirror_result(message)

    async def mirror_result(self, message: UserMessage) -> None:
        """Put a tool result into the stored transcript as soon as it arrives.

        Claude Code writes its transcript on a timer, so its own copy of a result reaches the
        store about 0.1 s after the model has been called with it: a replica killed in that
        window would resume a session that says the call's outcome is unknown, though it ran.
        The entry written here is the one Claude Code writes (same uuid and parent, so the
        later copy is a duplicate the store drops), minus bookkeeping fields it does not need to
        resume."""
        blocks = message.content if isinstance(message.content, list) else []
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        if not results or message.parent_tool_use_id or not message.uuid:
            return
        parent = self.asked_in.get(results[0].tool_use_id)
        if self.store is None or not self.session_id or parent is None:
            return
        entry = {
            "parentUuid": parent,
            "isSidechain": False,
            "type": "user",
            "message": {
                "role": "user",
                "content": [
                    {
                        "tool_use_id": b.tool_use_id,
                        "type": "tool_result",
                        "content": b.content,
                        "is_error": b.is_error,
                    }
                    for b in results
                ],
            },
            "uuid": message.uuid,
            "timestamp": datetime.now(UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "toolUseResult": message.tool_use_result,
            "sourceToolAssistantUUID": parent,
            "userType": "external",
            "entrypoint": "sdk-py",
            "sessionId": self.session_id,
            **self.transcript_meta,
        }
        key: SessionKey = {"project_key": "", "session_id": self.session_id}
        try:
            await self.store.append(key, [cast(SessionStoreEntry, entry)])
        except Exception:
            logger.warning("claude.result_mirror_failed", extra={"thread_id": self.turn.thread_id})

    # -- state -----------------------------------------------------------------------------

    def state(self, pending: _Pending | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.session_id:
            out["session_id"] = self.session_id
        if pending is not None:
            out["pending"] = pending.dump()
        return out

    # -- asking ----------------------------------------------------------------------------

    async def ask(
        self, kind: str, questions: list[Question], call: str, tool: str, key: str | None
    ) -> list[Answer]:
        """Ask through the handle once the call is in the stored transcript; a park is
        recorded (the caller refuses or defers)."""
        if self.store is not None and not await self.store.stored(call):
            logger.warning("claude.mirror_late", extra={"thread_id": self.turn.thread_id})
        pending = _Pending(call=call, tool=tool, kind=kind, key=key)
        try:
            return await self.turn.handle.ask(
                "approval" if kind == "approval" else "ask_user_question",
                questions,
                state=self.state(pending),
            )
        except PromptParked as parked:
            pending.prompt_id = parked.prompt_id
            self.parked, self.pending = parked, pending
            self.parked_at = asyncio.get_running_loop().time()
            raise

    async def question(self, tool_input: dict[str, Any], call: str) -> PermissionResult:
        """AskUserQuestion: ask, and answer in the SDK's shape (a park re-raises)."""
        try:
            questions = ask_questions(tool_input)
            key = question_key(tool_input)
            answers = await self.ask("ask_user_question", questions, call, ASK_TOOL, key)
        except PromptCancelled as e:
            why = cancelled(e)
        except (PromptUnavailable, BadItem) as e:
            why = not_delivered(e)
        else:
            return PermissionResultAllow(updated_input=updated_input(tool_input, answers))
        return PermissionResultDeny(
            message=f"Unanswered: the question {why}. Nobody refused to answer; ask again if you "
            "still need to know."
        )

    async def approval(self, tool: str, tool_input: dict[str, Any], call: str) -> PermissionResult:
        q = approval_question(tool, tool_input, agent=AGENT)
        await self.log_step(call, "asking")
        try:
            answers = await self.ask("approval", [q], call, tool, q.grant_key)
        except PromptParked:
            return PermissionResultDeny(message=PARKED_APPROVAL)
        except PromptCancelled as e:
            why = cancelled(e)
        except (PromptUnavailable, BadItem) as e:
            why = not_delivered(e)
        else:
            if verdict(answers) == "approve":
                return PermissionResultAllow()
            return PermissionResultDeny(message=denied(tool, denial_words(answers)))
        return PermissionResultDeny(
            message=f"Approval unavailable: the request {why}. Nobody refused this call; make it "
            "again to ask again."
        )

    async def gated(self, tool: str, tool_input: dict[str, Any], call: str) -> PermissionResult:
        gate = self.turn.gate
        if gate is not None:
            try:
                ruling = await gate(HARNESS, tool, tool_input)
            except Exception:
                logger.exception("claude.gate_failed", extra={"thread_id": self.turn.thread_id})
                return PermissionResultDeny(
                    message="Denied by policy rule 'policy_evaluation_error'"
                )
            if ruling.action == "allow":
                return PermissionResultAllow()
            if ruling.action == "deny":
                return PermissionResultDeny(
                    message=f"Denied by policy rule '{ruling.rule or 'default'}'"
                )
        return await self.approval(tool, tool_input, call)

    # -- the resumed call ------------------------------------------------------------------

    def answers_replay(self, call: str) -> bool:
        return self.replayed is not None and call == self.replayed

    def same_call(self, tool: str, tool_input: dict[str, Any]) -> bool:
        """Is this call the one the parked prompt asked about (or the agent's retry of it)?"""
        before = self.before
        if before is None or tool != before.tool:
            return False
        try:
            if tool == ASK_TOOL:
                return question_key(tool_input) == before.key
        except BadItem:
            return False
        return approval_question(tool, tool_input, agent=AGENT).grant_key == before.key

    async def replay(self, tool: str, tool_input: dict[str, Any]) -> PermissionResult:
        """The answer for the deferred call Claude Code replays on resume."""
        before, resume = self.before, self.turn.resume
        assert before is not None
        if resume is None or before.prompt_id not in (None, resume.prompt_id):
            return PermissionResultDeny(
                message="Not run: the request it waited on ended before anyone answered. Nobody "
                "refused it; make the call again if you still need it."
            )
        self.told = True
        if not self.same_call(tool, tool_input):
            return PermissionResultDeny(
                message="Not run yet: this call was held while an earlier request waited for a "
                f"person. Nobody refused it. {self.turn.prompt} Then make this call again if "
                "you still need it."
            )
        if tool == ASK_TOOL:
            return PermissionResultAllow(updated_input=updated_input(tool_input, resume.answers))
        if (resume.verdict or verdict(resume.answers)) != "approve":
            return PermissionResultDeny(
                message=denied(tool, denial_words(resume.answers, resume.text))
            )
        return await self.approval(tool, tool_input, self.replayed or "")  # the grant answers

    # -- callbacks -------------------------------------------------------------------------

    async def can_use_tool(
        self, tool: str, tool_input: dict[str, Any], ctx: ToolPermissionContext
    ) -> PermissionResult:
        self.activity.set()
        call = ctx.tool_use_id or ""
        try:
            await self.log_call(call, tool, tool_input)  # the hook may not have fired (#993)
            if call in self.decided:
                result = self.decided.pop(call)
            elif self.answers_replay(call):
                result = await self.replay(tool, tool_input)
            else:
                result = await self.decide(tool, tool_input, call)
            # Recorded before the CLI hears it: an `allowed` call may run from here on.
            allowed = isinstance(result, PermissionResultAllow)
            await self.log_step(call, "allowed" if allowed else "refused")
            return result
        except Exception as e:
            return self.fail(e)

    async def decide(self, tool: str, tool_input: dict[str, Any], call: str) -> PermissionResult:
        """A fresh call that needs permission (or a question the hook did not see)."""
        if self.parked is not None:
            return PermissionResultDeny(message=PAUSING)
        if tool == ASK_TOOL:  # the hook did not ask it: ask here (this cannot defer)
            try:
                return await self.question(tool_input, call)
            except PromptParked:
                return PermissionResultDeny(message=PARKED_QUESTION)
        if self.turn.permissions == "autonomous":
            return PermissionResultAllow()
        return await self.gated(tool, tool_input, call)

    async def pre_tool_use(
        self, data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> HookJSONOutput:
        self.activity.set()
        raw = cast(dict[str, Any], data)
        call = tool_use_id or str(raw.get("tool_use_id") or "")
        if not self.session_id and isinstance(raw.get("session_id"), str):
            self.session_id = raw["session_id"]
        await self.log_call(call, str(raw.get("tool_name") or ""), raw.get("tool_input"))
        if self.answers_replay(call) or call in self.decided:
            # An answer exists (claude-agent-sdk-python #993: on resume this hook fires only
            # sometimes): never defer it again; the callback gives that answer.
            logger.info("claude.replay_hook", extra={"thread_id": self.turn.thread_id})
            return {}
        if self.parked is not None:
            return await self.defer(call)
        if raw.get("tool_name") != ASK_TOOL:
            return {}
        tool_input = raw.get("tool_input")
        try:
            self.decided[call] = await self.question(
                tool_input if isinstance(tool_input, dict) else {}, call
            )
        except PromptParked:
            return await self.defer(call)
        except Exception as e:
            self.decided[call] = self.fail(e)
        return {}

    async def defer(self, call: str) -> HookJSONOutput:
        if self.pending is not None and self.pending.deferred is None:
            self.pending.deferred = call
        await self.log_step(call, "deferred")  # it does not run now (maybe on resume)
        return {
            "hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "defer"}
        }

    def fail(self, error: Exception) -> PermissionResult:
        """An unexpected error in a callback ends the turn (it is re-raised when the run ends)."""
        logger.exception("claude.callback_failed", extra={"thread_id": self.turn.thread_id})
        if self.fatal is None:
            self.fatal = error
        self.kill()
        return PermissionResultDeny(message=f"Not run: the worker failed ({error!r}).")

    # -- the CLI ---------------------------------------------------------------------------

    def options(self, scratch: Path, cwd: Path, resume: str | None) -> ClaudeAgentOptions:
        assert self.tmpdir is not None
        env = {
            **QUIET_ENV,
            "CLAUDE_CONFIG_DIR": str(scratch / "config"),
            "HOME": str(scratch / "home"),
            # Short, so Claude Code's socket (<dir>/cc-socks/<pid>.sock, at most 103 bytes) fits
            # in it rather than falling back to a shared /tmp/cc-socks-<uid>.
            "TMPDIR": str(self.tmpdir),
            "XDG_RUNTIME_DIR": str(self.tmpdir),
        }
        if self.config.base_url:
            env["ANTHROPIC_BASE_URL"] = self.config.base_url
        if self.config.api_key:
            env["ANTHROPIC_API_KEY"] = self.config.api_key
        autonomous = self.turn.permissions == "autonomous"
        if autonomous and hasattr(os, "geteuid") and os.geteuid() == 0:
            env["IS_SANDBOX"] = "1"  # bypassPermissions is refused as root otherwise
        cli = self.h.launcher()
        if cli is not None:
            # Which process the supervisor must outlive: it exits at once if this one is gone.
            env[claude_launch.PARENT_ENV] = str(os.getpid())
        for d in ("config", "home"):
            (scratch / d).mkdir(parents=True, exist_ok=True)
        return ClaudeAgentOptions(
            cwd=str(cwd),
            env=env,
            setting_sources=[],
            system_prompt={"type": "preset", "preset": "claude_code"},
            permission_mode="bypassPermissions" if autonomous else "default",
            settings=ASK_EVERY_CALL if self.turn.permissions == "guarded" else None,
            can_use_tool=self.can_use_tool,
            hooks={
                "PreToolUse": [
                    HookMatcher(matcher=None, hooks=[self.pre_tool_use], timeout=HOOK_TIMEOUT)
                ]
            },
            model=self.config.model,
            max_turns=self.config.max_turns,
            resume=resume,
            session_store=cast(SessionStore, self.store) if self.store else None,
            session_store_flush="eager",
            cli_path=cli or self.h.cli_path,
            stderr=self.stderr.append,
        )

    def kill(self) -> None:
        """SIGKILL the CLI and everything it started: it writes nothing more (no aborted call
        reaches the transcript). Through the supervisor, which kills the whole tree; a SIGKILL
        of the supervisor itself would leave the CLI's commands (each in a session of its own)
        running."""
        transport = getattr(self.client, "_transport", None)
        process = getattr(transport, "_process", None)
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if self.h.launcher() is not None:
                    process.send_signal(claude_launch.KILL_TREE)
                else:
                    process.kill()

    async def next_result(
        self, messages: asyncio.Queue[Any], first: float | None = None
    ) -> ResultMessage | None:
        """Emit assistant text until the CLI's result; None when the stream ended, or when
        nothing happened within `first` seconds (a resume with nothing to replay)."""
        loop = asyncio.get_running_loop()
        while True:
            timeout = None
            if first is not None and not self.activity.is_set():
                timeout = first
            if self.parked is not None:
                timeout = max(0.0, self.parked_at + PARK_SETTLE - loop.time())
            try:
                message = await asyncio.wait_for(messages.get(), timeout)
            except TimeoutError:
                if self.parked is not None:
                    logger.warning("claude.park_settle", extra={"thread_id": self.turn.thread_id})
                    self.kill()
                return None
            if message is None:
                return None
            if isinstance(message, BaseException):
                raise message
            self.activity.set()
            result = await self.take(message)
            if result is not None:
                return result

    async def take(self, message: Any) -> ResultMessage | None:
        if isinstance(message, SystemMessage) and message.subtype == "init":
            await self.started(message.data)
        elif isinstance(message, UserMessage):
            await self.log_results(message)  # as each result arrives, not at the turn's end
        elif isinstance(message, AssistantMessage):
            for block in message.content:
                if isinstance(block, ToolUseBlock) and message.uuid:
                    self.asked_in[block.id] = message.uuid
                if isinstance(block, TextBlock) and block.text.strip():
                    await self.turn.emit(block.text)
        elif isinstance(message, ResultMessage):
            if message.session_id:
                self.session_id = message.session_id
            return message
        return None

    async def started(self, data: dict[str, Any]) -> None:
        """The CLI's init message: the session id, and what its transcript entries carry."""
        sid = data.get("session_id")
        if isinstance(sid, str) and sid:
            self.session_id = sid
            await self.log_session()
        for ours, theirs in (("cwd", "cwd"), ("version", "claude_code_version")):
            if isinstance(data.get(theirs), str):
                self.transcript_meta[ours] = data[theirs]

    async def drive(
        self, scratch: Path, cwd: Path, resume: str | None, prompts: list[str], replay: bool
    ) -> ResultMessage | None:
        """Connect (resuming `resume`), let a deferred call replay, then send each prompt."""
        self.client = client = ClaudeSDKClient(self.options(scratch, cwd, resume))
        messages: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for message in client.receive_messages():
                    messages.put_nowait(message)
            except Exception as e:
                messages.put_nowait(e)
            finally:
                messages.put_nowait(None)

        reader: asyncio.Task[None] | None = None
        ok = False
        try:
            await client.connect()
            reader = asyncio.create_task(pump())
            result = None
            if replay:
                result = await self.next_result(messages, first=REPLAY_GRACE)
                if self.told:
                    # the replayed call's tool_result told the agent; a cut-off turn still must
                    prompts = [p for p in [claude_calls.preface(self.turn.interrupted)] if p]
            for prompt in prompts:
                if self.parked is not None or self.fatal is not None:
                    break
                await client.query(prompt)
                result = await self.next_result(messages)
            ok = True
            return result
        finally:
            if not ok or self.fatal is not None:
                self.kill()  # a failure, a lost thread: the CLI must write nothing more
            await self.close(client, reader)

    async def close(self, client: ClaudeSDKClient, reader: asyncio.Task[None] | None) -> None:
        # The SDK's copy of a resumed transcript (a temporary folder it removes on a clean
        # disconnect): removed here too when the disconnect did not get that far.
        materialized = getattr(getattr(client, "_materialized", None), "config_dir", None)
        try:
            await client.disconnect()
        except asyncio.CancelledError:
            self.kill()
            raise
        except Exception:
            self.kill()
            logger.debug("claude.disconnect_failed", exc_info=True)
        finally:
            if isinstance(materialized, Path):
                shutil.rmtree(materialized, ignore_errors=True)
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    # -- the turn --------------------------------------------------------------------------

    def plan(self) -> bool:
        """Replay a deferred call first? On a resume turn the prompt (the resume text) follows
        only if the replayed call did not take the answer; on a new turn (the prompt it waited on
        was cancelled) the call is refused, then the message follows."""
        before = self.before
        if before is None or not before.deferred or not self.session_id:
            return False
        self.replayed = before.deferred
        return True

    async def go(self) -> TurnResult:
        cwd = self.h.workdir(self.turn)
        if not cwd.is_dir():
            return TurnResult(
                "failed", state=self.state(), error=f"the work folder {cwd} does not exist"
            )
        scratch = Path(tempfile.mkdtemp(prefix="run-", dir=self.h.scratch_dir()))
        self.tmpdir = Path(tempfile.mkdtemp(prefix="pbc-"))
        try:
            return await self.attempt(scratch, cwd)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)
            await asyncio.to_thread(shutil.rmtree, self.tmpdir, True)

    def opening(self) -> str:
        """The turn's first message: after a cut-off turn, what is known of it comes first."""
        told = claude_calls.preface(self.turn.interrupted)
        return f"{told}\n\n{self.turn.prompt}" if told else self.turn.prompt

    async def attempt(self, scratch: Path, cwd: Path) -> TurnResult:
        if self.turn.interrupted is not None and self.session_id is None and self.turn.store:
            # A first turn cut off before its state was stored: continue its own session.
            with contextlib.suppress(Exception):
                records = await self.turn.store.load(claude_calls.CALLS)
                self.session_id = claude_calls.last_session(records)
        await self.log(e="turn")
        replay = self.plan()
        resumed = self.session_id
        first = self.opening()
        try:
            try:
                result = await self.drive(scratch, cwd, resumed, [first], replay)
            except ClaudeSDKError as e:
                if resumed and "No conversation found" in f"{e} {' '.join(self.stderr)}":
                    await self.turn.emit(
                        "(the earlier Claude session could not be found; starting a new one)"
                    )
                    self.session_id, self.replayed = None, None
                    result = await self.drive(scratch, cwd, None, [first], False)
                else:
                    raise
        except ClaudeSDKError as e:
            if self.fatal is not None:
                raise self.fatal from e
            if self.parked is not None:
                return self.parked_result()
            return TurnResult("failed", state=self.state(), error=self.describe(e))
        if self.fatal is not None:
            raise self.fatal
        if self.parked is not None:
            return self.parked_result()
        return self.finished(result)

    def parked_result(self) -> TurnResult:
        assert self.parked is not None
        return TurnResult("parked", state=self.state(self.pending), parked=self.parked)

    def finished(self, result: ResultMessage | None) -> TurnResult:
        if result is None:
            tail = "; ".join(list(self.stderr)[-3:])
            error = "Claude Code stopped without a result" + (f": {tail}" if tail else "")
            return TurnResult("failed", state=self.state(), error=error)
        if result.is_error:
            detail = result.result or "; ".join(result.errors or []) or result.subtype
            return TurnResult("failed", state=self.state(), error=f"Claude Code: {detail}")
        return TurnResult("completed", state=self.state())

    def describe(self, error: BaseException) -> str:
        tail = "; ".join(list(self.stderr)[-3:])
        return f"Claude Code failed: {error}" + (f" ({tail})" if tail else "")


def _bundled_cli() -> str | None:
    """The CLI the SDK bundles (where the SDK itself looks first)."""
    import claude_agent_sdk

    path = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
    return str(path) if path.is_file() else None


class ClaudeHarness:
    """The real Claude Code CLI as an agent (see the module docstring)."""

    name = HARNESS

    def __init__(
        self, *, scratch_root: str | os.PathLike[str] | None = None, cli_path: str | None = None
    ) -> None:
        self.root = (
            Path(scratch_root)
            if scratch_root
            else Path(tempfile.gettempdir()) / "prompt-broker-claude"
        )
        self.cli_path = cli_path
        self._launcher: str | None = None  # "" when there is none

    def scratch_dir(self) -> Path:
        runs = self.root / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        return runs

    def workdir(self, turn: Turn) -> Path:
        if turn.work_folder:
            return Path(turn.work_folder)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", turn.thread_id)
        folder = self.root / "work" / safe
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def launcher(self) -> str | None:
        """The supervised CLI (`workers.agents.claude_launch`) as one executable, written once; None
        off Linux or with no CLI found (the SDK then runs, or fails to find, the CLI itself)."""
        if self._launcher is not None or not sys.platform.startswith("linux"):
            return self._launcher or None
        real = self.cli_path or _bundled_cli() or shutil.which("claude")
        if real is None:
            self._launcher = ""
            return None
        folder = self.root / "bin"
        folder.mkdir(parents=True, exist_ok=True)
        script = (
            "#!/bin/sh\n"
            f"exec {shlex.quote(sys.executable)} -I -S {shlex.quote(claude_launch.__file__)} "
            f'{shlex.quote(real)} "$@"\n'
        )
        # Atomic: replicas sharing a scratch root may write it at the same time.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".claude-")
        with os.fdopen(fd, "w") as f:
            f.write(script)
        os.chmod(tmp, 0o755)
        target = folder / "claude-supervised"
        os.replace(tmp, target)
        self._launcher = str(target)
        return self._launcher

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        """What the call log says of the call in flight (`workers.agents.claude_calls.describe`)."""
        if store is None:
            return ""
        try:
            records = await store.load(claude_calls.CALLS)
        except Exception:
            logger.warning("claude.call_log_unreadable", extra={"thread_id": thread_id})
            return (
                "what the call in flight had done could not be read; any call may or may not "
                "have taken effect; check before running it again"
            )
        return claude_calls.describe(records)

    async def run_turn(self, turn: Turn) -> TurnResult:
        try:
            config = parse_config(turn.config)
        except BadItem as e:
            return TurnResult(
                "failed", state=turn.state, error=f"the claude_code harness config: {e}"
            )
        run = _Run(self, turn, config)
        try:
            return await run.go()
        except asyncio.CancelledError:
            run.kill()
            raise
