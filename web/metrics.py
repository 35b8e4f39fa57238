"""Prometheus metrics of the HTTP server (`prompt-broker serve`), served at its own `/metrics`.

What only a `serve` copy sees: its requests (by route template, never the path with a thread's
id in it), how long they take to start answering (an event stream's life is not its latency),
the event streams it holds open, and its webhook deliveries. The fleet's metrics (open prompts,
resolutions by surface, time to answer, ...) come from the audit worker's ops endpoint; each
copy here counts only its own work, so `sum` across copies is the right aggregate.

The registry is the process's own, apart from the fleet processes' registry, so one process
that runs both (a test) never mixes them.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "EVENT_STREAMS",
    "REGISTRY",
    "REQUESTS",
    "REQUEST_SECONDS",
    "WEBHOOK_DELIVERIES",
    "Measured",
    "exposition",
]

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "prompt_broker_http_requests",
    "HTTP requests answered, by route template (unmatched: 'none'), method and status.",
    ["route", "method", "status"],
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "prompt_broker_http_request_seconds",
    "Seconds from a request's arrival to the start of its response, by route template.",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
EVENT_STREAMS = Gauge(
    "prompt_broker_http_event_streams",
    "Server-Sent Event streams this copy holds open.",
    registry=REGISTRY,
)
WEBHOOK_DELIVERIES = Counter(
    "prompt_broker_webhook_deliveries",
    "Webhook delivery attempts by subscription and outcome: delivered, retried (an attempt "
    "failed and another is queued), failed (the last try failed: kept for replay), unsubscribed.",
    ["hook", "outcome"],
    registry=REGISTRY,
)


def exposition() -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(REGISTRY)


class Measured:
    """Counts and times every HTTP request (a pure ASGI wrapper: streams stay unbuffered).

    The route is the template the router matched (`/v1/threads/{thread_id}`), read from the
    scope after routing, so the labels stay few whatever ids the paths carry."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500  # a response never started is the server's failure

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                REQUEST_SECONDS.labels(_route(scope)).observe(time.perf_counter() - began)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            REQUESTS.labels(_route(scope), scope.get("method", ""), str(status)).inc()


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else "none"
