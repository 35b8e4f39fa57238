"""PROMPT_BROKER_WAIT_REPLICAS on the session's Redis Cluster (a replica per primary): an
answer's commit (route.lua) is followed by `WAIT n timeout` on the same connection, so a post
that returns has its answer on n replicas; one that cannot get them raises `BrokerUnavailable`
with `took_effect=True` (the answer is on the primary and delivered, but a failover now could
lose it). A replica is paused (SIGSTOP) for under a second: not long enough to fail over.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis
from redis.asyncio.cluster import RedisCluster

from broker import Broker, BrokerError, BrokerUnavailable, Settings
from broker.models import Question
from tests.conftest import RedisClusterNodes, start_cluster
from tests.helpers import began_waiting, text, truthy, until
from workers.runtime.redis_server import RedisServer

pytestmark = pytest.mark.real_redis


def _replica_of(cluster: RedisClusterNodes, port: int) -> RedisServer:
    primary = Redis(port=port, decode_responses=True)
    me = primary.execute_command("CLUSTER", "MYID")
    [line] = primary.execute_command("CLUSTER", "REPLICAS", me)
    replica_port = int(line.split()[1].split("@")[0].rsplit(":", 1)[1])
    return next(n for n in cluster.nodes if n.port == replica_port)


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def _asked(b: Broker, thread: str) -> tuple[str, asyncio.Task[object]]:
    await b.sessions.create(thread, "scripted")
    p = await b.ask(thread, "text", [Question(question="Name?")])
    waiting: asyncio.Task[object] = asyncio.create_task(b.wait(thread, p.prompt_id, timeout=20))
    await began_waiting(b, thread, p.prompt_id)
    return p.prompt_id, waiting


def _online(primary: RedisServer) -> bool:
    info = Redis(port=primary.port).info("replication")
    return bool(info.get("slave0", {}).get("state") == "online")


def _replica_state(replica: RedisServer, key: str) -> str | None:
    r = Redis(port=replica.port, decode_responses=True)
    r.execute_command("READONLY")  # read a replica's copy of the slot
    return r.hget(key, "state")  # type: ignore[return-value]


async def test_an_answer_returns_once_a_replica_has_it(redis_cluster: RedisClusterNodes) -> None:
    settings = Settings(key_prefix="w" + uuid.uuid4().hex[:8], wait_replicas=1, wait_timeout=2)
    async with Broker.from_url(redis_cluster.url, settings, cluster=True) as b:
        assert isinstance(b.redis, RedisCluster)
        for thread in ("t1", "t2", "t3", "t4"):  # over several primaries
            prompt_id, waiting = await _asked(b, thread)
            replica = _replica_of(
                redis_cluster, b.redis.get_node_from_key(b.thread(thread).items).port
            )
            routed = await b.post_item(thread, text("Ann"))
            assert routed.outcome == "answered"
            # Read at once from the replica: WAIT returned, so it has the answer already.
            assert _replica_state(replica, b.thread(thread).prompt(prompt_id)) == "answered"
            assert await waiting
        # A plain message (nothing to answer) is not waited on, and neither fails.
        assert (await b.post_item("t1", text("thanks"))).outcome == "queued"


async def test_an_unconfirmed_answer_says_so(redis_cluster: RedisClusterNodes) -> None:
    """The replica paused: the post raises after `wait_timeout`, took_effect=True; the answer
    is committed on the primary and the wait has it, once."""
    settings = Settings(key_prefix="w" + uuid.uuid4().hex[:8], wait_replicas=1, wait_timeout=0.3)
    async with Broker.from_url(redis_cluster.url, settings, cluster=True) as b:
        assert isinstance(b.redis, RedisCluster)
        prompt_id, waiting = await _asked(b, "u1")
        replica = _replica_of(redis_cluster, b.redis.get_node_from_key(b.thread("u1").items).port)
        loop = asyncio.get_running_loop()
        with paused(replica):
            started = loop.time()
            with pytest.raises(BrokerUnavailable) as unconfirmed:
                await b.post_item("u1", text("Ann"))
            took = loop.time() - started
        assert unconfirmed.value.took_effect is True
        assert "0 of the 1 replicas" in str(unconfirmed.value) and "it took effect" in str(
            unconfirmed.value
        )
        assert 0.3 <= took < 2, took
        assert (await b.get_prompt("u1", prompt_id)).state == "answered"
        answers = await asyncio.wait_for(waiting, 10)
        assert [a.answer for a in answers] == [["Ann"]]  # type: ignore[attr-defined]


async def test_off_by_default_no_wait(redis_cluster: RedisClusterNodes) -> None:
    """WAIT_REPLICAS=0: the post returns at once, the replica paused or not."""
    settings = Settings(key_prefix="w" + uuid.uuid4().hex[:8])
    assert settings.wait_replicas == 0
    async with Broker.from_url(redis_cluster.url, settings, cluster=True) as b:
        assert isinstance(b.redis, RedisCluster)
        _, waiting = await _asked(b, "v1")
        replica = _replica_of(redis_cluster, b.redis.get_node_from_key(b.thread("v1").items).port)
        with paused(replica):
            assert (await b.post_item("v1", text("Ann"))).outcome == "answered"
        assert await waiting


async def test_the_brokers_own_items_are_not_waited_on(redis_cluster: RedisClusterNodes) -> None:
    """An agent's output (the broker's identity) never answers: it is not held up by WAIT, even
    with the replica paused; a person's message is, but only an answer can fail."""
    settings = Settings(key_prefix="w" + uuid.uuid4().hex[:8], wait_replicas=1, wait_timeout=0.5)
    async with Broker.from_url(redis_cluster.url, settings, cluster=True) as b:
        assert isinstance(b.redis, RedisCluster)
        await b.post_item("x1", text("hello"))
        replica = _replica_of(redis_cluster, b.redis.get_node_from_key(b.thread("x1").items).port)
        loop = asyncio.get_running_loop()
        with paused(replica):
            started = loop.time()
            for _ in range(5):
                own = {"author": settings.identity, "content": [{"type": "text", "text": "out"}]}
                assert (await b.post_item("x1", own)).outcome == "posted"
            assert loop.time() - started < 0.5
            assert (await b.post_item("x1", text("a message"))).outcome == "queued"


async def test_wait_on_one_server(redis_server_factory: Callable[..., RedisServer]) -> None:
    """Not only a cluster: on one server WAIT runs on the pipeline's one connection. With no
    replica the answer commits and says it is unconfirmed; with one, it returns."""
    primary = redis_server_factory(appendonly=False)
    settings = Settings(key_prefix="w" + uuid.uuid4().hex[:8], wait_replicas=1, wait_timeout=0.2)
    async with Broker.from_url(primary.url, settings) as b:
        prompt_id, waiting = await _asked(b, "s1")
        with pytest.raises(BrokerUnavailable) as unconfirmed:
            await b.post_item("s1", text("Ann"))
        assert unconfirmed.value.took_effect is True
        assert (await b.get_prompt("s1", prompt_id)).state == "answered"
        assert await waiting
        replica = redis_server_factory(appendonly=False)
        Redis(port=replica.port).replicaof("127.0.0.1", primary.port)
        await until(lambda: truthy(_online(primary)), "the replica in sync", within=20)
    # With the replica there, a timeout a loaded machine always meets (0.2 s did not, once).
    patient = settings.model_copy(update={"wait_timeout": 5.0})
    async with Broker.from_url(primary.url, patient) as b:
        prompt_id, waiting = await _asked(b, "s2")
        assert (await b.post_item("s2", text("Bob"))).outcome == "answered"
        r = Redis(port=replica.port, decode_responses=True)
        assert r.hget(b.thread("s2").prompt(prompt_id), "state") == "answered"
        assert await waiting


@pytest.mark.parametrize("lose", [False, True], ids=["wait-1", "off-replica-behind"])
async def test_a_confirmed_answer_survives_its_primary_killed(tmp_path: Path, lose: bool) -> None:
    """kill -9 of the primary the moment the post returned: its replica is promoted with the
    answer (WAIT covered it, and every write before it on that primary: the question too).
    Without WAIT, a replica that had not yet received the answer is promoted without it."""
    own = start_cluster(tmp_path)
    try:
        wait = {} if lose else {"wait_replicas": 1, "wait_timeout": 2}
        settings = Settings(key_prefix="w" + uuid.uuid4().hex[:8], **wait)
        async with Broker.from_url(own.url, settings, cluster=True) as b:
            assert isinstance(b.redis, RedisCluster)
            await b.redis.initialize()
            first = own.nodes[0].port  # the URL's node: not the one to kill
            thread = next(
                f"k{i}"
                for i in range(100)
                if b.redis.get_node_from_key(b.thread(f"k{i}").items).port != first
            )
            port = b.redis.get_node_from_key(b.thread(thread).items).port
            p = await b.ask(thread, "text", [Question(question="Name?")])
            replica = _replica_of(own, port)
            if lose:  # WAIT off, the replica cut off through the answer: it never gets it
                await asyncio.sleep(0.3)  # the question replicated
                with paused(replica):  # (paused, it cannot reconnect before the kill)
                    Redis(port=port).client_kill_filter(_type="slave")
                    assert (await b.post_item(thread, text("Ann"))).outcome == "answered"
                    next(n for n in own.nodes if n.port == port).kill()
            else:
                assert (await b.post_item(thread, text("Ann"))).outcome == "answered"
                next(n for n in own.nodes if n.port == port).kill()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                try:
                    record = await b.get_prompt(thread, p.prompt_id)
                    break
                except BrokerError:
                    assert loop.time() < deadline, "no replica took over in 30 s"
                    await asyncio.sleep(0.5)
            if lose:  # what a failover can lose: the answer, the prompt pending again
                assert record.state == "pending"
            else:
                assert record.state == "answered" and record.answer_text == "Ann"
            assert b.redis.get_node_from_key(b.thread(thread).items).port != port
    finally:
        own.stop()
