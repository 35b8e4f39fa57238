"""A replica's batched looks at the threads it holds: for work a missed bell would have announced.

A resubscription, a fresh adoption, or a look that failed on a Redis error has threads looked at
in a batch (`suspect`, the `sweep` loop): look.lua, on pages of them, reads their records;
only the threads with something to do are kicked, and a dead holder's held wait is adopted as
parked right there, in the same step.
"""

from __future__ import annotations

import asyncio

from workers.runtime.holding import Holder, _Thread, logger


class Sweeping(Holder):
    """The `sweep` loop and the pipelined looks it makes."""

    async def _suspect_loop(self) -> None:
        while True:
            await self._suspect_event.wait()
            await asyncio.sleep(0.05)  # gather a resubscription's worth into one batch
            self._suspect_event.clear()
            suspects, self._suspects = self._suspects, set()
            try:
                await self._sweep(suspects)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica.loop_failed", extra={"loop": "sweep"})
                self._retry_later(suspects)

    async def _sweep(self, thread_ids: set[str] | None = None) -> None:
        """Look at threads (all when None) for work a missed bell would have announced: read
        their records in pipelines and kick only the threads that have something to do."""
        if thread_ids is None:
            threads = list(self.threads.values())
        else:
            threads = [t for i in thread_ids if (t := self.threads.get(i)) is not None]
        idle = [t for t in threads if t.task is None or t.task.done()]
        for i in range(0, len(idle), 500):
            for thread_id in await self._needing_a_look(idle[i : i + 500]):
                self.kick(thread_id)

    async def _needing_a_look(self, threads: list[_Thread]) -> list[str]:
        """Of these idle threads, those with something to do: look.lua, on pages of them. A
        dead holder's held wait (status running, its prompt pending, no turn here) is adopted
        as parked right there, in the same step, rather than by a look each."""
        held = {t.thread_id: t.epoch for t in threads}
        replies = await self.broker.sessions.look_many(self.id, self.incarnation, held)
        # look: lost, messages waiting, a turn that died, its prompt resolved: act on it
        return [t for t, reply in replies.items() if reply == "look"]
