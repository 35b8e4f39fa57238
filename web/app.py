"""The ASGI app: the JSON API under `/v1`, its event streams, health checks and the web inbox.

Stateless beyond Redis: every copy behind a load balancer answers every request the same (with
the same `PROMPT_BROKER_API_SESSION_SECRET`, session cookies too). It reads and writes prompts
only through the `Broker` API.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import BadItem, Broker, BrokerError, Settings
from web import metrics
from web.api import Api
from web.auth import Gate
from web.errors import ApiError, error_response, from_broker, json_response
from web.openapi import document
from web.settings import ApiSettings, broker_settings
from web.sse import EventHub
from web.webhooks import Dispatcher

__all__ = ["SECURITY_HEADERS", "STATIC", "create_app"]

logger = logging.getLogger("web")

STATIC = Path(__file__).parent / "static"


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _broker_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BrokerError)
    error = from_broker(exc)
    if error.status >= 500:
        logger.warning("api.unavailable", extra={"path": request.url.path, "error": str(exc)})
    return error_response(error)


async def _redis_error(request: Request, exc: Exception) -> Response:
    # A read the library does not wrap (a session record, the index) met an outage.
    logger.warning("api.unavailable", extra={"path": request.url.path, "error": repr(exc)})
    return error_response(
        ApiError(503, "unavailable", "Redis could not be reached", headers={"Retry-After": "1"})
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(
        ApiError(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))
    )


async def _internal(request: Request, exc: Exception) -> Response:
    # Never the request's headers in the log: they may carry a token or a session cookie.
    logger.error("api.internal", extra={"path": request.url.path}, exc_info=exc)
    return error_response(ApiError(500, "internal", "an internal error (logged)"))


#: On every response. The page holds Approve buttons: no other site may frame it (clickjacking),
#: and it runs only its own files (no inline script, nothing fetched from elsewhere).
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
]


class _SecurityHeaders:
    """Adds `SECURITY_HEADERS` to every HTTP response (a pure ASGI wrapper: streams unbuffered)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, sending)


def _api(request: Request) -> Api:
    api: Api = request.app.state.api
    return api


def handler(name: str) -> Any:
    """The route for one of `Api`'s methods, looked up when the app has started."""

    async def call(request: Request) -> Response:
        return await getattr(_api(request), name)(request)  # type: ignore[no-any-return]

    call.__name__ = name
    return call


async def healthz(request: Request) -> Response:
    return json_response({"ok": True})


async def readyz(request: Request) -> Response:
    try:
        await _api(request).broker.redis.ping()
    except (RedisError, OSError) as e:
        return json_response({"ok": False, "redis": False, "error": repr(e)}, 503)
    return json_response({"ok": True, "redis": True})


async def metrics_text(request: Request) -> Response:
    """This copy's own metrics (requests, event streams, webhook deliveries): counts only,
    nothing of a prompt or a person, so it asks for no token, like the health checks."""
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def openapi(request: Request) -> Response:
    return json_response(document())


async def index(request: Request) -> Response:
    page = STATIC / "index.html"
    if page.is_file():
        return FileResponse(page, headers={"Cache-Control": "no-cache"})
    return PlainTextResponse("prompt-broker: the web inbox is not installed", 404)


def create_app(
    api_settings: ApiSettings | None = None,
    settings: Settings | None = None,
    *,
    broker: Broker | None = None,
    webhook_options: dict[str, Any] | None = None,
) -> Starlette:
    """The app. With `broker` (tests), it serves that Broker and leaves it open at shutdown;
    otherwise it opens its own from `settings` (default: the environment) when it starts."""
    api_settings = api_settings or ApiSettings.from_env()
    settings = broker.settings if broker is not None else settings or broker_settings()
    identity = settings.identity
    if any(i.name == identity for i in api_settings.tokens):
        # Its items would be the broker's own: never answers, and free to forge audit items.
        raise BadItem("PROMPT_BROKER_API_TOKENS", f"no token may be named {identity!r}")
    gate = Gate(api_settings)
    webhook_options = webhook_options or {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = broker is None
        b = broker or Broker.from_url(settings=settings)
        hub = EventHub(b.redis, b.keys)
        await hub.start()
        hooks = None
        if api_settings.webhooks:
            hooks = Dispatcher(
                b.redis,
                b.keys,
                api_settings.webhooks,
                queue_redis=b.queue_redis,
                **webhook_options,
            )
            await hooks.start()
        app.state.api = Api(b, api_settings, gate, hub, hooks)
        try:
            yield
        finally:
            if hooks is not None:
                await hooks.aclose()
            await hub.aclose()
            if own:
                await b.aclose()

    routes = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics_text),
        Route("/openapi.json", openapi),
        Route("/v1/session", handler("sign_in"), methods=["POST"]),
        Route("/v1/session", handler("whoami"), methods=["GET"]),
        Route("/v1/session", handler("sign_out"), methods=["DELETE"]),
        Route("/v1/prompts", handler("list_prompts")),
        Route("/v1/threads", handler("list_threads")),
        Route("/v1/events", handler("events")),
        Route("/v1/threads/{thread_id}", handler("get_thread")),
        Route("/v1/threads/{thread_id}/events", handler("events")),
        Route("/v1/threads/{thread_id}/prompts/{prompt_id}", handler("get_prompt")),
        Route("/v1/threads/{thread_id}/timing", handler("get_timing"), methods=["GET"]),
        Route("/v1/threads/{thread_id}/timing", handler("put_timing"), methods=["PUT"]),
        Route(
            "/v1/threads/{thread_id}/prompts/{prompt_id}/timing",
            handler("get_timing"),
            methods=["GET"],
        ),
        Route(
            "/v1/threads/{thread_id}/prompts/{prompt_id}/timing",
            handler("put_timing"),
            methods=["PUT"],
        ),
        Route("/v1/threads/{thread_id}/items", handler("post_item"), methods=["POST"]),
        Route("/v1/threads/{thread_id}/cancel", handler("cancel"), methods=["POST"]),
        Route("/v1/webhooks", handler("webhooks")),
        Route("/v1/webhooks/failed/{delivery}/replay", handler("replay_webhook"), methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static"),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(metrics.Measured), Middleware(_SecurityHeaders)],
        exception_handlers={
            ApiError: _api_error,
            BrokerError: _broker_error,
            RedisError: _redis_error,
            ConnectionError: _redis_error,
            HTTPException: _http_error,
            Exception: _internal,
        },
    )
