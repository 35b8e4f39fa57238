"""Prompt deadlines, fleet-wide: a prompt nobody answered within `PROMPT_BROKER_OPS_PROMPT_DEADLINE`
seconds is cancelled with reason `expired`. Never approved, never denied: its agent is told the
prompt is unavailable because it expired, as for any prompt nobody answered.

Unset or 0 (the default): no deadline, and nothing changes: a wait outlives every process, and an
answer a week later still resumes the session.

- Server time: a prompt's age is the Redis server's clock now minus its record's `created` (the
  server's clock when it was asked), so no process's clock matters.
- Exactly once: the cancellation is the broker's cancel of that very prompt id, one script that
  acts only while the prompt is pending. Any number of processes may run the expirer (each audit
  worker does): one of them cancels, the others find it no longer pending and do nothing.
- Restarts: nothing is kept but the prompts themselves; an expirer that starts looks at every
  open prompt, so one that was due while every process was down is cancelled at the first look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from broker import Broker, BrokerError
from broker.keys import Keys
from workers.runtime.background import in_background
from workers.runtime.ops_status import server_ms

__all__ = ["DEADLINE_ENV", "EXPIRED", "expire_due", "expiring"]

logger = logging.getLogger("workers.runtime.deadlines")

DEADLINE_ENV = "PROMPT_BROKER_OPS_PROMPT_DEADLINE"
#: The reason an expired prompt is cancelled with.
EXPIRED = "expired"
#: Open-index members looked at per round trip.
PAGE = 500
#: The open index is scored by the asker's clock: look this much wider, the record decides.
SKEW_MS = 60_000


async def expire_due(broker: Broker, deadline_s: float) -> int:
    """Cancel every pending prompt older than `deadline_s` (server time); returns how many this
    call cancelled."""
    now = await server_ms(broker.redis)
    limit = now - int(deadline_s * 1000)
    cancelled = 0
    start = 0
    while True:
        members = await broker.indexes.open.page(
            broker.redis, "-inf", limit + SKEW_MS, offset=start, count=PAGE
        )
        if not members:
            return cancelled
        pipe = broker.redis.pipeline(transaction=False)
        pairs = [Keys.split_member(m) for m, _ in members]
        for thread_id, prompt_id in pairs:
            pipe.hmget(broker.thread(thread_id).prompt(prompt_id), ["state", "created"])
        for (thread_id, prompt_id), (state, created) in zip(
            pairs, await pipe.execute(), strict=True
        ):
            if state != "pending" or not created or int(created) > limit:
                continue
            try:
                done = await broker.cancel(thread_id, EXPIRED, prompt_id=prompt_id)
            except BrokerError as e:
                logger.warning(
                    "deadline.cancel_failed", extra={"prompt_id": prompt_id, "error": repr(e)}
                )
                continue
            if done is not None:
                cancelled += 1
                logger.info(
                    "prompt.expired",
                    extra={
                        "thread_id": thread_id,
                        "prompt_id": prompt_id,
                        "late_ms": now - int(created) - (now - limit),
                    },
                )
        if len(members) < PAGE:
            return cancelled
        start += PAGE


async def _run(broker: Broker, deadline_s: float, interval: float) -> None:
    while True:
        try:
            await expire_due(broker, deadline_s)
        except (RedisError, OSError) as e:
            logger.warning("deadline.look_failed", extra={"error": repr(e)})
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def expiring(broker: Broker, deadline_s: float) -> AsyncIterator[None]:
    """Expire due prompts in the background for the duration of the block (none when 0)."""
    if not deadline_s:
        yield
        return
    # Looks often enough that a prompt is cancelled within about a second of its deadline.
    async with in_background(_run(broker, deadline_s, min(1.0, deadline_s / 4)), "deadlines"):
        yield
