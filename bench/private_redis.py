"""A redis-server of the benchmark's own: measurements never share a server with anyone."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import redis

__all__ = ["free_port", "private_redis"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def private_redis(exe: str, port: int, config: Sequence[str] = ()) -> Iterator[str]:
    """Start our own redis-server (no RDB, no AOF), yield its URL, stop it by its pid.

    `config` holds extra "name value" directives, for what-if runs."""
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        for directive in config:
            name, _, value = directive.strip().partition(" ")
            args += [f"--{name}", *value.split()]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(port, proc)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            with redis.Redis(port=port, socket_timeout=0.5) as probe:
                probe.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")
