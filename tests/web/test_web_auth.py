"""Identities: Bearer tokens, scopes and thread globs, the session cookie and its CSRF token."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from broker import BadItem, Broker, Settings
from web.app import create_app
from web.auth import COOKIE
from web.settings import ApiSettings, Identity, hash_token
from web.testing import serving
from workers.runtime.cli import main as cli_main

APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
ALICE = "alice-token-0123456789"
READER = "reader-token-0123456789"
TEAM_A = "team-a-token-0123456789"
ADMIN = "admin-token-0123456789"


def identities() -> tuple[Identity, ...]:
    return (
        Identity.model_validate({"name": "alice", "token": ALICE, "scopes": ["read", "answer"]}),
        # Given as its hash, the way `prompt-broker token new` prints it.
        Identity.model_validate(
            {"name": "reader", "token_sha256": hash_token(READER), "scopes": ["read"]}
        ),
        Identity.model_validate(
            {
                "name": "team-a",
                "token": TEAM_A,
                "scopes": ["read", "answer"],
                "threads": "team-a-*",
            }
        ),
        Identity.model_validate({"name": "root", "token": ADMIN, "scopes": ["admin"]}),
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def url(broker: Broker) -> AsyncIterator[str]:
    app = create_app(ApiSettings(tokens=identities(), session_secret="s3cret"), broker=broker)
    async with serving(app) as base:
        yield base


@pytest.fixture
async def anon(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url) as client:
        yield client


ROUTES = [
    ("GET", "/v1/prompts"),
    ("GET", "/v1/threads"),
    ("GET", "/v1/threads/t"),
    ("GET", "/v1/threads/t/prompts/prm_00000000000000000000000000"),
    ("POST", "/v1/threads/t/items"),
    ("POST", "/v1/threads/t/cancel"),
    ("GET", "/v1/events"),
    ("GET", "/v1/threads/t/events"),
    ("GET", "/v1/session"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong-token-0123456789"),
        {"Authorization": "Basic YWxpY2U6cHc="},
        {"Authorization": "Bearer"},
        {"Cookie": f"{COOKIE}=forged.1.2.3"},
    ],
)
async def test_no_or_bad_token_is_401(
    anon: httpx.AsyncClient, broker: Broker, method: str, path: str, headers: dict[str, str]
) -> None:
    """Every /v1 route refuses a missing, unknown or malformed credential with 401; nothing is
    written."""
    await broker.ask("t", "approval", [APPROVAL])
    r = await anon.request(method, path, headers=headers, json={"content": []})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "unauthenticated"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert len(await broker.items("t")) == 1 and await broker.active_prompt("t") is not None


async def test_read_scope_cannot_write(anon: httpx.AsyncClient, broker: Broker) -> None:
    """A read-only token reads, and is refused 403 on every write, which writes nothing."""
    p = await broker.ask("t", "approval", [APPROVAL])
    assert (await anon.get("/v1/prompts", headers=bearer(READER))).status_code == 200
    r = await anon.post(
        "/v1/threads/t/items",
        headers=bearer(READER),
        json={"content": [{"type": "text", "text": "approve"}]},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = await anon.post("/v1/threads/t/cancel", headers=bearer(READER))
    assert r.status_code == 403
    assert (await broker.get_prompt("t", p.prompt_id)).state == "pending"
    assert len(await broker.items("t")) == 1


async def test_admin_scope_does_everything(anon: httpx.AsyncClient, broker: Broker) -> None:
    await broker.ask("t", "approval", [APPROVAL])
    assert (await anon.get("/v1/threads/t", headers=bearer(ADMIN))).status_code == 200
    r = await anon.post(
        "/v1/threads/t/items",
        headers=bearer(ADMIN),
        json={"content": [{"type": "text", "text": "approve"}]},
    )
    assert r.status_code == 200 and r.json()["outcome"] == "answered"


async def test_thread_outside_the_glob_is_403(anon: httpx.AsyncClient, broker: Broker) -> None:
    """A token limited to `team-a-*` neither sees nor writes other threads: 403, nothing
    written; lists leave them out."""
    mine = await broker.ask("team-a-1", "approval", [APPROVAL])
    other = await broker.ask("team-b-1", "approval", [APPROVAL])
    h = bearer(TEAM_A)
    for path in ("/v1/threads/team-b-1", f"/v1/threads/team-b-1/prompts/{other.prompt_id}"):
        assert (await anon.get(path, headers=h)).status_code == 403
    body = {"content": [{"type": "text", "text": "approve"}]}
    r = await anon.post("/v1/threads/team-b-1/items", headers=h, json=body)
    assert r.status_code == 403
    assert (await anon.post("/v1/threads/team-b-1/cancel", headers=h)).status_code == 403
    assert (await anon.get("/v1/threads/team-b-1/events", headers=h)).status_code == 403
    assert (await broker.get_prompt("team-b-1", other.prompt_id)).state == "pending"
    assert len(await broker.items("team-b-1")) == 1
    listed = (await anon.get("/v1/prompts", headers=h)).json()["prompts"]
    assert [p["prompt_id"] for p in listed] == [mine.prompt_id]
    threads = (await anon.get("/v1/threads", headers=h, params={"limit": 200})).json()
    assert {t["thread_id"] for t in threads["threads"]} <= {"team-a-1"}
    r = await anon.post("/v1/threads/team-a-1/items", headers=h, json=body)
    assert r.status_code == 200 and r.json()["outcome"] == "answered"


async def test_forged_author_is_ignored(anon: httpx.AsyncClient, broker: Broker) -> None:
    """The author is the token's name whatever the body says, even the broker's identity;
    the prompt records who answered it and through which surface."""
    p = await broker.ask("t", "approval", [APPROVAL])
    for forged in ("prompt-broker", "bob", 7):
        body = {"author": forged, "content": [{"type": "text", "text": "approve"}]}
        r = await anon.post("/v1/threads/t/items", headers=bearer(ALICE), json=body)
        assert r.status_code == 200, r.text
    items = await broker.items("t")
    assert [i.author for i in items[1:]] == ["alice", "alice", "alice"]
    # The first answered the prompt: the broker's identity would have been only "posted".
    answered = await broker.get_prompt("t", p.prompt_id)
    assert answered.state == "answered" and answered.answer_item_id == items[1].id
    assert answered.answered_by == "alice" and answered.answered_via == "http"


async def test_session_cookie_flow(anon: httpx.AsyncClient, broker: Broker) -> None:
    """Sign in with a token: an HttpOnly, SameSite=Strict cookie; reads with it; writes need
    the CSRF token (refused 403 without it, nothing written); sign out ends it."""
    await broker.ask("t", "approval", [APPROVAL])
    assert (await anon.post("/v1/session", json={"token": "nope-0123456789abc"})).status_code == 401
    r = await anon.post("/v1/session", json={"token": 5})
    assert r.status_code == 422 and r.json()["error"]["field"] == "token"
    r = await anon.post("/v1/session", json={"token": ALICE})
    assert r.status_code == 200
    signed = r.json()
    assert signed["name"] == "alice" and signed["csrf_token"]
    cookie_header = r.headers["set-cookie"].lower()
    assert "httponly" in cookie_header and "samesite=strict" in cookie_header
    assert ALICE.lower() not in cookie_header
    assert (await anon.get("/v1/session")).json()["name"] == "alice"
    assert (await anon.get("/v1/prompts")).status_code == 200
    body = {"content": [{"type": "text", "text": "approve"}]}
    r = await anon.post("/v1/threads/t/items", json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = await anon.post("/v1/threads/t/items", json=body, headers={"X-CSRF-Token": "x" * 43})
    assert r.status_code == 403
    assert len(await broker.items("t")) == 1
    csrf = {"X-CSRF-Token": signed["csrf_token"]}
    r = await anon.post(
        "/v1/threads/t/items", json=body, headers={**csrf, "Origin": "http://evil.example"}
    )
    assert r.status_code == 403 and len(await broker.items("t")) == 1
    r = await anon.post("/v1/threads/t/items", json=body, headers=csrf)
    assert r.status_code == 200 and r.json()["outcome"] == "answered"
    assert (await broker.items("t"))[-1].author == "alice"
    assert (await anon.delete("/v1/session")).status_code == 403  # a write: CSRF too
    assert (await anon.delete("/v1/session", headers=csrf)).status_code == 204
    assert (await anon.get("/v1/session")).status_code == 401


async def test_tampered_or_foreign_cookie_is_401(url: str, broker: Broker) -> None:
    """A cookie whose name was changed, or signed by a server with another secret, is refused."""
    async with httpx.AsyncClient(base_url=url) as c:
        await c.post("/v1/session", json={"token": READER})
        cookie = c.cookies[COOKIE]
    _, rest = cookie.split(".", 1)
    import base64

    root = base64.urlsafe_b64encode(b"root").decode().rstrip("=")
    async with httpx.AsyncClient(base_url=url, cookies={COOKIE: f"{root}.{rest}"}) as c:
        assert (await c.get("/v1/prompts")).status_code == 401
    other = create_app(ApiSettings(tokens=identities(), session_secret="other"), broker=broker)
    async with (
        serving(other) as other_url,
        httpx.AsyncClient(base_url=other_url, cookies={COOKIE: cookie}) as c,
    ):
        assert (await c.get("/v1/prompts")).status_code == 401
    same = create_app(ApiSettings(tokens=identities(), session_secret="s3cret"), broker=broker)
    async with (
        serving(same) as same_url,
        httpx.AsyncClient(base_url=same_url, cookies={COOKIE: cookie}) as c,
    ):
        # Another copy with the same secret takes it: stateless behind a load balancer.
        assert (await c.get("/v1/session")).json()["name"] == "reader"


async def test_no_token_in_logs(
    anon: httpx.AsyncClient, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither a good nor a bad token appears in any log record."""
    caplog.set_level(logging.DEBUG)
    await broker.ask("t", "approval", [APPROVAL])
    for token in (ALICE, "bad-token-9876543210"):
        await anon.get("/v1/prompts", headers=bearer(token))
        await anon.post("/v1/session", json={"token": token})
        await anon.post("/v1/threads/t/items", headers=bearer(token), json={"content": 1})
    text = "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)
    assert ALICE not in text and "bad-token-9876543210" not in text


# -- configuration ---------------------------------------------------------------------------


def test_tokens_from_env_json_and_file(tmp_path: Path) -> None:
    """PROMPT_BROKER_API_TOKENS holds the JSON list, or names a file that does."""
    entries = [{"name": "a", "token_sha256": hash_token(ALICE), "scopes": ["read"]}]
    s = ApiSettings.from_env({"PROMPT_BROKER_API_TOKENS": orjson.dumps(entries).decode()})
    assert s.tokens[0].name == "a" and s.tokens[0].threads == "*"
    f = tmp_path / "tokens.json"
    f.write_bytes(orjson.dumps(entries))
    assert ApiSettings.from_env({"PROMPT_BROKER_API_TOKENS": str(f)}).tokens == s.tokens


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"PROMPT_BROKER_API_TOKEN": "[]"}, "PROMPT_BROKER_API_TOKEN"),
        ({"PROMPT_BROKER_API_TOKENS": "/no/such/file"}, "PROMPT_BROKER_API_TOKENS"),
        ({"PROMPT_BROKER_API_TOKENS": "[{]"}, "PROMPT_BROKER_API_TOKENS"),
        ({"PROMPT_BROKER_API_TOKENS": '{"name": "a"}'}, "PROMPT_BROKER_API_TOKENS"),
        (
            {"PROMPT_BROKER_API_TOKENS": '[{"name": "a", "token": "short", "scopes": ["read"]}]'},
            "PROMPT_BROKER_API_TOKENS[0]",
        ),
        (
            {
                "PROMPT_BROKER_API_TOKENS": '[{"name": "a", "token_sha256": "ab", '
                '"scopes": ["read"]}]'
            },
            "PROMPT_BROKER_API_TOKENS[0][token_sha256]",
        ),
        (
            {
                "PROMPT_BROKER_API_TOKENS": '[{"name": "a", "token": "0123456789abcdef", '
                '"scopes": ["write"]}]'
            },
            "PROMPT_BROKER_API_TOKENS[0][scopes][0]",
        ),
        ({"PROMPT_BROKER_API_PORT": "http"}, "PROMPT_BROKER_API_PORT"),
        (
            {
                "PROMPT_BROKER_API_WEBHOOKS": '[{"id": "x", "url": "ftp://x", '
                '"secret": "0123456789abcdef"}]'
            },
            "PROMPT_BROKER_API_WEBHOOKS[0][url]",
        ),
        ({"PROMPT_BROKER_API_WEBHOOKS": "[1]"}, "PROMPT_BROKER_API_WEBHOOKS[0]"),
    ],
)
def test_bad_configuration_fails_loudly(env: dict[str, str], field: str) -> None:
    """A misspelt name, an unreadable file, bad JSON or a bad entry: BadItem naming it."""
    with pytest.raises(BadItem) as e:
        ApiSettings.from_env(env)
    assert e.value.field == field


def test_duplicate_names_and_the_brokers_identity_are_refused(broker: Broker) -> None:
    one = {"name": "a", "token": ALICE, "scopes": ["read"]}
    with pytest.raises(BadItem):
        ApiSettings.from_env(
            {"PROMPT_BROKER_API_TOKENS": orjson.dumps([one, {**one, "token": ADMIN}]).decode()}
        )
    me = Identity.model_validate({"name": "prompt-broker", "token": ALICE, "scopes": ["answer"]})
    with pytest.raises(BadItem):
        create_app(ApiSettings(tokens=(me,)), broker=broker)


def test_broker_settings_ignore_the_apis_own_names() -> None:
    """The library's settings are read without the API's names (which it would refuse)."""
    from web.settings import broker_settings

    s = broker_settings({"PROMPT_BROKER_API_TOKENS": "[]", "PROMPT_BROKER_KEY_PREFIX": "zz"})
    assert isinstance(s, Settings) and s.key_prefix == "zz"


def test_token_new_prints_the_token_and_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`token new` prints a fresh token, then the line that configures it (its hash only)."""
    assert cli_main(["token", "new", "carol", "--scopes", "read,answer", "--threads", "c-*"]) == 0
    token, line = capsys.readouterr().out.strip().splitlines()
    entry: dict[str, Any] = orjson.loads(line)
    assert token not in line and entry["token_sha256"] == hash_token(token)
    s = ApiSettings.from_env({"PROMPT_BROKER_API_TOKENS": orjson.dumps([entry]).decode()})
    assert s.tokens[0].name == "carol" and s.tokens[0].scopes == ("read", "answer")
    assert s.tokens[0].threads == "c-*"
    assert cli_main(["token", "new", "dave", "--scopes", "write"]) == 2
    assert "--scopes.0:" in capsys.readouterr().err  # the flag and the entry that is wrong
    assert cli_main(["token", "new", "prompt-broker", "--scopes", "read"]) == 2
    argv = ["token", "new", "erin", "--scopes", "read,answer", "--groups", "oncall, leads"]
    assert cli_main(argv) == 0
    entry = orjson.loads(capsys.readouterr().out.strip().splitlines()[1])
    assert entry["groups"] == ["oncall", "leads"]  # answers prompts escalated to them
    assert cli_main(["token", "new", "erin", "--scopes", "read", "--groups", "on call"]) == 2
    assert "--groups.0:" in capsys.readouterr().err


async def test_sign_in_from_another_origin_is_refused(anon: httpx.AsyncClient) -> None:
    """A page on another site cannot sign a visitor in (no cookie is set)."""
    r = await anon.post(
        "/v1/session", json={"token": ALICE}, headers={"Origin": "http://evil.example"}
    )
    assert r.status_code == 403 and "set-cookie" not in r.headers
