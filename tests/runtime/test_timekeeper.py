"""The timekeeper (workers/runtime/timekeeper.py) carries out timings: reminders and escalation
as events, the deadline as a cancel with reason `expired`; each once across audit workers, on
server time, through kill -9 and restarts. Real processes on a real redis-server of the test's
own and on the session's Redis Cluster, and in-process timekeepers where the point is a race."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from broker import Broker, Prompt, PromptCancelled, Settings, Timing
from broker.events import Event, read_after
from tests.conftest import cluster_runs_wanted, free_port
from tests.helpers import cli, drop_indexes, eventually, fleet_env, index_count, process
from workers.runtime.timekeeper import Timekeeper

pytestmark = [pytest.mark.real_redis]

Q = {"question": "Target?", "options": [{"label": "staging"}, {"label": "production"}]}
PICK = (
    '{"turns": [{"steps": [{"ask": [{"question": "Pick one", "header": "pick", '
    '"options": [{"label": "A"}, {"label": "B"}]}]}, {"say": "after the question"}]}]}'
)


@pytest.fixture
def env(fleet_redis: tuple[str, dict[str, str]]) -> dict[str, str]:
    """A private server of the test's own, or the session's cluster (`where` in conftest.py)."""
    url, chosen = fleet_redis
    return fleet_env(url, **chosen, ADOPT_INTERVAL="0.3", OPS_TURN_TIMEOUT="0")


T = TypeVar("T")


def through_broker(env: dict[str, str], look: Callable[[Broker], Awaitable[T]]) -> T:
    """`look` run with a Broker of the fleet's settings (its prefix, and on the cluster its
    cluster client): the records read, or written, as the fleet keeps them, wherever they live."""

    async def go() -> T:
        async with Broker.from_url(settings=Settings.from_env(env)) as b:
            return await look(b)

    return asyncio.run(go())


async def _events(b: Broker, prompt_id: str | None = None) -> list[Event]:
    got = await read_after(b.redis, b.keys, "0-0", count=100_000)
    return [e for e in got if prompt_id is None or e.prompt_id == prompt_id]


@contextlib.contextmanager
def audit_worker(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """`prompt-broker audit` (it runs a timekeeper), once its ops endpoint says it is ready: a
    loaded machine may take seconds to start one, and the test's clock must not start before."""
    port = str(free_port())
    with process(["audit"], env | {"PROMPT_BROKER_OPS_PORT": port}) as proc:
        eventually(
            lambda: cli("health", "audit", "--port", port, env=env).returncode == 0,
            "the audit worker ready",
            30,
        )
        yield proc


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def set_timing(env: dict[str, str], thread_id: str, timing: Timing) -> None:
    through_broker(env, lambda b: b.set_timing(thread_id, timing))


@pytest.mark.slow
def test_a_held_question_is_reminded_escalated_and_expires_once(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Two audit workers: the reminder and the escalation come once each, then the prompt is
    cancelled `expired` (never answered) and its agent is told."""
    script = tmp_path / "script.json"
    script.write_text(PICK)
    with process(["worker"], env), audit_worker(env), audit_worker(env):
        made = cli("thread", "new", "t1", "--script", str(script), env=env)
        assert made.returncode == 0, made.stderr
        set_timing(env, "t1", Timing(remind=(2,), escalate=3, escalate_to="oncall", deadline=5))
        assert cli("answer", "t1", "go", env=env).returncode == 0
        opened = eventually(lambda: through_broker(env, lambda b: b.open_prompts()), "the question")
        [prompt_id] = [p.prompt_id for p in opened]

        def prompt() -> Prompt:
            return through_broker(env, lambda b: b.get_prompt("t1", prompt_id))

        eventually(lambda: prompt().state == "cancelled", "the expiry", 20)
        time.sleep(1.0)  # both look again: nothing more happens
        p = prompt()
        assert p.reason == "expired" and p.answers is None
        assert p.escalated_to == "oncall"
        got = through_broker(env, lambda b: _events(b, prompt_id))
        names = [e.name for e in got]
        assert names == ["prompt.opened", "prompt.reminder", "prompt.escalated", "prompt.cancelled"]
        created = int(p.created_at.timestamp() * 1000)
        at = [e.at_ms - created for e in got]
        assert 2000 <= at[1] < 3500 and 3000 <= at[2] < 4500 and 5000 <= at[3] < 7000, at
        out = eventually(
            lambda: "expired" in (s := cli("show", "t1", env=env).stdout) and s, "told"
        )
        assert "approved" not in out.lower().replace("not approved", "")


@pytest.mark.slow
def test_kill_9_of_a_timekeeper_loses_no_deadline_and_repeats_nothing(env: dict[str, str]) -> None:
    """40 prompts with a reminder at 1 s and a deadline at 2.5 s; one of two audit workers is
    killed with SIGKILL midway, and a third starts later: every prompt expires exactly once, no
    reminder comes twice."""
    n = 40

    async def ask_all(b: Broker) -> list[str]:
        ids = []
        for i in range(n):
            t = f"k{i}"
            await b.post_item(t, {"author": "alice", "content": [{"type": "text", "text": "hi"}]})
            await b.set_timing(t, Timing(remind=(1,), deadline=2.5))
            ids.append((await b.ask(t, "ask_user_question", [Q])).prompt_id)
            await asyncio.sleep(0.05)  # spread over 2 s: the kill lands among their steps
        return ids

    async def states(b: Broker) -> list[Prompt]:
        return [await b.get_prompt(f"k{i}", p) for i, p in enumerate(ids)]

    with audit_worker(env) as first, audit_worker(env):
        ids = through_broker(env, ask_all)
        first.send_signal(signal.SIGKILL)
        first.wait(5)
        with audit_worker(env):
            eventually(
                lambda: all(p.state == "cancelled" for p in through_broker(env, states)),
                "every prompt expired",
                30,
            )
            time.sleep(1.0)
    counts = Counter((e.prompt_id, e.name) for e in through_broker(env, _events))
    for p in through_broker(env, states):
        assert p.reason == "expired"
        assert counts[(p.prompt_id, "prompt.cancelled")] == 1
        assert counts[(p.prompt_id, "prompt.reminder")] <= 1  # at most once, even across the kill
    # A reminder is lost only if the kill fell between taking it and writing its event.
    assert sum(counts[(p, "prompt.reminder")] for p in ids) >= n - 1


async def test_racing_timekeepers_take_every_step_once(make_broker: Any) -> None:
    """Three timekeepers on three connections, 30 prompts: each reminder and escalation once,
    each expiry once; waiters learn `expired`."""
    brokers = [await make_broker() for _ in range(3)]
    b = brokers[0]
    ids = []
    for i in range(30):
        ids.append((await b.ask(f"r{i}", "ask_user_question", [Q])).prompt_id)
        await b.set_timing(
            f"r{i}",
            # 400 ms between steps: a look every 20 ms by each of three timekeepers must fall
            # between any two of them, or the steps come due together and are taken as one
            # (step.lua). At 100 ms, then at 200 ms apart, a slow host running the whole suite
            # missed one on the cluster (a reminder counted once).
            Timing(remind=(0.8, 1.6), escalate=1.2, escalate_to="leads", deadline=2.4),
            prompt_id=ids[-1],
        )
    waits = [asyncio.create_task(b.wait(f"r{i}", p, timeout=10)) for i, p in enumerate(ids)]
    keepers = [Timekeeper(x, interval=0.02) for x in brokers]
    tasks = [asyncio.create_task(k.run()) for k in keepers]
    try:
        for w in waits:
            with pytest.raises(PromptCancelled) as e:
                await w
            assert e.value.reason == "expired"
        await asyncio.sleep(0.2)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    counts: Counter[tuple[str, str]] = Counter()
    for _, fields in await b.redis.xrange(f"{b.keys.prefix}:events"):
        f = {_text(k): _text(v) for k, v in fields.items()}
        counts[(f["prompt"], f["event"])] += 1
    for p in ids:
        assert counts[(p, "prompt.reminder")] == 2
        assert counts[(p, "prompt.escalated")] == 1
        assert counts[(p, "prompt.cancelled")] == 1
    assert await index_count(b, "due") == 0  # nothing left to look at


async def test_what_opened_while_no_timekeeper_ran_is_found(make_broker: Any) -> None:
    """A thread's timing reaches a prompt asked while no timekeeper ran (the first look scans
    the open prompts), and one asked while it runs (it follows the event log)."""
    b = await make_broker()
    await b.post_item("w", {"author": "alice", "content": [{"type": "text", "text": "hi"}]})
    await b.set_timing("w", Timing(deadline=0.3))
    before = await b.ask("w", "ask_user_question", [Q])
    await drop_indexes(b, "due")  # as if it had never been scheduled
    keeper = Timekeeper(b, interval=0.02)
    task = asyncio.create_task(keeper.run())
    try:
        with pytest.raises(PromptCancelled):
            await b.wait("w", before.prompt_id, timeout=5)
        later = await b.ask("w", "ask_user_question", [Q])
        started = time.monotonic()
        with pytest.raises(PromptCancelled) as e:
            await b.wait("w", later.prompt_id, timeout=5)
        assert e.value.reason == "expired" and time.monotonic() - started >= 0.25
        untimed = await b.ask("u", "ask_user_question", [Q])
        await asyncio.sleep(0.5)
        assert (await b.get_prompt("u", untimed.prompt_id)).state == "pending"  # no timing: none
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


ON_CLUSTER = [pytest.param("cluster", marks=pytest.mark.cluster)] if cluster_runs_wanted() else []


@pytest.fixture(params=["real", *ON_CLUSTER])
def backend(request: pytest.FixtureRequest) -> str:
    """The in-process timekeepers: the real server, and the session's cluster too."""
    return str(request.param)


async def test_a_cancel_that_fails_is_tried_again_later_not_in_a_loop(
    make_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expiries whose cancel fails (Redis refusing, say) leave the look at once, a full page of
    them too, and are tried again a second later, when they succeed."""
    from broker import BrokerUnavailable
    from workers.runtime import timekeeper

    monkeypatch.setattr(timekeeper, "PAGE", 1)  # two failing prompts are two full pages
    b = await make_broker()
    prompts = [await b.ask(f"f{i}", "ask_user_question", [Q]) for i in range(2)]
    for p in prompts:
        await b.set_timing(p.thread_id, Timing(deadline=0.05), prompt_id=p.prompt_id)
    await asyncio.sleep(0.1)
    real_cancel, calls = b.cancel, []

    async def refusing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) <= 2:
            raise BrokerUnavailable("cancelling", OSError("refused"), False, refused=True)
        return await real_cancel(*args, **kwargs)

    monkeypatch.setattr(b, "cancel", refusing)
    keeper = Timekeeper(b, interval=0.02)
    await asyncio.wait_for(keeper.take_due(), 5)  # returns: the failed ones are not retaken now
    assert len(calls) == 2
    for p in prompts:
        assert (await b.get_prompt(p.thread_id, p.prompt_id)).state == "pending"
    await asyncio.sleep(1.1)
    await keeper.take_due()
    assert len(calls) == 4
    for p in prompts:
        assert (await b.get_prompt(p.thread_id, p.prompt_id)).reason == "expired"


async def test_an_unreachable_cluster_is_an_outage_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No node of the cluster answers: the timekeeper's cluster client (the one `keeping_time`
    gets, broker/_cluster.py) raises a RedisError, not redis-py's RedisClusterException, so it is
    logged as the outage it is, a `timing.look_failed` warning, never a crash with a traceback."""
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}", redis_cluster=True)
    async with Broker.from_url(settings=settings) as b:
        keeper = Timekeeper(b, interval=0.05)
        with caplog.at_level("WARNING", logger="workers.runtime.timekeeper"):
            task = asyncio.create_task(keeper.run())
            await asyncio.sleep(0.4)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    events = [r.getMessage() for r in caplog.records if r.name == "workers.runtime.timekeeper"]
    assert "timing.look_failed" in events
    assert "timing.look_crashed" not in events
