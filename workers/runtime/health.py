"""The ops endpoint of a fleet process: `/metrics`, `/livez`, `/readyz` on its own port.

A replica and the audit worker serve it when `PROMPT_BROKER_OPS_PORT` is set (0 or unset: no
endpoint; `PROMPT_BROKER_OPS_HOST`, default 0.0.0.0, picks the interface):

- `/livez`: 200 while the process's event loop answers. A loop blocked by a bug fails it, which
  is what a liveness probe should restart.
- `/readyz`: 200 when the process can do its work: Redis answers and, for a replica, its own
  liveness record is current (it beat within one lease TTL, so the fleet counts it as live);
  503 with the reason otherwise.
- `/metrics`: the Prometheus text format (`workers.runtime.metrics`).

`prompt-broker health worker|audit` probes it from inside the container (no curl needed):
exit status 0 when ready (or live, with `--live`), 1 otherwise, with the reason on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, cast

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import BadItem, Broker, Settings
from broker._cluster import cluster_client
from broker.keys import Keys
from workers.runtime import metrics
from workers.runtime.deadlines import DEADLINE_ENV, expiring
from workers.runtime.ops_status import replica_alive

if TYPE_CHECKING:
    from workers.runtime.replica import Replica

__all__ = ["ops_port", "probe", "serve_audit_ops", "serve_ops", "serve_replica_ops"]

logger = logging.getLogger("workers.runtime.health")

Ready = Callable[[], Awaitable[str | None]]  # None when ready, else why not
PORT_ENV = "PROMPT_BROKER_OPS_PORT"
HOST_ENV = "PROMPT_BROKER_OPS_HOST"
SAMPLE_ENV = "PROMPT_BROKER_OPS_SAMPLE"
#: Seconds a turn may run without asking anything before it is stopped as failed (0: never).
DEFAULT_TURN_TIMEOUT = 1800.0
#: The port the image's healthchecks and probes use.
DEFAULT_PORT = 9464


def _env_number(name: str, default: float, *, integer: bool = False) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise BadItem(name, f"{raw!r} is not a number") from None
    if value < 0 or (integer and value > 65535):
        raise BadItem(name, f"{raw!r} is out of range")
    return value


def ops_port() -> int:
    """The ops port from the environment; 0 means none."""
    return int(_env_number(PORT_ENV, 0, integer=True))


async def _respond(writer: asyncio.StreamWriter, status: str, body: bytes, kind: str) -> None:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


def _handler(
    ready: Ready,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            writer.close()
            return
        parts = line.decode("latin-1").split()
        path = parts[1].split("?")[0] if len(parts) >= 2 else ""
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            await _respond(writer, "200 OK", generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/livez":
            await _respond(writer, "200 OK", b"live\n", text)
        elif path == "/readyz":
            try:
                why = await asyncio.wait_for(ready(), 5)
            except (TimeoutError, RedisError, OSError) as e:
                why = f"redis: {e!r}"
            if why is None:
                await _respond(writer, "200 OK", b"ready\n", text)
            else:
                await _respond(writer, "503 Service Unavailable", why.encode() + b"\n", text)
        else:
            await _respond(writer, "404 Not Found", b"not found\n", text)

    return handle


@contextlib.asynccontextmanager
async def serve_ops(ready: Ready, port: int, host: str | None = None) -> AsyncIterator[int]:
    """Serve the ops endpoint for the duration of the block; yields the port (for port 0 in
    tests: the one the system picked)."""
    metrics.count_logs()
    server = await asyncio.start_server(
        _handler(ready), host or os.environ.get(HOST_ENV, "0.0.0.0"), port
    )
    bound = server.sockets[0].getsockname()[1]
    logger.info("ops.serving", extra={"port": bound})
    try:
        yield bound
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1)


@contextlib.asynccontextmanager
async def serve_replica_ops(replica: Replica, port: int | None = None) -> AsyncIterator[int]:
    """A replica's ops endpoint (none when the port is 0). Its harnesses count their turns,
    and a turn quiet for `PROMPT_BROKER_OPS_TURN_TIMEOUT` seconds is stopped as failed."""
    metrics.instrument(
        replica.harnesses, _env_number(metrics.TURN_TIMEOUT_ENV, DEFAULT_TURN_TIMEOUT)
    )
    metrics.count_logs()
    port = ops_port() if port is None else port
    if not port:
        yield 0
        return
    broker = replica.broker

    async def ready() -> str | None:
        await broker.redis.ping()
        if not await replica_alive(broker.redis, broker.keys, replica.id, replica.ttl_ms):
            return f"replica {replica.id} has no current liveness record"
        return None

    async with serve_ops(ready, port) as bound:
        yield bound


@contextlib.asynccontextmanager
async def serve_audit_ops(settings: Settings, port: int | None = None) -> AsyncIterator[int]:
    """The audit worker's ops endpoint; it also samples the fleet metrics from Redis. With
    `PROMPT_BROKER_OPS_PROMPT_DEADLINE` set, it expires prompts past it (port or no port)."""
    metrics.count_logs()
    port = ops_port() if port is None else port
    deadline = _env_number(DEADLINE_ENV, 0)
    metrics.PROMPT_DEADLINE.set(deadline)
    if not port:
        if not deadline:
            yield 0
            return
        async with Broker.from_url(settings=settings) as broker, expiring(broker, deadline):
            yield 0
        return
    if settings.redis_cluster:  # a node of a Redis Cluster: its cluster client, as Broker.from_url
        nodes = cluster_client(settings.redis_url, decode_responses=True, socket_connect_timeout=5)
        redis = cast(Redis, nodes)
    else:
        redis = Redis.from_url(settings.redis_url, decode_responses=True, socket_connect_timeout=5)
    keys = Keys(settings.key_prefix, cluster=settings.redis_cluster, buckets=settings.index_buckets)
    interval = _env_number(SAMPLE_ENV, 15.0)
    sampler = metrics.FleetSampler(redis, keys, int(settings.lease_ttl * 1000), interval)

    async def ready() -> str | None:
        await redis.ping()
        return None

    try:
        async with (
            Broker(redis, settings) as broker,
            serve_ops(ready, port) as bound,
            metrics.sampling(sampler),
            expiring(broker, deadline),
        ):
            yield bound
    finally:
        await redis.aclose()


async def probe(port: int, path: str = "/readyz", host: str = "127.0.0.1") -> tuple[int, str]:
    """GET `path` from an ops endpoint: (HTTP status, body). Status 0 when it cannot connect."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except (OSError, TimeoutError) as e:
        return 0, f"cannot connect to {host}:{port}: {e}"
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    except (OSError, TimeoutError) as e:
        return 0, f"no answer from {host}:{port}: {e!r}"
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    try:
        return int(parts[1]), body.decode(errors="replace").strip()
    except (IndexError, ValueError):
        return 0, "not an HTTP answer"
