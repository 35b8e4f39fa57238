"""A Redis Cluster URL may name several nodes, so a process finds the cluster while one is down.

    redis://[user:password@]host1:port1,host2:port2,host3:port3[/0]

Every node named is a seed: the client asks the first that answers for the slot map and then
knows them all. Credentials and options come from the URL and apply to every node. A URL naming
one node is an ordinary Redis URL (and the only form a single server takes).
"""

from __future__ import annotations

import urllib.parse
from typing import Any, cast

import redis.cluster
from redis.asyncio.cluster import ClusterNode, RedisCluster

__all__ = ["cluster_client", "seeds", "sync_cluster_client"]


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


def cluster_client(url: str, **kwargs: Any) -> RedisCluster:
    """redis-py's asyncio cluster client on every node `url` names (see the module's doc)."""
    first, others = seeds(url)
    if others:
        kwargs["startup_nodes"] = [
            *kwargs.get("startup_nodes", ()),
            *(ClusterNode(host, port) for host, port in others),
        ]
    return cast(RedisCluster, RedisCluster.from_url(first, **kwargs))


def sync_cluster_client(url: str, **kwargs: Any) -> Any:
    """The same, with redis-py's synchronous cluster client (a one-off lookup; redis-py does
    not type it)."""
    first, others = seeds(url)
    if others:
        kwargs["startup_nodes"] = [
            *kwargs.get("startup_nodes", ()),
            *(redis.cluster.ClusterNode(h, p) for h, p in others),  # type: ignore[no-untyped-call]
        ]
    return redis.cluster.RedisCluster.from_url(first, **kwargs)
