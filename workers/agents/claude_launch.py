"""Run the Claude Code CLI so that it, and everything it starts, dies with the replica.

`python -I -S claude_launch.py <real claude> <args...>` (the harness writes a small executable
wrapper that runs this, and hands it to the SDK as `cli_path`). Standard library only, so it
starts in a few milliseconds with no site packages. Linux only (it uses `prctl`).

Why a supervisor, and not only a parent-death signal on the CLI: Claude Code starts every Bash
command in a session of its own (`setsid`), so killing the CLI, or its process group, leaves the
command running. This process stays between the replica and the CLI:

- It is a *child subreaper* (`PR_SET_CHILD_SUBREAPER`): whatever the CLI starts, at any depth and
  in any session, is re-parented to it when its own parent dies, so it can always find and kill
  the whole tree (a walk of `/proc` by parent pid).
- It gets a *parent-death signal* (`PR_SET_PDEATHSIG`, `DEATH`) when the replica dies, however it
  dies (SIGKILL included: the kernel sends it). Linux sends that signal when the *thread* that
  forked this process exits, not the process: the replica forks from its event-loop thread (the
  SDK's `anyio.open_process`), which lives as long as the replica, but to be safe a signal that
  arrives while `getppid()` is still the replica's pid (a thread exited, the replica lives) is
  ignored; the kernel sends it again at the next re-parenting, and the last one comes when the
  process is gone. If the replica died before the signal was armed (between fork and `prctl`),
  `getppid()` is already another pid and it exits at once without starting the CLI.
- The CLI child gets a parent-death signal too (SIGKILL, bound to this single-threaded process),
  so it dies even if this process is SIGKILLed.

Signals it takes: `KILL_TREE` (the harness: kill everything now), SIGTERM/SIGINT/SIGHUP (passed
to the CLI, which shuts down gracefully; the tree is killed if it has not within
`TERM_GRACE`). When the CLI exits, whatever it left running is killed, then this process exits
with the CLI's status (128 + signal when it was killed).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

#: The replica's pid, set by the harness in the CLI's environment (and removed before the CLI).
PARENT_ENV = "PB_CLAUDE_PARENT"
#: Sent by the kernel when the replica (the thread that started us) is gone.
DEATH = signal.SIGUSR2
#: Sent by the harness: stop the CLI and everything it started, at once.
KILL_TREE = signal.SIGUSR1
#: How long the CLI gets to exit after SIGTERM before its tree is killed.
TERM_GRACE = 3.0

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_WATCHED = {signal.SIGCHLD, DEATH, KILL_TREE, *_FORWARD}


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _signal(pid: int, sig: int) -> None:
    # (not contextlib.suppress: importing contextlib costs this start-up ~7 ms)
    try:  # noqa: SIM105
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def descendants(root: int) -> list[int]:
    """Every live process below `root`, parents before children (a /proc walk by ppid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def _reap() -> list[tuple[int, int]]:
    """Reap every child that has exited: (pid, wait status) pairs."""
    done: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def kill_tree() -> None:
    """SIGKILL everything below this process until nothing is left (orphans come to us)."""
    me = os.getpid()
    while True:
        live = descendants(me)
        for pid in live:
            _signal(pid, signal.SIGKILL)
        _reap()
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            if not live:
                return
        time.sleep(0.005)


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _start(argv: list[str]) -> int:
    """Fork the CLI: its own parent-death signal, a clean signal mask, then exec."""
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != me:  # we died between the fork and the prctl
                os._exit(137)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.execv(argv[0], argv)
        except OSError as e:
            os.write(2, f"claude_launch: cannot run {argv[0]}: {e}\n".encode())
        os._exit(127)
    # The pipes to the SDK are the CLI's alone: its exit closes them (EOF) even while this
    # process is still killing what the CLI left behind.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    return pid


def _wait(deadline: float | None) -> int | None:
    """The next watched signal; None when `deadline` passed first."""
    if deadline is None:
        return signal.sigwaitinfo(_WATCHED).si_signo
    info = signal.sigtimedwait(_WATCHED, max(0.0, deadline - time.monotonic()))
    return None if info is None else info.si_signo


def supervise(argv: list[str]) -> int:
    raw = os.environ.pop(PARENT_ENV, "")
    parent = int(raw) if raw.isdigit() else os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)  # taken with sigwaitinfo below
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, DEATH)
    if os.getppid() != parent:
        return 137  # the replica is already gone: start nothing
    cli = _start(argv)
    deadline: float | None = None
    while True:
        sig = _wait(deadline)
        if sig == signal.SIGCHLD:
            status = dict(_reap()).get(cli)
            if status is not None:
                kill_tree()  # whatever the CLI left running
                return _exit_code(status)
        elif sig in _FORWARD:
            _signal(cli, sig)
            deadline = deadline or time.monotonic() + TERM_GRACE
        elif sig != DEATH or os.getppid() != parent:
            # KILL_TREE, the replica's death, or the CLI ignored SIGTERM for TERM_GRACE
            kill_tree()
            return 137


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.stderr.write("usage: claude_launch.py <claude> [args...]\n")
        sys.exit(2)
    sys.exit(supervise(sys.argv[1:]))
