"""On a real Redis Cluster (three primaries, a replica each; `redis_cluster` in conftest.py):
every thread script runs in its thread's one slot, retention included; a bell rings on sharded
pub/sub from inside a script to a raw SSUBSCRIBE on the node that owns the slot; the Broker's
whole lifecycle, its audit worker and many bells at once on the cluster; and a cluster nobody
answers for is the Broker's own error. (Every backend-parametrized test runs on this cluster
too: tests/conftest.py `CLUSTER_SCOPE`.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import cast

import orjson
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from broker import Broker, BrokerUnavailable, PromptUnavailable, Settings
from broker._codec import pending_body
from broker._scripts import Scripts
from broker.answers import matchers, prepare
from broker.keys import Keys
from broker.models import Question
from tests.conftest import RedisClusterNodes, free_port
from tests.helpers import answered_and_audited

pytestmark = pytest.mark.real_redis


@pytest.fixture
async def cluster(redis_cluster: RedisClusterNodes) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.url, decode_responses=True)
    await client.initialize()  # the slot map: `get_node_from_key` reads it
    try:
        yield client
    finally:
        await client.aclose()


async def test_thread_scripts_run_in_one_slot_with_retention(cluster: RedisCluster) -> None:
    """ask, route (the answer), prompt, audit, close and cancel (retiring the thread), each in
    one call on the node owning the thread's slot: the keys they build from the thread's base
    (undeclared, but in the same slot) are allowed there."""
    keys = Keys("c" + uuid.uuid4().hex[:8])
    tk = keys.thread("t1")
    scripts = Scripts()
    qs = [Question(question="Name?")]
    await scripts.call(cluster, "create", [tk.session], ["scripted", "approval", "{}", "", ""])
    body = pending_body("prm_01M8RNSQBPNM9B62PHB3V0EV88", "text", qs)
    status, _, _ = await scripts.call(
        cluster,
        "ask",
        [tk.items, tk.active, tk.prompt("prm_01M8RNSQBPNM9B62PHB3V0EV88"), tk.session],
        [
            "prm_01M8RNSQBPNM9B62PHB3V0EV88", "itm_01M8RNSQBPNM9B62PHB3V0EV89", "pb", body,
            "text", orjson.dumps(matchers(qs)), "", tk.base, tk.wake, "", "", 10, 0,
        ],
    )  # fmt: skip
    assert status == "ok"
    prepared = orjson.dumps(prepare("Ann"))
    item = orjson.dumps({"content": [{"type": "text", "text": "Ann"}]})
    routed = await scripts.call(
        cluster,
        "route",
        [tk.items, tk.active, tk.inbox, tk.session],
        [
            "itm_01M8RNSQBPNM9B62PHB3V0EV8A", "ann", "", item, "user", "", "", "", prepared,
            tk.base, tk.wake, "", "1", "0", "cli", "", 10, 0,
        ],
    )  # fmt: skip
    assert routed[0] == "answered"
    flat = await scripts.call(cluster, "prompt", [tk.prompt(routed[2]), tk.items], [])
    assert "_body" in flat
    assert (await scripts.call(cluster, "close", [tk.session], []))[0] == "closed"
    reply = await scripts.call(
        cluster, "cancel", [tk.active, tk.session], ["closed", "", "", tk.base, tk.wake, 5]
    )
    assert reply == ["none", ""]
    assert 0 < await cluster.ttl(tk.items) <= 5
    assert 0 < await cluster.ttl(tk.prompt(routed[2])) <= 5


async def test_a_key_of_another_slot_is_refused(cluster: RedisCluster) -> None:
    """Why every thread key shares one hash tag: a script naming keys of two slots fails."""
    node = cluster.get_node_from_key("a:{x}:1")
    direct = Redis(host=node.host, port=node.port)
    try:
        with pytest.raises(ResponseError, match="CROSSSLOT"):
            await direct.eval("return 1", 2, "a:{x}:1", "a:{y}:1")
    finally:
        await direct.aclose()


async def test_sharded_bell_from_a_script_reaches_the_slots_node(
    cluster: RedisCluster, redis_cluster: RedisClusterNodes
) -> None:
    """The bell a cluster needs: SPUBLISH inside the thread's script (its channel shares the
    thread's hash tag, so the same slot), heard by a raw SSUBSCRIBE on the primary that owns
    the slot. redis-py 5.x (arq 0.28 pins redis < 6) has no sharded pub/sub in asyncio, so
    the waiter is to send SSUBSCRIBE on a connection of its own to that node."""
    tk = Keys("c" + uuid.uuid4().hex[:8]).thread("t2")
    node = cluster.get_node_from_key(tk.wake)
    sub = Redis(host=node.host, port=node.port, decode_responses=True)
    conn = await sub.connection_pool.get_connection()
    try:
        await conn.send_command("SSUBSCRIBE", tk.wake)
        assert await conn.read_response() == ["ssubscribe", tk.wake, 1]
        rung = await cluster.eval(
            "redis.call('SET', KEYS[1], 'x'); return redis.call('SPUBLISH', KEYS[2], ARGV[1])",
            2,
            tk.active,
            tk.wake,
            '{"prompt_id":"p"}',
        )
        assert rung == 1
        msg = await asyncio.wait_for(conn.read_response(), 5)
        assert msg == ["smessage", tk.wake, '{"prompt_id":"p"}']
        # Another primary does not hold the channel: a node that does not own the slot
        # answers SSUBSCRIBE with MOVED, which is how a migrated slot is noticed.
        others = [n.port for n in redis_cluster.nodes if n.port != node.port]
        primaries = [port for port in others if await _is_primary(port)]
        probe = Redis(port=primaries[0])
        try:
            with pytest.raises(ResponseError, match="MOVED"):
                await probe.execute_command("SSUBSCRIBE", tk.wake)
        finally:
            await probe.aclose()
    finally:
        await sub.connection_pool.release(conn)
        await sub.aclose()


async def _is_primary(port: int) -> bool:
    r = Redis(port=port, decode_responses=True)
    try:
        return bool((await r.info("replication"))["role"] == "master")
    finally:
        await r.aclose()


async def test_a_lifecycle_on_the_cluster(redis_cluster: RedisClusterNodes) -> None:
    """`Broker.from_url` with `redis_cluster`: ask, answer, wait, deliver, audit and close with
    retention, on threads spread over the three primaries, the bells on sharded pub/sub."""
    settings = Settings(key_prefix="c" + uuid.uuid4().hex[:8], closed_ttl=30, redis_cluster=True)
    async with Broker.from_url(redis_cluster.url, settings) as b:
        assert isinstance(b.redis, RedisCluster)
        await b.redis.initialize()
        # Two threads on each primary.
        by_node: dict[str, list[str]] = {}
        for i in range(200):
            node = b.redis.get_node_from_key(b.thread(f"t{i}").items).name
            if len(by_node.setdefault(node, [])) < 2:
                by_node[node].append(f"t{i}")
        threads = [t for ts in by_node.values() for t in ts]
        assert len(by_node) == 3 and len(threads) == 6
        for t in threads:
            await b.sessions.create(t, "scripted")
        prompts = [await b.ask(t, "text", [Question(question="Name?")]) for t in threads]
        assert {p.prompt_id for p in await b.open_prompts()} == {p.prompt_id for p in prompts}
        waits = [asyncio.create_task(b.wait(p.thread_id, p.prompt_id, timeout=10)) for p in prompts]
        await asyncio.sleep(0.2)
        # Sharded bells: one connection per primary (not per thread), each channel on its
        # slot's primary. The sweep is 15 s off, so the waits below return by bell alone.
        ps = b._waiter._pubsub
        assert ps is not None and len(ps._conns) == 3  # type: ignore[attr-defined]
        for t in threads:
            node = b.redis.get_node_from_key(b.thread(t).wake)
            direct = Redis(host=node.host, port=node.port, decode_responses=True)
            try:
                counts = await direct.execute_command("PUBSUB", "SHARDNUMSUB", b.thread(t).wake)
            finally:
                await direct.aclose()
            assert counts == [b.thread(t).wake, 1]
        for t in threads:
            routed = await b.post_item(t, {"content": [{"type": "text", "text": f"name {t}"}]})
            assert routed.outcome == "answered"
        answers = await asyncio.gather(*waits)
        assert [a[0].answer for a in answers] == [[f"name {t}"] for t in threads]
        await b.settle()
        for p in prompts:
            assert await b.post_resolution(p.thread_id, p.prompt_id)
        from workers.runtime.agent_store import AgentStore

        store = AgentStore(b, threads[0])
        entries = [{"n": i, "text": "a transcript entry " * 5} for i in range(20)]
        for e in entries:
            await store.append("claude:s", [e])
        assert await store.load("claude:s") == entries
        await b.sessions.close(threads[0])
        assert 0 < await b.redis.ttl(b.thread(threads[0]).agent("claude:s")) <= 30
        assert 0 < await b.redis.ttl(b.thread(threads[0]).items) <= 30
        assert await b.redis.ttl(b.thread(threads[1]).items) == -1
        # The audit jobs: arq's keys and queue share one hash tag, so one primary holds them.
        queue = b.keys.audit_queue
        assert await b.redis.zcard(queue) == len(threads)
        job = "arq:job:" + b.keys.audit_job_id(threads[0], prompts[0].prompt_id)
        assert b.redis.keyslot(job) == b.redis.keyslot(queue)


async def test_the_audit_worker_on_the_cluster(redis_cluster: RedisClusterNodes) -> None:
    """arq works on the one primary owning the audit queue's hash tag: the jobs enqueued for
    answers on every primary are run there, and each thread gets its audit item."""
    settings = Settings(
        key_prefix="c" + uuid.uuid4().hex[:8], redis_cluster=True, redis_url=redis_cluster.url
    )
    await answered_and_audited(settings, [f"a{i}" for i in range(6)])


async def test_many_threads_subscribed_at_once_hear_their_bells(
    redis_cluster: RedisClusterNodes,
) -> None:
    """`listen_many` subscribes 30 threads in one call; on a primary their channels span many
    slots, and SSUBSCRIBE takes one slot at a time: each thread still hears its bell."""
    settings = Settings(key_prefix="c" + uuid.uuid4().hex[:8], sweep_interval=60)
    async with Broker.from_url(redis_cluster.url, settings, cluster=True) as b:
        heard: dict[str, list[object]] = {}
        threads = [f"m{i}" for i in range(30)]
        await b.listen_many(
            {t: (lambda _ch, wake, t=t: heard.setdefault(t, []).append(wake)) for t in threads}
        )
        for t in threads:
            await b.post_item(t, {"content": [{"type": "text", "text": "hello"}]})
        deadline = asyncio.get_running_loop().time() + 10
        while any(not any("queued" in w for w in heard.get(t, [])) for t in threads):  # type: ignore[operator]
            assert asyncio.get_running_loop().time() < deadline, sorted(set(threads) - set(heard))
            await asyncio.sleep(0.05)
        assert b._waiter.reconnects == 0


async def test_a_cluster_nobody_answers_for_is_unavailable(prefix: str) -> None:
    """A cluster client whose nodes all are down cannot make its slot map: redis-py says so with
    its own RedisClusterException; the Broker's calls raise `BrokerUnavailable` (unreachable)
    and an ask `PromptUnavailable`, as on one server, and never redis-py's error."""
    client = RedisCluster.from_url(f"redis://127.0.0.1:{free_port()}", decode_responses=True)
    async with Broker(cast(Redis, client), Settings(key_prefix=prefix), owns_client=True) as b:
        with pytest.raises(BrokerUnavailable) as e:
            await b.open_prompts()
        assert not e.value.refused and "Redis could not be reached" in str(e.value)
        with pytest.raises(PromptUnavailable, match="slot map could not be read"):
            await b.ask("t", "approval", [{"question": "Go?"}])  # as on one server


async def test_a_node_that_is_no_cluster_node_is_refused_clearly(
    real_redis_url: str, prefix: str
) -> None:
    """`redis_cluster` set, but the URL names one plain server: `BrokerUnavailable` (refused,
    nothing written) naming why, not redis-py's RedisClusterException."""
    client = RedisCluster.from_url(real_redis_url.rsplit("/", 1)[0], decode_responses=True)
    async with Broker(cast(Redis, client), Settings(key_prefix=prefix), owns_client=True) as b:
        with pytest.raises(BrokerUnavailable) as e:
            await b.open_prompts()
    assert e.value.refused and "Cluster mode is not enabled" in str(e.value)
