"""A replica's adoption: claiming a fair share of the threads with no live holder, and holding them.

Every `adopt_interval` the replica reads the replica records and claims, in pipelined pages,
threads whose holder is dead, released or freed, or that are new; a claim bumps the thread's
fencing epoch. Each page's threads are subscribed to (their bells ring `kick`) and looked at in
one batch while the next page is claimed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any

from broker import BrokerError
from workers.runtime.holding import _Thread, logger
from workers.runtime.sweep import Sweeping

#: A thread whose lease ran out this long ago is taken by any replica, however loaded.
URGENT_MS = 500
#: Expired leases one adoption look takes; a full page means more wait: look again at once.
ADOPT_PAGE = 1000


class Adoption(Sweeping):
    """The `adopt` loop: claiming threads, listening to their bells, their first look."""

    async def _adopt(self) -> None:
        # Each page's threads are subscribed to and looked at while the next page is claimed.
        attaching: list[asyncio.Task[None]] = []
        try:
            while not self._stopping and await self._adopt_page(ADOPT_PAGE, attaching):
                pass
        finally:
            if attaching:
                await asyncio.gather(*attaching, return_exceptions=True)
            self._adopted.set()

    async def _adopt_page(self, limit: int, attaching: list[asyncio.Task[None]]) -> bool:
        """One look at the threads without a live holder; True if it claimed a full page."""
        fleet = await self.broker.sessions.look()
        if self.incarnation not in {r.incarnation for r in fleet.alive().values()}:
            return False  # dead itself (the heartbeat will join again): claims would not last
        seen = await self.broker.sessions.candidates(fleet, limit)
        candidates = [t for t in seen.expired if t not in self.threads]
        if not candidates:
            return False
        # Spread threads over the live replicas: one holding its fair share already takes only
        # threads nobody else took within URGENT_MS; and nobody takes more than a share a sweep.
        alive = max(1, seen.replicas)
        if len(self.threads) >= -(-seen.threads // alive):
            candidates = [t for t in candidates if seen.now - seen.expired[t] > URGENT_MS]
        random.shuffle(candidates)
        candidates = candidates[: -(-len(candidates) // alive)]
        claimed = await self.broker.sessions.claim_many(
            candidates, self.id, self.incarnation, seen.dead
        )
        for thread_id, epoch in claimed.items():
            self.threads[thread_id] = _Thread(thread_id, epoch, listener=self._kicker(thread_id))
        attaching.append(asyncio.create_task(self._attach(claimed)))
        if claimed:
            # How long each waited with no live holder (server time): its holder's death or its
            # creation, to this claim. Counted by the metrics (an histogram). A thread released
            # by a clean stop, or freed by a restart, is indexed with no time (score 0: taken
            # first): it is not timed, rather than timed from 1970.
            waited = [
                max(0, seen.now - since) / 1000
                for t in claimed
                if (since := seen.expired.get(t, seen.now)) > 0
            ]
            logger.info(
                "replica.adopted",
                extra={"replica": self.id, "threads": len(claimed), "waited_s": waited},
            )
        return len(claimed) >= limit

    async def _attach(self, claimed: Mapping[str, int]) -> None:
        """Hold the claimed threads: listen to all their bells (one SUBSCRIBE), look at each."""
        held = {t: self.threads[t] for t in claimed if t in self.threads}
        await self.broker.listen_many({t: h.listener for t, h in held.items()})
        # One batched look, not one examination each: most adopted threads just wait.
        try:
            for t in held.values():
                t.fresh = False
            await self._sweep(set(held))
        except (BrokerError, OSError, ConnectionError):
            logger.exception("replica.loop_failed", extra={"loop": "attach"})
            self._retry_later(set(claimed))

    def _kicker(self, thread_id: str) -> Any:
        def ring(_channel: str, wake: Mapping[str, Any]) -> None:
            if wake.get("resubscribed"):
                t = self.threads.get(thread_id)
                if t is not None and not t.fresh:
                    self.suspect(thread_id)  # a bell may have rung meanwhile: look in a batch
            else:
                self.kick(thread_id)

        return ring
