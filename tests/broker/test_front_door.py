"""The front door refuses bad input with its own errors, and nothing else ever leaves it.

Bad input is `BadItem` naming the field, with nothing written; Redis unreachable or refusing
writes is `BrokerUnavailable` from every public method; any client is accepted. A hypothesis
fuzz drives every public entry point with hostile values and holds: only `BrokerError`
subclasses, nothing written on a refusal, the active prompt unchanged and still answerable.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import fakeredis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from broker import (
    LIMITS,
    BadItem,
    Broker,
    BrokerError,
    BrokerUnavailable,
    PromptUnavailable,
    Settings,
)
from tests.conftest import BrokerFactory, ClientFactory, RedisServer
from tests.helpers import text

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
TARGET = {"question": "Target?", "options": [{"label": "staging"}, {"label": "production"}]}
SURROGATE = "\ud800"


async def snapshot(broker: Broker) -> dict[str, Any]:
    """Every key under the broker's prefix with its content: what a refusal must not change."""
    out: dict[str, Any] = {}
    async for key in broker.redis.scan_iter(match=f"{broker.keys.prefix}:*"):
        kind = await broker.redis.type(key)
        if kind == "stream":
            out[key] = await broker.redis.xrange(key)
        elif kind == "hash":
            out[key] = await broker.redis.hgetall(key)  # type: ignore[misc]
        elif kind == "list":
            out[key] = await broker.redis.lrange(key, 0, -1)  # type: ignore[misc]
        elif kind == "zset":
            out[key] = await broker.redis.zrange(key, 0, -1)
        else:
            out[key] = await broker.redis.get(key)
    return out


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# -- post_item ----------------------------------------------------------------------------

BAD_ITEMS: list[tuple[str, dict[str, Any], str]] = [
    ("surrogate in text", text(f"yes{SURROGATE}"), "content[0].text"),
    (
        "surrogate in a structured label",
        text("yes", answers=[{"answer": [f"Approve{SURROGATE}"]}]),
        "metadata.answers[0].answer[0]",
    ),
    (
        "surrogate in a structured question",
        text("yes", answers=[{"question": SURROGATE, "answer": ["Approve"]}]),
        "metadata.answers[0].question",
    ),
    ("surrogate in the author", {**text("yes"), "author": f"me{SURROGATE}"}, "author"),
    ("surrogate in a metadata key", text("yes", **{f"k{SURROGATE}": 1}), "metadata"),
    ("integer of 2**70", text("yes", big=2**70), "metadata.big"),
    ("integer below -2**63", text("yes", big=-(2**63) - 1), "metadata.big"),
    ("300 levels deep", text("yes", deep=nested(300)), "metadata.deep"),
    ("a set", text("yes", tags={"a", "b"}), "metadata.tags"),
    ("a non-string key", text("yes", m={1: "x"}), "metadata.m"),
    ("not a number", text("yes", x=float("nan")), "metadata.x"),
    ("an object", text("yes", x=object()), "metadata.x"),
    ("a non-string item key", {**text("yes"), 3: "x"}, "item"),
]


@pytest.mark.parametrize("active", [True, False], ids=["active", "idle"])
@pytest.mark.parametrize(("why", "item", "field"), BAD_ITEMS, ids=[c[0] for c in BAD_ITEMS])
async def test_post_item_refuses_bad_input(
    broker: Broker, active: bool, why: str, item: dict[str, Any], field: str
) -> None:
    if active:
        p = await broker.ask("t", "approval", [APPROVAL])
    before = await snapshot(broker)
    with pytest.raises(BadItem) as e:
        await broker.post_item("t", item)
    assert e.value.field.startswith(field), (why, e.value.field)
    str(e.value).encode()  # the message itself prints anywhere
    assert await snapshot(broker) == before
    if active:
        assert (await broker.post_item("t", text("yes"))).prompt_id == p.prompt_id


async def test_post_item_depth_limit_is_the_documented_one(broker: Broker) -> None:
    """Exactly the documented depth is accepted; one more level is refused."""
    await broker.post_item("t", text("ok", deep=nested(LIMITS["depth"] - 1)))
    with pytest.raises(BadItem):
        await broker.post_item("t", text("ok", deep=nested(LIMITS["depth"] + 1)))


async def test_post_item_keeps_ordinary_non_ascii(broker: Broker) -> None:
    routed = await broker.post_item("t", {**text("naïve 日本 🙂"), "author": "Zoë"})
    [item] = await broker.items("t")
    assert item.id == routed.item_id and item.text == "naïve 日本 🙂" and item.author == "Zoë"


# -- ask and cancel ---------------------------------------------------------------------------

BAD_QUESTIONS: list[tuple[str, dict[str, Any], str]] = [
    ("surrogate in the question", {**APPROVAL, "question": SURROGATE}, "questions[0].question"),
    ("surrogate in the header", {**APPROVAL, "header": SURROGATE}, "questions[0].header"),
    (
        "surrogate in a label",
        {**TARGET, "options": [{"label": "x"}, {"label": SURROGATE}]},
        "questions[0].options[1].label",
    ),
    (
        "surrogate in a description",
        {**TARGET, "options": [{"label": "x", "description": SURROGATE}]},
        "questions[0].options[0].description",
    ),
]


@pytest.mark.parametrize(
    ("why", "question", "field"), BAD_QUESTIONS, ids=[c[0] for c in BAD_QUESTIONS]
)
async def test_ask_refuses_bad_input(
    broker: Broker, why: str, question: dict[str, Any], field: str
) -> None:
    p = await broker.ask("t", "approval", [APPROVAL])
    before = await snapshot(broker)
    with pytest.raises(BadItem) as e:
        await broker.ask("t", "ask_user_question", [question])
    assert e.value.field == field, why
    assert await snapshot(broker) == before
    assert (await broker.active_prompt("t")) == await broker.get_prompt("t", p.prompt_id)


async def test_ask_refuses_bad_agent_state(broker: Broker) -> None:
    await broker.sessions.create("t", "scripted")
    before = await snapshot(broker)
    for state in ({"s": SURROGATE}, {"n": 2**70}, nested(300), {"x": {1, 2}}):
        with pytest.raises(BadItem) as e:
            await broker.ask("t", "approval", [APPROVAL], epoch=0, agent_state=state)
        assert e.value.field.startswith("agent_state")
    assert await snapshot(broker) == before


@pytest.mark.parametrize(
    ("reason", "problem"),
    [(f"stop{SURROGATE}", "surrogate"), ("x" * (LIMITS["reason_chars"] + 1), "limit")],
)
async def test_cancel_refuses_bad_reason(broker: Broker, reason: str, problem: str) -> None:
    p = await broker.ask("t", "approval", [APPROVAL])
    before = await snapshot(broker)
    with pytest.raises(BadItem, match=problem) as e:
        await broker.cancel("t", reason)
    assert e.value.field == "reason"
    assert await snapshot(broker) == before
    assert (await broker.cancel("t", "x" * LIMITS["reason_chars"])).prompt_id == p.prompt_id  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda b: b.items("t", after="nope"), "after"),
        (lambda b: b.items("t", count=-1), "count"),
        (lambda b: b.entries("t", after="1-2-3"), "after"),
        (lambda b: b.open_prompts(limit="5"), "limit"),
        (lambda b: b.wait("t", "prm_01M8RJ7DTBVQ04A2EVKNY8WKGH", timeout="soon"), "timeout"),
        (lambda b: b.cancel("t", epoch="1"), "epoch"),
        (lambda b: b.post_item("t", text("x"), epoch=-1), "epoch"),
        (lambda b: b.ask("t", "approval", [APPROVAL], epoch=True), "epoch"),
    ],
)
async def test_other_arguments_refused_as_bad_items(
    broker: Broker, call: Callable[[Broker], Awaitable[Any]], field: str
) -> None:
    with pytest.raises(BadItem) as e:
        await call(broker)
    assert e.value.field == field


# -- any client ---------------------------------------------------------------------------


async def test_a_client_without_decode_responses_is_accepted(
    make_client: ClientFactory, prefix: str
) -> None:
    """Most users' clients return bytes; the Broker works with one all the same, and leaves it
    as it was (still bytes, still open after the Broker closes)."""
    raw = make_client(decode_responses=False)
    async with Broker(raw, Settings(key_prefix=prefix)) as broker:
        p = await broker.ask("t", "approval", [APPROVAL])
        waiting = asyncio.create_task(broker.wait("t", p.prompt_id, timeout=5))
        routed = await broker.post_item("t", text("yes"))
        assert routed.prompt_id == p.prompt_id
        assert (await waiting)[0].answer == ["Approve"]
        assert [i.type for i in await broker.items("t")] == ["pending_prompt", ""]
    assert await raw.get(f"{prefix}:{{t}}:active") is None
    await raw.set(f"{prefix}:probe", "v")
    assert await raw.get(f"{prefix}:probe") == b"v"


@pytest.mark.real_redis
async def test_an_arq_pool_is_accepted(real_redis_url: str, prefix: str) -> None:
    from arq.connections import RedisSettings, create_pool

    pool = await create_pool(RedisSettings.from_dsn(real_redis_url))
    try:
        async with Broker(pool, Settings(key_prefix=prefix)) as broker:
            await broker.ask("t", "approval", [APPROVAL])
            assert (await broker.post_item("t", text("no"))).answers[0].answer == ["Deny"]  # type: ignore[index]
            for key in [k async for k in broker.redis.scan_iter(match=f"{prefix}:*")]:
                await broker.redis.delete(key)
    finally:
        await pool.aclose()


# -- Redis unreachable, Redis full ----------------------------------------------------------

PROMPT_ID = "prm_01M8RJ7DTBVQ04A2EVKNY8WKGH"

PUBLIC_CALLS: list[tuple[str, Callable[[Broker], Awaitable[Any]]]] = [
    ("post_item", lambda b: b.post_item("t", text("yes"))),
    ("cancel", lambda b: b.cancel("t", "stop")),
    ("active_prompt", lambda b: b.active_prompt("t")),
    ("get_prompt", lambda b: b.get_prompt("t", PROMPT_ID)),
    ("items", lambda b: b.items("t")),
    ("entries", lambda b: b.entries("t", after="0", block_ms=10)),
    ("take_inbox", lambda b: b.take_inbox("t")),
    ("open_prompts", lambda b: b.open_prompts()),
    ("wait", lambda b: b.wait("t", PROMPT_ID, timeout=5)),
    ("deliver", lambda b: b.deliver("t", PROMPT_ID)),
    ("listen", lambda b: b.listen("t", lambda _c, _w: None)),
    ("thread_exists", lambda b: b.thread_exists("t")),
    ("post_resolution", lambda b: b.post_resolution("t", PROMPT_ID)),
    ("enqueue_audit", lambda b: b.enqueue_audit("t", PROMPT_ID)),
]


@pytest.mark.real_redis
@pytest.mark.parametrize(("name", "call"), PUBLIC_CALLS, ids=[c[0] for c in PUBLIC_CALLS])
async def test_redis_unreachable_is_broker_unavailable(
    redis_server_factory: Callable[..., RedisServer],
    name: str,
    call: Callable[[Broker], Awaitable[Any]],
) -> None:
    server = redis_server_factory(appendonly=False)
    broker = Broker.from_url(server.url, Settings(key_prefix="pp"), socket_timeout=2)
    try:
        server.kill()
        with pytest.raises(BrokerUnavailable) as e:
            await asyncio.wait_for(call(broker), 10)
        assert "could not be reached" in str(e.value), name
    finally:
        await broker.aclose()


@pytest.mark.real_redis
async def test_ask_with_redis_unreachable_is_prompt_unavailable(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory(appendonly=False)
    broker = Broker.from_url(server.url, Settings(key_prefix="pp"))
    try:
        server.kill()
        with pytest.raises(PromptUnavailable):
            await broker.ask("t", "approval", [APPROVAL])
    finally:
        await broker.aclose()


@pytest.mark.real_redis
async def test_redis_over_maxmemory_is_our_error(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """Over `maxmemory` Redis refuses writes: `post_item` and `cancel` say so in our own error,
    `ask` says the question was not delivered; nothing changes, and all works again after."""
    server = redis_server_factory(appendonly=False)
    broker = Broker.from_url(server.url, Settings(key_prefix="pp"))
    admin = Redis.from_url(server.url, decode_responses=True)
    try:
        p = await broker.ask("t", "approval", [APPROVAL])
        before = await snapshot(broker)
        await admin.config_set("maxmemory", "1")
        for call in (
            lambda: broker.post_item("t", text("yes")),
            lambda: broker.post_item("u", text("hello")),
            lambda: broker.cancel("t", "stop"),
        ):
            with pytest.raises(BrokerUnavailable) as e:
                await call()
            assert e.value.refused and e.value.took_effect is False
            assert "refused to store" in str(e.value)
        with pytest.raises(PromptUnavailable):
            await broker.ask("v", "approval", [APPROVAL])
        await admin.config_set("maxmemory", "0")
        assert await snapshot(broker) == before
        assert (await broker.post_item("t", text("yes"))).prompt_id == p.prompt_id
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.aclose()
        await broker.aclose()


# -- the fuzz ------------------------------------------------------------------------------

hostile_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", SURROGATE, f"a{SURROGATE}b", "\udcff\udcfe", "\x00", "💥" * 3]),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
    st.sampled_from([b"bytes", {1, 2}, frozenset(), object(), (1, 2), 2**70, -(2**64)]),
)
json_like = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.one_of(hostile_text, st.integers(), st.none()), inner, max_size=3)
    ),
    max_leaves=12,
) | st.builds(nested, st.integers(min_value=60, max_value=300))
ids = st.one_of(
    hostile_text,
    st.sampled_from(["t", "prm_01M8RJ7DTBVQ04A2EVKNY8WKGH", "prm_x", "a" * 200, "{t}", "t:1"]),
    st.integers(),
    st.none(),
)
answers_sets = st.one_of(
    json_like,
    st.lists(
        st.fixed_dictionaries(
            {"answer": st.lists(hostile_text, max_size=2) | json_like},
            optional={"question": hostile_text | json_like},
        ),
        max_size=3,
    ),
)
items = st.one_of(
    json_like,
    st.fixed_dictionaries(
        {},
        optional={
            "content": st.one_of(
                json_like,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "file", "image"]) | hostile_text},
                        optional={"text": hostile_text | json_like, "file": json_like},
                    ),
                    max_size=2,
                ),
            ),
            "metadata": st.one_of(
                json_like,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "answers": answers_sets,
                        "prompt_id": ids,
                        "type": hostile_text | json_like,
                        "extra": json_like,
                    },
                ),
            ),
            "author": hostile_text | json_like,
            "other": json_like,
        },
    ),
)
questions = st.one_of(
    json_like,
    st.lists(
        st.fixed_dictionaries(
            {"question": hostile_text | json_like},
            optional={
                "header": hostile_text | json_like,
                "options": st.lists(
                    st.fixed_dictionaries(
                        {"label": hostile_text | json_like},
                        optional={"description": hostile_text},
                    ),
                    max_size=3,
                )
                | json_like,
                "multiSelect": st.booleans() | json_like,
            },
        ),
        max_size=3,
    ),
)

calls = st.one_of(
    st.tuples(st.just("post_item"), ids, items),
    st.tuples(st.just("post_item"), st.just("t"), items),
    st.tuples(
        st.just("ask"),
        ids,
        st.sampled_from(["approval", "text", "ask_user_question", 3, None]) | hostile_text,
        questions,
    ),
    st.tuples(st.just("cancel"), ids, hostile_text | json_like, st.none() | ids),
    st.tuples(st.just("get_prompt"), ids, ids),
    st.tuples(st.just("wait"), ids, ids),
    st.tuples(st.just("thread_exists"), ids),
    st.tuples(st.just("items"), ids, st.none() | hostile_text | json_like),
    st.tuples(st.just("deliver"), ids, ids),
    st.tuples(st.just("active_prompt"), ids),
    st.tuples(st.just("take_inbox"), ids),
    st.tuples(st.just("open_prompts"), st.none() | json_like),
    st.tuples(st.just("entries"), ids, st.just("$") | hostile_text | json_like),
    st.tuples(st.just("post_resolution"), ids, ids),
    st.tuples(st.just("enqueue_audit"), ids, ids),
    st.tuples(st.just("listen"), ids),
    st.tuples(st.just("post_item_fenced"), ids, items, json_like),
    st.tuples(st.just("wait_timeout"), st.just("t"), json_like),
)


async def _one_call(broker: Broker, call: tuple[Any, ...]) -> None:
    name, *args = call
    if name == "post_item":
        await broker.post_item(args[0], args[1], create=True)
    elif name == "ask":
        await broker.ask(args[0], args[1], args[2])
    elif name == "cancel":
        await broker.cancel(args[0], args[1], prompt_id=args[2])
    elif name == "get_prompt":
        await broker.get_prompt(args[0], args[1])
    elif name == "wait":
        await broker.wait(args[0], args[1], timeout=0.01)
    elif name == "thread_exists":
        await broker.thread_exists(args[0])
    elif name == "items":
        await broker.items(args[0], after=args[1])
    elif name == "deliver":
        await broker.deliver(args[0], args[1])
    else:
        await _other_call(broker, name, args)


async def _other_call(broker: Broker, name: str, args: list[Any]) -> None:
    if name == "active_prompt":
        await broker.active_prompt(args[0])
    elif name == "take_inbox":
        await broker.take_inbox(args[0])
    elif name == "open_prompts":
        await broker.open_prompts(args[0])
    elif name == "entries":
        await broker.entries(args[0], after=args[1], block_ms=1)
    elif name == "post_resolution":
        await broker.post_resolution(args[0], args[1])
    elif name == "enqueue_audit":
        await broker.enqueue_audit(args[0], args[1])
    elif name == "listen":
        await broker.listen(args[0], lambda _c, _w: None)
    elif name == "post_item_fenced":
        await broker.post_item(args[0], args[1], epoch=args[2])
    elif name == "wait_timeout":
        p = await broker.active_prompt("t")
        assert p is not None
        # Bounded from outside too: `None` or a huge timeout is valid and would wait on.
        await asyncio.wait_for(broker.wait("t", p.prompt_id, timeout=args[1]), 0.05)


async def _fuzz(call: tuple[Any, ...]) -> None:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with Broker(client, Settings(key_prefix="fz" + uuid.uuid4().hex[:8])) as broker:
        p = await broker.ask("t", "ask_user_question", [TARGET])
        before = await snapshot(broker)
        try:
            await _one_call(broker, call)
        except TimeoutError:
            pass  # wait's documented timeout
        except BrokerError as e:
            str(e).encode()  # our messages print anywhere, even about a surrogate
            assert await snapshot(broker) == before, e
            assert (await broker.active_prompt("t")) == await broker.get_prompt("t", p.prompt_id)
        else:
            if call[0] in ("get_prompt", "thread_exists", "items", "wait", "active_prompt"):
                assert await snapshot(broker) == before  # reads write nothing
        active = await broker.active_prompt("t")
        if active is not None:  # whatever happened, the active prompt is still answerable
            routed = await broker.post_item("t", text("2"))
            assert routed.outcome == "answered" and routed.prompt_id == active.prompt_id
    await client.aclose()


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(calls)
def test_fuzz_every_entry_point(call: tuple[Any, ...]) -> None:
    """Hostile values in every argument: only our own errors, nothing written on a refusal,
    the active prompt unchanged and still answerable."""
    asyncio.run(_fuzz(call))


async def test_fuzz_fixture_types_are_refused_by_name(make_broker: BrokerFactory) -> None:
    """A sample of the fuzz's values, on both backends: each refusal names a field."""
    broker = await make_broker()
    for item in ({"content": "x"}, {"metadata": [1]}, {"author": 3}, [1], None):
        with pytest.raises(BadItem) as e:
            await broker.post_item("t", item)  # type: ignore[arg-type]
        assert e.value.field
