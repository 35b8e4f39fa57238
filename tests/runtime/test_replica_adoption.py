"""Replicas holding threads (workers/runtime/adoption.py, sweep.py, heartbeat.py): a clean stop
that parks and releases, another replica adopting and resuming, fencing of a stale epoch, a lost
lease dropped, each thread claimed once in a race, and the sweep that finds work a missed bell
announced.

In process, on both backends, with the fleet and helpers of tests/runtime/test_replica.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from broker import (
    Broker,
    Fenced,
    Item,
    Question,
    Session,
    leases,
)
from tests.helpers import index_count, of_type, outputs, stays, text, truthy, until
from tests.runtime.test_replica import (
    ASK,
    Fleet,
    active,
    delivered_logs,
    pick,
    script,
    session,
    start_thread,
    status_is,
    turn_ends,
)

# -- clean stop and adoption -----------------------------------------------------------------


async def test_clean_stop_parks_releases_and_another_replica_resumes(
    fleet: Fleet, person: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A clean stop never cancels: the held wait is parked and released, a second replica adopts
    it at once, and the answer is delivered once and resumes the turn there."""
    caplog.set_level(logging.INFO, logger="broker")
    slow: dict[str, Any] = {"lease_ttl": 5.0}  # adoption must not wait out the lease
    a = await fleet.start("ra", **slow)
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")

    await fleet.stop(a)
    assert (await person.get_prompt("t1", p.prompt_id)).state == "pending"
    assert (await person.active_prompt("t1")) is not None
    s = await session(person, "t1")
    assert s.status == "parked"
    assert s.owner == ""
    assert s.waiting is not None and s.waiting.prompt_id == p.prompt_id
    assert of_type(await person.items("t1"), "turn_end") == []

    loop = asyncio.get_running_loop()
    began = loop.time()
    b = await fleet.start("rb", **slow)

    async def adopted() -> Session | None:
        s = await session(person, "t1")
        return s if s.owner == "rb" and "t1" in b.replica.threads else None

    await until(adopted, "rb to adopt t1", within=3.0)
    assert loop.time() - began < 2.5  # well inside the 5 s lease
    s = await session(person, "t1")
    assert s.status == "parked"  # still waiting for a person: no turn was started

    await person.post_item("t1", text("2"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["starting", "Pick one: B", "done"]
    prompt = await person.get_prompt("t1", p.prompt_id)
    assert prompt.state == "answered"
    assert prompt.delivered_at is not None
    assert delivered_logs(caplog, p.prompt_id) == []  # ra never delivered it
    turns = [(t.replica, t.resume is not None) for t in fleet.turns_of("t1")]
    assert turns == [("ra", False), ("rb", True)]
    assert (await session(person, "t1")).owner == "rb"


async def test_demotion_during_delivery_loses_no_answer(fleet: Fleet, person: Broker) -> None:
    """A hold demoted just as its answer's delivery commits still hands the answer to the agent."""
    a = await fleet.start("ra")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")

    deliver = a.broker._deliver

    async def committed_but_reply_slow(tk: Any, prompt_id: str, epoch: int | None) -> None:
        await deliver(tk, prompt_id, epoch)  # the script commits the delivery ...
        await asyncio.sleep(1.0)  # ... and its reply is slow to come back

    a.broker._deliver = committed_but_reply_slow  # type: ignore[method-assign]
    await person.post_item("t1", text("2"))

    async def delivered() -> bool:
        return (await person.get_prompt("t1", p.prompt_id)).delivered_at is not None

    await until(delivered, "the delivery to commit")
    await fleet.stop(a)  # demotes the hold while the reply is outstanding
    await fleet.start("rb")

    async def settled() -> list[Item] | None:
        s = await session(person, "t1")
        if s.owner == "" or s.status != "idle":
            return None
        return await person.items("t1")

    items = await until(settled, "t1 to settle")
    assert "Pick one: B" in outputs(items)


async def test_parked_answer_then_queued_message_both_run(fleet: Fleet, person: Broker) -> None:
    """A message queued after a parked prompt's answer runs right after the resume turn."""
    # A sweep far away: only bells and the records may drive the follow-up turn.
    config = {
        "script": {
            "turns": [
                {"match": "follow-up", "steps": [{"say": "follow-up seen"}]},
                {"steps": [{"ask": [pick()]}]},
            ]
        }
    }
    a = await fleet.start("ra", wait_mode="parked", sweep_interval=30.0)
    await start_thread(person, "t1", config)
    await status_is(person, "t1", "parked")
    await fleet.stop(a)
    await person.post_item("t1", text("1"))  # answers the parked prompt
    routed = await person.post_item("t1", text("a follow-up"))
    assert routed.outcome == "queued"

    await fleet.start("rb", sweep_interval=30.0)
    await turn_ends(person, "t1", 1)  # the resume turn

    async def followed_up() -> list[str] | None:
        out = outputs(await person.items("t1"))
        return out if "follow-up seen" in out else None

    out = await until(followed_up, "the follow-up turn", within=2.0)
    assert out == ["Pick one: A", "follow-up seen"]


async def claim_as(
    person: Broker, thread_id: str, replica: str, ttl_ms: int = 30_000
) -> int | None:
    """Claim the thread as a new incarnation of `replica`, alive for `ttl_ms`: its epoch."""
    incarnation, _, _ = await person.sessions.join(replica, ttl_ms)
    return await person.sessions.claim(thread_id, replica, incarnation)


# -- fencing ---------------------------------------------------------------------------------


async def test_stale_epoch_is_fenced(fleet: Fleet, person: Broker) -> None:
    """Once another replica claimed the thread, the old epoch's ask, post, deliver and session
    update are refused, and the holder drops the thread without delivering."""
    a = await fleet.start("ra")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")
    old = (await session(person, "t1")).epoch
    assert a.replica.threads["t1"].epoch == old

    # ra is paused: its heartbeat stops, and once its lease ran out "rb" claims the thread
    for task in a.replica._tasks:
        if task.get_name() == "beat":
            task.cancel()
    new = await until(lambda: claim_as(person, "t1", "rb"), "ra's record to run out", within=5)
    assert new > old
    before = await person.items("t1")

    agent_item = {
        "content": [{"type": "text", "text": "stale output"}],
        "metadata": {"type": "agent_output"},
        "author": person.identity,
    }
    with pytest.raises(Fenced) as e:
        await person.post_item("t1", agent_item, epoch=old)
    assert e.value.current == new
    with pytest.raises(Fenced):
        await person.post_item("t1", text("stale message"), epoch=old)
    with pytest.raises(Fenced):
        await person.sessions.update("t1", old, status="idle")
    assert (await person.items("t1")) == before
    assert (await person.active_prompt("t1")) == p
    s = await session(person, "t1")
    assert (s.owner, s.epoch, s.status) == ("rb", new, "running")

    # a person answers: the old epoch cannot deliver it, not even ra's own held wait
    await person.post_item("t1", text("1"))
    with pytest.raises(Fenced):
        await person.wait("t1", p.prompt_id, timeout=5, epoch=old)
    await until(lambda: truthy("t1" not in a.replica.threads), "ra to drop t1")
    assert (await person.get_prompt("t1", p.prompt_id)).delivered_at is None
    # the new holder delivers
    answers = await person.wait("t1", p.prompt_id, timeout=5, epoch=new)
    assert [x.answer for x in answers] == [["A"]]
    assert (await person.get_prompt("t1", p.prompt_id)).delivered_at is not None
    assert "Pick one: A" not in outputs(await person.items("t1"))


async def test_stale_epoch_ask_is_fenced(person: Broker) -> None:
    """An ask with the epoch of a replica whose thread another claimed is refused as Fenced,
    writing nothing."""
    await person.sessions.create("t1", "scripted", "approval", {})
    claimed = await claim_as(person, "t1", "ra", ttl_ms=1)
    assert claimed is not None
    old = claimed
    new = await until(lambda: claim_as(person, "t1", "rb"), "ra's record to run out", within=5)
    assert new > old
    with pytest.raises(Fenced) as e:
        await person.ask("t1", "text", [Question(question="Anything else?")], epoch=old)
    assert e.value.current == new
    assert await person.items("t1") == []
    assert await person.active_prompt("t1") is None
    assert await index_count(person, "open") == 0
    # the holder's epoch asks
    p = await person.ask("t1", "text", [Question(question="Anything else?")], epoch=new)
    assert (await person.active_prompt("t1")) == p


async def test_lost_lease_is_dropped_and_written_no_more(fleet: Fleet, person: Broker) -> None:
    """A replica whose thread another claimed finds it lost at its heartbeat, drops it, and
    writes nothing more for it."""
    a = await fleet.start("ra")
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")
    key = person.thread("t1").session

    async def steal() -> int | None:
        # as if ra had been paused past its deadline: its record ran out and "rb" claimed it
        record = f"{a.replica.incarnation}|0"
        await person.redis.hset(person.keys.replica_records, "ra", record)  # type: ignore[misc]
        return await claim_as(person, "t1", "rb")

    await until(steal, "rb's claim")
    await until(lambda: truthy("t1" not in a.replica.threads), "ra's heartbeat to drop t1")
    assert a.replica.held_count() == 0
    snapshot = await person.redis.hgetall(key)  # type: ignore[misc]
    assert snapshot["owner"] == "rb"

    # the person answers: ra, which held the call, must neither deliver nor write anything
    await person.post_item("t1", text("1"))
    after_answer = await person.items("t1")

    async def untouched() -> bool:
        return (
            await person.redis.hgetall(key) == snapshot  # type: ignore[misc]
            and await person.items("t1") == after_answer
            and (await person.get_prompt("t1", p.prompt_id)).delivered_at is None
            and "t1" not in a.replica.threads
        )

    await stays(untouched, "ra wrote for a thread it lost", duration=1.0)
    assert outputs(after_answer) == ["starting"]


async def test_adoption_race_each_thread_claimed_once(fleet: Fleet, person: Broker) -> None:
    """Two replicas started together on 20 new threads: each thread is claimed by exactly one,
    and runs its turn once."""
    threads = [f"t{i:02d}" for i in range(20)]
    for t in threads:
        await start_thread(person, t, script({"ask": [pick()]}))
    slow: dict[str, Any] = {
        "lease_ttl": 3.0
    }  # no lease may run out under load: epochs count the claims
    a, b = await asyncio.gather(fleet.start("ra", **slow), fleet.start("rb", **slow))

    async def all_asked() -> bool:
        return all([await person.active_prompt(t) is not None for t in threads])

    await until(all_asked, "every thread to ask", within=15)
    held_a, held_b = set(a.replica.threads), set(b.replica.threads)
    assert held_a.isdisjoint(held_b)
    assert held_a | held_b == set(threads)
    for t in threads:
        s = await session(person, t)
        assert s.owner == ("ra" if t in held_a else "rb")
        assert s.epoch == 1, f"{t} was claimed more than once"

    for t in threads:
        await person.post_item(t, text("1"))
    for t in threads:
        items = await turn_ends(person, t)
        assert len(of_type(items, "turn_end")) == 1
        assert len(of_type(items, "pending_prompt")) == 1
        assert outputs(items) == ["Pick one: A"]
        fresh = [x for x in fleet.turns_of(t) if x.resume is None]
        assert len(fresh) == 1, f"{t} ran {len(fresh)} fresh turns"
        assert fresh[0].replica == (await session(person, t)).owner


async def test_sweep_finds_work_whose_bell_was_missed(fleet: Fleet, person: Broker) -> None:
    """A message whose bell nobody heard (the pub/sub connection was down) is found by the look
    its resubscription brings, and runs a turn."""
    r = await fleet.start("r1")
    await start_thread(person, "t1", script({"say": "hello"}))
    await turn_ends(person, "t1")
    await asyncio.sleep(0.3)  # the look its first subscription brought is over
    held = r.replica.threads["t1"]
    r.replica.broker.unlisten("t1", held.listener)  # the bell now rings to nobody
    await person.post_item("t1", text("again"))
    await asyncio.sleep(0.5)
    assert outputs(await person.items("t1")) == ["hello"]  # nobody heard it
    held.listener("wake", {"resubscribed": True})  # what the waiter says once back
    items = await turn_ends(person, "t1", n=2)
    assert outputs(items) == ["hello", "hello"]


async def test_the_look_script_says_which_held_threads_need_a_look_and_parks_dead_waits(
    person: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """look.lua, on pages of threads in a replica's batched look: `look` for a thread lost (holder,
    incarnation or epoch), with messages queued, a turn that died, or its prompt resolved;
    `parked` for a held wait left running (the session parked, in that step); else `quiet`.
    A thread it does not hold is left as it is."""
    b = person

    async def held(thread_id: str, status: str) -> int:
        await b.sessions.create(thread_id, "scripted", "approval", ASK)
        epoch = (await b.sessions.claim_many([thread_id], "r1", "i1"))[thread_id]
        await b.sessions.update(thread_id, epoch, status=status)
        return epoch

    async def look(thread_id: str, epoch: int, replica: str = "r1", inc: str = "i1") -> str:
        return (await b.sessions.look_many(replica, inc, {thread_id: epoch}))[thread_id]

    # A held wait whose holder died: parked here, then quiet.
    epoch = await held("w", "running")
    await b.ask("w", "approval", [Question(question="Go?")], epoch=epoch, agent_state={"n": 1})
    for replica, inc, at in (("r2", "i1", epoch), ("r1", "i2", epoch), ("r1", "i1", epoch + 1)):
        assert await look("w", at, replica, inc) == "look"
        assert (await session(b, "w")).status == "running"  # not its to park
    assert await look("w", epoch) == "parked"
    assert (await session(b, "w")).status == "parked"
    assert await look("w", epoch) == "quiet"
    # Its prompt answered: a look (the resume turn).
    await b.post_item("w", text("yes"))
    assert await look("w", epoch) == "look"
    # Idle with nothing queued: quiet; a message queued: a look.
    epoch = await held("i", "idle")
    assert await look("i", epoch) == "quiet"
    await b.post_item("i", text("next"))
    assert await look("i", epoch) == "look"
    # A turn that died (running or parked, no wait): a look.
    for status in ("running", "parked"):
        epoch = await held(f"d-{status}", status)
        assert await look(f"d-{status}", epoch) == "look"
    # Many at once, on pages of two: each reply is its own thread's. A held wait left running
    # is parked, one idle is quiet, one parked on its pending prompt is quiet, one lost is a look.
    monkeypatch.setattr(leases, "SCRIPT_PAGE", 2)
    epochs = {"q": await held("q", "idle"), "p": await held("p", "running"), "w2": 0}
    await b.ask("p", "approval", [Question(question="Go?")], epoch=epochs["p"], agent_state={})
    epochs["w2"] = await held("w2", "running")
    await b.ask("w2", "approval", [Question(question="Go?")], epoch=epochs["w2"], agent_state={})
    assert await look("w2", epochs["w2"]) == "parked"
    epochs["lost"] = await held("lost", "idle") + 1
    order = ["q", "p", "lost", "w2", "i"]
    epochs["i"] = (await session(b, "i")).epoch
    assert await b.sessions.look_many("r1", "i1", {t: epochs[t] for t in order}) == {
        "q": "quiet",
        "p": "parked",
        "lost": "look",
        "w2": "quiet",
        "i": "look",
    }
    assert (await session(b, "p")).status == "parked"
