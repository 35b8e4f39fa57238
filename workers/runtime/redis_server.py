"""A private redis-server: one process of ours on a loopback port, stopped by its pid, not name.

`RedisServer` starts `redis-server` on 127.0.0.1 with its data in a folder of the caller's
(no RDB; AOF on or off), waits until it answers, and kills (-9), stops or restarts it by the pid
it started. `free_port` finds a free loopback port for one. The local fleet's own Redis
(`workers.runtime.fleet`), the tests' private servers (`tests/conftest.py`) and the benchmarks'
(`bench/private_redis.py`) are all started here.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

__all__ = ["RedisServer", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """One redis-server process on `port` with its data in `dir`: callers may kill, restart or
    pause it (`proc.pid`).

    `appendonly` turns the AOF on, fsynced as `appendfsync` says (`always`: a reply is sent only
    once its write is on disk, so a kill -9 loses nothing any client was told had happened;
    `everysec` may lose the last second). `logfile` None leaves the server's log on its stdout,
    which is discarded ("" says the same to redis-server); `loglevel` None leaves redis-server's
    own default. `extra` holds more command-line arguments, given at every start. `exe` is the
    redis-server to run (default: the one on PATH). `new_session` starts it in a session of its
    own, so a Ctrl-C at the terminal does not reach it.
    """

    port: int
    dir: Path
    appendonly: bool = True
    appendfsync: str = "always"
    logfile: str | None = None
    loglevel: str | None = "warning"
    extra: Sequence[str] = ()
    exe: str | None = None
    new_session: bool = False
    proc: subprocess.Popen[bytes] | None = field(default=None, compare=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self, *extra: str) -> list[str]:
        """The command line that starts this server."""
        exe = self.exe or shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--save", "", "--daemonize", "no"]
        args += ["--loglevel", self.loglevel] if self.loglevel is not None else []
        args += ["--logfile", self.logfile] if self.logfile is not None else []
        args += ["--appendonly", "yes" if self.appendonly else "no"]
        args += ["--appendfsync", self.appendfsync]
        return [*args, *self.extra, *extra]

    def spawn(self, *extra: str) -> subprocess.Popen[bytes]:
        """Start the process and return at once (`wait_ready` waits for it to answer)."""
        self.proc = subprocess.Popen(
            self.args(*extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=self.new_session,
        )
        return self.proc

    def start(self, *extra: str) -> str:
        """Start the process, wait until it answers, and return its URL."""
        self.spawn(*extra)
        self.wait_ready()
        return self.url

    def wait_ready(self, within: float = 10.0) -> None:
        proc = self.proc
        assert proc is not None, "start the server first"
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {proc.returncode}"
                    + self._log_tail()
                )
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as probe:
                    # Ours, not another server already on the port (ours then exits at once).
                    if int(probe.info("server")["process_id"]) == proc.pid:
                        return
                time.sleep(0.05)
            except (redis.ConnectionError, redis.TimeoutError):
                # While an AOF is loaded the server answers LOADING (a BusyLoadingError, which is
                # a ConnectionError): not ready yet.
                time.sleep(0.05)
        proc.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def _log_tail(self, lines: int = 5) -> str:
        """The last lines of the server's log file, where it has one: why it exited."""
        if not self.logfile:
            return ""
        try:
            tail = Path(self.logfile).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "; its log ends: " + " | ".join(line.strip() for line in tail) if tail else ""

    def kill(self) -> None:
        """kill -9: the server vanishes mid-write; only the AOF keeps what it had."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        """SIGTERM (redis-server writes its AOF out and exits), then SIGKILL after 10 s."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()
