"""Webhooks: prompt events POSTed to subscribers, signed, retried, delivered at least once.

Subscriptions come from `PROMPT_BROKER_API_WEBHOOKS` (a JSON list, or the path of a file)::

    [{"id": "chat", "url": "https://chat.example/hooks/pb", "secret": "...16+ chars...",
      "events": ["prompt.opened", "prompt.answered", "prompt.cancelled"]}]

Every `serve` copy reads the event log through one Redis consumer group (`webhooks`), so each
event is taken by one copy; for each subscription that wants it, an arq job is enqueued with
the job id `<prefix>:wh:<subscription>:<event id>` (enqueued twice, it runs once), and only
then is the event acknowledged. Each copy also runs an arq worker on that queue. Deliveries run
concurrently and retry on their own, so they can arrive out of order (a receiver orders by `id`).

A delivery is `POST <url>` with the event as JSON and these headers:

- `X-Prompt-Broker-Event`: the event name;
- `X-Prompt-Broker-Delivery`: `<subscription>:<event id>`, the same on every retry: a receiver
  dedupes on it (delivery is at least once);
- `X-Prompt-Broker-Timestamp`: unix seconds when this attempt was signed;
- `X-Prompt-Broker-Signature`: `v1=` + hex HMAC-SHA256 of `<timestamp>.<body>` under the
  subscription's secret. A receiver recomputes it and refuses a stale timestamp.

A 2xx answer is delivered. Anything else (or no answer in 10 s) is retried with backoff (2, 4,
8 ... 300 s) up to `TRIES` attempts; then it is kept in `<prefix>:webhooks:failed` (a hash by
delivery id), listed by `GET /v1/webhooks` and replayed by
`POST /v1/webhooks/failed/{delivery}/replay` (the admin scope).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import time
from typing import Any

import httpx
import orjson
from arq.connections import ArqRedis
from arq.utils import poll
from arq.worker import Retry, Worker, func
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from broker import events
from broker._cluster import connection_options
from broker.events import EventName
from broker.keys import Keys
from web import metrics

__all__ = ["TRIES", "Dispatcher", "Webhook", "sign"]

logger = logging.getLogger("web.webhooks")

TRIES = 8
#: Backoff between arq worker restarts after a Redis error, in seconds.
_RESTART_FIRST = 0.1
_RESTART_MAX = 1.0
_GROUP = "webhooks"
_JOB = "deliver_webhook"
_EVENT_NAMES: tuple[EventName, ...] = (
    "prompt.opened",
    "prompt.answered",
    "prompt.cancelled",
)


class Webhook(BaseModel):
    """One subscription: where to POST, which events, the secret that signs them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    url: str = Field(pattern=r"^https?://[^\s]+$", max_length=2000)
    secret: str = Field(min_length=16, max_length=256)
    events: tuple[EventName, ...] = _EVENT_NAMES


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for one attempt."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


class _Worker(Worker):
    """arq's worker loop without its start-up INFO log (which not every server answers: the
    embedded fakeredis one does not); the pool is ours, so nothing else in `main` applies."""

    async def main(self) -> None:
        self.ctx["redis"] = self.pool
        async for _ in poll(self.poll_delay_s):
            await self._poll_iteration()


def _backoff(tries: int) -> float:
    return float(min(300, 2**tries))


async def _arq_pool(redis: Redis, queue: str, *, refresh: bool = False) -> ArqRedis:
    """arq reads bytes: a pool like `redis`'s (same server and options) that does not decode."""
    if isinstance(redis, RedisCluster):
        return await _arq_on_cluster(redis, queue, refresh=refresh)
    pool = redis.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    twin = type(pool)(
        connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
    )
    return ArqRedis(connection_pool=twin)


async def _arq_on_cluster(nodes: RedisCluster, queue: str, *, refresh: bool) -> ArqRedis:
    """On a Redis Cluster arq works on the primary owning its queue's slot: every arq key of
    ours shares the queue's hash tag (broker/keys.py `audit_slot`, the slot of arq's own
    `arq:abort`), as the audit worker's do. With `refresh` (after arq's connection failed) the
    slot map is asked of the cluster again, from every node the client knows, so a replica
    promoted in a failover is found even when the node first named is the one that died."""
    await nodes.initialize()
    if not refresh:
        node = nodes.get_node_from_key(queue)
    else:  # asked of a client of its own: the shared one may be refreshing its map too
        known = [
            ClusterNode(n.host, n.port) for n in list(nodes.nodes_manager.startup_nodes.values())
        ]
        lookup = RedisCluster(startup_nodes=known, **connection_options(nodes.connection_kwargs))
        try:
            await lookup.initialize()
            node = lookup.get_node_from_key(queue)
        finally:
            await lookup.aclose()
    if node is None:  # the slot has no primary right now (a failover under way)
        raise RedisClusterException(f"no primary owns the slot of {queue!r}")
    # The node's credentials, timeouts and TLS; arq reads bytes (no decode_responses).
    options = connection_options(node.connection_kwargs, node.connection_class)
    return ArqRedis(host=node.host, port=node.port, **options)


class Dispatcher:
    """Feeds events to arq jobs and runs the worker that delivers them (one per `serve`)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        hooks: tuple[Webhook, ...],
        *,
        retry_delay: float | None = None,
        tries: int = TRIES,
        claim_idle_ms: int = 60_000,
        claim_every: float = 30.0,
        queue_redis: Redis | None = None,
    ) -> None:
        """`queue_redis`: the Redis of arq's queues when they have one of their own (the
        Broker's `queue_redis`, PROMPT_BROKER_QUEUE_URL); else they are on `redis`."""
        self.redis = redis
        self.queue_redis = queue_redis
        self.keys = keys
        self.hooks = {h.id: h for h in hooks}
        self.queue = f"{keys.audit_slot}{keys.prefix}:webhooks:queue"  # tagged on a cluster
        self.failed_key = f"{keys.prefix}:webhooks:failed"
        self.consumer = f"{socket.gethostname()}-{os.getpid()}"
        self.tries = tries
        self._claim_idle_ms = claim_idle_ms  # an entry unacknowledged this long was abandoned
        self._claim_every = claim_every
        self._retry_delay = retry_delay  # tests shorten the backoff
        self._arq: ArqRedis | None = None  # made on first use (`_pool`)
        self._http = httpx.AsyncClient(timeout=10)
        self._tasks: list[asyncio.Task[Any]] = []
        self._worker: Worker | None = None

    async def start(self) -> None:
        with contextlib.suppress(ResponseError):  # BUSYGROUP: another copy made it
            await self.redis.xgroup_create(
                events.event_key(self.keys), _GROUP, id="$", mkstream=True
            )
        self._tasks = [asyncio.create_task(self._feed()), asyncio.create_task(self._work())]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._worker is not None:
            await self._close_worker(self._worker)
        await self._http.aclose()
        if self._arq is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._arq.aclose(close_connection_pool=True)

    async def _pool(self, *, refresh: bool = False) -> ArqRedis:
        """arq's connection: to the queue's own Redis or the server, or on a cluster to the
        primary owning the queue's slot; with `refresh` made again (that primary is looked up
        anew)."""
        if self._arq is not None and not refresh:
            return self._arq
        where = self.queue_redis or self.redis
        old, self._arq = self._arq, await _arq_pool(where, self.queue, refresh=refresh)
        if old is not None:
            with contextlib.suppress(RedisError, OSError):
                await old.aclose(close_connection_pool=True)
        return self._arq

    async def _work(self) -> None:
        """Run arq's worker on the queue. A Redis error stops arq's loop (a restart of Redis, or
        on a cluster a failover of the queue's primary): then arq's connection is made again,
        to the primary owning the queue now, and another worker started, backing off to 1 s."""
        delay, refresh = _RESTART_FIRST, False
        while True:
            started = time.monotonic()
            try:
                pool = await self._pool(refresh=refresh)
                self._worker = self._new_worker(pool)
                await self._worker.main()
            except (RedisError, RedisClusterException, OSError) as e:
                logger.warning("webhooks.worker_restarting", extra={"error": repr(e)})
            except Exception as e:  # a bug must not stop every delivery of this copy: say it
                logger.error("webhooks.worker_crashed", extra={"error": repr(e)}, exc_info=e)
            if self._worker is not None:
                await self._close_worker(self._worker)
                self._worker = None
            if time.monotonic() - started > 30:  # it had been working: start again at once
                delay = _RESTART_FIRST
            await asyncio.sleep(delay)
            delay, refresh = min(delay * 2, _RESTART_MAX), True

    def _new_worker(self, pool: ArqRedis) -> Worker:
        return _Worker(
            [func(self._deliver, name=_JOB, max_tries=self.tries)],
            redis_pool=pool,
            queue_name=self.queue,
            handle_signals=False,
            poll_delay=0.1,
            keep_result=0,
            max_jobs=20,
            job_timeout=30,
            log_results=False,
        )

    async def _close_worker(self, worker: Worker, drain: float = 5.0) -> None:
        """Let deliveries in flight finish (a short drain), then stop arq's worker. A job arq
        cancels while it records its end raises CancelledError out of `close`: that is the job's,
        not ours, and the delivery it was finishing is retried (at least once), so it is dropped
        here unless this task itself is being cancelled."""
        running = [t for t in worker.tasks.values() if not t.done()]
        if running:
            await asyncio.wait(running, timeout=drain)
        try:
            await worker.close()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
        except Exception as e:  # closing must not fail a shutdown; say what happened
            logger.warning("webhooks.close_failed", extra={"error": repr(e)})

    # -- feeding -----------------------------------------------------------------------------

    async def _feed(self) -> None:
        """Take events for this copy from the group, and now and then those another copy took
        but never acknowledged (it died between reading and enqueueing): at least once.

        An event this copy read but could not enqueue (Redis failed in between) stays pending
        on this consumer: at the start and after every failure, this copy's own pending
        entries are taken again first, so such an event goes out as soon as Redis answers,
        not after the claim of abandoned entries (`claim_idle_ms`)."""
        key = events.event_key(self.keys)
        claimed_at = 0.0
        own = True  # this consumer's pending entries first
        while True:
            try:
                if time.monotonic() - claimed_at >= self._claim_every:
                    claimed_at = time.monotonic()
                    reply = await self.redis.xautoclaim(
                        key, _GROUP, self.consumer, self._claim_idle_ms, "0-0", count=100
                    )
                    await self._take(reply[1])
                if own:
                    reply = await self.redis.xreadgroup(_GROUP, self.consumer, {key: "0"}, 100)
                    batch = [e for _, entries in reply or [] for e in entries]
                    await self._take(batch)
                    own = len(batch) >= 100  # more of them: another page
                    continue
                reply = await self.redis.xreadgroup(_GROUP, self.consumer, {key: ">"}, 100, 2000)
                await self._take([e for _, batch in reply or [] for e in batch])
            except (RedisError, OSError) as e:
                logger.warning("webhooks.feed_failed", extra={"error": repr(e)})
                own = True
                await asyncio.sleep(1)

    async def _take(self, entries: list[Any]) -> None:
        """Enqueue each entry's deliveries, then acknowledge it (never before)."""
        for entry_id, fields in entries:
            if fields:  # a pending entry trimmed from the log comes back empty
                await self._enqueue(events.Event(entry_id, *_parts(fields)))
            await self.redis.xack(events.event_key(self.keys), _GROUP, entry_id)

    async def _enqueue(self, event: events.Event, *, suffix: str = "") -> None:
        payload = {
            "id": event.id,
            "event": event.name,
            "thread_id": event.thread_id,
            "prompt_id": event.prompt_id,
            "at_ms": event.at_ms,
            **event.data,
        }
        for hook in self.hooks.values():
            if event.name in hook.events:
                job_id = f"{self.keys.audit_slot}{self.keys.prefix}:wh:{hook.id}:{event.id}{suffix}"
                await (await self._pool()).enqueue_job(
                    _JOB, hook.id, payload, _job_id=job_id, _queue_name=self.queue
                )

    # -- delivering --------------------------------------------------------------------------

    async def _deliver(self, ctx: dict[str, Any], hook_id: str, payload: dict[str, Any]) -> str:
        hook = self.hooks.get(hook_id)
        delivery = f"{hook_id}:{payload['id']}"
        if hook is None:
            metrics.WEBHOOK_DELIVERIES.labels(hook_id, "unsubscribed").inc()
            return "unsubscribed"
        body = orjson.dumps(payload)
        now = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "X-Prompt-Broker-Event": str(payload["event"]),
            "X-Prompt-Broker-Delivery": delivery,
            "X-Prompt-Broker-Timestamp": str(now),
            "X-Prompt-Broker-Signature": sign(hook.secret, now, body),
        }
        try:
            r = await self._http.post(hook.url, content=body, headers=headers)
            problem = "" if 200 <= r.status_code < 300 else f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            problem = f"{type(e).__name__}: {e}"
        if not problem:
            metrics.WEBHOOK_DELIVERIES.labels(hook_id, "delivered").inc()
            return "delivered"
        tries = int(ctx.get("job_try", 1))
        if tries < self.tries:
            metrics.WEBHOOK_DELIVERIES.labels(hook_id, "retried").inc()
            delay = self._retry_delay if self._retry_delay is not None else _backoff(tries)
            raise Retry(defer=delay)
        record = {"hook": hook_id, "payload": payload, "error": problem, "tries": tries}
        await self.redis.hset(self.failed_key, delivery, orjson.dumps(record).decode())  # type: ignore[misc]
        metrics.WEBHOOK_DELIVERIES.labels(hook_id, "failed").inc()
        logger.warning("webhooks.failed", extra={"delivery": delivery, "error": problem})
        return "failed"

    # -- failures ----------------------------------------------------------------------------

    async def failures(self) -> list[dict[str, Any]]:
        raw: dict[str, str] = await self.redis.hgetall(self.failed_key)  # type: ignore[misc]
        return [{"delivery": k, **orjson.loads(v)} for k, v in sorted(raw.items())]

    async def replay(self, delivery: str) -> bool:
        """Deliver a kept failure again (a fresh job, its delivery id unchanged)."""
        raw = await self.redis.hget(self.failed_key, delivery)  # type: ignore[misc]
        if raw is None:
            return False
        record = orjson.loads(raw)
        payload = record["payload"]
        job_id = (
            f"{self.keys.audit_slot}{self.keys.prefix}:wh:{record['hook']}:{payload['id']}"
            f":replay:{time.time_ns()}"
        )
        await (await self._pool()).enqueue_job(
            _JOB, record["hook"], payload, _job_id=job_id, _queue_name=self.queue
        )
        await self.redis.hdel(self.failed_key, delivery)  # type: ignore[misc]
        return True


def _parts(fields: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]]:
    data = orjson.loads(fields.get("data") or "{}")
    return (
        fields["event"],
        fields["thread"],
        fields["prompt"],
        data if isinstance(data, dict) else {},
    )
