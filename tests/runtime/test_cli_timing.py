"""`thread timing` and `thread new --remind/--escalate/--deadline` from a shell, and what
`show` and `open` say of a running turn: real processes on a real redis-server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis

from tests.conftest import RedisServer
from tests.helpers import cli, eventually, fleet_env, process

pytestmark = [pytest.mark.real_redis]

PICK = (
    '{"turns": [{"steps": [{"say": "thinking"}, {"sleep": 4}, {"ask": [{"question": "Pick one", '
    '"header": "pick", "options": [{"label": "A"}, {"label": "B"}]}]}]}]}'
)


@pytest.fixture
def env(redis_server_factory: Callable[..., RedisServer]) -> dict[str, str]:
    return fleet_env(redis_server_factory().url, ADOPT_INTERVAL="0.3")


def test_set_show_and_clear_a_threads_timing(env: dict[str, str]) -> None:
    made = cli(
        "thread", "new", "t1", "--remind", "15m,45m", "--escalate", "30m:oncall",
        "--deadline", "1h", env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "timing: remind at 15m, 45m; escalate to oncall at 30m; expire at 1h" in made.stdout
    shown = cli("thread", "timing", "t1", "--json", env=env)
    assert orjson.loads(shown.stdout)["timing"] == {
        "deadline": 3600.0, "remind": [900.0, 2700.0], "escalate": 1800.0, "escalate_to": "oncall",
    }  # fmt: skip
    changed = cli("thread", "timing", "t1", "--deadline", "2d", env=env)
    assert changed.returncode == 0 and "thread t1: expire at 2d" in changed.stdout  # replaced
    cleared = cli("thread", "timing", "t1", "--clear", env=env)
    assert "no timing: its prompts wait as long as it takes" in cleared.stdout
    assert redis.Redis.from_url(env["PROMPT_BROKER_REDIS_URL"]).exists("pp:{t1}:timing") == 0


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--deadline", "soon"], "--deadline: expected a duration"),
        (["--remind", "5m,1h30m"], "--remind: expected a duration"),
        (["--escalate", "30m"], "--escalate: expected AGE:GROUP"),
        (["--escalate", "30m:on call"], "timing.escalate_to"),
        (["--deadline", "10m", "--remind", "20m"], "before the deadline"),
        (["--deadline", "500d"], "at most 366 days"),
    ],
)
def test_bad_timing_is_one_clear_line_and_writes_nothing(
    env: dict[str, str], flags: list[str], says: str
) -> None:
    run = cli("thread", "new", "t1", *flags, env=env)
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert redis.Redis.from_url(env["PROMPT_BROKER_REDIS_URL"]).keys("pp:*") == []


def test_timing_of_an_unknown_thread_or_a_settled_prompt_is_refused(env: dict[str, str]) -> None:
    run = cli("thread", "timing", "nope", "--deadline", "1h", env=env)
    assert run.returncode == 2 and "no thread nope" in run.stderr
    assert cli("thread", "new", "t1", env=env).returncode == 0
    run = cli("thread", "timing", "t1", "--prompt", "prm_01M8RX58TH2FTWCNBF4X98BGAQ",
              "--deadline", "5m", env=env)  # fmt: skip
    assert run.returncode == 2 and "no prompt prm_01M8RX58TH2FTWCNBF4X98BGAQ" in run.stderr
    run = cli("thread", "timing", "t1", "--clear", "--deadline", "5m", env=env)
    assert run.returncode == 2 and "--clear" in run.stderr


@pytest.mark.slow
def test_show_and_open_say_a_turn_is_running(env: dict[str, str], tmp_path: Path) -> None:
    """A turn at work (no prompt yet) shows as running in `show` and `open`; once it asks, `show`
    says what it waits on."""
    script = tmp_path / "script.json"
    script.write_text(PICK)
    with process(["worker", "--id", "r1"], env):
        made = cli("thread", "new", "t1", "--script", str(script), "--message", "go", env=env)
        assert made.returncode == 0, made.stderr
        out = eventually(
            lambda: "thinking" in (s := cli("show", "t1", env=env).stdout) and s, "the turn"
        )
        assert "agent: scripted, a turn is running on r1" in out
        listed = cli("open", env=env).stdout
        assert "nothing is waiting on a person" in listed
        assert "turns running (no prompt yet): t1 (r1)" in listed
        asked = eventually(
            lambda: "waits on prm_" in (s := cli("show", "t1", env=env).stdout) and s, "the ask", 30
        )
        assert "agent: scripted, its turn on r1 waits on prm_" in asked
        assert "turns running" not in cli("open", env=env).stdout
        document = orjson.loads(cli("show", "t1", "--json", env=env).stdout)
        assert document["session"] == {"status": "running", "owner": "r1"}


def test_show_of_a_thread_whose_session_record_is_damaged_still_shows_it(
    env: dict[str, str],
) -> None:
    assert cli("thread", "new", "t1", "--message", "hello", env=env).returncode == 0
    redis.Redis.from_url(env["PROMPT_BROKER_REDIS_URL"]).hset("pp:{t1}:session", "status", "bogus")
    shown = cli("show", "t1", env=env)
    assert shown.returncode == 0 and "hello" in shown.stdout and "Traceback" not in shown.stderr
    assert "agent:" not in shown.stdout  # `thread status` is where the damage is reported
    status = cli("thread", "status", "t1", env=env)
    assert status.returncode == 2 and "damaged" in status.stderr
