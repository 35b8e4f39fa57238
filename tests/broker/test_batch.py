"""The hot path's coalescing (broker/_batch.py), its ids (broker/_base.py) and its pool check
(broker/client.py): many callers in one turn share a round trip, and each still gets exactly
what a pipeline of its own would have given it."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from ulid import ULID

from broker import Broker, PromptUnavailable, Settings, _base, _batch
from broker._batch import Coalescer
from broker._scripts import Scripts
from tests.conftest import BrokerFactory

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


class Counting(Scripts):
    """Scripts that count the pipelines they send (each one round trip)."""

    def __init__(self, scripts: Scripts) -> None:
        self.by_name = scripts.by_name
        self.sent: list[int] = []

    async def execute(self, redis: Redis, stack: Any, pipe: Any = None) -> list[Any]:
        self.sent.append(len(stack))
        return await super().execute(redis, stack, pipe)


def counting(b: Broker) -> Counting:
    scripts = Counting(b._scripts)
    b._batch = Coalescer(b.redis, scripts)
    return scripts


async def test_asks_and_answers_at_once_share_round_trips(make_broker: BrokerFactory) -> None:
    """Forty threads asking, then answering, at once: far fewer round trips than calls, and
    every thread's prompt is its own, answered with its own words."""
    b = await make_broker()
    threads = [f"t{i}" for i in range(40)]
    # The first ask on a thread waits for its bell's subscription, and those are confirmed one
    # at a time: the asks then go out one by one. Measured on the threads' second prompts.
    for t in threads:
        await b.ask(t, "approval", [APPROVAL])
    sent = counting(b)
    prompts = await asyncio.gather(*(b.ask(t, "approval", [APPROVAL]) for t in threads))
    asked = len(sent.sent)
    words = ["yes" if i % 2 else "no" for i in range(40)]
    routed = await asyncio.gather(
        *(
            b.post_item(t, {"content": [{"type": "text", "text": w}]})
            for t, w in zip(threads, words, strict=True)
        )
    )
    answered = len(sent.sent) - asked
    assert asked < 10 and answered < 10, (asked, answered)
    for p, t, w, r in zip(prompts, threads, words, routed, strict=True):
        assert p.thread_id == t
        assert (r.outcome, r.prompt_id) == ("answered", p.prompt_id)
        assert r.answers is not None and r.answers[0].answer == [
            "Approve" if w == "yes" else "Deny"
        ]
        got = await b.get_prompt(t, p.prompt_id)
        assert got.state == "answered" and got.answers == r.answers


async def test_a_lone_call_goes_out_at_once(make_broker: BrokerFactory) -> None:
    """With nothing else in flight a call is sent from its own task, in the turn it was made:
    nothing is queued for a later turn."""
    b = await make_broker()
    sent = counting(b)
    call = asyncio.ensure_future(b.ask("alone", "approval", [APPROVAL]))
    await asyncio.sleep(0)  # the ask's first step: its checks and its send
    assert b._batch._queued == [] and not b._batch._flushing
    await call
    assert sent.sent == [3]  # the script, the index, the event: one pipeline


async def test_with_two_round_trips_out_what_queues_waits_for_both() -> None:
    """A submission queued while fewer than two round trips are out goes at the end of its turn;
    queued while two are out, it waits until both are back, then everything queued goes as one
    (not one pipeline per turn: on a cluster that broke the batches up)."""
    gates: list[asyncio.Future[None]] = []
    sent: list[list[Any]] = []

    class Gated(Scripts):
        """Each round trip is held until its gate opens; its replies are its commands."""

        async def execute(self, redis: Redis, stack: Any, pipe: Any = None) -> list[Any]:
            sent.append([args[1] for args, _ in stack])
            gates.append(asyncio.get_running_loop().create_future())
            await gates[-1]
            return [args[1] for args, _ in stack]

    batch = Coalescer(Redis(), Gated())

    def submit(name: str) -> asyncio.Future[list[Any]]:
        return asyncio.ensure_future(batch.submit([(("GET", name), {})]))

    async def turns() -> None:  # enough turns of the loop for whatever is due to go out
        for _ in range(6):
            await asyncio.sleep(0)

    first = submit("a")  # alone: out at once
    await turns()
    second = submit("b")  # one out: b goes at the end of its turn
    await turns()
    assert sent == [["a"], ["b"]]
    later = [submit("c"), submit("d")]  # two out: c and d wait
    await turns()
    assert sent == [["a"], ["b"]]
    gates[0].set_result(None)  # one back, one still out: they still wait
    assert await first == ["a"]
    await turns()
    assert sent == [["a"], ["b"]]
    gates[1].set_result(None)  # both back: c and d go, as one
    assert await second == ["b"]
    await turns()
    assert sent == [["a"], ["b"], ["c", "d"]]
    gates[2].set_result(None)
    assert [await f for f in later] == [["c"], ["d"]]
    await batch.aclose()


async def test_round_trips_stuck_out_hold_the_rest_back_briefly() -> None:
    """Two round trips that never end (a dead connection, no read timeout): what queues behind
    them still goes out, `HOLD` later."""
    sent: list[list[Any]] = []

    class Stuck(Scripts):
        async def execute(self, redis: Redis, stack: Any, pipe: Any = None) -> list[Any]:
            sent.append([args[1] for args, _ in stack])
            if len(sent) <= 2:
                await asyncio.Event().wait()  # never
            return [args[1] for args, _ in stack]

    batch = Coalescer(Redis(), Stuck())
    stuck = [asyncio.ensure_future(batch.submit([(("GET", n), {})])) for n in ("a", "b")]
    for _ in range(6):
        await asyncio.sleep(0)
    assert sent == [["a"], ["b"]]
    t0 = time.perf_counter()
    assert await asyncio.wait_for(batch.submit([(("GET", "c"), {})]), 1) == ["c"]
    assert _batch.HOLD <= time.perf_counter() - t0 < 0.5
    for f in stuck:
        f.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)
    for task in list(batch._flushing):
        task.cancel()
    await asyncio.gather(*batch._flushing, return_exceptions=True)


async def test_one_callers_error_is_its_own(make_broker: BrokerFactory) -> None:
    """A command refused in a shared batch raises for its caller only; the others' replies are
    theirs and right."""
    b = await make_broker()
    good = [b._batch.submit([(("SET", f"{b.keys.prefix}:k{i}", str(i)), {})]) for i in range(5)]
    bad = b._batch.submit(
        [(("INCR", f"{b.keys.prefix}:k0"), {}), (("LPUSH", f"{b.keys.prefix}:k1", "x"), {})]
    )
    b._batch._busy += 1  # as if a batch were in flight: these queue for one pipeline
    try:
        results = await asyncio.gather(*good, bad, return_exceptions=True)
    finally:
        b._batch._busy -= 1
    assert results[:5] == [[True]] * 5
    assert isinstance(results[5], ResponseError)
    assert await b.redis.get(f"{b.keys.prefix}:k0") == "1"  # its INCR ran: a pipeline, not MULTI


async def test_lost_scripts_are_loaded_again_in_a_batch(
    make_broker: BrokerFactory, backend: str
) -> None:
    """After the server forgot its scripts (SCRIPT FLUSH: on a cluster, on every primary), a
    batch of asks loads them again and every ask is made, once."""
    b = await make_broker()
    await b.ask("warm", "approval", [APPROVAL])
    if backend == "cluster":
        await b.redis.execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.PRIMARIES)  # type: ignore[no-untyped-call]
    else:
        await b.redis.script_flush()
    assert await b.redis.script_exists(b._scripts.by_name["ask"].sha) == [False]
    prompts = await asyncio.gather(*(b.ask(f"s{i}", "approval", [APPROVAL]) for i in range(10)))
    for i, p in enumerate(prompts):
        assert (await b.get_prompt(f"s{i}", p.prompt_id)).state == "pending"
        entries = await b.redis.xrange(b.thread(f"s{i}").items)
        assert len(entries) == 1


async def test_a_failed_batch_fails_each_of_its_callers(make_broker: BrokerFactory) -> None:
    """The connection failing under a shared batch: every caller in it gets that error (an ask
    then says the prompt could not be asked), none a reply of another, none hangs."""
    b = await make_broker()

    class Broken(Scripts):
        async def execute(self, redis: Redis, stack: Any, pipe: Any = None) -> list[Any]:
            await asyncio.sleep(0)
            raise RedisConnectionError("the connection dropped")

    broken = Broken()
    broken.by_name = b._scripts.by_name
    b._batch = Coalescer(b.redis, broken)
    b._batch._busy += 1
    try:
        raw = await asyncio.gather(
            *(b._batch.submit([(("SET", f"{b.keys.prefix}:x{i}", "v"), {})]) for i in range(4)),
            return_exceptions=True,
        )
        asks = await asyncio.gather(
            *(b.ask(f"f{i}", "approval", [APPROVAL]) for i in range(4)), return_exceptions=True
        )
    finally:
        b._batch._busy -= 1
    assert all(isinstance(r, RedisConnectionError) for r in raw), raw
    assert all(isinstance(r, PromptUnavailable) for r in asks), asks
    assert await b.redis.exists(*(f"{b.keys.prefix}:x{i}" for i in range(4))) == 0


async def test_a_cancelled_caller_does_not_stop_its_batch(make_broker: BrokerFactory) -> None:
    """A caller cancelled while its batch is queued: the batch still runs (its commands with it,
    as a sent pipeline would), and the others get their replies."""
    b = await make_broker()
    b._batch._busy += 1
    try:
        calls = [
            asyncio.ensure_future(b._batch.submit([(("SET", f"{b.keys.prefix}:c{i}", "v"), {})]))
            for i in range(4)
        ]
        await asyncio.sleep(0)
        calls[1].cancel()
        done = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        b._batch._busy -= 1
    assert isinstance(done[1], asyncio.CancelledError)
    assert [done[i] for i in (0, 2, 3)] == [[True]] * 3
    assert await b.redis.exists(*(f"{b.keys.prefix}:c{i}" for i in range(4))) == 4


async def test_closing_waits_for_batches_in_flight(make_broker: BrokerFactory) -> None:
    """aclose() lets a queued batch finish: nothing queued is dropped on the floor."""
    b = await make_broker()
    b._batch._busy += 1
    call = asyncio.ensure_future(b._batch.submit([(("SET", f"{b.keys.prefix}:late", "v"), {})]))
    await asyncio.sleep(0)
    b._batch._busy -= 1
    await b.aclose()
    assert await call == [True]
    assert await b.redis.get(f"{b.keys.prefix}:late") == "v"


# -- ids -----------------------------------------------------------------------------------------


def test_new_ids_are_ulids_of_now() -> None:
    """An id is `prefix_` and a ULID (python-ulid reads it back) of this millisecond."""
    before = time.time_ns() // 1_000_000
    minted = _base._new_id("prm")
    after = time.time_ns() // 1_000_000
    prefix, _, value = minted.partition("_")
    assert prefix == "prm" and len(value) == 26
    parsed = ULID.from_str(value)
    assert str(parsed) == value
    assert before <= parsed.milliseconds <= after


def test_new_ids_encode_as_python_ulid_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """For any time and randomness, the id's text is python-ulid's for the same 128 bits."""
    rng = random.Random(7)
    for _ in range(2000):
        ms, noise = rng.getrandbits(48), rng.getrandbits(80).to_bytes(10, "big")
        monkeypatch.setattr(_base.time, "time_ns", lambda ms=ms: ms * 1_000_000)
        monkeypatch.setattr(_base.os, "urandom", lambda n, noise=noise: noise)
        expected = ULID.from_int(ms << 80 | int.from_bytes(noise, "big"))
        assert _base._Ulids()() == str(expected)


def test_new_ids_strictly_increase_within_a_millisecond_and_when_the_clock_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ids minted in one millisecond, or after the clock stepped back, still sort in the order
    they were made (as python-ulid's `ULID()` does)."""
    ulids = _base._Ulids()
    now = [1_700_000_000_000 * 1_000_000]
    monkeypatch.setattr(_base.time, "time_ns", lambda: now[0])
    ids = [ulids() for _ in range(1000)]
    now[0] -= 5_000 * 1_000_000  # five seconds back
    ids += [ulids() for _ in range(10)]
    now[0] += 10_000 * 1_000_000
    ids.append(ulids())
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert ULID.from_str(ids[-1]).milliseconds == now[0] // 1_000_000


# -- the pool's check ----------------------------------------------------------------------------


async def test_a_connection_holding_an_unread_reply_is_not_reused_as_is(
    real_redis_url: str, prefix: str
) -> None:
    """A pooled connection with a reply nobody read (a caller gone mid-command) is made again
    before its next command, which gets its own reply, not the stale one."""
    async with Broker.from_url(real_redis_url, Settings(key_prefix=prefix)) as b:
        key = f"{prefix}:stale"
        await b.redis.set(key, "fresh")
        pool = b.redis.connection_pool
        conn = await pool.get_connection()
        await conn.send_command("PING")
        await asyncio.sleep(0.05)  # the PONG has arrived and sits unread
        await pool.release(conn)
        assert await b.redis.get(key) == "fresh"
        await b.redis.delete(key)


async def test_a_connection_the_server_closed_is_made_again(
    real_redis_url: str, prefix: str
) -> None:
    """A pooled connection the server has closed (CLIENT KILL) is made again at checkout: the
    next command just works."""
    async with Broker.from_url(real_redis_url, Settings(key_prefix=prefix)) as b:
        victim = await b.redis.client_id()  # the pool's one connection, used again next
        async with Redis.from_url(real_redis_url) as killer:
            assert await killer.client_kill_filter(_id=victim) == 1
        await asyncio.sleep(0.05)  # its end of stream has arrived
        assert await b.redis.ping() is True
        assert await b.redis.client_id() != victim


def test_hiredis_packing_writes_the_bytes_redis_py_writes() -> None:
    """The Broker's connections pack commands with hiredis: byte for byte what redis-py's own
    packer writes, whatever the arguments (others than str, bytes and int go redis-py's way)."""
    from redis.asyncio.connection import Connection

    from broker.client import _fast_packing

    fast = _fast_packing(Redis()).connection_pool.make_connection()
    plain = Connection()
    cases: list[tuple[Any, ...]] = [
        ("EVALSHA", "ab" * 20, 2, "pp:{t}:items", "pp:{t}:active", "", "é✓ 𝄞", b"\x00\xff", -7),
        ("SET", "k", 2**63 - 1),
        ("ZADD", "k", 1.5, "m"),  # a float
        ("SET", "k", memoryview(b"mv")),
        ("CLIENT SETNAME", "x"),  # a command name with a space
        ("GET", "k" * 100_000),  # large enough for redis-py to write it apart
    ]
    for args in cases:
        assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args)), args


async def test_a_replicas_handed_over_pools_pack_with_hiredis_too() -> None:
    """A replica's Broker is given its bounded pools (`replica_broker`), owning them: their
    connections pack with hiredis as the Broker's own do (they used to pack in Python: most of
    an adopting replica's CPU); a pool the Broker does not own is left as it was."""
    from redis.asyncio.connection import Connection

    from broker.client import _HiredisPacking
    from workers.runtime.run import replica_broker

    b = replica_broker(Settings(redis_url="redis://127.0.0.1:1/0"))
    try:
        assert b._pubsub_client is not None
        for client in (b.redis, b._pubsub_client):
            assert issubclass(client.connection_pool.connection_class, _HiredisPacking)
    finally:
        await b.aclose()
    lent = Redis(decode_responses=True)
    Broker(lent, Settings())
    assert lent.connection_pool.connection_class is Connection
    await lent.aclose()


def test_any_error_among_a_pipelines_replies_is_raised() -> None:
    """A reply error and a connection error given as a reply (a cluster pipeline gives a failed
    node's error so, for each of its commands) are both raised, never handed over as a reply."""
    from broker._scripts import raise_first

    raise_first([1, "OK", None, []])
    for error in (ResponseError("WRONGTYPE"), RedisConnectionError("node down")):
        with pytest.raises(type(error)):
            raise_first([1, error, "OK"])
