"""Replicas end to end, in process, on both backends: held and parked waits, grants, resume turns,
clean stops, fencing, adoption and lost leases.

Every replica runs as an asyncio task (`Replica.run(stop)`) on its own Broker, with short leases
and fast adoption; the `fleet` fixture stops every replica it started. A "person" answers through
another Broker with `post_item`. Synchronisation is by polling the Redis records with deadlines.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fakeredis
import pytest

from broker import (
    Broker,
    Item,
    Prompt,
    Session,
    Settings,
    ThreadNotFound,
)
from tests.conftest import BrokerFactory
from tests.helpers import index_score, of_type, text, truthy, until
from workers.agents.harness import (
    AgentStore,
    Resume,
    Turn,
    TurnResult,
)
from workers.agents.scripted import ScriptedHarness
from workers.runtime.replica import Replica

#: Settings every replica test runs with: short leases, fast adoption, a quick sweep.
FAST: dict[str, Any] = {"lease_ttl": 1.0, "adopt_interval": 0.05, "sweep_interval": 0.5}

T = TypeVar("T")


# -- helpers ---------------------------------------------------------------------------------


def pick(question: str = "Pick one") -> dict[str, Any]:
    return {"question": question, "header": "pick", "options": [{"label": "A"}, {"label": "B"}]}


def tool(command: str, output: str) -> dict[str, Any]:
    return {"tool": "Bash", "input": {"command": command}, "output": output}


def script(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"script": {"turns": [{"steps": list(steps)}]}}


#: Say something, ask one question, say something: the basic held or parked wait.
ASK = script({"say": "starting"}, {"ask": [pick()]}, {"say": "done"})


@dataclass
class TurnLog:
    """One turn a replica ran: where, for which thread, with what input."""

    replica: str
    thread_id: str
    prompt: str
    resume: Resume | None


class Recorder:
    """The scripted harness, recording every turn it is given."""

    name = "scripted"

    def __init__(self, replica_id: str, log: list[TurnLog]) -> None:
        self.replica_id = replica_id
        self.log = log
        self.inner = ScriptedHarness()

    async def run_turn(self, turn: Turn) -> TurnResult:
        self.log.append(TurnLog(self.replica_id, turn.thread_id, turn.prompt, turn.resume))
        return await self.inner.run_turn(turn)

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        return await self.inner.describe_interruption(thread_id, state, store)


@dataclass
class Running:
    replica: Replica
    broker: Broker
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def id(self) -> str:
        return self.replica.id


@dataclass
class Fleet:
    """Replicas started by a test; `aclose` stops every one still running."""

    make_broker: BrokerFactory
    running: list[Running] = field(default_factory=list)
    turns: list[TurnLog] = field(default_factory=list)

    async def start(
        self, replica_id: str, harnesses: dict[str, Any] | None = None, **overrides: Any
    ) -> Running:
        b = await self.make_broker(**(FAST | overrides))
        if harnesses is None:
            harnesses = {"scripted": Recorder(replica_id, self.turns)}
        replica = Replica(b, harnesses=harnesses, replica_id=replica_id)
        stop = asyncio.Event()
        task = asyncio.create_task(replica.run(stop), name=f"replica {replica_id}")
        r = Running(replica, b, stop, task)
        self.running.append(r)
        return r

    async def stop(self, r: Running) -> None:
        r.stop.set()
        await asyncio.wait_for(r.task, 15)

    async def aclose(self) -> None:
        for r in self.running:
            r.stop.set()
        for r in self.running:
            try:
                await asyncio.wait_for(r.task, 15)
            except Exception:
                logging.getLogger(__name__).exception("replica %s did not stop cleanly", r.id)

    def turns_of(self, thread_id: str) -> list[TurnLog]:
        return [t for t in self.turns if t.thread_id == thread_id]


async def start_thread(
    b: Broker, thread_id: str, config: dict[str, Any], permissions: str = "approval"
) -> None:
    await b.sessions.create(thread_id, "scripted", permissions, config, work_folder="/work/proj")
    await b.post_item(thread_id, text("go"))


async def session(b: Broker, thread_id: str) -> Session:
    s = await b.sessions.get(thread_id)
    assert s is not None
    return s


async def active(b: Broker, thread_id: str) -> Prompt:
    """The thread's active prompt, once there is one."""
    return await until(lambda: b.active_prompt(thread_id), f"a prompt on {thread_id}")


async def status_is(b: Broker, thread_id: str, *statuses: str) -> Session:
    async def check() -> Session | None:
        s = await session(b, thread_id)
        return s if s.status in statuses else None

    return await until(check, f"{thread_id} to be {'/'.join(statuses)}")


async def turn_ends(b: Broker, thread_id: str, n: int = 1) -> list[Item]:
    """Wait until the thread has `n` `turn_end` items and its session is idle; its items."""

    async def check() -> list[Item] | None:
        items = await b.items(thread_id)
        s = await session(b, thread_id)
        return items if len(of_type(items, "turn_end")) >= n and s.status == "idle" else None

    return await until(check, f"{n} turn_end on {thread_id}")


def delivered_logs(caplog: pytest.LogCaptureFixture, prompt_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "prompt.delivered" and getattr(r, "prompt_id", None) == prompt_id
    ]


# -- closing ---------------------------------------------------------------------------------


async def test_close_an_unknown_thread_writes_nothing(person: Broker) -> None:
    """Closing a thread that has no session raises ThreadNotFound and leaves no partial record:
    the thread can still be created afterwards."""
    with pytest.raises(ThreadNotFound):
        await person.sessions.close("nosuch")
    assert await person.redis.exists(person.thread("nosuch").session) == 0
    assert await person.sessions.get("nosuch") is None
    created = await person.sessions.create("nosuch", "scripted", "approval", ASK)
    assert created.status == "idle"


async def test_close_fences_the_holder_and_cancels_the_open_prompt(
    fleet: Fleet, person: Broker
) -> None:
    """Closing a held thread moves its epoch on (its holder is fenced), frees it, cancels its
    open prompt with the reason; closing it again changes nothing."""
    await fleet.start("r1")
    await start_thread(person, "c1", ASK)
    p = await active(person, "c1")
    before = await session(person, "c1")
    await person.sessions.close("c1", "done here")
    after = await session(person, "c1")
    assert after.status == "closed" and after.owner == "" and after.epoch == before.epoch + 1
    prompt = await person.get_prompt("c1", p.prompt_id)
    assert prompt.state == "cancelled" and prompt.reason == "done here"
    await person.sessions.close("c1")
    assert (await session(person, "c1")).epoch == after.epoch


async def test_a_new_thread_is_indexed_only_once_its_record_exists(settings: Settings) -> None:
    """On a server that has not loaded the scripts yet, a replica claiming from the lease index
    while `create` loads its script must not drop the new thread from the index for good."""
    server = fakeredis.FakeServer()  # fresh: no script loaded
    person = Broker(fakeredis.FakeAsyncRedis(server=server, decode_responses=True), settings)
    rival = Broker(fakeredis.FakeAsyncRedis(server=server, decode_responses=True), settings)
    load = person.redis.script_load

    async def load_while_a_replica_claims(source: str) -> Any:
        await rival.sessions.claim_many(["n1"], "r9", "i1")
        return await load(source)

    person.redis.script_load = load_while_a_replica_claims  # type: ignore[method-assign]
    try:
        await person.sessions.create("n1", "scripted", "approval", ASK)
        assert await index_score(person, "leases", "n1") is not None
        assert await rival.sessions.claim_many(["n1"], "r9", "i1") == {"n1": 1}
    finally:
        await person.aclose()
        await rival.aclose()


async def test_a_replica_warms_its_deferred_harnesses_only_after_its_first_adoption_pass(
    fleet: Fleet, person: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness import (`OnFirstUse.warm`) starts once the first adoption pass has ended:
    here three full pages, each claim made slow, far past the old fixed two adoption
    intervals; by then every thread is held."""
    from workers.runtime import adoption

    monkeypatch.setattr(adoption, "ADOPT_PAGE", 10)
    for i in range(30):
        await person.sessions.create(f"w{i:02d}", "scripted", "approval", ASK)
    held_at_warm: list[int] = []

    class Deferred:
        name = "deferred"

        def warm(self) -> None:
            held_at_warm.append(len(r.replica.threads))

    r = await fleet.start("r1", {"scripted": Recorder("r1", fleet.turns), "deferred": Deferred()})
    claim_many = r.broker.sessions.claim_many

    async def slow_claim(*args: Any, **kwargs: Any) -> dict[str, int]:
        await asyncio.sleep(0.2)  # 4 x the adoption interval, per page
        return await claim_many(*args, **kwargs)

    r.broker.sessions.claim_many = slow_claim  # type: ignore[method-assign]
    await until(lambda: truthy(bool(held_at_warm)), "the warm")
    assert held_at_warm == [30]


def test_a_harness_warmed_on_its_thread_logs_how_long_its_import_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`warm` imports on a thread of its own and logs `harness.loaded` there, with the seconds
    it took (an operator sees what a replica's first turn no longer waits for); a later `load`
    returns that harness and logs nothing more."""
    import logging
    import threading

    from workers.agents.scripted import ScriptedHarness
    from workers.runtime.replica import OnFirstUse

    caplog.set_level(logging.INFO, logger="workers")
    scripted = OnFirstUse("scripted", "workers.agents.scripted", "ScriptedHarness")
    scripted.warm()
    for t in threading.enumerate():
        if t.name == "import-scripted":
            t.join(10)
    loaded = [r for r in caplog.records if r.getMessage() == "harness.loaded"]
    assert len(loaded) == 1
    assert loaded[0].__dict__["harness"] == "scripted"
    assert loaded[0].__dict__["on"] == "import-scripted"
    assert 0 <= loaded[0].__dict__["seconds"] < 10
    assert scripted.loaded
    assert isinstance(scripted.load(), ScriptedHarness)
    assert len([r for r in caplog.records if r.getMessage() == "harness.loaded"]) == 1


def test_a_harness_left_for_first_use_that_does_not_import_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`warm` of a harness whose module does not import logs `harness.import_failed` (no
    traceback, the replica runs on); using it raises the import's error to that turn."""
    import threading

    from workers.runtime.replica import OnFirstUse

    broken = OnFirstUse("broken", "workers.no_such_harness_module", "Harness")
    broken.warm()
    for t in threading.enumerate():
        if t.name == "import-broken":
            t.join(10)
    assert [r.getMessage() for r in caplog.records] == ["harness.import_failed"]
    assert not broken.loaded
    with pytest.raises(ModuleNotFoundError):
        broken.load()
