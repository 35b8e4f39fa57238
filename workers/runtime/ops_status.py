"""The fleet as Redis records it: replicas, threads, waits, prompts, the audit backlog.

`fleet_status` is the one place that reads it; `prompt-broker status`, the readiness checks
and the fleet-wide metrics all use what it returns. It only reads, in pipelined pages, so it is
safe to run against a live fleet at any time.

What it reads:

- the replica records: `_replicas` and `_thread_ids` are the only functions that know their
  shape, so a change of liveness model changes those alone. With per-replica records (a hash
  of `<incarnation>|<deadline>`), a replica is live while its deadline is ahead of server time
  and its threads are its incarnation's `holds` set; without them, a replica is live when its
  last beat (`replicas`, server ms) is within one lease TTL and threads are the lease index;
- every thread's session record (`owner`, `status`, `wait`): a thread is held by its owner;
  `running` with a `wait` is a held wait (a live turn blocked on a person), `running` without
  one a turn running, `parked` a parked wait;
- the open-prompt index (by creation time) and, per member, its prompt's kind and state;
- the audit index (resolutions whose audit item is not posted yet, by resolution time).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import orjson
from redis.asyncio import Redis

from broker.indexes import Indexes
from broker.keys import Keys

__all__ = ["FleetStatus", "ReplicaStatus", "fleet_status", "render", "replica_alive"]

#: Records read per pipelined round trip.
PAGE = 1000


@dataclass
class ReplicaStatus:
    """One replica as the records show it."""

    id: str
    live: bool
    last_beat_ms: int
    threads: int = 0
    held_waits: int = 0
    parked_waits: int = 0
    turns_running: int = 0


@dataclass
class FleetStatus:
    """The fleet at one moment (server time `now_ms`)."""

    now_ms: int
    replicas: list[ReplicaStatus] = field(default_factory=list)
    threads: int = 0
    threads_unheld: int = 0  # owned by no live replica
    held_waits: int = 0
    parked_waits: int = 0
    turns_running: int = 0
    open_prompts: int = 0
    open_by_kind: dict[str, int] = field(default_factory=dict)
    oldest_open: str | None = None  # `T/prompt_id`
    oldest_open_age_s: float = 0.0
    oldest_unheld: str | None = None  # the oldest open prompt on a thread no live replica holds
    oldest_unheld_age_s: float = 0.0
    audit_backlog: int = 0
    audit_lag_s: float = 0.0  # age of the oldest resolution whose audit item is not posted

    @property
    def replicas_live(self) -> int:
        return sum(r.live for r in self.replicas)

    def as_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["replicas_live"] = self.replicas_live
        return document


async def server_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


class _Replica(NamedTuple):
    live: bool
    last_beat_ms: int
    incarnation: str  # '' without per-replica records


async def _replicas(redis: Redis, keys: Keys, now: int, ttl_ms: int) -> dict[str, _Replica]:
    """Every recorded replica. The liveness record's shape lives here (and in `_thread_ids`)."""
    pipe = redis.pipeline(transaction=False)
    pipe.zrange(keys.replicas, 0, -1, withscores=True)
    records_key = getattr(keys, "replica_records", None)
    if records_key:
        pipe.hgetall(records_key)
    beats, *rest = await pipe.execute()
    last = {_text(r): int(score) for r, score in beats}
    records = {_text(k): _text(v) for k, v in (rest[0] if rest else {}).items()}
    found: dict[str, _Replica] = {}
    for replica in sorted(set(last) | set(records)):
        beat = last.get(replica, 0)
        if records_key:
            incarnation, _, until = records.get(replica, "").partition("|")
            live = bool(until) and int(until) > now
        else:
            incarnation, live = "", beat >= now - ttl_ms
        found[replica] = _Replica(live, beat, incarnation)
    return found


async def _thread_ids(redis: Redis, keys: Keys, replicas: dict[str, _Replica]) -> list[str]:
    """Every thread: those to be claimed (the lease index) and those each incarnation holds."""
    found = set(await Indexes.of(keys).leases.members(redis))
    pipe = redis.pipeline(transaction=False)
    holds = getattr(keys, "holds", None)
    for replica, r in replicas.items():
        if holds is not None and r.incarnation:
            pipe.smembers(holds(replica, r.incarnation))
    for members in await pipe.execute():
        found.update(_text(m) for m in members)
    return sorted(found)


async def replica_alive(redis: Redis, keys: Keys, replica_id: str, ttl_ms: int) -> bool:
    """Whether `replica_id`'s liveness record is current (server time)."""
    found = (await _replicas(redis, keys, await server_ms(redis), ttl_ms)).get(replica_id)
    return found is not None and found.live


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _sessions(redis: Redis, keys: Keys, threads: list[str]) -> list[tuple[str, str, str]]:
    """(owner, status, wait) of each thread's session."""
    rows: list[tuple[str, str, str]] = []
    for start in range(0, len(threads), PAGE):
        pipe = redis.pipeline(transaction=False)
        for t in threads[start : start + PAGE]:
            pipe.hmget(keys.thread(t).session, ["owner", "status", "wait"])
        for owner, status, wait in await pipe.execute():
            rows.append((_text(owner or ""), _text(status or ""), _text(wait or "")))
    return rows


async def _pending(redis: Redis, keys: Keys, members: list[str]) -> list[tuple[str, str]]:
    """(member, kind) of the index members whose prompt is still pending, in index order.

    The open index keeps a resolved prompt until its resolution is taken care of: the record's
    state decides."""
    found: list[tuple[str, str]] = []
    for start in range(0, len(members), PAGE):
        page = members[start : start + PAGE]
        pipe = redis.pipeline(transaction=False)
        for member in page:
            thread_id, prompt_id = Keys.split_member(member)
            pipe.hmget(keys.thread(thread_id).prompt(prompt_id), ["kind", "state"])
        for member, (kind, state) in zip(page, await pipe.execute(), strict=True):
            if kind is not None and _text(state or "") == "pending":
                found.append((member, _text(kind)))
    return found


def _tally(status: FleetStatus, threads: list[str], rows: list[tuple[str, str, str]]) -> set[str]:
    """Count the sessions into `status`; returns the threads no live replica holds."""
    by_id = {r.id: r for r in status.replicas}
    unheld: set[str] = set()
    for thread_id, (owner, state, wait) in zip(threads, rows, strict=True):
        if state == "closed":
            continue
        status.threads += 1
        replica = by_id.get(owner)
        if replica is None or not replica.live:
            status.threads_unheld += 1
            unheld.add(thread_id)
        held = state == "running" and bool(wait)
        parked = state == "parked"
        running = state == "running" and not wait
        status.held_waits += held
        status.parked_waits += parked
        status.turns_running += running
        if replica is not None:
            replica.threads += 1
            replica.held_waits += held
            replica.parked_waits += parked
            replica.turns_running += running
    return unheld


async def fleet_status(redis: Redis, keys: Keys, ttl_ms: int) -> FleetStatus:
    """Read the fleet from Redis. `ttl_ms`: a replica that beat within it counts as live."""
    now = await server_ms(redis)
    replicas = await _replicas(redis, keys, now, ttl_ms)
    status = FleetStatus(now_ms=now)
    status.replicas = [
        ReplicaStatus(id=r, live=rec.live, last_beat_ms=rec.last_beat_ms)
        for r, rec in replicas.items()
    ]
    threads = await _thread_ids(redis, keys, replicas)
    unheld = _tally(status, threads, await _sessions(redis, keys, threads))
    indexes = Indexes.of(keys)
    created = dict(await indexes.open.page(redis))
    oldest_audit, backlog = await indexes.audit.head(redis, 1)
    pending = await _pending(redis, keys, list(created))
    status.open_prompts = len(pending)
    status.open_by_kind = dict(sorted(Counter(kind for _, kind in pending).items()))
    if pending:
        status.oldest_open = pending[0][0]
        status.oldest_open_age_s = max(0.0, (now - created[pending[0][0]]) / 1000)
    for member, _ in pending:  # in index order: the first on an unheld thread is the oldest
        if Keys.split_member(member)[0] in unheld:
            status.oldest_unheld = member
            status.oldest_unheld_age_s = max(0.0, (now - created[member]) / 1000)
            break
    status.audit_backlog = int(backlog)
    if oldest_audit:
        status.audit_lag_s = max(0.0, (now - oldest_audit[0][1]) / 1000)
    return status


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def render(status: FleetStatus, *, as_json: bool = False) -> str:
    """The fleet for a person (a table) or a program (`as_json`)."""
    if as_json:
        return orjson.dumps(status.as_json(), option=orjson.OPT_INDENT_2).decode()
    lines = [
        f"replicas: {status.replicas_live} live of {len(status.replicas)} recorded",
    ]
    if status.replicas:
        lines.append(f"  {'REPLICA':<40} {'LIVE':<4} {'BEAT':>6} THREADS HELD PARKED RUNNING")
        for r in status.replicas:
            beat = _age(max(0.0, (status.now_ms - r.last_beat_ms) / 1000))
            lines.append(
                f"  {r.id:<40} {'yes' if r.live else 'no':<4} {beat:>6} {r.threads:>7} "
                f"{r.held_waits:>4} {r.parked_waits:>6} {r.turns_running:>7}"
            )
    lines.append(
        f"threads: {status.threads} ({status.threads_unheld} not held by a live replica); "
        f"waits: {status.held_waits} held, {status.parked_waits} parked; "
        f"turns running: {status.turns_running}"
    )
    kinds = ", ".join(f"{k} {n}" for k, n in status.open_by_kind.items())
    lines.append(f"open prompts: {status.open_prompts}" + (f" ({kinds})" if kinds else ""))
    if status.oldest_open:
        lines.append(
            f"oldest open prompt: {status.oldest_open}, {_age(status.oldest_open_age_s)} old"
        )
    if status.oldest_unheld:
        lines.append(
            f"oldest prompt no live replica holds: {status.oldest_unheld}, "
            f"{_age(status.oldest_unheld_age_s)} old"
        )
    lag = f", oldest {_age(status.audit_lag_s)}" if status.audit_backlog else ""
    lines.append(f"audit backlog: {status.audit_backlog}{lag}")
    return "\n".join(lines)
