"""The Broker's contract: asking, routing what people post, waiting, cancelling, bad input."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.asyncio import Redis

from broker import (
    Answer,
    BadItem,
    Broker,
    BrokerClosed,
    PromptCancelled,
    PromptNotFound,
    Settings,
    StaleAnswer,
)
from tests.conftest import BrokerFactory, cluster_runs_wanted, delete_prefix
from tests.helpers import began_waiting, index_add, index_score, text

APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
TARGET = {
    "question": "What's the deployment target?",
    "options": [
        {"label": "staging", "description": "push to staging.example.com"},
        {"label": "production", "description": "push to www.example.com"},
    ],
}
SECTIONS = {
    "question": "Which sections?",
    "multiSelect": True,
    "options": [{"label": "KPI cards"}, {"label": "Table"}, {"label": "Chart"}],
}


async def stream_len(broker: Broker, thread: str) -> int:
    return int(await broker.redis.xlen(broker.thread(thread).items))


# -- asking -------------------------------------------------------------------------------


async def test_pending_prompt_item_matches_spec(broker: Broker) -> None:
    """The posted item is the question only, options numbered, metadata as the spec shows."""
    p = await broker.ask("t", "ask_user_question", [TARGET])
    [item] = await broker.items("t")
    assert item.id == p.item_id and item.author == broker.identity
    assert item.content == [
        {
            "type": "text",
            "text": (
                "What's the deployment target?\n"
                "  1. staging — push to staging.example.com\n"
                "  2. production — push to www.example.com"
            ),
        }
    ]
    assert item.metadata == {
        "type": "pending_prompt",
        "prompt": {
            "prompt_id": p.prompt_id,
            "kind": "ask_user_question",
            "prompt_state": "pending",
            "questions": [
                {
                    "question": TARGET["question"],
                    "header": "",
                    "multiSelect": False,
                    "options": TARGET["options"],
                }
            ],
        },
    }
    assert p.prompt_id.startswith("prm_") and item.id.startswith("itm_")
    assert (await broker.active_prompt("t")) == await broker.get_prompt("t", p.prompt_id)


async def test_second_prompt_supersedes_first(broker: Broker) -> None:
    """A new prompt is posted first, then the old one is cancelled `superseded`."""
    a = await broker.ask("t", "approval", [APPROVAL])
    waiter = asyncio.create_task(broker.wait("t", a.prompt_id, timeout=5))
    await began_waiting(broker, "t", a.prompt_id)
    b = await broker.ask("t", "approval", [APPROVAL])
    with pytest.raises(PromptCancelled) as e:
        await waiter
    assert e.value.reason == "superseded" and e.value.prompt_id == a.prompt_id
    assert [i.id for i in await broker.items("t")] == [a.item_id, b.item_id]
    assert (await broker.get_prompt("t", a.prompt_id)).state == "cancelled"
    active = await broker.active_prompt("t")
    assert active is not None and active.prompt_id == b.prompt_id
    assert [p.prompt_id for p in await broker.open_prompts()] == [b.prompt_id]


@pytest.mark.parametrize(
    ("kind", "questions", "field"),
    [
        ("choice", [APPROVAL], "kind"),
        ("approval", [APPROVAL, APPROVAL], "questions"),
        ("approval", [], "questions"),
        ("approval", "Approve?", "questions"),
        ("text", [TARGET], "questions[0].options"),
        ("ask_user_question", [{"question": "x", "multiselect": True}], "questions[0].multiselect"),
        ("ask_user_question", [{"options": []}], "questions[0].question"),
        ("ask_user_question", [{"question": "x" * 70_000}], "questions"),
    ],
)
async def test_bad_prompt_refused_and_nothing_written(
    broker: Broker, kind: str, questions: Any, field: str
) -> None:
    """Bad prompts raise BadItem naming the field, and write nothing."""
    with pytest.raises(BadItem) as e:
        await broker.ask("t", kind, questions)
    assert e.value.field == field
    assert await stream_len(broker, "t") == 0
    assert await broker.active_prompt("t") is None


async def test_bad_thread_id_refused(broker: Broker) -> None:
    """A thread id that cannot make a key is refused with its field named."""
    with pytest.raises(BadItem, match="thread_id"):
        await broker.ask("a}b", "approval", [APPROVAL])


# -- routing ------------------------------------------------------------------------------


async def test_first_user_item_answers_active_prompt(broker: Broker) -> None:
    """While a prompt is active, the next user item answers it, mapped by the spec's rules."""
    p = await broker.ask("t", "ask_user_question", [TARGET])
    r = await broker.post_item("t", text("Production"))
    assert (r.outcome, r.prompt_id, r.source) == ("answered", p.prompt_id, "text")
    assert [a.answer for a in r.answers or []] == [["production"]]
    assert await broker.active_prompt("t") is None
    second = await broker.post_item("t", text("and another thing"))
    assert second.outcome == "queued"


async def test_items_with_no_active_prompt_queue_in_order(broker: Broker) -> None:
    """With no active prompt, items queue for the next turn and drain in order, once."""
    for t in ("one", "two", "three"):
        assert (await broker.post_item("t", text(t))).outcome == "queued"
    assert [i.text for i in await broker.take_inbox("t")] == ["one", "two", "three"]
    assert await broker.take_inbox("t") == []


async def test_own_items_are_never_answers(broker: Broker) -> None:
    """Items authored by the broker's identity are posted, never taken as answers."""
    p = await broker.ask("t", "approval", [APPROVAL])
    r = await broker.post_item("t", {**text("yes"), "author": broker.identity})
    assert r.outcome == "posted"
    assert (await broker.get_prompt("t", p.prompt_id)).state == "pending"
    assert await broker.take_inbox("t") == []


async def test_structured_answers_used_as_they_stand(broker: Broker) -> None:
    """A full `metadata.answers` set is used verbatim: no mapping, labels not validated."""
    p = await broker.ask("t", "ask_user_question", [TARGET, SECTIONS])
    answers = [
        {"question": TARGET["question"], "answer": ["somewhere else"]},
        {"question": SECTIONS["question"], "answer": []},
    ]
    r = await broker.post_item("t", text("summary", answers=answers))
    assert r.source == "structured" and r.refused_answers is None
    assert [a.model_dump() for a in r.answers or []] == answers
    assert (await broker.get_prompt("t", p.prompt_id)).source == "structured"


async def test_partial_structured_answers_refused_text_mapped(broker: Broker) -> None:
    """A partial set is never padded: the text is mapped instead, and the caller told why."""
    await broker.ask("t", "ask_user_question", [TARGET, SECTIONS])
    r = await broker.post_item("t", text("1", answers=[{"answer": ["staging"]}]))
    assert r.source == "text"
    assert r.refused_answers is not None and "2 question(s)" in r.refused_answers
    assert [a.answer for a in r.answers or []] == [["staging"], ["KPI cards"]]


async def test_malformed_structured_answers_refused_text_mapped(broker: Broker) -> None:
    """A non-list `answer` is refused with its path named; the text answers."""
    await broker.ask("t", "ask_user_question", [TARGET])
    r = await broker.post_item("t", text("staging", answers=[{"answer": "staging"}]))
    assert r.source == "text" and r.refused_answers == (
        "metadata.answers[0].answer: expected a list of strings"
    )


async def test_empty_structured_answers_reported_refused(broker: Broker) -> None:
    """An empty `metadata.answers` list answers nothing: the text is mapped, and it says so."""
    await broker.ask("t", "approval", [APPROVAL])
    r = await broker.post_item("t", text("ok", answers=[]))
    assert r.source == "text"
    assert r.refused_answers == "metadata.answers: an empty list answers no question"
    assert [a.answer for a in r.answers or []] == [["Approve"]]


async def test_empty_structured_answers_alone_refused_nothing_written(broker: Broker) -> None:
    await broker.ask("t", "approval", [APPROVAL])
    before = await stream_len(broker, "t")
    with pytest.raises(BadItem) as e:
        await broker.post_item("t", {"content": [], "metadata": {"answers": []}})
    assert e.value.field == "metadata.answers"
    assert await stream_len(broker, "t") == before


async def test_structured_answer_naming_another_question_refused_text_mapped(
    broker: Broker,
) -> None:
    """An entry whose `question` is not the prompt's question at its position refuses the set:
    the text is mapped, the reason reported, and nothing keeps the wrong question."""
    p = await broker.ask("t", "ask_user_question", [TARGET])
    r = await broker.post_item(
        "t", text("2", answers=[{"question": "Wrong q", "answer": ["staging"]}])
    )
    assert r.source == "text"
    assert r.refused_answers == (
        'metadata.answers[0].question: "Wrong q" is not question 1 of the prompt '
        f'("{TARGET["question"]}")'
    )
    assert r.answers == [Answer(question=TARGET["question"], answer=["production"])]
    stored = await broker.get_prompt("t", p.prompt_id)
    assert stored.source == "text" and stored.answers == r.answers


async def test_structured_answer_question_case_and_space_may_differ(broker: Broker) -> None:
    """The question is compared folded; the record keeps the prompt's own wording."""
    p = await broker.ask("t", "ask_user_question", [TARGET, SECTIONS])
    answers = [
        {"question": "  what's the DEPLOYMENT   target? ", "answer": ["staging"]},
        {"question": "WHICH SECTIONS?", "answer": ["Table"]},
    ]
    r = await broker.post_item("t", text("summary", answers=answers))
    assert r.source == "structured" and r.refused_answers is None
    expected = [
        Answer(question=TARGET["question"], answer=["staging"]),
        Answer(question=SECTIONS["question"], answer=["Table"]),
    ]
    assert r.answers == expected
    assert (await broker.get_prompt("t", p.prompt_id)).answers == expected


@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("raw", [{"answer": ["a"]}, "Approve", 7])
async def test_structured_answers_not_a_list_refused_always(
    broker: Broker, active: bool, raw: Any
) -> None:
    """A `metadata.answers` that is not a list is refused whether or not a prompt is active
    (a queued item never carries it unchecked), naming the field; nothing is written."""
    if active:
        await broker.ask("t", "approval", [APPROVAL])
    before = await stream_len(broker, "t")
    with pytest.raises(BadItem) as e:
        await broker.post_item("t", text("yes", answers=raw))
    assert e.value.field == "metadata.answers"
    assert await stream_len(broker, "t") == before
    assert await broker.redis.llen(broker.thread("t").inbox) == 0


async def test_contentless_structured_answer_accepted(broker: Broker) -> None:
    """An item with only `metadata.answers` answers (the reference dropped it)."""
    p = await broker.ask("t", "approval", [APPROVAL])
    r = await broker.post_item(
        "t",
        {
            "content": [],
            "metadata": {"answers": [{"question": APPROVAL["question"], "answer": ["Approve"]}]},
        },
    )
    assert (r.outcome, r.prompt_id, r.source) == ("answered", p.prompt_id, "structured")


async def test_contentless_wrong_arity_refused_nothing_written(broker: Broker) -> None:
    """Answers-only with the wrong arity has nothing to fall back on: BadItem, nothing written."""
    await broker.ask("t", "approval", [APPROVAL])
    before = await stream_len(broker, "t")
    with pytest.raises(BadItem) as e:
        await broker.post_item(
            "t",
            {
                "content": [],
                "metadata": {"answers": [{"answer": ["Approve"]}, {"answer": ["Deny"]}]},
            },
        )
    assert e.value.field == "metadata.answers"
    assert await stream_len(broker, "t") == before
    assert await broker.active_prompt("t") is not None


async def test_answer_naming_active_prompt_answers_it(broker: Broker) -> None:
    """An item naming the active prompt's id answers it."""
    p = await broker.ask("t", "approval", [APPROVAL])
    r = await broker.post_item("t", text("y", prompt_id=p.prompt_id))
    assert r.prompt_id == p.prompt_id and r.answers and r.answers[0].answer == ["Approve"]


async def test_stale_answer_refused_with_real_state(broker: Broker) -> None:
    """An answer naming a superseded prompt is refused with its state; nothing is written."""
    a = await broker.ask("t", "approval", [APPROVAL])
    b = await broker.ask("t", "approval", [APPROVAL])
    before = await stream_len(broker, "t")
    with pytest.raises(StaleAnswer) as e:
        await broker.post_item("t", text("yes", prompt_id=a.prompt_id))
    assert (e.value.state, e.value.active_prompt_id) == ("cancelled", b.prompt_id)
    assert await stream_len(broker, "t") == before
    assert (await broker.get_prompt("t", b.prompt_id)).state == "pending"


async def test_answer_to_answered_prompt_refused(broker: Broker) -> None:
    """A second answer naming an already answered prompt is refused as `answered`."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item("t", text("no", prompt_id=p.prompt_id))
    with pytest.raises(StaleAnswer, match="answered; none is active"):
        await broker.post_item("t", text("yes", prompt_id=p.prompt_id))
    assert (await broker.get_prompt("t", p.prompt_id)).answers[0].answer == ["Deny"]  # type: ignore[index]


async def test_unknown_prompt_id_refused_as_unknown(broker: Broker) -> None:
    """Naming a prompt the thread never had is refused as `unknown`."""
    with pytest.raises(StaleAnswer) as e:
        await broker.post_item("t", text("yes", prompt_id="prm_01JAAAAAAAAAAAAAAAAAAAAAAA"))
    assert e.value.state == "unknown"


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"content": "hello"}, "content"),
        ({"content": [{"text": "no type"}]}, "content[0]"),
        ({"content": [{"type": "text", "text": 3}]}, "content[0].text"),
        ({"content": [{"type": "file", "file": {}}]}, "content[0].file.alias"),
        ({"content": []}, "content"),
        ({"content": [{"type": "text", "text": ""}]}, "content"),
        ({"content": [{"type": "text", "text": "x"}], "colour": "red"}, "item.colour"),
        ({"content": [{"type": "text", "text": "x"}], "author": ""}, "author"),
        ({"content": [{"type": "text", "text": "x"}], "metadata": []}, "metadata"),
        (text("x", prompt_id="p1"), "metadata.prompt_id"),
        (text("x", type="pending_prompt"), "metadata.type"),
        (text("x" * 70_000), "item"),
    ],
)
async def test_bad_items_refused_and_nothing_written(
    broker: Broker, item: dict[str, Any], field: str
) -> None:
    """Bad items raise BadItem naming the field, and write nothing."""
    p = await broker.ask("t", "approval", [APPROVAL])
    before = await stream_len(broker, "t")
    with pytest.raises(BadItem) as e:
        await broker.post_item("t", item)
    assert e.value.field == field
    assert await stream_len(broker, "t") == before
    assert (await broker.get_prompt("t", p.prompt_id)).state == "pending"


async def test_file_only_item_queues(broker: Broker) -> None:
    """An item with only a file block is a message and queues."""
    item = {"content": [{"type": "file", "file": {"alias": "report.pdf"}}]}
    assert (await broker.post_item("t", item)).outcome == "queued"
    [queued] = await broker.take_inbox("t")
    assert queued.content == item["content"]


# -- waiting ------------------------------------------------------------------------------


async def test_answer_before_wait_returns_at_once(broker: Broker) -> None:
    """An answer that landed before `wait` is returned at once."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item("t", text("approve"))
    answers = await broker.wait("t", p.prompt_id, timeout=2)
    assert answers[0].answer == ["Approve"]
    await broker.settle()
    assert (await broker.get_prompt("t", p.prompt_id)).delivered_at is not None


async def test_answer_through_another_broker_wakes_waiter(make_broker: BrokerFactory) -> None:
    """A person answering through another process wakes the waiting one."""
    agent, surface = await make_broker(), await make_broker()
    p = await agent.ask("t", "ask_user_question", [SECTIONS])
    waiting = asyncio.create_task(agent.wait("t", p.prompt_id, timeout=5))
    await began_waiting(agent, "t", p.prompt_id)
    await surface.post_item("t", text("KPI cards, 3"))
    assert [a.answer for a in await waiting] == [["KPI cards", "Chart"]]


async def test_wait_timeout_leaves_prompt_open(broker: Broker) -> None:
    """A wait that times out raises TimeoutError; the prompt stays open and answerable."""
    p = await broker.ask("t", "approval", [APPROVAL])
    with pytest.raises(TimeoutError):
        await broker.wait("t", p.prompt_id, timeout=0.2)
    assert (await broker.active_prompt("t")) is not None
    await broker.post_item("t", text("yes"))
    assert (await broker.wait("t", p.prompt_id, timeout=2))[0].answer == ["Approve"]


async def test_wait_on_unknown_prompt(broker: Broker) -> None:
    """Waiting on a prompt that does not exist raises PromptNotFound."""
    with pytest.raises(PromptNotFound):
        await broker.wait("t", "prm_01JAAAAAAAAAAAAAAAAAAAAAAA", timeout=2)


async def test_cancel_releases_waiter_with_reason(broker: Broker) -> None:
    """Cancelling releases the waiter with PromptCancelled carrying the reason."""
    p = await broker.ask("t", "approval", [APPROVAL])
    waiting = asyncio.create_task(broker.wait("t", p.prompt_id, timeout=5))
    await began_waiting(broker, "t", p.prompt_id)
    cancelled = await broker.cancel("t", "the run ended")
    assert cancelled is not None and cancelled.reason == "the run ended"
    with pytest.raises(PromptCancelled, match="the run ended"):
        await waiting
    assert await broker.active_prompt("t") is None
    assert (await broker.post_item("t", text("yes"))).outcome == "queued"


async def test_cancel_with_nothing_active_is_noop(broker: Broker) -> None:
    """Cancel with no active prompt does nothing and returns None."""
    assert await broker.cancel("t", "whatever") is None
    assert await stream_len(broker, "t") == 0


async def test_many_waits_share_one_pubsub_connection(real_redis_url: str, prefix: str) -> None:
    """A hundred waits on a hundred threads use the Broker's one pub/sub connection: the server's
    CLIENT LIST, filtered to this Broker's own client name, shows exactly one."""
    name = f"pb-one-pubsub-{prefix}"
    client = Redis.from_url(real_redis_url, decode_responses=True, client_name=name)
    broker = Broker(client, Settings(key_prefix=prefix), owns_client=True)
    admin = Redis.from_url(real_redis_url, decode_responses=True)

    async def pubsub_connections() -> int:
        return sum(1 for c in await admin.client_list(_type="pubsub") if c.get("name") == name)

    try:
        prompts = [await broker.ask(f"t{i}", "approval", [APPROVAL]) for i in range(100)]
        waits = [
            asyncio.create_task(broker.wait(p.thread_id, p.prompt_id, timeout=10)) for p in prompts
        ]
        for p in prompts:
            await began_waiting(broker, p.thread_id, p.prompt_id)
        assert await pubsub_connections() == 1
        [(_, subscribed)] = await admin.pubsub_numsub(broker.thread("t99").wake)
        assert subscribed == 1
        for p in prompts:
            await broker.post_item(p.thread_id, text("yes"))
        assert all(a[0].answer == ["Approve"] for a in await asyncio.gather(*waits))
        assert await pubsub_connections() == 1
    finally:
        await delete_prefix(admin, prefix)
        await admin.aclose()
        await broker.aclose()


async def test_closed_broker_refuses(broker: Broker) -> None:
    """A closed broker raises BrokerClosed, clearly."""
    await broker.aclose()
    with pytest.raises(BrokerClosed):
        await broker.ask("t", "approval", [APPROVAL])


# -- concurrency --------------------------------------------------------------------------


async def test_racing_surfaces_exactly_one_wins(make_broker: BrokerFactory) -> None:
    """Twenty surfaces answering one prompt at once: exactly one answers, the rest queue."""
    surfaces = [await make_broker() for _ in range(20)]
    p = await surfaces[0].ask("t", "ask_user_question", [TARGET])
    routed = await asyncio.gather(
        *(s.post_item("t", text(f"answer {i}")) for i, s in enumerate(surfaces))
    )
    winners = [r for r in routed if r.outcome == "answered"]
    assert len(winners) == 1 and winners[0].prompt_id == p.prompt_id
    assert len(await surfaces[0].take_inbox("t")) == 19


async def test_fifty_tasks_ask_and_answer_one_thread(make_broker: BrokerFactory) -> None:
    """50 tasks asking and answering on one thread: one resolution per prompt, nothing lost."""
    agents = [await make_broker() for _ in range(5)]
    surfaces = [await make_broker() for _ in range(5)]
    outcomes: dict[str, Any] = {}
    asked = asyncio.Semaphore(0)

    async def agent_task(i: int) -> None:
        b = agents[i % 5]
        p = await b.ask("t", "text", [{"question": f"q{i}"}])
        asked.release()
        try:
            outcomes[p.prompt_id] = await b.wait("t", p.prompt_id)
        except PromptCancelled as e:
            outcomes[p.prompt_id] = e

    async def surface_task(i: int) -> Any:
        await asyncio.sleep(0.001 * (i % 7))
        return await surfaces[i % 5].post_item("t", text(f"reply {i}"))

    agent_tasks = [asyncio.create_task(agent_task(i)) for i in range(25)]
    results = await asyncio.gather(*(surface_task(i) for i in range(25)))
    for _ in range(25):
        await asyncio.wait_for(asked.acquire(), 10)
    await agents[0].cancel("t", "test over")  # the last prompt may have had no reply left
    await asyncio.wait_for(asyncio.gather(*agent_tasks), 10)
    routed = [r for r in results if r is not None]
    answered = {r.prompt_id: r for r in routed if r.outcome == "answered"}
    queued = [r for r in routed if r.outcome == "queued"]
    assert len(routed) == 25 and len(answered) + len(queued) == 25  # no item lost or doubled
    assert len(outcomes) == 25
    for prompt_id, outcome in outcomes.items():
        record = await agents[0].get_prompt("t", prompt_id)
        if isinstance(outcome, PromptCancelled):
            assert record.state == "cancelled" and prompt_id not in answered
        else:
            assert record.state == "answered"
            assert outcome == answered[prompt_id].answers  # the answer given is the one posted
    inbox = await agents[0].take_inbox("t")
    assert sorted(i.id for i in inbox) == sorted(r.item_id for r in queued)
    open_now = await agents[0].open_prompts()
    assert len(open_now) <= 1


async def test_sweep_never_drops_a_channel_being_subscribed(make_broker: BrokerFactory) -> None:
    """Asks racing a fast idle-channel sweep all complete and stay answerable."""
    broker = await make_broker(sweep_interval=0.01)
    for _ in range(3):
        prompts = await asyncio.wait_for(
            asyncio.gather(*(broker.ask(f"s{i}", "approval", [APPROVAL]) for i in range(200))),
            20,
        )
        assert len(prompts) == 200
    p = prompts[0]
    waiting = asyncio.create_task(broker.wait(p.thread_id, p.prompt_id, timeout=5))
    await began_waiting(broker, p.thread_id, p.prompt_id)
    await broker.post_item(p.thread_id, text("yes"))
    assert (await waiting)[0].answer == ["Approve"]


async def test_ask_goes_ahead_when_the_bell_cannot_be_subscribed(
    make_broker: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscription that never confirms delays an ask by its 2 s bound, no more; its wait
    still works. The upper check allows 1.5 s over the bound for a loaded machine."""
    agent, surface = await make_broker(), await make_broker()
    hang = asyncio.Event()
    real_subscribe = agent._waiter.subscribe

    async def stuck(channel: str, thread_id: str) -> int:
        await hang.wait()
        return await real_subscribe(channel, thread_id)

    monkeypatch.setattr(agent._waiter, "subscribe", stuck)
    loop = asyncio.get_running_loop()
    started = loop.time()
    p = await asyncio.wait_for(agent.ask("t", "approval", [APPROVAL]), 5)
    assert 2.0 <= loop.time() - started < 3.5
    monkeypatch.setattr(agent._waiter, "subscribe", real_subscribe)
    await surface.post_item("t", text("yes"))
    assert (await agent.wait("t", p.prompt_id, timeout=5))[0].answer == ["Approve"]


def test_every_script_is_loaded() -> None:
    """Every script in broker/lua is one `Scripts` knows (a new one left out fails here)."""
    from importlib import resources

    from broker._scripts import NAMES

    lua = resources.files("broker") / "lua"
    files = {p.name.removesuffix(".lua") for p in lua.iterdir() if p.name.endswith(".lua")}
    assert set(NAMES) == files - {"_lib", "_retain"}
    assert len(NAMES) == len(set(NAMES))


def test_settings_leave_the_http_servers_and_ops_variables_alone() -> None:
    """`PROMPT_BROKER_API_*` are the HTTP server's and `PROMPT_BROKER_OPS_*` the ops endpoint's
    (they check them); any other unknown `PROMPT_BROKER_*` is still an error."""
    env = {
        "PROMPT_BROKER_API_TOKENS": "[]",
        "PROMPT_BROKER_OPS_PORT": "9",
        "PROMPT_BROKER_KEY_PREFIX": "x",
    }
    s = Settings.from_env(env)
    assert s.key_prefix == "x"
    with pytest.raises(BadItem) as e:
        Settings.from_env({"PROMPT_BROKER_KEY_PREFX": "x"})
    assert e.value.field == "PROMPT_BROKER_KEY_PREFX"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([1, 2], "metadata.answers[0]"),
        ([{"answer": "staging"}], "metadata.answers[0].answer"),
        ([{"answer": ["a"], "question": 3}], "metadata.answers[0].question"),
    ],
)
async def test_malformed_structured_answers_never_queued(
    broker: Broker, raw: Any, field: str
) -> None:
    """With no prompt active, a set of the wrong shape is refused (naming the entry) instead of
    being queued unchecked for the next turn; nothing is written."""
    with pytest.raises(BadItem) as e:
        await broker.post_item("t", text("staging", answers=raw))
    assert e.value.field == field
    assert await stream_len(broker, "t") == 0
    assert await broker.take_inbox("t") == []


async def test_empty_structured_answers_may_be_queued(broker: Broker) -> None:
    """An empty set is well shaped: with no prompt active the message is queued as usual."""
    assert (await broker.post_item("t", text("hello", answers=[]))).outcome == "queued"


async def test_open_prompts_drops_index_members_with_no_record(broker: Broker) -> None:
    """A member naming a prompt that never existed (a fenced ask's leftover) is dropped."""
    p = await broker.ask("t", "approval", [APPROVAL])
    ghost = broker.keys.member("u", "prm_01M8RJ7DTBVQ04A2EVKNY8WKGH")
    await index_add(broker, "open", {ghost: 1})
    assert [o.prompt_id for o in await broker.open_prompts()] == [p.prompt_id]
    assert await index_score(broker, "open", ghost) is None
    assert await index_score(broker, "open", broker.keys.member("t", p.prompt_id))


async def test_prompt_events_are_written(broker: Broker) -> None:
    """Asked, answered, cancelled and superseded prompts each leave an event for live surfaces."""
    from broker import events

    a = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item("t", text("yes"))
    b = await broker.ask("t", "approval", [APPROVAL])
    c = await broker.ask("t", "approval", [APPROVAL])  # supersedes b
    await broker.cancel("t", "the run ended")
    entries = await broker.redis.xrange(events.event_key(broker.keys))
    seen = [(f["event"], f["prompt"]) for _, f in entries]
    assert seen == [
        (events.OPENED, a.prompt_id),
        (events.ANSWERED, a.prompt_id),
        (events.OPENED, b.prompt_id),
        (events.OPENED, c.prompt_id),
        (events.CANCELLED, b.prompt_id),
        (events.CANCELLED, c.prompt_id),
    ]
    reasons = [f.get("data") for _, f in entries if f["event"] == events.CANCELLED]
    assert "superseded" in reasons[0] and "the run ended" in reasons[1]


ON_CLUSTER = [pytest.param("cluster", marks=pytest.mark.cluster)] if cluster_runs_wanted() else []


@pytest.mark.parametrize("backend", ON_CLUSTER, indirect=True)
async def test_on_a_cluster_a_lost_answer_event_leaves_the_answer_standing(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """On a cluster the event stream is in another slot: an answer's event follows route.lua
    (coalesced with the turn's others). When writing it fails, the answer stands (committed,
    its bell rung): the caller is told `answered`, the wait gets it, a warning says so."""
    from broker import events

    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.redis.set(events.event_key(broker.keys), "not a stream")  # XADD: WRONGTYPE
    with caplog.at_level(logging.WARNING, logger="broker"):
        routed = await broker.post_item("t", text("yes"))
    assert (routed.outcome, routed.prompt_id) == ("answered", p.prompt_id)
    assert await broker.wait("t", p.prompt_id, timeout=5) == routed.answers
    lost = [r for r in caplog.records if r.getMessage() == "prompt.event_lost"]
    assert len(lost) == 1 and "WRONGTYPE" in lost[0].error  # type: ignore[attr-defined]


async def test_answer_records_who_and_through_which_surface(broker: Broker) -> None:
    """The prompt and its audit item say who answered and, when the poster named it, through
    which surface; `metadata.prompt` keeps the protocol's shape."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item("t", {**text("yes"), "author": "alice"}, surface="http")
    answers = await broker.wait("t", p.prompt_id, timeout=5)
    assert answers[0].answer == ["Approve"]
    await broker.settle()
    record = await broker.get_prompt("t", p.prompt_id)
    assert (record.answered_by, record.answered_via) == ("alice", "http")
    item_id = await broker.post_resolution("t", p.prompt_id)
    [audit] = [i for i in await broker.items("t") if i.id == item_id]
    assert audit.metadata["answered_by"] == "alice" and audit.metadata["surface"] == "http"
    assert set(audit.metadata["prompt"]) == {"prompt_id", "kind", "prompt_state", "answers"}


async def test_surface_is_optional_and_checked(broker: Broker) -> None:
    p = await broker.ask("t", "approval", [APPROVAL])
    with pytest.raises(BadItem) as e:
        await broker.post_item("t", text("yes"), surface="Not A Surface!")
    assert e.value.field == "surface"
    await broker.post_item("t", text("yes"))
    record = await broker.get_prompt("t", p.prompt_id)
    assert (record.answered_by, record.answered_via) == ("user", None)


async def test_idempotency_key_makes_a_retry_harmless(broker: Broker) -> None:
    """A retried post under the same key is not made again: the first outcome comes back (same
    item id), the thread holds one item, and a prompt asked since is not answered by it."""
    first = await broker.post_item("t", text("hello"), idempotency_key="req-1")
    again = await broker.post_item("t", text("hello"), idempotency_key="req-1")
    assert again == first and first.outcome == "queued"
    assert await stream_len(broker, "t") == 1
    assert len(await broker.take_inbox("t")) == 1
    p = await broker.ask("t", "approval", [APPROVAL])
    answered = await broker.post_item("t", text("yes"), idempotency_key="req-2")
    assert answered.prompt_id == p.prompt_id and answered.answers is not None
    p2 = await broker.ask("t", "approval", [APPROVAL])
    assert await broker.post_item("t", text("yes"), idempotency_key="req-2") == answered
    assert (await broker.get_prompt("t", p2.prompt_id)).state == "pending"
    other = await broker.post_item("u", text("hello"), idempotency_key="req-1")
    assert other.item_id != first.item_id  # keys are per thread


async def test_idempotency_key_is_checked_and_refusals_are_not_kept(broker: Broker) -> None:
    for bad in ("", "x" * 256, "a\ud800", 7):
        with pytest.raises(BadItem) as e:
            await broker.post_item("t", text("x"), idempotency_key=bad)  # type: ignore[arg-type]
        assert e.value.field == "idempotency_key"
    with pytest.raises(StaleAnswer):
        await broker.post_item(
            "t", text("yes", prompt_id="prm_01M8RJ7DTBVQ04A2EVKNY8WKGH"), idempotency_key="k"
        )
    assert (await broker.post_item("t", text("hi"), idempotency_key="k")).outcome == "queued"
