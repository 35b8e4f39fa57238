"""Fixtures: every Redis-touching test runs on fakeredis and on a real redis-server.

The real server is `TEST_REDIS_URL` (default redis://127.0.0.1:6379/13). It is shared with other
users, so each test gets its own key prefix and deletes only its own keys; nothing here flushes a
database. When no server answers there, a private `redis-server` is started on a free port for the
session. Tests that kill or restart Redis use `redis_server_factory`: their own server, stopped by
its pid.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from redis.asyncio import Redis

from broker import Broker, Settings
from workers.runtime.redis_server import RedisServer, free_port  # tests take both from here

DEFAULT_URL = "redis://127.0.0.1:6379/13"


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def make(appendonly: bool = True) -> RedisServer:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not on PATH")
        d = tmp_path / f"redis-{len(servers)}"
        d.mkdir()
        server = RedisServer(free_port(), d, appendonly=appendonly)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@dataclass
class RedisClusterNodes:
    """A private Redis Cluster: three primaries with one replica each, on loopback ports."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url.removesuffix("/0")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too: at most 55,535."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20_000, 45_000)
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def start_cluster(root: Path) -> RedisClusterNodes:
    """Start six `redis-server --cluster-enabled yes` and join them with `redis-cli --cluster
    create` (three primaries, a replica each); stopped by their pids, never by name."""
    cli = shutil.which("redis-cli")
    if cli is None or shutil.which("redis-server") is None:
        pytest.skip("redis-server and redis-cli (redis-tools) are needed for the cluster tests")
    nodes = [RedisServer(_cluster_port(), root / f"node-{i}", appendonly=False) for i in range(6)]
    cluster = RedisClusterNodes(nodes)
    try:
        for node in nodes:
            node.dir.mkdir()
            node.start(
                "--cluster-enabled", "yes", "--cluster-config-file", str(node.dir / "nodes.conf"),
                "--cluster-node-timeout", "2000", "--logfile", str(node.dir / "redis.log"),
            )  # fmt: skip
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [redis.Redis(port=n.port).cluster("info")["cluster_state"] for n in nodes]
            # A replica can take over only once it has synced with its primary.
            links = [redis.Redis(port=n.port).info("replication") for n in nodes]
            synced = all(i["role"] == "master" or i["master_link_status"] == "up" for i in links)
            if synced and all(state == "ok" for state in states):
                return cluster
            time.sleep(0.1)
        raise RuntimeError("the test cluster did not reach cluster_state:ok")
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A private Redis Cluster for the session's cluster tests (tests/broker/test_cluster*.py)."""
    with tempfile.TemporaryDirectory() as d:
        cluster = start_cluster(Path(d))
        try:
            yield cluster
        finally:
            cluster.stop()


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


@pytest.fixture(scope="session")
def real_redis_url() -> Iterator[str]:
    """A real redis-server for the whole session: `TEST_REDIS_URL`, or a private one."""
    url = os.environ.get("TEST_REDIS_URL", DEFAULT_URL)
    if _answers(url):
        yield url
        return
    if shutil.which("redis-server") is None:
        if os.environ.get("PB_REQUIRE_REAL_REDIS"):
            pytest.fail(f"no Redis at {url} and no redis-server on PATH (PB_REQUIRE_REAL_REDIS)")
        pytest.skip(f"no Redis at {url} and no redis-server on PATH")
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(free_port(), Path(d), appendonly=False)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def prefix() -> str:
    """This test's own key prefix."""
    return "t" + uuid.uuid4().hex[:12]


async def delete_prefix(client: Redis, prefix: str) -> None:
    """Delete this test's keys only: its prefix, and arq's keys for its audit jobs."""
    for pattern in (f"{prefix}:*", f"arq:*:{prefix}:*"):
        keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])


@pytest.fixture(params=["fake", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "real":
        request.node.add_marker(pytest.mark.real_redis)
    return str(request.param)


ClientFactory = Callable[..., Redis]


@pytest.fixture
async def make_client(
    backend: str, request: pytest.FixtureRequest, prefix: str
) -> AsyncIterator[ClientFactory]:
    """Make clients that share one server: fakeredis (one FakeServer) or the real one."""
    clients: list[Redis] = []
    if backend == "fake":
        server = fakeredis.FakeServer()

        def make(decode_responses: bool = True) -> Redis:
            client = fakeredis.FakeAsyncRedis(server=server, decode_responses=decode_responses)
            clients.append(client)
            return client
    else:
        url = request.getfixturevalue("real_redis_url")

        def make(decode_responses: bool = True) -> Redis:
            client = Redis.from_url(url, decode_responses=decode_responses)
            clients.append(client)
            return client

    yield make
    if backend == "real" and clients:
        await delete_prefix(clients[0], prefix)
    for client in clients:
        await client.aclose()


@pytest.fixture
def settings(prefix: str) -> Settings:
    return Settings(key_prefix=prefix, sweep_interval=2.0)


BrokerFactory = Callable[..., Awaitable[Broker]]


@pytest.fixture
async def make_broker(
    make_client: ClientFactory, settings: Settings
) -> AsyncIterator[BrokerFactory]:
    """Make Brokers (each with its own client) on this test's server and prefix."""
    brokers: list[Broker] = []

    async def make(**overrides: object) -> Broker:
        s = settings.model_copy(update=overrides) if overrides else settings
        b = Broker(make_client(), s)
        brokers.append(b)
        return b

    yield make
    for b in brokers:
        await b.aclose()


@pytest.fixture
async def broker(make_broker: BrokerFactory) -> Broker:
    return await make_broker()


@pytest.fixture
async def fleet(make_broker: BrokerFactory) -> AsyncIterator[Any]:
    """In-process replicas for this test (`tests.runtime.test_replica.Fleet`), all stopped after
    it."""
    from tests.runtime.test_replica import Fleet

    f = Fleet(make_broker)
    try:
        yield f
    finally:
        await f.aclose()


@pytest.fixture
async def person(make_broker: BrokerFactory) -> Broker:
    """The test's own Broker: creates threads, answers as a person, inspects records."""
    from tests.runtime.test_replica import FAST

    return await make_broker(**FAST)
