"""The OpenAPI 3.1 document served at `/openapi.json`, written out rather than derived.

Starlette derives nothing, and the library checks every input itself (naming the field in
its 422s), so the document says the contract in one place; a test holds it to the routes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["document"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERR = _json(_ref("Error"), "an error: `{error: {code, message, field?}}`")
_THREAD = {"name": "thread_id", "in": "path", "required": True, "schema": {"type": "string"}}
_PAGE = [
    {"name": "cursor", "in": "query", "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 200}},
]


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _ERR for c in codes}


def _read(summary: str, ok: dict[str, Any], *codes: int, **extra: Any) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "security": [{"bearer": []}, {"session": []}],
            "responses": {"200": ok, **_errors(401, 403, 422, 503, *codes)},
            **extra,
        }
    }


_SSE = {
    "description": "Server-Sent Events: `prompt.opened`, `prompt.answered`, `prompt.cancelled`, "
    "`prompt.reminder`, `prompt.escalated` (each with an `id:`), `ready` first, `reset` "
    "when the client fell behind the log; a `: ping` comment every heartbeat. Resume with "
    "the `Last-Event-ID` header.",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": {"type": "string"},
                    "message": {"type": "string"},
                    "field": {"type": "string"},
                },
            }
        },
    },
    "Question": {
        "type": "object",
        "properties": {
            "question": {"type": "string"},
            "header": {"type": "string"},
            "multiSelect": {"type": "boolean"},
            "options": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string"},
                        "description": {"type": "string"},
                    },
                },
            },
            "subject": {"type": "string"},
            "grant_key": {"type": "string"},
        },
    },
    "Answer": {
        "type": "object",
        "properties": {
            "question": {"type": "string"},
            "answer": {"type": "array", "items": {"type": "string"}},
        },
    },
    "Prompt": {
        "type": "object",
        "properties": {
            "prompt_id": {"type": "string"},
            "thread_id": {"type": "string"},
            "kind": {"enum": ["approval", "ask_user_question", "text"]},
            "questions": {"type": "array", "items": _ref("Question")},
            "state": {"enum": ["pending", "answered", "cancelled"]},
            "created_at": {"type": "string", "format": "date-time"},
            "harness": {"type": ["string", "null"]},
            "work_folder": {"type": ["string", "null"]},
            "answers": {"type": ["array", "null"], "items": _ref("Answer")},
            "answered_by": {"type": ["string", "null"]},
            "reason": {"type": ["string", "null"]},
            "escalated_to": {"type": ["string", "null"]},
            "timing": {"oneOf": [_ref("Timing"), {"type": "null"}]},
            "deadline_at": {"type": ["string", "null"], "format": "date-time"},
        },
    },
    "Timing": {
        "type": "object",
        "description": "seconds after a prompt opens; a PUT also takes durations as text "
        "(`90s`, `15m`, `2h`, `1d`)",
        "additionalProperties": False,
        "properties": {
            "deadline": {"type": "number", "exclusiveMinimum": 0},
            "remind": {"type": "array", "items": {"type": "number"}, "maxItems": 20},
            "escalate": {"type": "number", "exclusiveMinimum": 0},
            "escalate_to": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]+$"},
        },
    },
    "TimingState": {
        "type": "object",
        "properties": {
            "thread_id": {"type": "string"},
            "prompt_id": {"type": "string"},
            "timing": {"oneOf": [_ref("Timing"), {"type": "null"}]},
            "deadline_at": {"type": ["string", "null"], "format": "date-time"},
        },
    },
    "Item": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "author": {"type": "string"},
            "type": {"type": "string"},
            "content": {"type": "array", "items": {"type": "object"}},
            "metadata": {"type": "object"},
            "created_at": {"type": "string", "format": "date-time"},
        },
    },
    "NewItem": {
        "type": "object",
        "description": "the thread-item shape; any `author` is ignored (the token's name is)",
        "properties": {
            "content": {"type": "array", "items": {"type": "object"}},
            "metadata": {
                "type": "object",
                "properties": {
                    "prompt_id": {"type": "string"},
                    "answers": {"type": "array", "items": _ref("Answer")},
                },
            },
        },
    },
    "Routed": {
        "type": "object",
        "properties": {
            "outcome": {"enum": ["answered", "queued", "posted"]},
            "item_id": {"type": "string"},
            "prompt_id": {"type": ["string", "null"]},
            "answers": {"type": ["array", "null"], "items": _ref("Answer")},
            "source": {"enum": ["structured", "text", None]},
            "refused_answers": {"type": ["string", "null"]},
        },
    },
    "SignedIn": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "scopes": {"type": "array", "items": {"type": "string"}},
            "threads": {"type": "string"},
            "groups": {"type": "array", "items": {"type": "string"}},
            "csrf_token": {"type": ["string", "null"]},
            "expires_at": {"type": ["integer", "null"]},
        },
    },
}


_PROMPT = {"name": "prompt_id", "in": "path", "required": True, "schema": {}}


def _timing(what: str, *params: dict[str, Any]) -> dict[str, Any]:
    """GET and PUT of a thread's or a prompt's timing."""
    state = _json(_ref("TimingState"), "the timing in force (`null`: none)")
    return {
        **_read(f"{what}'s timing", state, 404, parameters=list(params)),
        "put": {
            "summary": f"set {what}'s timing, or clear it with `null` (answer, in the glob)",
            "parameters": list(params),
            "requestBody": _json({"oneOf": [_ref("Timing"), {"type": "null"}]}, "the timing"),
            "responses": {"200": state, **_errors(401, 403, 404, 409, 422, 503)},
            "security": [{"bearer": []}, {"session": []}],
        },
    }


def document() -> dict[str, Any]:
    """The whole OpenAPI document."""
    page: dict[str, Any] = {"parameters": _PAGE}
    write: dict[str, Any] = {"security": [{"bearer": []}, {"session": []}]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "prompt-broker", "version": "1"},
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {
                    "type": "apiKey",
                    "in": "cookie",
                    "name": "pb_session",
                    "description": "from POST /v1/session; writes also need X-CSRF-Token",
                },
            },
        },
        "paths": {
            "/healthz": {"get": {"summary": "alive", "responses": {"200": {"description": "ok"}}}},
            "/metrics": {
                "get": {
                    "summary": "this copy's Prometheus metrics (text format)",
                    "responses": {"200": {"description": "the metrics"}},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Redis answers",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "no"}},
                }
            },
            "/v1/session": {
                "post": {
                    "summary": "sign in with a token: sets the session cookie",
                    "requestBody": _json(
                        {"type": "object", "properties": {"token": {"type": "string"}}}, "token"
                    ),
                    "responses": {"200": _json(_ref("SignedIn"), "signed in"), **_errors(401, 422)},
                },
                "get": {
                    "summary": "who is signed in (and the CSRF token)",
                    "responses": {"200": _json(_ref("SignedIn"), "signed in"), **_errors(401)},
                },
                "delete": {
                    "summary": "sign out",
                    "responses": {"204": {"description": "signed out"}, **_errors(401, 403)},
                },
            },
            "/v1/prompts": _read(
                "what waits on a person, oldest first",
                _json(
                    {
                        "type": "object",
                        "properties": {
                            "prompts": {"type": "array", "items": _ref("Prompt")},
                            "next_cursor": {"type": ["string", "null"]},
                        },
                    },
                    "a page",
                ),
                parameters=[
                    {"name": "state", "in": "query", "schema": {"enum": ["open"]}},
                    *_PAGE,
                ],
            ),
            "/v1/threads": _read("a page of threads", _json({"type": "object"}, "a page"), **page),
            "/v1/threads/{thread_id}": _read(
                "a thread: its items in order, its active prompt, its session",
                _json({"type": "object"}, "the thread"),
                404,
                parameters=[_THREAD],
            ),
            "/v1/threads/{thread_id}/prompts/{prompt_id}": _read(
                "one prompt, and its pending_prompt item",
                _json(_ref("Prompt"), "the prompt"),
                404,
                parameters=[
                    _THREAD,
                    {"name": "prompt_id", "in": "path", "required": True, "schema": {}},
                ],
            ),
            "/v1/threads/{thread_id}/timing": _timing("the thread", _THREAD),
            "/v1/threads/{thread_id}/prompts/{prompt_id}/timing": _timing(
                "the prompt", _THREAD, _PROMPT
            ),
            "/v1/threads/{thread_id}/items": {
                "post": {
                    "summary": "post an answer or a message as the token's identity",
                    "parameters": [
                        _THREAD,
                        {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}},
                    ],
                    "requestBody": _json(_ref("NewItem"), "the item"),
                    "responses": {
                        "200": _json(_ref("Routed"), "what happened to it"),
                        **_errors(401, 403, 404, 409, 422, 503),
                    },
                    **write,
                }
            },
            "/v1/threads/{thread_id}/cancel": {
                "post": {
                    "summary": "cancel the thread's active prompt",
                    "parameters": [_THREAD],
                    "responses": {
                        "200": _json({"type": "object"}, "`{cancelled: Prompt | null}`"),
                        **_errors(401, 403, 404, 422, 503),
                    },
                    **write,
                }
            },
            "/v1/webhooks": _read(
                "webhook subscriptions and kept failures (admin)",
                _json({"type": "object"}, "`{webhooks: [...], failed: [...]}`"),
            ),
            "/v1/webhooks/failed/{delivery}/replay": {
                "post": {
                    "summary": "deliver a kept failure again (admin)",
                    "parameters": [
                        {"name": "delivery", "in": "path", "required": True, "schema": {}}
                    ],
                    "responses": {
                        "200": _json({"type": "object"}, "`{replayed: <delivery>}`"),
                        **_errors(401, 403, 404),
                    },
                    **write,
                }
            },
            "/v1/events": _read("every visible thread's prompt events", _SSE),
            "/v1/threads/{thread_id}/events": _read(
                "one thread's prompt events", _SSE, parameters=[_THREAD]
            ),
        },
    }
