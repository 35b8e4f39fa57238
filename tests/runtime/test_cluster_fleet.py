"""The whole fleet on a Redis Cluster: two replicas, the audit worker, the HTTP API and the CLI,
real processes with PROMPT_BROKER_REDIS_CLUSTER=true and PROMPT_BROKER_REDIS_URL naming one
node of the session's private cluster (`redis_cluster` in conftest.py).

A scripted thread asks; the answer comes through the HTTP API; the agent goes on and asks
again; the replica holding the thread is killed with SIGKILL, the other adopts it, and the
second answer comes through the CLI. Each answer is delivered once, each prompt audited once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from broker import Keys, Settings
from tests.conftest import RedisClusterNodes
from tests.helpers import cli, eventually, process
from workers.runtime.fleet import Fleet
from workers.runtime.redis_server import free_port

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]

TOKEN = "alice-token-0123456789"

SCRIPT = {
    "turns": [
        {
            "steps": [
                {"ask": [{"question": "Pick one", "header": "pick",
                                "options": [{"label": "A"}, {"label": "B"}]}]},
                {"say": "after the first"},
                {"ask": [{"question": "Go on?", "header": "go",
                          "options": [{"label": "yes"}, {"label": "no"}]}]},
                {"say": "all done"},
            ]
        }
    ]
}  # fmt: skip


@pytest.fixture
def env(redis_cluster: RedisClusterNodes) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    return clean | {
        "PROMPT_BROKER_REDIS_URL": redis_cluster.url,
        "PROMPT_BROKER_REDIS_CLUSTER": "true",
        "PROMPT_BROKER_KEY_PREFIX": "fl" + uuid.uuid4().hex[:8],
        "PROMPT_BROKER_LEASE_TTL": "2",
        "PROMPT_BROKER_ADOPT_INTERVAL": "0.2",
        "PROMPT_BROKER_SWEEP_INTERVAL": "1",
        "PROMPT_BROKER_OPS_PORT": "0",
        "PROMPT_BROKER_API_PORT": str(free_port()),
        "PROMPT_BROKER_API_TOKENS": json.dumps(
            [{"name": "alice", "token": TOKEN, "scopes": ["read", "answer"]}]
        ),
    }


def _http(env: dict[str, str], method: str, path: str, body: Any = None) -> Any:
    url = f"http://127.0.0.1:{env['PROMPT_BROKER_API_PORT']}{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def _metrics(ops: dict[str, str]) -> str:
    try:
        url = f"http://127.0.0.1:{ops['PROMPT_BROKER_OPS_PORT']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return str(reply.read().decode())
    except OSError:
        return ""


def _prompts(env: dict[str, str]) -> list[dict[str, Any]] | None:
    try:
        return list(_http(env, "GET", "/v1/prompts")["prompts"])
    except OSError:  # not listening yet
        return None


def _ok(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, run.stderr
    return run.stdout


def _items(env: dict[str, str]) -> list[dict[str, Any]]:
    return list(json.loads(_ok(cli("show", "t1", "--json", env=env)))["items"])


def _said(items: list[dict[str, Any]]) -> Counter[str]:
    texts = [c["text"] for i in items if i["metadata"].get("type") == "agent_output"
             for c in i["content"]]  # fmt: skip
    return Counter(texts)


def _resolved(items: list[dict[str, Any]]) -> Counter[str]:
    kind = "pending_prompt_resolved"
    ids = [i["metadata"]["prompt"]["prompt_id"] for i in items if i["metadata"].get("type") == kind]
    return Counter(ids)


def _holder(env: dict[str, str]) -> str | None:
    owner = json.loads(_ok(cli("thread", "status", "t1", "--json", env=env)))["owner"]
    return str(owner) if owner else None


def test_fleet_on_a_cluster_answers_by_http_and_cli_through_a_kill(
    env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    _ok(cli("thread", "new", "t1", "--script", str(script), "--message", "go", env=env))
    # The audit worker's ops endpoint samples the fleet's metrics from the cluster.
    ops = {"PROMPT_BROKER_OPS_PORT": str(free_port()), "PROMPT_BROKER_OPS_SAMPLE": "0.3"}
    with (
        process(["worker", "--id", "r1"], env) as r1,
        process(["worker", "--id", "r2"], env) as r2,
        process(["audit"], env | ops),
        process(["serve"], env),
    ):
        replicas = {"r1": r1, "r2": r2}
        [first] = eventually(lambda: _prompts(env), "the first question through GET /v1/prompts")
        assert first["thread_id"] == "t1" and first["questions"][0]["question"] == "Pick one"
        open_metric = 'prompt_broker_open_prompts{kind="ask_user_question"} 1.0'
        eventually(lambda: open_metric in _metrics(ops), "the open prompt in the audit's metrics")
        routed = _http(
            env, "POST", "/v1/threads/t1/items", {"content": [{"type": "text", "text": "A"}]}
        )
        assert routed["outcome"] == "answered" and routed["prompt_id"] == first["prompt_id"]
        eventually(lambda: _said(_items(env))["after the first"], "the agent going on")
        eventually(lambda: _resolved(_items(env))[first["prompt_id"]], "the first audit item", 20)
        eventually(lambda: "Go on?" in _ok(cli("open", env=env)), "the second question")

        holder = eventually(lambda: _holder(env), "the thread's holder")
        victim, other = replicas[holder], replicas["r2" if holder == "r1" else "r1"]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        eventually(lambda: _holder(env) == ("r2" if holder == "r1" else "r1"), "the adoption", 20)
        assert other.poll() is None
        _ok(cli("answer", "t1", "yes", env=env))
        eventually(lambda: _said(_items(env))["all done"], "the agent's end", 20)
        eventually(lambda: len(_resolved(_items(env))) == 2, "both audited", 20)
        time.sleep(2)  # a second delivery or audit, if there were one, would be in by now
        items = _items(env)
        said = {"Pick one: A": 1, "after the first": 1, "Go on? yes": 1, "all done": 1}
        assert _said(items) == Counter(said)
        second = [p for p in _resolved(items) if p != first["prompt_id"]]
        assert _resolved(items) == Counter({first["prompt_id"]: 1, second[0]: 1})
        assert "nothing is waiting on a person" in _ok(cli("open", env=env))
        status = _ok(cli("status", env=env))
        assert "open prompts: 0" in status
        eventually(lambda: open_metric.replace("1.0", "0.0") in _metrics(ops), "no open prompt")


async def test_fleet_ready_reads_the_replicas_where_the_cluster_keeps_them(
    redis_cluster: RedisClusterNodes,
) -> None:
    """`Fleet.ready` (what `prompt-broker up` waits on) counts the replicas on a cluster: the
    prefix is chosen so their key lives on another primary than the node the URL names (a plain
    client there gets MOVED)."""
    named = redis_cluster.nodes[0].port
    cluster = RedisCluster.from_url(redis_cluster.url)
    await cluster.initialize()
    prefix = next(
        p
        for p in ("fr" + uuid.uuid4().hex[:8] for _ in range(100))
        if cluster.get_node_from_key(Keys(p, cluster=True).replicas).port != named
    )
    key = Keys(prefix, cluster=True).replicas
    try:
        await cluster.zadd(key, {"replica-1": 1})
        settings = Settings(redis_url=redis_cluster.url, redis_cluster=True, key_prefix=prefix)
        await Fleet(settings, workers=1).ready(within=5)
    finally:
        await cluster.delete(key)
        await cluster.aclose()
