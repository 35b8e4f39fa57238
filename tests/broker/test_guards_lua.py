"""Each guard of the Lua scripts, tested by calling the script itself, on fakeredis and a real
redis-server: no Python pre-check stands in front, so removing any one guard fails a test here.

The guards of resume, deliver, grant and interrupt that tests/runtime/test_delivery_once.py already
holds are not repeated; this file holds the rest (bench/mutation.py removes each guard in turn).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from broker import Broker
from broker.keys import ThreadKeys
from tests.runtime.test_delivery_once import EPOCH, Thread, asked, interrupt

TTL = 60_000
INC = "inc1"  # the claiming replica's incarnation


@pytest.fixture
async def th(broker: Broker) -> Thread:
    """A claimed thread whose agent asked one approval, which the person answered."""
    return await asked(broker)


async def call(b: Broker, name: str, keys: list[str], args: list[Any]) -> list[Any]:
    return list(await b._scripts.call(b.redis, name, keys, args))


async def hgetall(b: Broker, key: str) -> dict[str, str]:
    return dict(await b.redis.hgetall(key))  # type: ignore[misc]


async def claimed(b: Broker, thread_id: str = "t1", replica: str = "r1") -> ThreadKeys:
    """A session made and claimed by `replica` (incarnation `INC`) at epoch 1."""
    await b.sessions.create(thread_id, "scripted", "approval", {})
    tk = b.thread(thread_id)
    # As the holder-less session was read: nobody holds it, no record was seen.
    assert await call(b, "claim", [tk.session], [replica, INC, "", "", "", 0]) == [
        ["claimed", "1", "", ""]
    ]
    return tk


def retention(b: Broker) -> list[Any]:
    """The stream limits the ask and audit scripts take last."""
    return [b.settings.stream_max_items, b.settings.stream_max_age]


def wait_on(prompt_id: str) -> str:
    return orjson.dumps({"prompt_id": prompt_id, "kind": "approval", "subject": "Bash"}).decode()


# -- _lib.lua: cancel_prompt ------------------------------------------------------------------


def cancel_args(tk: ThreadKeys, prompt_id: str) -> tuple[list[str], list[Any]]:
    return [tk.active, tk.session], ["closed", prompt_id, "", tk.base, tk.wake]


async def test_cancel_leaves_an_answered_prompt_answered(th: Thread) -> None:
    """A cancel that lands after the answer changes nothing: the answer stands."""
    keys, args = cancel_args(th.tk, th.pid)
    assert await call(th.b, "cancel", keys, args) == ["none", ""]
    assert (await th.record())["state"] == "answered"


async def test_cancel_clears_only_its_own_lock(broker: Broker) -> None:
    """Cancelling a pending prompt that no longer holds the thread's lock leaves the lock to the
    prompt that holds it."""
    th = await asked(broker, answer=None)
    await broker.redis.set(th.tk.active, "pmt_other")
    keys, args = cancel_args(th.tk, th.pid)
    assert await call(broker, "cancel", keys, args) == ["cancelled", th.pid]
    assert await broker.redis.get(th.tk.active) == "pmt_other"


async def test_cancel_is_fenced(th: Thread) -> None:
    """A stale holder cancels nothing."""
    b = th.b
    p = await b.ask("t1", "approval", [th.prompt.questions[0]], epoch=EPOCH)
    keys, args = cancel_args(th.tk, p.prompt_id)
    args[2] = EPOCH - 1
    assert await call(b, "cancel", keys, args) == ["fenced", str(EPOCH)]
    assert (await hgetall(b, th.tk.prompt(p.prompt_id)))["state"] == "pending"


# -- resume.lua --------------------------------------------------------------------------------


async def test_resume_refuses_a_cancelled_prompt(broker: Broker) -> None:
    """A cancelled prompt is never handed over: not marked delivered, no turn, no grant."""
    th = await asked(broker, answer=None)
    assert await broker.cancel("t1", "closed") is not None
    assert await th.resume("dlv_a") == ["state", "cancelled"]
    record, session = await th.record(), await th.session()
    assert "delivered" not in record and "granted" not in record
    assert session["status"] != "running" and "grant" not in session


async def test_resume_without_a_grant_mints_none(th: Thread) -> None:
    """A denial (no grant given) mints no grant and marks none minted."""
    assert (await th.resume("dlv_a", grant=""))[0] == "resumed"
    assert "grant" not in await th.session()
    assert "granted" not in await th.record()


async def test_resume_leaves_a_wait_on_another_prompt(th: Thread) -> None:
    """Handing over prompt A does not end the session's wait on prompt B."""
    await th.b.redis.hset(th.tk.session, "wait", wait_on("pmt_b"))  # type: ignore[misc]
    assert (await th.resume("dlv_a"))[0] == "resumed"
    assert orjson.loads((await th.session())["wait"])["prompt_id"] == "pmt_b"


# -- deliver.lua -------------------------------------------------------------------------------


async def test_held_delivery_leaves_a_wait_on_another_prompt(th: Thread) -> None:
    """Delivering prompt A does not end the session's wait on prompt B."""
    await th.b.redis.hset(th.tk.session, "wait", wait_on("pmt_b"))  # type: ignore[misc]
    assert (await th.deliver("dlv_a"))[0] == "delivered"
    s = await th.session()
    assert orjson.loads(s["wait"])["prompt_id"] == "pmt_b" and "delivered" not in s


async def test_second_delivery_keeps_the_first_time(th: Thread) -> None:
    """A second delivery reports the first one's time and rewrites nothing."""
    first = await th.deliver("dlv_a")
    await th.b.redis.hset(th.tk.prompt(th.pid), "delivered", "1")  # type: ignore[misc]
    assert await th.deliver("dlv_b") == ["already", "1"]
    assert first[0] == "delivered" and (await th.record())["delivered"] == "1"


async def test_a_delivery_with_no_token_is_never_taken_for_a_retry(th: Thread) -> None:
    """Resumed with no token (the script stores it as given), then delivered with none: that is
    a second delivery, not a retry of the first, so it is refused."""
    assert (await th.resume(""))[0] == "resumed"
    assert (await th.deliver(""))[0] == "already"


# -- interrupt.lua -----------------------------------------------------------------------------


async def test_a_wait_on_another_prompt_is_not_an_interruption(th: Thread) -> None:
    """The delivered prompt named is not the one the session waits on: that wait is live."""
    await th.resume("dlv_a")
    await th.b.redis.hset(th.tk.session, mapping={"status": "parked", "wait": wait_on("pmt_b")})  # type: ignore[misc]
    assert await interrupt(th, waited=th.pid) is False
    s = await th.session()
    assert s["status"] == "parked" and "wait" in s


# -- release.lua -------------------------------------------------------------------------------


async def test_release_only_by_the_holder_at_its_epoch(broker: Broker) -> None:
    tk = await claimed(broker)
    assert await call(broker, "release", [tk.session], ["r2", EPOCH]) == ["lost"]
    assert await call(broker, "release", [tk.session], ["r1", EPOCH - 1]) == ["lost"]
    s = await hgetall(broker, tk.session)
    assert s["owner"] == "r1" and s["epoch"] == "1"


async def test_release_fences_the_old_epoch(broker: Broker) -> None:
    """After a release, whatever the old holder still sends is refused."""
    tk = await claimed(broker)
    assert await call(broker, "release", [tk.session], ["r1", EPOCH]) == ["released"]
    s = await hgetall(broker, tk.session)
    assert s["owner"] == "" and s["inc"] == "" and s["epoch"] == str(EPOCH + 1)
    assert await call(broker, "update", [tk.session], [EPOCH, "status", "running"]) == [
        "fenced",
        str(EPOCH + 1),
    ]


# -- claim.lua ---------------------------------------------------------------------------------


def claim_args(replica: str, seen: tuple[str, str], record: tuple[str, int]) -> list[Any]:
    """A claim by `replica` (incarnation "inc2") that read holder `seen` and its `record`."""
    return [replica, "inc2", *seen, *record]


async def test_claim_of_no_session_writes_nothing(broker: Broker) -> None:
    tk = broker.thread("t1")
    assert await call(broker, "claim", [tk.session], claim_args("r1", ("", ""), ("", 0))) == [
        ["missing"]
    ]
    assert await broker.redis.exists(tk.session) == 0


async def test_claim_of_a_closed_thread_is_refused(broker: Broker) -> None:
    tk = await claimed(broker)
    assert (await call(broker, "close", [tk.session], []))[0] == "closed"
    args = claim_args("r2", ("", ""), ("", 0))
    assert await call(broker, "claim", [tk.session], args) == [["closed"]]
    assert (await hgetall(broker, tk.session))["owner"] == ""


async def test_claim_only_from_the_holder_it_read(broker: Broker) -> None:
    """A claim that read another holder than the session names now takes nothing ('moved')."""
    tk = await claimed(broker)
    for seen in (("r9", INC), ("r1", "old")):
        args = claim_args("r2", seen, ("", 0))
        assert await call(broker, "claim", [tk.session], args) == [["moved", "r1", INC]]
    s = await hgetall(broker, tk.session)
    assert s["owner"] == "r1" and s["epoch"] == "1"


async def test_claim_only_from_a_dead_holder(broker: Broker) -> None:
    """A holder whose record is its own incarnation with a deadline to come is alive: held. Seen
    dead (its deadline passed, or the record is another incarnation's), it is taken, at a new
    epoch."""
    tk = await claimed(broker)
    future = await broker.sessions.server_ms() + TTL
    alive = claim_args("r2", ("r1", INC), (INC, future))
    assert await call(broker, "claim", [tk.session], alive) == [["held", "r1", INC]]
    other = claim_args("r2", ("r1", INC), ("inc0", future))
    assert await call(broker, "claim", [tk.session], other) == [["claimed", "2", "r1", INC]]
    expired = claim_args("r3", ("r2", "inc2"), ("inc2", 1))
    assert await call(broker, "claim", [tk.session], expired) == [["claimed", "3", "r2", "inc2"]]
    s = await hgetall(broker, tk.session)
    assert s["owner"] == "r3" and s["epoch"] == "3"


# -- close.lua and create.lua ------------------------------------------------------------------


async def test_close_of_no_session_writes_nothing(broker: Broker) -> None:
    tk = broker.thread("t1")
    assert await call(broker, "close", [tk.session], []) == ["missing"]
    assert await broker.redis.exists(tk.session) == 0


async def test_close_bumps_the_epoch_once(broker: Broker) -> None:
    """Close fences the last holder; closing again moves nothing."""
    tk = await claimed(broker)
    assert await call(broker, "close", [tk.session], []) == ["closed", "2"]
    assert await call(broker, "close", [tk.session], []) == ["already"]
    assert (await hgetall(broker, tk.session))["epoch"] == "2"
    assert (await call(broker, "update", [tk.session], [EPOCH, "x", "y"]))[0] == "fenced"


async def test_create_leaves_an_existing_session_alone(broker: Broker) -> None:
    tk = await claimed(broker)
    args = ["scripted", "approval", "{}", "", ""]
    assert await call(broker, "create", [tk.session], args) == ["exists"]
    s = await hgetall(broker, tk.session)
    assert s["owner"] == "r1" and s["epoch"] == "1"


async def test_update_is_fenced(broker: Broker) -> None:
    tk = await claimed(broker)
    assert await call(broker, "update", [tk.session], [EPOCH + 1, "status", "x"]) == [
        "fenced",
        "1",
    ]
    assert (await hgetall(broker, tk.session))["status"] == "idle"


# -- ask.lua -----------------------------------------------------------------------------------


def ask_args(b: Broker, tk: ThreadKeys, prompt_id: str, epoch: Any) -> tuple[list[str], list[Any]]:
    keys = [tk.items, tk.active, tk.prompt(prompt_id), tk.session]
    body = orjson.dumps({"content": [], "metadata": {"type": "pending_prompt"}})
    args = [prompt_id, "itm_x", "agent", body, "approval", "{}", epoch, tk.base, tk.wake, "", ""]
    return keys, args + retention(b)


async def test_ask_is_fenced(broker: Broker) -> None:
    """A stale holder asks nothing: no item, no lock, no record."""
    tk = await claimed(broker)
    keys, args = ask_args(broker, tk, "pmt_a", EPOCH - 1)
    assert await call(broker, "ask", keys, args) == ["fenced", "1"]
    assert await broker.redis.exists(tk.items, tk.active, tk.prompt("pmt_a")) == 0


async def test_ask_again_does_not_supersede_itself(broker: Broker) -> None:
    """An ask retried with the prompt id that holds the lock keeps that prompt pending."""
    tk = await claimed(broker)
    keys, args = ask_args(broker, tk, "pmt_a", EPOCH)
    assert (await call(broker, "ask", keys, args))[0] == "ok"
    status, _, superseded = await call(broker, "ask", keys, args)
    assert status == "ok" and superseded == ""
    assert (await hgetall(broker, tk.prompt("pmt_a")))["state"] == "pending"


# -- audit.lua ---------------------------------------------------------------------------------


def audit_args(th: Thread, state: str, item: str = "itm_r") -> tuple[list[str], list[Any]]:
    body = orjson.dumps({"content": [], "metadata": {"type": "pending_prompt_resolved"}})
    args = [item, "audit", body, state, "0", th.tk.base, th.pid, *retention(th.b)]
    return [th.tk.prompt(th.pid), th.tk.items], args


async def test_audit_refuses_an_undelivered_answer(th: Thread) -> None:
    """An answer nobody was handed is never audited, whatever the caller checked first."""
    assert await call(th.b, "audit", *audit_args(th, "answered")) == ["refused", "undelivered"]
    assert await th.items("pending_prompt_resolved") == 0


async def test_audit_refuses_a_pending_or_missing_prompt(broker: Broker) -> None:
    th = await asked(broker, answer=None)
    assert await call(broker, "audit", *audit_args(th, "pending")) == ["refused", "pending"]
    gone = Thread(broker, th.tk, th.prompt.model_copy(update={"prompt_id": "pmt_gone"}), th.grant)
    assert await call(broker, "audit", *audit_args(gone, "answered")) == ["refused", "missing"]
    assert await broker.redis.exists(th.tk.prompt("pmt_gone")) == 0
    assert await th.items("pending_prompt_resolved") == 0


async def test_audit_refuses_a_body_of_another_state(th: Thread) -> None:
    await th.deliver("dlv_a")
    assert await call(th.b, "audit", *audit_args(th, "cancelled")) == ["refused", "changed"]
    assert await th.items("pending_prompt_resolved") == 0


async def test_audit_posts_once(th: Thread) -> None:
    await th.deliver("dlv_a")
    assert await call(th.b, "audit", *audit_args(th, "answered")) == ["posted", "itm_r"]
    assert (await th.record())["audit_item"] == "itm_r"
    assert await call(th.b, "audit", *audit_args(th, "answered", "itm_s")) == ["already", "itm_r"]
    assert await th.items("pending_prompt_resolved") == 1
