"""Waiting for the answer and handing it over (`Delivery`, which `Broker` inherits): `wait`,
the delivery record that follows it (`deliver`, `settle`), the audit job and the resolution
item posted once per prompt (`enqueue_audit`, `post_resolution`), and listening to a thread's
bells (`listen`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from arq.constants import job_key_prefix, result_key_prefix
from arq.jobs import serialize_job
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import _codec
from broker._base import _UNREACHABLE, _new_id, _reaching, now_ms
from broker._waiter import Wake
from broker.checks import _check_epoch, _epoch
from broker.errors import (
    BadItem,
    BrokerError,
    BrokerUnavailable,
    Fenced,
    PromptCancelled,
    PromptNotFound,
)
from broker.keys import ThreadKeys, check_prompt_id
from broker.models import ANSWERS, Answer
from broker.reads import Reads

__all__ = ["AUDIT_JOB", "Delivery"]

logger = logging.getLogger("broker")

#: The arq function that posts a prompt's `pending_prompt_resolved` item (workers/runtime/audit.py).
AUDIT_JOB = "post_resolution"

_AUDIT_EXPIRES_MS = 86_400_000

#: Seconds between tries to record a delivery made before it was recorded (about a minute).
_DELIVERY_RETRIES = (0, 0.1, 0.5, 1, 2, 5, 10, 20, 30)


class Delivery(Reads):
    """Waiting for an answer and recording its delivery, the audit that follows, and
    listening to a thread's bells."""

    # -- waiting ---------------------------------------------------------------------------

    @_reaching("waiting for the answer", None)
    async def wait(
        self,
        thread_id: str,
        prompt_id: str,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented contract
        *,
        epoch: int | None = None,
        deliver: bool = True,
    ) -> list[Answer]:
        """Wait for the person's answer and return it; the agent now has it.

        Then the delivery is recorded (the audit item waits for that record, so an answer no
        caller received is never audited). Unfenced: the answers are handed
        over first and the record follows in the background, a round trip later; `settle()`
        waits for it, and `aclose()` does too. Fenced (`epoch`): recorded first, so a replica
        that lost the thread never hands over an answer. With `deliver=False` nothing is
        recorded: the caller hands the answers over, then calls `deliver`.

        Raises `PromptCancelled` (with the reason) if the prompt was cancelled or superseded,
        `TimeoutError` after `timeout` seconds (the prompt stays open), `PromptNotFound`, and
        `Fenced` if `epoch` is no longer the thread's (another replica delivers instead).
        """
        self._check_open()
        tk = self.thread(thread_id)
        check_prompt_id(prompt_id)
        _check_epoch(epoch)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout)
        ):
            raise BadItem("timeout", f"expected seconds (a number) or None, got {timeout!r}")
        try:
            async with asyncio.timeout(timeout):
                wake = await self._waiter.wait(thread_id, prompt_id, tk.wake)
        except TimeoutError:
            raise  # the builtin one is an OSError: the caller's timeout, not an outage
        except _UNREACHABLE as e:
            # Only the start of a wait can fail so: once subscribed, the waiter rides out
            # outages on its own and the wait goes on.
            raise BrokerUnavailable("waiting for the answer", e, False) from e
        if wake["state"] == "missing":
            raise PromptNotFound(thread_id, prompt_id)
        if wake["state"] == "cancelled":
            raise PromptCancelled(prompt_id, wake.get("reason") or "")
        answers = ANSWERS.validate_python(wake["answers"])
        if deliver and epoch is None:
            task = asyncio.create_task(self._deliver_later(tk, prompt_id))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)
        elif deliver:
            await self._deliver(tk, prompt_id, epoch)
        return answers

    async def settle(self) -> None:
        """Wait until every delivery `wait` handed over has been recorded."""
        while self._deliveries:
            await asyncio.gather(*self._deliveries, return_exceptions=True)

    async def _deliver_later(self, tk: ThreadKeys, prompt_id: str) -> None:
        """Record a delivery after the fact, riding out a short Redis outage."""
        for delay in _DELIVERY_RETRIES:
            await asyncio.sleep(delay)
            try:
                await self._deliver(tk, prompt_id, None)
                return
            except (BrokerError, RedisError, OSError) as e:
                # Never left to escape the task (nobody awaits it but `settle`): logged below.
                error: BaseException = e
        logger.error(
            "prompt.delivery_unrecorded",
            extra={"thread_id": tk.thread_id, "prompt_id": prompt_id, "error": repr(error)},
        )

    @_reaching("recording the delivery", None)
    async def deliver(self, thread_id: str, prompt_id: str, *, epoch: int | None = None) -> None:
        """Record that answers a `wait(..., deliver=False)` returned were handed over, and
        enqueue their audit item."""
        self._check_open()
        await self._deliver(self.thread(thread_id), check_prompt_id(prompt_id), epoch)

    async def _deliver(self, tk: ThreadKeys, prompt_id: str, epoch: int | None) -> None:
        """Mark the answer delivered and enqueue its audit job, in one round trip.

        Every step is idempotent (a second mark keeps the first time; the audit job is one per
        prompt), so after a dropped connection one more try is safe.
        """
        for attempt in (1, 2):
            pipe = self.redis.pipeline(transaction=False)
            self._scripts.queue(
                pipe, "deliver", [tk.prompt(prompt_id), tk.session], [_epoch(epoch), prompt_id]
            )
            self._queue_resolved(pipe, tk.thread_id, prompt_id)
            try:
                (status, value), *_ = await self._batch.run(pipe)
                break
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                if attempt == 2:
                    raise BrokerUnavailable(
                        "recording the delivery (the answer was not handed over: wait again)",
                        e,
                        None,
                    ) from e
        if status == "fenced":
            raise Fenced(tk.thread_id, epoch or 0, int(value) if value else None)
        await self._audit_job_after(tk.thread_id, prompt_id)
        logger.info(
            "prompt.delivered",
            extra={
                "thread_id": tk.thread_id,
                "prompt_id": prompt_id,
                "first": status == "delivered",
            },
        )

    def _queue_resolved(self, pipe: Any, thread_id: str, prompt_id: str) -> None:
        """Index a resolution: no longer open, its audit item unposted and its job enqueued."""
        member = self.keys.member(thread_id, prompt_id)
        pipe.zrem(self.indexes.open.key(thread_id), member)
        pipe.zadd(self.indexes.audit.key(thread_id), {member: now_ms()})
        self._queue_audit_job(pipe, thread_id, prompt_id)

    def _queue_audit_job(self, pipe: Any, thread_id: str, prompt_id: str) -> None:
        """arq's enqueue_job, as one script in `pipe`: one job per prompt, whoever enqueues.

        With arq's queue on a Redis of its own (`queue_redis`) nothing goes in `pipe`: the
        caller runs `_audit_job_after` once its pipeline has run."""
        if self.queue_redis is None:
            self._scripts.queue(pipe, "enqueue", *self._audit_job(thread_id, prompt_id))

    def _audit_job(self, thread_id: str, prompt_id: str) -> tuple[list[str], list[Any]]:
        """The keys and arguments of enqueue.lua for a prompt's audit job."""
        job_id = self.keys.audit_job_id(thread_id, prompt_id)
        now = now_ms()
        job = serialize_job(AUDIT_JOB, (thread_id, prompt_id), {}, None, now)
        keys = [job_key_prefix + job_id, result_key_prefix + job_id, self.keys.audit_queue]
        return keys, [job_id, job, _AUDIT_EXPIRES_MS, now]

    async def _audit_job_after(self, thread_id: str, prompt_id: str) -> None:
        """With arq's queue on a Redis of its own, enqueue the audit job of a step that has
        run (after it, so the job never finds the step undone). If that Redis cannot be
        reached the step stands: the resolution is in the audit index, and the reconcile
        sweep enqueues its job (workers/runtime/audit.py)."""
        if self._queue_batch is None:
            return
        try:
            # Coalesced: the jobs of one turn share the round trip to the queue's server.
            await self._queue_batch.call("enqueue", *self._audit_job(thread_id, prompt_id))
        except (RedisError, OSError) as e:
            logger.warning(
                "prompt.audit_unqueued",
                extra={"thread_id": thread_id, "prompt_id": prompt_id, "error": repr(e)},
            )

    @_reaching("enqueueing the audit job", None)
    async def enqueue_audit(self, thread_id: str, prompt_id: str) -> bool:
        """Enqueue a prompt's audit job (idempotent); True if it was not already queued."""
        self._check_open()
        self.thread(thread_id)
        check_prompt_id(prompt_id)
        queue = self.queue_redis or self.redis
        queued = await self._scripts.call(queue, "enqueue", *self._audit_job(thread_id, prompt_id))
        return bool(queued)

    async def listen(self, thread_id: str, listener: Callable[[str, Wake], None]) -> None:
        """Call `listener(channel, message)` for every bell on the thread (resolutions, queued
        items, and `{"resubscribed": true}` after a dropped pub/sub connection came back: a
        listener that hears that may have missed bells, so it re-reads)."""
        await self.listen_many({thread_id: listener})

    @_reaching("subscribing to the threads", False)
    async def listen_many(self, listeners: Mapping[str, Callable[[str, Wake], None]]) -> None:
        """`listen` on many threads at once (`thread_id -> listener`), in one SUBSCRIBE."""
        self._check_open()
        await self._waiter.listen_many(
            [(t, self.thread(t).wake, listener) for t, listener in listeners.items()]
        )

    def unlisten(self, thread_id: str, listener: Callable[[str, Wake], None]) -> None:
        self._waiter.unlisten(self.thread(thread_id).wake, listener)

    # -- audit ---------------------------------------------------------------------------------

    @_reaching("posting the resolution", None)
    async def post_resolution(self, thread_id: str, prompt_id: str) -> str | None:
        """Post the prompt's `pending_prompt_resolved` item, exactly once.

        Returns its item id (new or already posted), or None when there is nothing to post yet
        (still pending, or answered but never delivered: that is never posted).
        """
        self._check_open()
        tk = self.thread(thread_id)
        member = self.keys.member(thread_id, prompt_id)
        unindexed = False
        for _ in range(4):
            try:
                prompt = await self.get_prompt(thread_id, prompt_id)
            except PromptNotFound:
                await self.redis.zrem(self.indexes.audit.key(thread_id), member)
                return None
            if prompt.audit_item_id:
                status, value = "already", prompt.audit_item_id
            elif prompt.state == "pending" or (
                prompt.state == "answered" and prompt.delivered_at is None
            ):
                status, value = (
                    "refused",
                    prompt.state if prompt.state == "pending" else "undelivered",
                )
            else:
                status, value = await self._scripts.call(
                    self.redis,
                    "audit",
                    [tk.prompt(prompt_id), tk.items],
                    [
                        _new_id("itm"),
                        self.identity,
                        _codec.resolved_body(prompt),
                        prompt.state,
                        self.settings.resolved_ttl,
                        tk.base,
                        *self._retention,
                    ],
                )
            if status in ("posted", "already"):
                pipe = self.redis.pipeline(transaction=False)
                pipe.zrem(self.indexes.audit.key(thread_id), member)
                pipe.zrem(self.indexes.open.key(thread_id), member)
                await pipe.execute()
                if status == "posted":
                    logger.info(
                        "prompt.audited",
                        extra={"thread_id": thread_id, "prompt_id": prompt_id, "item_id": value},
                    )
                return str(value)
            if value == "missing":
                return None
            if value in ("pending", "undelivered"):
                if unindexed:
                    return None
                # Nothing to post yet: drop it from the index, then look once more, so that a
                # delivery landing in between (its own enqueue refused while we run) is not lost.
                await self.redis.zrem(self.indexes.audit.key(thread_id), member)
                unindexed = True
        return None  # the state kept changing under us: the reconcile job comes back
