"""A turn's waits on a person: the prompt handle its agent asks through, held in place or parked.

An agent's `ask` spends a one-shot grant that covers the call, or asks; with waits held, it
blocks in place (its turn slot given back meanwhile) until answered, and the answer is handed
over once (deliver.lua). Past `held_waits_max` held waits the oldest is demoted to parked: its
turn ends, the prompt stays open, and its answer starts a resume turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from broker import Answer, Fenced, Kind, Prompt, Question
from broker.sessions import delivery_token
from workers.agents.grants import covers
from workers.agents.harness import PromptParked
from workers.runtime.holding import Holder, _HeldWait, _Lost, _Thread, logger


class HeldWaits(Holder):
    """The replica's held waits, oldest first, capped at `held_waits_max`."""

    def held_count(self) -> int:
        return len(self._held)

    def _enter_hold(self, held: _HeldWait) -> None:
        self._held.pop(held.thread_id, None)
        self._held[held.thread_id] = held
        while len(self._held) > self.settings.held_waits_max:
            _, oldest = self._held.popitem(last=False)
            oldest.demoted.set()
            logger.info("wait.demoted", extra={"thread_id": oldest.thread_id, "why": "held_cap"})

    def _leave_hold(self, held: _HeldWait) -> None:
        if self._held.get(held.thread_id) is held:
            del self._held[held.thread_id]


class _Slot:
    """A turn's claim on one of the replica's turn slots; a held wait gives it back meanwhile."""

    def __init__(self, sem: asyncio.Semaphore) -> None:
        self._sem = sem
        self._held = False

    async def acquire(self) -> None:
        await self._sem.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._sem.release()


class _Handle:
    """The prompt handle a turn's agent asks through."""

    def __init__(self, replica: HeldWaits, t: _Thread, slot: _Slot) -> None:
        self.r = replica
        self.t = t
        self.slot = slot

    async def ask(
        self,
        kind: Kind,
        questions: Sequence[Question],
        *,
        state: dict[str, Any] | None = None,
    ) -> list[Answer]:
        b, t = self.r.broker, self.t
        qs = [q if isinstance(q, Question) else Question.model_validate(q) for q in questions]
        subject = (qs[0].subject or "") if qs else ""
        if kind == "approval" and subject:
            granted = await self._spend_grant(qs[0])
            if granted is not None:
                return granted
        try:
            prompt = await b.ask(t.thread_id, kind, qs, epoch=t.epoch, agent_state=state)
        except Fenced as e:
            raise _Lost from e
        if self.r.settings.wait_mode == "parked" or self.r._stopping:
            raise PromptParked(prompt.prompt_id, kind, subject)
        return await self._hold(prompt, subject)

    async def _spend_grant(self, q: Question) -> list[Answer] | None:
        b, t = self.r.broker, self.t
        session = await b.sessions.get(t.thread_id, lease=False)
        if session is None or session.grant is None or session.grant.subject != q.subject:
            return None
        if not covers(session.grant.grant_key, q.grant_key, session.work_folder):
            return None
        try:
            item = await b.sessions.spend_grant(session, t.epoch, q.question)
        except Fenced as e:
            raise _Lost from e
        if item is None:
            return None
        logger.info("grant.spent", extra={"thread_id": t.thread_id, "subject": q.subject})
        return [Answer(question=q.question, answer=["Approve"])]

    async def _hold(self, prompt: Prompt, subject: str) -> list[Answer]:
        """Wait in place. The turn's slot is given back meanwhile and taken again only when
        the answer came: a demoted or cancelled hold must never block on a slot."""
        held = _HeldWait(self.t.thread_id, prompt.prompt_id, prompt.kind, subject)
        self.r._enter_hold(held)
        self.slot.release()
        wait = asyncio.ensure_future(
            self.r.broker.wait(
                self.t.thread_id, prompt.prompt_id, epoch=self.t.epoch, deliver=False
            )
        )
        demoted = asyncio.ensure_future(held.demoted.wait())
        try:
            await asyncio.wait({wait, demoted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            demoted.cancel()
            self.r._leave_hold(held)
            if not wait.done():
                wait.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await wait
            elif not wait.cancelled():
                # Retrieved here too: the hold itself may be cancelled (its turn cut off) in
                # the very turn its wait ended, with a PromptCancelled nobody would read.
                wait.exception()
        if wait.cancelled():
            raise PromptParked(prompt.prompt_id, prompt.kind, subject)
        try:
            answers = wait.result()
            # Out of the hold now: a demotion can no longer cancel the delivery half-way.
            handed = await self.r.broker.sessions.deliver(
                self.t.thread_id, prompt.prompt_id, self.t.epoch, delivery_token()
            )
        except Fenced as e:
            raise _Lost from e
        if handed.outcome != "handed":
            # Handed over before (or gone): never twice. Stop touching the thread; its next
            # holder finds the turn cut off and reports it.
            logger.warning(
                "prompt.delivery_refused",
                extra={"thread_id": self.t.thread_id, "prompt_id": prompt.prompt_id},
            )
            raise _Lost
        await self.slot.acquire()
        return answers
