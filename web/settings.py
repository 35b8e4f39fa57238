"""The HTTP server's settings and identities, read from `PROMPT_BROKER_API_*` in one place.

`PROMPT_BROKER_API_TOKENS` is a JSON list of identities, or the path of a file holding one::

    [{"name": "alice", "token_sha256": "9f86d0...", "scopes": ["read", "answer"]},
     {"name": "deploy-bot", "token": "pb_...", "scopes": ["read"], "threads": "deploy-*"},
     {"name": "bob", "token_sha256": "...", "scopes": ["read", "answer"], "threads": "bob-*",
      "groups": ["oncall"]}]

A token is given in clear (`token`) or, better, as the hex SHA-256 of it (`token_sha256`, what
`prompt-broker token new` prints); only the hash is kept in memory. `groups` names what a
prompt's timing may escalate to (`escalate_to`): once escalated, members may read and answer
it. An unknown `PROMPT_BROKER_API_*` name, an unknown field or a bad value fails loudly with
`BadItem`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.errors import BadItem
from broker.settings import Settings
from web.webhooks import Webhook

__all__ = [
    "ENV_PREFIX",
    "SCOPES",
    "ApiSettings",
    "Identity",
    "broker_settings",
    "hash_token",
    "load_tokens",
]

ENV_PREFIX = "PROMPT_BROKER_API_"
Scope = Literal["read", "answer", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "answer", "admin")
#: A group an identity belongs to: what a prompt's timing may escalate to (`escalate_to`).
Group = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token: what is configured and compared, never the token itself."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class Identity(BaseModel):
    """One configured token: whose it is, what it may do, which threads it may see."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    scopes: tuple[Scope, ...] = Field(min_length=1)
    threads: str = Field("*", min_length=1, max_length=256)
    #: Prompts escalated to one of these (a timing's `escalate_to`) it may also read and
    #: answer, whatever its `threads` glob says.
    groups: tuple[Group, ...] = Field((), max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _hash_clear_token(cls, value: Any) -> Any:
        # A clear token is hashed at once, so the process never holds it past loading.
        if isinstance(value, Mapping) and "token" in value:
            if "token_sha256" in value:
                raise ValueError("give `token` or `token_sha256`, not both")
            token = value["token"]
            if not isinstance(token, str) or len(token) < 16:
                raise ValueError("`token` must be a string of at least 16 characters")
            value = {k: v for k, v in value.items() if k != "token"}
            value["token_sha256"] = hash_token(token)
        if isinstance(value, Mapping) and isinstance(value.get("token_sha256"), str):
            value = {**value, "token_sha256": value["token_sha256"].lower()}
        return value

    def allows(self, scope: Scope) -> bool:
        return scope in self.scopes or "admin" in self.scopes


class ApiSettings(BaseModel):
    """Everything the HTTP server reads. `ApiSettings.from_env()` reads `PROMPT_BROKER_API_<X>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: tuple[Identity, ...] = Field(
        (), description="the identities (a JSON list, or the path of a file holding one)"
    )
    host: str = Field("127.0.0.1", description="the address `serve` listens on")
    port: int = Field(8420, ge=0, le=65535, description="the port `serve` listens on")
    heartbeat: float = Field(
        15.0, gt=0, le=3600, description="seconds between SSE heartbeats (a comment line)"
    )
    session_ttl: int = Field(
        12 * 3600, ge=60, description="seconds a web sign-in (the session cookie) lasts"
    )
    webhooks: tuple[Webhook, ...] = Field(
        (), description="webhook subscriptions (a JSON list, or the path of a file holding one)"
    )
    session_secret: str = Field(
        "",
        description="the key session cookies are signed with: the same on every copy behind a "
        "load balancer (default: a random one per process, so sign-ins end with it)",
    )

    @model_validator(mode="after")
    def _unique(self) -> ApiSettings:
        names = [i.name for i in self.tokens]
        hashes = [i.token_sha256 for i in self.tokens]
        if len(set(names)) != len(names):
            raise ValueError("two tokens have the same name")
        if len(set(hashes)) != len(hashes):
            raise ValueError("two identities have the same token")
        hooks = [h.id for h in self.webhooks]
        if len(set(hooks)) != len(hooks):
            raise ValueError("two webhooks have the same id")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ApiSettings:
        """Settings from the environment, then `overrides` (the CLI's flags) on top."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, value in env.items():
            if not name.startswith(ENV_PREFIX):
                continue
            field = name[len(ENV_PREFIX) :].lower()
            if field not in cls.model_fields:
                known = ", ".join(ENV_PREFIX + f.upper() for f in cls.model_fields)
                raise BadItem(name, f"unknown setting (known: {known})")
            values[field] = load_tokens(value, name) if field in ("tokens", "webhooks") else value
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            err = e.errors()[0]
            loc = [str(p) for p in err["loc"]] or ["settings"]
            where = ENV_PREFIX + loc[0].upper() + "".join(f"[{p}]" for p in loc[1:])
            raise BadItem(where, err["msg"]) from None


def load_tokens(value: str, field: str = ENV_PREFIX + "TOKENS") -> Any:
    """The JSON list itself, or (not starting with `[`) the path of a file that holds it."""
    text = value.strip()
    if not text.startswith("["):
        try:
            text = Path(text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadItem(field, f"not a JSON list, nor a readable file ({e})") from None
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise BadItem(field, f"not valid JSON ({e})") from None
    if not isinstance(parsed, list):
        raise BadItem(field, "expected a JSON list of objects")
    return parsed


def broker_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """The library's settings, from the environment without our own `PROMPT_BROKER_API_*`."""
    env = os.environ if environ is None else environ
    return Settings.from_env(
        {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}, **overrides
    )
