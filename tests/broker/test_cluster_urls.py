"""A Redis Cluster URL naming several nodes (broker/_cluster.py): a process finds the cluster
while the first node it names is down, through the library and the CLI; a node that is not
`host:port` is a clear error."""

from __future__ import annotations

import os
import uuid

import pytest

from broker import Broker, Settings
from broker._cluster import seeds
from broker.models import Question
from tests.conftest import RedisClusterNodes
from tests.helpers import cli
from workers.runtime.redis_server import free_port


def test_seeds_split_a_url_naming_several_nodes() -> None:
    assert seeds("redis://127.0.0.1:7000/0") == ("redis://127.0.0.1:7000/0", [])
    first, others = seeds("redis://u:p%40ss@a.example:7000,b.example:7001,[::1]:7002/0?x=1")
    assert first == "redis://u:p%40ss@a.example:7000/0?x=1"
    assert others == [("b.example", 7001), ("::1", 7002)]
    for bad in ("redis://a:1,b", "redis://a:1,:7001", "redis://a:1,b:port", "redis://a:1,b:0"):
        with pytest.raises(ValueError, match="is not a cluster node"):
            seeds(bad)


@pytest.mark.real_redis
async def test_a_broker_finds_the_cluster_past_a_dead_first_node(
    redis_cluster: RedisClusterNodes,
) -> None:
    live = ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster.nodes[:2])
    url = f"redis://127.0.0.1:{free_port()},{live}"  # nothing listens on the first
    settings = Settings(key_prefix="u" + uuid.uuid4().hex[:8])
    async with Broker.from_url(url, settings, cluster=True) as b:
        p = await b.ask("t1", "text", [Question(question="Name?")])
        await b.post_item("t1", {"author": "bob", "content": [{"type": "text", "text": "Ann"}]})
        answers = await b.wait("t1", p.prompt_id, timeout=10)
        assert [a.answer for a in answers] == [["Ann"]]
        await b.redis.delete(*[k async for k in b.redis.scan_iter(f"{settings.key_prefix}:*")])


@pytest.mark.real_redis
def test_the_cli_takes_several_nodes_and_says_what_is_wrong(
    redis_cluster: RedisClusterNodes,
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    env = clean | {
        "PROMPT_BROKER_REDIS_CLUSTER": "true",
        "PROMPT_BROKER_KEY_PREFIX": "u" + uuid.uuid4().hex[:8],
        "PROMPT_BROKER_REDIS_URL": f"redis://127.0.0.1:{free_port()},"
        f"127.0.0.1:{redis_cluster.nodes[1].port}",
    }
    run = cli("open", env=env)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    bad = cli("open", env=env | {"PROMPT_BROKER_REDIS_URL": "redis://127.0.0.1:1,nohost"})
    assert bad.returncode == 2
    assert "'nohost' is not a cluster node (host:port)" in bad.stderr
    assert "Traceback" not in bad.stderr


async def test_an_unreachable_cluster_is_a_redis_error() -> None:
    """No node answers: the client raises a RedisError (a connection error), as one server's
    client does, on a command and on a pipeline; a mistake in a call stays redis-py's own."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisClusterException

    from broker._cluster import cluster_client

    client = cluster_client(f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
    try:
        with pytest.raises(RedisConnectionError, match="slot map could not be read"):
            await client.get("k")
        pipe = client.pipeline()
        pipe.get("k")
        with pytest.raises(RedisConnectionError, match="slot map could not be read"):
            await pipe.execute()
        with pytest.raises(RedisClusterException, match="transaction is deprecated"):
            client.pipeline(transaction=True)
    finally:
        await client.aclose()
