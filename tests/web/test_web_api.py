"""The HTTP API's routes and status codes, on a real socket, over fakeredis and a real server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import fakeredis
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import Broker, Settings
from tests.conftest import free_port
from web.app import create_app
from web.settings import ApiSettings, Identity, hash_token
from web.testing import serving, serving_in_thread

APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
TARGET = {
    "question": "What's the deployment target?",
    "header": "Target",
    "options": [
        {"label": "staging", "description": "the test cluster"},
        {"label": "production", "description": "the real one"},
    ],
}
ALICE = "alice-token-0123456789"
READER = "reader-token-0123456789"


def identities() -> tuple[Identity, ...]:
    return (
        Identity.model_validate({"name": "alice", "token": ALICE, "scopes": ["read", "answer"]}),
        Identity.model_validate({"name": "reader", "token": READER, "scopes": ["read"]}),
    )


def auth(token: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(ApiSettings(tokens=identities(), heartbeat=1.0), broker=broker)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=auth()) as client:
        yield client


def error(r: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


async def test_health_ready_openapi(http: httpx.AsyncClient) -> None:
    """/healthz and /readyz answer without a token; the OpenAPI document lists every route."""
    assert (await http.get("/healthz", headers={"Authorization": ""})).json() == {"ok": True}
    ready = await http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["redis"] is True
    paths = (await http.get("/openapi.json")).json()["paths"]
    for path in (
        "/v1/prompts",
        "/v1/threads",
        "/v1/threads/{thread_id}",
        "/v1/threads/{thread_id}/prompts/{prompt_id}",
        "/v1/threads/{thread_id}/items",
        "/v1/threads/{thread_id}/cancel",
        "/v1/threads/{thread_id}/timing",
        "/v1/threads/{thread_id}/prompts/{prompt_id}/timing",
        "/v1/events",
        "/v1/threads/{thread_id}/events",
        "/v1/session",
        "/v1/webhooks",
        "/v1/webhooks/failed/{delivery}/replay",
    ):
        assert path in paths


async def test_the_page_and_its_security_headers(http: httpx.AsyncClient) -> None:
    """`/` serves the inbox; every response forbids framing and other origins' scripts."""
    page = await http.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for r in (page, await http.get("/v1/prompts"), await http.get("/healthz")):
        assert r.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"


async def test_prompts_oldest_first_with_cursor_paging(
    http: httpx.AsyncClient, broker: Broker
) -> None:
    """GET /v1/prompts pages through what waits, oldest first, with its questions and options."""
    asked = []
    for i in range(5):
        asked.append(await broker.ask(f"t{i}", "ask_user_question", [TARGET]))
        await asyncio.sleep(0.002)  # distinct creation times
    seen: list[str] = []
    cursor = ""
    while True:
        r = await http.get("/v1/prompts", params={"limit": 2, "cursor": cursor})
        assert r.status_code == 200
        body = r.json()
        seen += [p["prompt_id"] for p in body["prompts"]]
        if body["next_cursor"] is None:
            break
        cursor = body["next_cursor"]
    assert seen == [p.prompt_id for p in asked]
    first = (await http.get("/v1/prompts", params={"limit": 1})).json()["prompts"][0]
    assert first["thread_id"] == "t0" and first["kind"] == "ask_user_question"
    assert first["questions"][0]["options"][1] == {
        "label": "production",
        "description": "the real one",
    }
    assert first["created_at"].endswith("Z") and first["harness"] is None


async def test_answered_prompts_leave_the_list(http: httpx.AsyncClient, broker: Broker) -> None:
    """Only pending prompts are listed."""
    p = await broker.ask("t1", "approval", [APPROVAL])
    await broker.ask("t2", "approval", [APPROVAL])
    await broker.post_item("t1", {"content": [{"type": "text", "text": "approve"}]})
    listed = (await http.get("/v1/prompts")).json()["prompts"]
    assert [x["thread_id"] for x in listed] == ["t2"]
    assert p.prompt_id not in {x["prompt_id"] for x in listed}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"state": "closed"}, "state"),
        ({"limit": "0"}, "limit"),
        ({"limit": "201"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"cursor": "!!"}, "cursor"),
        ({"cursor": "bm90IGEgY3Vyc29y"}, "cursor"),
    ],
)
async def test_prompts_bad_query_is_422(
    http: httpx.AsyncClient, params: dict[str, str], field: str
) -> None:
    """Bad query parameters are 422 naming the parameter."""
    r = await http.get("/v1/prompts", params=params)
    assert r.status_code == 422 and error(r)["field"] == field


async def test_threads_and_thread(http: httpx.AsyncClient, broker: Broker) -> None:
    """GET /v1/threads lists every thread; GET /v1/threads/{id} its items and active prompt."""
    p = await broker.ask("alpha", "approval", [APPROVAL])
    await broker.post_item("beta", {"content": [{"type": "text", "text": "hello"}]})
    ids: set[str] = set()
    cursor = ""
    for _ in range(100):
        body = (await http.get("/v1/threads", params={"cursor": cursor, "limit": 1})).json()
        ids |= {t["thread_id"] for t in body["threads"]}
        if body["next_cursor"] is None:
            break
        cursor = body["next_cursor"]
    assert ids == {"alpha", "beta"}
    thread = (await http.get("/v1/threads/alpha")).json()
    assert thread["active_prompt"]["prompt_id"] == p.prompt_id
    assert [i["type"] for i in thread["items"]] == ["pending_prompt"]
    assert thread["session"] is None
    r = await http.get("/v1/threads/nobody")
    assert r.status_code == 404 and error(r)["code"] == "thread_not_found"
    r = await http.get("/v1/threads/-bad id")
    assert r.status_code == 422 and error(r)["field"] == "thread_id"


async def test_get_prompt(http: httpx.AsyncClient, broker: Broker) -> None:
    """GET one prompt with its pending_prompt item; 404 for none, 422 for a malformed id."""
    p = await broker.ask("t", "approval", [APPROVAL])
    body = (await http.get(f"/v1/threads/t/prompts/{p.prompt_id}")).json()
    assert body["state"] == "pending" and body["item"]["id"] == p.item_id
    assert body["item"]["metadata"]["prompt"]["prompt_id"] == p.prompt_id
    missing = "prm_" + "0" * 26
    r = await http.get(f"/v1/threads/t/prompts/{missing}")
    assert r.status_code == 404 and error(r)["code"] == "prompt_not_found"
    r = await http.get("/v1/threads/t/prompts/nope")
    assert r.status_code == 422 and error(r)["field"] == "prompt_id"


async def test_post_answer_structured(http: httpx.AsyncClient, broker: Broker) -> None:
    """A structured answer answers the prompt: 200 with outcome, answers and source; the
    agent's wait returns it."""
    p = await broker.ask("t", "ask_user_question", [TARGET])
    waiting = asyncio.create_task(broker.wait("t", p.prompt_id, timeout=5))
    body = {
        "content": [],
        "metadata": {
            "prompt_id": p.prompt_id,
            "answers": [{"question": TARGET["question"], "answer": ["staging"]}],
        },
    }
    r = await http.post("/v1/threads/t/items", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["outcome"] == "answered" and out["prompt_id"] == p.prompt_id
    assert out["source"] == "structured" and out["answers"][0]["answer"] == ["staging"]
    answers = await waiting
    assert answers[0].answer == ["staging"]


async def test_post_text_then_message_queued(http: httpx.AsyncClient, broker: Broker) -> None:
    """Text answers by mapping; with no prompt active a message is queued for the next turn."""
    await broker.ask("t", "approval", [APPROVAL])
    r = await http.post("/v1/threads/t/items", json={"content": [{"type": "text", "text": "1"}]})
    assert r.json()["outcome"] == "answered" and r.json()["source"] == "text"
    r = await http.post("/v1/threads/t/items", json={"content": [{"type": "text", "text": "hi"}]})
    assert r.status_code == 200 and r.json()["outcome"] == "queued"
    inbox = await broker.take_inbox("t")
    assert [i.text for i in inbox] == ["hi"] and inbox[0].author == "alice"


async def test_stale_answer_is_409_with_the_real_state(
    http: httpx.AsyncClient, broker: Broker
) -> None:
    """Answering a prompt someone else answered: 409 saying who answered, what and when."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.post_item(
        "t", {"author": "bob", "content": [{"type": "text", "text": "deny"}]}, create=False
    )
    r = await http.post(
        "/v1/threads/t/items",
        json={
            "content": [{"type": "text", "text": "approve"}],
            "metadata": {"prompt_id": p.prompt_id},
        },
    )
    assert r.status_code == 409
    e = error(r)
    assert e["code"] == "stale_answer" and e["state"] == "answered"
    assert e["prompt"]["answered_by"] == "bob"
    assert e["prompt"]["answers"][0]["answer"] == ["Deny"]
    assert e["prompt"]["resolved_at"] is not None


async def test_stale_cancelled_says_why(http: httpx.AsyncClient, broker: Broker) -> None:
    """A superseded prompt's 409 says it was cancelled and why."""
    old = await broker.ask("t", "approval", [APPROVAL])
    new = await broker.ask("t", "approval", [APPROVAL])
    r = await http.post(
        "/v1/threads/t/items",
        json={
            "content": [{"type": "text", "text": "yes"}],
            "metadata": {"prompt_id": old.prompt_id},
        },
    )
    e = error(r)
    assert r.status_code == 409 and e["state"] == "cancelled"
    assert e["prompt"]["reason"] == "superseded" and e["active_prompt_id"] == new.prompt_id


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"content": "yes"}, "content"),
        ({"content": [{"type": "text", "text": 5}]}, "content[0].text"),
        ({"content": [], "metadata": {"answers": "x"}}, "metadata.answers"),
        ({"content": [], "metadata": []}, "metadata"),
        ({"content": [{"type": "text", "text": "x"}], "extra": 1}, "item.extra"),
        (
            {"content": [{"type": "text", "text": "x"}], "metadata": {"prompt_id": "p"}},
            "metadata.prompt_id",
        ),
        (
            {"content": [{"type": "text", "text": "x"}], "metadata": {"type": "pending_prompt"}},
            "metadata.type",
        ),
        ([1, 2], "body"),
    ],
)
async def test_post_bad_input_is_422(
    http: httpx.AsyncClient, broker: Broker, body: Any, field: str
) -> None:
    """Bad items are 422 naming the field, and nothing is written."""
    await broker.ask("t", "approval", [APPROVAL])
    r = await http.post("/v1/threads/t/items", json=body)
    assert r.status_code == 422, r.text
    assert error(r)["field"] == field
    assert len(await broker.items("t")) == 1 and await broker.active_prompt("t") is not None


async def test_post_not_json_is_422(http: httpx.AsyncClient, broker: Broker) -> None:
    await broker.ask("t", "approval", [APPROVAL])
    r = await http.post("/v1/threads/t/items", content=b"{nope")
    assert r.status_code == 422 and error(r)["field"] == "body"


async def test_post_unknown_thread_is_404(http: httpx.AsyncClient, broker: Broker) -> None:
    """The API never starts a thread: an unknown one is 404 and nothing is written."""
    r = await http.post(
        "/v1/threads/ghost/items", json={"content": [{"type": "text", "text": "x"}]}
    )
    assert r.status_code == 404 and error(r)["code"] == "thread_not_found"
    assert not await broker.thread_exists("ghost")


async def test_post_closed_thread_is_409(http: httpx.AsyncClient, broker: Broker) -> None:
    await broker.sessions.create("t", "scripted", "approval")
    await broker.sessions.close("t")
    r = await http.post("/v1/threads/t/items", json={"content": [{"type": "text", "text": "x"}]})
    assert r.status_code == 409 and error(r)["code"] == "thread_closed"


async def test_idempotency_key_replays_and_writes_nothing(
    http: httpx.AsyncClient, broker: Broker
) -> None:
    """A retried POST with the same Idempotency-Key gets the first answer; nothing new is
    written. Another body with that key is 422; another key posts again."""
    await broker.ask("t", "approval", [APPROVAL])
    body = {"content": [{"type": "text", "text": "approve"}]}
    key = {"Idempotency-Key": "retry-1"}
    first = await http.post("/v1/threads/t/items", json=body, headers=key)
    again = await http.post("/v1/threads/t/items", json=body, headers=key)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"
    assert len(await broker.items("t")) == 2  # the prompt and one answer
    other = await http.post(
        "/v1/threads/t/items", json={"content": [{"type": "text", "text": "x"}]}, headers=key
    )
    assert other.status_code == 422 and error(other)["code"] == "idempotency_mismatch"
    fresh = await http.post(
        "/v1/threads/t/items", json=body, headers={"Idempotency-Key": "retry-2"}
    )
    assert (
        fresh.json()["outcome"] == "queued" and fresh.json()["item_id"] != first.json()["item_id"]
    )


async def test_idempotency_replays_a_409_too(http: httpx.AsyncClient, broker: Broker) -> None:
    """The first answer is kept whatever it was: a replayed stale answer is the same 409."""
    p = await broker.ask("t", "approval", [APPROVAL])
    await broker.cancel("t", "gone")
    body = {"content": [{"type": "text", "text": "y"}], "metadata": {"prompt_id": p.prompt_id}}
    key = {"Idempotency-Key": "k"}
    first = await http.post("/v1/threads/t/items", json=body, headers=key)
    again = await http.post("/v1/threads/t/items", json=body, headers=key)
    assert first.status_code == again.status_code == 409 and first.json() == again.json()


async def test_bad_idempotency_key_is_422(http: httpx.AsyncClient, broker: Broker) -> None:
    await broker.ask("t", "approval", [APPROVAL])
    r = await http.post(
        "/v1/threads/t/items",
        json={"content": [{"type": "text", "text": "x"}]},
        headers={"Idempotency-Key": "has space"},
    )
    assert r.status_code == 422 and error(r)["field"] == "Idempotency-Key"
    assert len(await broker.items("t")) == 1


async def test_cancel(http: httpx.AsyncClient, broker: Broker) -> None:
    """POST cancel cancels the active prompt with the reason; again, nothing to cancel."""
    p = await broker.ask("t", "approval", [APPROVAL])
    r = await http.post("/v1/threads/t/cancel", json={"reason": "not needed"})
    assert r.status_code == 200
    assert r.json()["cancelled"]["prompt_id"] == p.prompt_id
    assert (await broker.get_prompt("t", p.prompt_id)).reason == "not needed"
    r = await http.post("/v1/threads/t/cancel")
    assert r.status_code == 200 and r.json() == {"cancelled": None}
    r = await http.post("/v1/threads/ghost/cancel")
    assert r.status_code == 404
    r = await http.post("/v1/threads/t/cancel", json={"reason": 5})
    assert r.status_code == 422 and error(r)["field"] == "reason"
    r = await http.post("/v1/threads/t/cancel", json={"why": "x"})
    assert r.status_code == 422 and error(r)["field"] == "why"


async def test_unknown_route_and_method(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/nothing")
    assert r.status_code == 404 and error(r)["code"] == "not_found"
    r = await http.delete("/v1/prompts")
    assert r.status_code == 405


async def test_redis_down_is_503(broker: Broker, redis_server_factory: Any) -> None:
    """With Redis gone, reads and writes are 503 (never 500), and /readyz says not ready."""
    server = redis_server_factory(appendonly=False)
    from redis.asyncio import Redis

    b = Broker(Redis.from_url(server.url, decode_responses=True), broker.settings, owns_client=True)
    app = create_app(ApiSettings(tokens=identities()), broker=b)
    try:
        async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=auth()) as c:
            await b.ask("t", "approval", [APPROVAL])
            server.kill()
            assert (await c.get("/readyz")).status_code == 503
            assert (await c.get("/v1/prompts")).status_code == 503
            r = await c.post(
                "/v1/threads/t/items", json={"content": [{"type": "text", "text": "x"}]}
            )
            assert r.status_code == 503 and error(r)["code"] == "unavailable"
    finally:
        await b.aclose()


# -- fuzz: never a 500 on bad input ------------------------------------------------------------

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
_items = st.fixed_dictionaries(
    {},
    optional={
        "content": _json_values
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "file", "x"])}, optional={"text": _json_values}
            ),
            max_size=3,
        ),
        "metadata": _json_values
        | st.fixed_dictionaries(
            {},
            optional={
                "prompt_id": _json_values,
                "answers": _json_values,
                "type": _json_values,
            },
        ),
        "author": _json_values,
    },
)


def test_fuzz_post_and_query_never_500(prefix: str) -> None:
    """Random bodies, query parameters and Idempotency-Keys: always a 2xx or a 4xx with our
    error body, never a 500 (on fakeredis, the server on its own thread)."""

    async def make() -> Any:
        b = Broker(fakeredis.FakeAsyncRedis(decode_responses=True), Settings(key_prefix=prefix))
        await b.ask("t", "ask_user_question", [TARGET])
        return create_app(ApiSettings(tokens=identities()), broker=b)

    with serving_in_thread(make) as url, httpx.Client(base_url=url, headers=auth()) as c:

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            body=_items | _json_values,
            raw=st.binary(max_size=40),
            limit=st.text(max_size=5),
            cursor=st.text(max_size=12),
            thread=st.text(min_size=1, max_size=12),
            key=st.none()
            | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=10),
        )
        def check(
            *, body: Any, raw: bytes, limit: str, cursor: str, thread: str, key: str | None
        ) -> None:
            headers = {} if key is None else {"Idempotency-Key": key}
            r = c.post("/v1/threads/t/items", json=body, headers=headers)
            assert r.status_code < 500, r.text
            if r.status_code >= 400:
                assert "code" in r.json()["error"]
            r = c.post("/v1/threads/t/items", content=raw)
            assert r.status_code < 500, r.text
            r = c.post("/v1/threads/t/cancel", json=body)
            assert r.status_code < 500, r.text
            q = c.get("/v1/prompts", params={"limit": limit, "cursor": cursor})
            assert q.status_code in (200, 422), q.text
            t = c.get("/v1/threads", params={"cursor": cursor, "limit": limit})
            assert t.status_code in (200, 422), t.text
            where = httpx.URL("/v1/threads/").join(quote(thread, safe=""))
            for path in (str(where), f"{where}/prompts/{quote(thread, safe='')}"):
                # (a path the router normalises may be redirected: 307)
                assert c.get(path).status_code in (200, 307, 404, 422), path
            r = c.post(f"{where}/items", json=body)
            assert r.status_code < 500, r.text
            if key is None:
                # Whatever was posted, the thread still reads back (nothing half-written).
                assert c.get("/v1/threads/t").status_code == 200

        check()


async def _hold_a_stream(base: str, opened: asyncio.Event) -> None:
    async with (
        httpx.AsyncClient(base_url=base, headers=auth(), timeout=30) as c,
        c.stream("GET", "/v1/threads/t/events") as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event: ready"):
                opened.set()


@pytest.mark.parametrize("backend", ["real"])
@pytest.mark.parametrize("given", ["flag", "env"])
async def test_a_real_serve_process(
    broker: Broker, real_redis_url: str, prefix: str, tmp_path: Path, given: str
) -> None:
    """`prompt-broker serve` as its own process, tokens from --tokens or the environment: an
    answer POSTed to it reaches the agent's wait; SIGTERM stops it with status 0 even with an
    event stream open; the token is in none of its output."""
    tokens = tmp_path / "tokens.json"
    entry = {"name": "alice", "token_sha256": hash_token(ALICE), "scopes": ["read", "answer"]}
    tokens.write_bytes(orjson.dumps([entry]))
    port = free_port()
    env = {
        **os.environ,
        "PROMPT_BROKER_KEY_PREFIX": prefix,
        "PROMPT_BROKER_REDIS_URL": real_redis_url,
    }
    env = {k: v for k, v in env.items() if not k.startswith("PROMPT_BROKER_API_")}
    flags = ["--tokens", str(tokens)]
    if given == "env":
        env["PROMPT_BROKER_API_TOKENS"] = str(tokens)
        flags = []
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers.runtime.cli",
        "serve",
        "--port",
        str(port),
        *flags,
        "-v",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    stream: asyncio.Task[None] | None = None
    try:
        async with httpx.AsyncClient(base_url=base, headers=auth()) as c:
            for _ in range(200):
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            p = await broker.ask("t", "approval", [APPROVAL])
            waiting = asyncio.create_task(broker.wait("t", p.prompt_id, timeout=10))
            r = await c.post(
                "/v1/threads/t/items", json={"content": [{"type": "text", "text": "approve"}]}
            )
            assert r.status_code == 200, r.text
            assert (await waiting)[0].answer == ["Approve"]
            scraped = (await c.get("/metrics")).text  # the process's own metrics
            posted = 'method="POST",route="/v1/threads/{thread_id}/items",status="200"} 1.0'
            assert f"prompt_broker_http_requests_total{{{posted}" in scraped
        opened = asyncio.Event()
        stream = asyncio.create_task(_hold_a_stream(base, opened))
        await asyncio.wait_for(opened.wait(), 10)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 15)
        except TimeoutError:
            proc.kill()  # never left behind, even when this test fails
            raise
        if stream is not None:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
    assert proc.returncode == 0, out.decode()
    assert ALICE.encode() not in out and b"/v1/threads/t/items" in out  # the access log ran


async def test_idempotency_holds_even_without_our_record(
    http: httpx.AsyncClient, broker: Broker
) -> None:
    """The key goes to the library too: were the API's own record of the first answer lost
    (Redis went away before it was kept), a retry still writes nothing and gets the first
    outcome."""
    await broker.ask("t", "approval", [APPROVAL])
    body = {"content": [{"type": "text", "text": "approve"}]}
    key = {"Idempotency-Key": "lost-record"}
    first = await http.post("/v1/threads/t/items", json=body, headers=key)
    assert first.json()["outcome"] == "answered"
    ours = [k async for k in broker.redis.scan_iter(match=f"{broker.keys.prefix}:*api-idem:*")]
    assert len(ours) == 1
    await broker.redis.delete(*ours)
    again = await http.post("/v1/threads/t/items", json=body, headers=key)
    assert again.status_code == 200 and again.json()["item_id"] == first.json()["item_id"]
    assert len(await broker.items("t")) == 2
