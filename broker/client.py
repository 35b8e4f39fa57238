"""The `Broker`: ask a person, wait for the answer, route what people post, cancel, inspect.

This module holds its lifecycle (connections, closing) and the transitions that open and close a
prompt (`ask`, `cancel`) and a harness's own data on the thread. The rest the `Broker` inherits
from its parts: the reads (broker/reads.py), waiting and delivery with the audit that follows
(broker/delivery.py), routing what people post (broker/routing.py), deadlines, reminders and
escalation (broker/timing.py), on the state they share (broker/_base.py); the input checks are
broker/checks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, cast

import orjson
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError

from broker import _codec, events
from broker._base import _new_id, _reaching, now_ms
from broker._batch import Coalescer
from broker._cluster import OutageCluster, cluster_client, connection_options
from broker._scripts import Scripts
from broker._sharded import ShardedBells
from broker._waiter import Waiter, nothing_received
from broker.answers import matchers
from broker.checks import (
    LIMITS,
    _check_epoch,
    _check_json,
    _check_prompt,
    _check_size,
    _check_text,
    _dumps,
    _epoch,
)
from broker.delivery import AUDIT_JOB, Delivery
from broker.errors import BadItem, Fenced, PromptNotFound, PromptUnavailable
from broker.indexes import Indexes
from broker.keys import Keys, ThreadKeys, check_prompt_id
from broker.models import Prompt, Question
from broker.routing import Routing
from broker.sessions import Sessions
from broker.settings import Settings
from broker.timing import Timings

__all__ = ["AUDIT_JOB", "Broker"]

logger = logging.getLogger("broker")

#: Seconds an ask waits for its bell's subscription before going ahead without it.
_SUBSCRIBE_FOR_ASK = 2.0


def _ms(stream_id_or_ms: str) -> int:
    return int(stream_id_or_ms.partition("-")[0])


_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # an older hiredis, or none: redis-py packs as usual
    _hiredis_pack = None

_PLAIN = frozenset((str, bytes, int))  # by exact type: a bool or a float goes the usual way


class _HiredisPacking(AbstractConnection):
    """Packs a command with hiredis's C packer: the same bytes redis-py's own (Python) packer
    writes for str, bytes and int arguments, about 6x faster (a route.lua call: 18 -> 3 us of
    the client's CPU). Anything else (a float, a bool, a command name with a space, another
    encoding) is packed the usual way."""

    def pack_command(self, *args: Any) -> list[bytes]:
        e = self.encoder
        if (
            _hiredis_pack is not None
            and e.encoding == "utf-8"
            and e.encoding_errors == "strict"
            and _PLAIN.issuperset(map(type, args))
            and " " not in str(args[0])
        ):
            return [_hiredis_pack(args)]
        return super().pack_command(*args)

    async def can_read_destructive(self) -> bool:
        """Whether a reply or an end of stream is waiting, unasked for (the pool asks before it
        hands the connection out). redis-py finds out by reading with a zero timeout: two turns
        of the event loop and a cancellation, on every command (on the hot path that was a fifth
        of the client's time). Here what was received is looked at where it lies: the stream's
        buffer and its end, and hiredis's own buffer. Anything there, or anything unusual, goes
        redis-py's way (which reads it, and the pool reconnects)."""
        if nothing_received(self):
            return False
        return bool(await super().can_read_destructive())  # type: ignore[no-untyped-call]


_PACKING: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _fast_packing(client: Redis) -> Redis:
    """`client`, its pool's connections packing with hiredis: those it makes from now on (call
    it on a client the Broker makes for itself, or one handed over to it)."""
    pool = client.connection_pool
    cls = pool.connection_class
    if _hiredis_pack is not None and not issubclass(cls, _HiredisPacking):
        if cls not in _PACKING:
            _PACKING[cls] = type(f"Hiredis{cls.__name__}", (_HiredisPacking, cls), {})
        pool.connection_class = _PACKING[cls]
    return client


def _decoding_cluster(client: RedisCluster) -> RedisCluster:
    """A cluster client like `client` (its nodes, credentials, TLS and timeouts) that decodes."""
    extra = connection_options(client.connection_kwargs)
    nodes = [ClusterNode(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()]
    twin: RedisCluster = OutageCluster(startup_nodes=nodes, decode_responses=True, **extra)
    return twin


class Broker(Routing, Delivery, Timings):
    """The front door to prompts on Redis. Use it as an async context manager::

        async with Broker.from_url("redis://localhost:6379/0") as broker:
            prompt = await broker.ask("thread-1", "approval", [question])
            answers = await broker.wait("thread-1", prompt.prompt_id)

    One Broker holds one connection pool and at most one pub/sub connection, however many
    waits are open. `epoch` arguments fence a call to a replica's lease on the thread.
    """

    def __init__(
        self,
        redis: Redis,
        settings: Settings | None = None,
        *,
        owns_client: bool = False,
        pubsub: Redis | None = None,
    ) -> None:
        """`pubsub`: the client whose pool the waiter takes its one pub/sub connection from
        (default `redis`, where it counts against that pool's size); closed with the Broker
        when `owns_client`."""
        self._given = [c for c in (redis, pubsub) if c is not None]  # closed if owns_client
        self._derived: list[Redis] = []
        redis = self._decoding(redis)
        pubsub = None if pubsub is None else self._decoding(pubsub)
        if owns_client:
            # Handed over (a replica's bounded pools, say): their connections made from now on
            # pack with hiredis and check for stray replies cheaply too, as the Broker's own.
            for handed in (redis, pubsub):
                if handed is not None and not isinstance(handed, RedisCluster):
                    _fast_packing(handed)
        self.settings = settings or Settings()
        self.redis = redis
        cluster = isinstance(redis, RedisCluster)  # the client decides, not the setting
        self.keys = Keys(
            self.settings.key_prefix, cluster=cluster, buckets=self.settings.index_buckets
        )
        self.indexes = Indexes.of(self.keys)
        self.identity = self.settings.identity
        self._owns_client = owns_client
        self._scripts = Scripts(cluster=cluster)
        self._batch = Coalescer(redis, self._scripts)
        self._pubsub_client = pubsub
        bells = pubsub or redis
        self._sharded = ShardedBells(redis) if isinstance(redis, RedisCluster) else None
        if self._sharded is not None:
            # Typed as Redis: the waiter only calls `pubsub()`, which this provides.
            bells = cast(Redis, self._sharded)
        self._waiter = Waiter(bells, self._read_wakes, self.settings.sweep_interval)
        self.sessions = Sessions(self)
        self._closed = False
        self._deliveries: set[asyncio.Task[None]] = set()
        # arq's queues on a Redis of their own (PROMPT_BROKER_QUEUE_URL), else on `redis`: a
        # cluster's every lifecycle would put its job on the one primary of arq's slot.
        self.queue_redis: Redis | None = None
        self._queue_batch = None
        if self.settings.queue_url:
            queue = Redis.from_url(self.settings.queue_url, decode_responses=True)
            self.queue_redis = _fast_packing(queue)
            self._derived.append(self.queue_redis)
            self._queue_batch = Coalescer(self.queue_redis, self._scripts)
        # The stream trimming policy every script that adds an item applies (_retain.lua).
        self._retention = (self.settings.stream_max_items, self.settings.stream_max_age)

    def _decoding(self, client: Redis) -> Redis:
        """`client`, or one like it that decodes replies (the broker reads str everywhere).

        Most users' clients (arq's pool too) are made without `decode_responses=True`. Rather
        than refuse them, the Broker makes its own pool with the same connection settings (for
        a cluster client, a cluster client on the same nodes) and closes it with itself; the
        caller's client is left as it is.
        """
        if isinstance(client, RedisCluster):
            if client.get_encoder().decode_responses:
                return cast(Redis, client)
            decoding = cast(Redis, _decoding_cluster(client))
            self._derived.append(decoding)
            return decoding
        pool = client.connection_pool
        if pool.connection_kwargs.get("decode_responses"):
            return client
        kwargs = {**pool.connection_kwargs, "decode_responses": True}
        twin = type(pool)(
            connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
        )
        derived = _fast_packing(Redis(connection_pool=twin))
        self._derived.append(derived)
        return derived

    @classmethod
    def from_url(
        cls,
        url: str | None = None,
        settings: Settings | None = None,
        *,
        cluster: bool | None = None,
        **redis_kwargs: Any,
    ) -> Broker:
        """A Broker on its own connection pool; `url` defaults to the settings' `redis_url`.

        `redis_kwargs` go to `redis.asyncio.Redis.from_url` (timeouts, `max_connections`, ...).
        With `cluster=True` (default: the `redis_cluster` setting) `url` names one node of a
        Redis Cluster: commands go through redis-py's cluster client, each thread's scripts to
        the primary owning its slot, and the bells are sharded pub/sub (`ShardedPubSub`,
        broker/_sharded.py).
        """
        settings = settings or Settings.from_env()
        url = url or settings.redis_url
        if cluster if cluster is not None else settings.redis_cluster:
            nodes = cluster_client(url, decode_responses=True, **redis_kwargs)
            # Typed as Redis: the cluster client answers every command the Broker sends.
            return cls(cast(Redis, nodes), settings, owns_client=True)
        client = _fast_packing(Redis.from_url(url, decode_responses=True, **redis_kwargs))
        return cls(client, settings, owns_client=True)

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pub/sub connection (open waits are cancelled) and, if owned, the pool."""
        if self._closed:
            return
        try:
            await asyncio.wait_for(self.settle(), 5)
        except TimeoutError:
            logger.error("broker.deliveries_unrecorded", extra={"n": len(self._deliveries)})
            for task in list(self._deliveries):
                task.cancel()
        self._closed = True
        await self._batch.aclose()
        if self._queue_batch is not None:
            await self._queue_batch.aclose()
        await self._waiter.aclose()
        if self._sharded is not None:
            await self._sharded.aclose()
        for derived in self._derived:
            if isinstance(derived, RedisCluster):
                await derived.aclose()  # its node pools are its own
            else:
                await derived.aclose(close_connection_pool=True)
        if self._owns_client:
            for client in self._given:
                await client.aclose()

    # -- asking ----------------------------------------------------------------------------

    async def ask(
        self,
        thread_id: str,
        kind: str,
        questions: Sequence[Question | Mapping[str, Any]],
        *,
        epoch: int | None = None,
        agent_state: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """Post a `pending_prompt` item and make it the thread's active prompt.

        A prompt already active on the thread is cancelled `superseded` in the same step.
        With `epoch` (a replica's agent asking), the thread's session records, in the same step,
        that its agent waits on this prompt and `agent_state`, what the agent needs to continue
        from it if the answer comes back in a later turn.

        Raises `BadItem` for bad input (nothing written), `PromptUnavailable` when Redis cannot
        take it (the question was not delivered; nobody refused), `Fenced` for a stale epoch.
        """
        self._check_open()
        tk = self.thread(thread_id)
        checked_kind, qs = _check_prompt(kind, questions)
        _check_epoch(epoch)
        if agent_state is not None:
            if not isinstance(agent_state, Mapping):
                raise BadItem(
                    "agent_state", f"expected an object, got {type(agent_state).__name__}"
                )
            _check_json(agent_state, "agent_state")
        prompt_id, item_id = _new_id("prm"), _new_id("itm")
        body = _codec.pending_body(prompt_id, checked_kind, qs)
        _check_size(body, "questions")
        subject = qs[0].subject or ""
        wait = (
            b""
            if epoch is None
            else orjson.dumps({"prompt_id": prompt_id, "kind": checked_kind, "subject": subject})
        )
        try:
            generation = await self._subscribe_for_ask(tk)
            pipe = self.redis.pipeline(transaction=False)
            self._scripts.queue(
                pipe,
                "ask",
                [tk.items, tk.active, tk.prompt(prompt_id), tk.session],
                [
                    prompt_id,
                    item_id,
                    self.identity,
                    body,
                    checked_kind,
                    orjson.dumps(matchers(qs)),
                    _epoch(epoch),
                    tk.base,
                    tk.wake,
                    wait,
                    b""
                    if agent_state is None or epoch is None
                    else _dumps(agent_state, "agent_state"),
                    *self._retention,
                ],
            )
            member = self.keys.member(thread_id, prompt_id)
            pipe.zadd(self.indexes.open.key(thread_id), {member: now_ms()})
            # Tells live surfaces to look (a fenced ask leaves one for a prompt that never
            # existed: a reader refetches and finds nothing).
            events.queue_event(
                pipe, self.keys, events.OPENED, thread_id, prompt_id, kind=checked_kind
            )
            (status, sid_or_epoch, *rest), _, _ = await self._batch.run(pipe)
            superseded = rest[0] if rest else ""  # a fenced reply carries no third value
        except (RedisError, OSError) as e:
            return await self._ask_outcome_unknown(tk, prompt_id, e)
        if status == "fenced":
            # Shielded: a turn cancelled right now (its thread lost) must not leave the index
            # naming a prompt that never existed. `open_prompts` drops such members too.
            cleanup = asyncio.ensure_future(
                self.redis.zrem(self.indexes.open.key(thread_id), member)
            )
            cleanup.add_done_callback(_retrieved)
            with contextlib.suppress(RedisError, OSError):
                await asyncio.shield(cleanup)
            raise Fenced(thread_id, epoch or 0, int(sid_or_epoch) if sid_or_epoch else None)
        if generation is not None:
            self._waiter.expect(prompt_id, tk.wake, generation)
        if superseded:
            try:
                await self._after_cancel(thread_id, superseded, "superseded")
            except (RedisError, OSError) as e:
                # The new prompt is asked; only the old one's indexes and audit job are missing,
                # and the reconcile sweep finds a cancelled record without them.
                logger.warning(
                    "prompt.supersede_unindexed",
                    extra={"thread_id": thread_id, "prompt_id": superseded, "error": repr(e)},
                )
        logger.info(
            "prompt.asked",
            extra={
                "thread_id": thread_id,
                "prompt_id": prompt_id,
                "kind": checked_kind,
                "superseded": superseded or None,
            },
        )
        return Prompt(
            prompt_id=prompt_id,
            thread_id=thread_id,
            kind=checked_kind,
            questions=qs,
            state="pending",
            item_id=item_id,
            created_at=_codec.sid_datetime(sid_or_epoch),
        )

    async def _subscribe_for_ask(self, tk: ThreadKeys) -> int | None:
        """Subscribe to the thread's bell before asking, so the wait that follows needs no read.

        Only an optimisation: when the confirmation is slow (the pub/sub connection is
        reconnecting) the ask goes ahead, and its wait reads the record as usual.
        """
        try:
            async with asyncio.timeout(_SUBSCRIBE_FOR_ASK):
                return await self._waiter.subscribe(tk.wake, tk.thread_id)
        except (TimeoutError, RedisError, OSError):
            return None  # the ask itself says whether Redis can be reached

    async def _ask_outcome_unknown(
        self, tk: ThreadKeys, prompt_id: str, error: BaseException
    ) -> Prompt:
        """The ask failed in flight: it may or may not have been committed. Read it back once."""
        try:
            return await self.get_prompt(tk.thread_id, prompt_id)
        except PromptNotFound:
            pass
        except (RedisError, OSError):
            pass
        logger.warning(
            "prompt.unavailable", extra={"thread_id": tk.thread_id, "error": repr(error)}
        )
        raise PromptUnavailable(tk.thread_id, error) from error

    # -- cancelling --------------------------------------------------------------------------

    @_reaching("cancelling the prompt", None)
    async def cancel(
        self,
        thread_id: str,
        reason: str = "",
        *,
        prompt_id: str | None = None,
        epoch: int | None = None,
    ) -> Prompt | None:
        """Cancel the thread's active prompt (or `prompt_id`, if pending) with `reason`.

        Returns the cancelled prompt, or None when nothing pending matched (a no-op). A waiter
        on it raises `PromptCancelled`; its audit item is enqueued.
        """
        self._check_open()
        tk = self.thread(thread_id)
        if prompt_id is not None:
            check_prompt_id(prompt_id)
        if not isinstance(reason, str):
            raise BadItem("reason", f"expected a string, got {type(reason).__name__}")
        if len(reason) > LIMITS["reason_chars"]:
            raise BadItem("reason", f"over the limit of {LIMITS['reason_chars']} characters")
        _check_text(reason, "reason")
        _check_epoch(epoch)
        status, value = await self._scripts.call(
            self.redis,
            "cancel",
            [tk.active, tk.session],
            [reason, prompt_id or "", _epoch(epoch), tk.base, tk.wake, self.settings.closed_ttl],
        )
        if status == "fenced":
            raise Fenced(thread_id, epoch or 0, int(value) if value else None)
        if status == "none":
            return None
        try:
            await self._after_cancel(thread_id, value, reason)
        except (RedisError, OSError) as e:
            # The prompt is cancelled (its waiters heard it); only its indexes and audit job
            # are missing, and the reconcile sweep finds a cancelled record without them.
            logger.warning(
                "prompt.cancel_unindexed",
                extra={"thread_id": thread_id, "prompt_id": value, "error": repr(e)},
            )
        logger.info(
            "prompt.cancelled", extra={"thread_id": thread_id, "prompt_id": value, "reason": reason}
        )
        return await self.get_prompt(thread_id, value)

    async def _after_cancel(self, thread_id: str, prompt_id: str, reason: str = "") -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._queue_resolved(pipe, thread_id, prompt_id)
        events.queue_event(pipe, self.keys, events.CANCELLED, thread_id, prompt_id, reason=reason)
        await self._scripts.run_pipeline(self.redis, pipe)
        await self._audit_job_after(thread_id, prompt_id)

    async def append_agent_data(self, thread_id: str, name: str, elements: Sequence[bytes]) -> int:
        """Append `elements` to a harness's list `agent:<name>` on the thread (agent.lua): the
        name is registered so a closed thread's expiry reaches it (workers/runtime/agent_store.py).
        Returns the list's length."""
        self._check_open()
        tk = self.thread(thread_id)
        return int(
            await self._scripts.call(
                self.redis, "agent", [tk.agent(name), tk.agents, tk.session], [name, *elements]
            )
        )

    async def compact_agent_data(
        self, thread_id: str, name: str, *, length: int, count: int, batch: bytes, first: bytes
    ) -> bool:
        """Replace the last `count` elements of `agent:<name>` (read when it had `length`, the
        first of them `first`) by `batch`; False when the list changed meanwhile (compact.lua)."""
        self._check_open()
        key = self.thread(thread_id).agent(name)
        reply = await self._scripts.call(
            self.redis, "compact", [key], [length, count, batch, first]
        )
        return bool(reply)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A done callback that retrieves the outcome: a background step never logs as unretrieved."""
    if not task.cancelled():
        task.exception()
