"""One page of the threads' SCAN for `GET /v1/threads`: on one server, SCAN's own cursor; on a
Redis Cluster, where every primary has a keyspace and a cursor of its own, the primaries in turn
(in name order), the page's cursor `[the primary's index, its SCAN cursor]`.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from web.errors import bad

__all__ = ["scan_page"]


async def scan_page(
    redis: Redis, cursor: Any, match: str, count: int
) -> tuple[list[str], Any | None]:
    """The keys of one SCAN step matching `match`, and the next page's cursor (None: done)."""
    if not isinstance(redis, RedisCluster):
        if cursor is not None and (not isinstance(cursor, int) or cursor < 0):
            raise bad("cursor", "not a cursor this server gave out")
        next_scan, keys = await redis.scan(cursor or 0, match=match, count=count)
        return list(keys), int(next_scan) or None
    at, node_cursor = [0, 0] if cursor is None else cursor if _pair(cursor) else (-1, -1)
    await redis.initialize()  # the slot map: which nodes are primaries
    primaries = sorted(redis.get_primaries(), key=lambda n: n.name)
    if not 0 <= at < len(primaries):
        raise bad("cursor", "not a cursor this server gave out")
    node = primaries[at]
    cursors, keys = await redis.scan(node_cursor, match=match, count=count, target_nodes=node)
    if int(cursors[node.name]):
        return list(keys), [at, int(cursors[node.name])]
    return list(keys), [at + 1, 0] if at + 1 < len(primaries) else None


def _pair(cursor: Any) -> bool:
    return (
        isinstance(cursor, list)
        and len(cursor) == 2
        and all(isinstance(c, int) and c >= 0 for c in cursor)
    )
