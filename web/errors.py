"""The API's error body, and the library's errors mapped to status codes.

Every non-2xx answer is `{"error": {"code", "message", ...}}`; a 422 names the `field`.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from broker.errors import (
    BadItem,
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    Fenced,
    PromptCancelled,
    PromptNotFound,
    PromptUnavailable,
    StaleAnswer,
    ThreadClosed,
    ThreadNotFound,
)

__all__ = ["ApiError", "bad", "dumps", "error_response", "from_broker", "json_response"]

_OPTIONS = orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=_OPTIONS)


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(value), status, headers, media_type="application/json")


class ApiError(Exception):
    """An answer other than 2xx: its status, a stable `code`, a message and any extra fields."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers
        self.extra = extra

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        error.update(self.extra)
        return {"error": error}


def bad(field: str, problem: str) -> ApiError:
    return ApiError(422, "bad_item", f"{field}: {problem}", field=field)


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), error.status, error.headers)


def _extra(error: BrokerError) -> dict[str, Any]:
    """The ids and state an error carries, for the body beside its message."""
    names = ("thread_id", "prompt_id", "state", "active_prompt_id", "took_effect")
    return {n: getattr(error, n) for n in names if hasattr(error, n)}


#: Each library error's status and code, most specific first.
_MAPPED: tuple[tuple[type[BrokerError], int, str], ...] = (
    (ThreadNotFound, 404, "thread_not_found"),
    (PromptNotFound, 404, "prompt_not_found"),
    (ThreadClosed, 409, "thread_closed"),
    (StaleAnswer, 409, "stale_answer"),
    (PromptCancelled, 409, "prompt_cancelled"),
    (Fenced, 409, "fenced"),  # only a replica's fenced call can be; never the API's
    (BrokerUnavailable, 503, "unavailable"),
    (PromptUnavailable, 503, "unavailable"),
    (BrokerClosed, 503, "unavailable"),
)


def from_broker(error: BrokerError) -> ApiError:
    """The status code and body for one of the library's errors (a StaleAnswer's caller adds
    the prompt's real state, read afterwards)."""
    if isinstance(error, BadItem):
        return ApiError(422, "bad_item", str(error), field=error.field)
    for kind, status, code in _MAPPED:
        if isinstance(error, kind):
            headers = {"Retry-After": "1"} if status == 503 else None
            return ApiError(status, code, str(error), headers=headers, **_extra(error))
    return ApiError(500, "internal", "an unexpected broker error")
