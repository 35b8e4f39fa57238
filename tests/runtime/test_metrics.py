"""Metrics, read from `/metrics` of a real ops endpoint, on a real redis-server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker import Broker
from tests.helpers import expire, index_count, text, until
from workers.runtime import metrics
from workers.runtime.health import probe, serve_ops
from workers.runtime.metrics import FleetSampler
from workers.runtime.replica import Replica

pytestmark = pytest.mark.real_redis

QUESTION = {"question": "Target?", "options": [{"label": "staging"}, {"label": "production"}]}


@pytest.fixture
def backend() -> str:
    return "real"


async def ready() -> str | None:
    return None


@pytest.fixture
async def scrape() -> AsyncIterator[Any]:
    """Read a metric's value from the process's `/metrics` (0 for a series not there yet)."""
    async with serve_ops(ready, 0, host="127.0.0.1") as port:

        async def read(name: str, **labels: str) -> float:
            status, body = await probe(port, "/metrics")
            assert status == 200
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    if sample.name == name and sample.labels == labels:
                        return float(sample.value)
            return 0.0

        yield read


async def test_fleet_metrics_follow_prompts_and_resolutions(broker: Broker, scrape: Any) -> None:
    """Open prompts by kind and the oldest's age; an answer counts by outcome, source and
    surface and lands in time to answer; a cancellation counts as cancelled; the audit backlog
    and lag show the resolutions not yet audited."""
    sampler = FleetSampler(broker.redis, broker.keys, 5000, interval=60)
    await sampler.sample()
    answered = await scrape(
        "prompt_broker_resolutions_total", outcome="answered", source="text", surface="cli"
    )
    cancelled = await scrape(
        "prompt_broker_resolutions_total", outcome="cancelled", source="none", surface="none"
    )
    timed = await scrape("prompt_broker_time_to_answer_seconds_count", outcome="answered")

    await broker.ask("t1", "ask_user_question", [QUESTION])
    await broker.ask("t2", "ask_user_question", [QUESTION])
    await asyncio.sleep(0.3)
    await sampler.sample()
    assert await scrape("prompt_broker_open_prompts", kind="ask_user_question") == 2
    assert await scrape("prompt_broker_open_prompts", kind="approval") == 0
    assert await scrape("prompt_broker_oldest_open_prompt_age_seconds") >= 0.3
    # Asked through the library on threads with no session: no replica's to hold, not unheld
    # (test_health.py shows a paused replica's prompt counted).
    assert await scrape("prompt_broker_oldest_unheld_prompt_age_seconds") == 0

    await broker.post_item("t1", text("2"), surface="cli")
    await broker.cancel("t2", "changed my mind")
    await sampler.sample()
    assert await scrape("prompt_broker_open_prompts", kind="ask_user_question") == 0
    assert await scrape("prompt_broker_oldest_open_prompt_age_seconds") == 0
    assert (
        await scrape(
            "prompt_broker_resolutions_total", outcome="answered", source="text", surface="cli"
        )
        == answered + 1
    )
    assert (
        await scrape(
            "prompt_broker_resolutions_total", outcome="cancelled", source="none", surface="none"
        )
        == cancelled + 1
    )
    assert (
        await scrape("prompt_broker_time_to_answer_seconds_count", outcome="answered") == timed + 1
    )
    # The answer waits for its audit item (no audit worker runs here).
    backlog = await index_count(broker, "audit")
    assert backlog >= 1 and await scrape("prompt_broker_audit_backlog") == backlog
    await asyncio.sleep(0.2)
    await sampler.sample()
    assert await scrape("prompt_broker_audit_lag_seconds") >= 0.2
    # A second sample counts nothing twice.
    await sampler.sample()
    assert (
        await scrape("prompt_broker_time_to_answer_seconds_count", outcome="answered") == timed + 1
    )


async def test_a_released_threads_adoption_wait_is_not_timed_from_the_epoch(
    make_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A clean stop indexes its threads with score 0 (taken first, at no known time): their
    adoption is logged with the thread counted but no wait, where a new thread's wait is its
    time since creation (seconds, not the epoch's 1.8e9)."""
    caplog.set_level(logging.INFO, logger="workers")
    b = await make_broker(lease_ttl=1.0, adopt_interval=0.05, sweep_interval=0.5)
    await b.sessions.create("fresh", "scripted", "approval", {})
    await b.sessions.create("given", "scripted", "approval", {})
    inc, _, _ = await b.sessions.join("gone", 60_000)
    epoch = await b.sessions.claim("given", "gone", inc)
    assert epoch is not None
    assert await b.sessions.release_all("gone", inc, {"given": epoch}) == 1
    replica = Replica(b, None, "m1")
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    try:

        async def both() -> bool:
            return {"fresh", "given"} <= set(replica.threads)

        await until(both, "both threads adopted", 15)
    finally:
        stop.set()
        await task
    records = [r for r in caplog.records if r.getMessage() == "replica.adopted"]
    assert sum(r.__dict__["threads"] for r in records) == 2
    waits = [w for r in records for w in r.__dict__["waited_s"]]
    assert len(waits) == 1 and 0 <= waits[0] < 60


async def test_turns_and_adoptions_counted(make_broker: Any, scrape: Any) -> None:
    """A replica's harnesses count their turns by harness and outcome; its adoptions count
    from the log event it writes."""
    b = await make_broker(lease_ttl=1.0, adopt_interval=0.05, sweep_interval=0.5)
    replica = Replica(b, None, "m1")
    metrics.instrument(replica.harnesses)
    metrics.count_logs()
    completed = await scrape("prompt_broker_turns_total", harness="scripted", outcome="completed")
    adopted = await scrape("prompt_broker_adoptions_total")
    waits = await scrape("prompt_broker_adoption_wait_seconds_count")
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    try:
        await b.sessions.create("t1", "scripted", "approval", {}, work_folder="/w")
        await b.post_item("t1", text("go"))

        async def asked() -> bool:
            return bool(await b.open_prompts())

        await until(asked, "the scripted agent's question", 15)
        assert await scrape("prompt_broker_adoptions_total") == adopted + 1
        assert await scrape("prompt_broker_adoption_wait_seconds_count") == waits + 1  # its wait
        [open_prompt] = await b.open_prompts()
        await b.post_item("t1", text("1"))

        async def done() -> bool:
            n = await scrape("prompt_broker_turns_total", harness="scripted", outcome="completed")
            return bool(n == completed + 1)

        await until(done, "the turn counted as completed", 15)
        assert await scrape("prompt_broker_turn_seconds_count", harness="scripted") >= 1
        assert open_prompt.thread_id == "t1"
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_ops_endpoint_paths(scrape: Any) -> None:
    async with serve_ops(ready, 0, host="127.0.0.1") as port:
        assert (await probe(port, "/livez"))[0] == 200
        assert (await probe(port, "/readyz"))[0] == 200
        assert (await probe(port, "/nope"))[0] == 404

    async def not_ready() -> str | None:
        return "redis: down"

    async with serve_ops(not_ready, 0, host="127.0.0.1") as port:
        assert await probe(port, "/readyz") == (503, "redis: down")


def test_counting_log_events_prints_nothing_more(caplog: pytest.LogCaptureFixture) -> None:
    """An event counted from the log is counted at any log level, and printed only if the
    process's level says so."""
    metrics.count_logs()
    logging.getLogger().setLevel(logging.WARNING)
    before = metrics.DEMOTED._value.get()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("workers.runtime.replica").info("wait.demoted", extra={"thread_id": "t"})
    assert metrics.DEMOTED._value.get() == before + 1
    assert not [r for r in caplog.records if r.msg == "wait.demoted"]
    with caplog.at_level(logging.INFO):
        logging.getLogger("workers.runtime.replica").info("wait.demoted", extra={"thread_id": "t"})
    assert metrics.DEMOTED._value.get() == before + 2
    assert [r for r in caplog.records if r.msg == "wait.demoted"]


async def test_cancelled_as_the_turn_fails_leaves_no_unretrieved_error() -> None:
    """The turn-timeout wrapper cancelled (its thread lost) just after the harness's turn ended
    with an error: the error is retrieved, the cancellation propagates, asyncio reports nothing."""
    import dataclasses
    import gc

    from workers.agents.harness import Turn

    started, go = asyncio.Event(), asyncio.Event()

    class Failing:
        name = "failing"

        async def run_turn(self, turn: Turn) -> Any:
            started.set()
            await go.wait()
            raise RuntimeError("lost")

    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        harness: Any = metrics._Instrumented(Failing(), turn_timeout=60)  # type: ignore[arg-type]
        turn = Turn("t1", "go", "approval", {}, None, None, None)  # type: ignore[arg-type]
        outer = asyncio.ensure_future(harness.run_turn(dataclasses.replace(turn)))
        await started.wait()
        go.set()
        await asyncio.sleep(0)  # the harness's turn fails; the wrapper is not resumed yet
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        del outer
        gc.collect()
        await asyncio.sleep(0)
        assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
    finally:
        loop.set_exception_handler(None)


async def test_a_late_heartbeat_and_an_expired_record_are_logged_and_counted(
    make_broker: Any, scrape: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A beat that ends past half a lease TTL after the last one that got through began is
    logged (`replica.beat_late`, with the gap and the write's own time) and counted; one on time
    is neither. A beat that finds the record run out logs `replica.expired` with the gap too, and
    is counted."""
    b = await make_broker(lease_ttl=1.0)
    replica = Replica(b, None, "hb1")
    metrics.count_logs()
    late = await scrape("prompt_broker_heartbeats_late_total")
    expired = await scrape("prompt_broker_replica_expirations_total")
    with caplog.at_level(logging.WARNING, logger="workers.runtime.replica"):
        await replica._join()
        await replica._heartbeat()  # on time: just after the join
        assert [r.msg for r in caplog.records] == []
        # As if the loop had been held up: the last beat began 0.7 s ago (TTL 1 s).
        assert replica._last_beat is not None
        replica._last_beat -= 0.7
        await replica._heartbeat()
        [record] = [r for r in caplog.records if r.msg == "replica.beat_late"]
        assert record.gap_s >= 0.7 and record.beat_s < 0.5 and record.lease_ttl == 1.0
        assert await scrape("prompt_broker_heartbeats_late_total") == late + 1
        caplog.clear()
        await replica._heartbeat()  # on time again
        assert [r.msg for r in caplog.records] == []
        # A beat that starts on time but whose write takes 0.6 s (a pool with no connection
        # free, a slow Redis): late too, and its own time says why.
        beat = b.sessions.beat

        async def slow_beat(*args: Any) -> int | None:
            await asyncio.sleep(0.6)
            return await beat(*args)

        b.sessions.beat = slow_beat  # type: ignore[method-assign]
        await replica._heartbeat()
        b.sessions.beat = beat  # type: ignore[method-assign]
        [record] = [r for r in caplog.records if r.msg == "replica.beat_late"]
        assert record.gap_s >= 0.6 and record.beat_s >= 0.6
        assert await scrape("prompt_broker_heartbeats_late_total") == late + 2
        caplog.clear()
        # Its record runs out (a pause past the TTL): the next beat finds it dead.
        await expire(b, "hb1")
        await replica._heartbeat()
        [record] = [r for r in caplog.records if r.msg == "replica.expired"]
        assert record.gap_s is not None and record.gap_s < 0.7 and record.lease_ttl == 1.0
        assert await scrape("prompt_broker_replica_expirations_total") == expired + 1
        assert await scrape("prompt_broker_heartbeats_late_total") == late + 2
