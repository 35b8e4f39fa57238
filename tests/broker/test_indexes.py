"""The discovery indexes split into buckets (broker/indexes.py) on one server, over fakeredis and
a real server: every member in its thread's bucket, merged reads in score order, and every user
of the indexes (open listing and its HTTP paging, the audit sweep, leases, deadlines, the
timekeeper) working across buckets. One bucket (the default here) keeps today's key names."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from redis.crc import key_slot

from broker import Broker, Keys, Question, Timing
from broker.indexes import Index
from tests.conftest import BrokerFactory
from web.app import create_app
from web.settings import ApiSettings, Identity
from web.testing import serving
from workers.runtime import audit, deadlines
from workers.runtime.timekeeper import Timekeeper

APPROVAL = Question.model_validate(
    {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
)
TOKEN = "bucket-token-0123456789"


@pytest.fixture
async def bucketed(make_broker: BrokerFactory) -> Broker:
    """A Broker whose indexes are four buckets."""
    return await make_broker(index_buckets=4)


async def _keys_of(broker: Broker, index: Index) -> dict[str, list[str]]:
    """Each existing key of the index (its buckets and the one-key name) -> its members."""
    out = {}
    for key in [index.name, *[f"{index.name}:{i}" for i in range(8)]]:
        members = await broker.redis.zrange(key, 0, -1)
        if members:
            out[key] = members
    return out


def _flat(by_key: dict[str, list[str]]) -> list[str]:
    return [m for members in by_key.values() for m in members]


def _bucket(index: str, thread_id: str, n: int = 4) -> str:
    """The key of `index`'s bucket for `thread_id`, by the rule written out: of the n bucket
    keys, the one whose slot is the highest at or below the thread's; if none is, the highest."""
    slots = {f"{index}:{i}": key_slot(f"{index}:{i}".encode()) for i in range(n)}
    mine = key_slot(thread_id.encode())
    below = [k for k, s in slots.items() if s <= mine] or list(slots)
    return max(below, key=slots.__getitem__)


@pytest.mark.single_server("one server's default: one bucket, the old key names")
async def test_one_bucket_by_default_keeps_the_key_names(broker: Broker) -> None:
    """On one server the default is one bucket, named as the index always was (`<prefix>:open`);
    the auto count on a cluster is 16."""
    p = await broker.ask("t1", "approval", [APPROVAL])
    prefix = broker.keys.prefix
    assert broker.keys.buckets == 1
    assert broker.indexes.open.all_keys() == [f"{prefix}:open"]
    assert await _keys_of(broker, broker.indexes.open) == {f"{prefix}:open": [f"t1/{p.prompt_id}"]}
    assert Keys("pp").buckets == 1 and Keys("pp", cluster=True).buckets == 16
    assert Keys("pp", cluster=True, buckets=1).bucket("pp:open", 0) == "pp:open"
    assert Keys("pp", buckets=4).bucket("pp:open", 3) == "pp:open:3"


async def test_members_land_in_their_threads_bucket(bucketed: Broker) -> None:
    """Open, audit and lease members go to their thread's bucket (`_bucket`); the listing sees
    them all, oldest first; delivery and audit empty the indexes."""
    b = bucketed
    threads = [f"thread-{i}" for i in range(12)]
    asked = []
    for t in threads:
        await b.sessions.create(t, "scripted", "approval", {})
        asked.append(await b.ask(t, "approval", [APPROVAL]))
        await asyncio.sleep(0.002)  # distinct creation times: the listing's order is theirs
    open_keys = await _keys_of(b, b.indexes.open)
    assert b.keys.open not in open_keys  # no one-key index beside the buckets
    assert len(open_keys) > 1
    for key, members in open_keys.items():
        for m in members:
            assert key == _bucket(b.keys.open, m.split("/")[0])
    for key, members in (await _keys_of(b, b.indexes.leases)).items():
        assert all(key == _bucket(b.keys.leases, t) for t in members)
    assert sorted(_flat(await _keys_of(b, b.indexes.leases))) == sorted(threads)
    assert [p.prompt_id for p in await b.open_prompts()] == [p.prompt_id for p in asked]
    for t, p in zip(threads, asked, strict=True):
        await b.post_item(t, {"author": "ann", "content": [{"type": "text", "text": "1"}]})
        await b.wait(t, p.prompt_id, timeout=5)
    await b.settle()
    assert await b.indexes.open.count(b.redis) == 0
    audits = await _keys_of(b, b.indexes.audit)
    assert sorted(_flat(audits)) == sorted(
        f"{t}/{p.prompt_id}" for t, p in zip(threads, asked, strict=True)
    )
    for key, members in audits.items():
        assert all(key == _bucket(b.keys.audit, m.split("/")[0]) for m in members)
    for t, p in zip(threads, asked, strict=True):
        assert await b.post_resolution(t, p.prompt_id)
    assert await b.indexes.audit.count(b.redis) == 0


async def test_merged_reads_page_in_score_order(bucketed: Broker) -> None:
    """`page`, `walk`, `head` and `oldest` over four buckets answer as one sorted set would:
    every member once, by score then member, ties included."""
    index = bucketed.indexes.open
    scores = {f"t{i}/prm_{i:026d}": float(i // 3) for i in range(41)}  # three to a score
    await index.add(bucketed.redis, scores)
    assert len(await _keys_of(bucketed, index)) == 4
    expected = sorted(scores.items(), key=lambda kv: (kv[1], kv[0]))
    pages = [await index.page(bucketed.redis, offset=o, count=7) for o in range(0, 42, 7)]
    assert [row for page in pages for row in page] == expected
    assert [row async for row in index.walk(bucketed.redis, batch=2)] == expected
    assert [row async for row in index.walk(bucketed.redis, 3, 5, batch=1)] == [
        kv for kv in expected if 3 <= kv[1] <= 5
    ]
    assert await index.page(bucketed.redis, "-inf", 2) == expected[:9]
    assert await index.head(bucketed.redis, 5) == (expected[:5], 41)
    assert await index.oldest(bucketed.redis) == expected[0]
    assert await index.members(bucketed.redis) == [m for m, _ in expected]


async def test_http_prompts_page_across_buckets(bucketed: Broker) -> None:
    """GET /v1/prompts pages through prompts spread over the buckets, oldest first, each once."""
    asked = []
    for i in range(9):
        asked.append(await bucketed.ask(f"h{i}", "approval", [APPROVAL]))
        await asyncio.sleep(0.002)  # distinct creation times
    ident = Identity.model_validate({"name": "ann", "token": TOKEN, "scopes": ["read"]})
    app = create_app(ApiSettings(tokens=(ident,), heartbeat=1.0), broker=bucketed)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    seen: list[str] = []
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=headers) as http:
        cursor = ""
        while True:
            body = (await http.get("/v1/prompts", params={"limit": 2, "cursor": cursor})).json()
            seen += [p["prompt_id"] for p in body["prompts"]]
            if body["next_cursor"] is None:
                break
            cursor = body["next_cursor"]
    assert seen == [p.prompt_id for p in asked]


async def test_leases_claim_release_and_adopt_across_buckets(bucketed: Broker) -> None:
    """New threads are found in their buckets, claimed, released back to them, and a dead
    incarnation's threads are adopted; a claimed thread leaves the to-claim index."""
    b = bucketed
    threads = [f"lease-{i}" for i in range(10)]
    for t in threads:
        await b.sessions.create(t, "scripted", "approval", {})
    inc, _, _ = await b.sessions.join("r1", 60_000)
    seen = await b.sessions.candidates(await b.sessions.look())
    assert sorted(seen.expired) == sorted(threads) and seen.threads == 10
    held = await b.sessions.claim_many(threads, "r1", inc)
    assert sorted(held) == sorted(threads)
    assert await b.indexes.leases.count(b.redis) == 0
    assert await b.sessions.release_all("r1", inc, held) == 10
    assert sorted(await b.indexes.leases.members(b.redis)) == sorted(threads)
    inc2, _, _ = await b.sessions.join("r2", 60_000)
    held = await b.sessions.claim_many(threads, "r2", inc2)
    assert len(held) == 10 and await b.indexes.leases.count(b.redis) == 0
    await b.sessions.join("r2", 60_000)  # r2 restarts: inc2 is dead at once
    assert await b.sessions.free("r2", inc2) == 10
    assert sorted(await b.indexes.leases.members(b.redis)) == sorted(threads)
    inc3, _, _ = await b.sessions.join("r3", 60_000)
    assert len(await b.sessions.claim_many(threads, "r3", inc3)) == 10


async def test_deadlines_and_timekeeper_across_buckets(bucketed: Broker) -> None:
    """The deadline expirer finds old prompts in every bucket; the timekeeper's rescan puts
    timed prompts back into their threads' due buckets and expires them all."""
    b = bucketed
    for i in range(6):
        await b.ask(f"d{i}", "approval", [APPROVAL])
    assert await deadlines.expire_due(b, 0.0) == 6
    assert await b.open_prompts() == []
    for i in range(6):
        p = await b.ask(f"k{i}", "approval", [APPROVAL])
        await b.set_timing(f"k{i}", Timing(deadline=0.05), prompt_id=p.prompt_id)
    assert await b.indexes.due.count(b.redis) == 6
    await b.redis.delete(*b.indexes.due.all_keys())
    keeper = Timekeeper(b)
    assert await keeper.scan() == 6
    due = await _keys_of(b, b.indexes.due)
    assert len(due) > 1 and sum(len(m) for m in due.values()) == 6
    for key, members in due.items():
        assert all(key == _bucket(b.keys.due, m.split("/")[0]) for m in members)
    await asyncio.sleep(0.1)
    assert await keeper.take_due() == 6
    assert await b.open_prompts() == [] and await b.indexes.due.count(b.redis) == 0


async def test_the_sweep_rebuilds_a_lost_bucket(bucketed: Broker) -> None:
    """A bucket key deleted (a failover lost it) comes back, each member in its own bucket, from
    the records: open and audit by the reconcile sweep, leases by `rebuild_leases`."""
    b = bucketed
    threads = [f"r{i}" for i in range(12)]
    asked = {}
    for t in threads:
        await b.sessions.create(t, "scripted", "approval", {})
        asked[t] = await b.ask(t, "approval", [APPROVAL])
    await b.cancel("r0", "stop")
    before = {i: await _keys_of(b, i) for i in (b.indexes.open, b.indexes.audit, b.indexes.leases)}
    lost = _bucket(b.keys.open, "r1")
    await b.redis.delete(lost, _bucket(b.keys.leases, "r1"), _bucket(b.keys.audit, "r0"))
    await audit.rebuild_indexes(b)
    await b.sessions.rebuild_leases()
    for index, was in before.items():
        now = await _keys_of(b, index)
        assert {k: sorted(v) for k, v in now.items()} == {k: sorted(v) for k, v in was.items()}


async def test_the_sweep_moves_members_a_former_rule_left_in_another_bucket(
    make_broker: BrokerFactory,
) -> None:
    """A member in a bucket of the current count that is not its thread's (where the crc32
    rule of an earlier build put it) is moved into its own by the sweep, keeping its score;
    a member already in its own stays."""
    b = await make_broker(index_buckets=4)
    threads = [f"old-{i}" for i in range(8)]
    asked = {t: await b.ask(t, "approval", [APPROVAL]) for t in threads}
    index = b.indexes.open
    # Two threads' members moved where another rule would have put them.
    moved = []
    for t in threads[:2]:
        member = f"{t}/{asked[t].prompt_id}"
        own = index.key(t)
        other = next(k for k in index.all_keys() if k != own)
        score = await b.redis.zscore(own, member)
        await b.redis.zrem(own, member)
        await b.redis.zadd(other, {member: score})
        moved.append((member, score))
    counts = await audit.rebuild_indexes(b)
    assert counts["moved"] == 2
    for key, members in (await _keys_of(b, index)).items():
        assert all(key == index.key_of(m) for m in members), (key, members)
    for member, score in moved:
        assert await b.redis.zscore(index.key_of(member), member) == score
    assert sorted(p.prompt_id for p in await b.open_prompts()) == sorted(
        p.prompt_id for p in asked.values()
    )


async def test_the_sweep_moves_members_of_a_former_bucket_count(
    make_broker: BrokerFactory,
) -> None:
    """Members written under one bucket (`<prefix>:open`; the auto count on a cluster) or
    under 4 buckets are moved, with their scores, into their buckets once the count is 2 and
    the sweep has run."""
    one = await make_broker()  # one bucket on a server, the auto count (16) on a cluster
    four = await make_broker(index_buckets=4)
    two = await make_broker(index_buckets=2)

    def moving(stem: str, former: Broker) -> str:
        """A thread whose open bucket under `former`'s count is not its bucket of 2 (where
        a thread falls depends on the prefix)."""
        return next(
            t
            for t in (f"{stem}-{i}" for i in range(100))
            if former.indexes.open.key(t) != two.indexes.open.key(t)
        )

    m1, m3 = moving("m1", one), moving("m3", four)
    p = await one.ask(m1, "approval", [APPROVAL])
    await asyncio.sleep(0.002)
    await one.sessions.create("m2", "scripted", "approval", {})
    q = await four.ask(m3, "approval", [APPROVAL])
    await four.indexes.due.add(four.redis, {f"{m3}/{q.prompt_id}": 7})
    moved = await audit.rebuild_indexes(two)
    await two.sessions.rebuild_leases()
    await Timekeeper(two).scan()
    assert moved["moved"] == 2  # m1 from the one key, m3 from its bucket of 4
    opened = await _keys_of(two, two.indexes.open)
    assert sorted(_flat(opened)) == sorted([f"{m1}/{p.prompt_id}", f"{m3}/{q.prompt_id}"])
    assert sorted(await two.indexes.leases.members(two.redis)) == ["m2"]
    for index in (two.indexes.open, two.indexes.leases, two.indexes.due):
        for key, members in (await _keys_of(two, index)).items():
            assert all(key == index.key_of(m) for m in members), (key, members)
    assert await two.redis.zscore(two.indexes.due.key(m3), f"{m3}/{q.prompt_id}") == 7
    assert [x.prompt_id for x in await two.open_prompts()] == [p.prompt_id, q.prompt_id]
