"""The `Broker`: ask a person, wait for the answer, route what people post, cancel, inspect."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar, cast

import orjson
from arq.constants import job_key_prefix, result_key_prefix
from arq.jobs import serialize_job
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from ulid import ULID

from broker import _codec, events
from broker._scripts import Scripts
from broker._sharded import ShardedBells
from broker._waiter import Waiter, Wake
from broker.answers import check_structured, matchers, prepare
from broker.errors import (
    BadItem,
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    Fenced,
    PromptCancelled,
    PromptNotFound,
    PromptUnavailable,
    StaleAnswer,
    ThreadClosed,
    ThreadNotFound,
)
from broker.keys import Keys, ThreadKeys, check_prompt_id
from broker.models import KINDS, Answer, Item, Kind, Prompt, Question, Routed
from broker.sessions import Sessions
from broker.settings import Settings

__all__ = ["AUDIT_JOB", "LIMITS", "Broker"]

logger = logging.getLogger("broker")

#: The arq function that posts a prompt's `pending_prompt_resolved` item (workers/runtime/audit.py).
AUDIT_JOB = "post_resolution"

#: Documented input limits: past them a call raises `BadItem` and writes nothing.
LIMITS = {
    "item_bytes": 64 * 1024,  # an item's content and metadata, as JSON
    "questions": 20,  # questions in one prompt
    "options": 50,  # options in one question
    "author_chars": 128,
    "reason_chars": 1000,  # a cancel's reason
    "depth": 64,  # nesting of objects and lists in content, metadata and agent state
}

_RESERVED_TYPES = frozenset(
    {
        "pending_prompt",
        "pending_prompt_resolved",
        "approval_granted",
        "policy_denied",
        "policy_applied",  # its presence tells an orchestrator the policy was enforced
    }
)
_ITEM_KEYS = frozenset({"content", "metadata", "author"})
_AUDIT_EXPIRES_MS = 86_400_000
#: Seconds an ask waits for its bell's subscription before going ahead without it.
_SUBSCRIBE_FOR_ASK = 2.0
#: Seconds between tries to record a delivery made before it was recorded (about a minute).
_DELIVERY_RETRIES = (0, 0.1, 0.5, 1, 2, 5, 10, 20, 30)


#: What "Redis could not be reached" looks like from redis-py (and the OS under it).
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
#: Redis answered, but will not write: over `maxmemory`, or a replica that became read-only.
_REFUSING = (OutOfMemoryError, ReadOnlyError)
_STREAM_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")
_SURFACE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _reaching(
    what: str, took_effect: bool | None
) -> Callable[[Callable[_P, Awaitable[_R]]], Callable[_P, Coroutine[Any, Any, _R]]]:
    """Turn redis-py's "cannot reach Redis" and "Redis will not write" into `BrokerUnavailable`,
    so a public method raises only our own errors. `took_effect` is what is known of the call
    when that happens (False: nothing was written; None: unknown)."""

    def decorate(fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, Coroutine[Any, Any, _R]]:
        @functools.wraps(fn)
        async def reaching(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return await fn(*args, **kwargs)
            except BrokerError:
                raise  # BrokerUnavailable is an OSError too: ours already
            except TimeoutError:
                raise  # the builtin one is an OSError: a caller's timeout, not an outage
            except _REFUSING as e:
                # Redis refuses a write before making it, and each of our steps that can be
                # refused is one script or one MULTI: refused, it did nothing.
                raise BrokerUnavailable(what, e, False, refused=True) from e
            except _UNREACHABLE as e:
                raise BrokerUnavailable(what, e, took_effect) from e

        return reaching

    return decorate


def _new_id(prefix: str) -> str:
    return f"{prefix}_{ULID()}"


def _ms(stream_id_or_ms: str) -> int:
    return int(stream_id_or_ms.partition("-")[0])


class Broker:
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
        self.settings = settings or Settings()
        self.redis = redis
        cluster = isinstance(redis, RedisCluster)  # the client decides, not the setting
        self.keys = Keys(self.settings.key_prefix, cluster=cluster)
        self.identity = self.settings.identity
        self._owns_client = owns_client
        self._scripts = Scripts(cluster=cluster)
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
        # The stream trimming policy every script that adds an item applies (_retain.lua).
        self._retention = (self.settings.stream_max_items, self.settings.stream_max_age)

    def _decoding(self, client: Redis) -> Redis:
        """`client`, or one like it that decodes replies (the broker reads str everywhere).

        Most users' clients (arq's pool too) are made without `decode_responses=True`. Rather
        than refuse them, the Broker makes its own pool with the same connection settings and
        closes it with itself; the caller's client is left as it is.
        """
        if isinstance(client, RedisCluster):
            if not client.get_encoder().decode_responses:
                raise BadItem("redis", "a RedisCluster client needs decode_responses=True")
            return cast(Redis, client)
        pool = client.connection_pool
        if pool.connection_kwargs.get("decode_responses"):
            return client
        kwargs = {**pool.connection_kwargs, "decode_responses": True}
        twin = type(pool)(
            connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
        )
        derived = Redis(connection_pool=twin)
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
            nodes = RedisCluster.from_url(url, decode_responses=True, **redis_kwargs)
            # Typed as Redis: the cluster client answers every command the Broker sends.
            return cls(cast(Redis, nodes), settings, owns_client=True)
        client = Redis.from_url(url, decode_responses=True, **redis_kwargs)
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
        await self._waiter.aclose()
        if self._sharded is not None:
            await self._sharded.aclose()
        for derived in self._derived:
            await derived.aclose(close_connection_pool=True)
        if self._owns_client:
            for client in self._given:
                await client.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosed

    def thread(self, thread_id: str) -> ThreadKeys:
        return self.keys.thread(thread_id)

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
            pipe.zadd(self.keys.open, {self.keys.member(thread_id, prompt_id): ULID().milliseconds})
            # Tells live surfaces to look (a fenced ask leaves one for a prompt that never
            # existed: a reader refetches and finds nothing).
            events.queue_event(
                pipe, self.keys, events.OPENED, thread_id, prompt_id, kind=checked_kind
            )
            (status, sid_or_epoch, *rest), _, _ = await self._scripts.run_pipeline(self.redis, pipe)
            superseded = rest[0] if rest else ""  # a fenced reply carries no third value
        except (RedisError, OSError) as e:
            return await self._ask_outcome_unknown(tk, prompt_id, e)
        if status == "fenced":
            # Shielded: a turn cancelled right now (its thread lost) must not leave the index
            # naming a prompt that never existed. `open_prompts` drops such members too.
            cleanup = asyncio.ensure_future(
                self.redis.zrem(self.keys.open, self.keys.member(thread_id, prompt_id))
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
        answers = [Answer.model_validate(a) for a in wake["answers"]]
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
                (status, value), *_ = await self._scripts.run_pipeline(self.redis, pipe)
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
        pipe.zrem(self.keys.open, member)
        pipe.zadd(self.keys.audit, {member: ULID().milliseconds})
        self._queue_audit_job(pipe, thread_id, prompt_id)

    def _queue_audit_job(self, pipe: Any, thread_id: str, prompt_id: str) -> None:
        """arq's enqueue_job, as one script in `pipe`: one job per prompt, whoever enqueues."""
        job_id = self.keys.audit_job_id(thread_id, prompt_id)
        now = ULID().milliseconds
        job = serialize_job(AUDIT_JOB, (thread_id, prompt_id), {}, None, now)
        self._scripts.queue(
            pipe,
            "enqueue",
            [job_key_prefix + job_id, result_key_prefix + job_id, self.keys.audit_queue],
            [job_id, job, _AUDIT_EXPIRES_MS, now],
        )

    @_reaching("enqueueing the audit job", None)
    async def enqueue_audit(self, thread_id: str, prompt_id: str) -> bool:
        """Enqueue a prompt's audit job (idempotent); True if it was not already queued."""
        self._check_open()
        self.thread(thread_id)
        check_prompt_id(prompt_id)
        pipe = self.redis.pipeline(transaction=False)
        self._queue_audit_job(pipe, thread_id, prompt_id)
        (queued,) = await self._scripts.run_pipeline(self.redis, pipe)
        return bool(queued)

    async def _read_wakes(self, pairs: list[tuple[str, str]]) -> dict[str, Wake]:
        """The waiter's reader: the resolved prompts among `pairs`, as wake messages."""
        pipe = self.redis.pipeline(transaction=False)
        for thread_id, prompt_id in pairs:
            pipe.hmget(self.thread(thread_id).prompt(prompt_id), ["state", "answers", "reason"])
        wakes: dict[str, Wake] = {}
        for (_, prompt_id), (state, answers, reason) in zip(
            pairs, await pipe.execute(), strict=True
        ):
            if state == "answered":
                wakes[prompt_id] = {
                    "prompt_id": prompt_id,
                    "state": state,
                    "answers": orjson.loads(answers),
                }
            elif state == "cancelled":
                wakes[prompt_id] = {"prompt_id": prompt_id, "state": state, "reason": reason}
            elif state is None:
                wakes[prompt_id] = {"prompt_id": prompt_id, "state": "missing"}
        return wakes

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

    # -- routing what people post ------------------------------------------------------------

    @_reaching("posting the item", False)
    async def post_item(
        self,
        thread_id: str,
        item: Mapping[str, Any] | BaseModel,
        *,
        epoch: int | None = None,
        create: bool = True,
        surface: str | None = None,
        idempotency_key: str | None = None,
    ) -> Routed:
        """Add an item to the thread and route it, atomically: it answers the active prompt, or
        is queued for the next turn, or (naming a prompt that is not active) raises
        `StaleAnswer` with that prompt's real state and writes nothing.

        Items whose author is the broker's identity are only added (`outcome="posted"`). With
        `epoch`, the post is fenced to that lease: a replica that lost the thread posts nothing.
        With `create=False`, a thread that does not exist yet (no items, no session) raises
        `ThreadNotFound` instead of being started. A closed thread raises `ThreadClosed`.
        Neither writes anything; both are decided in the same atomic step as the post.
        `surface` names what the item came through (`"http"`, `"cli"`, ...): an answer records
        it, with the item's author, on the prompt (`answered_via`, `answered_by`) and the audit
        item (`metadata.surface`, `metadata.answered_by`). With `idempotency_key`, a post that
        took effect under that key on this thread (within a day) is not made again: the first
        outcome is returned, with the first item's id, whatever the item says this time.
        """
        self._check_open()
        tk = self.thread(thread_id)
        p = _check_item(item, self.identity)
        _check_surface(surface)
        idem = _idempotency(idempotency_key)
        item_id = _new_id("itm")
        keys = [tk.items, tk.active, tk.inbox, tk.session]
        args = [
            item_id,
            p.author,
            p.type,
            p.body,
            "self" if p.is_self else "user",
            p.named,
            p.structured,
            p.refusal,
            p.prepared,
            tk.base,
            tk.wake,
            _epoch(epoch),
            "1" if create else "0",
            "1" if p.malformed else "0",
            surface or "",
            idem,
            *self._retention,
        ]
        try:
            reply = await self._scripts.call(self.redis, "route", keys, args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            reply = await self._route_outcome_unknown(tk, item_id, keys, args, e)
        repeated = reply[0] == "repeat"
        if repeated:
            reply = orjson.loads(reply[1])
        status, *rest = reply
        _raise_refused(thread_id, epoch, p, status, rest)
        if status != "answered":
            return Routed(outcome=status, item_id=rest[0])
        item_id, prompt_id, answers, source, refusal = rest
        if repeated:
            return _answered(item_id, prompt_id, answers, source, refusal)
        try:
            await events.append_event(
                self.redis,
                self.keys,
                events.ANSWERED,
                thread_id,
                prompt_id,
                source=source,
                answered_by=p.author,
            )
        except (RedisError, OSError) as e:
            # Only a notice (route.lua cannot write it: another slot); pages also poll, and
            # the answer itself is committed and its bell rung.
            logger.warning(
                "prompt.event_lost",
                extra={"thread_id": thread_id, "prompt_id": prompt_id, "error": repr(e)},
            )
        logger.info(
            "prompt.answered",
            extra={"thread_id": thread_id, "prompt_id": prompt_id, "source": source},
        )
        return _answered(item_id, prompt_id, answers, source, refusal)

    async def _route_outcome_unknown(
        self, tk: ThreadKeys, item_id: str, keys: list[str], args: list[Any], error: Exception
    ) -> list[Any]:
        """The route call failed in flight. Find out whether it happened; if not, try once more.

        The item id was minted here, so the thread stream says whether it was added; if it was,
        the inbox or the answered prompt's record says how it was routed.
        """
        try:
            found = await self._find_routed(tk, item_id)
            if found is not None:
                return found
            return list(await self._scripts.call(self.redis, "route", keys, args))
        except (RedisConnectionError, RedisTimeoutError, OSError) as e2:
            raise BrokerUnavailable("posting the item", e2, None) from error

    async def _find_routed(self, tk: ThreadKeys, item_id: str) -> list[Any] | None:
        entries = await self.redis.xrevrange(tk.items, "+", "-", count=1000)
        ids = [fields.get("id") for _, fields in entries]
        if item_id not in ids:
            return None
        at = ids.index(item_id)
        if entries[at][1].get("author") == self.identity:
            return ["posted", item_id]
        for _, fields in entries[at + 1 :]:
            if fields.get("type") != "pending_prompt":
                continue
            prompt_id = orjson.loads(fields["body"])["metadata"]["prompt"]["prompt_id"]
            h: dict[str, str] = await self.redis.hgetall(tk.prompt(prompt_id))  # type: ignore[misc]
            if h.get("answer_item") == item_id:
                return ["answered", item_id, prompt_id, h["answers"], h["source"], ""]
        return ["queued", item_id]

    @_reaching("checking the thread", False)
    async def thread_exists(self, thread_id: str) -> bool:
        """True once the thread has items or an agent session (a closed thread still exists)."""
        self._check_open()
        tk = self.thread(thread_id)
        return bool(await self.redis.exists(tk.items, tk.session))

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

    # -- reading -----------------------------------------------------------------------------

    @_reaching("reading the prompt", False)
    async def get_prompt(self, thread_id: str, prompt_id: str) -> Prompt:
        """The prompt's record; `PromptNotFound` if there is none."""
        self._check_open()
        tk = self.thread(thread_id)
        keys = [tk.prompt(check_prompt_id(prompt_id)), tk.items]
        flat = await self._scripts.call(self.redis, "prompt", keys, [])
        if not flat:
            raise PromptNotFound(thread_id, prompt_id)
        return _codec.prompt_from_hash(thread_id, prompt_id, _pairs(flat))

    @_reaching("reading the active prompt", False)
    async def active_prompt(self, thread_id: str) -> Prompt | None:
        """The thread's active (pending) prompt, or None."""
        self._check_open()
        prompt_id = await self.redis.get(self.thread(thread_id).active)
        if not prompt_id:
            return None
        try:
            prompt = await self.get_prompt(thread_id, prompt_id)
        except PromptNotFound:
            return None
        return prompt if prompt.state == "pending" else None

    @_reaching("reading the thread", False)
    async def items(
        self, thread_id: str, *, after: str | None = None, count: int | None = None
    ) -> list[Item]:
        """The thread's items in order (after the item whose stream id is `after`, if given)."""
        self._check_open()
        key = self.thread(thread_id).items
        if after is not None:
            _check_stream_id(after, "after")
        count = _check_count(count, "count")
        out: list[Item] = []
        start = f"({after}" if after else "-"
        while count is None or len(out) < count:
            page = 1000 if count is None else min(1000, count - len(out))
            entries = await self.redis.xrange(key, start, "+", count=page)
            out.extend(_codec.item_from_entry(sid, fields) for sid, fields in entries)
            if len(entries) < page:
                break
            start = f"({entries[-1][0]}"
        return out

    @_reaching("reading the thread", False)
    async def entries(
        self, thread_id: str, *, after: str = "$", block_ms: int = 0
    ) -> list[tuple[str, Item]]:
        """Block until new items arrive after stream id `after` ('$': from now). For `tail`."""
        self._check_open()
        key = self.thread(thread_id).items
        if after != "$":
            _check_stream_id(after, "after")
        block_ms = _check_count(block_ms, "block_ms") or 0
        reply = await self.redis.xread({key: after}, block=block_ms, count=1000)
        return [(sid, _codec.item_from_entry(sid, f)) for _, entries in reply for sid, f in entries]

    @_reaching("taking the inbox", None)
    async def take_inbox(self, thread_id: str) -> list[Item]:
        """Drain the thread's inbox atomically, in order: the next turn's input."""
        self._check_open()
        key = self.thread(thread_id).inbox
        pipe = self.redis.pipeline(transaction=True)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        raw, _ = await pipe.execute()
        return [_codec.item_from_inbox(r) for r in raw]

    @_reaching("listing open prompts", False)
    async def open_prompts(self, limit: int | None = None) -> list[Prompt]:
        """Every pending prompt, oldest first: what is waiting on a person."""
        self._check_open()
        limit = _check_count(limit, "limit")
        members: list[str] = await self.redis.zrange(self.keys.open, 0, -1)
        pairs = [self.keys.split_member(m) for m in members]
        out: list[Prompt] = []
        for chunk in range(0, len(pairs), 500):
            part = pairs[chunk : chunk + 500]
            pipe = self.redis.pipeline(transaction=False)
            for thread_id, prompt_id in part:
                tk = self.thread(thread_id)
                self._scripts.queue(pipe, "prompt", [tk.prompt(prompt_id), tk.items], [])
            rows = await self._scripts.run_pipeline(self.redis, pipe)
            gone = []
            for (thread_id, prompt_id), flat in zip(part, rows, strict=True):
                h = _pairs(flat)
                if h.get("state") == "pending":
                    out.append(_codec.prompt_from_hash(thread_id, prompt_id, h))
                elif not h:
                    gone.append(self.keys.member(thread_id, prompt_id))
            if gone:
                # Members with no record at all (a fenced ask's leftover): an index entry nobody
                # else would ever remove. The ask pipeline adds a member only after its record.
                await self.redis.zrem(self.keys.open, *gone)
            if limit is not None and len(out) >= limit:
                return out[:limit]
        return out

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
                await self.redis.zrem(self.keys.audit, member)
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
                pipe.zrem(self.keys.audit, member)
                pipe.zrem(self.keys.open, member)
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
                await self.redis.zrem(self.keys.audit, member)
                unindexed = True
        return None  # the state kept changing under us: the reconcile job comes back


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _epoch(epoch: int | None) -> str:
    checked = _check_epoch(epoch)
    return "" if checked is None else str(checked)


def _check_size(body: bytes, field: str) -> None:
    if len(body) > LIMITS["item_bytes"]:
        raise BadItem(
            field, f"{len(body)} bytes as JSON, over the {LIMITS['item_bytes']}-byte limit"
        )


def _check_prompt(kind: object, questions: object) -> tuple[Kind, list[Question]]:
    if kind not in KINDS:
        raise BadItem("kind", f"{kind!r} is not a prompt kind (one of {', '.join(KINDS)})")
    if isinstance(questions, str | bytes) or not isinstance(questions, Sequence):
        raise BadItem("questions", "expected a list of questions")
    if not questions:
        raise BadItem("questions", "a prompt needs at least one question")
    if len(questions) > LIMITS["questions"]:
        raise BadItem(
            "questions", f"{len(questions)} questions, over the limit of {LIMITS['questions']}"
        )
    qs: list[Question] = []
    for i, q in enumerate(questions):
        try:
            qs.append(q if isinstance(q, Question) else Question.model_validate(q))
        except ValidationError as e:
            err = e.errors()[0]
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            raise BadItem(f"questions[{i}]{loc}", err["msg"]) from None
        if len(qs[-1].options) > LIMITS["options"]:
            raise BadItem(f"questions[{i}].options", f"over the limit of {LIMITS['options']}")
        _check_json(qs[-1].model_dump(exclude_none=True), f"questions[{i}]")
    if kind in ("approval", "text") and len(qs) != 1:
        raise BadItem("questions", f"a {kind} prompt has exactly one question, not {len(qs)}")
    if kind == "text" and qs[0].options:
        raise BadItem("questions[0].options", "a text prompt has no options")
    return kind, qs


class _CheckedItem:
    """An inbound item, checked and made ready for route.lua."""

    __slots__ = (
        "author",
        "body",
        "is_self",
        "malformed",
        "named",
        "prepared",
        "refusal",
        "structured",
        "type",
    )

    def __init__(self, author: str, body: bytes, type_: str, is_self: bool) -> None:
        self.author, self.body, self.type, self.is_self = author, body, type_, is_self
        self.named = ""
        self.structured: bytes | str = ""
        self.refusal = ""
        self.malformed = False  # a set of the wrong shape: refused even when it would be queued
        self.prepared: bytes | str = ""


def _check_item(item: Mapping[str, Any] | BaseModel, identity: str) -> _CheckedItem:
    data = item.model_dump() if isinstance(item, BaseModel) else item
    if not isinstance(data, Mapping):
        raise BadItem("item", f"expected an object, got {type(data).__name__}")
    unknown = sorted((k for k in data if k not in _ITEM_KEYS), key=repr)
    if unknown:
        name = unknown[0] if isinstance(unknown[0], str) else repr(unknown[0])
        raise BadItem(
            _key_path("item", _check_text(name, "item")),
            "unknown field (an item has content, metadata, author)",
        )
    author = _check_author(data.get("author", "user"))
    content = data.get("content", [])
    text, has_file = _check_content(content)
    metadata, type_ = _check_metadata(data.get("metadata"))
    _check_json(content, "content")
    _check_json(metadata, "metadata")
    is_self = author == identity
    if type_ in _RESERVED_TYPES and not is_self:
        raise BadItem("metadata.type", f"{type_!r} items are posted by the broker only")
    body = _dumps({"content": content, "metadata": metadata}, "item")
    _check_size(body, "item")
    checked = _CheckedItem(author, body, type_, is_self)
    if is_self:
        return checked
    named = metadata.get("prompt_id")
    if named is not None:
        checked.named = check_prompt_id(named, "metadata.prompt_id")
    _check_answers(checked, metadata.get("answers"), text, has_file)
    return checked


def _check_answers(checked: _CheckedItem, raw: object, text: str, has_file: bool) -> None:
    """A person's `metadata.answers`, and the text to map when there is no usable set."""
    if raw is not None and not isinstance(raw, list):
        # Checked whatever the thread's state: a queued item must not carry it unchecked.
        raise BadItem(
            "metadata.answers",
            f"expected a list of {{question, answer}} objects, got {type(raw).__name__}",
        )
    entries, refusal = check_structured(raw)
    checked.malformed = refusal is not None and raw != []
    if entries is not None:
        checked.structured = orjson.dumps(entries)
    checked.refusal = refusal or ""
    if text or has_file:
        checked.prepared = orjson.dumps(prepare(text))
    elif entries is None:
        if refusal:
            raise BadItem("metadata.answers", refusal.removeprefix("metadata.answers: "))
        raise BadItem("content", "no text, no file and no metadata.answers: nothing to post")


def _check_author(author: object) -> str:
    limit = LIMITS["author_chars"]
    if not isinstance(author, str) or not author or len(author) > limit:
        raise BadItem("author", f"expected a non-empty string of at most {limit} characters")
    return _check_text(author, "author")


def _check_metadata(metadata: object) -> tuple[Mapping[str, Any], str]:
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, Mapping):
        raise BadItem("metadata", f"expected an object, got {type(metadata).__name__}")
    type_ = metadata.get("type", "")
    if not isinstance(type_, str):
        raise BadItem("metadata.type", "expected a string")
    return metadata, type_


def _check_content(content: object) -> tuple[str, bool]:
    """The item's text (non-empty text blocks joined by newlines) and whether it has a file."""
    if not isinstance(content, list):
        raise BadItem("content", f"expected a list of blocks, got {type(content).__name__}")
    texts: list[str] = []
    has_file = False
    for i, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise BadItem(f"content[{i}]", "expected an object with a string `type`")
        if block["type"] == "text":
            if not isinstance(block.get("text"), str):
                raise BadItem(f"content[{i}].text", "expected a string")
            if block["text"]:
                texts.append(block["text"])
        elif block["type"] == "file":
            file = block.get("file")
            if (
                not isinstance(file, Mapping)
                or not isinstance(file.get("alias"), str)
                or not file["alias"]
            ):
                raise BadItem(f"content[{i}].file.alias", "expected a non-empty string")
            has_file = True
    return "\n".join(texts), has_file


def _check_text(value: str, field: str) -> str:
    """A string Redis and JSON can carry: lone surrogates (from undecodable bytes, say) cannot."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadItem(
                field, f"not valid Unicode text: a lone surrogate at character {e.start}"
            ) from None
    return value


def _key_path(field: str, key: str) -> str:
    simple = key.isascii() and key.replace("_", "a").replace("-", "a").isalnum()
    return f"{field}.{key}" if simple else f"{field}[{key!a}]"


def _check_json(value: object, field: str, depth: int = 0) -> None:
    """Everything in `value` can be stored as JSON, or BadItem names the first place it cannot
    (instead of the encoder's error, which names no field)."""
    if depth > LIMITS["depth"]:
        raise BadItem(field, f"nested more than {LIMITS['depth']} levels deep")
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise BadItem(field, f"the key {key!r} is not a string")
            path = _key_path(field, key)
            _check_text(key, path)
            _check_json(inner, path, depth + 1)
    elif isinstance(value, list | tuple):
        for i, inner in enumerate(value):
            _check_json(inner, f"{field}[{i}]", depth + 1)
    else:
        _check_scalar(value, field)


def _check_scalar(value: object, field: str) -> None:
    if isinstance(value, str):
        _check_text(value, field)
    elif value is None or isinstance(value, bool):
        return
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise BadItem(field, "an integer outside the 64-bit range JSON readers accept")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise BadItem(field, f"{value} is not a JSON number")
    else:
        try:
            orjson.dumps(value)  # what the encoder takes as it is: datetimes, UUIDs, ...
        except (TypeError, orjson.JSONEncodeError):
            raise BadItem(
                field, f"a {type(value).__name__} is not JSON (objects, lists, strings, numbers)"
            ) from None


def _check_epoch(epoch: object) -> int | None:
    if epoch is None:
        return None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise BadItem("epoch", f"expected a lease epoch (a non-negative integer), got {epoch!r}")
    return epoch


def _check_count(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise BadItem(field, f"expected a non-negative integer, got {value!r}")
    return value


def _check_stream_id(value: object, field: str) -> str:
    if not isinstance(value, str) or not _STREAM_ID.fullmatch(value):
        raise BadItem(field, f"{value!r} is not a stream id (like 1700000000000-0)")
    return value


def _dumps(value: object, field: str) -> bytes:
    """orjson, with anything it still refuses (after the checks above) as our own error."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise BadItem(field, f"cannot be stored as JSON ({e})") from None


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A done callback that retrieves the outcome: a background step never logs as unretrieved."""
    if not task.cancelled():
        task.exception()


def _check_surface(surface: object) -> None:
    if surface is not None and (not isinstance(surface, str) or not _SURFACE.fullmatch(surface)):
        raise BadItem("surface", f"{surface!r} is not a surface name (1-32 of a-z 0-9 . _ -)")


def _answered(item_id: str, prompt_id: str, answers: str, source: str, refusal: str) -> Routed:
    return Routed(
        outcome="answered",
        item_id=item_id,
        prompt_id=prompt_id,
        answers=[Answer.model_validate(a) for a in orjson.loads(answers)],
        source=source,
        refused_answers=refusal or None,
    )


def _idempotency(key: object) -> str:
    """The key as route.lua keeps it: hashed, so any string of the caller's fits a key name."""
    if key is None:
        return ""
    if not isinstance(key, str) or not key or len(key) > 255:
        raise BadItem("idempotency_key", "expected a non-empty string of at most 255 characters")
    return hashlib.sha256(_check_text(key, "idempotency_key").encode()).hexdigest()


def _raise_refused(
    thread_id: str, epoch: int | None, p: _CheckedItem, status: str, rest: list[Any]
) -> None:
    """Raise the error for a route reply that wrote nothing; return for one that did."""
    if status == "fenced":
        raise Fenced(thread_id, epoch or 0, int(rest[0]) if rest[0] else None)
    if status == "closed":
        raise ThreadClosed(thread_id)
    if status == "notfound":
        raise ThreadNotFound(thread_id)
    if status == "stale":
        state, active = rest
        raise StaleAnswer(thread_id, p.named, state, active or None)
    if status == "bad":
        why = str(rest[0])
        where, sep, problem = why.partition(": ")
        if sep and where.startswith("metadata.answers"):
            raise BadItem(where, problem)
        raise BadItem("metadata.answers" if p.structured or p.refusal else "content", why)
