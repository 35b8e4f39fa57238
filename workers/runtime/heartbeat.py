"""A replica's liveness: joining as a new incarnation, and the heartbeat that keeps it alive.

Every `lease_ttl / 3` one write (`_heartbeat`) proves this replica's incarnation alive for
`lease_ttl` more, whatever it holds: a thread's lease is its holder's liveness. A beat that finds
the record expired or taken by another incarnation drops every thread at once, touching nothing,
and joins again (`_join`), freeing what the former incarnations held.

A beat that ends more than half a lease TTL after the last one that got through began is logged
(`replica.beat_late`): beats start every third of it, so the record came close to running out.
Its fields say why: `gap_s` (from the start of that beat to the end of this one: the longest the
record can have gone unwritten) against `beat_s` (this write itself). A slow write is Redis or
the connection pool; a long gap with a quick write is this process's event loop, held up by
something that did not yield.
"""

from __future__ import annotations

import time

from workers.runtime.holding import Holder, logger


class Heartbeat(Holder):
    """Joining, and the heartbeat (the replica's `beat` loop)."""

    async def _join(self) -> None:
        """Start a new incarnation; free what former ones of this id held (dead now): the one
        on the record, and this process's own last one (its record may be gone already)."""
        sessions = self.broker.sessions
        previous = self.incarnation
        started = time.monotonic()
        self.incarnation, _, former = await sessions.join(self.id, self.ttl_ms)
        self._last_beat = started  # a join writes the record alive, as a beat does
        for old in {former, previous} - {""}:
            freed = await sessions.free(self.id, old)
            logger.info("replica.freed_former", extra={"replica": self.id, "threads": freed})

    async def _heartbeat(self) -> None:
        """One write, whatever is held. Found dead: every thread may be another's by now."""
        started = time.monotonic()
        alive = await self.broker.sessions.beat(self.id, self.incarnation, self.ttl_ms)
        ended = time.monotonic()
        last = self._last_beat
        gap = None if last is None else round(ended - last, 3)  # the longest it went unwritten
        timing = {
            "gap_s": gap,
            "beat_s": round(ended - started, 3),
            "lease_ttl": self.ttl_ms / 1000,
        }
        if alive is not None:
            self._last_beat = started
            if gap is not None and gap > self.ttl_ms / 2000:
                logger.warning("replica.beat_late", extra={"replica": self.id, **timing})
            return
        logger.warning(
            "replica.expired",
            extra={
                "replica": self.id,
                "incarnation": self.incarnation,
                "threads": len(self.threads),
                **timing,
            },
        )
        for thread_id in list(self.threads):
            self._drop(thread_id)
        await self._join()
