"""The crash-test matrix: real replica processes on a real, private redis-server (and the
crashes of replicas on the session's Redis Cluster as well).

Every test starts its own redis-server (AOF on, `redis_server_factory`), a `Fleet` of replica
processes (`python -m workers.runtime.cli worker`) plus the audit worker on it, and a `Broker`
playing the person and the observer. Threads run scripted agents that ask an approval (`Bash`) and
then say something. A fault is injected (SIGKILL, CLIENT KILL of pub/sub, SIGSTOP/SIGCONT, a rolling
SIGTERM restart, a Redis kill -9 and restart) and the test checks, per thread, that nothing was
lost or doubled: one prompt, answered, delivered once (by the replica logs and the agent's
output), audited once, and a grant spent where the answer came back through a resume turn.

On a failure the fleet's logs are printed (pytest shows them under "Captured stdout").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import Broker, Item, Prompt, Session, Settings
from tests import helpers
from tests.conftest import OnCluster, RedisServer, delete_prefix
from tests.helpers import kill_pubsub, numsub, outputs, text
from workers.runtime.fleet import Fleet

pytestmark = pytest.mark.real_redis

#: Settings every fleet here runs with (the brief's): short leases, quick adoption sweeps.
BASE = {"key_prefix": "pp", "lease_ttl": 2.0, "adopt_interval": 0.1, "sweep_interval": 1.0}

T = TypeVar("T")


# -- the rig ---------------------------------------------------------------------------------------


@dataclass
class Rig:
    """A running fleet on a private server (or the session's cluster), and the person/observer's
    Broker."""

    server: RedisServer | OnCluster
    fleet: Fleet
    b: Broker
    settings: Settings
    logs: Path
    stopped: set[int] = field(default_factory=set)  # SIGSTOPped pids: SIGCONT before stopping


def dump_logs(logs: Path, tail: int = 400) -> None:
    """Print the last lines of every process's log (pytest shows them on failure)."""
    if not logs.is_dir():
        print(f"(no log dir at {logs})")
        return
    for path in sorted(logs.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        print(f"\n===== {path.name} ({len(lines)} lines, last {min(tail, len(lines))}) =====")
        print("\n".join(lines[-tail:]))


@contextlib.asynccontextmanager
async def running_fleet(
    server: RedisServer | OnCluster,
    tmp_path: Path,
    workers: int,
    *,
    restart: bool = False,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """Start `workers` replicas and the audit worker on `server`; always stop them after."""
    if isinstance(server, OnCluster):
        overrides = {"key_prefix": server.prefix, "redis_cluster": True} | overrides
    settings = Settings(redis_url=server.url, **(BASE | overrides))
    logs = tmp_path / "logs"
    fleet = Fleet(settings, workers=workers, restart=restart, log_dir=logs)
    b = Broker.from_url(server.url, settings)
    rig = Rig(server, fleet, b, settings, logs)
    try:
        await fleet.start(embedded=False)
        await fleet.ready()
        # arq writes its health-check key at the end of its first poll of the queue.
        health = b.keys.audit_queue + ":health-check"
        await until(lambda: b.redis.exists(health), 30, "the audit worker to poll its queue")
        yield rig
    except BaseException:
        dump_logs(logs)
        raise
    finally:
        for pid in rig.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await fleet.stop()
        if isinstance(server, OnCluster):
            await delete_prefix(b.redis, server.prefix)
        await b.aclose()


@pytest.fixture
def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory(appendonly=True)


# -- helpers ---------------------------------------------------------------------------------------


async def until(check: Callable[[], Awaitable[T | None]], within: float, what: str) -> T:
    """Poll `check` until it returns something truthy; a Redis hiccup counts as not yet."""
    redis_down = (RedisConnectionError, RedisTimeoutError, OSError)
    return await helpers.until(check, what, within, tolerate=redis_down)


def command(thread: str) -> str:
    return f"make {thread}"


def wrapped(thread: str) -> str:
    return f"{thread}: wrapped up."


#: How long a napping turn sleeps: it must end while its replica is paused (see test 3).
NAP = 1.0


def napped(thread: str) -> str:
    return f"{thread}: after the nap."


def script(thread: str) -> dict[str, Any]:
    """First message: ask an approval for one Bash call, then say something. Later messages
    `nap then say` / `nap then ask`: sleep NAP seconds, then post a line / ask another approval."""
    first = [
        {"tool": "Bash", "input": {"command": command(thread)}, "output": f"{thread} output"},
        {"say": wrapped(thread)},
    ]
    again = {"tool": "Bash", "input": {"command": f"{command(thread)}-again"}}
    return {
        "script": {
            "turns": [
                {"match": "nap then say", "steps": [{"sleep": NAP}, {"say": napped(thread)}]},
                {"match": "nap then ask", "steps": [{"sleep": NAP}, again]},
                {"steps": first},
            ]
        }
    }


#: How a replica's item begins when it finds a thread whose turn was cut off.
INTERRUPTED = "(the turn was interrupted: the replica running it stopped."


def interruptions(items: Iterable[Item]) -> list[str]:
    """The items that told the person a turn was cut off."""
    return [line for line in outputs(list(items)) if line.startswith(INTERRUPTED)]


def answer(approve: bool) -> dict[str, Any]:
    return text("yes" if approve else "no")


async def start_threads(b: Broker, threads: Iterable[str], within: float = 20) -> dict[str, Prompt]:
    """Create scripted threads, send each a first message, wait until each has asked."""
    threads = list(threads)
    for t in threads:
        await b.sessions.create(t, "scripted", "approval", script(t))
        await b.post_item(t, text("Please go ahead."))

    nudged = dict.fromkeys(threads, 0)

    async def asked() -> dict[str, Prompt] | None:
        prompts = {}
        for t in threads:
            p = await b.active_prompt(t)
            if p is None:
                # Not the fault under test: a stall longer than the lease (a loaded machine) can
                # cut a starting turn, which its next holder reports interrupted, the message
                # spent. Send it again.
                cut = len(interruptions(await b.items(t)))
                if cut > nudged[t]:
                    nudged[t] = cut
                    print(f"{t}: its first turn was interrupted during set-up; sent again")
                    await b.post_item(t, text("Please go ahead."))
                return None
            prompts[t] = p
        return prompts

    return await until(asked, within, "every thread's agent to ask its approval")


async def held_everywhere(b: Broker, threads: Iterable[str], within: float = 10) -> dict[str, str]:
    """Wait until every thread's agent waits, held, in a live turn; returns thread -> owner."""
    threads = list(threads)

    async def held() -> dict[str, str] | None:
        owners = {}
        for t in threads:
            s = await b.sessions.get(t)
            if s is None or s.waiting is None or s.status != "running" or not s.owner:
                return None
            owners[t] = s.owner
        return owners

    try:
        return await until(held, within, "every thread to hold its wait")
    except AssertionError as e:
        now = {t: await b.sessions.get(t) for t in threads}
        seen = {t: (s.owner, s.status, s.waiting) if s else None for t, s in now.items()}
        raise AssertionError(f"{e}; sessions: {seen}") from None


async def settled(b: Broker, threads: Iterable[str], within: float = 20) -> None:
    """Wait until every thread's turn ended, nothing waits, and every prompt was audited."""
    threads = list(threads)

    async def done() -> bool:
        for t in threads:
            s = await b.sessions.get(t)
            if s is None or s.status != "idle" or s.waiting is not None:
                return False
            items = await b.items(t)
            if not any(i.type == "turn_end" for i in items):
                return False
            asked = sum(1 for i in items if i.type == "pending_prompt")
            if sum(1 for i in items if i.type == "pending_prompt_resolved") < asked:
                return False
        return True

    await until(done, within, "every thread to finish its turn and be audited")


def log_events(logs: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Every JSON log line of the fleet's processes (or of one), tagged with its `process`."""
    out = []
    for path in sorted(logs.glob("*.log") if name is None else [logs / f"{name}.log"]):
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            event["process"] = path.stem
            out.append(event)
    return out


def deliveries(logs: Path, prompt_id: str) -> list[str]:
    """The processes that handed this prompt's answer to an agent, once per hand-over: a held
    wait's first delivery (`prompt.delivered`, first) or a resume turn (`turn.resume`)."""
    return [
        e["process"]
        for e in log_events(logs)
        if e.get("prompt_id") == prompt_id
        and (
            (e.get("event") == "prompt.delivered" and e.get("first"))
            or e.get("event") == "turn.resume"
        )
    ]


def _item_problems(items: list[Item], thread: str, prompt_id: str, approve: bool) -> list[str]:
    """What is wrong with a settled thread's items: its resolution, output, turn end."""
    problems: list[str] = []
    resolved = Counter(
        i.metadata["prompt"]["prompt_id"] for i in items if i.type == "pending_prompt_resolved"
    )
    if resolved != Counter({prompt_id: 1}):
        problems.append(f"resolution items {dict(resolved)} (expected one for {prompt_id})")
    lines = outputs(items)
    tool = f"{'Ran' if approve else 'Did not run'} Bash `{command(thread)}`"
    about = [line for line in lines if f"`{command(thread)}`" in line]
    if len(about) != 1 or not about[0].startswith(tool):
        problems.append(f"tool output {about!r} (expected one line starting {tool!r})")
    if lines.count(wrapped(thread)) != 1:
        problems.append(f"{wrapped(thread)!r} said {lines.count(wrapped(thread))} times")
    ends = [i.metadata.get("status") for i in items if i.type == "turn_end"]
    if ends != ["completed"]:
        problems.append(f"turn ends {ends} (expected one completed)")
    return problems


async def check_thread(
    rig: Rig, thread: str, approve: bool, granted: bool, delivered_by: str | None = None
) -> list[str]:
    """Everything wrong with one settled thread (empty when all is well).

    `granted`: the answer came back through a resume turn, so an approval is re-asked and answered
    by the one-shot grant (`approval_granted`). `delivered_by`: the replica that must have handed
    the answer over.
    """
    items = await rig.b.items(thread)
    asked = [i.metadata["prompt"]["prompt_id"] for i in items if i.type == "pending_prompt"]
    if len(asked) != 1:
        return [f"{len(asked)} pending_prompt items (expected 1)"]
    prompt = await rig.b.get_prompt(thread, asked[0])
    problems = _item_problems(items, thread, prompt.prompt_id, approve)
    if prompt.state != "answered" or prompt.delivered_at is None or not prompt.audit_item_id:
        problems.append(
            f"{prompt.prompt_id} is {prompt.state}, delivered at {prompt.delivered_at}, "
            f"audit item {prompt.audit_item_id}"
        )
    grants = sum(1 for i in items if i.type == "approval_granted")
    if grants != (1 if granted and approve else 0):
        problems.append(f"{grants} approval_granted items (granted={granted}, approve={approve})")
    by = deliveries(rig.logs, prompt.prompt_id)
    if len(by) != 1 or (delivered_by is not None and by != [delivered_by]):
        problems.append(f"answer handed over by {by} (expected once, by {delivered_by or 'any'})")
    return problems


async def check_all(rig: Rig, expect: dict[str, tuple[bool, bool, str | None]]) -> None:
    """`check_thread` on every thread; one assertion listing every problem found."""
    found = {}
    for thread, (approve, granted, by) in expect.items():
        problems = await check_thread(rig, thread, approve, granted, by)
        if problems:
            found[thread] = problems
            print(f"\n== {thread}")
            for item in await rig.b.items(thread):
                print(f"  {item.type or 'message':24} {item.author:14} {item.text[:100]!r}")
    assert not found, f"problems: {found}"


async def epochs(b: Broker, threads: Iterable[str]) -> dict[str, int]:
    out = {}
    for t in threads:
        s = await b.sessions.get(t)
        assert s is not None, f"{t} has no session"
        out[t] = s.epoch
    return out


async def adopted_from(
    b: Broker, victim: str, before: dict[str, int]
) -> dict[str, tuple[str, int]] | None:
    """thread -> (owner, epoch) once every thread of `before` is held by another replica than
    `victim` at a newer epoch than it had; else None."""
    now = {}
    for t, epoch in before.items():
        s = await b.sessions.get(t)
        if s is None or s.owner in ("", victim) or s.epoch <= epoch:
            return None
        now[t] = (s.owner, s.epoch)
    return now


async def prompts_of(b: Broker, threads: Iterable[str]) -> list[Prompt]:
    """Every prompt asked on these threads, as recorded now."""
    out = []
    for t in threads:
        for i in await b.items(t):
            if i.type == "pending_prompt":
                out.append(await b.get_prompt(t, i.metadata["prompt"]["prompt_id"]))
    return out


# -- 1. SIGKILL ------------------------------------------------------------------------------------


async def test_sigkill_replica_holding_waits(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """SIGKILL of a replica holding held waits: adopted within lease_ttl + 1 s, each answer
    delivered and audited exactly once, approvals resumed through a spent grant."""
    async with running_fleet(where, tmp_path, workers=3) as rig:
        b = rig.b
        threads = [f"kill{i}" for i in range(6)]
        await start_threads(b, threads)
        owners = await held_everywhere(b, threads)
        victim = Counter(owners.values()).most_common(1)[0][0]
        doomed = [t for t in threads if owners[t] == victim]
        assert len(doomed) >= 2, f"the victim holds {len(doomed)} waits: {owners}"
        before = await epochs(b, doomed)

        proc = rig.fleet.replica(victim).proc
        assert proc is not None
        killed_at = time.monotonic()
        rig.fleet.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 5)

        async def adoption(t: str) -> float:
            async def moved() -> float | None:
                if await adopted_from(b, victim, {t: before[t]}):
                    return time.monotonic() - killed_at
                return None

            return await until(moved, 10, f"{t} to be adopted")

        watch = [asyncio.create_task(adoption(t)) for t in doomed]
        approve = {t: i % 2 == 0 for i, t in enumerate(threads)}
        # The dead replica's threads are answered while it is dead, before anyone adopted them.
        for t in doomed:
            assert (await b.post_item(t, answer(approve[t]))).outcome == "answered"
        for t in threads:
            if t not in doomed:
                await b.post_item(t, answer(approve[t]))
        took = dict(zip(doomed, await asyncio.gather(*watch), strict=True))
        print(f"adopted after (s): {took}")
        assert max(took.values()) <= rig.settings.lease_ttl + 1.0, took

        await settled(b, threads)
        # The victim's threads: resumed by an adopter (a grant for approvals); the others were
        # delivered in place by the replica holding them.
        await check_all(
            rig,
            {t: (approve[t], t in doomed, None if t in doomed else owners[t]) for t in threads},
        )
        for p in await prompts_of(b, doomed):
            assert victim not in deliveries(rig.logs, p.prompt_id)


# -- 2. CLIENT KILL TYPE pubsub --------------------------------------------------------------------


async def test_pubsub_killed_between_resolve_and_delivery(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """CLIENT KILL of every replica's pub/sub connection (on a cluster: its sharded one on every
    node), answers posted at once: every held wait still completes in place, each answer
    delivered and audited exactly once."""
    async with running_fleet(where, tmp_path, workers=2) as rig:
        b = rig.b
        threads = [f"bell{i}" for i in range(6)]
        await start_threads(b, threads)
        owners = await held_everywhere(b, threads)
        wakes = [b.thread(t).wake for t in threads]

        async def listened() -> bool:  # every held wait's bell has its subscriber
            return all([await numsub(b.redis, w) >= 1 for w in wakes])

        await until(listened, 10, "every held wait to subscribe")
        killed = await kill_pubsub(b.redis)
        assert killed >= 2, f"killed {killed} pub/sub connections"
        approve = {t: i % 2 == 1 for i, t in enumerate(threads)}
        # Answer at once: most bells ring while the replicas reconnect, heard by nobody.
        routed = await asyncio.gather(*(b.post_item(t, answer(approve[t])) for t in threads))
        assert all(r.outcome == "answered" for r in routed)

        await settled(b, threads)
        # Held waits, delivered in place by the replica that held them: no adoption, no grant.
        await check_all(rig, {t: (approve[t], False, owners[t]) for t in threads})
        for t in threads:
            s = await b.sessions.get(t)
            assert s is not None and s.owner == owners[t]
        for name in set(owners.values()):
            events = [e["event"] for e in log_events(rig.logs, name)]
            assert "waiter.disconnected" in events, f"{name} never noticed the kill"


# -- 3. SIGSTOP / SIGCONT: a stale replica ---------------------------------------------------------


async def start_naps(rig: Rig, owner: str, say_t: str, ask_t: str) -> None:
    """Finish the two threads' first turns, then start a turn on each that naps, then posts a
    line (`say_t`) or asks an approval (`ask_t`); return once both naps are under way."""
    b = rig.b
    for t in (say_t, ask_t):
        await b.post_item(t, answer(True))
    await settled(b, [say_t, ask_t])
    await check_all(rig, {t: (True, False, owner) for t in (say_t, ask_t)})
    await b.post_item(say_t, text("nap then say"))
    await b.post_item(ask_t, text("nap then ask"))

    async def napping() -> bool:
        for t in (say_t, ask_t):
            s = await b.sessions.get(t)
            if s is None or s.status != "running":
                return False
        return True

    await until(napping, 5, "both nap turns to start")


async def interrupted_once(b: Broker, threads: Iterable[str]) -> bool:
    """The adopter found these threads mid-turn with nothing waited on, and said so once."""
    for t in threads:
        s = await b.sessions.get(t)
        if s is None or s.status != "idle":
            return False
        if len(interruptions(await b.items(t))) != 1:
            return False
    return True


async def wake(rig: Rig, name: str, pid: int, threads: list[str]) -> list[dict[str, Any]]:
    """SIGCONT the paused replica; wait until it dropped every one of `threads`, and a little
    more; return what it logged about them since it woke."""
    seen = len(log_events(rig.logs, name))
    os.kill(pid, signal.SIGCONT)
    rig.stopped.discard(pid)

    def since() -> list[dict[str, Any]]:
        return [e for e in log_events(rig.logs, name)[seen:] if e.get("thread_id") in threads]

    async def dropped() -> bool:
        lost = {e["thread_id"] for e in since() if e.get("event") == "replica.lost_thread"}
        return lost >= set(threads)

    await until(dropped, 10, f"{name} to drop the adopted threads")
    await asyncio.sleep(1.5)  # a window for anything the stale replica still had in flight
    proc = rig.fleet.replica(name).proc
    assert proc is not None and proc.poll() is None, f"{name} died on waking"
    return since()


async def test_stale_replica_cannot_act_after_adoption(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """A SIGSTOPped replica whose threads were adopted (and answered) meanwhile neither asks,
    delivers nor posts after SIGCONT: it drops them, and the adopter's deliveries stand."""
    async with running_fleet(where, tmp_path, workers=2) as rig:
        b = rig.b
        threads = [f"stale{i}" for i in range(6)]
        await start_threads(b, threads)
        owners = await held_everywhere(b, threads)
        victim = Counter(owners.values()).most_common(1)[0][0]
        mine = [t for t in threads if owners[t] == victim]
        assert len(mine) >= 3, owners  # 6 threads on 2 replicas: one holds 3 or more
        # Two of the victim's threads are mid-turn, napping, when it is paused: on waking, one
        # goes on to post a line, the other to ask. The others are held approval waits.
        say_t, ask_t, held = mine[0], mine[1], mine[2:]
        await start_naps(rig, victim, say_t, ask_t)
        before = await epochs(b, mine)
        pid = rig.fleet.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        rig.stopped.add(pid)

        adopted = await until(
            lambda: adopted_from(b, victim, before), rig.settings.lease_ttl + 5, "the adoption"
        )
        approve = {t: i % 2 == 0 for i, t in enumerate(held)}
        for t in held:
            assert (await b.post_item(t, answer(approve[t]))).outcome == "answered"
        await settled(b, held)
        await check_all(rig, {t: (approve[t], True, adopted[t][0]) for t in held})
        await until(lambda: interrupted_once(b, [say_t, ask_t]), 10, "the naps reported cut")
        snapshot = {t: await b.items(t) for t in mine}
        delivered = {p.prompt_id: p.delivered_at for p in await prompts_of(b, mine)}

        # Wake it once its naps are over, so the first thing it does is carry on with them.
        await asyncio.sleep(max(0.0, stopped_at + NAP + 0.5 - time.monotonic()))
        logged = await wake(rig, victim, pid, mine)

        assert [e for e in logged if e.get("event") != "replica.lost_thread"] == []
        for t in mine:
            assert await b.items(t) == snapshot[t], f"{t} changed after {victim} woke"
            s = await b.sessions.get(t)
            assert s is not None and (s.owner, s.epoch) == adopted[t], (s, adopted[t])
        for t in (say_t, ask_t):
            assert napped(t) not in outputs(snapshot[t])
            assert sum(1 for i in snapshot[t] if i.type == "pending_prompt") == 1
        for p in await prompts_of(b, mine):
            assert p.delivered_at == delivered[p.prompt_id]
            by = adopted[p.thread_id][0] if p.thread_id in held else victim
            assert deliveries(rig.logs, p.prompt_id) == [by], p.prompt_id


# -- 4. rolling SIGTERM restart --------------------------------------------------------------------


async def watch_pending(
    b: Broker, prompts: dict[str, Prompt], stop: asyncio.Event, changed: list[str]
) -> None:
    """Until `stop`, read every prompt over and over; note in `changed` any not pending."""
    while not stop.is_set():
        with contextlib.suppress(RedisConnectionError, OSError):
            for t, p in prompts.items():
                now = await b.get_prompt(t, p.prompt_id)
                if now.state != "pending":
                    changed.append(f"{t}: {p.prompt_id} became {now.state}")
        await asyncio.sleep(0.05)


async def restart_one(rig: Rig, name: str, threads: list[str]) -> None:
    """SIGTERM one replica, wait for it to exit cleanly, for the fleet to start it again, and
    for every thread to be held (with its wait) again."""
    b, p = rig.b, rig.fleet.replica(name)
    old = p.proc
    assert old is not None
    rig.fleet.kill(name, signal.SIGTERM, restart=True)
    code = await asyncio.to_thread(old.wait, 15)
    assert code == 0, f"{name} exited {code} on SIGTERM"

    async def back() -> bool:
        if p.proc is None or p.proc is old or p.proc.poll() is not None:
            return False
        return await b.redis.zscore(b.keys.replicas, name) is not None

    await until(back, 10, f"{name} to come back")

    async def all_held() -> bool:
        for t in threads:
            s = await b.sessions.get(t)
            if s is None or not s.owner or s.waiting is None:
                return False
        return True

    await until(all_held, 10, f"every thread held again after {name} restarted")


async def test_rolling_sigterm_restart_keeps_prompts(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """Every replica SIGTERMed and restarted in turn with prompts open: none is cancelled, all
    are parked and adopted; answered afterwards, each is delivered and audited exactly once."""
    async with running_fleet(where, tmp_path, workers=3, restart=True) as rig:
        b = rig.b
        threads = [f"roll{i}" for i in range(6)]
        prompts = await start_threads(b, threads)
        await held_everywhere(b, threads)
        stop = asyncio.Event()
        changed: list[str] = []
        watcher = asyncio.create_task(watch_pending(b, prompts, stop, changed))
        try:
            for i in range(1, rig.fleet.workers + 1):
                try:
                    await restart_one(rig, f"replica-{i}", threads)
                finally:
                    assert changed == [], f"while replica-{i} restarted"
        finally:
            stop.set()
            await watcher
        assert changed == []
        assert all(rig.fleet.replica(f"replica-{i}").restarts == 1 for i in range(1, 4))
        assert {p.prompt_id for p in await b.open_prompts()} == {
            p.prompt_id for p in prompts.values()
        }
        for t in threads:
            s = await b.sessions.get(t)
            assert s is not None and s.status == "parked", s  # every holder stopped once
            assert s.waiting is not None and s.waiting.prompt_id == prompts[t].prompt_id
            assert not any(i.type == "pending_prompt_resolved" for i in await b.items(t))

        approve = {t: i % 2 == 0 for i, t in enumerate(threads)}
        for t in threads:
            assert (await b.post_item(t, answer(approve[t]))).outcome == "answered"
        await settled(b, threads)
        await check_all(rig, {t: (approve[t], True, None) for t in threads})


# -- 5. Redis kill -9 and restart (AOF) ------------------------------------------------------------


async def one_held_per_replica(b: Broker, threads: list[str]) -> dict[str, Session] | None:
    """Every thread waits; each replica holds one wait (held_waits_max=1), the rest are parked."""
    sessions = {}
    for t in threads:
        s = await b.sessions.get(t)
        if s is None or s.waiting is None or s.status not in ("running", "parked"):
            return None
        sessions[t] = s
    running = Counter(s.owner for s in sessions.values() if s.status == "running")
    return sessions if running and set(running.values()) == {1} else None


async def test_redis_restart_with_held_and_parked_waits(
    server: RedisServer, tmp_path: Path
) -> None:
    """Redis kill -9 and restart on the same port (AOF): open prompts and sessions survive,
    replicas reconnect on their own, later answers are delivered and audited exactly once."""
    # The replicas must ride the restart out in the same process, which is checked; restart=True
    # would only hide an audit worker that died (test_fleet_survives_redis_outage checks it).
    async with running_fleet(server, tmp_path, workers=2, restart=False, held_waits_max=1) as rig:
        b = rig.b
        pids = {p.name: p.proc.pid for p in rig.fleet.processes if p.proc and p.name != "audit"}
        threads = [f"aof{i}" for i in range(4)]
        prompts = await start_threads(b, threads)
        before = await until(
            lambda: one_held_per_replica(b, threads), 15, "one held wait a replica, rest parked"
        )
        parked = {t for t, s in before.items() if s.status == "parked"}
        assert parked and len(parked) < len(threads), {t: s.status for t, s in before.items()}
        open_before = {p.prompt_id for p in await b.open_prompts()}
        assert open_before == {p.prompt_id for p in prompts.values()}
        old_pid = server.proc.pid if server.proc else None

        await asyncio.to_thread(server.restart)
        assert server.proc is not None and server.proc.pid != old_pid
        restarted_ms = await until(b.sessions.server_ms, 5, "the restarted server")

        assert {p.prompt_id for p in await b.open_prompts()} == open_before
        for t, s in before.items():
            now = await b.sessions.get(t)
            assert now is not None, f"{t}'s session is gone"
            same = ("status", "waiting", "harness", "config", "permissions", "state")
            assert {k: getattr(now, k) for k in same} == {k: getattr(s, k) for k in same}
            assert now.owner and now.epoch >= s.epoch

        async def reconnected() -> bool:
            for name, pid in pids.items():
                p = rig.fleet.replica(name)
                assert p.restarts == 0 and p.proc is not None and p.proc.pid == pid, name
                assert p.proc.poll() is None, f"{name} exited {p.proc.returncode}"
                beat = await b.redis.zscore(b.keys.replicas, name)
                if beat is None or beat <= restarted_ms:
                    return False
            return True

        await until(reconnected, 10, "every replica to beat on the restarted server")

        approve = {t: i % 2 == 1 for i, t in enumerate(threads)}
        for t in threads:
            assert (await b.post_item(t, answer(approve[t]))).outcome == "answered"
        await settled(b, threads)
        # Held waits are delivered in place (pub/sub resubscribed); parked ones by resume turns.
        await check_all(rig, {t: (approve[t], t in parked, None) for t in threads})
        for name in {s.owner for s in before.values()}:
            events = [e["event"] for e in log_events(rig.logs, name)]
            assert "waiter.disconnected" in events, f"{name} never noticed the restart"


async def test_fleet_survives_redis_outage(server: RedisServer, tmp_path: Path) -> None:
    """Redis down for about a second (kill -9, then restarted on the same port): every process of
    the fleet, the audit worker included, stays up, and later answers are audited exactly once."""
    async with running_fleet(server, tmp_path, workers=1) as rig:
        b = rig.b
        threads = ["outage0", "outage1"]
        await start_threads(b, threads)
        owners = await held_everywhere(b, threads)
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(1.0)  # several of the audit worker's polls, all within the leases
        await asyncio.to_thread(server.start)
        restarted_ms = await until(b.sessions.server_ms, 5, "the restarted server")

        async def beating() -> bool:
            beat = await b.redis.zscore(b.keys.replicas, "replica-1")
            return beat is not None and beat > restarted_ms

        await until(beating, 10, "the replica to beat on the restarted server")
        dead = {
            p.name: p.proc.poll()
            for p in rig.fleet.processes
            if p.proc and p.proc.poll() is not None
        }
        assert dead == {}, f"exited during the outage: {dead}"
        for t in threads:
            assert (await b.post_item(t, answer(True))).outcome == "answered"
        await settled(b, threads)
        await check_all(rig, {t: (True, False, owners[t]) for t in threads})
