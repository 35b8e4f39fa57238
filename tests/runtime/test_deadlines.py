"""Turn timeouts: a turn that runs too long without asking anything ends with a failure item.

Real replica processes on a real redis-server of the test's own, and on the session's Redis
Cluster; the limit is PROMPT_BROKER_OPS_TURN_TIMEOUT.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import cli, eventually, fleet_env, process

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]


@pytest.fixture
def env(fleet_redis: tuple[str, dict[str, str]]) -> dict[str, str]:
    """A private server of the test's own, or the session's cluster (`where` in conftest.py)."""
    url, chosen = fleet_redis
    return fleet_env(url, **chosen, ADOPT_INTERVAL="0.3", OPS_TURN_TIMEOUT="1.5")


PICK = (
    '{"turns": [{"steps": [{"ask": [{"question": "Pick one", "header": "pick", '
    '"options": [{"label": "A"}, {"label": "B"}]}]}, {"say": "after the question"}]}]}'
)


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


@pytest.mark.single_server("reads one server's keys (pp:open, pp:events ...) with a plain client")
def test_prompt_past_its_deadline_expires_once_never_approved(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Two audit workers expire a held prompt past PROMPT_BROKER_OPS_PROMPT_DEADLINE: it is
    cancelled with reason expired (never answered), once, and its agent is told; an audit worker
    started after the deadline passed while none ran expires it at its first look."""
    import redis

    deadline = {"PROMPT_BROKER_OPS_PROMPT_DEADLINE": "2", "PROMPT_BROKER_OPS_TURN_TIMEOUT": "0"}
    r = redis.Redis.from_url(env["PROMPT_BROKER_REDIS_URL"], decode_responses=True)
    with process(["worker"], env):
        thread(env, tmp_path, PICK)  # one question, held
        eventually(lambda: "Pick one" in cli("open", env=env).stdout, "the question")
        [member] = r.zrange("pp:open", 0, -1)
        prompt_key = "pp:{t1}:prompt:" + member.split("/")[1]
        time.sleep(3)  # past the deadline with no expirer running: nothing happens by itself
        assert r.hget(prompt_key, "state") == "pending"
        with process(["audit"], env | deadline), process(["audit"], env | deadline):
            eventually(lambda: r.hget(prompt_key, "state") == "cancelled", "the expiry", 20)
            assert r.hget(prompt_key, "reason") == "expired"
            assert r.hget(prompt_key, "answers") is None
            time.sleep(1.5)  # both expirers look again: nothing more happens
        events = [f for _, f in r.xrange("pp:events") if f["prompt"] == member.split("/")[1]]
        assert [e["event"] for e in events] == ["prompt.opened", "prompt.cancelled"]
        out = eventually(lambda: "expired" in (s := shown(env)) and s, "the agent told")
        assert "approved" not in out.lower().replace("not approved", "")


@pytest.mark.single_server("reads one server's keys (pp:open, pp:events ...) with a plain client")
def test_a_new_prompt_gets_its_full_time(env: dict[str, str], tmp_path: Path) -> None:
    """With the expirer running, a prompt is not expired before its deadline."""
    import redis

    deadline = {"PROMPT_BROKER_OPS_PROMPT_DEADLINE": "4"}
    r = redis.Redis.from_url(env["PROMPT_BROKER_REDIS_URL"], decode_responses=True)
    with process(["worker"], env), process(["audit"], env | deadline):
        thread(env, tmp_path, PICK)
        eventually(lambda: "Pick one" in cli("open", env=env).stdout, "the question")
        [member] = r.zrange("pp:open", 0, -1)
        prompt_key = "pp:{t1}:prompt:" + member.split("/")[1]
        created = int(r.hget(prompt_key, "created") or 0)
        eventually(lambda: r.hget(prompt_key, "state") == "cancelled", "the expiry", 20)
        resolved = int(r.hget(prompt_key, "resolved") or 0)
        assert 4000 <= resolved - created < 4000 + 3000, resolved - created
