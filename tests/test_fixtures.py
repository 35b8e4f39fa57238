"""The test fixtures' own promise: after a test, nothing of its prefix is left on the server it
ran on (the shared single server, or every primary of the session's cluster), its audit jobs'
arq keys included."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker import Broker
from tests.conftest import delete_prefix
from tests.helpers import text

APPROVAL = {"question": "Ship it?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


async def _keys_of(client: Redis, prefix: str) -> list[str]:
    """Every key whose name holds `prefix`, on every primary of a cluster."""
    if not isinstance(client, RedisCluster):
        return sorted([k async for k in client.scan_iter(match=f"*{prefix}*", count=1000)])
    cluster: RedisCluster = client
    await cluster.initialize()
    found: list[str] = []
    for primary in cluster.get_primaries():
        node = Redis(host=primary.host, port=primary.port, decode_responses=True)
        try:
            found += [k async for k in node.scan_iter(match=f"*{prefix}*", count=1000)]
        finally:
            await node.aclose()
    return sorted(found)


async def test_delete_prefix_leaves_nothing_of_the_test(broker: Broker, prefix: str) -> None:
    """A thread's keys, the index buckets, the replica records (`{<prefix>:replicas}:...`) and
    the audit job arq holds (`arq:job:...`, on a cluster under `{arq:abort}`) all go."""
    p = await broker.ask("t", "approval", [APPROVAL])
    waiting = asyncio.create_task(broker.wait("t", p.prompt_id, timeout=5))
    await broker.post_item("t", text("yes"))
    await waiting
    await broker.settle()  # the audit job is enqueued
    await broker.redis.hset(broker.keys.replica_records, "r1", "i|0")  # type: ignore[misc]
    before = await _keys_of(broker.redis, prefix)
    assert any(k.startswith("arq:job:") for k in before), before
    assert broker.keys.replica_records in before
    assert any(k.startswith(f"{prefix}:{{t}}:") for k in before)
    await delete_prefix(broker.redis, prefix)
    assert await _keys_of(broker.redis, prefix) == []
