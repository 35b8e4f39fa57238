"""Reading a request's inputs: the path's thread id, a page's `limit` and `cursor`, and a body
of JSON (read to a bound, then parsed), each refused with a 422 naming what is wrong."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import orjson
from starlette.requests import Request

from broker.keys import check_thread_id
from web.errors import ApiError, bad

__all__ = [
    "MAX_BODY",
    "decode_cursor",
    "encode_cursor",
    "json_body",
    "limit",
    "parse_json",
    "raw_body",
    "thread_id",
]

MAX_BODY = 256 * 1024  # the library refuses items past 64 KB; this only bounds the read
PAGE = 50
MAX_PAGE = 200
_DIGITS = re.compile(r"[0-9]{1,4}")  # not str.isdigit: that takes "¹" too


def limit(request: Request) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return PAGE
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_PAGE:
        raise bad("limit", f"expected a whole number from 1 to {MAX_PAGE}")
    return int(raw)


def encode_cursor(value: object) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(value)).decode().rstrip("=")


def decode_cursor(request: Request) -> Any:
    raw = request.query_params.get("cursor") or ""
    if not raw:
        return None
    try:
        return orjson.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, orjson.JSONDecodeError):
        raise bad("cursor", "not a cursor this server gave out") from None


def thread_id(request: Request) -> str:
    return check_thread_id(request.path_params["thread_id"])


async def raw_body(request: Request) -> bytes:
    """The body's bytes; 413 past `MAX_BODY`."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise ApiError(413, "too_large", f"the body is over {MAX_BODY} bytes")
    return raw


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad("body", "not valid JSON") from None


async def json_body(request: Request, *, optional: bool = False) -> tuple[dict[str, Any], bytes]:
    """The body, a JSON object (`{}` for an empty one when `optional`), and its bytes."""
    raw = await raw_body(request)
    if not raw.strip() and optional:
        return {}, raw
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    return body, raw
