"""Resharding under held waits: the slots of threads with open prompts, waited on, move to
another primary (CLUSTER SETSLOT IMPORTING/MIGRATING, MIGRATE of every key, SETSLOT NODE, as
`redis-cli --cluster reshard` does it); answered after the move, every wait returns its
answer once, by bell (the sweep is off), and nothing is lost. On a cluster of its own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis

from broker import Broker, BrokerUnavailable, Settings
from broker.models import Question
from tests.conftest import RedisClusterNodes, start_cluster
from tests.helpers import began_waiting, truthy, until

pytestmark = pytest.mark.real_redis


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    cluster = start_cluster(tmp_path_factory.mktemp("reshard"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _primaries(cluster: RedisClusterNodes) -> dict[int, str]:
    """port -> node id of every primary."""
    out = {}
    for n in cluster.nodes:
        r = redis.Redis(port=n.port, decode_responses=True)
        if r.info("replication")["role"] == "master":
            out[n.port] = r.execute_command("CLUSTER", "MYID")
    return out


def move_slot(
    cluster: RedisClusterNodes, slot: int, source: int, target: int, *, first: int = 0
) -> int:
    """Move `slot` from the primary on port `source` to the one on `target`, keys and all, the
    way `redis-cli --cluster reshard` does; returns how many keys moved. With `first`, only
    that many keys move (one MIGRATE each) and the slot is left half moved: `finish_move`."""
    ids = _primaries(cluster)
    src = redis.Redis(port=source, decode_responses=True)
    dst = redis.Redis(port=target, decode_responses=True)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    if first:
        for key in src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, first):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", key)
        return first
    return finish_move(cluster, slot, source, target)


def finish_move(cluster: RedisClusterNodes, slot: int, source: int, target: int) -> int:
    ids = _primaries(cluster)
    src = redis.Redis(port=source, decode_responses=True)
    moved = 0
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
    for port in [target, source, *(p for p in ids if p not in (source, target))]:
        redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    return moved


async def test_held_waits_survive_their_slots_moving(own_cluster: RedisClusterNodes) -> None:
    settings = Settings(key_prefix="r" + uuid.uuid4().hex[:8], sweep_interval=600)
    async with (
        Broker.from_url(own_cluster.url, settings, cluster=True) as b,
        Broker.from_url(own_cluster.url, settings, cluster=True) as person,
    ):
        await b.redis.initialize()  # type: ignore[attr-defined]
        await person.redis.initialize()  # type: ignore[attr-defined]
        ports = sorted(_primaries(own_cluster))
        source, target = ports[0], ports[1]
        slot_of = b.redis.keyslot  # type: ignore[attr-defined]
        # Four threads on `source`, each in a slot of its own, and two that stay where they are.
        moving = [
            t
            for t in (f"t{i}" for i in range(400))
            if b.redis.get_node_from_key(b.thread(t).items).port == source  # type: ignore[attr-defined]
        ][:4]
        staying = [
            t
            for t in (f"s{i}" for i in range(400))
            if b.redis.get_node_from_key(b.thread(t).items).port == ports[2]  # type: ignore[attr-defined]
        ][:2]
        slots = {slot_of(b.thread(t).items) for t in moving}
        assert len(slots) == 4
        threads = moving + staying
        for t in threads:
            await b.sessions.create(t, "scripted")
        prompts = {t: await b.ask(t, "text", [Question(question=f"Name {t}?")]) for t in threads}
        waits = {
            t: asyncio.create_task(b.wait(t, p.prompt_id, timeout=60)) for t, p in prompts.items()
        }
        for t, p in prompts.items():
            await began_waiting(b, t, p.prompt_id)
        reconnects = b._waiter.reconnects

        for slot in slots:
            assert move_slot(own_cluster, slot, source, target) > 0
        for t in moving:
            node = redis.Redis(port=target).execute_command(
                "CLUSTER", "COUNTKEYSINSLOT", slot_of(b.thread(t).items)
            )
            assert node > 0  # the thread's keys are on the new primary now
        # The server took the moved channels away (sunsubscribe): the waiter resubscribed
        # where the slots are now, and re-read every wait.
        await until(lambda: truthy(b._waiter.reconnects > reconnects), "the waiter reconnecting")
        for t, p in prompts.items():
            await began_waiting(b, t, p.prompt_id)
        assert not any(w.done() for w in waits.values())

        for t in threads:  # a surface whose slot map is stale: MOVED, followed
            routed = await person.post_item(t, {"content": [{"type": "text", "text": f"ann {t}"}]})
            assert routed.outcome == "answered" and routed.prompt_id == prompts[t].prompt_id
        for t in threads:
            answers = await asyncio.wait_for(waits[t], 20)
            assert [a.answer for a in answers] == [[f"ann {t}"]]
        await b.settle()
        for t, p in prompts.items():
            record = await person.get_prompt(t, p.prompt_id)
            assert record.state == "answered" and record.delivered_at is not None
            items = await person.items(t)
            assert [i.type for i in items].count("pending_prompt") == 1
            assert [i.text for i in items].count(f"ann {t}") == 1
        assert await person.open_prompts() == []
        for t in moving:
            assert b.redis.get_node_from_key(b.thread(t).items).port == target  # type: ignore[attr-defined]


async def test_an_answer_while_the_threads_keys_are_split(own_cluster: RedisClusterNodes) -> None:
    """Mid-move, some of the thread's keys on each primary: its scripts cannot run on either
    (TRYAGAIN, then redis-py gives up). The answer is refused as `BrokerUnavailable`, having
    done nothing; the prompt is still pending and the wait held; once the slot has moved the
    surface's retry answers it, once."""
    settings = Settings(key_prefix="r" + uuid.uuid4().hex[:8], sweep_interval=600)
    async with (
        Broker.from_url(own_cluster.url, settings, cluster=True) as b,
        Broker.from_url(own_cluster.url, settings, cluster=True) as person,
    ):
        await b.redis.initialize()  # type: ignore[attr-defined]
        ports = sorted(_primaries(own_cluster))
        source, target = ports[2], ports[0]
        thread = next(
            t
            for t in (f"h{i}" for i in range(400))
            if b.redis.get_node_from_key(b.thread(t).items).port == source  # type: ignore[attr-defined]
        )
        slot = b.redis.keyslot(b.thread(thread).items)  # type: ignore[attr-defined]
        await b.sessions.create(thread, "scripted")
        p = await b.ask(thread, "text", [Question(question="Name?")])
        waiting = asyncio.create_task(b.wait(thread, p.prompt_id, timeout=60))
        await began_waiting(b, thread, p.prompt_id)
        move_slot(own_cluster, slot, source, target, first=1)
        with pytest.raises(BrokerUnavailable) as refused:
            await person.post_item(thread, {"content": [{"type": "text", "text": "early"}]})
        assert refused.value.took_effect is False
        assert not waiting.done()
        finish_move(own_cluster, slot, source, target)
        assert (await person.get_prompt(thread, p.prompt_id)).state == "pending"
        routed = await person.post_item(thread, {"content": [{"type": "text", "text": "Ann"}]})
        assert routed.outcome == "answered"
        assert [a.answer for a in await asyncio.wait_for(waiting, 20)] == [["Ann"]]
        texts = [i.text for i in await person.items(thread)]
        assert "early" not in texts and texts.count("Ann") == 1
