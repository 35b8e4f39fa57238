"""Fixtures: every Redis-touching test runs on fakeredis and on a real redis-server, and the
ones in `CLUSTER_SCOPE` on a real Redis Cluster as well.

The real server is `TEST_REDIS_URL` (default redis://127.0.0.1:6379/13). It is shared with other
users, so each test gets its own key prefix and deletes only its own keys; nothing here flushes a
database. When no server answers there, a private `redis-server` is started on a free port for the
session. Tests that kill or restart Redis use `redis_server_factory`: their own server, stopped by
its pid.

The cluster backend is the session's private cluster (`redis_cluster`: six `redis-server`
processes, started the first time a test needs it and stopped by their pids at the end of the
session). `PB_CLUSTER_TESTS=0` (or `-m "not cluster"`) leaves the cluster runs out for a quicker
local run; CI runs them. A test that cannot run on a cluster by its nature says so with
`@pytest.mark.single_server("why")`, and no cluster run is made of it.
"""

from __future__ import annotations

import asyncio
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
from typing import Any, cast

import fakeredis
import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

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


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections and for bind(0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (10,000 higher) is free too, both below the kernel's
    ephemeral range (a client's outgoing connection or another server's `free_port()`, a bind
    to port 0, can never take either), and neither one of `taken`'s: the ports, and the bus
    ports, of the nodes picked before it (one node's port can be another's bus port)."""
    top = max(_ephemeral_low() - 10_000, 11_000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, top)
        if {port, port + 10_000} & taken:
            continue
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        taken.update((port, port + 10_000))
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _start_node(node: RedisServer, taken: set[int]) -> None:
    """Start one cluster node; where its port was taken in between (redis-server exits at
    once, its log saying why), try again on another free pair, up to five times."""
    for attempt in range(5):
        try:
            node.start(
                "--cluster-enabled", "yes", "--cluster-config-file", str(node.dir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
            )  # fmt: skip
            return
        except RuntimeError:  # its message ends with the log's last lines
            if attempt == 4 or node.proc is None or node.proc.poll() is None:
                raise
            node.proc = None
            node.port = _cluster_port(taken)
            (node.dir / "nodes.conf").unlink(missing_ok=True)  # a fresh node on the new pair


def start_cluster_nodes(root: Path, count: int) -> RedisClusterNodes:
    """`count` `redis-server --cluster-enabled yes` on free loopback ports, each in a folder of
    its own under `root`, not joined yet; stopped by their pids."""
    taken: set[int] = set()
    nodes = [
        RedisServer(
            _cluster_port(taken),
            root / f"node-{i}",
            appendonly=False,
            logfile=str(root / f"node-{i}" / "redis.log"),
        )
        for i in range(count)
    ]
    cluster = RedisClusterNodes(nodes)
    try:
        for node in nodes:
            node.dir.mkdir()
            _start_node(node, taken)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def start_cluster(root: Path) -> RedisClusterNodes:
    """Start six `redis-server --cluster-enabled yes` and join them with `redis-cli --cluster
    create` (three primaries, a replica each); stopped by their pids, never by name."""
    cli = shutil.which("redis-cli")
    if cli is None or shutil.which("redis-server") is None:
        why = "redis-server and redis-cli (redis-tools) are needed for the cluster tests"
        if os.environ.get("PB_REQUIRE_REAL_REDIS"):  # CI: a missing tool fails, never skips
            pytest.fail(f"{why} (PB_REQUIRE_REAL_REDIS)")
        pytest.skip(why)
    cluster = start_cluster_nodes(root, 6)
    nodes = cluster.nodes
    try:
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
    """A private Redis Cluster for the session: the cluster tests (tests/*/test_cluster*.py) and
    the `cluster` backend. Started lazily (only when a test asks for it); stopped by pid after
    the session, whatever its tests did."""
    with tempfile.TemporaryDirectory() as d:
        cluster = start_cluster(Path(d))
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A private Redis Cluster for one test that kills or cuts off a node of it."""
    cluster = start_cluster(tmp_path)
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


async def delete_prefix(client: Redis | RedisCluster, prefix: str) -> None:
    """Delete this test's keys only: its prefix, its `{<prefix>:...}` keys (the replica records)
    and arq's keys for its audit jobs. On a cluster every primary is scanned (a SCAN sees one
    node), and arq's keys and queue carry the `{arq:abort}:` hash tag (`Keys.audit_slot`)."""
    patterns = [f"{prefix}:*", f"{{{prefix}:*", f"arq:*:{prefix}:*"]
    if not isinstance(client, RedisCluster):
        for pattern in patterns:
            keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
            for i in range(0, len(keys), 500):
                await client.delete(*keys[i : i + 500])
        return
    patterns.append("{arq:abort}:" + f"{prefix}:*")  # the queue; `arq:*:` matches the jobs
    await client.initialize()
    for primary in client.get_primaries():
        node = Redis(host=primary.host, port=primary.port)
        try:
            for pattern in patterns:
                keys = [k async for k in node.scan_iter(match=pattern, count=1000)]
                for i in range(0, len(keys), 500):
                    pipe = node.pipeline(transaction=False)  # keys of several slots: one DEL each
                    for key in keys[i : i + 500]:
                        pipe.delete(key)
                    await pipe.execute()
        finally:
            await node.aclose()


#: Where the tests taking `backend` or `where` run on the cluster too (paths from the repository
#: root; a directory ends with "/"). Chosen by measuring: CI must stay within about 20 minutes and
#: the cluster runs may add 3 or 4. On a real server the backend-parametrized tests take about
#: 70 s; their cluster runs about as long, so every one of them is in scope. With the CLI tests
#: (test_cli.py), the route.lua parity and the replica crash and deadline tests (`where`), which
#: choose the cluster themselves, `pytest -m cluster` made 427 runs in 146 s on two cores
#: (cluster start included); with the health tests 432 runs, 176 s beside another test run.
CLUSTER_SCOPE: tuple[str, ...] = (
    "tests/broker/",
    "tests/runtime/",
    "tests/web/",
    "tests/agents/",
    "tests/test_guards_generated.py",
    "tests/test_guards_python.py",
    "tests/test_fixtures.py",
)


def cluster_runs_wanted() -> bool:
    """`PB_CLUSTER_TESTS=0` turns the cluster runs off (a quicker local run); on by default."""
    return os.environ.get("PB_CLUSTER_TESTS", "1").strip().lower() not in ("0", "no", "false")


@dataclass(frozen=True)
class OnCluster:
    """The session's Redis Cluster, under a test's own key prefix (deleted after it)."""

    url: str
    prefix: str


def _where(
    request: pytest.FixtureRequest, redis_server_factory: Callable[..., RedisServer], prefix: str
) -> RedisServer | OnCluster:
    """Where a fleet of processes runs (the replica crash tests, the turn deadlines ...): a
    private server of the test's own (AOF on), and the session's cluster under the test's prefix
    (parametrized by `pytest_generate_tests`, as `backend` is). Tests that kill, pause or restart
    Redis itself take `server` instead."""
    if request.param == "cluster":
        return OnCluster(request.getfixturevalue("redis_cluster").url, prefix)
    return redis_server_factory(appendonly=True)


where = pytest.fixture(_where, name="where")


@pytest.fixture
def fleet_redis(where: RedisServer | OnCluster) -> Iterator[tuple[str, dict[str, str]]]:
    """For tests that drive processes by their environment: the Redis URL of `where`, and the
    settings (`fleet_env` names: REDIS_CLUSTER, KEY_PREFIX) that go with it. On the cluster the
    test's prefix keys are deleted after it."""
    if not isinstance(where, OnCluster):
        yield where.url, {}
        return
    yield where.url, {"REDIS_CLUSTER": "true", "KEY_PREFIX": where.prefix}

    async def cleanup() -> None:
        client = RedisCluster.from_url(where.url)
        try:
            await delete_prefix(client, where.prefix)
        finally:
            await client.aclose()

    asyncio.run(cleanup())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "single_server(reason): by its nature cannot run on a Redis Cluster (SELECT, a MULTI "
        "over several slots, one server killed ...): no `cluster` run is made of it",
    )
    config.addinivalue_line("markers", "cluster: this run is on the session's Redis Cluster")
    config.addinivalue_line(
        "markers",
        "cluster_xfail(reason, raises=...): a product bug on a cluster, not yet fixed: the "
        "cluster run is xfail(strict=True), the fake and real runs are as ever",
    )


def _in_cluster_scope(metafunc: pytest.Metafunc) -> bool:
    path = Path(metafunc.definition.path).resolve()
    root = Path(metafunc.config.rootpath).resolve()
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        return False
    return any(rel.startswith(s) if s.endswith("/") else rel == s for s in CLUSTER_SCOPE)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize this file's `backend` fixture (fake, real) and `where` fixture (server), each
    with `cluster` as well where it is in `CLUSTER_SCOPE`, wanted, and the test is not marked
    `single_server`. A test module that defines its own `backend`, or a test that parametrizes
    it itself, is left alone."""
    for name, ours, plain in (
        ("backend", _backend, ["fake", "real"]),
        ("where", _where, ["server"]),
    ):
        if name not in metafunc.fixturenames:
            continue
        if any(name in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize")):
            continue
        # The fixture that answers for the name in this test: the last of its definitions
        # (pytest keeps them there at this stage; Metafunc has no public name for it).
        defs = metafunc._arg2fixturedefs.get(name, ())
        if not defs or defs[-1].func is not ours:
            continue
        params: list[Any] = [pytest.param(p, marks=pytest.mark.real_redis) for p in plain]
        if plain[0] == "fake":
            params[0] = "fake"
        single = metafunc.definition.get_closest_marker("single_server")
        if single is None and cluster_runs_wanted() and _in_cluster_scope(metafunc):
            marks = [pytest.mark.real_redis, pytest.mark.cluster]
            # A product bug found on a cluster, written up for its owner: the cluster run is
            # expected to fail until it is fixed (strict: a fix shows as XPASS, failing the run).
            bug = metafunc.definition.get_closest_marker("cluster_xfail")
            if bug is not None:
                reason = str(bug.args[0])
                marks.append(pytest.mark.xfail(strict=True, reason=reason, **bug.kwargs))
            params.append(pytest.param("cluster", marks=marks))
        metafunc.parametrize(name, params, indirect=True)


def _backend(request: pytest.FixtureRequest) -> str:
    """`fake`, `real` or `cluster` (parametrized by `pytest_generate_tests` above)."""
    if request.param != "fake":
        request.node.add_marker(pytest.mark.real_redis)
    return str(request.param)


backend = pytest.fixture(_backend, name="backend")


ClientFactory = Callable[..., Redis]


@pytest.fixture
async def make_client(
    backend: str, request: pytest.FixtureRequest, prefix: str
) -> AsyncIterator[ClientFactory]:
    """Make clients that share one server: fakeredis (one FakeServer), the real one, or the
    session's cluster (a `RedisCluster` client, typed as `Redis`: it answers every command the
    Broker sends, and the Broker tells the two apart)."""
    clients: list[Redis] = []
    if backend == "fake":
        server = fakeredis.FakeServer()

        def make(decode_responses: bool = True) -> Redis:
            client = fakeredis.FakeAsyncRedis(server=server, decode_responses=decode_responses)
            clients.append(client)
            return client
    elif backend == "cluster":
        nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")

        def make(decode_responses: bool = True) -> Redis:
            cluster = RedisCluster.from_url(nodes.url, decode_responses=decode_responses)
            client = cast(Redis, cluster)
            clients.append(client)
            return client
    else:
        url = request.getfixturevalue("real_redis_url")

        def make(decode_responses: bool = True) -> Redis:
            client = Redis.from_url(url, decode_responses=decode_responses)
            clients.append(client)
            return client

    yield make
    if backend != "fake" and clients:
        await delete_prefix(clients[0], prefix)
    for client in clients:
        await client.aclose()


@pytest.fixture
def settings(prefix: str, request: pytest.FixtureRequest) -> Settings:
    """This test's settings; on the cluster backend they name the session's cluster (what the
    audit worker and the CLI read), as a deployment on a cluster would."""
    if "backend" in request.fixturenames and request.getfixturevalue("backend") == "cluster":
        url = request.getfixturevalue("redis_cluster").url
        return Settings(key_prefix=prefix, sweep_interval=2.0, redis_url=url, redis_cluster=True)
    return Settings(key_prefix=prefix, sweep_interval=2.0)


BrokerFactory = Callable[..., Awaitable[Broker]]


@pytest.fixture
def surfaces_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Posts hand no answer to the waits on their own loop (broker/_waiter.py `hand_over`): the
    test's surface Broker stands for a surface in another process, so only the bell, the
    re-reads and the sweep can wake a wait, as they must there."""
    monkeypatch.setattr("broker.routing.hand_over", lambda _prompt_id, _answers: False)


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
