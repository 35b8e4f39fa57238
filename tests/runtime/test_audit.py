"""The audit path: `pending_prompt_resolved` lands once, after delivery, and never uninvited."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import arq.worker
import pytest
from arq.connections import ArqRedis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import WatchError

from broker import Broker, PromptCancelled, Settings
from tests.conftest import BrokerFactory, ClientFactory, delete_prefix
from tests.helpers import (
    drop_indexes,
    index_add,
    index_count,
    index_members,
    run_audit_worker,
    text,
    until,
)
from workers.runtime import audit

APPROVAL = {"question": "Run `rm -rf build`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


def resolutions(items: list[Any], prompt_id: str) -> list[Any]:
    return [
        i
        for i in items
        if i.type == "pending_prompt_resolved" and i.metadata["prompt"]["prompt_id"] == prompt_id
    ]


RunWorker = Callable[[Broker], Awaitable[None]]


@pytest.fixture
def run_worker(make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch) -> RunWorker:
    """Run the arq audit worker on this test's server until its queue is empty."""
    # arq logs the server's INFO at start; fakeredis has no INFO. Logging only.
    monkeypatch.setattr(arq.worker, "log_redis_info", _no_info)

    async def run(broker: Broker) -> None:
        client: Any = make_client(decode_responses=False)
        if isinstance(client, RedisCluster):  # arq works on the primary owning the queue's slot
            await client.initialize()
            node = client.get_node_from_key(broker.keys.audit_queue)
            pool = ArqRedis(host=node.host, port=node.port)
        else:
            pool = ArqRedis(connection_pool=client.connection_pool)
        await run_audit_worker(broker, pool)

    return run


async def _no_info(*_: object) -> None:
    return None


async def test_answer_audited_once_after_delivery(broker: Broker, run_worker: RunWorker) -> None:
    """A delivered answer's resolution lands once, with the answers the agent was given."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item("t", text("yes"))
    answers = await broker.wait("t", p.prompt_id, timeout=5)
    await broker.settle()
    await run_worker(broker)
    [res] = resolutions(await broker.items("t"), p.prompt_id)
    assert res.metadata["prompt"] == {
        "prompt_id": p.prompt_id,
        "kind": "approval",
        "prompt_state": "answered",
        "answers": [a.model_dump() for a in answers],
    }
    assert res.text == "✓ Answered: Approve"
    assert res.author == broker.identity
    assert await index_count(broker, "audit") == 0


async def test_undelivered_answer_never_posted(broker: Broker, run_worker: RunWorker) -> None:
    """An answer no waiter received is not audited, by the job or by reconcile."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item("t", text("no"))
    assert await broker.post_resolution("t", p.prompt_id) is None
    await broker.enqueue_audit("t", p.prompt_id)
    await audit.reconcile({"broker": broker})
    await run_worker(broker)
    assert resolutions(await broker.items("t"), p.prompt_id) == []
    assert (await broker.get_prompt("t", p.prompt_id)).audit_item_id is None


async def test_cancel_audited_with_reason(broker: Broker, run_worker: RunWorker) -> None:
    """A cancelled prompt's resolution carries the reason and no answers."""
    p = await broker.ask("t", "text", [{"question": "Name?"}])
    await broker.cancel("t", "the run ended")
    await run_worker(broker)
    [res] = resolutions(await broker.items("t"), p.prompt_id)
    assert res.metadata["prompt"] == {
        "prompt_id": p.prompt_id,
        "kind": "text",
        "prompt_state": "cancelled",
        "reason": "the run ended",
    }
    assert res.text == "✗ Cancelled: the run ended"


async def test_racing_posters_post_one_resolution(make_broker: BrokerFactory) -> None:
    """Ten brokers posting the same resolution at once produce exactly one item."""
    brokers = [await make_broker() for _ in range(10)]
    p = await brokers[0].ask("t", "approval", [APPROVAL])
    await brokers[1].post_item("t", text("ok"))
    await brokers[0].wait("t", p.prompt_id, timeout=5)
    await brokers[0].settle()
    ids = await asyncio.gather(*(b.post_resolution("t", p.prompt_id) for b in brokers))
    assert len(set(ids)) == 1 and ids[0] is not None
    assert len(resolutions(await brokers[0].items("t"), p.prompt_id)) == 1


async def test_superseded_prompt_audited(broker: Broker, run_worker: RunWorker) -> None:
    """A superseded prompt gets a cancelled resolution with reason `superseded`."""
    p1 = await broker.ask("t", "approval", [APPROVAL])
    await broker.ask("t", "approval", [APPROVAL])
    with pytest.raises(PromptCancelled):
        await broker.wait("t", p1.prompt_id, timeout=5)
    await run_worker(broker)
    [res] = resolutions(await broker.items("t"), p1.prompt_id)
    assert res.metadata["prompt"]["reason"] == "superseded"


async def test_rebuild_restores_lost_indexes(broker: Broker, run_worker: RunWorker) -> None:
    """The sweep rebuilds `open` and `audit` from the prompt records alone."""
    open_p = await broker.ask("a", "approval", [APPROVAL])
    gone = await broker.ask("b", "approval", [APPROVAL])
    await broker.cancel("b", "stop")
    await drop_indexes(broker, "open", "audit")
    counts = await audit.rebuild_indexes(broker)
    assert counts["scanned"] == 2
    assert [p.prompt_id for p in await broker.open_prompts()] == [open_p.prompt_id]
    assert await index_members(broker, "audit") == [f"b/{gone.prompt_id}"]
    await audit.reconcile({"broker": broker, "runs": 1})
    await run_worker(broker)
    assert len(resolutions(await broker.items("b"), gone.prompt_id)) == 1


async def test_the_full_sweep_rebuilds_the_lease_indexes(broker: Broker) -> None:
    """A thread whose lease index entry was lost (a failover) is found again by the sweep the
    reconcile job runs every tenth time, so a replica can claim it."""
    await broker.sessions.create("lost", "scripted", "approval", {})
    await drop_indexes(broker, "leases")
    counts = await audit.reconcile({"broker": broker, "runs": 1})  # not a full sweep
    assert "leases_unowned" not in counts and await index_count(broker, "leases") == 0
    counts = await audit.reconcile({"broker": broker, "runs": 0})  # the next one is
    assert counts["leases_unowned"] == 1
    assert await index_members(broker, "leases") in (["lost"], [b"lost"])


async def test_rebuild_drops_index_entries_with_no_record(broker: Broker) -> None:
    """Members of `open` and `audit` whose prompt record is gone are dropped; the rest stay."""
    kept = await broker.ask("a", "approval", [APPROVAL])
    ghost = "a/prm_01M8RJEMZ5NYSK2HZD2KRBPC1M"
    await index_add(broker, "open", {ghost: 1})
    await index_add(broker, "audit", {ghost: 1, "z/prm_01M8RJEV25K476KJ4FB2CMSEME": 2})
    counts = await audit.rebuild_indexes(broker)
    assert counts["orphans"] == 3
    assert await index_members(broker, "open") == [f"a/{kept.prompt_id}"]
    assert await index_members(broker, "audit") == []


@pytest.mark.real_redis
async def test_serve_rides_out_a_watch_error(
    real_redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection lost under arq's WATCH stops its worker with a WatchError: `serve` takes it as
    a disconnect and starts another worker, which posts the resolution."""
    runs: list[int] = []
    run = audit.AuditWorker.async_run

    async def lose_the_watch_once(self: audit.AuditWorker) -> None:
        runs.append(1)
        if len(runs) == 1:
            raise WatchError("A ConnectionError occurred on while watching one or more keys")
        await run(self)

    monkeypatch.setattr(audit.AuditWorker, "async_run", lose_the_watch_once)
    settings = Settings(redis_url=real_redis_url, key_prefix=prefix)
    broker = Broker.from_url(real_redis_url, settings)
    serving = asyncio.create_task(audit.serve(settings))
    try:
        p = await broker.ask("t", "approval", [APPROVAL])
        await broker.post_item("t", text("yes"))
        await broker.wait("t", p.prompt_id, timeout=5)
        await broker.settle()

        async def posted() -> bool:
            return bool(resolutions(await broker.items("t"), p.prompt_id))

        await until(posted, "the resolution, posted by the second worker", 20)
        assert len(runs) == 2 and not serving.done()
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await delete_prefix(broker.redis, prefix)
        await broker.aclose()


# -- arq's queue on a Redis of its own (PROMPT_BROKER_QUEUE_URL) -------------------------------


async def _run_worker_on(broker: Broker, queue: ArqRedis) -> None:
    """The audit worker as `prompt-broker audit` runs it with a queue URL: arq on that Redis."""
    settings = audit.worker_settings(broker.settings)["redis_settings"]
    assert settings.port == queue.connection_pool.connection_kwargs["port"]
    await run_audit_worker(broker, queue)


async def test_with_a_queue_url_the_audit_jobs_live_on_that_redis(
    make_broker: BrokerFactory,
    redis_server_factory: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `queue_url` the audit job of an answer, a cancel and a parked handover is enqueued
    on that Redis and none on the broker's own; the worker there posts each resolution once."""
    monkeypatch.setattr(arq.worker, "log_redis_info", _no_info)
    queue_server = redis_server_factory(appendonly=False)
    broker = await make_broker(queue_url=queue_server.url)
    answered = await broker.ask("qa", "approval", [APPROVAL])
    await broker.post_item("qa", text("yes"))
    await broker.wait("qa", answered.prompt_id, timeout=5)
    await broker.settle()
    cancelled = await broker.ask("qc", "approval", [APPROVAL])
    await broker.cancel("qc", "not needed")
    queue = ArqRedis.from_url(queue_server.url)
    try:
        queued = await queue.zrange(broker.keys.audit_queue, 0, -1)
        assert sorted(queued) == sorted(
            broker.keys.audit_job_id(t, p.prompt_id).encode()
            for t, p in (("qa", answered), ("qc", cancelled))
        )
        assert await broker.redis.exists(broker.keys.audit_queue) == 0
        await _run_worker_on(broker, queue)
        assert await queue.zcard(broker.keys.audit_queue) == 0
    finally:
        await queue.aclose(close_connection_pool=True)
    assert len(resolutions(await broker.items("qa"), answered.prompt_id)) == 1
    assert len(resolutions(await broker.items("qc"), cancelled.prompt_id)) == 1
    assert await index_count(broker, "audit") == 0


async def test_with_a_queue_url_the_audit_jobs_of_one_turn_share_a_round_trip(
    make_broker: BrokerFactory, redis_server_factory: Callable[..., Any]
) -> None:
    """Twenty deliveries recorded at once put twenty jobs on the queue's own Redis in a few
    round trips (coalesced), not one each: the socket reads that server processed are counted."""
    queue_server = redis_server_factory(appendonly=False)
    broker = await make_broker(queue_url=queue_server.url)
    threads = [f"batch-{i}" for i in range(20)]
    prompts = [await broker.ask(t, "approval", [APPROVAL]) for t in threads]
    for t in threads:
        await broker.post_item(t, text("yes"))
    for t, p in zip(threads, prompts, strict=True):
        await broker.wait(t, p.prompt_id, timeout=5, deliver=False)
    queue = ArqRedis.from_url(queue_server.url)
    try:
        before = (await queue.info("stats"))["total_reads_processed"]
        await asyncio.gather(
            *(broker.deliver(t, p.prompt_id) for t, p in zip(threads, prompts, strict=True))
        )
        reads = (await queue.info("stats"))["total_reads_processed"] - before
        queued = await queue.zrange(broker.keys.audit_queue, 0, -1)
    finally:
        await queue.aclose(close_connection_pool=True)
    assert sorted(queued) == sorted(
        broker.keys.audit_job_id(t, p.prompt_id).encode()
        for t, p in zip(threads, prompts, strict=True)
    )
    # Coalesced: 6-12 here, with the CPU busy or not (the deliveries end in a few waves, and
    # the second INFO counts); one round trip a job: 28-68 (new connections' handshakes too).
    assert reads <= 15, f"{reads} reads on the queue's Redis for 20 jobs"


async def test_a_queue_redis_down_leaves_the_answer_standing_and_reconcile_queues_it(
    make_broker: BrokerFactory,
    redis_server_factory: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The queue's Redis stopped: the answer is still delivered once and stays in the audit
    index, a warning says its job was not queued; with that Redis back, reconcile queues it
    and the worker posts it once."""
    monkeypatch.setattr(arq.worker, "log_redis_info", _no_info)
    queue_server = redis_server_factory(appendonly=False)
    port = queue_server.port
    queue_server.stop()
    broker = await make_broker(queue_url=queue_server.url, audit_grace=0)
    p = await broker.ask("down", "approval", [APPROVAL])
    await broker.post_item("down", text("yes"))
    [answer] = await broker.wait("down", p.prompt_id, timeout=5)
    assert answer.answer == ["Approve"]
    await broker.settle()
    assert (await broker.get_prompt("down", p.prompt_id)).delivered_at is not None
    assert [r.getMessage() for r in caplog.records if r.getMessage() == "prompt.audit_unqueued"]
    assert await index_members(broker, "audit") == [f"down/{p.prompt_id}"]
    back = redis_server_factory(appendonly=False)  # a fresh server in its place
    broker2 = await make_broker(queue_url=back.url, audit_grace=0)
    assert back.port != port  # a new server: nothing of the first survived
    counts = await audit.reconcile({"broker": broker2, "runs": 1})
    assert counts["requeued"] == 1
    queue = ArqRedis.from_url(back.url)
    try:
        await _run_worker_on(broker2, queue)
    finally:
        await queue.aclose(close_connection_pool=True)
    assert len(resolutions(await broker2.items("down"), p.prompt_id)) == 1
    assert await index_count(broker2, "audit") == 0
