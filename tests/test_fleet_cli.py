"""The runtime's command line, run as real processes: threads, the demo on a fleet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RedisServer

pytestmark = pytest.mark.real_redis


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def env(redis_server_factory: object) -> dict[str, str]:
    server: RedisServer = redis_server_factory()  # type: ignore[operator]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    return clean | {"PROMPT_BROKER_REDIS_URL": server.url}


def test_thread_new_and_status(env: dict[str, str], tmp_path: Path) -> None:
    """`thread new` creates a session from a script file; `thread status` shows it."""
    script = tmp_path / "s.json"
    script.write_text('{"turns": [{"steps": [{"say": "hello"}]}]}')
    made = cli("thread", "new", "t1", "--script", str(script), env=env)
    assert made.returncode == 0, made.stderr
    assert "t1: scripted agent, approval" in made.stdout
    status = cli("thread", "status", "t1", env=env)
    assert '"status": "idle"' in status.stdout and '"owner": ""' in status.stdout


def test_thread_new_bad_script_one_line_error(env: dict[str, str], tmp_path: Path) -> None:
    """A script with a misspelt step is refused in one line naming the field, exit 2."""
    script = tmp_path / "s.json"
    script.write_text('{"turns": [{"steps": [{"sai": "hello"}]}]}')
    made = cli("thread", "new", "t1", "--script", str(script), env=env)
    assert made.returncode == 2
    assert made.stderr.startswith("prompt-broker: error: config.script.turns[0].steps[0]")
    assert "Traceback" not in made.stderr and made.stderr.count("\n") == 1


def test_thread_new_twice_refused(env: dict[str, str]) -> None:
    """Creating a thread that exists is refused, and the first one is kept."""
    assert cli("thread", "new", "t1", env=env).returncode == 0
    again = cli("thread", "new", "t1", "--permissions", "autonomous", env=env)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert '"permissions": "approval"' in cli("thread", "status", "t1", env=env).stdout


def test_demo_passes_on_its_own_redis() -> None:
    """`prompt-broker demo` with no Redis given: own redis-server, a replica killed, verdict OK."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    run = cli("demo", "--workers", "2", env=clean, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "on a private redis-server" in run.stdout
    assert "demo: OK: 8 threads, 8 prompts" in run.stdout


def test_demo_falls_back_to_embedded_fakeredis(tmp_path: Path) -> None:
    """With no redis-server on PATH, the fleet runs on an embedded fakeredis server, and says so."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    run = cli("demo", "--workers", "2", env=clean | {"PATH": str(tmp_path)}, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "on an embedded fakeredis server" in run.stdout
    assert "demo: OK: 8 threads, 8 prompts" in run.stdout
