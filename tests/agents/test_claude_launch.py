"""The Claude Code CLI's supervisor (`workers.agents.claude_launch`), with a shell script as the
"CLI".

Real processes throughout: the script starts a command in a session of its own (`setsid`), as
Claude Code starts every Bash command, so killing the CLI alone would leave it running. Every
process a test starts carries a unique environment marker, so the test finds them wherever they
were re-parented. (The real CLI under a real replica killed with SIGKILL is in
tests/agents/test_claude.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from workers.agents import claude_launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

LAUNCH = [sys.executable, "-I", "-S", claude_launch.__file__]


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark`."""
    needle = f"PB_TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if state != "Z" and needle in environ:
            found.append(int(entry))
    return found


def wait_for(check: object, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def cli_script(tmp_path: Path, body: str = "") -> Path:
    """A stand-in CLI: starts `sleep 60` in its own session and another in its own, runs
    `body`, writes `started`, then waits."""
    script = tmp_path / "cli.sh"
    started = tmp_path / "started"
    script.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            setsid sleep 60 &
            sleep 60 &
            {body}
            touch {started}
            wait
            """)
    )
    script.chmod(0o755)
    return script


def launch(script: Path, mark: str, *, parent: int | None = None) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PB_TEST_MARK": mark,
        claude_launch.PARENT_ENV: str(os.getpid() if parent is None else parent),
    }
    return subprocess.Popen([*LAUNCH, str(script)], env=env)


def test_killing_the_tree_takes_commands_in_their_own_session(tmp_path: Path) -> None:
    """`KILL_TREE` (what the harness sends) kills the CLI and the command it started in a
    session of its own; nothing is left."""
    mark = uuid.uuid4().hex
    proc = launch(cli_script(tmp_path), mark)
    wait_for((tmp_path / "started").exists, "the CLI to start")
    # Supervisor, shell, two sleeps. Waited for, not looked at once: a sleep still in its exec
    # shows an empty environment for a moment (seen once in a full run: 3 of the 4).
    wait_for(lambda: len(marked(mark)) >= 4, "the CLI's four processes")
    proc.send_signal(claude_launch.KILL_TREE)
    assert proc.wait(5) == 137
    assert marked(mark) == []


def test_the_replica_dying_kills_everything_it_started(tmp_path: Path) -> None:
    """A "replica" process starts the supervised CLI and is SIGKILLed: one second later no
    process it started is alive (the parent-death signal)."""
    mark = uuid.uuid4().hex
    script = cli_script(tmp_path)
    replica = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            f"env = {{**os.environ, {claude_launch.PARENT_ENV!r}: str(os.getpid())}}\n"
            f"subprocess.Popen({[*LAUNCH, str(script)]!r}, env=env)\n"
            "time.sleep(60)\n",
        ],
        env={**os.environ, "PB_TEST_MARK": mark},
    )
    wait_for((tmp_path / "started").exists, "the CLI to start")
    wait_for(lambda: len(marked(mark)) >= 5, "the replica and the CLI's four processes")
    replica.kill()
    replica.wait(5)
    time.sleep(1.0)
    assert marked(mark) == []


def test_a_thread_of_the_replica_exiting_is_not_its_death(tmp_path: Path) -> None:
    """Linux sends the parent-death signal when the *thread* that forked exits: a CLI started
    from a thread that then ends keeps running while the replica lives."""
    mark = uuid.uuid4().hex
    started: list[subprocess.Popen[bytes]] = []

    def start_then_exit() -> None:  # the thread outlives the arming of the signal, then ends
        started.append(launch(cli_script(tmp_path), mark))
        wait_for((tmp_path / "started").exists, "the CLI to start")

    thread = threading.Thread(target=start_then_exit)
    thread.start()
    thread.join()
    (proc,) = started
    wait_for(lambda: len(marked(mark)) >= 4, "the CLI to keep marking after its thread ended")
    assert proc.poll() is None
    proc.send_signal(claude_launch.KILL_TREE)
    assert proc.wait(5) == 137
    assert marked(mark) == []


def test_sigterm_reaches_the_cli_and_its_leftovers_are_killed(tmp_path: Path) -> None:
    """SIGTERM (the SDK's stop) is passed to the CLI, which exits its own way; the supervisor
    then kills what it left behind and exits with the CLI's status."""
    mark = uuid.uuid4().hex
    got = tmp_path / "got-term"
    proc = launch(cli_script(tmp_path, f"trap 'touch {got}; exit 3' TERM"), mark)
    wait_for((tmp_path / "started").exists, "the CLI to start")
    proc.terminate()
    assert proc.wait(5) == 3
    assert got.exists()
    assert marked(mark) == []


def test_exit_status_and_an_already_dead_parent(tmp_path: Path) -> None:
    """The CLI's exit status passes through; if the replica died before the supervisor armed
    its signal (its parent is not the pid it was given), the CLI is never started."""
    script = tmp_path / "exit7.sh"
    ran = tmp_path / "ran"
    script.write_text(f"#!/bin/sh\ntouch {ran}\nexit 7\n")
    script.chmod(0o755)
    assert launch(script, uuid.uuid4().hex).wait(5) == 7
    ran.unlink()
    assert launch(script, uuid.uuid4().hex, parent=os.getpid() + 1_000_000).wait(5) == 137
    assert not ran.exists()


def test_started_by_hand_with_no_parent_variable(tmp_path: Path) -> None:
    """Without the variable (started by hand), the supervisor takes its parent as the replica."""
    script = tmp_path / "ok.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != claude_launch.PARENT_ENV}
    done = subprocess.run([*LAUNCH, str(script)], check=False, env=env, timeout=10)
    assert done.returncode == 0
