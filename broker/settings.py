"""One frozen settings object, read from `PROMPT_BROKER_*` environment variables in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from broker.errors import BadItem

__all__ = ["ENV_PREFIX", "Settings"]

ENV_PREFIX = "PROMPT_BROKER_"
_OTHERS = (ENV_PREFIX + "API_", ENV_PREFIX + "OPS_")


class Settings(BaseModel):
    """Everything configurable. `Settings.from_env()` reads `PROMPT_BROKER_<FIELD>`.

    An unknown `PROMPT_BROKER_*` variable is an error, so a misspelt option fails loudly instead
    of being ignored. `PROMPT_BROKER_API_*` belong to the HTTP server and `PROMPT_BROKER_OPS_*` to
    the ops endpoint, which check them themselves.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="the Redis server every replica shares"
    )
    redis_cluster: bool = Field(
        False,
        description="redis_url names a node of a Redis Cluster, or several (h1:p1,h2:p2; "
        "experimental)",
    )
    queue_url: str = Field(
        "",
        description="a Redis server of its own for arq's queues (the audit jobs, webhook "
        "deliveries); empty: redis_url's (on a cluster, the primary owning their slot)",
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        description="replicas that must confirm an answer's commit (Redis WAIT) before the post "
        "returns (0: off)",
    )
    wait_timeout: float = Field(
        0.5, gt=0, description="seconds an answer's post waits for those replicas' confirmation"
    )
    key_prefix: str = Field("pp", description="the first part of every key and channel")
    index_buckets: int = Field(
        0,
        ge=0,
        le=256,
        description="keys each discovery index (open, audit, leases, due) is split into, by "
        "thread (0: auto, 1 on one server and 16 on a Redis Cluster)",
    )
    identity: str = Field(
        "prompt-broker",
        description="the author of the broker's own items; items by it are never answers",
    )
    sweep_interval: float = Field(
        15.0, gt=0, description="seconds between re-reads of every prompt a waiter holds"
    )
    resolved_ttl: int = Field(
        30 * 86400,
        ge=0,
        description="seconds a prompt's record is kept after its audit item is posted (0: forever)",
    )
    closed_ttl: int = Field(
        7 * 86400,
        ge=0,
        description="seconds every key of a closed thread is kept after it closes (0: forever)",
    )
    stream_max_items: int = Field(
        10_000,
        ge=0,
        description="items a thread's stream keeps (0: no limit); never trimmed past an "
        "unaudited prompt",
    )
    stream_max_age: int = Field(
        0,
        ge=0,
        description="seconds a thread's items are kept (0: no limit); never trimmed past an "
        "unaudited prompt",
    )
    audit_job_timeout: int = Field(
        10, gt=0, description="seconds an audit job may run; arq redelivers after this plus 1 s"
    )
    audit_grace: float = Field(
        10.0, ge=0, description="seconds before the reconcile job re-enqueues an unposted audit"
    )

    # -- replicas (workers/) --------------------------------------------------------------
    lease_ttl: float = Field(
        5.0, gt=0, description="seconds a replica's lease on a thread lasts unless renewed"
    )
    adopt_interval: float = Field(
        0.5, gt=0, description="seconds between a replica's looks for threads to adopt"
    )
    held_waits_max: int = Field(
        8, ge=1, description="held waits per replica; past it the oldest is parked"
    )
    wait_mode: Literal["held", "parked"] = Field(
        "held", description="held: the agent's call blocks in place; parked: the turn ends"
    )
    max_turns: int = Field(16, ge=1, description="turns a replica runs at once")
    shutdown_grace: float = Field(
        5.0, ge=0, description="seconds a stopping replica lets its turns settle"
    )
    redis_connections: int = Field(
        3, ge=1, description="a replica's command connections (plus one for pub/sub)"
    )
    policy_rules: list[dict[str, Any]] = Field(
        [],
        description="the worker's own guarded-policy rules (a JSON list), tried before a thread's",
    )

    @field_validator("queue_url")
    @classmethod
    def _queue_url(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{value!r} is not a Redis URL (redis://, rediss:// or unix://)")
        return value

    @field_validator("policy_rules", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        # From the environment it is JSON text; its rules are checked by `workers.agents.policy`.
        if isinstance(value, str | bytes):
            try:
                return orjson.loads(value or "[]")
            except orjson.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e})") from None
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from the environment, then `overrides` (the CLI's flags) on top."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, value in env.items():
            if not name.startswith(ENV_PREFIX) or name.startswith(_OTHERS):
                continue  # the HTTP server's and the ops endpoint's own: they check them
            field = name[len(ENV_PREFIX) :].lower()
            if field not in cls.model_fields:
                known = ", ".join(ENV_PREFIX + f.upper() for f in cls.model_fields)
                raise BadItem(name, f"unknown setting (known: {known})")
            values[field] = value
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "settings"
            raise BadItem(ENV_PREFIX + field.upper(), err["msg"]) from None
