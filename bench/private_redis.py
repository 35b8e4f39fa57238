"""A redis-server of the benchmark's own: measurements never share a server with anyone.

`private_redis` is a context manager for a throw-away server (no RDB, no AOF). `PrivateRedis`
is the same server as an object that a soak can kill -9 and restart on the same port and folder,
with AOF on and fsynced on every write, so that what a client was told is written survives.
Both are `workers.runtime.redis_server.RedisServer`, with the benchmark's log in the data folder
and its what-if directives.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from workers.runtime.redis_server import RedisServer, free_port

__all__ = ["PrivateRedis", "free_port", "private_redis", "server_cpu_seconds"]


class PrivateRedis(RedisServer):
    """One redis-server process on `port` with its data in `folder`, stopped only by its pid.

    `config` holds extra "name value" directives (redis.conf lines), for what-if runs."""

    def __init__(
        self,
        exe: str,
        port: int,
        folder: Path,
        *,
        aof: bool = False,
        config: Sequence[str] = (),
    ) -> None:
        extra: list[str] = []
        for directive in config:
            name, _, value = directive.strip().partition(" ")
            extra += [f"--{name}", *value.split()]
        super().__init__(
            port, folder, appendonly=aof, logfile=str(folder / "redis.log"), extra=extra, exe=exe
        )


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


def server_cpu_seconds(info: Mapping[str, object]) -> float:
    """A redis-server's CPU time so far (user and system, every thread), from `INFO cpu`."""
    return float(str(info["used_cpu_user"])) + float(str(info["used_cpu_sys"]))
