"""Redis over TLS, with a certificate signed by a private CA that the URL names
(`rediss://host:port/0?ssl_ca_certs=/path/ca.crt`): the Broker reached such a server, but the
audit worker's arq connection (arq's `from_dsn` keeps only the scheme of a URL's TLS options)
and, on a cluster, the sharded bells' and the webhooks' arq connections (only the username and
password carried) did not. Real `redis-server` processes of the tests' own, on free loopback
ports, with mutual TLS (the clients show a certificate too) and certificates made here by
`openssl`."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from broker import Broker, Settings
from broker.errors import BadItem
from tests.conftest import RedisClusterNodes, _cluster_port
from tests.helpers import answered_and_audited, text, until
from workers.runtime import audit
from workers.runtime.fleet import Fleet
from workers.runtime.redis_server import RedisServer, free_port

pytestmark = pytest.mark.real_redis


@dataclass
class Certificates:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def server_args(self, tls_port: int) -> list[str]:
        """A TLS port whose clients must show a certificate the CA signed (mutual TLS)."""
        return [
            "--tls-port", str(tls_port), "--tls-cert-file", str(self.cert),
            "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "yes",
        ]  # fmt: skip

    @property
    def query(self) -> str:
        """The URL's TLS options: the CA to check the server by, and the client's own pair."""
        return (
            f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A CA of the test's own, a server certificate it signed for 127.0.0.1, and a client's."""
    missing = [t for t in ("openssl", "redis-server", "redis-cli") if shutil.which(t) is None]
    if missing:
        why = f"{', '.join(missing)} needed for the TLS tests"
        if os.environ.get("PB_REQUIRE_REAL_REDIS"):  # CI: a missing tool fails, never skips
            pytest.fail(f"{why} (PB_REQUIRE_REAL_REDIS)")
        pytest.skip(why)
    d = tmp_path_factory.mktemp("tls")
    ca, ca_key, cert, key = d / "ca.crt", d / "ca.key", d / "server.crt", d / "server.key"
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pb-test-ca",
        "-keyout", ca_key, "-out", ca)  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key,
        "-out", d / "server.csr")  # fmt: skip
    run("x509", "-req", "-in", d / "server.csr", "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-days", "2", "-extfile", ext, "-out", cert)  # fmt: skip
    client_cert, client_key = d / "client.crt", d / "client.key"
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=prompt-broker", "-keyout",
        client_key, "-out", d / "client.csr")  # fmt: skip
    run("x509", "-req", "-in", d / "client.csr", "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-days", "2", "-out", client_cert)  # fmt: skip
    return Certificates(ca, cert, key, client_cert, client_key)


@pytest.fixture
def tls_url(certificates: Certificates, tmp_path: Path) -> Iterator[str]:
    """A redis-server answering TLS on one port (and plain on another, only to see it is up)."""
    tls_port = free_port()
    server = RedisServer(free_port(), tmp_path, appendonly=False)
    server.start(*certificates.server_args(tls_port))
    try:
        yield f"rediss://127.0.0.1:{tls_port}/0?{certificates.query}"
    finally:
        server.stop()


@pytest.fixture
def tls_cluster_url(certificates: Certificates, tmp_path: Path) -> Iterator[str]:
    """Three primaries answering TLS only to clients and to each other (`tls-cluster`), joined
    with `redis-cli --tls --cluster create`; each has a plain port too, to see it is up."""
    taken: set[int] = set()
    tls_ports = [_cluster_port(taken) for _ in range(3)]  # its bus: 10,000 higher (tls-cluster)
    nodes = [RedisServer(free_port(), tmp_path / f"node-{i}", appendonly=False) for i in range(3)]
    cluster = RedisClusterNodes(nodes)
    try:
        for node, tls_port in zip(nodes, tls_ports, strict=True):
            node.dir.mkdir()
            node.start(
                *certificates.server_args(tls_port), "--tls-cluster", "yes",
                "--cluster-enabled", "yes", "--cluster-config-file", str(node.dir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
            )  # fmt: skip
        subprocess.run(
            ["redis-cli", "--tls", "--cacert", str(certificates.ca),
             "--cert", str(certificates.client_cert), "--key", str(certificates.client_key),
             "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in tls_ports), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while any(redis.Redis(port=n.port).cluster("info")["cluster_state"] != "ok" for n in nodes):
            assert time.monotonic() < deadline, "the TLS cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        yield f"rediss://127.0.0.1:{tls_ports[0]}?{certificates.query}"
    finally:
        cluster.stop()


async def test_the_audit_worker_reaches_a_tls_server_whose_ca_the_url_names(
    tls_url: str,
) -> None:
    """Before: arq's `from_dsn` dropped `ssl_ca_certs` (and the client's certificate), and the
    worker's connection failed with CERTIFICATE_VERIFY_FAILED while the Broker's own worked.
    The server asks for a client certificate: a client with the CA alone is turned away."""
    only_the_ca = Redis.from_url(tls_url.partition("&")[0])
    with pytest.raises(RedisConnectionError):
        await only_the_ca.ping()
    await only_the_ca.aclose()
    settings = Settings(redis_url=tls_url, key_prefix="tls" + uuid.uuid4().hex[:8])
    await answered_and_audited(settings, ["t1", "t2"])


async def test_a_fleet_runs_on_a_tls_server(tls_url: str, tmp_path: Path) -> None:
    """`prompt-broker worker` and `prompt-broker audit` as real processes, given the TLS URL
    alone: the replica's bounded pools and its pub/sub connection, and the audit worker's arq
    connection, all reach the server. The scripted agent asks, a person answers "2", the turn
    ends with it and the answer is audited."""
    settings = Settings(
        redis_url=tls_url, key_prefix="tls" + uuid.uuid4().hex[:8], adopt_interval=0.1
    )
    fleet = Fleet(settings, workers=1, restart=False, log_dir=tmp_path / "logs")
    async with Broker.from_url(settings=settings) as person:
        try:
            await fleet.start()
            await fleet.ready()
            await person.sessions.create("t1", "scripted", "approval", {})
            await person.post_item("t1", text("hello"))
            prompt = await until(lambda: person.active_prompt("t1"), "the agent's question", 30)
            routed = await person.post_item("t1", text("2"))
            assert routed.outcome == "answered" and routed.prompt_id == prompt.prompt_id

            async def audited() -> bool:
                items = await person.items("t1")
                return any(i.type == "pending_prompt_resolved" for i in items) and any(
                    i.type == "turn_end" for i in items
                )

            await until(audited, "the turn's end and the audit item", 30)
            answered = await person.get_prompt("t1", prompt.prompt_id)
            assert answered.state == "answered" and answered.audit_item_id
        except BaseException:
            for log in sorted((tmp_path / "logs").glob("*.log")):
                print(f"===== {log.name}\n{log.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            await fleet.stop()


async def test_the_audit_worker_and_the_webhooks_reach_a_tls_cluster(
    tls_cluster_url: str,
) -> None:
    """On a TLS cluster the audit worker works on the primary of its queue's slot, and the
    webhooks' arq connection is made to that primary with the cluster client's TLS (before:
    with its username and password only, and the TLS server reset the connection); after a
    failure of it (`refresh`) the slot map is asked again over TLS too."""
    from web.webhooks import _arq_pool

    settings = Settings(
        redis_url=tls_cluster_url, redis_cluster=True, key_prefix="tls" + uuid.uuid4().hex[:8]
    )
    await answered_and_audited(settings, [f"c{i}" for i in range(4)])
    async with Broker.from_url(settings=settings) as b:
        queue = b.keys.audit_queue
        await b.redis.initialize()  # type: ignore[attr-defined]
        primary = b.redis.get_node_from_key(queue)  # type: ignore[attr-defined]
        for refresh in (False, True):
            arq = await _arq_pool(b.redis, queue, refresh=refresh)
            try:
                assert await arq.ping()
                kwargs = arq.connection_pool.connection_kwargs
                assert (kwargs["host"], kwargs["port"]) == (primary.host, primary.port)
                assert f"ssl_ca_certs={kwargs['ssl_ca_certs']}&" in tls_cluster_url
                assert f"ssl_keyfile={kwargs['ssl_keyfile']}" in tls_cluster_url
            finally:
                await arq.aclose()


def test_arq_settings_read_a_url_as_redis_py_does() -> None:
    s = audit.arq_settings(
        "rediss://ann:secret@cache.internal:6380/3?ssl_ca_certs=/etc/ca.pem"
        "&ssl_cert_reqs=none&ssl_check_hostname=true&socket_connect_timeout=4",
        "PROMPT_BROKER_REDIS_URL",
    )
    assert (s.host, s.port, s.database, s.username, s.password) == (
        "cache.internal", 6380, 3, "ann", "secret"
    )  # fmt: skip
    assert (s.ssl, s.ssl_ca_certs, s.ssl_cert_reqs, s.ssl_check_hostname) == (
        True, "/etc/ca.pem", "none", True
    )  # fmt: skip
    assert s.conn_timeout == 4
    plain = audit.arq_settings("redis://127.0.0.1:6379/2", "PROMPT_BROKER_REDIS_URL")
    assert (plain.ssl, plain.database, plain.unix_socket_path) == (False, 2, None)
    unix = audit.arq_settings("unix:///run/redis.sock?db=5", "PROMPT_BROKER_REDIS_URL")
    assert (unix.unix_socket_path, unix.database, unix.ssl) == ("/run/redis.sock", 5, False)


def test_a_tls_option_arq_cannot_carry_is_refused_naming_its_setting() -> None:
    """Rather than a worker that connects without it (and fails, or checks less than asked)."""
    settings = Settings(
        redis_url="redis://127.0.0.1:6379/0",
        queue_url="rediss://127.0.0.1:6380/0?ssl_ciphers=ECDHE-RSA-AES256-GCM-SHA384",
    )
    with pytest.raises(BadItem) as e:
        audit.worker_settings(settings)
    assert e.value.field == "PROMPT_BROKER_QUEUE_URL"
    assert "'ssl_ciphers' cannot be given" in str(e.value)
