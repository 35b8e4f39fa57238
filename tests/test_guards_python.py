"""Guards of the Python side, each tested on its own (bench/mutation.py removes each in turn), on
fakeredis and a real redis-server.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from broker import Broker, Fenced, Item
from tests.agents.test_policy import bash, guard, rule
from tests.broker.test_waiter import NEVER
from tests.conftest import BrokerFactory
from tests.helpers import drop_indexes, index_add, index_members, index_score, text, truthy, until
from tests.runtime.test_crash import INTERRUPTED
from tests.runtime.test_delivery_once import EPOCH, Thread, asked
from tests.runtime.test_replica import ASK, Fleet, active, start_thread
from workers.agents.harness import approval_question
from workers.runtime import audit
from workers.runtime.holding import _Thread
from workers.runtime.replica import Replica
from workers.runtime.waits import _Handle, _Slot

APPROVAL = {"question": "Run `make`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


@pytest.fixture
async def th(broker: Broker) -> Thread:
    """A claimed thread whose agent asked one approval, which the person answered."""
    return await asked(broker)


async def test_rebuild_indexes_only_what_may_be_audited(broker: Broker) -> None:
    """From the records alone: a pending prompt is open; a cancelled one or a delivered answer
    is due for audit; an answer never delivered is not (it is never audited), nor a prompt whose
    resolution was already posted."""
    pending = await broker.ask("a", "approval", [APPROVAL])
    undelivered = await broker.ask("b", "approval", [APPROVAL])
    assert (await broker.post_item("b", text("Approve"))).outcome == "answered"
    delivered = await broker.ask("c", "approval", [APPROVAL])
    assert (await broker.post_item("c", text("Approve"))).outcome == "answered"
    await broker.deliver("c", delivered.prompt_id)
    cancelled = await broker.ask("d", "approval", [APPROVAL])
    await broker.cancel("d", "stop")
    posted = await broker.ask("e", "approval", [APPROVAL])
    assert (await broker.post_item("e", text("Deny"))).outcome == "answered"
    await broker.deliver("e", posted.prompt_id)
    assert await broker.post_resolution("e", posted.prompt_id) is not None

    # Wrong entries on purpose, then no indexes at all: the records decide.
    await drop_indexes(broker, "open", "audit")
    await index_add(broker, "audit", {f"e/{posted.prompt_id}": 1})
    await index_add(broker, "open", {f"b/{undelivered.prompt_id}": 1})
    counts = await audit.rebuild_indexes(broker)
    assert counts["scanned"] == 5
    assert await index_members(broker, "open") == [f"a/{pending.prompt_id}"]
    assert sorted(await index_members(broker, "audit")) == sorted(
        [f"c/{delivered.prompt_id}", f"d/{cancelled.prompt_id}"]
    )


# -- workers/runtime/replica.py: a parked answer handed over before is never handed over again -----


async def test_a_parked_answer_already_handed_over_is_told_not_resumed(
    fleet: Fleet, person: Broker
) -> None:
    """The answer to a parked prompt was handed to a resume turn that was cut off before it
    touched the session (the record says delivered; the session still waits on it). The adopter's
    resume is refused as a second delivery: it reports the interruption and runs no turn."""
    a = await fleet.start("ra", lease_ttl=5.0)
    await start_thread(person, "t1", ASK)
    p = await active(person, "t1")
    await until(lambda: truthy(a.replica.held_count() == 1), "the held wait")
    await fleet.stop(a)  # parked and released
    assert (await person.post_item("t1", text("2"))).outcome == "answered"
    prompt_key = person.thread("t1").prompt(p.prompt_id)
    await person.redis.hset(prompt_key, mapping={"delivered": "1", "delivery": "dlv_cut"})  # type: ignore[misc]

    await fleet.start("rb", lease_ttl=5.0)

    async def told() -> list[Item] | None:
        found = [i for i in await person.items("t1") if i.metadata.get("interrupted")]
        return found or None

    (item,) = await until(told, "the interruption item")
    assert item.text.startswith(INTERRUPTED)
    assert [t.resume for t in fleet.turns_of("t1")] == [None]


# -- workers/agents/policy.py: an allow rule that cannot prove a command yields to a later deny ----


def test_an_unproven_allow_yields_to_a_later_deny() -> None:
    """`git push "$REMOTE"` matches the allow glob, but the expansion leaves it unproven: a later
    deny rule that matches decides (deny, not ask); with none, it asks."""
    rules = [
        rule("ok", "exec", "allow", command=["git *"]),
        rule("no", "exec", "deny", command=["git push*"]),
    ]
    g = guard(*rules)
    assert bash(g, 'git push "$REMOTE"').action == "deny"
    assert bash(g, 'git push "$REMOTE"').rule == "no"
    assert bash(g, 'git status "$X"').action == "ask"
    assert bash(g, "git push origin").action == "allow"


# -- broker/_waiter.py: a resolution heard before the wait began ------------------------------


async def test_an_answer_heard_before_the_wait_is_used(make_broker: BrokerFactory) -> None:
    """The bell rang for the prompt after its ask subscribed and before anyone waited on it: the
    channel was not resubscribed since, so the wait reads nothing and must use what was heard.
    The sweep is an hour away, so only that can end the wait."""
    b = await make_broker(sweep_interval=NEVER)
    surface = await make_broker(sweep_interval=NEVER)
    p = await b.ask("t1", "approval", [APPROVAL])
    assert (await surface.post_item("t1", text("Approve"))).outcome == "answered"

    async def heard() -> bool:
        note = b._waiter._expected.get(p.prompt_id)
        return note is not None and note[2] is not None

    await until(heard, "the bell to be heard")
    answers = await b.wait("t1", p.prompt_id, timeout=5)
    assert answers[0].answer == ["Approve"]


# -- broker/delivery.py ------------------------------------------------------------------------


async def test_a_fenced_wait_hands_nothing_over(th: Thread) -> None:
    """A holder whose epoch moved on gets `Fenced`, not the answer, and nothing is recorded."""
    with pytest.raises(Fenced):
        await th.b.wait("t1", th.pid, timeout=5, epoch=EPOCH + 1)
    await th.b.settle()
    assert "delivered" not in await th.record()


async def test_a_posted_resolution_leaves_the_audit_index(th: Thread) -> None:
    await th.b.deliver("t1", th.pid)
    member = th.b.keys.member("t1", th.pid)
    assert await index_score(th.b, "audit", member) is not None
    assert await th.b.post_resolution("t1", th.pid) is not None
    assert await index_score(th.b, "audit", member) is None


# -- broker/sessions.py ------------------------------------------------------------------------


async def test_a_grant_replaced_after_the_read_is_not_reported_spent(th: Thread) -> None:
    """The script refuses the spend ('changed'): the caller is told None, not an item id."""
    await th.resume("dlv_a")
    session = await th.b.sessions.get("t1")
    assert session is not None and session.grant is not None
    replaced = th.grant.model_copy(update={"grant_key": "Bash:make other"})
    await th.b.redis.hset(th.tk.session, "grant", replaced.model_dump_json())  # type: ignore[misc]
    assert await th.b.sessions.spend_grant(session, EPOCH, "Run it?") is None
    assert await th.items("approval_granted") == 0


# -- workers/runtime/replica.py: a grant is spent only on a call to its own tool -------------------


async def test_a_keyless_grant_is_spent_only_on_its_own_subject(th: Thread) -> None:
    """A grant with no key (Codex mints such for calls with no command) covers any call to its
    subject, and none to another: a call to another tool asks, the grant is kept for its own."""
    keyless = th.grant.model_copy(update={"grant_key": None})
    assert (await th.resume("dlv_a", grant=keyless.model_dump_json()))[0] == "resumed"
    # The handle's grant path alone: its replica and thread are only where it reads the broker,
    # the thread id and the epoch.
    handle = _Handle(
        cast(Replica, SimpleNamespace(broker=th.b)),
        cast(_Thread, SimpleNamespace(thread_id="t1", epoch=EPOCH)),
        cast(_Slot, None),
    )
    other = approval_question("Write", {"file_path": "/work/x"}).model_copy(
        update={"grant_key": None}
    )
    assert await handle._spend_grant(other) is None
    assert "grant" in await th.session()
    own = approval_question("Bash", {"command": "make other"}).model_copy(
        update={"grant_key": None}
    )
    assert await handle._spend_grant(own) is not None
    assert "grant" not in await th.session()
