"""route.lua's text mapping equals Python's `map_text`, and its check of structured answers equals
`accept_structured`, on fakeredis, on a real redis-server and on the session's Redis Cluster.

The answer path maps text inside Redis (broker/lua/route.lua, a port of `answers.map_prepared`).
Each example asks a generated prompt through `Broker.ask` on a fresh thread, posts a generated
reply through `Broker.post_item`, and holds the routed answers equal to `map_text`.

Hypothesis and pytest-asyncio's function-scoped fixtures do not mix, so each example builds its
own client and runs its async body with `asyncio.run`: a fresh `FakeServer`, or the real server
under a key prefix of its own whose keys are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

import fakeredis
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker import Answer, Broker, Option, Question, Settings, map_text
from broker.answers import accept_structured, check_structured, matchers
from tests.conftest import cluster_runs_wanted, delete_prefix

# -- running one example -------------------------------------------------------------------------


_BACKENDS = ["fake", pytest.param("real", marks=pytest.mark.real_redis)]
if cluster_runs_wanted():  # as the `backend` fixture does (tests/conftest.py)
    _BACKENDS.append(pytest.param("cluster", marks=[pytest.mark.real_redis, pytest.mark.cluster]))


@pytest.fixture(scope="module", params=_BACKENDS)
def redis_url(request: pytest.FixtureRequest) -> str | None:
    """None for fakeredis, else the session's real server, or its cluster as `cluster+<url>`
    (module scope: hypothesis-safe)."""
    if request.param == "fake":
        return None
    if request.param == "cluster":
        return CLUSTER + request.getfixturevalue("redis_cluster").url
    return str(request.getfixturevalue("real_redis_url"))


CLUSTER = "cluster+"


def _client(url: str | None) -> Redis:
    if url is None:
        return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    if url.startswith(CLUSTER):
        return cast(Redis, RedisCluster.from_url(url.removeprefix(CLUSTER), decode_responses=True))
    return Redis.from_url(url, decode_responses=True)


async def _route(url: str | None, kind: str, questions: list[Question], text: str) -> list[Answer]:
    """Ask `questions` on a fresh thread, post `text`, and return the answers route.lua gave."""
    prefix = "par" + uuid.uuid4().hex[:12]
    client = _client(url)
    try:
        async with Broker(client, Settings(key_prefix=prefix)) as broker:
            thread = "th-" + uuid.uuid4().hex[:8]
            prompt = await broker.ask(thread, kind, questions)
            routed = await broker.post_item(thread, {"content": [{"type": "text", "text": text}]})
            assert routed.outcome == "answered"
            assert routed.source == "text"
            assert routed.prompt_id == prompt.prompt_id
            assert routed.answers is not None
            stored = await broker.get_prompt(thread, prompt.prompt_id)
            assert stored.answers == routed.answers
            return routed.answers
    finally:
        if url is not None:
            await delete_prefix(client, prefix)
        await client.aclose()


def routed_answers(url: str | None, kind: str, questions: list[Question], text: str) -> Any:
    return asyncio.run(_route(url, kind, questions, text))


# -- strategies ----------------------------------------------------------------------------------

INTERESTING_LABELS = [
    "staging",
    "production",
    "KPI cards",
    "kpi CARDS",
    "Table",
    "CSV import",
    "straße",
    "Straße",
    "STRASSE",
    "1",
    "2",
    "10",
    "01",
    "0",
    "²",
    "٣",
    "",
    " ",
    "a b",
    "a b c",
    "b c",
    "Approve",
    "Deny",
    "Approve & remember",
    "yes",
    "naïve café",
    "日本 語",
    "x,y",
    "nul\x00byte",
    "🙂 ok",
    "İstanbul",
    "ǅemal",
    "\u00a0padded\u3000",
    "Table ",
    "tab\tbed",
]
SEPARATORS = [
    ",",
    " ",
    ", ",
    " , ",
    ",,",
    "\t",
    "\n",
    "\u00a0",
    "\u2003",
    "\u3000",
    "\u2028",
    "\x1f",
    "\x85",
]

labels = st.one_of(
    st.sampled_from(INTERESTING_LABELS),
    st.text(max_size=10),
    st.lists(st.sampled_from(["a", "b", "c", "KPI", "cards", "Straße", "2"]), max_size=3).map(
        " ".join
    ),
)
options = st.lists(
    st.builds(Option, label=labels, description=st.sampled_from(["", "why"])), max_size=7
)
question_texts = st.sampled_from(["Target?", "Which sections?", "", "¿Qué?"]) | st.text(max_size=8)
choice_questions = st.builds(
    Question, question=question_texts, options=options, multiSelect=st.booleans()
)


@st.composite
def prompts(draw: st.DrawFn) -> tuple[str, list[Question]]:
    """A prompt the broker accepts: approval and text have one question, text has no options."""
    kind = draw(st.sampled_from(["ask_user_question", "approval", "text"]))
    if kind == "ask_user_question":
        return kind, draw(st.lists(choice_questions, min_size=1, max_size=4))
    if kind == "approval":
        standard = Question(
            question="Run it?", options=[Option(label="Approve"), Option(label="Deny")]
        )
        return kind, [draw(st.just(standard) | choice_questions)]
    return kind, [Question(question=draw(question_texts))]


def _variants(token: str) -> list[str]:
    return [token, token.upper(), token.lower(), token.casefold(), token.title()]


@st.composite
def reply_for(draw: st.DrawFn, questions: list[Question]) -> str:
    """A non-empty reply: labels (or their words) in case variants, numbers and separators."""
    pool = ["0", "99", "²", "٣", "yes", "OK", "approve", "sure", "STRASSE"]
    for question in questions:
        pool.append(str(len(question.options) + 1))
        for n, option in enumerate(question.options, 1):
            pool += [str(n), f"0{n}", *_variants(option.label), *option.label.split()]
    tokens = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5))
    seps = draw(st.lists(st.sampled_from(SEPARATORS), min_size=len(tokens), max_size=len(tokens)))
    built = "".join(t + s for t, s in zip(tokens, seps, strict=True))
    edge = draw(st.sampled_from(["", " ", "\t", "\u00a0"]))
    text = draw(st.sampled_from([built, built.strip(), edge + built]) | st.text(min_size=1))
    return text if text else " "


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[Question], str]:
    kind, questions = draw(prompts())
    return kind, questions, draw(reply_for(questions))


def _q(*names: str, multi: bool = False) -> Question:
    return Question(question="Q?", options=[Option(label=n) for n in names], multiSelect=multi)


SECTIONS = _q("CSV import", "KPI cards", "Table", multi=True)


# -- the property ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(("ask_user_question", [SECTIONS], "KPI cards, Table"))
@example(("ask_user_question", [SECTIONS], "kpi\u3000CARDS table,,2"))
@example(("ask_user_question", [_q("a b", "a b c", "c", multi=True)], "A  B C, c"))
@example(("ask_user_question", [_q("Weg", "straße")], "STRASSE"))
@example(("ask_user_question", [_q("Weg", "straße", multi=True)], "STRASSE\u00a0weg 1"))
@example(("ask_user_question", [_q("a", "b", "c")], "²"))
@example(("ask_user_question", [_q("a", "²", multi=True)], "² ٣ 1"))
@example(("ask_user_question", [_q("", " ", "x")], " "))
@example(("ask_user_question", [_q("", "x", multi=True)], "1, 1"))
@example(("ask_user_question", [_q("a", "b")], "1" * 40))
@example(("ask_user_question", [_q("a", "b")], "000000000002"))
@example(("ask_user_question", [_q("nul\x00byte", "x")], "NUL\x00BYTE"))
@example(("ask_user_question", [_q("a", "b", multi=True), _q("c"), Question(question="free")], "2"))
@example(("approval", [_q("Approve", "Deny", "Approve & remember")], "Approve & remember"))
@example(("approval", [_q("Approve", "Deny")], " YES\n"))
@example(("text", [Question(question="Name?")], "  1, yes \u3000"))
def test_route_lua_maps_text_like_python(
    redis_url: str | None, case: tuple[str, list[Question], str]
) -> None:
    """The answers route.lua gives a text reply equal `map_text` for the same prompt and text."""
    kind, questions, text = case
    expected = map_text(kind, questions, text)  # type: ignore[arg-type]
    assert routed_answers(redis_url, kind, questions, text) == expected


# -- structured answers: route.lua's check equals `accept_structured` -----------------------------


async def _route_structured(
    url: str | None, questions: list[Question], raw: list[dict[str, Any]]
) -> Any:
    prefix = "par" + uuid.uuid4().hex[:12]
    client = _client(url)
    try:
        async with Broker(client, Settings(key_prefix=prefix)) as broker:
            thread = "th-" + uuid.uuid4().hex[:8]
            await broker.ask(thread, "ask_user_question", questions)
            item = {"content": [{"type": "text", "text": "x"}], "metadata": {"answers": raw}}
            return await broker.post_item(thread, item)
    finally:
        if url is not None:
            await delete_prefix(client, prefix)
        await client.aclose()


def _spellings(question: str) -> list[str]:
    return [question, question.upper(), f"  {question}  ", question.replace(" ", "\t  "), "Wrong q"]


@st.composite
def structured_cases(draw: st.DrawFn) -> tuple[list[Question], list[dict[str, Any]]]:
    questions = draw(st.lists(choice_questions, min_size=1, max_size=3))
    n = draw(st.sampled_from([len(questions), len(questions), max(1, len(questions) - 1)]))
    raw: list[dict[str, Any]] = []
    texts = [q.question for q in questions]
    for i in range(n):
        entry: dict[str, Any] = {"answer": draw(st.lists(labels, max_size=2))}
        own = texts[i] if i < len(texts) else "extra"
        named = draw(st.sampled_from([None, *_spellings(own), *texts]) | question_texts)
        if named is not None:
            entry["question"] = named
        raw.append(entry)
    return questions, raw


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structured_cases())
@example(([Question(question="Target?")], [{"question": "Wrong q", "answer": ["B"]}]))
@example(([Question(question="Straße?")], [{"question": "STRASSE?", "answer": ["B"]}]))
@example(([Question(question="a b")], [{"question": "A\u00a0B", "answer": []}]))
def test_route_lua_checks_structured_answers_like_python(
    redis_url: str | None, case: tuple[list[Question], list[dict[str, Any]]]
) -> None:
    """route.lua accepts exactly the sets `accept_structured` accepts, with the same answers,
    and refuses the others with the same reason (the text is mapped then)."""
    questions, raw = case
    entries, why = check_structured(raw)
    assert entries is not None, why
    expected, refusal = accept_structured(matchers(questions), entries)
    routed = asyncio.run(_route_structured(redis_url, questions, raw))
    assert routed.outcome == "answered"
    if expected is not None:
        assert (routed.source, routed.answers, routed.refused_answers) == (
            "structured",
            expected,
            None,
        )
    else:
        assert (routed.source, routed.refused_answers) == ("text", refusal)
        assert routed.answers == map_text("ask_user_question", questions, "x")
