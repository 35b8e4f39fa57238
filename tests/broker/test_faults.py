"""Faults on a real redis-server of the test's own: killed pub/sub connections, restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from broker import Broker, Settings
from tests.conftest import RedisServer
from tests.helpers import began_waiting, text, until

# The surface Broker stands for another process: only bells and re-reads wake the waits.
pytestmark = [pytest.mark.real_redis, pytest.mark.usefixtures("surfaces_apart")]

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


@pytest.fixture
async def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory(appendonly=True)


@pytest.fixture
async def brokers(server: RedisServer) -> AsyncIterator[tuple[Broker, Broker]]:
    # The sweep an hour away: what these tests name (the re-read after a resubscription) is the
    # only thing that can pass them.
    settings = Settings(key_prefix="pp", sweep_interval=3600.0)
    agent = Broker(Redis.from_url(server.url, decode_responses=True), settings, owns_client=True)
    surface = Broker(Redis.from_url(server.url, decode_responses=True), settings, owns_client=True)
    yield agent, surface
    await agent.aclose()
    await surface.aclose()


async def open_waits(agent: Broker, n: int) -> list[tuple[str, asyncio.Task[Any]]]:
    waits = []
    for i in range(n):
        p = await agent.ask(f"t{i}", "approval", [APPROVAL])
        waits.append((f"t{i}", asyncio.create_task(agent.wait(f"t{i}", p.prompt_id, timeout=20))))
        await began_waiting(agent, f"t{i}", p.prompt_id)
    return waits


async def kill_pubsub(server: RedisServer) -> int:
    admin = Redis.from_url(server.url, decode_responses=True)
    try:
        return int(await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
    finally:
        await admin.aclose()


async def test_pubsub_killed_then_answers(
    brokers: tuple[Broker, Broker], server: RedisServer
) -> None:
    """CLIENT KILL of the pub/sub connection with 20 waits open: every wait still returns."""
    agent, surface = brokers
    waits = await open_waits(agent, 20)
    assert await kill_pubsub(server) == 1
    # Posted once the waiter is back (every channel subscribed again), so the bells are heard.
    await until(lambda: _resubscribed(agent, [t for t, _ in waits]), "the resubscription")
    for thread, _ in waits:
        await surface.post_item(thread, text("yes"))
    results = await asyncio.gather(*(w for _, w in waits))
    assert all(r[0].answer == ["Approve"] for r in results)
    assert agent._waiter.reconnects >= 1


async def _resubscribed(agent: Broker, threads: list[str]) -> bool:
    counts = await agent.redis.pubsub_numsub(*(agent.thread(t).wake for t in threads))
    return all(n == 1 for _, n in counts)


async def test_answers_while_pubsub_down_are_not_lost(
    brokers: tuple[Broker, Broker], server: RedisServer
) -> None:
    """Answers committed while the waiter is disconnected are read after it resubscribes."""
    agent, surface = brokers
    waits = await open_waits(agent, 20)
    await kill_pubsub(server)
    # Post at once: most of these land before the waiter notices and resubscribes, so their
    # bells ring to nobody. The re-read after resubscription must find them.
    await asyncio.gather(*(surface.post_item(thread, text("no")) for thread, _ in waits))
    results = await asyncio.wait_for(asyncio.gather(*(w for _, w in waits)), 10)
    assert all(r[0].answer == ["Deny"] for r in results)
    assert (
        len(await agent.redis.client_list(_type="pubsub")) == 1
    )  # the agent's; the surface only posts


async def test_redis_restart_keeps_open_prompts(
    brokers: tuple[Broker, Broker], server: RedisServer
) -> None:
    """Redis killed and restarted (AOF on): prompts survive, waits resume, answers land once."""
    agent, surface = brokers
    waits = await open_waits(agent, 10)
    server.restart()
    assert len(await surface.open_prompts()) == 10
    for thread, _ in waits:
        routed = await surface.post_item(thread, text("approve"))
        assert routed.outcome == "answered"
    results = await asyncio.wait_for(asyncio.gather(*(w for _, w in waits)), 15)
    assert all(r[0].answer == ["Approve"] for r in results)
    for thread, _ in waits:
        items = await surface.items(thread)
        assert sum(1 for i in items if i.text == "approve") == 1  # posted once, not twice


async def test_script_cache_flushed(brokers: tuple[Broker, Broker], server: RedisServer) -> None:
    """After SCRIPT FLUSH every script is reloaded on demand, pipelines included."""
    agent, surface = brokers
    p = await agent.ask("t", "approval", [APPROVAL])
    await agent.redis.script_flush()
    await surface.post_item("t", text("yes"))
    await agent.redis.script_flush()
    assert (await agent.wait("t", p.prompt_id, timeout=5))[0].answer == ["Approve"]
    await agent.settle()
    assert (await agent.get_prompt("t", p.prompt_id)).delivered_at is not None


async def test_ask_with_redis_down_is_unavailable(server: RedisServer) -> None:
    """With Redis unreachable, ask says the question was not delivered and nobody refused."""
    from broker import PromptUnavailable

    broker = Broker.from_url(server.url, Settings(key_prefix="pp"))
    server.kill()
    try:
        with pytest.raises(PromptUnavailable) as e:
            await broker.ask("t", "approval", [APPROVAL])
        message = str(e.value)
        assert "could not be delivered" in message and "nobody refused" in message
        assert "retry" in message and "denied" not in message
    finally:
        await broker.aclose()
