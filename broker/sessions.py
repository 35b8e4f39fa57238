"""Agent sessions: which replica drives a thread, under which incarnation and fencing epoch.

The session record `pp:{T}:session` decides: it names its holder (`owner`, a replica id) and the
holder's incarnation (`inc`). A thread's lease is its holder's liveness: a replica proves it is
alive once per interval in one write (its replica record, beat.lua: an incarnation and a deadline
in server time), whatever it holds. When a record expires, the other replicas claim that
incarnation's threads (claim.lua, which checks the holder is still the dead one and bumps the
epoch). Every script a replica runs for a thread carries its epoch, so a replica that lost the
thread (paused, partitioned, too slow) can no longer ask, deliver or post anything on it.

`pp:leases` (threads without a holder) and `pp:holds:<replica>:<inc>` (what an incarnation
claimed) are discovery indexes, rebuildable from the records (`rebuild_leases`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

import orjson
from pydantic import BaseModel, ConfigDict
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from ulid import ULID

from broker._codec import body, ms_datetime
from broker._scripts import Scripts
from broker.errors import BadItem, BrokerUnavailable, Fenced, ThreadNotFound
from broker.keys import Keys, ThreadKeys, check_thread_id
from broker.models import Prompt

__all__ = [
    "Fleet",
    "Grant",
    "Handover",
    "Permissions",
    "Record",
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


class Record(NamedTuple):
    """A replica's record: its current incarnation and the deadline it proved itself alive to."""

    incarnation: str
    until: int  # ms, server time


class Fleet(NamedTuple):
    """What a look at the replica records sees (server time of the records' own server)."""

    now: int
    records: dict[str, Record]

    def alive(self) -> dict[str, Record]:
        return {r: rec for r, rec in self.records.items() if rec.until > self.now}

    def dead(self) -> dict[str, Record]:
        return {r: rec for r, rec in self.records.items() if rec.until <= self.now}


class Candidates(NamedTuple):
    """What an adoption look sees: server time, the threads to claim (thread -> ms since when
    they are to be had), all threads held or not, and the live replicas."""

    now: int
    expired: dict[str, int]
    threads: int
    replicas: int
    # of those, the threads found in a dead incarnation's index: -> (its replica, its record
    # as seen dead), evidence `claim_many` may use without reading the session first
    dead: dict[str, tuple[str, Record]]


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


def _record(raw: str | None) -> Record | None:
    """A replica record as stored (`<incarnation>|<deadline ms>`), or None."""
    if not raw:
        return None
    incarnation, _, until = raw.partition("|")
    return Record(incarnation, int(until or 0))


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


class BrokerCore(Protocol):
    """What `Sessions` uses of the `Broker` that owns it: its connection, keys, scripts and
    identity, and the resolution bookkeeping a delivery shares with it. Written as a protocol so
    this module never imports the client (which holds a `Sessions`): imports flow one way."""

    redis: Redis
    keys: Keys
    identity: str
    _scripts: Scripts

    def thread(self, thread_id: str) -> ThreadKeys: ...

    def _check_open(self) -> None: ...

    def _queue_resolved(self, pipe: Any, thread_id: str, prompt_id: str) -> None: ...

    def _queue_audit_job(self, pipe: Any, thread_id: str, prompt_id: str) -> None: ...

    async def cancel(
        self,
        thread_id: str,
        reason: str = "",
        *,
        prompt_id: str | None = None,
        epoch: int | None = None,
    ) -> Prompt | None: ...


class Sessions:
    """Session records and leases, through a Broker's connection and scripts."""

    def __init__(self, broker: BrokerCore) -> None:
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
        pipe.zadd(self._b.keys.leases, {thread_id: ULID().milliseconds}, nx=True)
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

    # -- replica records ---------------------------------------------------------------------

    async def _beat(self, mode: str, replica: str, incarnation: str, ttl_ms: int = 0) -> list[Any]:
        keys = [self._b.keys.replicas, self._b.keys.replica_records]
        return await self._call("beat", keys, [mode, replica, incarnation, ttl_ms])

    async def join(self, replica: str, ttl_ms: int) -> tuple[str, int, str]:
        """Start a new incarnation of `replica`, alive for `ttl_ms`: `(incarnation, deadline ms,
        the incarnation it supersedes or "")`. The superseded one is dead from now on."""
        incarnation = str(ULID())
        reply = await self._beat("join", replica, incarnation, ttl_ms)
        return incarnation, int(reply[1]), str(reply[2]) if len(reply) > 2 else ""

    async def beat(self, replica: str, incarnation: str, ttl_ms: int) -> int | None:
        """Prove `replica`'s incarnation alive for `ttl_ms` more (one write, whatever it holds):
        the new deadline, or None when it is dead (its deadline passed, or another incarnation
        joined): it then holds nothing and must touch none of its threads again."""
        reply = await self._beat("beat", replica, incarnation, ttl_ms)
        return int(reply[1]) if reply[0] == "alive" else None

    async def leave(self, replica: str, incarnation: str) -> None:
        """Remove the incarnation's record (a clean stop, after releasing its threads)."""
        await self._beat("leave", replica, incarnation)

    async def look(self) -> Fleet:
        """Every replica record, with the records' server time."""
        reply = await self._beat("look", "", "")
        records = {}
        for i in range(1, len(reply) - 1, 2):
            record = _record(reply[i + 1])
            if record is not None:
                records[str(reply[i])] = record
        return Fleet(int(reply[0]), records)

    async def bury(self, replica: str, record: Record) -> bool:
        """Remove a dead incarnation's record once nothing is left to adopt from it."""
        reply = await self._beat("bury", replica, record.incarnation)
        return bool(reply[0] == "buried")

    # -- claims ------------------------------------------------------------------------------

    async def candidates(self, fleet: Fleet, limit: int = 500) -> Candidates:
        """Threads to claim: the unowned (new, released, freed) and those of dead incarnations,
        up to `limit` of each kind, with what a replica needs to take its fair share. A dead
        incarnation with nothing left to adopt loses its record here."""
        k = self._b.keys
        dead = fleet.dead()
        alive = fleet.alive()
        pipe = self._b.redis.pipeline(transaction=False)
        pipe.zrangebyscore(k.leases, "-inf", "+inf", start=0, num=limit, withscores=True)
        pipe.zcard(k.leases)
        for r, rec in dead.items():
            pipe.srandmember(k.holds(r, rec.incarnation), limit)
        for r, rec in fleet.records.items():
            pipe.scard(k.holds(r, rec.incarnation))
        found, unowned, *rest = await pipe.execute()
        expired = {t: int(score) for t, score in found}
        of_dead: dict[str, tuple[str, Record]] = {}
        for (r, rec), members in zip(dead.items(), rest[: len(dead)], strict=True):
            for t in members:
                if t not in expired:
                    expired[t] = rec.until
                    of_dead[t] = (r, rec)
            if not members:
                await self.bury(r, rec)
        threads = int(unowned) + sum(int(n) for n in rest[len(dead) :])
        return Candidates(fleet.now, expired, threads, len(alive), of_dead)

    async def claim(self, thread_id: str, replica: str, incarnation: str) -> int | None:
        """Claim the thread if it has no live holder: its new epoch, or None."""
        return (await self.claim_many([thread_id], replica, incarnation)).get(thread_id)

    async def claim_many(
        self,
        threads: Sequence[str],
        replica: str,
        incarnation: str,
        dead: Mapping[str, tuple[str, Record]] | None = None,
    ) -> dict[str, int]:
        """Claim, in pipelined pages, those of `threads` whose holder is dead (or that have none):
        `{thread: epoch}` of those claimed.

        Per page: read each session's holder; then (strictly after) the holders' records; then
        one claim.lua per thread with what was seen, which takes it only if the session still
        names that holder and the record showed it dead. Death is permanent (beat.lua), so what
        was seen dead is dead when the claim runs. The claimer's index entry is written before
        its claims, so a claimer that dies half-way leaves no thread it holds unfindable.

        `dead`: threads found in a dead incarnation's index, with that replica and its record
        as seen dead (`Candidates.dead`). Those sessions are not read first: the claim expects
        that holder, and its record's incarnation was seen expired, which stays true, so no
        read order matters for them.
        """
        if not threads:
            return {}
        k = self._b.keys
        threads = list(dict.fromkeys(threads))
        dead = dead or {}
        unread = [t for t in threads if t not in dead]
        pipe = self._b.redis.pipeline(transaction=False)
        for t in unread:
            pipe.hmget(self._b.thread(t).session, ["owner", "inc"])
        read = dict(zip(unread, [(o or "", i or "") for o, i in await pipe.execute()], strict=True))
        holders = sorted({o for o, _ in read.values() if o})
        records: dict[str, Record] = {}
        if holders:
            raw = await self._b.redis.hmget(k.replica_records, holders)  # type: ignore[misc]
            records = {o: r for o, v in zip(holders, raw, strict=True) if (r := _record(v))}
        seen: list[tuple[str, str]] = []
        pipe = self._b.redis.pipeline(transaction=False)
        pipe.sadd(k.holds(replica, incarnation), *threads)
        for t in threads:
            rec: Record | None
            if t in dead:
                owner, rec = dead[t]
                inc = rec.incarnation
            else:
                owner, inc = read[t]
                rec = records.get(owner)
            seen.append((owner, inc))
            observed = [rec.incarnation, rec.until] if rec else ["", 0]
            self._b._scripts.queue(
                pipe,
                "claim",
                [self._b.thread(t).session],
                [replica, incarnation, owner, inc, *observed],
            )
        _, *replies = await self._b._scripts.run_pipeline(self._b.redis, pipe)
        return await self._settle(threads, seen, replies, replica, incarnation)

    async def _settle(
        self,
        threads: list[str],
        seen: list[tuple[str, str]],
        replies: list[Any],
        replica: str,
        incarnation: str,
    ) -> dict[str, int]:
        """The index writes after a page of claims; `{thread: epoch}` of those claimed."""
        k = self._b.keys
        mine = k.holds(replica, incarnation)
        claimed: dict[str, int] = {}
        not_mine: list[str] = []
        freed: dict[str, list[str]] = {}
        for t, (owner, inc), reply in zip(threads, seen, replies, strict=True):
            if reply[0] == "claimed":
                claimed[t] = int(reply[1])
                former = k.holds(str(reply[2]), str(reply[3])) if reply[2] else None
            else:
                if (owner, inc) != (replica, incarnation):  # not one it already holds
                    not_mine.append(t)
                former = k.holds(owner, inc) if reply[0] != "held" and owner else None
            if former is not None and former != mine:
                freed.setdefault(former, []).append(t)
        pipe = self._b.redis.pipeline(transaction=False)
        if not_mine:
            pipe.srem(mine, *not_mine)
        for key, members in freed.items():
            pipe.srem(key, *members)
        # Out of the to-claim index: claimed, held by a live replica (in its index), closed or
        # gone. A 'moved' one stays: its new holder may be a dead one, read again next look.
        done = [t for t, reply in zip(threads, replies, strict=True) if reply[0] != "moved"]
        if done:
            pipe.zrem(k.leases, *done)
        await pipe.execute()
        return claimed

    async def release_all(self, replica: str, incarnation: str, held: Mapping[str, int]) -> int:
        """Give every thread `held` (`thread -> epoch`) up at once and remove the record: a clean
        stop. Returns how many were released. The to-claim index gets them first, so a stop cut
        short half-way leaves none unfindable."""
        k = self._b.keys
        released = 0
        threads = list(held)
        for start in range(0, len(threads), 1000):
            page = threads[start : start + 1000]
            await self._b.redis.zadd(k.leases, dict.fromkeys(page, 0))
            pipe = self._b.redis.pipeline(transaction=False)
            for t in page:
                self._b._scripts.queue(
                    pipe, "release", [self._b.thread(t).session], [replica, held[t]]
                )
            replies = await self._b._scripts.run_pipeline(self._b.redis, pipe)
            released += sum(1 for r in replies if r[0] == "released")
        await self._b.redis.delete(k.holds(replica, incarnation))
        await self.leave(replica, incarnation)
        return released

    async def release(self, thread_id: str, replica: str, epoch: int) -> bool:
        """Give one thread up now, so another replica adopts it without waiting."""
        await self._b.redis.zadd(self._b.keys.leases, {thread_id: 0})
        reply = await self._call("release", [self._b.thread(thread_id).session], [replica, epoch])
        return bool(reply[0] == "released")

    async def free(self, replica: str, incarnation: str) -> int:
        """Put what a superseded incarnation of `replica` claimed up for claiming (a restarted
        replica does this at once: its old incarnation is dead, nobody need wait for its record
        to expire). Returns how many threads were freed."""
        k = self._b.keys
        key = k.holds(replica, incarnation)
        moved = 0
        cursor = 0
        while True:
            cursor, page = await self._b.redis.sscan(key, cursor, count=1000)
            if page:
                await self._b.redis.zadd(k.leases, dict.fromkeys(page, 0), nx=True)
                moved += len(page)
            if not cursor:
                break
        await self._b.redis.delete(key)
        return moved

    async def rebuild_leases(self) -> dict[str, int]:
        """Rebuild the lease indexes from the session records: every unowned thread, and every
        thread whose holder's incarnation is not the one on its record, is indexed to be
        claimed; every held one is in its holder's set. Returns counts."""
        k = self._b.keys
        fleet = await self.look()
        counts = {"unowned": 0, "held": 0}
        async for key in self._b.redis.scan_iter(match=k.session_pattern, count=1000):
            owner, inc, status = await self._b.redis.hmget(key, ["owner", "inc", "status"])  # type: ignore[misc]
            thread_id = key[len(k.prefix) + 2 : key.index("}:session")]
            if status is None or status == "closed":
                continue
            rec = fleet.records.get(owner or "")
            if owner and rec is not None and rec.incarnation == inc:
                await self._b.redis.sadd(k.holds(owner, inc), thread_id)  # type: ignore[misc]
                counts["held"] += 1
            else:
                await self._b.redis.zadd(k.leases, {thread_id: 0}, nx=True)
                counts["unowned"] += 1
        return counts

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
        """Every thread the lease indexes know, with its holder's deadline (ms; 0: none)."""
        fleet = await self.look()
        out = {t: 0 for t in await self._b.redis.zrange(self._b.keys.leases, 0, -1)}
        for r, rec in fleet.records.items():
            members = await self._b.redis.smembers(self._b.keys.holds(r, rec.incarnation))  # type: ignore[misc]
            out.update(dict.fromkeys(members, rec.until))
        return out
