"""A replica's batched looks at the threads it holds: for work a missed bell would have announced.

A resubscription, a fresh adoption, or a look that failed on a Redis error has threads looked at
in a batch (`suspect`, the `sweep` loop): their records are read in pipelines, only the threads
with something to do are kicked, and a dead holder's held wait is adopted as parked right there.
"""

from __future__ import annotations

import asyncio

import orjson

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
        """Of these idle threads, those with something to do, from their records read in
        pipelines. A dead holder's held wait (status running, its prompt pending, no turn here)
        is adopted as parked right here, in one pipeline, rather than by a look each."""
        redis = self.broker.redis
        pipe = redis.pipeline(transaction=False)
        for t in threads:
            keys = self.broker.thread(t.thread_id)
            pipe.hmget(keys.session, ["owner", "inc", "epoch", "status", "wait"])
            pipe.llen(keys.inbox)
        rows = await pipe.execute()
        look: list[str] = []
        waiting: list[tuple[_Thread, str, str]] = []
        for t, (owner, inc, epoch, status, wait), queued in zip(
            threads, rows[::2], rows[1::2], strict=True
        ):
            lost = owner != self.id or inc != self.incarnation or epoch != str(t.epoch)
            if lost or queued or (not wait and status in ("running", "parked")):
                look.append(t.thread_id)  # lost, messages waiting, a turn that died: look
            elif wait:
                waiting.append((t, orjson.loads(wait)["prompt_id"], status))
        if not waiting:
            return look
        pipe = redis.pipeline(transaction=False)
        for t, prompt_id, _ in waiting:
            pipe.hget(self.broker.thread(t.thread_id).prompt(prompt_id), "state")
        states = await pipe.execute()
        park: list[_Thread] = []
        for (t, _, status), state in zip(waiting, states, strict=True):
            if state != "pending":
                look.append(t.thread_id)  # answered, cancelled or gone: act on it
            elif status != "parked":
                park.append(t)
        return look + await self._park(park)

    async def _park(self, threads: list[_Thread]) -> list[str]:
        """Mark these sessions parked, in one pipeline; those refused (fenced) need a look."""
        if not threads:
            return []
        redis = self.broker.redis
        pipe = redis.pipeline(transaction=False)
        for t in threads:
            session = self.broker.thread(t.thread_id).session
            self.broker._scripts.queue(pipe, "update", [session], [t.epoch, "status", "parked"])
        replies = await self.broker._scripts.run_pipeline(redis, pipe)
        # fenced: another holder has it now; the look finds it lost and drops it
        return [t.thread_id for t, r in zip(threads, replies, strict=True) if r[0] != "ok"]
