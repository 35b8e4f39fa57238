"""A replica's turns: running a thread's agent on its messages or on a parked prompt's answer.

A turn takes one of the replica's turn slots, tells its agent of a turn cut off before it, posts
a guarded thread's `policy_applied` item and gates its calls, hands the harness its prompt
handle (`workers.runtime.waits`), and ends by writing the session's next state: parked, idle,
or failed (an answered wait is kept, never dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson
from redis.exceptions import RedisError

from broker import (
    BadItem,
    BrokerError,
    BrokerUnavailable,
    Fenced,
    Grant,
    Prompt,
    PromptNotFound,
    Session,
    ThreadClosed,
)
from broker.sessions import delivery_token
from workers.agents import policy
from workers.agents.grants import approves, resume_text
from workers.agents.harness import (
    Gate,
    GateVerdict,
    Harness,
    Interruption,
    Resume,
    Turn,
    TurnResult,
)

# A harness's durable session data: compressed, and expiring with its closed thread.
from workers.runtime.agent_store import AgentStore as _Store
from workers.runtime.holding import _Lost, _Thread, logger
from workers.runtime.interruptions import _resume_of, interruption_of
from workers.runtime.waits import HeldWaits, _Handle, _Slot

OUTPUT = "agent_output"
#: The reason a prompt still open when its turn completed is cancelled with.
RUN_ENDED = "the run ended"


class Turns(HeldWaits):
    """Running turns, and the writes a turn makes to its thread."""

    async def _resume(self, t: _Thread, session: Session, prompt: Prompt) -> bool:
        """Run the resume turn of an answered parked prompt, if its answer was never handed
        over; False when it was (the turn that got it was cut off)."""
        q = prompt.questions[0]
        approve = approves(prompt.answers)
        grant = None
        if prompt.kind == "approval" and approve and q.subject:
            grant = Grant(subject=q.subject, grant_key=q.grant_key, granted_by=prompt.prompt_id)
        token = t.tokens.setdefault(prompt.prompt_id, delivery_token())
        handed = await self.broker.sessions.resume(
            t.thread_id, prompt.prompt_id, t.epoch, grant, token
        )
        del t.tokens[prompt.prompt_id]  # a reply came: the next attempt is a new one
        if handed.outcome == "already":
            logger.warning(
                "turn.resume_refused",
                extra={"thread_id": t.thread_id, "prompt_id": prompt.prompt_id},
            )
            return False
        if handed.outcome == "unanswered":
            return True  # the record moved on (the prompt is gone): look again
        logger.info("turn.resume", extra={"thread_id": t.thread_id, "prompt_id": prompt.prompt_id})
        await self._run_turn(
            t, session, resume_text(prompt, session.work_folder), _resume_of(prompt)
        )
        return True

    async def _run_turn(
        self, t: _Thread, session: Session, text: str, resume: Resume | None
    ) -> None:
        harness = self.harnesses.get(session.harness)
        interrupted = interruption_of(session.interrupted)
        slot = _Slot(self._slots)
        await slot.acquire()
        try:
            # The interruption is told to this turn's agent, and only to it.
            if resume is None:
                await self._update(t, status="running", interrupted=None, delivered=None)
            elif interrupted is not None:
                await self._update(t, interrupted=None)
            if harness is None:
                result = TurnResult("failed", error=f"no harness {session.harness!r} here")
            else:
                result = await self._call_harness(
                    t, session, harness, text, resume=resume, slot=slot, interrupted=interrupted
                )
        finally:
            slot.release()
        await self._end_turn(t, result)

    async def _call_harness(
        self,
        t: _Thread,
        session: Session,
        harness: Harness,
        text: str,
        *,
        resume: Resume | None,
        slot: _Slot,
        interrupted: Interruption | None = None,
    ) -> TurnResult:
        try:
            gate = await self._gate(t, session) if session.permissions == "guarded" else None
        except BadItem as e:
            return TurnResult("failed", error=f"the thread's policy cannot be enforced: {e}")
        turn = Turn(
            thread_id=t.thread_id,
            prompt=text,
            permissions=session.permissions,
            config=session.config,
            state=session.state,
            handle=_Handle(self, t, slot),
            emit=lambda line: self._emit(t, line),
            resume=resume,
            work_folder=session.work_folder,
            gate=gate,
            store=_Store(self.broker, t.thread_id),
            interrupted=interrupted,
        )
        try:
            return await harness.run_turn(turn)
        except (_Lost, Fenced, asyncio.CancelledError):
            raise
        except (RedisError, BrokerUnavailable):
            # Redis trouble (down, loading its data, timing out), not the agent's: the turn is
            # cut off as if this replica had stopped, and its records decide on the next look
            # (a parked wait resumes, a cut-off turn is reported), never a failed turn that
            # would drop a wait whose answer may already be given.
            logger.warning("turn.redis_trouble", extra={"thread_id": t.thread_id}, exc_info=True)
            raise
        except Exception as e:
            logger.exception("turn.crashed", extra={"thread_id": t.thread_id})
            return TurnResult("failed", error=f"the agent crashed: {e!r}")

    async def _gate(self, t: _Thread, session: Session) -> Gate:
        """A guarded turn's gate, once its `policy_applied` item is posted. `BadItem` when the
        thread's policy is missing or malformed (a thread created around
        `workers.agents.policy`)."""
        if session.policy is None:
            raise BadItem("policy", "POLICY_MISSING: guarded permissions need a policy block")
        try:
            thread_policy = policy.parse_policy(session.policy)
        except BadItem as e:
            raise BadItem(e.field, f"POLICY_INVALID: {e.problem}") from None
        guard = policy.Guard(self.policy_rules, thread_policy, session.work_folder)
        applied = guard.applied()
        counts = applied["counts"]
        summary = f"policy applied: {counts['rules']} rules, default {thread_policy.default}"
        await self._post(t, summary, "policy_applied", None, applied)

        async def gate(harness: str, tool: str, tool_input: dict[str, Any]) -> GateVerdict:
            verdict = await guard.decide_async(harness, tool, tool_input)
            logger.info(
                "policy.verdict",
                extra={"thread_id": t.thread_id, "action": verdict.action, "rule": verdict.rule},
            )
            if verdict.action == "deny" and verdict.rule != policy.EVALUATION_ERROR:
                content, meta = policy.denied_item(verdict)
                try:
                    await self._post(t, content, "policy_denied", None, meta)
                except (BrokerError, OSError):  # the call stays refused; only the item is lost
                    logger.exception("policy.denied_not_posted", extra={"thread_id": t.thread_id})
            return verdict

        return gate

    async def _end_turn(self, t: _Thread, result: TurnResult) -> None:
        state = _json(result.state)
        if result.status == "parked":
            await self._update(t, status="parked", hstate=state, delivered=None)
            logger.info("turn.parked", extra={"thread_id": t.thread_id})
            return
        if result.status == "failed":
            await self.broker.cancel(t.thread_id, result.error, epoch=t.epoch)
            await self._post(t, f"✗ the turn failed: {result.error}", "turn_end", "failed")
            if await self._answered_wait(t):
                # The person answered what the agent waited on before the turn failed: that
                # answer is not dropped; the session stays parked on it and resumes.
                await self._update(t, status="parked", hstate=state, error=result.error)
                t.kicked = True
                return
            await self._update(
                t, status="idle", wait=None, hstate=state, error=result.error, delivered=None
            )
            return
        # A run that ended leaves no question behind for nobody to take the answer of.
        await self.broker.cancel(t.thread_id, RUN_ENDED, epoch=t.epoch)
        await self._post(t, "", "turn_end", "completed")
        await self._update(t, status="idle", wait=None, hstate=state, error=None, delivered=None)

    async def _answered_wait(self, t: _Thread) -> bool:
        """Whether the session waits on a prompt that is answered and not yet handed over."""
        session = await self.broker.sessions.get(t.thread_id, lease=False)
        if session is None or session.waiting is None:
            return False
        try:
            prompt = await self.broker.get_prompt(t.thread_id, session.waiting.prompt_id)
        except PromptNotFound:
            return False
        return prompt.state == "answered" and prompt.delivered_at is None

    async def _update(self, t: _Thread, **fields: str | None) -> None:
        await self.broker.sessions.update(t.thread_id, t.epoch, **fields)

    async def _emit(self, t: _Thread, line: str) -> None:
        await self._post(t, line, OUTPUT, None)

    async def _post(
        self,
        t: _Thread,
        text: str,
        type_: str,
        status: str | None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        meta: dict[str, Any] = {**(extra or {}), "type": type_}
        if status is not None:
            meta["status"] = status
        content = [{"type": "text", "text": text}] if text else []
        try:
            await self.broker.post_item(
                t.thread_id,
                {"content": content, "metadata": meta, "author": self.broker.identity},
                epoch=t.epoch,
            )
        except (Fenced, ThreadClosed) as e:
            raise _Lost from e


def _json(value: Any) -> str | None:
    return orjson.dumps(value).decode() if value is not None else None
