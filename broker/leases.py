"""Leases: the replica records, and how a thread gets a holder and loses it. `Sessions`
(broker/sessions.py) inherits these methods from `Leases`.

A thread's lease is its holder's liveness: a replica proves it is alive once per interval in one
write (its replica record, beat.lua: an incarnation and a deadline in server time), whatever it
holds. When a record expires, the other replicas claim that incarnation's threads (claim.lua,
which checks the holder is still the dead one and bumps the epoch).

`pp:leases` (threads without a holder) and `pp:holds:<replica>:<inc>` (what an incarnation
claimed) are discovery indexes, rebuildable from the records (`rebuild_leases`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from broker._base import new_ulid
from broker._scripts import Scripts
from broker.indexes import Indexes
from broker.keys import Keys, ThreadKeys

__all__ = ["SCRIPT_PAGE", "Candidates", "Fleet", "LeaseCore", "Leases", "Record"]

#: Threads one claim.lua or look.lua call takes at most: a script holds the server while it
#: runs (some 5 to 10 us a thread), so a page of 10,000 is many short runs, not one long one.
SCRIPT_PAGE = 250

#: Claim replies after which a thread leaves the to-claim index.
_SETTLED = frozenset({"claimed", "closed", "missing"})


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


def _record(raw: str | None) -> Record | None:
    """A replica record as stored (`<incarnation>|<deadline ms>`), or None."""
    if not raw:
        return None
    incarnation, _, until = raw.partition("|")
    return Record(incarnation, int(until or 0))


class LeaseCore(Protocol):
    """What `Leases` uses of the `Broker` that owns it: its connection, keys and scripts.
    Written as a protocol so this module never imports the client: imports flow one way."""

    redis: Redis
    keys: Keys
    indexes: Indexes
    _scripts: Scripts

    def thread(self, thread_id: str) -> ThreadKeys: ...

    def _check_open(self) -> None: ...


class Leases:
    """Replica records, claims and releases, through a Broker's connection and scripts."""

    _b: LeaseCore

    def __init__(self, broker: LeaseCore) -> None:
        self._b = broker

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> list[Any]:
        self._b._check_open()
        return list(await self._b._scripts.call(self._b.redis, name, keys, args))

    async def server_ms(self) -> int:
        """The Redis server's clock, in ms: leases are measured by it, never by ours."""
        seconds, micros = await self._b.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    # -- replica records ---------------------------------------------------------------------

    async def _beat(self, mode: str, replica: str, incarnation: str, ttl_ms: int = 0) -> list[Any]:
        keys = [self._b.keys.replicas, self._b.keys.replica_records]
        return await self._call("beat", keys, [mode, replica, incarnation, ttl_ms])

    async def join(self, replica: str, ttl_ms: int) -> tuple[str, int, str]:
        """Start a new incarnation of `replica`, alive for `ttl_ms`: `(incarnation, deadline ms,
        the incarnation it supersedes or "")`. The superseded one is dead from now on."""
        incarnation = new_ulid()
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
        leases = self._b.indexes.leases
        pipe = self._b.redis.pipeline(transaction=False)
        head = leases.queue_head(pipe, limit)
        for r, rec in dead.items():
            pipe.srandmember(k.holds(r, rec.incarnation), limit)
        for r, rec in fleet.records.items():
            pipe.scard(k.holds(r, rec.incarnation))
        replies = await pipe.execute()
        found, unowned = leases.head_from(replies[:head], limit)
        rest = replies[head:]
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

        Read each session's holder; then (strictly after) the holders' records; then claim.lua,
        on pages of `SCRIPT_PAGE` threads, with what was seen: it takes a thread only if its
        session still names that holder and the record showed it dead. Death is permanent
        (beat.lua), so what was seen dead is dead when the claim runs. The claimer's index entry
        is written before its claims, so a claimer that dies half-way leaves no thread it holds
        unfindable.

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
        seen: dict[str, tuple[str, str]] = {}
        pipe = self._b.redis.pipeline(transaction=False)
        pipe.sadd(k.holds(replica, incarnation), *threads)
        pages = self._pages(threads)
        for page in pages:
            args: list[Any] = [replica, incarnation]
            for t in page:
                rec: Record | None
                if t in dead:
                    owner, rec = dead[t]
                    inc = rec.incarnation
                else:
                    owner, inc = read[t]
                    rec = records.get(owner)
                seen[t] = (owner, inc)
                args += [owner, inc, *([rec.incarnation, rec.until] if rec else ["", 0])]
            keys = [self._b.thread(t).session for t in page]
            self._b._scripts.queue(pipe, "claim", keys, args)
        _, *replies = await self._b._scripts.run_pipeline(self._b.redis, pipe)
        threads = [t for page in pages for t in page]  # in the replies' order
        flat = [r for page_replies in replies for r in page_replies]
        return await self._settle(threads, [seen[t] for t in threads], flat, replica, incarnation)

    def _pages(self, threads: Sequence[str]) -> list[list[str]]:
        """`threads` in the groups one claim.lua or look.lua call takes: pages of `SCRIPT_PAGE`
        on a single server; on a cluster, of one slot's threads (a script touches one slot)."""
        groups: Sequence[Sequence[str]] = [threads]
        if isinstance(self._b.redis, RedisCluster):
            by_slot: dict[int, list[str]] = {}
            for t in threads:
                # A thread's keys hash on `{thread_id}`: its slot is the id's own (as bucket_of
                # in broker/keys.py takes it), with no key names to build.
                by_slot.setdefault(key_slot(t.encode()), []).append(t)
            groups = list(by_slot.values())
        return [
            list(group[i : i + SCRIPT_PAGE])
            for group in groups
            for i in range(0, len(group), SCRIPT_PAGE)
        ]

    async def look_many(
        self, replica: str, incarnation: str, held: Mapping[str, int]
    ) -> dict[str, str]:
        """What each thread `held` (`thread -> the epoch held`) needs, in pages of look.lua:
        `look`, `parked` (a dead holder's held wait, marked parked under that epoch) or
        `quiet`, as broker/lua/look.lua says."""
        if not held:
            return {}
        pages = self._pages(list(held))
        pipe = self._b.redis.pipeline(transaction=False)
        for page in pages:
            keys: list[str] = []
            args: list[Any] = [replica, incarnation]
            for t in page:
                tk = self._b.thread(t)
                keys += [tk.session, tk.inbox]
                args += [held[t], tk.base]
            self._b._scripts.queue(pipe, "look", keys, args)
        replies = await self._b._scripts.run_pipeline(self._b.redis, pipe)
        return {
            t: str(reply)
            for page, page_replies in zip(pages, replies, strict=True)
            for t, reply in zip(page, page_replies, strict=True)
        }

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
        # Out of the to-claim index: claimed, closed or gone. A 'moved' one stays: its new
        # holder may be a dead one, read again next look. A 'held' one stays too: a holder
        # stopping cleanly indexes its threads here and then releases them, and an entry taken
        # out in between would leave a released thread in no index at all. (Held, it is in its
        # holder's set as well; the entry goes once a claim takes it.)
        done = [t for t, reply in zip(threads, replies, strict=True) if reply[0] in _SETTLED]
        self._b.indexes.leases.queue_remove(pipe, done)
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
            await self._b.indexes.leases.add(self._b.redis, dict.fromkeys(page, 0))
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
        await self._b.redis.zadd(self._b.indexes.leases.key(thread_id), {thread_id: 0})
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
                await self._b.indexes.leases.add(self._b.redis, dict.fromkeys(page, 0), nx=True)
                moved += len(page)
            if not cursor:
                break
        await self._b.redis.delete(key)
        return moved

    async def rebuild_leases(self) -> dict[str, int]:
        """Rebuild the lease indexes from the session records: every unowned thread, and every
        thread whose holder's incarnation is not the one on its record, is indexed to be
        claimed; every held one is in its holder's set; a member a former bucket count left in
        another bucket is moved to its own (broker/indexes.py). Returns counts."""
        k = self._b.keys
        leases = self._b.indexes.leases
        fleet = await self.look()
        await leases.regroup(self._b.redis)
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
                await self._b.redis.zadd(leases.key(thread_id), {thread_id: 0}, nx=True)
                counts["unowned"] += 1
        return counts

    async def holders(self) -> dict[str, int]:
        """Every thread the lease indexes know, with its holder's deadline (ms; 0: none)."""
        fleet = await self.look()
        out = dict.fromkeys(await self._b.indexes.leases.members(self._b.redis), 0)
        for r, rec in fleet.records.items():
            members = await self._b.redis.smembers(self._b.keys.holds(r, rec.incarnation))  # type: ignore[misc]
            out.update(dict.fromkeys(members, rec.until))
        return out
