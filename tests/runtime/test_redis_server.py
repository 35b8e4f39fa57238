"""The private redis-server helper (workers/runtime/redis_server.py) and the test cluster's
node ports (tests/conftest.py): a server counts as started only when it is ours, says why when
it is not, and a cluster node whose port is taken moves to another pair."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import _cluster_port, _start_node
from workers.runtime.redis_server import RedisServer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def test_a_port_another_server_holds_is_not_a_start_and_the_log_says_why(
    tmp_path: Path, redis_server_factory: Callable[..., RedisServer]
) -> None:
    """Another redis-server answers on the port: ours exits, and start() says so with its log's
    last lines, instead of taking the other server's answer for its own."""
    other = redis_server_factory(appendonly=False)
    (tmp_path / "ours").mkdir()
    ours = RedisServer(
        other.port, tmp_path / "ours", appendonly=False, logfile=str(tmp_path / "ours.log")
    )
    with pytest.raises(RuntimeError, match=r"exited with 1; its log ends: .*already in use"):
        ours.start()


def test_a_cluster_node_whose_bus_port_is_taken_moves_to_another_pair(tmp_path: Path) -> None:
    taken: set[int] = set()
    port = _cluster_port(taken)
    assert {port, port + 10_000} <= taken
    assert {(second := _cluster_port(taken)), second + 10_000}.isdisjoint({port, port + 10_000})
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    node = RedisServer(port, node_dir, appendonly=False, logfile=str(node_dir / "redis.log"))
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port + 10_000))
        blocker.listen()
        try:
            _start_node(node, taken)
            assert node.port != port
            assert node.proc is not None and node.proc.poll() is None
        finally:
            node.stop()
