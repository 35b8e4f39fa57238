"""A Redis Cluster URL may name several nodes, so a process finds the cluster while one is down.

    redis://[user:password@]host1:port1,host2:port2,host3:port3[/0]

Every node named is a seed: the client asks the first that answers for the slot map and then
knows them all. Credentials and options come from the URL and apply to every node. A URL naming
one node is an ordinary Redis URL (and the only form a single server takes).

The client made here raises a RedisError when it cannot read the slot map (no node answers, or
the nodes leave slots uncovered): redis-py raises its RedisClusterException, which is not one,
so every handler written for an outage on one server (`except RedisError`) would miss it and a
background loop would die of it. Its other RedisClusterExceptions (a mistake in a call, such as
keys of two slots) stay as they are.
"""

from __future__ import annotations

import urllib.parse
from typing import Any, cast

import redis.cluster
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.exceptions import RedisClusterException

from broker._scripts import slot_map_error

__all__ = ["OutageCluster", "cluster_client", "connection_options", "seeds", "sync_cluster_client"]


def seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """`url` with only its first node, and the other nodes it names as (host, port).

    Raises ValueError (with what is wrong) for a node that is not `host:port`.
    """
    parts = urllib.parse.urlsplit(url)
    auth, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return url, []
    first, *rest = hosts.split(",")
    others: list[tuple[str, int]] = []
    for node in rest:
        host, colon, port = node.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{node!r} is not a cluster node (host:port)")
        others.append((host.strip("[]"), int(port)))
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{auth}{at}{first}")), others


#: What a client made beside a user's cluster client keeps of its connection settings.
_KEPT = (
    "username", "password", "credential_provider", "client_name", "socket_timeout",
    "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options",
    "health_check_interval", "retry", "protocol", "encoding", "encoding_errors",
)  # fmt: skip


def connection_options(kwargs: dict[str, Any], connection_class: Any = None) -> dict[str, Any]:
    """What a client made beside a cluster client keeps of its connection settings (the
    client's `connection_kwargs`; or a node's, with the node's `connection_class`, which a
    node keeps apart): credentials, timeouts and, on a TLS cluster, `ssl=True` with every
    `ssl_*` option (its CA, certificate, key, hostname check). Keyword arguments for redis-py's
    `Redis` or `RedisCluster`; what decodes replies is left to the caller."""
    kept = {k: kwargs[k] for k in _KEPT if k in kwargs}
    connection_class = connection_class or kwargs.get("connection_class")
    if isinstance(connection_class, type) and issubclass(connection_class, SSLConnection):
        kept |= {"ssl": True} | {k: v for k, v in kwargs.items() if k.startswith("ssl_")}
    return kept


def _as_outage(e: RedisClusterException) -> Exception:
    """The RedisError a slot-map failure is (broker/_scripts.py `slot_map_error`), else `e`."""
    return slot_map_error(e) or e


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except RedisClusterException as e:
            raise _as_outage(e) from e


class OutageCluster(RedisCluster):
    """redis-py's asyncio cluster client whose slot-map failures are RedisErrors (see above)."""

    async def initialize(self) -> OutageCluster:
        try:
            await super().initialize()
        except RedisClusterException as e:
            raise _as_outage(e) from e
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as e:
            raise _as_outage(e) from e

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        if transaction:
            raise RedisClusterException("transaction is deprecated in cluster mode")
        return _Pipeline(self)  # type: ignore[abstract]  # redis-py marks it so; it is not


def _seeded(url: str, kwargs: dict[str, Any], node: Any) -> str:
    """`url` with its first node only; the other nodes it names join `kwargs`' startup nodes,
    each made with `node(host, port)` (the asyncio or the synchronous ClusterNode)."""
    first, others = seeds(url)
    if others:
        kwargs["startup_nodes"] = [
            *kwargs.get("startup_nodes", ()),
            *(node(host, port) for host, port in others),
        ]
    return first


def cluster_client(url: str, **kwargs: Any) -> RedisCluster:
    """redis-py's asyncio cluster client on every node `url` names (see the module's doc)."""
    first = _seeded(url, kwargs, ClusterNode)
    return cast(RedisCluster, OutageCluster.from_url(first, **kwargs))


def sync_cluster_client(url: str, **kwargs: Any) -> Any:
    """The same, with redis-py's synchronous cluster client (a one-off lookup; redis-py does
    not type it)."""
    first = _seeded(url, kwargs, redis.cluster.ClusterNode)
    return redis.cluster.RedisCluster.from_url(first, **kwargs)
