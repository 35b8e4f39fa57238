"""The HTTP API on the session's Redis Cluster (`redis_cluster` in conftest.py): the open
prompts, an answer posted, and `GET /v1/threads` paging through every primary's keyspace (a
cluster has a SCAN cursor per primary, not one)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from broker import Broker, Question, Settings
from tests.conftest import RedisClusterNodes
from tests.web.test_web_events import said
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


async def test_webhooks_on_the_cluster(cluster_broker: Broker) -> None:
    """The webhook dispatcher's arq queue and jobs share arq's hash tag, so arq works on the one
    primary owning it: a prompt's opening and its answer reach the subscriber, once each."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from web.receiver import Receiver
    from web.webhooks import Webhook

    b = cluster_broker
    secret = "hook-secret-0123456789"
    receiver = Receiver(secret, "http://inbox.example")
    target = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    admin = Identity.model_validate({"name": "root", "token": TOKEN, "scopes": ["admin"]})
    async with serving(target) as hook_base:
        hook = Webhook(id="chat", url=f"{hook_base}/hook", secret=secret)
        app = create_app(
            ApiSettings(tokens=(admin,), webhooks=(hook,)),
            broker=b,
            webhook_options={"retry_delay": 0.1},
        )
        async with serving(app):
            p = await b.ask("w1", "approval", [Question(question="Deploy?")])
            await said(receiver, 1, "the opening")  # answered once the chat asked
            await b.post_item("w1", {"author": "bob", "content": [{"type": "text", "text": "1"}]})
            for _ in range(200):
                if len(receiver.messages) >= 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a duplicate, if any, would be in by now
    link = f"http://inbox.example/#/threads/w1/prompts/{p.prompt_id}"
    assert receiver.messages == [
        f"[w1] a approval waits on you: answer at {link}",
        f"[w1] answered by bob ({link})",
    ]
    queue = b.redis.keyslot(f"{b.keys.audit_slot}{b.keys.prefix}:webhooks:queue")  # type: ignore[attr-defined]
    assert queue == b.redis.keyslot("arq:abort")  # type: ignore[attr-defined]
