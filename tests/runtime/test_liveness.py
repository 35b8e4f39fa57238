"""Liveness per replica: one record write per beat, whatever a replica holds.

A thread's lease is its holder's liveness: the session names its holder and the holder's
incarnation, the replica record (beat.lua) carries that incarnation and a deadline in server time,
and a claim (claim.lua) takes a thread only on evidence that its holder is dead, bumping the epoch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from broker import Broker, Fenced, Settings, leases
from tests.conftest import RedisServer
from tests.helpers import drop_indexes, expire, index_members, replica_record, truthy, until
from workers.agents.harness import approval_question
from workers.agents.scripted import ScriptedHarness
from workers.runtime.replica import Replica

TTL = 60_000
QUESTION = approval_question("Bash", {"command": "make deploy"})


# -- the records and the claim -------------------------------------------------------------------


async def test_a_live_holders_thread_is_not_taken_a_dead_ones_is(broker: Broker) -> None:
    """While the holder's record runs, nobody claims its thread; once it expired, a claim takes
    it with a new epoch, and the former holder's epoch is refused from then on."""
    await broker.sessions.create("t1", "scripted", "approval", {})
    ra, _, _ = await broker.sessions.join("ra", TTL)
    rb, _, _ = await broker.sessions.join("rb", TTL)
    old = await broker.sessions.claim("t1", "ra", ra)
    assert old == 1
    assert await broker.sessions.claim("t1", "rb", rb) is None
    s = await broker.sessions.get("t1")
    assert s is not None and (s.owner, s.holder_incarnation, s.epoch) == ("ra", ra, 1)
    assert s.lease_until is not None  # the holder's record deadline

    await expire(broker, "ra")
    s = await broker.sessions.get("t1")
    assert s is not None and s.lease_until is not None and s.lease_until.timestamp() < 1
    assert await broker.sessions.claim("t1", "rb", rb) == 2
    with pytest.raises(Fenced):
        await broker.sessions.update("t1", 1, status="running")
    assert await broker.redis.sismember(broker.keys.holds("rb", rb), "t1")  # type: ignore[misc]
    assert not await broker.redis.sismember(broker.keys.holds("ra", ra), "t1")  # type: ignore[misc]


async def test_claim_refuses_a_holder_other_than_the_one_read(broker: Broker) -> None:
    """claim.lua acts on what the caller read: a session that names another holder than the one
    read ('moved'), or a record seen alive ('held'), is not taken."""
    await broker.sessions.create("t1", "scripted", "approval", {})
    ra, _, _ = await broker.sessions.join("ra", TTL)
    assert await broker.sessions.claim("t1", "ra", ra) == 1
    session = broker.thread("t1").session

    async def claim(*args: Any) -> list[Any]:
        (reply,) = await broker._scripts.call(broker.redis, "claim", [session], list(args))
        return list(reply)

    far = int(time.time() * 1000) + TTL
    assert (await claim("rb", "x", "", "", "", 0))[0] == "moved"  # read it unowned: it is not
    assert (await claim("rb", "x", "ra", "other", "", 0))[0] == "moved"
    assert (await claim("rb", "x", "ra", ra, ra, far))[0] == "held"
    # a record that (by this server's clock) has not expired yet is not taken either
    soon = int(time.time() * 1000) + 5_000
    assert (await claim("rb", "x", "ra", ra, ra, soon))[0] == "held"
    s = await broker.sessions.get("t1")
    assert s is not None and (s.owner, s.epoch) == ("ra", 1)
    # seen superseded (another incarnation on the record) or without a record: dead, taken
    assert (await claim("rb", "x", "ra", ra, "newer", far))[:2] == ["claimed", "2"]
    assert (await claim("rc", "y", "rb", "x", "", 0))[:2] == ["claimed", "3"]


async def test_a_claim_that_finds_a_releasing_holder_alive_leaves_the_thread_findable(
    broker: Broker,
) -> None:
    """A clean stop puts its threads in the to-claim index, then releases each (release_all).
    An adopter that looks in between finds the holder alive ('held'): it must leave the entry,
    or the thread, released a moment later, is in no index at all and nobody adopts it (a
    rolling restart in CI left one so)."""
    await broker.sessions.create("t1", "scripted", "approval", {})
    ra, _, _ = await broker.sessions.join("ra", TTL)
    rb, _, _ = await broker.sessions.join("rb", TTL)
    epoch = await broker.sessions.claim("t1", "ra", ra)
    assert epoch is not None
    leases = broker.indexes.leases
    await leases.add(broker.redis, {"t1": 0})  # release_all's first step, for "ra"
    seen = await broker.sessions.candidates(await broker.sessions.look())
    assert "t1" in seen.expired
    assert await broker.sessions.claim_many(["t1"], "rb", rb, seen.dead) == {}  # ra: alive
    # release_all's second step, then its end: the holds set deleted, the record gone
    session = broker.thread("t1").session
    released = await broker._scripts.call(broker.redis, "release", [session], ["ra", epoch])
    assert released == ["released"]
    await broker.redis.delete(broker.keys.holds("ra", ra))
    await broker.sessions.leave("ra", ra)
    seen = await broker.sessions.candidates(await broker.sessions.look())
    assert "t1" in seen.expired
    assert await broker.sessions.claim_many(["t1"], "rb", rb, seen.dead) == {"t1": epoch + 2}
    assert "t1" not in await leases.members(broker.redis)  # claimed: out of the index


async def test_an_expired_record_is_never_extended(broker: Broker) -> None:
    """Once its deadline passed, a beat finds the incarnation dead and writes nothing: what an
    adopter saw expired stays so. Only a new incarnation (join) is alive again."""
    ra, _, _ = await broker.sessions.join("ra", TTL)
    assert await broker.sessions.beat("ra", ra, TTL) is not None
    await expire(broker, "ra")
    before = await replica_record(broker, "ra")
    assert await broker.sessions.beat("ra", ra, TTL) is None
    assert await replica_record(broker, "ra") == before
    again, _, former = await broker.sessions.join("ra", TTL)
    assert again != ra and former == ra
    assert await broker.sessions.beat("ra", ra, TTL) is None  # the old one stays dead
    assert await broker.sessions.beat("ra", again, TTL) is not None


async def test_a_beat_is_one_write_whatever_is_held(broker: Broker) -> None:
    """A replica's beat touches its record (and the replicas index) only, however many threads
    it holds: the sessions are not written."""
    ra, _, _ = await broker.sessions.join("ra", TTL)
    threads = [f"t{i}" for i in range(50)]
    for t in threads:
        await broker.sessions.create(t, "scripted", "approval", {})
    assert len(await broker.sessions.claim_many(threads, "ra", ra)) == 50
    before = [await broker.redis.hgetall(broker.thread(t).session) for t in threads]  # type: ignore[misc]
    await asyncio.sleep(0.01)
    assert await broker.sessions.beat("ra", ra, TTL) is not None
    after = [await broker.redis.hgetall(broker.thread(t).session) for t in threads]  # type: ignore[misc]
    assert after == before


async def test_claims_on_several_script_pages_each_get_their_own_reply(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """claim.lua takes a page of threads in one run: with pages of three, a mix of free, held,
    closed and missing threads is claimed exactly where each one's own reply says so, and the
    claimer's holds index ends with those only."""
    monkeypatch.setattr(leases, "SCRIPT_PAGE", 3)
    ra, _, _ = await broker.sessions.join("ra", TTL)
    rb, _, _ = await broker.sessions.join("rb", TTL)
    free = [f"f{i}" for i in range(5)]
    held = [f"h{i}" for i in range(3)]
    for t in [*free, *held, "closed"]:
        await broker.sessions.create(t, "scripted", "approval", {})
    assert await broker.sessions.claim_many(held, "rb", rb) == dict.fromkeys(held, 1)
    await broker.sessions.close("closed")
    # Each page begins with a held one: a free one judged on its page's first would be taken
    # for held too.
    mixed = ["h0", "f0", "missing", "h1", "f1", "closed", "h2", "f2", "f3", "f4"]
    assert await broker.sessions.claim_many(mixed, "ra", ra) == dict.fromkeys(free, 1)
    for t in held:
        assert await broker.redis.hget(broker.thread(t).session, "owner") == "rb"  # type: ignore[misc]
    holds = broker.keys.holds("ra", ra)
    assert await broker.redis.smembers(holds) == set(free)  # type: ignore[misc]


async def test_a_restart_frees_what_the_former_incarnation_held_at_once(broker: Broker) -> None:
    """A replica that comes back under the same id is a new incarnation: its former one is dead
    for good, and what it held is up for claiming at once (no waiting for its deadline)."""
    ra, _, _ = await broker.sessions.join("ra", TTL)
    rb, _, _ = await broker.sessions.join("rb", TTL)
    threads = [f"t{i}" for i in range(5)]
    for t in threads:
        await broker.sessions.create(t, "scripted", "approval", {})
    assert len(await broker.sessions.claim_many(threads, "ra", ra)) == 5
    fleet = await broker.sessions.look()
    assert (await broker.sessions.candidates(fleet)).expired == {}

    ra2, _, former = await broker.sessions.join("ra", TTL)
    assert former == ra
    assert await broker.sessions.free("ra", former) == 5
    seen = await broker.sessions.candidates(await broker.sessions.look())
    assert set(seen.expired) == set(threads)
    assert await broker.sessions.claim_many(threads, "rb", rb) == dict.fromkeys(threads, 2)
    assert await broker.sessions.claim_many(threads, "ra", ra2) == {}  # rb is alive


async def test_a_dead_incarnations_threads_are_found_and_its_record_buried(broker: Broker) -> None:
    """Adopters find an expired incarnation's threads through its index; once none is left,
    its record goes."""
    ra, _, _ = await broker.sessions.join("ra", TTL)
    rb, _, _ = await broker.sessions.join("rb", TTL)
    for t in ("t1", "t2"):
        await broker.sessions.create(t, "scripted", "approval", {})
    await broker.sessions.claim_many(["t1", "t2"], "ra", ra)
    await expire(broker, "ra")
    seen = await broker.sessions.candidates(await broker.sessions.look())
    assert set(seen.expired) == {"t1", "t2"} and seen.replicas == 1
    assert await broker.sessions.claim_many(list(seen.expired), "rb", rb) == {"t1": 2, "t2": 2}
    await broker.sessions.candidates(await broker.sessions.look())
    assert await replica_record(broker, "ra") is None
    assert await broker.redis.zscore(broker.keys.replicas, "ra") is None


async def test_the_lease_indexes_are_rebuilt_from_the_records(broker: Broker) -> None:
    """With the indexes lost, the records rebuild them: a held thread is in its holder's set,
    an unowned one (or one of a dead incarnation) is to be claimed."""
    ra, _, _ = await broker.sessions.join("ra", TTL)
    for t in ("t1", "t2", "t3"):
        await broker.sessions.create(t, "scripted", "approval", {})
    await broker.sessions.claim_many(["t1", "t2"], "ra", ra)
    await drop_indexes(broker, "leases")
    await broker.redis.delete(broker.keys.holds("ra", ra))
    counts = await broker.sessions.rebuild_leases()
    assert counts == {"held": 2, "unowned": 1}
    assert await broker.redis.smembers(broker.keys.holds("ra", ra)) == {"t1", "t2"}  # type: ignore[misc]
    assert await index_members(broker, "leases") == ["t3"]


# -- replicas --------------------------------------------------------------------------------------


def _replica(b: Broker) -> tuple[Replica, asyncio.Event, asyncio.Task[None]]:
    replica = Replica(b, harnesses={"scripted": ScriptedHarness()}, replica_id="ra")
    stop = asyncio.Event()
    return replica, stop, asyncio.create_task(replica.run(stop))


async def _dead_replicas_parked_threads(b: Broker, n: int) -> list[str]:
    """N threads, each held by a dead replica whose agent held an open approval."""
    threads = [f"p{i:04d}" for i in range(n)]
    dead, _, _ = await b.sessions.join("dead", 1)
    for t in threads:
        await b.sessions.create(t, "scripted", "approval", {"script": {"turns": []}})
    epochs = await b.sessions.claim_many(threads, "dead", dead)
    for t in threads:
        await b.sessions.update(t, epochs[t], status="running")
        await b.ask(t, "approval", [QUESTION], epoch=epochs[t])
    return threads


@pytest.mark.real_redis
async def test_an_idle_replica_sends_the_same_few_commands_however_many_threads_it_holds(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """A replica holding 400 parked threads, nothing happening: its commands over 3 s are a
    handful of beats and adoption looks, not one per thread (a renewal each, a re-read each)."""
    server = redis_server_factory(appendonly=False)
    settings = Settings(key_prefix="pp", lease_ttl=1.0, adopt_interval=0.5, sweep_interval=0.5)
    person = Broker(Redis.from_url(server.url, decode_responses=True), settings)
    b = Broker(Redis.from_url(server.url, decode_responses=True), settings)
    threads = await _dead_replicas_parked_threads(person, 400)
    replica, stop, task = _replica(b)
    try:

        async def all_parked() -> bool:
            pipe = person.redis.pipeline(transaction=False)
            for t in threads:
                pipe.hmget(person.thread(t).session, ["owner", "status"])
            rows = await pipe.execute()
            return all(row == ["ra", "parked"] for row in rows)

        await until(all_parked, "every thread adopted and parked", within=30)
        await asyncio.sleep(1.0)  # the adoption's own tail (subscription looks) is over
        stats = Redis.from_url(server.url, decode_responses=True)
        try:
            before = int((await stats.info("stats"))["total_commands_processed"])
            await asyncio.sleep(3.0)
            after = int((await stats.info("stats"))["total_commands_processed"])
        finally:
            await stats.aclose()
        # 9 beats (one each ttl/3) and 6 looks (a few commands each) in 3 s; each thread's
        # lease renewed every ttl/3 would be 3,600, a re-read of each every sweep 2,400 more.
        assert after - before - 1 < 120, f"{after - before - 1} commands in 3 s while idle"
        assert len(replica.threads) == 400
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await person.aclose()
        await b.aclose()


@pytest.mark.real_redis
async def test_sigterm_releases_every_thread_at_once(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """A clean stop gives every thread up at once and removes its record: another replica
    adopts them well within a lease, not after one."""
    server = redis_server_factory(appendonly=False)
    settings = Settings(key_prefix="pp", lease_ttl=10.0, adopt_interval=0.1)
    person = Broker(Redis.from_url(server.url, decode_responses=True), settings)
    b = Broker(Redis.from_url(server.url, decode_responses=True), settings)
    threads = await _dead_replicas_parked_threads(person, 100)
    replica, stop, task = _replica(b)
    try:
        await until(lambda: truthy(len(replica.threads) == 100), "ra to adopt them", within=30)

        async def looked_at() -> bool:
            # adopted, then looked at: the dead holder's open waits are parked (a claim comes
            # before its thread's first look, so SIGTERM must wait for the look to count on it)
            sessions = [await person.sessions.get(t) for t in threads]
            return all(s is not None and s.status == "parked" for s in sessions)

        await until(looked_at, "ra to park the dead holder's waits", within=30)
        stop.set()
        await asyncio.wait_for(task, 30)
        assert await replica_record(person, "ra") is None
        for t in threads:
            s = await person.sessions.get(t)
            assert s is not None and s.owner == "" and s.status == "parked"
        t0 = time.monotonic()
        rb = Broker(Redis.from_url(server.url, decode_responses=True), settings)
        other = Replica(rb, harnesses={"scripted": ScriptedHarness()}, replica_id="rb")
        stop2 = asyncio.Event()
        task2 = asyncio.create_task(other.run(stop2))
        try:
            await until(lambda: truthy(len(other.threads) == 100), "rb to adopt them", within=9)
            assert time.monotonic() - t0 < settings.lease_ttl
        finally:
            stop2.set()
            await asyncio.wait_for(task2, 30)
            await rb.aclose()
    finally:
        stop.set()
        await person.aclose()
        await b.aclose()


async def test_a_replica_found_dead_drops_everything_and_joins_again(
    make_broker: Callable[..., Any],
) -> None:
    """A replica whose beat finds its record expired (paused past its deadline) holds nothing
    any more, comes back as a new incarnation, and only then adopts again."""
    person: Broker = await make_broker(lease_ttl=1.0, adopt_interval=0.05)
    b: Broker = await make_broker(lease_ttl=1.0, adopt_interval=0.05)
    replica = Replica(b, harnesses={"scripted": ScriptedHarness()}, replica_id="ra")
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    try:
        await person.sessions.create("t1", "scripted", "approval", {"script": {"turns": []}})
        await until(lambda: truthy("t1" in replica.threads), "ra to adopt t1")
        first = replica.incarnation
        epoch = replica.threads["t1"].epoch
        await expire(person, "ra")
        await until(lambda: truthy(replica.incarnation != first), "ra to join again")
        # the thread it held was freed by its new incarnation and adopted again, anew
        await until(lambda: truthy("t1" in replica.threads), "ra to adopt t1 again")
        assert replica.threads["t1"].epoch > epoch
        s = await person.sessions.get("t1")
        assert s is not None and s.holder_incarnation == replica.incarnation
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_a_replica_whose_record_vanished_frees_its_threads_on_joining_again(
    make_broker: Callable[..., Any],
) -> None:
    """A record can go while its replica still claims (removed as expired and empty, or lost
    with a failed-over server): nobody can then find that incarnation's threads through it. The
    replica, finding itself dead, puts its own last incarnation's threads up for claiming."""
    person: Broker = await make_broker(lease_ttl=1.0, adopt_interval=0.05)
    b: Broker = await make_broker(lease_ttl=1.0, adopt_interval=0.05)
    replica = Replica(b, harnesses={"scripted": ScriptedHarness()}, replica_id="ra")
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    try:
        await person.sessions.create("t1", "scripted", "approval", {"script": {"turns": []}})
        await until(lambda: truthy("t1" in replica.threads), "ra to adopt t1")
        first = replica.incarnation
        await person.redis.hdel(person.keys.replica_records, "ra")  # type: ignore[misc]
        await until(lambda: truthy(replica.incarnation != first), "ra to join again")
        await until(lambda: truthy("t1" in replica.threads), "ra to adopt t1 again", within=5)
        s = await person.sessions.get("t1")
        assert s is not None and s.holder_incarnation == replica.incarnation
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
