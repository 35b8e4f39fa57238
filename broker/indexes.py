"""The discovery indexes (`open`, `audit`, `leases`, `due`), each a sorted set split by thread
into buckets, and the merged reads over them.

On a Redis Cluster a single index key lives on one primary, which every ask, answer and look
would touch. So an index is `Keys.buckets` keys (broker/keys.py: `<index>:<i>`, or the index's
own name with one bucket), and a thread's members always go to one bucket, the one whose slot
is the nearest at or below the thread's (`bucket_of`): every write for a thread names one key,
in the pipeline beside the thread's script, and mostly on the thread's own node, so in the
same round trip. A read merges the buckets: by score, as one sorted set would
answer (ties by member, as Redis orders them).

An index is a hint, never a decision: the records decide, and the sweep rebuilds each index
from them (workers/runtime/audit.py for `open` and `audit`, `Sessions.rebuild_leases` for
`leases`, the timekeeper's rescan for `due`), moving members a former bucket count left in
another bucket (`regroup`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.keys import Keys, bucket_of

__all__ = ["Index", "Indexes"]

Scored = list[tuple[str, float]]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Index:
    """One discovery index: its buckets, and reads and writes that find the right one."""

    keys: Keys
    name: str  # the index's name (`pp:open`): its one key with one bucket, else the stem
    threads: bool = False  # members are thread ids (leases), else `T/prompt_id`

    # -- names --------------------------------------------------------------------------------

    def key(self, thread_id: str) -> str:
        """The bucket holding `thread_id`'s members."""
        return self.keys.bucket(self.name, bucket_of(self.name, thread_id, self.keys.buckets))

    def key_of(self, member: str) -> str:
        """The bucket a member belongs in."""
        return self.key(member if self.threads else Keys.split_member(member)[0])

    def all_keys(self) -> list[str]:
        return [self.keys.bucket(self.name, i) for i in range(self.keys.buckets)]

    def grouped(self, members: Iterable[str]) -> dict[str, list[str]]:
        """`members` by the bucket each belongs in."""
        out: dict[str, list[str]] = {}
        for member in members:
            out.setdefault(self.key_of(member), []).append(member)
        return out

    # -- writes (a pipeline, or a client) -----------------------------------------------------

    def queue_add(self, pipe: Any, scores: Mapping[str, float], *, nx: bool = False) -> int:
        """Queue the ZADDs of `scores` (member -> score) on `pipe`, one per bucket touched;
        returns how many commands were queued."""
        groups = self.grouped(scores)
        for key, members in groups.items():
            pipe.zadd(key, {m: scores[m] for m in members}, nx=nx)
        return len(groups)

    def queue_remove(self, pipe: Any, members: Iterable[str]) -> int:
        """Queue the ZREMs of `members` on `pipe`, one per bucket touched."""
        groups = self.grouped(members)
        for key, group in groups.items():
            pipe.zrem(key, *group)
        return len(groups)

    async def add(self, redis: Redis, scores: Mapping[str, float], *, nx: bool = False) -> None:
        if scores:
            pipe = redis.pipeline(transaction=False)
            self.queue_add(pipe, scores, nx=nx)
            await pipe.execute()

    async def remove(self, redis: Redis, members: Iterable[str]) -> None:
        pipe = redis.pipeline(transaction=False)
        if self.queue_remove(pipe, members):
            await pipe.execute()

    # -- merged reads -------------------------------------------------------------------------

    async def page(
        self,
        redis: Redis,
        low: float | str = "-inf",
        high: float | str = "+inf",
        offset: int = 0,
        count: int | None = None,
    ) -> Scored:
        """`(member, score)` with `low <= score <= high`, in score order, `count` of them (all:
        None) from `offset`: what ZRANGEBYSCORE ... WITHSCORES LIMIT answers on one key. Each
        bucket is read from its start to `offset + count`, then the lists are merged."""
        keys = self.all_keys()
        if len(keys) == 1:
            if count is None:
                rows = await redis.zrangebyscore(keys[0], low, high, withscores=True)
            else:
                rows = await redis.zrangebyscore(
                    keys[0], low, high, start=offset, num=count, withscores=True
                )
            return [(_text(m), float(s)) for m, s in rows]
        pipe = redis.pipeline(transaction=False)
        for key in keys:
            if count is None:
                pipe.zrangebyscore(key, low, high, withscores=True)
            else:
                pipe.zrangebyscore(key, low, high, start=0, num=offset + count, withscores=True)
        merged = _merge(await pipe.execute())
        return merged[offset:] if count is None else merged[offset : offset + count]

    async def walk(
        self, redis: Redis, low: float | str = "-inf", high: float | str = "+inf", batch: int = 200
    ) -> AsyncGenerator[tuple[str, float], None]:
        """`(member, score)` with `low <= score <= high`, in score order, read `batch` at a
        time from each bucket as the merge needs it (a long walk reads each entry once)."""
        keys = self.all_keys()
        offsets = [0] * len(keys)
        buffers: list[deque[tuple[str, float]]] = [deque() for _ in keys]
        done = [False] * len(keys)

        async def fill(which: list[int]) -> None:
            pipe = redis.pipeline(transaction=False)
            for i in which:
                pipe.zrangebyscore(keys[i], low, high, start=offsets[i], num=batch, withscores=True)
            for i, rows in zip(which, await pipe.execute(), strict=True):
                buffers[i].extend((_text(m), float(s)) for m, s in rows)
                offsets[i] += len(rows)
                done[i] = len(rows) < batch

        await fill(list(range(len(keys))))
        heap = [(buf[0][1], buf[0][0], i) for i, buf in enumerate(buffers) if buf]
        heapq.heapify(heap)
        while heap:
            score, member, i = heapq.heappop(heap)
            buffers[i].popleft()
            yield member, score
            if not buffers[i] and not done[i]:
                await fill([i])
            if buffers[i]:
                heapq.heappush(heap, (buffers[i][0][1], buffers[i][0][0], i))

    async def members(self, redis: Redis) -> list[str]:
        """Every member, in score order."""
        return [m for m, _ in await self.page(redis)]

    def queue_head(self, pipe: Any, limit: int) -> int:
        """Queue, on `pipe`, what `head_from` needs: each bucket's first `limit` and its size.
        Returns how many replies it takes."""
        for key in self.all_keys():
            pipe.zrange(key, 0, limit - 1, withscores=True)
            pipe.zcard(key)
        return 2 * self.keys.buckets

    @staticmethod
    def head_from(replies: list[Any], limit: int) -> tuple[Scored, int]:
        """From `queue_head`'s replies: the first `limit` members by score, and how many in all."""
        return _merge(replies[0::2])[:limit], sum(int(n) for n in replies[1::2])

    async def head(self, redis: Redis, limit: int) -> tuple[Scored, int]:
        """The first `limit` members by score, and how many there are in all."""
        pipe = redis.pipeline(transaction=False)
        self.queue_head(pipe, limit)
        return self.head_from(await pipe.execute(), limit)

    async def count(self, redis: Redis) -> int:
        """How many members, in all buckets."""
        pipe = redis.pipeline(transaction=False)
        for key in self.all_keys():
            pipe.zcard(key)
        return sum(int(n) for n in await pipe.execute())

    async def oldest(self, redis: Redis) -> tuple[str, float] | None:
        """The member with the lowest score, or None when the index is empty."""
        first, _ = await self.head(redis, 1)
        return first[0] if first else None

    # -- the sweep ----------------------------------------------------------------------------

    async def scan(
        self, redis: Redis, keys: Iterable[str] | None = None
    ) -> AsyncGenerator[tuple[str, str, float], None]:
        """Every `(bucket key, member, score)` of the buckets (or of `keys`), by ZSCAN."""
        for key in self.all_keys() if keys is None else keys:
            async for member, score in redis.zscan_iter(key, count=1000):
                yield key, _text(member), float(score)

    async def regroup(self, redis: Redis) -> int:
        """Move every member found outside its bucket (a former bucket count's, or a bucket
        past the count) into its own, keeping its score; returns how many moved."""
        pipe = redis.pipeline(transaction=False)
        strays = self.keys.stray_buckets(self.name)
        for key in strays:
            pipe.exists(key)
        found = [k for k, n in zip(strays, await pipe.execute(), strict=True) if n]
        if self.keys.buckets == 1 and not found:
            return 0  # one bucket: every member of the one key is in its place
        moved = 0
        batch: list[tuple[str, str, float]] = []
        async for key, member, score in self.scan(redis, [*self.all_keys(), *found]):
            if self.key_of(member) != key:
                batch.append((key, member, score))
            if len(batch) >= 500:
                moved += await self._move(redis, batch)
                batch = []
        return moved + await self._move(redis, batch)

    async def _move(self, redis: Redis, batch: list[tuple[str, str, float]]) -> int:
        if not batch:
            return 0
        pipe = redis.pipeline(transaction=False)
        for key, member, score in batch:
            pipe.zadd(self.key_of(member), {member: score}, nx=True)  # its own one wins
            pipe.zrem(key, member)
        await pipe.execute()
        return len(batch)


def _merge(lists: Iterable[Iterable[tuple[Any, Any]]]) -> Scored:
    """Sorted `(member, score)` lists merged into one, by score then member (Redis's order)."""
    rows = ([(_text(m), float(s)) for m, s in part] for part in lists)
    return list(heapq.merge(*rows, key=lambda row: (row[1], row[0])))


@dataclass(frozen=True, slots=True)
class Indexes:
    """The four discovery indexes of one key prefix."""

    open: Index
    audit: Index
    leases: Index
    due: Index

    @classmethod
    def of(cls, keys: Keys) -> Indexes:
        return cls(
            Index(keys, keys.open),
            Index(keys, keys.audit),
            Index(keys, keys.leases, threads=True),
            Index(keys, keys.due),
        )
