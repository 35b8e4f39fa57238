"""Health, readiness and `status`, against real fleet processes on a real redis-server of the
test's own, and on the session's Redis Cluster."""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tests.conftest import RedisServer, free_port
from tests.helpers import cli, eventually, fleet_env, process

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]


@pytest.fixture
def env(fleet_redis: tuple[str, dict[str, str]]) -> dict[str, str]:
    """A private server of the test's own, or the session's cluster (`where` in conftest.py)."""
    url, chosen = fleet_redis
    return fleet_env(url, **chosen, LEASE_TTL="2", ADOPT_INTERVAL="0.3")


def status(env: dict[str, str]) -> dict[str, Any]:
    run = cli("status", "--json", env=env)
    assert run.returncode == 0, run.stderr
    document: dict[str, Any] = orjson.loads(run.stdout)
    return document


def test_fleet_status(env: dict[str, str]) -> None:
    """`status` shows a replica's thread, its held wait and the open prompt; a paused replica
    shows as not live and its thread as not held by a live replica."""
    with process(["worker", "--id", "r1"], env) as worker:
        made = cli("thread", "new", "t1", "--message", "go", env=env)
        assert made.returncode == 0, made.stderr
        fleet = eventually(
            lambda: (s := status(env))["held_waits"] == 1 and s, "the held wait in status"
        )
        assert fleet["replicas_live"] == 1 and fleet["threads"] == 1
        [replica] = fleet["replicas"]
        assert replica["id"] == "r1" and replica["live"] and replica["threads"] == 1
        assert replica["held_waits"] == 1 and replica["parked_waits"] == 0
        assert fleet["open_prompts"] == 1 and fleet["open_by_kind"] == {"ask_user_question": 1}
        assert fleet["oldest_open"].startswith("t1/prm_") and fleet["threads_unheld"] == 0
        assert fleet["oldest_unheld"] is None and fleet["oldest_unheld_age_s"] == 0
        human = cli("status", env=env)
        assert human.returncode == 0, human.stderr
        assert "replicas: 1 live of 1 recorded" in human.stdout
        assert "waits: 1 held, 0 parked; turns running: 0" in human.stdout
        assert "open prompts: 1 (ask_user_question 1)" in human.stdout
        assert "oldest open prompt: t1/prm_" in human.stdout

        worker.send_signal(signal.SIGSTOP)  # paused past its lease: its record lapses
        eventually(lambda: status(env)["replicas_live"] == 0, "the paused replica not live")
        paused = status(env)
        assert paused["threads_unheld"] == 1
        # Its prompt is now one whose answer reaches nobody until a replica adopts the thread.
        assert paused["oldest_unheld"] == paused["oldest_open"]
        assert paused["oldest_unheld_age_s"] > 0
        assert "oldest prompt no live replica holds: t1/prm_" in cli("status", env=env).stdout
        worker.send_signal(signal.SIGCONT)


def test_replica_health(env: dict[str, str]) -> None:
    """A replica's ops endpoint: ready once its liveness record is current; a paused replica
    fails its probe (no answer); a killed one cannot be reached."""
    port = free_port()
    assert cli("health", "worker", "--port", str(port), env=env).returncode == 1  # nothing yet
    with process(["worker", "--id", "r1"], env | {"PROMPT_BROKER_OPS_PORT": str(port)}) as worker:
        eventually(
            lambda: cli("health", "worker", "--port", str(port), env=env).returncode == 0,
            "the replica to be ready",
        )
        live = cli("health", "worker", "--port", str(port), "--live", env=env)
        assert live.returncode == 0 and "live" in live.stdout
        worker.send_signal(signal.SIGSTOP)
        paused = cli("health", "worker", "--port", str(port), env=env)
        assert paused.returncode == 1 and "worker not ready" in paused.stderr
        worker.send_signal(signal.SIGCONT)
        worker.kill()
        worker.wait()
    dead = cli("health", "worker", "--port", str(port), env=env)
    assert dead.returncode == 1 and "cannot connect" in dead.stderr


@pytest.mark.single_server("stops and starts its own one redis-server")
def test_replica_not_ready_without_redis(
    redis_server_factory: Callable[..., RedisServer], env: dict[str, str]
) -> None:
    """Readiness needs Redis: with its server stopped, `/readyz` says 503 naming Redis while
    the process stays live; once Redis is back, ready again."""
    server = redis_server_factory()
    port = free_port()
    own = env | {"PROMPT_BROKER_REDIS_URL": server.url, "PROMPT_BROKER_OPS_PORT": str(port)}
    with process(["worker", "--id", "r1"], own):
        eventually(
            lambda: cli("health", "worker", "--port", str(port), env=env).returncode == 0,
            "the replica to be ready",
        )
        server.stop()
        down = eventually(
            lambda: (
                (run := cli("health", "worker", "--port", str(port), env=env)).returncode == 1
                and run
            ),
            "not ready without Redis",
        )
        assert "redis" in down.stderr.lower()
        assert cli("health", "worker", "--port", str(port), "--live", env=env).returncode == 0
        server.start()
        eventually(
            lambda: cli("health", "worker", "--port", str(port), env=env).returncode == 0,
            "ready again",
        )


def test_audit_worker_health(env: dict[str, str]) -> None:
    """The audit worker's ops endpoint: ready while it runs and Redis answers; it serves the
    fleet metrics."""
    port = free_port()
    audit_env = env | {"PROMPT_BROKER_OPS_PORT": str(port), "PROMPT_BROKER_OPS_SAMPLE": "0.2"}
    with process(["audit"], audit_env):
        eventually(
            lambda: cli("health", "audit", "--port", str(port), env=env).returncode == 0,
            "the audit worker to be ready",
        )
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"prompt_broker_audit_backlog 0.0" in body
        assert b"prompt_broker_replicas_live 0.0" in body


def test_bad_ops_port_is_one_line_error(env: dict[str, str]) -> None:
    run = cli("health", "worker", env=env | {"PROMPT_BROKER_OPS_PORT": "nine"})
    assert run.returncode != 0
    assert "PROMPT_BROKER_OPS_PORT" in run.stderr and "Traceback" not in run.stderr
    run = cli("worker", env=env | {"PROMPT_BROKER_OPS_PORT": "70000"})
    assert run.returncode != 0
    assert "PROMPT_BROKER_OPS_PORT" in run.stderr and "Traceback" not in run.stderr


def test_serve_health(env: dict[str, str]) -> None:
    """`health serve` probes the HTTP server's own /readyz (and /healthz with --live)."""
    port = free_port()
    with process(["serve", "--port", str(port)], env):
        eventually(
            lambda: cli("health", "serve", "--port", str(port), env=env).returncode == 0,
            "the HTTP server to be ready",
        )
        assert cli("health", "serve", "--port", str(port), "--live", env=env).returncode == 0
    assert cli("health", "serve", "--port", str(port), env=env).returncode == 1
