"""`Idempotency-Key`: a retried POST gets the first answer back and writes nothing.

One record per (identity, thread, key), in the thread's hash slot beside its other keys:
`<prefix>:{T}:api-idem:<sha256>`: the whole first answer (status and body, a 409 too), so a
replay is the same response; the write itself is made at most once by the library, which is
handed the key too. It is claimed with SET NX (a short TTL while the first request
runs, so a crash in between frees it), then holds the first answer's status and body for a day.
An answer that did not take effect for certain (503) frees the key, so the retry really retries.
These records are this package's own writes outside the `Broker` API (beside the webhooks').
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from broker.keys import ThreadKeys
from web.errors import ApiError, bad, dumps

__all__ = ["Claim", "check_key", "claim", "finish", "release"]

_KEY = re.compile(r"[\x21-\x7e]{1,200}")
_RUNNING_TTL = 60  # seconds: longer than any POST takes, short enough for a crashed one
_DONE_TTL = 86_400


def check_key(value: str) -> str:
    if not _KEY.fullmatch(value):
        raise bad("Idempotency-Key", "expected 1 to 200 printable ASCII characters, no spaces")
    return value


@dataclass(frozen=True, slots=True)
class Claim:
    key: str
    body_hash: str


def _record_key(tk: ThreadKeys, name: str, key: str) -> str:
    digest = hashlib.sha256(f"{name}\0{key}".encode()).hexdigest()
    return f"{tk.base}api-idem:{digest}"


async def claim(
    redis: Redis, tk: ThreadKeys, name: str, key: str, body: bytes
) -> Claim | tuple[int, Any]:
    """Claim the key for this request (a `Claim`), or the first answer's `(status, body)`.

    Raises 409 while the first request still runs, and 422 when the key was used with another
    body (a client bug that must not pass as a replay).
    """
    record_key = _record_key(tk, name, check_key(key))
    body_hash = hashlib.sha256(body).hexdigest()
    running = orjson.dumps({"state": "running", "body": body_hash})
    if await redis.set(record_key, running, nx=True, ex=_RUNNING_TTL):
        return Claim(record_key, body_hash)
    raw = await redis.get(record_key)
    if raw is None:  # expired between the two calls: take it now
        if await redis.set(record_key, running, nx=True, ex=_RUNNING_TTL):
            return Claim(record_key, body_hash)
        raw = await redis.get(record_key) or b"{}"
    record = orjson.loads(raw)
    if record.get("body") != body_hash:
        raise ApiError(
            422,
            "idempotency_mismatch",
            "this Idempotency-Key was used with a different body",
            field="Idempotency-Key",
        )
    if record.get("state") != "done":
        raise ApiError(
            409,
            "idempotency_conflict",
            "a request with this Idempotency-Key is still running: retry in a moment",
        )
    return int(record["status"]), record["response"]


async def finish(redis: Redis, claim: Claim, status: int, response: Any) -> None:
    """Keep the first answer for replays. A 5xx is not kept but frees the key, so a retry
    really retries: the post itself carries the key to the library, which makes it at most
    once even if the first one took effect before Redis went away."""
    if status >= 500:
        await redis.delete(claim.key)
        return
    record = {"state": "done", "body": claim.body_hash, "status": status, "response": response}
    await redis.set(claim.key, dumps(record), ex=_DONE_TTL)


async def release(redis: Redis, claim: Claim) -> None:
    await redis.delete(claim.key)
