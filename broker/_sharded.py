"""Sharded pub/sub on a Redis Cluster, in the shape of the `PubSub` the waiter (broker/_waiter.py)
reads.

On a cluster the thread scripts ring their bells with SPUBLISH (broker/_scripts.py rewrites
PUBLISH for a cluster), which reaches only the shard owning the channel's slot instead of every
node. redis-py 5.x, which arq 0.28 pins below 6, has no sharded pub/sub in asyncio, so this sends
SSUBSCRIBE itself: one connection per primary that owns a channel waited on, whatever the number
of threads, each read by a task of its own into one queue.

Anything unexpected is a disconnect, which the waiter already knows how to handle (drop this
object, make a new one, subscribe every channel again, re-read every wait): a node's connection
failing, an error reply (MOVED, when a slot moved to another primary), or the server taking a
channel away (`sunsubscribe` we did not ask for: the slot migrated or the node was demoted). A
new object refreshes the slot map first, so it subscribes where the slots are now.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from broker._cluster import connection_options

__all__ = ["ShardedBells", "ShardedPubSub"]


class ShardedBells:
    """Stands in for the waiter's client: its `pubsub()` is a `ShardedPubSub`.

    The slot map it routes SSUBSCRIBE by is a cluster client of its own (it sends nothing but
    the cluster's slot queries), so refreshing it after a failure never disturbs the Broker's
    commands: redis-py 5.x's cluster client, refreshed while commands are in flight, can hand
    them no default node.
    """

    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster
        self._map: RedisCluster | None = None
        self.stale = True  # refresh before the first subscription, and after any failure

    def pubsub(self) -> ShardedPubSub:
        return ShardedPubSub(self)

    async def slot_map(self) -> RedisCluster:
        """The slot map, refreshed when stale. No node answering for it (redis-py's own
        RedisClusterException, not a RedisError) is a disconnect like any other."""
        try:
            if self._map is None:
                first = self._cluster.get_nodes()[0] if self._cluster.get_nodes() else None
                if first is None:
                    await self._cluster.initialize()
                    first = self._cluster.get_nodes()[0]
                # The cluster's credentials, timeouts and TLS (connection_options).
                options = connection_options(first.connection_kwargs, first.connection_class)
                self._map = RedisCluster(host=first.host, port=first.port, **options)
            if self.stale:
                await self._map.nodes_manager.initialize()
                self.stale = False
        except RedisClusterException as e:
            raise RedisConnectionError(f"the cluster's slot map could not be read: {e}") from e
        return self._map

    async def aclose(self) -> None:
        if self._map is not None:
            await self._map.aclose()


class ShardedPubSub:
    """SSUBSCRIBE on the primaries owning the channels; messages as the waiter knows them."""

    def __init__(self, bells: ShardedBells) -> None:
        self._bells = bells
        self._map: RedisCluster | None = None
        self._conns: dict[str, Connection] = {}  # primary name -> its connection
        self._readers: list[asyncio.Task[None]] = []
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._leaving: set[str] = set()  # channels we asked to leave
        self.connection: Connection | None = None  # set once one node's connection is made

    async def subscribe(self, *channels: str) -> None:
        try:
            if self._map is None:
                self._map = await self._bells.slot_map()
            for node, names in self._by_slot(channels):
                conn = await self._connect(node)
                self._leaving.difference_update(names)
                # One command per slot: SSUBSCRIBE refuses channels of two slots (CROSSSLOT).
                await conn.send_command("SSUBSCRIBE", *names)
        except BaseException:
            self._bells.stale = True
            raise

    async def unsubscribe(self, *channels: str) -> None:
        for node, names in self._by_slot(channels):
            conn = self._conns.get(node.name)
            if conn is not None:
                self._leaving.update(names)
                await conn.send_command("SUNSUBSCRIBE", *names)

    async def get_message(
        self,
        ignore_subscribe_messages: bool = False,
        timeout: float = 5.0,  # noqa: ASYNC109 - PubSub.get_message's own signature
    ) -> dict[str, Any] | None:
        del ignore_subscribe_messages  # the waiter wants confirmations: they re-read waits
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def take_buffered(self) -> dict[str, Any] | None:
        """A message read in already, or None (waiting for none): broker/_waiter.py drains
        these after each `get_message`."""
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        for task in self._readers:
            task.cancel()
        for task in self._readers:
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await task
        for conn in self._conns.values():
            with contextlib.suppress(RedisError, OSError):
                await conn.disconnect()
        self._conns.clear()
        self.connection = None

    def _by_slot(self, channels: Iterable[str]) -> list[tuple[ClusterNode, list[str]]]:
        assert self._map is not None  # set by the first subscribe
        groups: dict[int, tuple[ClusterNode, list[str]]] = {}
        for channel in channels:
            node = self._map.get_node_from_key(channel)  # the slot's primary
            if node is None:
                raise RedisConnectionError(f"no primary holds the slot of {channel}")
            groups.setdefault(self._map.keyslot(channel), (node, []))[1].append(channel)
        return list(groups.values())

    async def _connect(self, node: ClusterNode) -> Connection:
        conn = self._conns.get(node.name)
        if conn is None:
            kwargs = {**node.connection_kwargs, "host": node.host, "port": node.port}
            conn = node.connection_class(**kwargs)  # an SSLConnection on a TLS cluster
            await conn.connect()  # type: ignore[no-untyped-call]
            self._conns[node.name] = conn
            self._readers.append(asyncio.ensure_future(self._read(conn)))
            self.connection = conn
        return conn

    async def _read(self, conn: Connection) -> None:
        try:
            while True:
                reply = await conn.read_response(timeout=None)
                message = self._message(reply)
                if message is not None:
                    self._queue.put_nowait(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an error reply (MOVED ...) or a lost connection
            self._bells.stale = True
            self._queue.put_nowait(e)

    def _message(self, reply: Any) -> dict[str, Any] | None:
        kind, channel, data = _text(reply[0]), _text(reply[1]), reply[2]
        if kind == "smessage":
            return {"type": "message", "pattern": None, "channel": channel, "data": data}
        if kind == "ssubscribe":
            return {"type": "subscribe", "pattern": None, "channel": channel, "data": data}
        if kind == "sunsubscribe":
            if channel in self._leaving:
                self._leaving.discard(channel)
                return None
            raise RedisConnectionError(f"the server dropped {channel} (its slot moved)")
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
