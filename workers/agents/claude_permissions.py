"""The Claude harness's permission callbacks: Claude Code's calls become prompts, and the
answers permission results.

`Permissions` adds to a turn's run (`RunState`) the SDK's `can_use_tool` callback and the
`PreToolUse` hook: an approval (after the policy gate, in guarded mode) or an `AskUserQuestion`
is asked through the turn's prompt handle once the call is in the stored transcript, and the
answer becomes `PermissionResultAllow` (with the answers in the tool's input, for a question)
or `PermissionResultDeny` saying who refused, or that nobody did. A parked wait defers the call
from the hook (the session pauses with it pending); on resume, the replayed call gets the
answer the turn was resumed with (`replay`). See "Permissions", "Questions" and "Held and parked
waits" in `workers.agents.claude`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from claude_agent_sdk import (
    HookContext,
    HookInput,
    HookJSONOutput,
    PermissionResult,
    PermissionResultAllow,
    PermissionResultDeny,
    ToolPermissionContext,
)

from broker import Answer, BadItem, PromptCancelled, PromptUnavailable, verdict
from broker.models import Question
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
from workers.agents.claude_config import HARNESS
from workers.agents.claude_state import Pending, RunState
from workers.agents.harness import PromptParked, approval_question

__all__ = ["Permissions"]

#: The harness's one logger: its records keep this name whichever module of the harness logs.
logger = logging.getLogger("workers.agents.claude")


class Permissions(RunState):
    """A turn's run with its permission callbacks: asking, answering, deferring."""

    # -- asking ----------------------------------------------------------------------------

    async def ask(
        self, kind: str, questions: list[Question], call: str, tool: str, key: str | None
    ) -> list[Answer]:
        """Ask through the handle once the call is in the stored transcript; a park is
        recorded (the caller refuses or defers)."""
        if self.store is not None and not await self.store.stored(call):
            logger.warning("claude.mirror_late", extra={"thread_id": self.turn.thread_id})
        pending = Pending(call=call, tool=tool, kind=kind, key=key)
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
