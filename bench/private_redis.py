"""A redis-server of the benchmark's own: measurements never share a server with anyone.

`private_redis` is a context manager for a throw-away server (no RDB, no AOF). `PrivateRedis`
is the same server as an object that a soak can kill -9 and restart on the same port and folder,
with AOF on and fsynced on every write, so that what a client was told is written survives.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import redis

__all__ = ["PrivateRedis", "free_port", "private_redis"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """One redis-server process on `port` with its data in `folder`, stopped only by its pid."""

    def __init__(
        self,
        exe: str,
        port: int,
        folder: Path,
        *,
        aof: bool = False,
        config: Sequence[str] = (),
    ) -> None:
        self.exe, self.port, self.folder, self.aof = exe, port, folder, aof
        self.config = list(config)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.folder), "--save", "", "--daemonize", "no"]
        args += ["--loglevel", "warning", "--logfile", str(self.folder / "redis.log")]
        # `always`: a reply is sent only once its write is on disk, so a kill -9 loses nothing
        # any client was told had happened (`everysec` may lose the last second).
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else []
        args += [] if self.aof else ["--appendonly", "no"]
        for directive in self.config:
            name, _, value = directive.strip().partition(" ")
            args += [f"--{name}", *value.split()]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_ready(self.port, self.proc)
        return self.url

    def kill(self) -> None:
        """kill -9: the server vanishes mid-write; only the AOF keeps what it had."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None


@contextlib.contextmanager
def private_redis(exe: str, port: int, config: Sequence[str] = ()) -> Iterator[str]:
    """Start our own redis-server (no RDB, no AOF), yield its URL, stop it by its pid.

    `config` holds extra "name value" directives, for what-if runs."""
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        server = PrivateRedis(exe, port, Path(tmp), config=config)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            with redis.Redis(port=port, socket_timeout=0.5) as probe:
                probe.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError):
            # While an AOF is loaded the server answers LOADING (a BusyLoadingError, which is a
            # ConnectionError): not ready yet.
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")
