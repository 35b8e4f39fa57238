"""`prompt-broker webhooks list|replay`: the failed deliveries the HTTP server keeps, from a shell.

Against a real redis-server: a failed delivery is planted in the hash the dispatcher writes
(`<prefix>:webhooks:failed`, the record `Dispatcher._deliver` stores after its last try), then
listed and replayed through `workers.runtime.cli.main`, and once through a real process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
import redis
from redis.asyncio import Redis

from broker import Broker, Settings
from tests.conftest import delete_prefix
from web.webhooks import Dispatcher, Webhook
from workers.runtime.cli import main

pytestmark = pytest.mark.real_redis

HOOK = {
    "id": "chat",
    "url": "http://127.0.0.1:9/hooks/pb",
    "secret": "a-secret-of-at-least-sixteen",
    "events": ["prompt.opened", "prompt.answered"],
}
DELIVERY = "chat:1700000000000-0"
PAYLOAD = {
    "id": "1700000000000-0",
    "event": "prompt.opened",
    "thread_id": "t1",
    "prompt_id": "p1",
    "at_ms": 1700000000000,
}


@pytest.fixture
def env(real_redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[redis.Redis]:
    """This test's prefix and one subscription in the environment; its keys deleted after."""
    monkeypatch.setenv("PROMPT_BROKER_REDIS_URL", real_redis_url)
    monkeypatch.setenv("PROMPT_BROKER_KEY_PREFIX", prefix)
    monkeypatch.setenv("PROMPT_BROKER_API_WEBHOOKS", orjson.dumps([HOOK]).decode())
    client = redis.Redis.from_url(real_redis_url, decode_responses=True)
    yield client
    client.close()

    async def clean() -> None:
        r = Redis.from_url(real_redis_url)
        await delete_prefix(r, prefix)
        await r.aclose()

    asyncio.run(clean())


def plant(client: redis.Redis, prefix: str) -> None:
    record = {"hook": "chat", "payload": PAYLOAD, "error": "HTTP 500", "tries": 8}
    client.hset(f"{prefix}:webhooks:failed", DELIVERY, orjson.dumps(record).decode())


def test_list_shows_subscriptions_and_failures_without_the_secret(
    env: redis.Redis, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["webhooks", "list"]) == 0
    empty = capsys.readouterr().out
    assert "failed deliveries (0)" in empty and DELIVERY not in empty
    plant(env, prefix)
    assert main(["webhooks", "list"]) == 0
    out = capsys.readouterr().out
    assert "subscriptions (1):" in out
    assert "chat  http://127.0.0.1:9/hooks/pb  prompt.opened, prompt.answered" in out
    assert "failed deliveries (1):" in out
    line = next(x for x in out.splitlines() if DELIVERY in x)
    assert "prompt.opened" in line and "thread t1" in line and "8 tries" in line
    assert "HTTP 500" in line
    assert HOOK["secret"] not in out


def test_list_json(env: redis.Redis, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    plant(env, prefix)
    assert main(["webhooks", "list", "--json"]) == 0
    document = orjson.loads(capsys.readouterr().out)
    assert document == {
        "webhooks": [{"id": "chat", "url": HOOK["url"], "events": HOOK["events"]}],
        "failed": [
            {
                "delivery": DELIVERY,
                "hook": "chat",
                "payload": PAYLOAD,
                "error": "HTTP 500",
                "tries": 8,
            }
        ],
    }


def test_replay_requeues_the_delivery_and_forgets_the_failure(
    env: redis.Redis, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plant(env, prefix)
    assert main(["webhooks", "replay", DELIVERY]) == 0
    assert DELIVERY in capsys.readouterr().out
    assert env.hlen(f"{prefix}:webhooks:failed") == 0
    # The arq job a `serve` copy's worker takes: on its queue, for the same hook and event.
    jobs = env.zrange(f"{prefix}:webhooks:queue", 0, -1)
    assert len(jobs) == 1 and jobs[0].startswith(f"{prefix}:wh:{DELIVERY}:replay:")
    assert main(["webhooks", "list", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["failed"] == []


def test_replay_of_an_unknown_delivery_is_one_line_and_nonzero(
    env: redis.Redis, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plant(env, prefix)
    assert main(["webhooks", "replay", "chat:nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "no failed delivery 'chat:nope'" in captured.err
    # Nothing queued, and the kept failure is still there.
    assert env.zcard(f"{prefix}:webhooks:queue") == 0
    assert env.hexists(f"{prefix}:webhooks:failed", DELIVERY)


def test_a_real_process_lists_and_refuses(env: redis.Redis, prefix: str) -> None:
    plant(env, prefix)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "workers.runtime.cli", "webhooks", *args],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    listed = run("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [f["delivery"] for f in orjson.loads(listed.stdout)["failed"]] == [DELIVERY]
    unknown = run("replay", "chat:nope")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "prompt-broker: error: DELIVERY_ID: no failed delivery 'chat:nope' "
        "(`webhooks list` shows those kept)"
    ]
    replayed = run("replay", DELIVERY)
    assert replayed.returncode == 0, replayed.stderr
    assert env.hlen(f"{prefix}:webhooks:failed") == 0


def test_a_replayed_delivery_reaches_the_receiver(
    env: redis.Redis, prefix: str, real_redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replayed from the CLI, the delivery is sent by a `serve` copy's dispatcher, same id."""
    plant(env, prefix)
    assert main(["webhooks", "replay", DELIVERY]) == 0
    received: list[tuple[str | None, bytes]] = []
    arrived = threading.Event()

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.headers["X-Prompt-Broker-Delivery"], body))
            self.send_response(204)
            self.end_headers()
            arrived.set()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook = Webhook.model_validate({**HOOK, "url": f"http://127.0.0.1:{server.server_port}/"})

    async def serve_until_received() -> None:
        async with Broker.from_url(real_redis_url, Settings(key_prefix=prefix)) as b:
            hooks = Dispatcher(b.redis, b.keys, (hook,))
            await hooks.start()
            try:
                await asyncio.to_thread(arrived.wait, 15)
            finally:
                await hooks.aclose()

    try:
        asyncio.run(serve_until_received())
    finally:
        server.shutdown()
        server.server_close()
    assert [d for d, _ in received] == [DELIVERY]
    assert orjson.loads(received[0][1]) == PAYLOAD
