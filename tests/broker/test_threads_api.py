"""Unknown and closed threads: `post_item(create=False)`, `ThreadNotFound`, `ThreadClosed`,
`thread_exists`. Every refusal writes nothing, and is decided inside the routing script."""

from __future__ import annotations

import pytest

from broker import BadItem, Broker, BrokerError, ThreadClosed, ThreadNotFound
from tests.helpers import text

APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


async def keys_of(broker: Broker) -> set[str]:
    """Every key under this test's prefix: what a refusal must leave untouched."""
    return {k async for k in broker.redis.scan_iter(match=f"{broker.keys.prefix}:*")}


async def test_error_tree() -> None:
    assert issubclass(ThreadNotFound, BrokerError) and issubclass(ThreadClosed, BrokerError)
    assert issubclass(ThreadNotFound, LookupError)
    assert ThreadNotFound("t1").thread_id == "t1"
    assert ThreadClosed("t2").thread_id == "t2"
    assert "t2" in str(ThreadClosed("t2")) and "t1" in str(ThreadNotFound("t1"))


async def test_unknown_thread_refused_without_create(broker: Broker) -> None:
    before = await keys_of(broker)
    with pytest.raises(ThreadNotFound) as e:
        await broker.post_item("nosuch", text("2"), create=False)
    assert e.value.thread_id == "nosuch"
    assert await keys_of(broker) == before
    assert not await broker.thread_exists("nosuch")


async def test_unknown_thread_started_by_default(broker: Broker) -> None:
    assert not await broker.thread_exists("fresh")
    routed = await broker.post_item("fresh", text("hello"))
    assert routed.outcome == "queued"
    assert await broker.thread_exists("fresh")


async def test_create_false_accepts_a_thread_with_items(broker: Broker) -> None:
    await broker.post_item("t", text("first"))
    routed = await broker.post_item("t", text("second"), create=False)
    assert routed.outcome == "queued"


async def test_create_false_accepts_a_thread_with_only_a_session(broker: Broker) -> None:
    """A session made by `thread new` has no items yet: the thread exists all the same."""
    await broker.sessions.create("s", "scripted")
    assert await broker.redis.xlen(broker.thread("s").items) == 0
    assert await broker.thread_exists("s")
    routed = await broker.post_item("s", text("go"), create=False)
    assert routed.outcome == "queued"


async def test_create_false_answers_an_active_prompt(broker: Broker) -> None:
    p = await broker.ask("t", "approval", [APPROVAL])
    routed = await broker.post_item("t", text("yes"), create=False)
    assert routed.outcome == "answered" and routed.prompt_id == p.prompt_id


@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize("author", ["user", "self"])
async def test_closed_thread_refuses_every_post(broker: Broker, create: bool, author: str) -> None:
    await broker.sessions.create("c", "scripted")
    await broker.post_item("c", text("before"))
    await broker.sessions.close("c")
    before = await keys_of(broker)
    items = await broker.redis.xlen(broker.thread("c").items)
    inbox = await broker.redis.lrange(broker.thread("c").inbox, 0, -1)
    item = text("after")
    if author == "self":
        item["author"] = broker.identity
    with pytest.raises(ThreadClosed) as e:
        await broker.post_item("c", item, create=create)
    assert e.value.thread_id == "c"
    assert await broker.redis.xlen(broker.thread("c").items) == items
    assert await broker.redis.lrange(broker.thread("c").inbox, 0, -1) == inbox
    assert await keys_of(broker) == before
    assert await broker.thread_exists("c")


async def test_closed_thread_refuses_an_answer_to_a_prompt_left_open(broker: Broker) -> None:
    """Decided in the script: even a prompt whose record is still pending (a close that did not
    cancel it, written by an older version) is not answered on a closed thread."""
    await broker.sessions.create("c", "scripted")
    p = await broker.ask("c", "approval", [APPROVAL])
    await broker.redis.hset(broker.thread("c").session, "status", "closed")
    with pytest.raises(ThreadClosed):
        await broker.post_item("c", text("yes"))
    assert (await broker.get_prompt("c", p.prompt_id)).state == "pending"


async def test_route_script_refuses_on_its_own(broker: Broker) -> None:
    """The script itself refuses (no Python check in front of it): a closed session, and an
    unknown thread when told not to create it."""
    tk = broker.thread("raw")

    async def route(create: str) -> list[str]:
        reply = await broker._scripts.call(
            broker.redis,
            "route",
            [tk.items, tk.active, tk.inbox, tk.session],
            [
                *["itm_x", "user", "", '{"content":[]}', "user", "", "", "", '{"raw":"x"}'],
                *[tk.base, tk.wake, "", create],
            ],
        )
        return list(reply)

    assert await route("0") == ["notfound"]
    assert await broker.redis.exists(tk.items) == 0
    await broker.redis.hset(tk.session, "status", "closed")
    assert await route("1") == ["closed"]
    assert await route("0") == ["closed"]
    assert await broker.redis.exists(tk.items) == 0


async def test_thread_exists_checks_its_id(broker: Broker) -> None:
    with pytest.raises(BadItem):
        await broker.thread_exists("no spaces allowed")
