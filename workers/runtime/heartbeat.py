"""A replica's liveness: joining as a new incarnation, and the heartbeat that keeps it alive.

Every `lease_ttl / 3` one write (`_heartbeat`) proves this replica's incarnation alive for
`lease_ttl` more, whatever it holds: a thread's lease is its holder's liveness. A beat that finds
the record expired or taken by another incarnation drops every thread at once, touching nothing,
and joins again (`_join`), freeing what the former incarnations held.
"""

from __future__ import annotations

from workers.runtime.holding import Holder, logger


class Heartbeat(Holder):
    """Joining, and the heartbeat (the replica's `beat` loop)."""

    async def _join(self) -> None:
        """Start a new incarnation; free what former ones of this id held (dead now): the one
        on the record, and this process's own last one (its record may be gone already)."""
        sessions = self.broker.sessions
        previous = self.incarnation
        self.incarnation, _, former = await sessions.join(self.id, self.ttl_ms)
        for old in {former, previous} - {""}:
            freed = await sessions.free(self.id, old)
            logger.info("replica.freed_former", extra={"replica": self.id, "threads": freed})

    async def _heartbeat(self) -> None:
        """One write, whatever is held. Found dead: every thread may be another's by now."""
        if await self.broker.sessions.beat(self.id, self.incarnation, self.ttl_ms) is not None:
            return
        logger.warning(
            "replica.expired",
            extra={
                "replica": self.id,
                "incarnation": self.incarnation,
                "threads": len(self.threads),
            },
        )
        for thread_id in list(self.threads):
            self._drop(thread_id)
        await self._join()
