"""`serve`'s own /metrics: requests by route template and status, their latency, the event
streams held open. Read over HTTP, as a Prometheus scraper does, and compared before and after
(the counters are the process's, shared by every app a test process makes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker import Broker
from web.app import create_app
from web.settings import ApiSettings, Identity
from web.testing import serving

ALICE = "alice-token-0123456789"
SECRET_THREAD = "t-7f3c9a-not-in-metrics"


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[httpx.AsyncClient]:
    alice = Identity.model_validate({"name": "alice", "token": ALICE, "scopes": ["read"]})
    app = create_app(ApiSettings(tokens=(alice,), heartbeat=0.3), broker=broker)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client


async def scrape(
    c: httpx.AsyncClient,
) -> tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    r = await c.get("/metrics")  # no token: counts only, like the health checks
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }
    return r.text, samples


def requests(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float],
    route: str,
    method: str,
    status: int,
) -> float:
    key = (
        "prompt_broker_http_requests_total",
        frozenset({("route", route), ("method", method), ("status", str(status))}),
    )
    return samples.get(key, 0.0)


async def test_requests_are_counted_by_route_template_and_status(
    http: httpx.AsyncClient, broker: Broker
) -> None:
    _, before = await scrape(http)
    token = {"Authorization": f"Bearer {ALICE}"}
    assert (await http.get("/v1/prompts", headers=token)).status_code == 200
    assert (await http.get("/v1/prompts", headers=token)).status_code == 200
    assert (await http.get("/v1/prompts")).status_code == 401
    assert (await http.get(f"/v1/threads/{SECRET_THREAD}", headers=token)).status_code == 404
    assert (await http.get("/nowhere", headers=token)).status_code == 404
    text, after = await scrape(http)
    assert (
        requests(after, "/v1/prompts", "GET", 200) - requests(before, "/v1/prompts", "GET", 200)
        == 2
    )
    assert (
        requests(after, "/v1/prompts", "GET", 401) - requests(before, "/v1/prompts", "GET", 401)
        == 1
    )
    thread = "/v1/threads/{thread_id}"
    assert requests(after, thread, "GET", 404) - requests(before, thread, "GET", 404) == 1
    assert requests(after, "none", "GET", 404) - requests(before, "none", "GET", 404) == 1
    assert SECRET_THREAD not in text  # ids never become labels
    count = ("prompt_broker_http_request_seconds_count", frozenset({("route", "/v1/prompts")}))
    assert after[count] - before.get(count, 0.0) == 3


async def test_open_event_streams_are_a_gauge(http: httpx.AsyncClient) -> None:
    key: tuple[str, frozenset[tuple[str, str]]] = ("prompt_broker_http_event_streams", frozenset())
    _, before = await scrape(http)
    token = {"Authorization": f"Bearer {ALICE}"}
    async with http.stream("GET", "/v1/events", headers=token) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event: ready"):
                break
        _, during = await scrape(http)
        assert during[key] - before[key] == 1
    for _ in range(100):  # the server notices the closed stream at its next write
        _, after = await scrape(http)
        if after[key] == before[key]:
            break
        await asyncio.sleep(0.05)
    assert after[key] == before[key]
