"""A delivery happens once: the scripts that hand an answer to an agent, mint and spend its grant,
and report a cut-off turn, each called directly (no Python pre-check in the way), on fakeredis
and on a real redis-server.

Each guard has a test that fails without it: the epoch fence, the prompt-state check, delivered
once (resume and held delivery), a grant minted once and spent once per prompt, the CAS on the
grant as read, and the interruption reported once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from broker import Broker, Fenced, Grant, Item, Option, Prompt, Question
from broker.keys import ThreadKeys
from tests.conftest import OnCluster, RedisServer
from tests.helpers import of_type, outputs, text, until
from tests.runtime.test_crash import INTERRUPTED, Rig, deliveries, log_events, running_fleet
from tests.runtime.test_crash import until as crash_until
from tests.runtime.test_replica import ASK, Fleet
from workers.agents.harness import AgentStore, Turn, TurnResult, approval_question

#: The session's lease epoch after its first claim.
EPOCH = 1


@dataclass
class Thread:
    """A claimed thread whose agent asked one approval, which the person answered."""

    b: Broker
    tk: ThreadKeys
    prompt: Prompt
    grant: Grant

    async def call(self, name: str, keys: list[str], args: list[Any]) -> list[Any]:
        return list(await self.b._scripts.call(self.b.redis, name, keys, args))

    async def resume(
        self, token: str, *, epoch: int = EPOCH, grant: str | None = None
    ) -> list[Any]:
        args = [epoch, self.grant.model_dump_json() if grant is None else grant]
        return await self.call(
            "resume",
            [self.tk.session, self.tk.prompt(self.prompt.prompt_id)],
            [*args, self.pid, token],
        )

    async def deliver(self, token: str, *, epoch: int | str = EPOCH) -> list[Any]:
        keys = [self.tk.prompt(self.pid), self.tk.session]
        return await self.call("deliver", keys, [epoch, self.pid, token])

    async def spend(self, raw: str | None, *, epoch: int = EPOCH, item: str = "itm_1") -> list[Any]:
        keys = [self.tk.session, self.tk.items, self.tk.prompt(self.pid)]
        body = orjson.dumps({"content": [], "metadata": {"type": "approval_granted"}})
        return await self.call("grant", keys, [epoch, raw or "", item, "agent", body])

    async def session(self) -> dict[str, str]:
        return dict(await self.b.redis.hgetall(self.tk.session))  # type: ignore[misc]

    async def record(self) -> dict[str, str]:
        return dict(await self.b.redis.hgetall(self.tk.prompt(self.pid)))  # type: ignore[misc]

    async def items(self, type_: str) -> int:
        return sum(1 for i in await self.b.items(self.tk.thread_id) if i.type == type_)

    @property
    def pid(self) -> str:
        return self.prompt.prompt_id


async def asked(broker: Broker, thread_id: str = "t1", *, answer: str | None = "yes") -> Thread:
    await broker.sessions.create(thread_id, "scripted", "approval", {})
    incarnation, _, _ = await broker.sessions.join("r1", 60_000)
    claimed = await broker.sessions.claim(thread_id, "r1", incarnation)
    assert claimed == EPOCH
    q = approval_question("Bash", {"command": "make deploy"})
    prompt = await broker.ask(thread_id, "approval", [q], epoch=EPOCH, agent_state={"step": 0})
    if answer is not None:
        assert (await broker.post_item(thread_id, text(answer))).outcome == "answered"
    grant = Grant(subject="Bash", grant_key=q.grant_key, granted_by=prompt.prompt_id)
    return Thread(broker, broker.thread(thread_id), prompt, grant)


@pytest.fixture
async def th(broker: Broker) -> Thread:
    return await asked(broker)


@pytest.fixture
def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory(appendonly=True)


# -- resume.lua ------------------------------------------------------------------------------------


async def test_resume_hands_over_once_and_mints_one_grant(th: Thread) -> None:
    """The first resume hands the answer over, mints the grant, stops the wait and records the
    delivery in the session; a second resume (another attempt) is refused and writes nothing."""
    assert (await th.resume("dlv_a"))[0] == "resumed"
    s = await th.session()
    assert s["grant"] == th.grant.model_dump_json()
    assert "wait" not in s and s["status"] == "running" and s["delivered"] == th.pid
    first = (await th.record())["delivered"]

    assert (await th.spend(s["grant"]))[0] == "spent"
    again = await th.resume("dlv_b")
    assert again == ["delivered", first]
    s = await th.session()
    assert "grant" not in s, "a second resume minted the grant again"
    assert (await th.record())["delivered"] == first
    assert await th.items("approval_granted") == 1


async def test_resume_retry_of_the_same_attempt_is_the_same_delivery(th: Thread) -> None:
    """The same token again (a reply lost on the way) gets 'resumed' with the first time, and
    mints nothing a second time, even once the grant was spent."""
    (_, first) = await th.resume("dlv_a")
    await th.spend((await th.session())["grant"])
    assert await th.resume("dlv_a") == ["resumed", first]
    assert "grant" not in await th.session()


async def test_resume_mints_a_grant_once_per_prompt_ever(th: Thread) -> None:
    """A prompt whose grant was minted before mints none again, whatever else its record says."""
    await th.b.redis.hset(th.tk.prompt(th.pid), "granted", "1")  # type: ignore[misc]
    assert (await th.resume("dlv_a"))[0] == "resumed"
    assert "grant" not in await th.session()


async def test_resume_is_fenced(th: Thread) -> None:
    """A stale epoch hands nothing over: no delivery mark, no grant, the wait stays."""
    await th.b.redis.hset(th.tk.session, "epoch", EPOCH + 1)  # type: ignore[misc]
    assert await th.resume("dlv_a") == ["fenced", str(EPOCH + 1)]
    s = await th.session()
    assert "grant" not in s and "wait" in s and "delivered" not in s
    assert "delivered" not in await th.record()


async def test_resume_of_an_unanswered_prompt_is_refused(broker: Broker) -> None:
    """A pending prompt is not resumed: nothing is marked and no grant is minted."""
    th = await asked(broker, answer=None)
    assert await th.resume("dlv_a") == ["state", "pending"]
    s = await th.session()
    assert "grant" not in s and "wait" in s
    assert "delivered" not in await th.record()


# -- deliver.lua (held waits) ----------------------------------------------------------------------


async def test_held_delivery_once(th: Thread) -> None:
    """A held answer is handed over once: the first call delivers (the session stops waiting and
    records it), a second attempt gets 'already', a retry of the first gets its own reply."""
    (status, first) = await th.deliver("dlv_a")
    assert status == "delivered"
    s = await th.session()
    assert "wait" not in s and s["delivered"] == th.pid
    assert await th.deliver("dlv_b") == ["already", first]
    assert await th.deliver("dlv_a") == ["delivered", first]
    assert (await th.record())["delivered"] == first


async def test_held_delivery_is_fenced_and_checks_the_state(broker: Broker) -> None:
    """A stale epoch delivers nothing; neither does a pending prompt."""
    th = await asked(broker, answer=None)
    assert await th.deliver("dlv_a") == ["state", "pending"]
    await broker.post_item("t1", text("yes"))
    assert await th.deliver("dlv_a", epoch=EPOCH + 5) == ["fenced", str(EPOCH)]
    assert "delivered" not in await th.record()
    assert "wait" in await th.session()


async def test_unfenced_delivery_leaves_the_session_alone(th: Thread) -> None:
    """A library caller's own wait (no epoch) marks the prompt but not the session's agent."""
    assert (await th.deliver("", epoch=""))[0] == "delivered"
    s = await th.session()
    assert "wait" in s and "delivered" not in s


# -- grant.lua -------------------------------------------------------------------------------------


async def test_grant_spent_once_per_prompt(th: Thread) -> None:
    """Spent once; a grant for the same prompt put back afterwards is dropped, not spent."""
    await th.resume("dlv_a")
    raw = (await th.session())["grant"]
    assert (await th.spend(raw))[0] == "spent"
    await th.b.redis.hset(th.tk.session, "grant", raw)  # type: ignore[misc]
    assert await th.spend(raw, item="itm_2") == ["used", "itm_1"]
    assert "grant" not in await th.session()
    assert await th.items("approval_granted") == 1


async def test_grant_spend_compares_the_grant_as_read(th: Thread) -> None:
    """A grant read before it changed is not spent (CAS on the stored text)."""
    await th.resume("dlv_a")
    raw = (await th.session())["grant"]
    stale = raw.replace("make deploy", "make other")
    assert await th.spend(stale) == ["changed"]
    assert await th.spend(None) == ["changed"]
    assert (await th.session())["grant"] == raw
    assert await th.items("approval_granted") == 0


async def test_grant_spend_is_fenced(th: Thread) -> None:
    """A replica that lost the thread cannot spend its grant."""
    await th.resume("dlv_a")
    raw = (await th.session())["grant"]
    await th.b.redis.hset(th.tk.session, "epoch", EPOCH + 1)  # type: ignore[misc]
    assert await th.spend(raw) == ["fenced", str(EPOCH + 1)]
    assert (await th.session())["grant"] == raw
    assert await th.items("approval_granted") == 0


# -- interrupt.lua ---------------------------------------------------------------------------------


async def interrupt(th: Thread, *, epoch: int = EPOCH, waited: str | None = None) -> bool:
    return await th.b.sessions.interrupt(
        th.tk.thread_id,
        epoch,
        "(the turn was interrupted)",
        metadata={"interrupted": {"delivered": th.pid}},
        interruption={"delivered": None, "note": "n"},
        waited=waited,
    )


async def test_interruption_reported_once(th: Thread) -> None:
    """A turn cut off after its delivery is reported once: one item, the record kept for the next
    turn, the turn ended with no grant left; a second report (a re-adopter) posts nothing."""
    await th.resume("dlv_a")
    assert await interrupt(th) is True
    s = await th.session()
    assert s["status"] == "idle" and orjson.loads(s["interrupted"])["note"] == "n"
    assert not {"grant", "wait", "delivered"} & set(s)
    assert await interrupt(th) is False
    items = [i for i in await th.b.items("t1") if i.metadata.get("interrupted")]
    assert len(items) == 1 and items[0].type == "agent_output"


async def test_interruption_is_fenced(th: Thread) -> None:
    """A stale holder reports nothing."""
    await th.resume("dlv_a")
    with pytest.raises(Fenced):
        await interrupt(th, epoch=EPOCH + 3)
    assert (await th.session())["status"] == "running"


async def test_a_wait_on_an_undelivered_answer_is_not_an_interruption(th: Thread) -> None:
    """A session still waiting on an answer nobody was given is left to its resume."""
    await th.b.redis.hset(th.tk.session, "status", "parked")  # type: ignore[misc]
    assert await interrupt(th, waited=th.pid) is False
    assert await interrupt(th) is False
    s = await th.session()
    assert s["status"] == "parked" and "wait" in s


async def test_a_wait_on_a_delivered_answer_is_an_interruption(th: Thread) -> None:
    """A wait left naming an answer already handed over ends as an interruption."""
    await th.deliver("", epoch="")  # marks the prompt only: the wait stays
    await th.b.redis.hset(th.tk.session, "status", "parked")  # type: ignore[misc]
    assert await interrupt(th, waited=th.pid) is True
    s = await th.session()
    assert s["status"] == "idle" and "wait" not in s


# -- real replica processes: a resume turn cut off after it spent its grant and ran the command ----

#: How long the resume turn works after running its command: the fault lands in this window.
WORK = 3.0


def marker_script(
    thread: str, marker: Path, work: float = WORK, command: str | None = None
) -> dict[str, Any]:
    """An approval for a command that really runs (it appends a line to `marker`), then work,
    then a last line. A later message `again` makes the agent try the same command again."""
    command = command or f"echo RAN >> {marker}"
    call = {"tool": "Bash", "input": {"command": command}, "shell": True}
    return {
        "script": {
            "turns": [
                {"match": "again", "steps": [call]},
                {"steps": [call, {"sleep": work}, {"say": f"{thread}: wrapped up."}]},
            ]
        }
    }


def marks(marker: Path) -> int:
    return len(marker.read_text().splitlines()) if marker.exists() else 0


@dataclass
class Cut:
    """A thread whose parked approval was answered, and whose resume turn ran the command."""

    thread: str
    prompt_id: str
    marker: Path
    holder: str
    held: bool = False  # answered in place (held wait): no grant is minted


async def ran_once_then(
    rig: Rig,
    thread: str,
    marker: Path,
    work: float = WORK,
    command: str | None = None,
    *,
    held: bool = False,
) -> Cut:
    """Start the thread, let its approval park, approve it, and return once the resume turn
    spent its grant and ran the command (while it works on, before its end); with `command`,
    once that command started. `held`: the approval is waited on in place, not parked."""
    b = rig.b
    config = marker_script(thread, marker, work, command)
    await b.sessions.create(thread, "scripted", "approval", config)
    await b.post_item(thread, text("Please go ahead."))

    async def parked() -> Prompt | None:
        s = await b.sessions.get(thread)
        if s is None or s.status != ("running" if held else "parked") or s.waiting is None:
            return None
        return await b.active_prompt(thread)

    try:
        prompt = await crash_until(parked, 20, "the approval to park")
    except AssertionError as e:
        raise AssertionError(f"{e}: {thread} is {await b.sessions.get(thread)}") from None
    assert (await b.post_item(thread, text("yes"))).outcome == "answered"

    async def ran() -> str | None:
        items = await b.items(thread)
        if marks(marker) < 1 or (not held and not of_type(items, "approval_granted")):
            return None
        # After the command: its end recorded (it says so right after); during: it started.
        if command is None and not any(line.startswith("Ran Bash") for line in outputs(items)):
            return None
        s = await b.sessions.get(thread)
        return s.owner if s is not None and s.status == "running" else None

    holder = await crash_until(ran, 20, "the resume turn to spend its grant and run the command")
    return Cut(thread, prompt.prompt_id, marker, holder, held)


async def told_once(rig: Rig, cut: Cut, note: str | None = None) -> None:
    """After the fault: the command ran once, one grant, one audit item, one interruption item
    with the truth; then the next turn is told, and its retry asks a person again."""
    b = rig.b

    async def interrupted() -> list[Item] | None:
        s = await b.sessions.get(cut.thread)
        items = await b.items(cut.thread)
        told = [i for i in items if i.metadata.get("interrupted")]
        return told if told and s is not None and s.status == "idle" else None

    await crash_until(interrupted, 20, "the interruption to be reported")
    audited = await crash_until(lambda: _resolved(b, cut.thread), 20, "the answer's audit item")
    await asyncio.sleep(2.5)  # a window for any replay of the cut-off turn to show

    items = await b.items(cut.thread)
    assert marks(cut.marker) == 1, f"the approved command ran {marks(cut.marker)} times"
    grants = of_type(items, "approval_granted")
    assert [g.metadata["granted_by"] for g in grants] == ([] if cut.held else [cut.prompt_id])
    assert audited == [cut.prompt_id] and len(of_type(items, "pending_prompt_resolved")) == 1
    told = [i for i in items if i.metadata.get("interrupted")]
    assert len(told) == 1, [i.text for i in told]
    assert told[0].text.startswith(INTERRUPTED)
    assert f"the person approved `Bash` (prompt {cut.prompt_id})" in told[0].text
    note = note or f"Bash `echo RAN >> {cut.marker}` ran, exit code 0"
    assert note in told[0].text, told[0].text
    used = "Its one-shot approval was used." in told[0].text
    assert used is not cut.held, told[0].text
    assert "was not used" not in told[0].text
    assert told[0].metadata["interrupted"]["delivered"] == cut.prompt_id
    assert f"{cut.thread}: wrapped up." not in outputs(items)
    assert len(deliveries(rig.logs, cut.prompt_id)) == 1
    s = await b.sessions.get(cut.thread)
    assert s is not None and s.interrupted is not None and s.grant is None
    assert s.interrupted["delivered"]["prompt_id"] == cut.prompt_id

    # The next turn tells the agent first; the call it makes again asks a person again.
    await b.post_item(cut.thread, text("again, please"))
    again = await crash_until(
        lambda: b.active_prompt(cut.thread), 20, "the repeated call to ask a person"
    )
    assert again.prompt_id != cut.prompt_id
    items = await b.items(cut.thread)
    first = [line for line in outputs(items) if line.startswith("My previous turn")]
    assert len(first) == 1, outputs(items)
    assert "the person approved `Bash`" in first[0] and note in first[0]
    assert len(of_type(items, "approval_granted")) == len(grants)
    assert marks(cut.marker) == 1
    s = await b.sessions.get(cut.thread)
    assert s is not None and s.interrupted is None


async def _resolved(b: Broker, thread: str) -> list[str] | None:
    items = await b.items(thread)
    done = [i.metadata["prompt"]["prompt_id"] for i in items if i.type == "pending_prompt_resolved"]
    return done or None


PARKED = {"wait_mode": "parked"}


@pytest.mark.real_redis
async def test_sigkill_after_the_command_ran(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """SIGKILL of the replica whose resume turn spent its grant and ran the command: the adopter
    reports the turn interrupted once and never replays it."""
    async with running_fleet(where, tmp_path, workers=2, **PARKED) as rig:
        cut = await ran_once_then(rig, "k1", tmp_path / "k1.marker")
        proc = rig.fleet.replica(cut.holder).proc
        assert proc is not None
        rig.fleet.kill(cut.holder, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 5)
        await told_once(rig, cut)
        s = await rig.b.sessions.get(cut.thread)
        assert s is not None and s.owner != cut.holder


@pytest.mark.real_redis
async def test_sigstop_past_the_lease_after_the_command_ran(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """SIGSTOP past the lease, then SIGCONT, of that replica: the adopter reports the turn
    interrupted once; the woken replica writes nothing more; nothing runs twice."""
    async with running_fleet(where, tmp_path, workers=2, **PARKED) as rig:
        cut = await ran_once_then(rig, "p1", tmp_path / "p1.marker")
        pid = rig.fleet.kill(cut.holder, signal.SIGSTOP)
        rig.stopped.add(pid)

        async def adopted() -> bool:
            s = await rig.b.sessions.get(cut.thread)
            return s is not None and s.owner not in ("", cut.holder) and s.status == "idle"

        await crash_until(adopted, rig.settings.lease_ttl + 10, "the adoption")
        await asyncio.sleep(WORK)  # its turn's work is over when it wakes: it carries on at once
        os.kill(pid, signal.SIGCONT)
        rig.stopped.discard(pid)
        await told_once(rig, cut)
        lost = [
            e
            for e in log_events(rig.logs, cut.holder)
            if e.get("event") == "replica.lost_thread" and e.get("thread_id") == cut.thread
        ]
        assert lost, f"{cut.holder} did not drop the thread on waking"


@pytest.mark.real_redis
async def test_redis_outage_crashes_the_turn_after_the_command_ran(
    server: RedisServer, tmp_path: Path
) -> None:
    """Redis killed while the resume turn works on (its next write fails: the turn crashes) and
    restarted: the same replica finds the turn cut off and reports it, never replays it."""
    async with running_fleet(server, tmp_path, workers=1, **PARKED) as rig:
        cut = await ran_once_then(rig, "o1", tmp_path / "o1.marker")
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(WORK + 1.5)  # the turn's last line is refused: it crashes
        await asyncio.to_thread(server.start)
        await told_once(rig, cut)
        crashed = [
            e
            for e in log_events(rig.logs, cut.holder)
            if e.get("event") in ("replica.thread_failed", "turn.crashed")
        ]
        assert crashed, "the turn did not crash during the outage"


# -- in process: a held answer handed over, then the turn cut off ----------------------------------


class StuckAfterAnswer:
    """An agent that asks one question (held), says what it got, then never ends its turn."""

    name = "scripted"

    async def run_turn(self, turn: Turn) -> TurnResult:
        q = Question(
            question="Pick one", header="pick", options=[Option(label="A"), Option(label="B")]
        )
        answers = await turn.handle.ask("ask_user_question", [q])
        await turn.emit(f"got {answers[0].answer}")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        return ""


async def test_held_answer_then_cut_off_is_told_not_redelivered(
    fleet: Fleet, person: Broker
) -> None:
    """A turn that got its held answer and was then cut off (its replica stopped before the
    turn ended) is reported once by the adopter, with the answer it had; the next turn is told,
    and the answer is never handed over again."""
    r1 = await fleet.start("r1", {"scripted": StuckAfterAnswer()}, shutdown_grace=0.2)
    await person.sessions.create("h1", "scripted", "approval", ASK)
    await person.post_item("h1", text("go"))
    p = await until(lambda: person.active_prompt("h1"), "the held question")
    await person.post_item("h1", text("2"))
    await until(lambda: _has(person, "h1", "got ['B']"), "the stuck agent to get its answer")
    await fleet.stop(r1)  # the turn never ended: its record says running, answer handed over
    s = await person.sessions.get("h1")
    assert s is not None and s.status == "running" and s.delivered == p.prompt_id

    await fleet.start("r2")

    async def told() -> list[Item] | None:
        items = await person.items("h1")
        found = [i for i in items if i.metadata.get("interrupted")]
        return found or None

    (item,) = await until(told, "the interruption item")
    assert item.text.startswith(INTERRUPTED)
    assert f"the person's answer to prompt {p.prompt_id}: Pick one: B" in item.text
    await person.post_item("h1", text("go on"))
    await until(lambda: _has(person, "h1", "starting"), "the next turn")
    lines = outputs(await person.items("h1"))
    first = lines[lines.index("starting") - 1]
    assert first.startswith("My previous turn was interrupted before it ended. It had been")
    assert f"prompt {p.prompt_id}: Pick one: B" in first
    assert [t.resume for t in fleet.turns_of("h1")] == [None]
    assert len([i for i in await person.items("h1") if i.metadata.get("interrupted")]) == 1


async def _has(b: Broker, thread: str, line: str) -> bool:
    return line in outputs(await b.items(thread))


@pytest.mark.real_redis
async def test_sigkill_with_many_threads_cut_at_once(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """Six resume turns on three replicas, each past its command: SIGKILL of the replica running
    the most. Its threads are each reported once and never replayed; the others finish."""
    async with running_fleet(where, tmp_path, workers=3, **PARKED) as rig:
        threads = [f"m{i}" for i in range(6)]
        cuts = await asyncio.gather(
            *(ran_once_then(rig, t, tmp_path / f"{t}.marker", work=8.0) for t in threads)
        )
        victim = Counter(c.holder for c in cuts).most_common(1)[0][0]
        proc = rig.fleet.replica(victim).proc
        assert proc is not None
        rig.fleet.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 5)
        doomed = [c for c in cuts if c.holder == victim]
        await asyncio.gather(*(told_once(rig, c) for c in doomed))
        for c in cuts:
            if c in doomed:
                continue
            done = await crash_until(
                lambda c=c: _has(rig.b, c.thread, f"{c.thread}: wrapped up."), 20, "the rest"
            )
            assert done and marks(c.marker) == 1
            assert not [i for i in await rig.b.items(c.thread) if i.metadata.get("interrupted")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.real_redis
async def test_sigkill_while_the_command_runs(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """SIGKILL of the replica while the approved command still runs: the command (and what it
    started) dies with it within a second; the adopter says the call may or may not have taken
    effect, never that it failed; nothing runs twice."""
    marker, pidfile = tmp_path / "w1.marker", tmp_path / "w1.pid"
    command = f"echo RAN >> {marker}; sleep 30 & echo $! > {pidfile}; wait"
    async with running_fleet(where, tmp_path, workers=2, **PARKED) as rig:
        cut = await ran_once_then(rig, "w1", marker, command=command)
        pid = int(await crash_until(lambda: _read(pidfile), 5, "the command's child pid"))
        proc = rig.fleet.replica(cut.holder).proc
        assert proc is not None and alive(pid)
        rig.fleet.kill(cut.holder, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 5)
        killed_at = asyncio.get_running_loop().time()
        await crash_until(lambda: _gone(pid), 1.0, "the command to die with its replica")
        print(f"the command died {asyncio.get_running_loop().time() - killed_at:.3f} s after")
        await told_once(
            rig,
            cut,
            note=f"Bash `{command}` was interrupted; it may or may not have taken effect; "
            "check before running it again",
        )


async def _read(path: Path) -> str | None:
    return await asyncio.to_thread(_read_now, path)


def _read_now(path: Path) -> str | None:
    text_ = path.read_text().strip() if path.exists() else ""
    return text_ or None


async def _gone(pid: int) -> bool:
    return not alive(pid)


@pytest.mark.real_redis
async def test_sigkill_after_a_held_approval_ran_its_command(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """A held approval answered in place (no grant), its command run, then SIGKILL: the adopter
    reports the answer it had been handed, once; nothing is handed over or run again."""
    async with running_fleet(where, tmp_path, workers=2) as rig:
        cut = await ran_once_then(rig, "h1", tmp_path / "h1.marker", held=True)
        proc = rig.fleet.replica(cut.holder).proc
        assert proc is not None
        rig.fleet.kill(cut.holder, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 5)
        await told_once(rig, cut)


# -- a reply lost on the way ---------------------------------------------------------------------


def lose_first_reply(b: Broker) -> list[int]:
    """Make the broker's next pipeline run on the server, then fail as a dropped connection."""
    calls: list[int] = []
    run = b._scripts.run_pipeline

    async def run_then_drop(redis: Any, pipe: Any) -> list[Any]:
        result = await run(redis, pipe)
        calls.append(1)
        if len(calls) == 1:
            raise RedisConnectionError("connection lost after the command ran")
        return result

    b._scripts.run_pipeline = run_then_drop  # type: ignore[method-assign]
    return calls


async def test_a_resume_whose_reply_was_lost_is_still_handed_over(th: Thread) -> None:
    """The resume ran but its reply was lost: the retry (same token) gets the delivery, not a
    refusal, so the answer is not reported interrupted without ever reaching the agent."""
    calls = lose_first_reply(th.b)
    handed = await th.b.sessions.resume("t1", th.pid, EPOCH, th.grant, "dlv_lost")
    assert handed.outcome == "handed" and len(calls) == 2
    assert (await th.session())["grant"] == th.grant.model_dump_json()


async def test_a_held_delivery_whose_reply_was_lost_is_still_handed_over(th: Thread) -> None:
    """The same for a held answer's delivery record."""
    calls = lose_first_reply(th.b)
    handed = await th.b.sessions.deliver("t1", th.pid, EPOCH, "dlv_lost")
    assert handed.outcome == "handed" and len(calls) == 2
    assert (await th.b.sessions.deliver("t1", th.pid, EPOCH, "dlv_other")).outcome == "already"


@pytest.mark.real_redis
async def test_sigkill_during_a_held_wait_then_cancelled(
    where: RedisServer | OnCluster, tmp_path: Path
) -> None:
    """SIGKILL during a held wait, the prompt cancelled before anyone adopts the thread: the
    adopter reports the cut-off turn once (nothing was handed over), and the next turn is told."""
    marker = tmp_path / "c1.marker"
    async with running_fleet(where, tmp_path, workers=2) as rig:
        b = rig.b
        await b.sessions.create("c1", "scripted", "approval", marker_script("c1", marker))
        await b.post_item("c1", text("Please go ahead."))

        async def holding() -> str | None:
            s = await b.sessions.get("c1")
            ok = s is not None and s.status == "running" and s.waiting is not None
            return s.owner if ok and s is not None else None

        holder = await crash_until(holding, 20, "the held wait")
        proc = rig.fleet.replica(holder).proc
        assert proc is not None
        rig.fleet.kill(holder, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 5)
        assert await b.cancel("c1", "changed my mind") is not None

        async def told() -> list[Item] | None:
            found = [i for i in await b.items("c1") if i.metadata.get("interrupted")]
            s = await b.sessions.get("c1")
            return found if found and s is not None and s.status == "idle" else None

        (item,) = await crash_until(told, 20, "the interruption item")
        assert item.text.startswith(INTERRUPTED) and "It had been handed" not in item.text
        await asyncio.sleep(1.0)  # a negative window: no second interruption item follows
        assert len([i for i in await b.items("c1") if i.metadata.get("interrupted")]) == 1
        assert marks(marker) == 0
        await b.post_item("c1", text("again, please"))
        await crash_until(lambda: b.active_prompt("c1"), 20, "the next turn's question")
        lines = outputs(await b.items("c1"))
        assert any(line.startswith("My previous turn was interrupted") for line in lines)
