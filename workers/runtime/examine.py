"""A replica's examinations: a thread's bell rang, so read its records and do what they say.

Whenever a thread's bell rings and no turn of it runs here (the `kicks` loop), one task reads its
records: it resumes a parked turn whose prompt was answered, adopts a dead replica's open prompt
as parked, reports a turn that was cut off (once), or starts a turn for queued messages.
"""

from __future__ import annotations

import asyncio

from broker import Fenced, Prompt, PromptNotFound, Session
from workers.agents.harness import Interruption, Resume

# A harness's durable session data: compressed, and expiring with its closed thread.
from workers.runtime.agent_store import AgentStore as _Store
from workers.runtime.holding import _Lost, _Thread, logger
from workers.runtime.interruptions import _resume_of, interruption_record, interruption_text
from workers.runtime.turns import Turns


class Examining(Turns):
    """The `kicks` loop: one examination task per rung thread."""

    async def _kick_loop(self) -> None:
        while True:
            await self._kick_event.wait()
            self._kick_event.clear()
            kicks, self._kicks = self._kicks, set()
            for thread_id in kicks:
                t = self.threads.get(thread_id)
                if t is not None and (t.task is None or t.task.done()):
                    t.task = asyncio.create_task(self._examine(t), name=f"thread {thread_id}")

    async def _examine(self, t: _Thread) -> None:
        try:
            while not self._stopping:
                t.kicked = False
                await self._step(t)
                if not t.kicked:
                    return
        except _Lost:
            self._drop(t.thread_id)
        except Fenced:
            self._drop(t.thread_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("replica.thread_failed", extra={"thread_id": t.thread_id})
            self._retry_later({t.thread_id})

    async def _step(self, t: _Thread) -> None:
        """Do what the thread's records say, once."""
        session = await self.broker.sessions.get(t.thread_id, lease=False)
        if session is None or session.owner != self.id or session.epoch != t.epoch:
            raise _Lost
        if session.holder_incarnation != self.incarnation:
            raise _Lost
        if session.status == "closed":
            raise _Lost
        if session.waiting is not None:
            if await self._waiting(t, session, session.waiting.prompt_id):
                return
        elif session.status in ("running", "parked"):
            # A turn was cut off (its replica died, paused past its lease, or lost Redis) with
            # nothing waited on: perhaps after an answer was handed to it.
            await self._interrupted(t, session, waited=None)
        inbox = await self.broker.take_inbox(t.thread_id)
        if inbox:
            text = "\n\n".join(i.text for i in inbox if i.text)
            session = await self.broker.sessions.get(t.thread_id, lease=False) or session
            await self._run_turn(t, session, text, None)

    async def _waiting(self, t: _Thread, session: Session, prompt_id: str) -> bool:
        """Act on the prompt the session waits on; True when nothing more is to be done now."""
        try:
            prompt = await self.broker.get_prompt(t.thread_id, prompt_id)
        except PromptNotFound:
            prompt = None
        if prompt is not None and prompt.state == "pending":
            if session.status != "parked":  # a dead replica's held wait: adopt as parked
                await self._update(t, status="parked")
            return True
        if prompt is not None and prompt.state == "answered":
            if await self._resume(t, session, prompt):
                t.kicked = True  # look again: messages may have queued meanwhile
                return True
            # Handed over before, to a turn that was cut off: tell, never replay.
            await self._interrupted(t, session, waited=prompt)
        elif session.status == "running":
            # A held wait whose turn was cut off, its prompt since cancelled (or gone): the
            # agent will never get an answer, and its turn did not end. Tell that too.
            await self._update(t, wait=None)
            await self._interrupted(t, session, waited=None)
        else:
            await self._update(t, status="idle", wait=None)
        return False

    async def _interrupted(self, t: _Thread, session: Session, waited: Prompt | None) -> None:
        """Report a cut-off turn once: the person gets one item with what is known, the session
        keeps it for the next turn to tell the agent, and nothing of that turn is replayed."""
        delivered_id = waited.prompt_id if waited is not None else session.delivered
        delivered: Resume | None = None
        if delivered_id:
            try:
                prompt = await self.broker.get_prompt(t.thread_id, delivered_id)
            except PromptNotFound:
                prompt = None
            if prompt is not None and prompt.state == "answered":
                delivered = _resume_of(prompt)
        note = await self._describe(t, session)
        grant = "none"
        if delivered is not None and delivered.verdict == "approve":
            grant = await self.broker.sessions.grant_of(t.thread_id, delivered.prompt_id)
        interruption = Interruption(delivered=delivered, note=note)
        told = await self.broker.sessions.interrupt(
            t.thread_id,
            t.epoch,
            interruption_text(delivered, note, grant=grant),
            metadata={"interrupted": {"delivered": delivered_id or None, "note": note}},
            interruption=interruption_record(interruption),
            waited=waited.prompt_id if waited is not None else None,
        )
        if told:
            logger.info(
                "turn.interrupted",
                extra={"thread_id": t.thread_id, "prompt_id": delivered_id, "note": note},
            )

    async def _describe(self, t: _Thread, session: Session) -> str:
        """The harness's account of the call in flight; "" when it has none or fails to say."""
        harness = self.harnesses.get(session.harness)
        if harness is None:
            return ""
        try:
            async with asyncio.timeout(10):
                return await harness.describe_interruption(
                    t.thread_id, session.state, _Store(self.broker, t.thread_id)
                )
        except asyncio.CancelledError:
            raise
        except Exception:  # the interruption is reported all the same, without its note
            logger.exception("turn.interruption_undescribed", extra={"thread_id": t.thread_id})
            return ""
