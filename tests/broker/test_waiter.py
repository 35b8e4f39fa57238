"""The waiter never goes deaf, and each of its reads is tested on its own.

The sweep (the slow re-read of every wait) would hide a missing read, so every test here that
names another read runs with the sweep an hour away: only the behaviour it names can pass it.
Faults use a real redis-server of the test's own: `CLIENT KILL`, an ACL user switched off so the
pub/sub connection cannot come back, and SIGSTOP of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from broker import Broker, BrokerUnavailable, Settings
from tests.conftest import BrokerFactory, RedisServer
from tests.helpers import began_waiting, numsub, text, until

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
NEVER = 3600.0  # a sweep interval far beyond every test's time limit

# The surface Brokers stand for other processes: a post hands no answer over on its own loop.
pytestmark = pytest.mark.usefixtures("surfaces_apart")


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Everything the event loop would log as unhandled ("Task exception was never retrieved",
    ...); the test asserts it is empty."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    loop.set_exception_handler(previous)


async def no_loop_errors(seen: list[dict[str, Any]]) -> None:
    gc.collect()  # an unretrieved task exception is reported when the task is collected
    await asyncio.sleep(0)
    assert [c.get("message") for c in seen] == []


# -- the read after subscribing ----------------------------------------------------------


async def test_read_after_subscribing_when_the_channel_is_already_subscribed(
    make_broker: BrokerFactory,
) -> None:
    """The thread's channel is already subscribed (a listener holds it) and the answer landed
    before the wait began: the wait's own read of the record is all that can find it."""
    agent = await make_broker(sweep_interval=NEVER)
    surface = await make_broker()
    heard: list[Any] = []
    await agent.listen("t", lambda _c, wake: heard.append(wake))
    p = await surface.ask("t", "approval", [APPROVAL])  # another Broker: the agent expects nothing
    await surface.post_item("t", text("yes"))
    await until(lambda: _truthy(any(w.get("state") == "answered" for w in heard)), "the bell")
    answers = await agent.wait("t", p.prompt_id, timeout=3)
    assert answers[0].answer == ["Approve"]


async def _truthy(value: bool) -> bool:
    return value


async def test_a_channel_made_again_never_reuses_a_confirmation(
    make_broker: BrokerFactory,
) -> None:
    """A prompt asked while its channel was subscribed, whose channel was then dropped as idle
    and answered while nobody listened: the new subscription must not pass for the old one, or
    the wait would skip its read."""
    agent = await make_broker(sweep_interval=NEVER)
    surface = await make_broker()
    p = await agent.ask("t", "approval", [APPROVAL])
    channel = agent.thread("t").wake
    await until(lambda: _is(numsub(surface.redis, channel), 1), "the subscription")
    agent._waiter._channels[channel].idle_since -= 2 * NEVER  # idle for long enough
    await agent._waiter._sweep()  # drops it
    assert channel not in agent._waiter._channels
    await until(lambda: _is_zero(numsub(surface.redis, channel)), "the unsubscription")
    await surface.post_item("t", text("yes"))  # its bell rings to nobody
    assert (await agent.wait("t", p.prompt_id, timeout=3))[0].answer == ["Approve"]


async def _is_zero(n: Any) -> bool:
    return await n == 0


async def _is(n: Awaitable[int], expected: int) -> bool:
    return await n == expected


# -- faults on a server of our own -------------------------------------------------------


@pytest.fixture
async def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory(appendonly=False)


class Rig:
    """An agent Broker whose pub/sub connection logs in as its own ACL user (so the test can
    keep it from coming back), a surface Broker, and an admin client."""

    def __init__(self, server: RedisServer, sweep: float) -> None:
        self.server = server
        self.user = "waiter" + uuid.uuid4().hex[:6]
        self.name = "pb-waiter-" + uuid.uuid4().hex[:8]
        self.admin = Redis.from_url(server.url, decode_responses=True)
        settings = Settings(key_prefix="pp", sweep_interval=sweep)
        pubsub = Redis(
            host="127.0.0.1",
            port=server.port,
            username=self.user,
            password="pw",
            decode_responses=True,
            client_name=self.name,
        )
        self.agent = Broker(
            Redis.from_url(server.url, decode_responses=True),
            settings,
            owns_client=True,
            pubsub=pubsub,
        )
        self.surface = Broker(
            Redis.from_url(server.url, decode_responses=True), settings, owns_client=True
        )

    async def user_on(self, on: bool) -> None:
        await self.admin.execute_command(
            "ACL", "SETUSER", self.user, "on" if on else "off", ">pw", "~*", "&*", "+@all"
        )

    async def cut(self) -> None:
        """Drop the agent's pub/sub connection and keep it from logging in again."""
        await self.user_on(False)
        await self.admin.execute_command("CLIENT", "KILL", "USER", self.user)

    async def subscriptions(self) -> int:
        """How many channels the agent's own pub/sub connection is subscribed to."""
        clients = await self.admin.client_list(_type="pubsub")
        return sum(int(c["sub"]) for c in clients if c.get("name") == self.name)

    async def pubsub_connections(self) -> int:
        clients = await self.admin.client_list(_type="pubsub")
        return sum(1 for c in clients if c.get("name") == self.name)

    async def aclose(self) -> None:
        await self.agent.aclose()
        await self.surface.aclose()
        await self.admin.aclose()


@pytest.fixture
async def make_rig(server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    rigs: list[Rig] = []

    async def make(sweep: float) -> Rig:
        rig = Rig(server, sweep)
        await rig.user_on(True)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.aclose()


@pytest.mark.real_redis
async def test_reread_after_resubscription(
    make_rig: Callable[..., Any], loop_errors: list[dict[str, Any]]
) -> None:
    """Answers committed while the pub/sub connection is down (proved down: nobody is
    subscribed when they are posted) are found by the re-read after the resubscription."""
    rig = await make_rig(NEVER)
    prompts = [await rig.agent.ask(f"t{i}", "approval", [APPROVAL]) for i in range(5)]
    waits = [asyncio.create_task(rig.agent.wait(p.thread_id, p.prompt_id)) for p in prompts]
    channels = [rig.agent.thread(p.thread_id).wake for p in prompts]
    await until(lambda: _all_subscribed(rig, channels), "the waits' subscriptions")
    await rig.cut()
    for channel in channels:
        assert await numsub(rig.admin, channel) == 0
    for p in prompts:
        await rig.surface.post_item(p.thread_id, text("no"))
    await asyncio.sleep(0.3)  # negative window: the waiter keeps failing to log in meanwhile
    assert not any(w.done() for w in waits)
    await rig.user_on(True)
    results = await asyncio.wait_for(asyncio.gather(*waits), 8)
    assert all(r[0].answer == ["Deny"] for r in results)
    assert rig.agent._waiter.reconnects >= 1
    assert await rig.pubsub_connections() == 1
    await no_loop_errors(loop_errors)


async def test_a_burst_of_bells_wakes_every_wait_with_its_own_answer(
    make_broker: BrokerFactory, backend: str
) -> None:
    """Bells that arrive together are handed out from what was read in already: each of 300
    waits (the sweep an hour away: only the bells can wake them) returns its own prompt's
    answer, and on a real server the reader needed far fewer reads than it had bells."""
    agent = await make_broker(sweep_interval=NEVER)
    surface = await make_broker()
    prompts = [await agent.ask(f"t{i}", "approval", [APPROVAL]) for i in range(300)]
    waits = [asyncio.create_task(agent.wait(p.thread_id, p.prompt_id)) for p in prompts]
    for p in prompts:
        await began_waiting(agent, p.thread_id, p.prompt_id)
    ps: Any = agent._waiter._pubsub
    # Socket reads, counted where every way of reading comes (get_message, `read_message`).
    stream = getattr(ps.connection, "_reader", None)
    reads = _count_calls(stream, "read") if stream is not None else []
    words = ["yes" if i % 2 else "no" for i in range(len(prompts))]
    posts = [surface.post_item(p.thread_id, text(w)) for p, w in zip(prompts, words, strict=True)]
    await asyncio.gather(*posts)
    results = await asyncio.wait_for(asyncio.gather(*waits), 10)
    assert [r[0].answer for r in results] == [
        ["Approve"] if w == "yes" else ["Deny"] for w in words
    ]
    if backend != "fake":  # fakeredis's connection has no hiredis reader to hand them out
        assert 0 < len(reads) < len(prompts) / 2


@pytest.mark.real_redis
@pytest.mark.parametrize("health_checks", [0, 1])
async def test_bells_are_read_off_the_parser_unless_health_checks_are_sent(
    server: RedisServer, health_checks: int, loop_errors: list[dict[str, Any]]
) -> None:
    """On a real server the reader takes its bells straight off the connection's parser
    (`read_message`: no get_message); a connection that sends health checks (only get_message
    sends them) is read with get_message. Either way, with the sweep an hour away, every wait
    gets its own answer, also after an idle longer than the health check interval."""
    settings = Settings(key_prefix="pp", sweep_interval=NEVER)
    pubsub = Redis.from_url(server.url, decode_responses=True, health_check_interval=health_checks)
    agent = Broker(
        Redis.from_url(server.url, decode_responses=True),
        settings,
        owns_client=True,
        pubsub=pubsub,
    )
    surface = Broker(Redis.from_url(server.url, decode_responses=True), settings, owns_client=True)
    gets: list[int] = []
    try:
        for i in range(6):
            if i == 3:
                await asyncio.sleep(1.3)  # idle past the interval: a health check is due
            p = await agent.ask(f"t{i}", "approval", [APPROVAL])
            waiting = asyncio.create_task(agent.wait(p.thread_id, p.prompt_id))
            await began_waiting(agent, p.thread_id, p.prompt_id)
            if i == 0:
                gets = _count_calls(agent._waiter._pubsub, "get_message")
            await surface.post_item(p.thread_id, text("yes" if i % 2 else "no"))
            (answer,) = await asyncio.wait_for(waiting, 5)
            assert answer.answer == (["Approve"] if i % 2 else ["Deny"])
        assert agent._waiter.reconnects == 0
        assert (len(gets) > 0) == bool(health_checks), len(gets)
    finally:
        await agent.aclose()
        await surface.aclose()
    await no_loop_errors(loop_errors)


def _count_calls(obj: Any, name: str) -> list[int]:
    """Patch `obj.name` (a coroutine method) to note each call in the list returned."""
    calls: list[int] = []
    original = getattr(obj, name)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return await original(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


async def _all_subscribed(rig: Rig, channels: list[str]) -> bool:
    return all([await numsub(rig.admin, c) == 1 for c in channels])


@pytest.mark.real_redis
async def test_sweep_runs_while_the_reader_cannot_reconnect(
    make_rig: Callable[..., Any], loop_errors: list[dict[str, Any]]
) -> None:
    """The periodic re-read does not depend on the reader: with the pub/sub connection kept
    down, an answer still reaches its wait within a few sweep intervals."""
    rig = await make_rig(0.3)
    p = await rig.agent.ask("t", "approval", [APPROVAL])
    waiting = asyncio.create_task(rig.agent.wait("t", p.prompt_id))
    await until(lambda: _all_subscribed(rig, [rig.agent.thread("t").wake]), "the subscription")
    await rig.cut()
    await rig.surface.post_item("t", text("yes"))
    assert (await asyncio.wait_for(waiting, 3))[0].answer == ["Approve"]
    assert await rig.pubsub_connections() == 0  # it really was the sweep
    await no_loop_errors(loop_errors)


@pytest.mark.real_redis
async def test_subscription_cancelled_while_it_connects_then_pubsub_killed(
    make_rig: Callable[..., Any], server: RedisServer, loop_errors: list[dict[str, Any]]
) -> None:
    """A wait times out while its subscription is still connecting (the server is stopped), then
    the pub/sub connection is killed: the waiter recovers, and later answers still arrive, with
    the sweep an hour away."""
    rig = await make_rig(NEVER)
    first = await rig.surface.ask("a", "approval", [APPROVAL])  # the agent has no note of it
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            await rig.agent.wait("a", first.prompt_id, timeout=0.5)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    await until(rig.pubsub_connections, "the subscription made after all")
    assert await rig.admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub") >= 1
    second = await rig.agent.ask("b", "approval", [APPROVAL])
    waits = [
        asyncio.create_task(rig.agent.wait("a", first.prompt_id)),
        asyncio.create_task(rig.agent.wait("b", second.prompt_id)),
    ]
    await began_waiting(rig.agent, "a", first.prompt_id)
    await began_waiting(rig.agent, "b", second.prompt_id)
    await rig.surface.post_item("a", text("yes"))
    await rig.surface.post_item("b", text("no"))
    a, b = await asyncio.wait_for(asyncio.gather(*waits), 8)
    assert a[0].answer == ["Approve"] and b[0].answer == ["Deny"]
    assert await rig.pubsub_connections() == 1
    await no_loop_errors(loop_errors)


@pytest.mark.real_redis
async def test_wait_with_redis_down_is_unavailable(server: RedisServer) -> None:
    broker = Broker.from_url(server.url, Settings(key_prefix="pp"))
    p = await broker.ask("t", "approval", [APPROVAL])
    server.kill()
    fresh = Broker.from_url(server.url, Settings(key_prefix="pp"))
    try:
        with pytest.raises(BrokerUnavailable):
            await fresh.wait("t", p.prompt_id, timeout=3)
    finally:
        await fresh.aclose()
        await broker.aclose()


@pytest.mark.real_redis
async def test_pubsub_killed_over_and_over_while_waits_subscribe_and_are_cancelled(
    make_rig: Callable[..., Any], loop_errors: list[dict[str, Any]]
) -> None:
    """`CLIENT KILL` of the waiter's pub/sub connection, again and again, while waits start
    subscribing and are cancelled at random points of that: afterwards the waiter is whole, one
    connection, every later answer arrives (the sweep an hour away), and nothing is left for the
    event loop to complain about."""
    rng = random.Random(7)
    rig = await make_rig(NEVER)
    prompts = [await rig.surface.ask(f"s{i}", "approval", [APPROVAL]) for i in range(12)]
    stop = asyncio.Event()

    async def killer() -> int:
        kills = 0
        while not stop.is_set():
            kills += int(await rig.admin.execute_command("CLIENT", "KILL", "USER", rig.user))
            await asyncio.sleep(rng.uniform(0, 0.02))
        return kills

    killing = asyncio.create_task(killer())
    for i in range(60):
        p = prompts[i % len(prompts)]
        started = asyncio.create_task(rig.agent.wait(p.thread_id, p.prompt_id))
        await asyncio.sleep(rng.uniform(0, 0.01))
        started.cancel()
        with contextlib.suppress(asyncio.CancelledError, BrokerUnavailable):
            await started
    stop.set()
    assert await killing > 0
    waits = [asyncio.create_task(rig.agent.wait(p.thread_id, p.prompt_id)) for p in prompts]
    await until(lambda: _is(rig.subscriptions(), len(prompts)), "every wait's subscription")
    for p in prompts:
        await rig.surface.post_item(p.thread_id, text("yes"))
    results = await asyncio.wait_for(asyncio.gather(*waits), 8)
    assert all(r[0].answer == ["Approve"] for r in results)
    assert await rig.pubsub_connections() == 1
    await no_loop_errors(loop_errors)
