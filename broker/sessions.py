"""Agent sessions: which replica drives a thread, under which incarnation and fencing epoch.

The session record `pp:{T}:session` decides: it names its holder (`owner`, a replica id) and the
holder's incarnation (`inc`). A thread's lease is its holder's liveness (broker/leases.py: the
replica records, claims and releases, which `Sessions` inherits). Every script a replica runs for
a thread carries its epoch, so a replica that lost the thread (paused, partitioned, too slow) can
no longer ask, deliver or post anything on it.

This module holds the record itself (created, read, updated, closed) and what its holder does
through it: hand an answer over (a parked one on resume, a held one on delivery), report a turn
cut off, spend a one-shot grant.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

import orjson
from pydantic import BaseModel, ConfigDict
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker._base import _new_id, now_ms
from broker._codec import body, ms_datetime
from broker.errors import BadItem, BrokerUnavailable, Fenced, ThreadNotFound
from broker.keys import check_thread_id
from broker.leases import LeaseCore, Leases, _record
from broker.models import Prompt

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
    lease_until: datetime | None  # the holder's record deadline, if its incarnation holds it
    status: Status
    created_at: datetime
    state: dict[str, Any] | None = None  # the harness's own, between turns
    waiting: Waiting | None = None
    grant: Grant | None = None
    grant_raw: str | None = None  # the grant exactly as stored: spending compares it
    error: str | None = None
    # guarded only: as given (`workers.agents.policy` checks it)
    policy: dict[str, Any] | None = None
    delivered: str | None = None  # the prompt whose answer the running turn was handed, if any
    interrupted: dict[str, Any] | None = None  # the last turn was cut off: for the next to tell
    holder_incarnation: str = ""  # the incarnation of `owner` that claimed it


def _session(thread_id: str, h: Mapping[str, str], until: int = 0) -> Session:
    return Session(
        thread_id=thread_id,
        harness=h["harness"],
        permissions=h["permissions"],
        config=orjson.loads(h["config"]),
        work_folder=h.get("work_folder", ""),
        owner=h.get("owner", ""),
        holder_incarnation=h.get("inc", ""),
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
    return _new_id("dlv")


class BrokerCore(LeaseCore, Protocol):
    """What `Sessions` uses of the `Broker` that owns it: its connection, keys, scripts and
    identity, and the resolution bookkeeping a delivery shares with it. Written as a protocol so
    this module never imports the client (which holds a `Sessions`): imports flow one way."""

    identity: str

    def _queue_resolved(self, pipe: Any, thread_id: str, prompt_id: str) -> None: ...

    def _queue_audit_job(self, pipe: Any, thread_id: str, prompt_id: str) -> None: ...

    async def _audit_job_after(self, thread_id: str, prompt_id: str) -> None: ...

    async def cancel(
        self,
        thread_id: str,
        reason: str = "",
        *,
        prompt_id: str | None = None,
        epoch: int | None = None,
    ) -> Prompt | None: ...


class Sessions(Leases):
    """Session records and leases (the methods of `Leases`), through a Broker's connection and
    scripts."""

    _b: BrokerCore

    def __init__(self, broker: BrokerCore) -> None:
        super().__init__(broker)

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
        the runtime's to check (`workers.agents.policy.validate`, before this), not the library's.
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
        pipe.zadd(self._b.indexes.leases.key(thread_id), {thread_id: now_ms()}, nx=True)
        pipe.hgetall(tk.session)
        _, h = await pipe.execute()
        return _session(thread_id, h)

    async def get(self, thread_id: str, *, lease: bool = True) -> Session | None:
        """The session. `lease`: also read its holder's record, for `lease_until` (the holder's
        deadline while the incarnation that claimed it is the record's); one more round trip."""
        h: dict[str, str] = await self._b.redis.hgetall(self._b.thread(thread_id).session)  # type: ignore[misc]
        if not h:
            return None
        until = 0
        if lease and h.get("owner"):
            raw = await self._b.redis.hget(self._b.keys.replica_records, h["owner"])  # type: ignore[misc]
            record = _record(raw)
            if record is not None and record.incarnation == h.get("inc", ""):
                until = record.until
        return _session(thread_id, h, until)

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
            pipe.zrem(self._b.indexes.open.key(thread_id), member)
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
        audit = self._b.indexes.audit.key(thread_id)
        await self._b.redis.zadd(audit, {member: int(reply[1])}, nx=True)
        await self._b._audit_job_after(thread_id, prompt_id)
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
        await self._b._audit_job_after(thread_id, prompt_id)
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
        item_id = _new_id("itm")
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
        item_id = _new_id("itm")
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
        await self._b.redis.zrem(self._b.indexes.leases.key(thread_id), thread_id)
