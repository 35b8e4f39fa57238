"""kill -9 of a Redis Cluster primary holding an open prompt and a held wait; its replica is
promoted. On a cluster of its own (the test kills a node)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from broker import Broker, BrokerError, Settings
from broker.models import Question
from tests.conftest import RedisClusterNodes

pytestmark = pytest.mark.real_redis


def _primary_of(cluster: RedisClusterNodes, port: int) -> bool:
    return bool(redis.Redis(port=port).info("replication")["role"] == "master")


async def test_primary_killed_wait_still_returns_once(own_cluster: RedisClusterNodes) -> None:
    """The prompt was replicated before the kill (replication is asynchronous: a write not yet
    on the replica would be lost), so the promoted replica holds it; the held wait's bell
    connection fails, the waiter refreshes the slot map, resubscribes on the new primary and
    re-reads; the answer posted there returns the wait, once."""
    settings = Settings(key_prefix="f" + uuid.uuid4().hex[:8], sweep_interval=60)
    async with Broker.from_url(own_cluster.url, settings, cluster=True) as b:
        await b.redis.initialize()  # type: ignore[attr-defined]
        start = own_cluster.nodes[0].port
        # A thread whose slot is not on the node the URL names (the client's first contact).
        thread = next(
            f"t{i}"
            for i in range(100)
            if b.redis.get_node_from_key(b.thread(f"t{i}").items).port != start  # type: ignore[attr-defined]
        )
        node = b.redis.get_node_from_key(b.thread(thread).items)  # type: ignore[attr-defined]
        p = await b.ask(thread, "text", [Question(question="Name?")])
        waiting = asyncio.create_task(b.wait(thread, p.prompt_id, timeout=60))
        await asyncio.sleep(0.5)  # replicated by now; the wait is subscribed
        victim = next(n for n in own_cluster.nodes if n.port == node.port)
        victim.kill()
        deadline = time.monotonic() + 30
        while True:  # a surface retrying its answer until the promoted replica takes it
            try:
                routed = await b.post_item(thread, {"content": [{"type": "text", "text": "Ann"}]})
                break
            except BrokerError:
                assert time.monotonic() < deadline, "no primary took the slot in 30 s"
                await asyncio.sleep(0.5)
        assert routed.outcome == "answered"
        answers = await asyncio.wait_for(waiting, 30)
        assert [a.answer for a in answers] == [["Ann"]]
        new = b.redis.get_node_from_key(b.thread(thread).items)  # type: ignore[attr-defined]
        assert new.port != victim.port and _primary_of(own_cluster, new.port)
        await b.settle()
        assert (await b.get_prompt(thread, p.prompt_id)).delivered_at is not None
