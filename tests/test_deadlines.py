"""Turn timeouts: a turn that runs too long without asking anything ends with a failure item.

Real replica processes on a real redis-server; the limit is PROMPT_BROKER_OPS_TURN_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RedisServer

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def eventually(check: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return got


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def env(redis_server_factory: Callable[..., RedisServer]) -> dict[str, str]:
    server = redis_server_factory()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    return clean | {
        "PROMPT_BROKER_REDIS_URL": server.url,
        "PROMPT_BROKER_ADOPT_INTERVAL": "0.3",
        "PROMPT_BROKER_OPS_TURN_TIMEOUT": "1.5",
    }


def thread(env: dict[str, str], tmp_path: Path, script: str) -> None:
    path = tmp_path / "script.json"
    path.write_text(script)
    made = cli("thread", "new", "t1", "--script", str(path), "--message", "go", env=env)
    assert made.returncode == 0, made.stderr


def shown(env: dict[str, str]) -> str:
    run = cli("show", "t1", env=env)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_quiet_turn_is_stopped_with_a_failure_item(env: dict[str, str], tmp_path: Path) -> None:
    thread(env, tmp_path, '{"turns": [{"steps": [{"say": "working"}, {"sleep": 30}]}]}')
    started = time.monotonic()
    with process(["worker"], env):
        out = eventually(
            lambda: "without asking anything" in (s := shown(env)) and s, "the failure item", 25
        )
        took = time.monotonic() - started
        assert "the turn failed" in out and "1.5 s" in out
        assert took < 15, took  # stopped at the timeout, not at the end of its 30 s sleep
        status = cli("thread", "status", "t1", "--json", env=env).stdout
        assert '"status": "idle"' in status


def test_waiting_on_a_person_does_not_count(env: dict[str, str], tmp_path: Path) -> None:
    """A held wait longer than the timeout, then an answer: the turn completes as scripted."""
    script = (
        '{"turns": [{"steps": [{"ask": [{"question": "Go on?", "header": "go", '
        '"options": [{"label": "yes"}, {"label": "no"}]}]}, {"sleep": 0.5}, {"say": "done"}]}]}'
    )
    thread(env, tmp_path, script)
    with process(["worker"], env):
        eventually(lambda: "Go on?" in cli("open", env=env).stdout, "the question")
        time.sleep(3)  # twice the timeout, waiting on a person
        answered = cli("answer", "t1", "yes", env=env)
        assert answered.returncode == 0, answered.stderr
        out = eventually(lambda: "done" in (s := shown(env)) and s, "the turn's end")
        assert "without asking anything" not in out
