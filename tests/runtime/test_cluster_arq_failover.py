"""kill -9 of the Redis Cluster primary that holds arq's queues (the slot of `{arq:abort}`), its
replica promoted: the audit worker (a real process) and the webhook dispatcher go on working on
the new primary without a restart. Each test has a cluster of its own (it kills a node).

The worst case is taken: the node the URL names, the only one the audit worker was told about,
is the one that dies.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import redis

from broker import Broker, BrokerError, Settings
from broker.models import Question
from tests.conftest import RedisClusterNodes, RedisServer
from tests.helpers import process, until
from web.receiver import Receiver
from web.testing import serving

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]


def _arq_primary(cluster: RedisClusterNodes) -> RedisServer:
    """The primary owning the slot of arq's keys (`{arq:abort}`)."""
    slot = redis.Redis(port=cluster.nodes[0].port).cluster("keyslot", "{arq:abort}")
    for node in cluster.nodes:
        client = redis.Redis(port=node.port)
        if client.info("replication")["role"] != "master":
            continue
        owned = client.cluster("slots")
        if any(start <= slot <= end and nodes[0][1] == node.port for start, end, *nodes in owned):
            return node
    raise AssertionError("no primary owns the slot of {arq:abort}")


def _promoted(cluster: RedisClusterNodes, dead: RedisServer) -> bool:
    """A live node says the slot of `{arq:abort}` is owned by a primary other than `dead`."""
    for node in cluster.nodes:
        if node is dead:
            continue
        try:
            client = redis.Redis(port=node.port, socket_timeout=1)
            slot = client.cluster("keyslot", "{arq:abort}")
            for start, end, *nodes in client.cluster("slots"):
                if start <= slot <= end:
                    return bool(nodes[0][1] != dead.port)
        except redis.RedisError:
            continue
    return False


async def _failed_over(cluster: RedisClusterNodes, victim: RedisServer) -> None:
    """Kill -9 `victim`, then wait until its replica owns the slot of `{arq:abort}`."""
    await asyncio.sleep(0.5)  # the queue's writes reach the replica
    victim.kill()
    await until(lambda: asyncio.to_thread(_promoted, cluster, victim), "the replica promoted", 30)


async def _answered(b: Broker, thread: str, text: str) -> str:
    """Ask, answer (retried while the slot has no primary), wait: the prompt's id."""
    p = await b.ask(thread, "text", [Question(question="Name?")])
    deadline = time.monotonic() + 30
    while True:
        try:
            await b.post_item(
                thread, {"author": "bob", "content": [{"type": "text", "text": text}]}
            )
            break
        except BrokerError:
            assert time.monotonic() < deadline, "no primary took the thread's slot in 30 s"
            await asyncio.sleep(0.5)
    await b.wait(thread, p.prompt_id, timeout=30)
    await b.settle()  # its delivery recorded and its audit job enqueued
    return p.prompt_id


async def _audited(b: Broker, thread: str, prompt_id: str) -> bool:
    return (await b.get_prompt(thread, prompt_id)).audit_item_id is not None


async def test_the_audit_worker_goes_on_after_a_failover_of_arqs_primary(
    own_cluster: RedisClusterNodes,
) -> None:
    victim = _arq_primary(own_cluster)
    prefix = "af" + uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")} | {
        "PROMPT_BROKER_REDIS_URL": victim.url.removesuffix("/0"),  # the node that will die
        "PROMPT_BROKER_REDIS_CLUSTER": "true",
        "PROMPT_BROKER_KEY_PREFIX": prefix,
        "PROMPT_BROKER_OPS_PORT": "0",
    }
    settings = Settings(key_prefix=prefix, sweep_interval=60)
    others = next(n for n in own_cluster.nodes if n is not victim)
    async with Broker.from_url(others.url.removesuffix("/0"), settings, cluster=True) as b:
        with process(["audit"], env) as worker:
            first = await _answered(b, "t1", "Ann")
            await until(lambda: _audited(b, "t1", first), "the first audit", within=30)
            await _failed_over(own_cluster, victim)
            second = await _answered(b, "t2", "Bob")
            await until(lambda: _audited(b, "t2", second), "the audit after the failover", 40)
            assert worker.poll() is None, "the audit worker stopped"
            for thread in ("t1", "t2"):
                await asyncio.sleep(1)  # a second posting, if any, would be in by now
                kinds = [i.type for i in await b.items(thread)]
                assert kinds.count("pending_prompt_resolved") == 1, (thread, kinds)


async def test_webhooks_go_on_after_a_failover_of_arqs_primary(
    own_cluster: RedisClusterNodes,
) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Route

    from web.app import create_app
    from web.settings import ApiSettings, Identity
    from web.webhooks import Webhook

    victim = _arq_primary(own_cluster)
    others = next(n for n in own_cluster.nodes if n is not victim)
    settings = Settings(key_prefix="wf" + uuid.uuid4().hex[:8], sweep_interval=60)
    secret = "hook-secret-0123456789"
    receiver = Receiver(secret, "http://inbox")
    target = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    admin = Identity.model_validate(
        {"name": "root", "token": "root-token-0123456789", "scopes": ["admin"]}
    )
    async with (
        Broker.from_url(others.url.removesuffix("/0"), settings, cluster=True) as b,
        serving(target) as hook_base,
    ):
        hook = Webhook(id="chat", url=f"{hook_base}/hook", secret=secret)
        app = create_app(
            ApiSettings(tokens=(admin,), webhooks=(hook,)),
            broker=b,
            webhook_options={"retry_delay": 0.2},
        )
        async with serving(app):
            first = await b.ask("t1", "approval", [Question(question="Deploy?")])
            await until(lambda: _said(receiver, first.prompt_id), "the first opening", 30)
            await _failed_over(own_cluster, victim)
            deadline = time.monotonic() + 30
            while True:  # the thread's slot may have been on the dead primary too
                try:
                    second = await b.ask("t2", "approval", [Question(question="Again?")])
                    break
                except BrokerError:
                    assert time.monotonic() < deadline, "no primary took t2's slot in 30 s"
                    await asyncio.sleep(0.5)
            await until(lambda: _said(receiver, second.prompt_id), "the opening after", 40)
    assert sum(second.prompt_id in m for m in receiver.messages) == 1


async def _said(receiver: Receiver, prompt_id: str) -> bool:
    return any(prompt_id in m for m in receiver.messages)
