"""The HTTP API on the session's Redis Cluster (`redis_cluster` in conftest.py): the open
prompts, an answer posted, and `GET /v1/threads` paging through every primary's keyspace (a
cluster has a SCAN cursor per primary, not one)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from broker import Broker, Question, Settings
from tests.conftest import RedisClusterNodes
from web.app import create_app
from web.settings import ApiSettings, Identity
from web.testing import serving

pytestmark = pytest.mark.real_redis

TOKEN = "alice-token-0123456789"


@pytest.fixture
async def cluster_broker(redis_cluster: RedisClusterNodes) -> AsyncIterator[Broker]:
    settings = Settings(key_prefix="h" + uuid.uuid4().hex[:8])
    async with Broker.from_url(redis_cluster.url, settings, cluster=True) as b:
        yield b


@pytest.fixture
async def http(cluster_broker: Broker) -> AsyncIterator[httpx.AsyncClient]:
    alice = Identity.model_validate({"name": "alice", "token": TOKEN, "scopes": ["read", "answer"]})
    app = create_app(ApiSettings(tokens=(alice,)), broker=cluster_broker)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=headers) as client:
        yield client


async def test_threads_page_through_every_primary(
    http: httpx.AsyncClient, cluster_broker: Broker
) -> None:
    b = cluster_broker
    assert isinstance(b.redis, RedisCluster)
    threads = {f"t{i}" for i in range(12)}
    for t in threads:
        await b.post_item(t, {"content": [{"type": "text", "text": "hello"}]})
    await b.redis.initialize()
    assert len({b.redis.get_node_from_key(b.thread(t).items).name for t in threads}) == 3
    seen: list[str] = []
    cursor: str | None = None
    for _ in range(100):
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        r = await http.get("/v1/threads", params=params)
        assert r.status_code == 200, r.text
        seen += [t["thread_id"] for t in r.json()["threads"]]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(threads)  # each once
    r = await http.get("/v1/threads", params={"cursor": "WzksMF0"})  # [9,0]: no such primary
    assert r.status_code == 422  # as a bad cursor on one server


async def test_prompts_and_an_answer(http: httpx.AsyncClient, cluster_broker: Broker) -> None:
    b = cluster_broker
    p = await b.ask("a1", "text", [Question(question="Name?")])
    r = await http.get("/v1/prompts")
    assert [x["prompt_id"] for x in r.json()["prompts"]] == [p.prompt_id]
    r = await http.post("/v1/threads/a1/items", json={"content": [{"type": "text", "text": "Ann"}]})
    assert r.status_code in (200, 201), r.text
    assert r.json()["outcome"] == "answered"
    assert (await b.get_prompt("a1", p.prompt_id)).state == "answered"
