"""Small helpers the tests share: polling with a deadline, and building and reading items."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from redis.asyncio.cluster import RedisCluster

from broker import Broker, Item, Question, Settings

T = TypeVar("T")


async def until(
    check: Callable[[], Awaitable[T | None]],
    what: str,
    within: float = 8.0,
    *,
    tolerate: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll `check` until it returns something truthy (returned), or fail after `within` s.

    Errors of the `tolerate` types (a Redis that is restarting) count as "not yet".
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: BaseException | None = None
    while True:
        try:
            value = await check()
            if value:
                return value
        except tolerate as e:
            last = e
        if loop.time() > deadline:
            why = f" ({last!r})" if last is not None else ""
            raise AssertionError(f"timed out after {within}s waiting for {what}{why}")
        await asyncio.sleep(0.02)


async def stays(check: Callable[[], Awaitable[bool]], what: str, duration: float) -> None:
    """Poll `check` for `duration` seconds: it must hold every time (a negative check)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    while loop.time() < deadline:
        assert await check(), what
        await asyncio.sleep(0.05)


async def truthy(value: bool) -> bool:
    """`value`, awaitably: lets `until` poll an in-memory condition."""
    return value


def text(words: str, **metadata: Any) -> dict[str, Any]:
    """A person's message (with `metadata`, if any)."""
    item: dict[str, Any] = {"content": [{"type": "text", "text": words}]}
    if metadata:
        item["metadata"] = metadata
    return item


def of_type(items: Sequence[Item], type_: str) -> list[Item]:
    return [i for i in items if i.type == type_]


def outputs(items: Sequence[Item]) -> list[str]:
    """The agent's output lines, in order."""
    return [i.text for i in of_type(items, "agent_output")]


async def began_waiting(broker: Any, thread_id: str, prompt_id: str) -> None:
    """Until `broker`'s wait on the prompt is registered and its channel's subscription is
    confirmed: the wait has begun (a condition, not a guess at how long that takes)."""
    waiter = broker._waiter
    wake = broker.thread(thread_id).wake

    async def began() -> bool:
        ch = waiter._channels.get(wake)
        return prompt_id in waiter._waits and ch is not None and ch.confirmed.is_set()

    await until(began, f"the wait on {prompt_id} to begin")


def fleet_env(redis_url: str, **settings: str) -> dict[str, str]:
    """The environment a user's shell would give a fleet process: ours without any
    PROMPT_BROKER_* of the test run, then the Redis URL and `settings` (`LEASE_TTL="2"` sets
    PROMPT_BROKER_LEASE_TTL)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    chosen = {f"PROMPT_BROKER_{name}": value for name, value in settings.items()}
    return clean | {"PROMPT_BROKER_REDIS_URL": redis_url} | chosen


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`prompt-broker ARGS` as a real process with `env`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "workers.runtime.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def eventually(check: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    """Poll a synchronous `check` until it returns something truthy (a condition, not a guess)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return got


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """`prompt-broker ARGS` running in the background for a `with` block; stopped after it
    (continued first, in case the test paused it), killed if it does not stop in 15 s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.runtime.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the discovery indexes, whatever their bucket count -----------------------------------------
# `open`, `audit`, `leases` and `due` are one sorted set each on one server and N buckets on a
# cluster (broker/indexes.py). Tests that look into or damage an index go through these, so the
# same test reads the right keys on both.


def _index(broker: Any, name: str) -> Any:
    return getattr(broker.indexes, name)


def _str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def index_entries(broker: Any, name: str) -> list[tuple[str, float]]:
    """Every (member, score) of index `name` over all its buckets, as one ZRANGE WITHSCORES
    of one sorted set would give them (by score, ties by member)."""
    found: list[tuple[str, float]] = []
    for key in _index(broker, name).all_keys():
        found += [(_str(m), s) for m, s in await broker.redis.zrange(key, 0, -1, withscores=True)]
    return sorted(found, key=lambda e: (e[1], e[0]))


async def index_members(broker: Any, name: str) -> list[str]:
    """The members of index `name` in score order (ZRANGE 0 -1 of one sorted set)."""
    return [member for member, _ in await index_entries(broker, name)]


async def index_count(broker: Any, name: str) -> int:
    return len(await index_entries(broker, name))


async def index_score(broker: Any, name: str, member: str) -> float | None:
    """`member`'s score in index `name` (in the bucket it belongs in), or None."""
    score: float | None = await broker.redis.zscore(_index(broker, name).key_of(member), member)
    return score


async def index_add(broker: Any, name: str, scores: dict[str, float]) -> None:
    """ZADD each member to the bucket of index `name` it belongs in."""
    index = _index(broker, name)
    for member, score in scores.items():
        await broker.redis.zadd(index.key_of(member), {member: score})


async def drop_indexes(broker: Any, *names: str) -> None:
    """Delete every bucket of the indexes `names` (as a failover that lost them would)."""
    for name in names:
        for key in _index(broker, name).all_keys():
            await broker.redis.delete(key)


async def numsub(client: Any, channel: str) -> int:
    """Subscribers of `channel`; on a cluster (sharded bells) those on the node owning it."""
    if isinstance(client, RedisCluster):
        await client.initialize()  # the slot map (a no-op once made)
        node = client.get_node_from_key(channel)
        [(_, n)] = await client.execute_command("PUBSUB SHARDNUMSUB", channel, target_nodes=node)
        return int(n)
    [(_, n)] = await client.pubsub_numsub(channel)
    return int(n)


async def kill_pubsub(client: Any) -> int:
    """CLIENT KILL TYPE pubsub: on one server, or on every node of a cluster. How many died."""
    if not isinstance(client, RedisCluster):
        return int(await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
    await client.initialize()
    killed = 0
    for node in client.get_nodes():
        command = ("CLIENT", "KILL", "TYPE", "pubsub")
        killed += int(await client.execute_command(*command, target_nodes=node))
    return killed


async def run_audit_worker(broker: Any, pool: Any) -> None:
    """The arq audit worker on `pool` (an ArqRedis), in burst until its queue is empty, its
    jobs posting through `broker` (the test's, not one it would make)."""
    from workers.runtime import audit

    kwargs = audit.worker_settings(broker.settings) | {"handle_signals": False}
    del kwargs["redis_settings"], kwargs["on_startup"], kwargs["on_shutdown"]
    worker = audit.AuditWorker(**kwargs, redis_pool=pool, burst=True)
    worker.ctx["broker"] = broker
    try:
        await asyncio.wait_for(worker.async_run(), 30)
    finally:
        await worker.close()


async def answered_and_audited(settings: Settings, threads: list[str]) -> None:
    """Ask on each thread, answer "Ann", wait for it; then the audit worker (as `prompt-broker
    audit` makes it, from `settings` alone, in burst) posts each thread's
    `pending_prompt_resolved` item."""
    from workers.runtime import audit

    async with Broker.from_url(settings=settings) as b:
        prompts = [await b.ask(t, "text", [Question(question="Name?")]) for t in threads]
        for t, p in zip(threads, prompts, strict=True):
            waiting = asyncio.create_task(b.wait(t, p.prompt_id, timeout=10))
            await asyncio.sleep(0.05)
            await b.post_item(t, {"content": [{"type": "text", "text": "Ann"}]})
            assert [a.answer for a in await waiting] == [["Ann"]]
        await b.settle()
        kwargs = audit.worker_settings(settings) | {"handle_signals": False, "burst": True}
        # Fail fast rather than retry for 40 s when the connection cannot be made at all.
        kwargs["redis_settings"].conn_retries = 0
        worker = audit.AuditWorker(**kwargs)
        try:
            await asyncio.wait_for(worker.async_run(), 60)
        finally:
            await worker.close()
        for t, p in zip(threads, prompts, strict=True):
            assert (await b.get_prompt(t, p.prompt_id)).audit_item_id
            assert (await b.items(t))[-1].type == "pending_prompt_resolved"


async def replica_record(b: Broker, replica: str) -> str | None:
    """A replica's liveness record as stored (`incarnation|deadline ms`), or None."""
    raw: str | None = await b.redis.hget(b.keys.replica_records, replica)  # type: ignore[misc]
    return raw


async def expire(b: Broker, replica: str) -> None:
    """As if `replica` had been paused past its deadline: its record's deadline is long past."""
    raw = await replica_record(b, replica)
    assert raw is not None
    inc = raw.partition("|")[0]
    await b.redis.hset(b.keys.replica_records, replica, f"{inc}|1")  # type: ignore[misc]
