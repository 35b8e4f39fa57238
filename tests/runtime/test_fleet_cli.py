"""The runtime's command line, run as real processes: threads, `up`, the demo on a fleet."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from tests.conftest import RedisServer, free_port
from tests.helpers import cli, fleet_env

pytestmark = pytest.mark.real_redis


@pytest.fixture
def env(redis_server_factory: object) -> dict[str, str]:
    server: RedisServer = redis_server_factory()  # type: ignore[operator]
    return fleet_env(server.url)


def test_thread_new_and_status(env: dict[str, str], tmp_path: Path) -> None:
    """`thread new` creates a session from a script file; `thread status` shows it."""
    script = tmp_path / "s.json"
    script.write_text('{"turns": [{"steps": [{"say": "hello"}]}]}')
    made = cli("thread", "new", "t1", "--script", str(script), env=env)
    assert made.returncode == 0, made.stderr
    assert "t1: scripted agent, approval" in made.stdout
    status = cli("thread", "status", "t1", "--json", env=env)
    assert '"status": "idle"' in status.stdout and '"owner": ""' in status.stdout
    human = cli("thread", "status", "t1", env=env)
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines()[:2] == [
        "thread t1: scripted agent, approval, idle",
        "  held by:       no replica (the next adoption sweep gives it one)",
    ]
    assert "  waiting on:    nothing\n" in human.stdout


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
    assert again.returncode == 2
    assert again.stderr == "prompt-broker: error: THREAD: thread t1 already exists\n"
    assert '"permissions": "approval"' in cli("thread", "status", "t1", "--json", env=env).stdout


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


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("prompt-broker: error: ") and "Traceback" not in err, err
    return lines[0]


def keys(url: str) -> list[str]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return sorted(client.keys("*"))
    finally:
        client.close()


def test_thread_close_unknown_is_an_error_and_writes_nothing(env: dict[str, str]) -> None:
    """`thread close nosuch`: one line, exit 2, no key written; `status` of it is a clean
    error too, and `thread new nosuch` still works afterwards."""
    before = keys(env["PROMPT_BROKER_REDIS_URL"])
    closed = cli("thread", "close", "nosuch", env=env)
    assert closed.returncode == 2
    assert one_error_line(closed.stderr).startswith(
        "prompt-broker: error: THREAD: no thread nosuch"
    )
    assert keys(env["PROMPT_BROKER_REDIS_URL"]) == before
    status = cli("thread", "status", "nosuch", env=env)
    assert status.returncode == 2
    assert one_error_line(status.stderr).startswith("prompt-broker: error: THREAD: no thread")
    assert cli("thread", "new", "nosuch", env=env).returncode == 0
    assert cli("thread", "close", "nosuch", env=env).stdout == "thread nosuch closed\n"
    assert cli("thread", "close", "nosuch", env=env).stdout == "thread nosuch was already closed\n"
    assert '"status": "closed"' in cli("thread", "status", "nosuch", "--json", env=env).stdout


def test_thread_actions_take_redis_url(env: dict[str, str]) -> None:
    """`thread new|close|status` take --redis-url after the action, as every command does."""
    url = env["PROMPT_BROKER_REDIS_URL"]
    bare = {k: v for k, v in env.items() if k != "PROMPT_BROKER_REDIS_URL"}
    assert cli("thread", "new", "t1", "--redis-url", url, env=bare).returncode == 0
    status = cli("thread", "status", "t1", "--redis-url", url, env=bare)
    assert status.returncode == 0 and status.stdout.startswith("thread t1: scripted agent")
    assert cli("thread", "close", "t1", "--redis-url", url, env=bare).returncode == 0


def test_thread_new_harness_lists_choices(env: dict[str, str]) -> None:
    """A wrong --harness is refused by name, listing the choices."""
    made = cli("thread", "new", "t1", "--harness", "clade", env=env)
    assert made.returncode == 2
    assert "invalid choice: 'clade' (choose from" in made.stderr
    assert all(name in made.stderr for name in ("scripted", "claude_code", "codex"))


# -- `up`: its own Redis keeps its data; its failures leave nothing behind -------------------------


def children_of(pid: int) -> list[int]:
    """The processes a fleet started: they carry `--parent PID`, or are its children."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid or any(
            a == b"--parent" and b == str(pid).encode() for a, b in itertools.pairwise(argv)
        ):
            found.append(int(entry.name))
    return found


def server_on(port: int) -> list[int]:
    """redis-server processes on `port`, by their command line (which redis-server rewrites to
    `redis-server 127.0.0.1:PORT` once it runs)."""
    hits = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            words = line.split()
            if (
                words
                and words[0].endswith("redis-server")
                and (f"127.0.0.1:{port}" in words or str(port) in words)
            ):
                hits.append(int(entry.name))
    return hits


@dataclass
class Up:
    """A `prompt-broker up` in a session of its own, as a terminal runs it."""

    proc: subprocess.Popen[str]
    out: Path

    def banner(self, within: float = 60) -> str:
        deadline = time.monotonic() + within
        while "Ctrl-C stops the fleet" not in self.out.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"up did not come up:\n{self.out.read_text()}")
            time.sleep(0.1)
        return self.out.read_text()

    def ctrl_c(self, within: float = 60) -> int:
        """SIGINT to the whole process group, as Ctrl-C at a terminal sends it."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(within)


def start_up(env: dict[str, str], out: Path, *args: str) -> Up:
    sink = out.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.runtime.cli", "up", "--workers", "2", *args],
        cwd=out.parent,  # the test's folder: the `home` fixture cleans up by it
        env=env,
        stdout=sink,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return Up(proc, out)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment with no Redis given and a data home of this test's own. Afterwards, a
    test that failed half-way leaves nothing running: every process working in its folder
    (a fleet's redis-server, a fleet's processes) is killed, by pid."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    yield clean | {"XDG_DATA_HOME": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "cwd").startswith(str(tmp_path)):
                    os.kill(int(entry.name), signal.SIGKILL)


def until(check: Callable[[], object], what: str, within: float = 30) -> Any:
    deadline = time.monotonic() + within
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return found


@pytest.mark.slow
def test_up_keeps_open_prompts_across_ctrl_c(home: dict[str, str], tmp_path: Path) -> None:
    """`up` with no Redis given: Ctrl-C, `up` again: the same address, the thread and its open
    prompt are still there, the CLI finds the fleet by itself, and the prompt can be answered."""
    first = start_up(home, tmp_path / "up1.out")
    banner = first.banner()
    assert "a private redis-server (AOF on, data in" in banner
    assert "are kept in" in banner
    record = Path(home["XDG_DATA_HOME"]) / "prompt-broker" / "fleet.json"
    url = orjson.loads(record.read_bytes())["url"]
    assert cli("thread", "new", "t1", "--message", "hello", env=home).returncode == 0
    opened = until(lambda: "Pick one" in (r := cli("open", env=home)).stdout and r, "a prompt")
    assert f"using the local fleet's Redis at {url}" in opened.stderr
    prompt_id = opened.stdout.split()[2]
    children = children_of(first.proc.pid)
    assert first.ctrl_c() == 0
    assert [p for p in children if Path(f"/proc/{p}").exists()] == []
    assert server_on(int(url.rsplit(":", 1)[1].split("/")[0])) == []

    second = start_up(home, tmp_path / "up2.out")
    second.banner()
    try:
        assert orjson.loads(record.read_bytes())["url"] == url  # the same address
        opened = cli("open", env=home)
        assert prompt_id in opened.stdout, opened.stdout + opened.stderr
        answered = cli("answer", "t1", "2", env=home)
        assert answered.stdout.startswith(f"answered {prompt_id} on thread t1"), answered
    finally:
        assert second.ctrl_c() == 0


@pytest.mark.slow
def test_up_killed_leaves_no_replica_and_its_redis_is_taken_back(
    home: dict[str, str], tmp_path: Path
) -> None:
    """kill -9 of `up`: its replicas and audit worker stop with it; the next `up` takes back
    the redis-server left running on the data folder (never a second one on the same AOF)."""
    first = start_up(home, tmp_path / "up1.out")
    first.banner()
    url = orjson.loads((Path(home["XDG_DATA_HOME"]) / "prompt-broker/fleet.json").read_bytes())
    port = int(url["url"].rsplit(":", 1)[1].split("/")[0])
    assert cli("thread", "new", "t1", "--message", "hello", env=home).returncode == 0
    until(lambda: "Pick one" in cli("open", env=home).stdout, "a prompt")
    workers = [p for p in children_of(first.proc.pid) if p not in server_on(port)]
    assert len(workers) == 3
    first.proc.kill()
    first.proc.wait(10)
    until(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), "the orphans to stop")
    (left,) = server_on(port)
    second = start_up(home, tmp_path / "up2.out")
    try:
        assert "left running by an earlier fleet" in second.banner()
        assert server_on(port) == [left]
        assert "Pick one" in cli("open", env=home).stdout
    finally:
        assert second.ctrl_c() == 0
    until(lambda: server_on(port) == [], "the redis-server to stop")


def test_up_unreachable_redis_one_line_nothing_left(tmp_path: Path) -> None:
    """`up` against a Redis that is not there: one error line, exit 2, no process left."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    url = f"redis://127.0.0.1:{free_port()}/0"
    up = start_up(clean | {"PROMPT_BROKER_REDIS_URL": url}, tmp_path / "up.out")
    assert up.proc.wait(60) == 2
    errors = [line for line in up.out.read_text().splitlines() if '"level":"' not in line]
    assert len(errors) == 1, up.out.read_text()
    assert errors[0].startswith(f"prompt-broker: error: cannot reach Redis at {url}")
    assert "Traceback" not in up.out.read_text()
    assert children_of(up.proc.pid) == []


def test_up_unusable_data_folder_one_line(home: dict[str, str], tmp_path: Path) -> None:
    """A data folder that cannot be made (a file is in the way): one line, exit 2."""
    blocker = tmp_path / "data"
    blocker.write_text("not a folder")
    up = start_up(home, tmp_path / "up.out")
    assert up.proc.wait(60) == 2
    text = up.out.read_text()
    assert "prompt-broker: error: cannot use the data folder" in text and "Traceback" not in text
    assert children_of(up.proc.pid) == []


@pytest.mark.slow
def test_second_up_on_one_folder_refused(home: dict[str, str], tmp_path: Path) -> None:
    """Two fleets on one data folder would run two servers on one AOF: the second is refused."""
    first = start_up(home, tmp_path / "up1.out")
    first.banner()
    try:
        second = start_up(home, tmp_path / "up2.out")
        assert second.proc.wait(60) == 2
        assert "another `prompt-broker up` is running on the data folder" in second.out.read_text()
        assert first.proc.poll() is None
    finally:
        assert first.ctrl_c() == 0


@pytest.mark.slow
def test_up_embedded_fakeredis_says_it_keeps_nothing(home: dict[str, str], tmp_path: Path) -> None:
    """No redis-server on PATH: the fleet runs on fakeredis and says plainly it keeps nothing."""
    up = start_up(home | {"PATH": str(tmp_path)}, tmp_path / "up.out")
    banner = up.banner()
    assert up.ctrl_c() == 0
    assert "an embedded fakeredis server" in banner and "It keeps NOTHING" in banner
    assert "LOSES every thread and open prompt" in banner
    assert "(prompts stay open in Redis)" not in banner


def test_ups_status_line_counts_in_words() -> None:
    """`up`'s status line says 1 thread and 1 prompt, not 1 threads and 1 prompts."""
    from workers.runtime.cli.up import status_line

    assert status_line(4, 1, 1) == "4 processes up, 1 thread, 1 prompt waiting on a person"
    assert status_line(1, 0, 2) == "1 process up, 0 threads, 2 prompts waiting on a person"
