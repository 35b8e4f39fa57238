"""The timekeeper: carries out prompts' timings (broker/timing.py) on server time. Each audit
worker runs one; any number may run at once.

- **Finding prompts with a timing.** It follows the prompt event log for `prompt.opened` and,
  for each new prompt whose record or thread carries a timing, adds it to `<prefix>:due`. A
  look over every open prompt at start and then every `RESCAN` seconds finds any it missed
  (events trimmed past it while no timekeeper ran). `Broker.set_timing` adds the prompt it
  applies to itself.
- **Taking steps.** Every `interval` it takes the prompts due by the server's clock (a page
  at a time) and runs `Broker.step_timing` on each: a reminder writes a `prompt.reminder` event,
  an escalation a `prompt.escalated` event (the HTTP API's streams and webhooks carry both), and
  a deadline cancels the prompt with reason `expired` (`Broker.cancel` of that prompt id, which
  acts once). Each step is taken once across timekeepers: the record says which were taken.
- **At most once, for reminders.** A timekeeper killed between taking a reminder and writing its
  event loses that one event (the record says it was taken); the next step still comes. A
  deadline is never lost that way: only the cancel itself records it.
- **Restarts.** Nothing is kept but the records and the due index; a timekeeper that starts
  takes at once every step that came due while none ran (catching up as one reminder).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from broker import Broker, BrokerError, Settings, Step, events
from broker.keys import Keys
from workers.runtime.background import in_background
from workers.runtime.deadlines import EXPIRED
from workers.runtime.ops_status import server_ms

__all__ = ["RESCAN", "Timekeeper", "keeping_time"]

logger = logging.getLogger("workers.runtime.timekeeper")

#: Seconds between looks over every open prompt (for prompts whose event a timekeeper missed).
RESCAN = 60.0
#: Due prompts taken per round trip.
PAGE = 200


class Timekeeper:
    def __init__(self, broker: Broker, interval: float = 0.25, rescan: float = RESCAN) -> None:
        self.broker = broker
        self.interval = interval
        self.rescan = rescan
        self._after: str | None = None
        self._scanned = 0.0

    @property
    def _keys(self) -> Keys:
        return self.broker.keys

    async def _with_timing(self, members: list[str]) -> list[str]:
        """The members (`T/prompt_id`) whose prompt or thread carries a timing."""
        if not members:
            return []
        pipe = self.broker.redis.pipeline(transaction=False)
        for member in members:
            thread_id, prompt_id = Keys.split_member(member)
            tk = self._keys.thread(thread_id)
            pipe.hexists(tk.prompt(prompt_id), "timing")
            pipe.exists(tk.timing)
        flags = await pipe.execute()
        return [m for i, m in enumerate(members) if flags[2 * i] or flags[2 * i + 1]]

    async def _schedule(self, members: list[str]) -> int:
        """Add to the due index (to be looked at now) those with a timing not there yet."""
        timed = await self._with_timing(members)
        await self.broker.indexes.due.add(self.broker.redis, dict.fromkeys(timed, 0), nx=True)
        return len(timed)

    async def follow(self) -> int:
        """Schedule the prompts opened since the last look; returns how many had a timing."""
        redis, keys = self.broker.redis, self._keys
        if self._after is None:
            self._after = await events.last_event_id(redis, keys)
            await self.scan()  # what opened before this timekeeper started
        found = 0
        while True:
            batch = await events.read_after(redis, keys, self._after)
            if not batch:
                return found
            opened = [
                Keys.member(e.thread_id, e.prompt_id) for e in batch if e.name == events.OPENED
            ]
            found += await self._schedule(opened)
            self._after = batch[-1].id

    async def scan(self) -> int:
        """Schedule every open prompt with a timing (missed events); returns how many. The due
        index's members a former bucket count left in another bucket move to their own."""
        self._scanned = time.monotonic()
        await self.broker.indexes.due.regroup(self.broker.redis)
        found = 0
        batch: list[str] = []
        async for _, member, _ in self.broker.indexes.open.scan(self.broker.redis):
            batch.append(member)
            if len(batch) >= 1000:
                found += await self._schedule(batch)
                batch = []
        return found + await self._schedule(batch)

    async def take_due(self) -> int:
        """Take the steps of every prompt due now; returns how many prompts were looked at."""
        redis, due = self.broker.redis, self.broker.indexes.due
        now = await server_ms(redis)
        looked = 0
        while True:
            members = [m for m, _ in await due.page(redis, "-inf", now, 0, PAGE)]
            # A page at once: a wave of prompts due together (a thread batch, a restart's catch
            # up) is not served one round trip after another.
            await asyncio.gather(*(self._step(m) for m in members))
            looked += len(members)
            if len(members) < PAGE:
                return looked

    async def _step(self, member: str) -> None:
        redis = self.broker.redis
        thread_id, prompt_id = Keys.split_member(member)
        due = self.broker.indexes.due.key(thread_id)
        try:
            step = await self.broker.step_timing(thread_id, prompt_id)
        except BrokerError as e:
            logger.warning("timing.step_failed", extra={"prompt_id": prompt_id, "error": repr(e)})
            await redis.zadd(due, {member: await server_ms(redis) + 1000})  # look again soon
            return
        if step.outcome in ("gone", "none"):
            await redis.zrem(due, member)
            return
        if step.outcome == "expire":
            await self._expire(thread_id, prompt_id, step.age_ms)
            return
        if step.outcome == "fired":
            await self._announce(thread_id, prompt_id, step)
        if step.next_ms is None:
            await redis.zrem(due, member)
        else:
            await redis.zadd(due, {member: step.next_ms})

    async def _announce(self, thread_id: str, prompt_id: str, step: Step) -> None:
        redis, keys = self.broker.redis, self._keys
        age_s = round(step.age_ms / 1000, 3)
        if step.reminder:
            await events.append_event(
                redis,
                keys,
                events.REMINDER,
                thread_id,
                prompt_id,
                reminder=step.reminder,
                of=step.reminders,
                age_s=age_s,
            )
            logger.info(
                "prompt.reminder",
                extra={"thread_id": thread_id, "prompt_id": prompt_id, "reminder": step.reminder},
            )
        if step.escalated_to:
            await events.append_event(
                redis,
                keys,
                events.ESCALATED,
                thread_id,
                prompt_id,
                to=step.escalated_to,
                age_s=age_s,
            )
            logger.info(
                "prompt.escalated",
                extra={"thread_id": thread_id, "prompt_id": prompt_id, "to": step.escalated_to},
            )

    async def _expire(self, thread_id: str, prompt_id: str, age_ms: int) -> None:
        member, due = Keys.member(thread_id, prompt_id), self.broker.indexes.due.key(thread_id)
        try:
            done = await self.broker.cancel(thread_id, EXPIRED, prompt_id=prompt_id)
        except BrokerError as e:
            logger.warning("timing.expire_failed", extra={"prompt_id": prompt_id, "error": repr(e)})
            # Looked at again in a second (not at once: this look's page would take it again).
            await self.broker.redis.zadd(due, {member: await server_ms(self.broker.redis) + 1000})
            return
        await self.broker.redis.zrem(due, member)
        if done is not None:
            logger.info(
                "prompt.expired",
                extra={"thread_id": thread_id, "prompt_id": prompt_id, "age_ms": age_ms},
            )

    async def once(self) -> None:
        """One round: new prompts, a rescan when it is time, the steps due."""
        await self.follow()
        if time.monotonic() - self._scanned >= self.rescan:
            await self.scan()
        await self.take_due()

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except (RedisError, OSError, BrokerError) as e:
                logger.warning("timing.look_failed", extra={"error": repr(e)})
                await asyncio.sleep(0.5)
            except Exception as e:  # a bug must not stop every deadline of the fleet: say it
                logger.error("timing.look_crashed", extra={"error": repr(e)}, exc_info=e)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.interval)


@contextlib.asynccontextmanager
async def keeping_time(settings: Settings, interval: float = 0.25) -> AsyncIterator[Timekeeper]:
    """Run a timekeeper on its own Broker for the duration of the block."""
    async with Broker.from_url(settings=settings) as broker:
        keeper = Timekeeper(broker, interval)
        async with in_background(keeper.run(), "timekeeper"):
            yield keeper
