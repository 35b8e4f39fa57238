"""Agent sessions: which replica drives a thread, under which lease and fencing epoch.

The session record `pp:{T}:session` decides; `pp:leases` (thread -> lease deadline, server ms)
is the discovery index the adoption sweep reads, written beside the record's script and
rebuildable from the records. Every claim bumps the epoch, and every script a replica runs for
the thread carries its epoch, so a replica that lost the thread (paused, partitioned, too slow)
can no longer ask, deliver or post anything on it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import orjson
from pydantic import BaseModel, ConfigDict
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from ulid import ULID

from broker._codec import body, ms_datetime
from broker.errors import BadItem, BrokerUnavailable, Fenced, ThreadNotFound
from broker.keys import check_thread_id

if TYPE_CHECKING:
    from broker.client import Broker

__all__ = [
    "Grant",
    "Handover",
    "Permissions",
    "Session",
    "Sessions",
    "Status",
    "Waiting",
    "delivery_token",
]

Permissions = Literal["approval", "autonomous", "guarded"]
Status = Literal["idle", "running", "parked", "closed"]
PERMISSIONS: tuple[Permissions, ...] = ("approval", "autonomous", "guarded")
#: The largest policy block a session takes, as JSON.
POLICY_BYTES = 64 * 1024


class Waiting(BaseModel):
    """The prompt the session's agent is waiting on (held in a live turn, or parked)."""

    model_config = ConfigDict(frozen=True)
    prompt_id: str
    kind: str
    subject: str = ""


class Grant(BaseModel):
    """A one-shot approval: the next call to `subject` covered by `grant_key` is approved."""

    model_config = ConfigDict(frozen=True)
    subject: str
    grant_key: str | None = None
    granted_by: str


class Session(BaseModel):
    """A thread's agent session, as recorded in Redis."""

    model_config = ConfigDict(frozen=True)
    thread_id: str
    harness: str
    permissions: Permissions
    config: dict[str, Any]
    work_folder: str
    owner: str
    epoch: int
    lease_until: datetime | None
    status: Status
    created_at: datetime
    state: dict[str, Any] | None = None  # the harness's own, between turns
    waiting: Waiting | None = None
    grant: Grant | None = None
    grant_raw: str | None = None  # the grant exactly as stored: spending compares it
    error: str | None = None
    policy: dict[str, Any] | None = None  # guarded only: as given (`workers.policy` checks it)
    delivered: str | None = None  # the prompt whose answer the running turn was handed, if any
    interrupted: dict[str, Any] | None = None  # the last turn was cut off: for the next to tell


class Candidates(NamedTuple):
    """What an adoption sweep sees: server time, expired threads, all threads, live replicas."""

    now: int
    expired: dict[str, int]  # thread -> lease deadline (ms, server time; its creation if new)
    threads: int
    replicas: int


def _session(thread_id: str, h: Mapping[str, str]) -> Session:
    until = int(h.get("lease_until") or 0)
    return Session(
        thread_id=thread_id,
        harness=h["harness"],
        permissions=h["permissions"],
        config=orjson.loads(h["config"]),
        work_folder=h.get("work_folder", ""),
        owner=h.get("owner", ""),
        epoch=int(h.get("epoch") or 0),
        lease_until=ms_datetime(until) if until else None,
        status=h["status"],
        created_at=ms_datetime(h["created"]),
        state=orjson.loads(h["hstate"]) if h.get("hstate") else None,
        waiting=Waiting.model_validate_json(h["wait"]) if h.get("wait") else None,
        grant=Grant.model_validate_json(h["grant"]) if h.get("grant") else None,
        grant_raw=h.get("grant"),
        error=h.get("error"),
        policy=orjson.loads(h["policy"]) if h.get("policy") else None,
        delivered=h.get("delivered") or None,
        interrupted=orjson.loads(h["interrupted"]) if h.get("interrupted") else None,
    )


def _policy(permissions: str, policy: Mapping[str, Any] | None) -> bytes:
    """The policy block as stored (b"" for none), refused where it cannot belong."""
    if permissions != "guarded":
        if policy is not None:
            raise BadItem("policy", f"only guarded threads take a policy, not {permissions}")
        return b""
    if policy is None:
        raise BadItem("policy", "POLICY_MISSING: guarded permissions need a policy block")
    if not isinstance(policy, Mapping):
        raise BadItem("policy", f"expected an object, got {type(policy).__name__}")
    try:
        stored = orjson.dumps(dict(policy))
    except TypeError as e:
        raise BadItem("policy", f"not JSON: {e}") from None
    if len(stored) > POLICY_BYTES:
        raise BadItem("policy", f"{len(stored)} bytes as JSON, over the limit of {POLICY_BYTES}")
    return stored


def _fenced(thread_id: str, epoch: int, reply: list[Any]) -> Fenced:
    return Fenced(thread_id, epoch, int(reply[1]) if len(reply) > 1 and reply[1] else None)


logger = logging.getLogger("broker")

#: A delivery whose reply was lost on a dropped connection is tried once more with its token.
_ATTEMPTS = 2
_LINK_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class Handover(NamedTuple):
    """What a delivery step said: `handed` (hand the answer over now), `already` (it was
    handed over before: never again), or `unanswered` (the prompt is not answered; `state`)."""

    outcome: Literal["handed", "already", "unanswered"]
    value: str  # the delivery time (ms) when handed or already, else the prompt's state


def delivery_token() -> str:
    """A new delivery attempt's token: a retry of that attempt reuses it."""
    return f"dlv_{ULID()}"


class Sessions:
    """Session records and leases, through a Broker's connection and scripts."""

    def __init__(self, broker: Broker) -> None:
        self._b = broker

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> list[Any]:
        self._b._check_open()
        return list(await self._b._scripts.call(self._b.redis, name, keys, args))

    async def server_ms(self) -> int:
        """The Redis server's clock, in ms: leases are measured by it, never by ours."""
        seconds, micros = await self._b.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def create(
        self,
        thread_id: str,
        harness: str,
        permissions: str = "approval",
        config: Mapping[str, Any] | None = None,
        work_folder: str = "",
        *,
        policy: Mapping[str, Any] | None = None,
    ) -> Session:
        """Create a thread's session, unowned: the next adoption sweep gives it a replica.

        `guarded` permissions need a `policy` block, and only they take one. Its content is
        the runtime's to check (`workers.policy.validate`, before this), not the library's.
        """
        check_thread_id(thread_id)
        if permissions not in PERMISSIONS:
            raise BadItem("permissions", f"{permissions!r} is not one of {', '.join(PERMISSIONS)}")
        stored_policy = _policy(permissions, policy)
        if not isinstance(harness, str) or not harness:
            raise BadItem("harness", "expected a harness name")
        if config is not None and not isinstance(config, Mapping):
            raise BadItem("config", f"expected an object, got {type(config).__name__}")
        tk = self._b.thread(thread_id)
        reply = await self._call(
            "create",
            [tk.session],
            [harness, permissions, orjson.dumps(dict(config or {})), work_folder, stored_policy],
        )
        if reply[0] == "exists":
            raise BadItem("thread_id", f"thread {thread_id} already exists")
        # Indexed only once the record exists: a replica that claims from the index before the
        # record is there drops the entry ('missing'), and the thread would never be adopted.
        # (In one pipeline with the script, a server that had to load the script first would
        # run the script after the index write.)
        pipe = self._b.redis.pipeline(transaction=False)
        pipe.zadd(self._b.keys.leases, {thread_id: ULID().milliseconds}, nx=True)
        pipe.hgetall(tk.session)
        _, h = await pipe.execute()
        return _session(thread_id, h)

    async def get(self, thread_id: str) -> Session | None:
        h: dict[str, str] = await self._b.redis.hgetall(self._b.thread(thread_id).session)  # type: ignore[misc]
        return _session(thread_id, h) if h else None

    async def claim(self, thread_id: str, replica: str, ttl_ms: int) -> tuple[int, int] | None:
        """Claim the thread: `(epoch, lease deadline ms)`, or None if it is not to be had."""
        reply = await self._call("claim", [self._b.thread(thread_id).session], [replica, ttl_ms])
        if reply[0] == "claimed":
            epoch, deadline = int(reply[1]), int(reply[2])
            await self._b.redis.zadd(self._b.keys.leases, {thread_id: deadline})
            return epoch, deadline
        if reply[0] in ("missing", "closed"):
            await self._b.redis.zrem(self._b.keys.leases, thread_id)
        elif reply[0] == "held":
            await self._b.redis.zadd(self._b.keys.leases, {thread_id: int(reply[2])})
        return None

    async def claim_many(self, threads: Sequence[str], replica: str, ttl_ms: int) -> dict[str, int]:
        """Claim several threads in two round trips: `{thread: epoch}` of those claimed."""
        if not threads:
            return {}
        pipe = self._b.redis.pipeline(transaction=False)
        for t in threads:
            self._b._scripts.queue(pipe, "claim", [self._b.thread(t).session], [replica, ttl_ms])
        replies = await self._b._scripts.run_pipeline(self._b.redis, pipe)
        claimed: dict[str, int] = {}
        scores: dict[str, int] = {}
        gone: list[str] = []
        for t, reply in zip(threads, replies, strict=True):
            if reply[0] == "claimed":
                claimed[t], scores[t] = int(reply[1]), int(reply[2])
            elif reply[0] == "held":
                scores[t] = int(reply[2])
            else:
                gone.append(t)
        pipe = self._b.redis.pipeline(transaction=False)
        if scores:
            pipe.zadd(self._b.keys.leases, scores)
        if gone:
            pipe.zrem(self._b.keys.leases, *gone)
        await pipe.execute()
        return claimed

    async def renew(
        self, replica: str, held: Mapping[str, int], ttl_ms: int
    ) -> tuple[dict[str, int], list[str]]:
        """Renew every lease `replica` holds (`thread -> epoch`), in two round trips.

        Returns the new deadlines and the threads it turned out to have lost.
        """
        if not held:
            return {}, []
        threads = list(held)
        pipe = self._b.redis.pipeline(transaction=False)
        for t in threads:
            self._b._scripts.queue(
                pipe, "renew", [self._b.thread(t).session], [replica, held[t], ttl_ms]
            )
        replies = await self._b._scripts.run_pipeline(self._b.redis, pipe)
        renewed = {t: int(r[1]) for t, r in zip(threads, replies, strict=True) if r[0] == "renewed"}
        lost = [t for t, r in zip(threads, replies, strict=True) if r[0] != "renewed"]
        if renewed:
            await self._b.redis.zadd(self._b.keys.leases, renewed, xx=True)
        return renewed, lost

    async def release(self, thread_id: str, replica: str, epoch: int) -> bool:
        """Give the thread up now, so another replica adopts it without waiting for the TTL."""
        reply = await self._call("release", [self._b.thread(thread_id).session], [replica, epoch])
        if reply[0] != "released":
            return False
        await self._b.redis.zadd(self._b.keys.leases, {thread_id: 0}, xx=True)
        return True

    async def beat(self, replica: str, within_ms: int, *, leaving: bool = False) -> int:
        """Record that `replica` is alive (or leaving); returns how many replicas are alive."""
        self._b._check_open()
        alive = await self._b._scripts.call(
            self._b.redis, "beat", [self._b.keys.replicas], [replica, within_ms, int(leaving)]
        )
        return int(alive)

    async def expired(self, limit: int = 200, alive_within_ms: int = 5000) -> Candidates:
        """Threads whose lease deadline (server time) has passed, per the index: candidates for
        adoption, with what a replica needs to take its fair share of them."""
        now = await self.server_ms()
        pipe = self._b.redis.pipeline(transaction=False)
        pipe.zrangebyscore(self._b.keys.leases, "-inf", now, start=0, num=limit, withscores=True)
        pipe.zcard(self._b.keys.leases)
        pipe.zcount(self._b.keys.replicas, now - alive_within_ms, "+inf")
        found, total, alive = await pipe.execute()
        return Candidates(now, {t: int(score) for t, score in found}, int(total), int(alive))

    async def update(self, thread_id: str, epoch: int, **fields: str | None) -> None:
        """Set fields of the session as its lease holder (None or "" removes a field)."""
        args: list[Any] = [epoch]
        for name, value in fields.items():
            args += [name, value or ""]
        reply = await self._call("update", [self._b.thread(thread_id).session], args)
        if reply[0] == "fenced":
            raise _fenced(thread_id, epoch, reply)

    async def resume(
        self, thread_id: str, prompt_id: str, epoch: int, grant: Grant | None, token: str
    ) -> Handover:
        """Hand a parked prompt's answer to a resume turn (resume.lua), enqueueing its audit.

        At most once per prompt, ever: `already` when it was handed over before (the turn that
        got it was cut off; it is reported interrupted, never replayed). `token` names this
        attempt: a retry after a lost reply is the same delivery. The grant, if any, is minted in
        the same step, once per prompt.
        """
        tk = self._b.thread(thread_id)
        member = self._b.keys.member(thread_id, prompt_id)
        for attempt in range(1, _ATTEMPTS + 1):
            pipe = self._b.redis.pipeline(transaction=False)
            self._b._scripts.queue(
                pipe,
                "resume",
                [tk.session, tk.prompt(prompt_id)],
                [epoch, grant.model_dump_json() if grant else "", prompt_id, token],
            )
            pipe.zrem(self._b.keys.open, member)
            self._b._queue_audit_job(pipe, thread_id, prompt_id)
            try:
                reply, *_ = await self._b._scripts.run_pipeline(self._b.redis, pipe)
                break
            except _LINK_ERRORS as e:
                if attempt == _ATTEMPTS:
                    raise BrokerUnavailable("handing over a parked answer", e, None) from e
        if reply[0] == "fenced":
            raise _fenced(thread_id, epoch, reply)
        if reply[0] == "state":
            return Handover("unanswered", str(reply[1]))
        if reply[0] == "delivered":
            return Handover("already", str(reply[1]))
        await self._b.redis.zadd(self._b.keys.audit, {member: int(reply[1])}, nx=True)
        return Handover("handed", str(reply[1]))

    async def deliver(self, thread_id: str, prompt_id: str, epoch: int, token: str) -> Handover:
        """Record, as the lease holder, that a held wait's answer is handed to the agent now
        (deliver.lua), indexing it for audit. `already`: it was handed over before; do not."""
        tk = self._b.thread(thread_id)
        for attempt in range(1, _ATTEMPTS + 1):
            pipe = self._b.redis.pipeline(transaction=False)
            self._b._scripts.queue(
                pipe, "deliver", [tk.prompt(prompt_id), tk.session], [epoch, prompt_id, token]
            )
            self._b._queue_resolved(pipe, thread_id, prompt_id)
            try:
                reply, *_ = await self._b._scripts.run_pipeline(self._b.redis, pipe)
                break
            except _LINK_ERRORS as e:
                if attempt == _ATTEMPTS:
                    raise BrokerUnavailable("recording a held answer's delivery", e, None) from e
        if reply[0] == "fenced":
            raise _fenced(thread_id, epoch, reply)
        if reply[0] == "state":
            return Handover("unanswered", str(reply[1]))
        first = reply[0] == "delivered"
        logger.info(
            "prompt.delivered",
            extra={"thread_id": thread_id, "prompt_id": prompt_id, "first": first},
        )
        return Handover("handed" if first else "already", str(reply[1]))

    async def interrupt(
        self,
        thread_id: str,
        epoch: int,
        text: str,
        *,
        metadata: Mapping[str, Any],
        interruption: Mapping[str, Any],
        waited: str | None = None,
    ) -> bool:
        """Report the session's cut-off turn (interrupt.lua): post `text` as agent output, record
        `interruption` for the next turn, end the turn. False when there was nothing to report
        (already reported, or the session waits on an answer nobody was given).

        `waited`: the prompt the session still waits on, whose answer was already handed over.
        """
        tk = self._b.thread(thread_id)
        keys = [tk.session, tk.items] + ([tk.prompt(waited)] if waited else [])
        item_id = f"itm_{ULID()}"
        reply = await self._call(
            "interrupt",
            keys,
            [
                epoch,
                item_id,
                self._b.identity,
                body(text, {**metadata, "type": "agent_output"}),
                orjson.dumps(dict(interruption)),
                waited or "",
            ],
        )
        if reply[0] == "fenced":
            raise _fenced(thread_id, epoch, reply)
        return bool(reply[0] == "posted")

    async def grant_of(self, thread_id: str, prompt_id: str) -> Literal["none", "unused", "used"]:
        """What became of a prompt's one-shot grant: never minted, minted and not spent, or
        spent (its `approval_granted` item posted), as the prompt's record says."""
        key = self._b.thread(thread_id).prompt(prompt_id)
        granted, item = await self._b.redis.hmget(key, ["granted", "grant_item"])  # type: ignore[misc]
        if item:
            return "used"
        return "unused" if granted else "none"

    async def spend_grant(self, session: Session, epoch: int, question: str) -> str | None:
        """Spend the session's grant (as read in `session`) and post `approval_granted`.

        Returns the new item's id, or None if the grant was already spent or replaced.
        """
        grant = session.grant
        if grant is None or session.grant_raw is None:
            return None
        tk = self._b.thread(session.thread_id)
        item_id = f"itm_{ULID()}"
        text = f"✓ auto-approved `{grant.subject}`: an earlier answer approved the next call to it"
        meta = {
            "type": "approval_granted",
            "subject": grant.subject,
            "granted_by": grant.granted_by,
            "question": question,
        }
        reply = await self._call(
            "grant",
            [tk.session, tk.items, tk.prompt(grant.granted_by)],
            [epoch, session.grant_raw, item_id, self._b.identity, body(text, meta)],
        )
        if reply[0] == "fenced":
            raise _fenced(session.thread_id, epoch, reply)
        return item_id if reply[0] == "spent" else None

    async def close(self, thread_id: str, reason: str = "thread_closed") -> None:
        """End the thread: let no replica hold it (close.lua), then cancel its open prompt with
        `reason`. `ThreadNotFound` (nothing written) when the thread has no session.

        Closed first: from then on its last holder is fenced and no surface may answer, so the
        cancel cannot race an ask or an answer. Closing a closed thread again changes nothing.
        """
        reply = await self._call("close", [self._b.thread(thread_id).session], [])
        if reply[0] == "missing":
            raise ThreadNotFound(thread_id)
        await self._b.cancel(thread_id, reason)
        await self._b.redis.zrem(self._b.keys.leases, thread_id)

    async def holders(self) -> dict[str, int]:
        """Every thread in the lease index with its deadline (ms; 0 means unowned)."""
        pairs = await self._b.redis.zrange(self._b.keys.leases, 0, -1, withscores=True)
        return {t: int(score) for t, score in pairs}
