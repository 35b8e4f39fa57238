"""Entry points for the processes of a fleet: one replica, the audit worker."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping

from redis.asyncio import BlockingConnectionPool, Redis

from broker import Broker, Settings
from workers.agents.harness import Harness
from workers.runtime.health import serve_replica_ops
from workers.runtime.replica import Replica

logger = logging.getLogger("workers.runtime.run")

__all__ = ["replica_broker", "run_replica"]


def replica_broker(settings: Settings) -> Broker:
    """A Broker for a replica: a bounded pool (`redis_connections`) plus one pub/sub connection.

    The pub/sub connection has a pool of its own: taken from the command pool, it would leave
    `redis_connections - 1` for commands (and with 1, none: every command would wait forever).
    On a Redis Cluster (`redis_cluster`): redis-py's cluster client, a pool per node (not bounded:
    past a bound it raises instead of waiting), the bells on sharded pub/sub connections of
    their own (one per primary, broker/_sharded.py).
    """
    if settings.redis_cluster:
        return Broker.from_url(settings=settings, socket_connect_timeout=5, socket_keepalive=True)

    def pool(size: int) -> BlockingConnectionPool:
        return BlockingConnectionPool.from_url(
            settings.redis_url,
            max_connections=size,
            timeout=None,
            decode_responses=True,
            socket_connect_timeout=5,
            socket_keepalive=True,
        )

    return Broker(
        Redis(connection_pool=pool(settings.redis_connections)),
        settings,
        owns_client=True,
        pubsub=Redis(connection_pool=pool(1)),
    )


async def run_replica(
    settings: Settings,
    harnesses: Mapping[str, Harness] | None = None,
    replica_id: str | None = None,
) -> None:
    """Run one replica until SIGTERM or SIGINT, then stop cleanly (a second signal: at once)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("replica.killed", extra={"signal": sig.name})
            raise SystemExit(1)
        logger.info("replica.stopping", extra={"signal": sig.name})
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    async with replica_broker(settings) as broker:
        replica = Replica(broker, harnesses, replica_id)
        # ops: /metrics, /livez, /readyz on PROMPT_BROKER_OPS_PORT (workers.runtime.health)
        async with serve_replica_ops(replica):
            await replica.run(stop)
