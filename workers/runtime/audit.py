"""The audit worker: arq jobs that post `pending_prompt_resolved` items, exactly once.

Run it with `prompt-broker audit` (or `python -m workers.runtime.audit`), or with arq's own
`arq workers.runtime.audit.WorkerSettings`. Ours cuts arq's crash redelivery from `job_timeout + 10
s` to `job_timeout + 1 s`; arq's command keeps its `+ 10 s`.

- `post_resolution(thread_id, prompt_id)` is enqueued by whoever hands answers to the agent
  (`Broker.wait`) or cancels a prompt; its arq job id is the prompt's, and the Lua script behind
  it posts at most one resolution per prompt, however often it runs. An answer no agent ever
  received is never posted.
- `reconcile` (cron, every 15 s) re-enqueues every resolution still unposted in the `audit`
  index; every tenth run it also rebuilds the `open` and `audit` indexes from the prompt records,
  and the lease indexes from the session records, which decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import signal
import urllib.parse
from dataclasses import dataclass
from typing import Any

import arq.worker
import redis.cluster
from arq import cron, func
from arq.connections import RedisSettings
from arq.worker import Worker
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from ulid import ULID

from broker import Broker, Keys, Settings
from broker._cluster import sync_cluster_client
from broker.client import AUDIT_JOB
from broker.errors import BadItem
from broker.indexes import Index
from broker.settings import ENV_PREFIX

logger = logging.getLogger("workers.runtime.audit")

__all__ = [
    "AuditWorker",
    "post_resolution",
    "rebuild_indexes",
    "reconcile",
    "serve",
]

FULL_SWEEP_EVERY = 10

_arq_log_redis_info = getattr(arq.worker, "log_redis_info")  # noqa: B009 - not re-exported


async def _log_redis_info(redis: Any, log_func: Any) -> None:
    """arq logs the server's INFO at start; the embedded fakeredis server has no INFO."""
    try:
        await _arq_log_redis_info(redis, log_func)
    except ResponseError:
        log_func("redis INFO unavailable (the embedded fakeredis server?)")


setattr(arq.worker, "log_redis_info", _log_redis_info)  # noqa: B010
_PROMPT_KEY = re.compile(r"^(?P<prefix>.+):\{(?P<thread>[^}]+)\}:prompt:(?P<prompt>prm_\w+)$")


async def startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx.get("settings") or Settings.from_env()
    extra: dict[str, Any] = {}
    if settings.redis_cluster and _known_nodes:  # the node the URL names may be the one that died
        extra["startup_nodes"] = [ClusterNode(host, port) for host, port in _known_nodes]
    ctx["broker"] = Broker.from_url(settings=settings, **extra)
    ctx["runs"] = 0


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx["broker"].aclose()


async def post_resolution(ctx: dict[str, Any], thread_id: str, prompt_id: str) -> str | None:
    """Post the prompt's resolution item (once); None when there is nothing to post yet."""
    broker: Broker = ctx["broker"]
    return await broker.post_resolution(thread_id, prompt_id)


async def reconcile(ctx: dict[str, Any]) -> dict[str, int]:
    """Re-enqueue unposted resolutions; every `FULL_SWEEP_EVERY` runs, rebuild the indexes."""
    broker: Broker = ctx["broker"]
    ctx["runs"] = ctx.get("runs", 0) + 1
    counts = {"requeued": 0}
    if ctx["runs"] % FULL_SWEEP_EVERY == 1:
        counts |= await rebuild_indexes(broker)
        # The lease indexes too (threads to claim, each holder's set): after a failover that
        # lost them, a dead replica's threads are found again here.
        leases = await broker.sessions.rebuild_leases()
        counts |= {f"leases_{name}": n for name, n in leases.items()}
    before = ULID().milliseconds - int(broker.settings.audit_grace * 1000)
    for member, _ in await broker.indexes.audit.page(broker.redis, "-inf", before):
        thread_id, prompt_id = broker.keys.split_member(member)
        counts["requeued"] += await broker.enqueue_audit(thread_id, prompt_id)
    if counts["requeued"]:
        logger.info("audit.requeued", extra=counts)
    return counts


@dataclass
class _Fix:
    open_add: dict[str, float]
    open_rem: list[str]
    audit_add: dict[str, float]
    audit_rem: list[str]


async def rebuild_indexes(broker: Broker) -> dict[str, int]:
    """Bring `open` and `audit` back in line with the prompt records (which decide), each
    member in its own bucket (broker/indexes.py)."""
    indexes = (broker.indexes.open, broker.indexes.audit)
    # First into their own buckets (a former bucket count's members): the records then decide.
    moved = sum([await index.regroup(broker.redis) for index in indexes])
    scanned = 0
    fix = _Fix({}, [], {}, [])
    async for batch in _prompt_batches(broker):
        pipe = broker.redis.pipeline(transaction=False)
        for key, _, _ in batch:
            pipe.hmget(key, ["state", "delivered", "audit_item", "created"])
        for (_, thread_id, prompt_id), row in zip(batch, await pipe.execute(), strict=True):
            scanned += 1
            _classify(broker.keys.member(thread_id, prompt_id), row, fix)
    pipe = broker.redis.pipeline(transaction=False)
    broker.indexes.open.queue_add(pipe, fix.open_add, nx=True)
    broker.indexes.open.queue_remove(pipe, fix.open_rem)
    broker.indexes.audit.queue_add(pipe, fix.audit_add, nx=True)
    broker.indexes.audit.queue_remove(pipe, fix.audit_rem)
    await pipe.execute()
    orphans = 0
    for index in indexes:
        orphans += await _drop_orphans(broker, index)
    return {
        "scanned": scanned,
        "open": len(fix.open_add),
        "unaudited": len(fix.audit_add),
        "orphans": orphans,
        "moved": moved,
    }


async def _drop_orphans(broker: Broker, index: Index) -> int:
    """Drop the members of an index whose prompt record does not exist (expired, or an ask cut
    off between its index write and its record). A record that lands later is indexed again by
    the next sweep, so a member dropped too early is never lost for good."""
    dropped = 0
    members: list[str] = []
    async for _, member, _ in index.scan(broker.redis):
        members.append(member)
        if len(members) >= 500:
            dropped += await _drop_unrecorded(broker, index, members)
            members = []
    if members:
        dropped += await _drop_unrecorded(broker, index, members)
    return dropped


async def _drop_unrecorded(broker: Broker, index: Index, members: list[str]) -> int:
    pipe = broker.redis.pipeline(transaction=False)
    for member in members:
        thread_id, prompt_id = broker.keys.split_member(member)
        pipe.exists(broker.thread(thread_id).prompt(prompt_id))
    gone = [m for m, found in zip(members, await pipe.execute(), strict=True) if not found]
    await index.remove(broker.redis, gone)
    return len(gone)


def _classify(member: str, row: list[str | None], fix: _Fix) -> None:
    state, delivered, audited, created = row
    if state is None:
        return
    score = float(created or 0)
    if state == "pending":
        fix.open_add[member] = score
        return
    fix.open_rem.append(member)
    if audited is None and (state == "cancelled" or delivered is not None):
        fix.audit_add[member] = score
    else:
        fix.audit_rem.append(member)


async def _prompt_batches(broker: Broker) -> Any:
    batch: list[tuple[str, str, str]] = []
    async for key in broker.redis.scan_iter(match=broker.keys.prompt_pattern, count=1000):
        m = _PROMPT_KEY.match(key)
        if m is None or m["prefix"] != broker.keys.prefix:
            continue
        batch.append((key, m["thread"], m["prompt"]))
        if len(batch) >= 500:
            yield batch
            batch = []
    if batch:
        yield batch


#: The TLS options of a URL (redis-py's names) that arq's connections take; arq's RedisSettings
#: has no field for the others.
_ARQ_TLS = (
    "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data",
    "ssl_check_hostname",
)  # fmt: skip


def arq_settings(url: str, setting: str) -> RedisSettings:
    """arq's connection settings for `url`, read as redis-py reads it for the Broker: host,
    port or socket path, database, credentials, connect timeout and TLS with its query options
    (`rediss://host:6380/0?ssl_ca_certs=/etc/ca.pem`). arq's own `from_dsn` keeps only the
    scheme of those, so a server whose certificate a private CA signed refused the worker
    that the Broker reached. A TLS option arq cannot carry raises `BadItem` naming `setting`
    (the variable the URL came from), before anything connects."""
    try:
        options: dict[str, Any] = dict(parse_url(url))  # any query option, by redis-py's name
    except ValueError as e:
        raise BadItem(setting, str(e)) from None
    connection_class = options.pop("connection_class", None)
    refused = sorted(k for k in options if k.startswith("ssl_") and k not in _ARQ_TLS)
    if refused:
        raise BadItem(
            setting,
            f"the TLS option {refused[0]!r} cannot be given to the audit worker's arq connection "
            f"(it takes {', '.join(_ARQ_TLS)})",
        )
    tls = {k: options[k] for k in _ARQ_TLS if k in options}
    if "socket_connect_timeout" in options:
        tls["conn_timeout"] = max(1, round(options["socket_connect_timeout"]))
    return RedisSettings(
        host=options.get("host") or "localhost",
        port=options.get("port") or 6379,
        unix_socket_path=options.get("path"),
        database=options.get("db") or 0,
        username=options.get("username"),
        password=options.get("password"),
        ssl=connection_class is SSLConnection,
        **tls,
    )


def _redis_settings(url: str, setting: str, *, cluster: bool = False) -> RedisSettings:
    """arq's Redis settings (`arq_settings`), riding out a Redis restart: every command and
    every connect is retried on a connection error, backing off to 1 s, for about 40 s in all.
    On a cluster for about 4 s: a primary that stops answering is more likely gone for good
    (its replica takes over), and the worker started again then looks the queue's primary up
    anew."""
    return dataclasses.replace(
        arq_settings(url, setting),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, OSError],
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=8 if cluster else 45),
    )


#: Every node of the cluster the last lookup saw (host, port): asked next time beside the one
#: the URL names, which may be the primary that died.
_known_nodes: list[tuple[str, int]] = []


def _queue_url(settings: Settings, queue: str) -> str:
    """Where arq works: the queue's own Redis (`queue_url`), the Redis server, or on a cluster
    the primary owning the queue's slot.

    arq cannot span slots; on a cluster every key it touches for the audit jobs shares the
    queue's hash tag (broker/keys.py), so one primary holds them all. Looked up each time a
    worker starts, from the node the URL names and every node seen before: after a failover
    the worker started again finds the promoted primary. Raises `RedisClusterException` when
    no node answers or the slot has no primary yet (the caller tries again).
    """
    if settings.queue_url:
        return settings.queue_url
    if not settings.redis_cluster:
        return settings.redis_url
    others = [redis.cluster.ClusterNode(h, p) for h, p in _known_nodes]  # type: ignore[no-untyped-call]
    nodes = sync_cluster_client(
        settings.redis_url, startup_nodes=others, socket_connect_timeout=2, socket_timeout=2
    )
    try:
        node = nodes.get_node_from_key(queue)
        _known_nodes[:] = [(n.host, n.port) for n in nodes.get_nodes()]
    finally:
        nodes.close()
    if node is None:
        raise RedisClusterException(f"no primary owns the slot of {queue!r}")
    parts = urllib.parse.urlsplit(settings.redis_url)
    return urllib.parse.urlunsplit(parts._replace(netloc=_netloc(parts, node.host, node.port)))


def _netloc(parts: urllib.parse.SplitResult, host: str, port: int) -> str:
    auth = parts.netloc.rpartition("@")[0]
    return f"{auth}@{host}:{port}" if auth else f"{host}:{port}"


def worker_settings(settings: Settings | None = None) -> dict[str, Any]:
    """arq Worker keyword arguments for these settings (the environment by default)."""
    settings = settings or Settings.from_env()
    keys = Keys(settings.key_prefix, cluster=settings.redis_cluster)
    # On a cluster the reconcile job's arq keys need the queue's hash tag too.
    reconcile_name = f"{keys.audit_slot}{settings.key_prefix}:reconcile" if keys.cluster else None
    return {
        "functions": [func(post_resolution, name=AUDIT_JOB)],
        "cron_jobs": [
            cron(reconcile, name=reconcile_name, second={0, 15, 30, 45}, run_at_startup=True)
        ],
        "queue_name": keys.audit_queue,
        "redis_settings": _redis_settings(
            _queue_url(settings, keys.audit_queue),
            ENV_PREFIX + ("QUEUE_URL" if settings.queue_url else "REDIS_URL"),
            cluster=settings.redis_cluster and not settings.queue_url,
        ),
        "job_timeout": settings.audit_job_timeout,
        # No result kept: posting is idempotent on its own, and a kept result would block
        # re-enqueueing that prompt's job until it expired.
        "keep_result": 0,
        "max_jobs": 50,
        "poll_delay": 0.1,
        "on_startup": startup,
        "on_shutdown": shutdown,
        "ctx": {"settings": settings},
        "handle_signals": True,
    }


class AuditWorker(Worker):
    """arq's Worker with crash redelivery after `job_timeout + 1 s` instead of `+ 10 s`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        timeouts = [f.timeout_s or self.job_timeout_s for f in self.functions.values()]
        self.in_progress_timeout_s = max(t or 0 for t in timeouts) + 1


def _worker_settings_class() -> type:
    s = worker_settings()
    attrs = {k: v for k, v in s.items() if k not in ("handle_signals",)}
    attrs["__doc__"] = (
        "For `arq workers.runtime.audit.WorkerSettings`: settings from PROMPT_BROKER_* env."
    )
    return type("WorkerSettings", (), attrs)


def __getattr__(name: str) -> Any:
    # `WorkerSettings` is made on first use, so importing this module never reads the
    # environment or fails on it; arq's `arq workers.runtime.audit.WorkerSettings` gets it here.
    if name == "WorkerSettings":
        return _worker_settings_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def serve(settings: Settings) -> None:
    """The audit worker until SIGTERM or SIGINT (`prompt-broker audit`).

    It rides out a Redis outage: the retries in `_redis_settings` cover single commands, but
    arq's job pick-up runs under WATCH, and a connection lost there comes out of the worker as a
    `WatchError` that stops it. Any Redis or OS error out of the worker is taken as a
    disconnect: the worker is closed and a new one started, backing off to 1 s.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    running: list[asyncio.Future[Any]] = []

    def on_signal() -> None:
        stop.set()
        for task in running:
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    delay = _RESTART_FIRST
    from workers.runtime.health import serve_audit_ops  # ops: /metrics, /livez, /readyz
    from workers.runtime.timekeeper import keeping_time  # deadlines, reminders, escalation

    try:
        async with serve_audit_ops(settings), keeping_time(settings):
            while not stop.is_set():
                if await _run_worker(settings, running, stop):
                    return
                logger.warning("audit.restarting", extra={"retry_in": delay})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, _RESTART_MAX)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


#: Backoff between audit worker restarts after a Redis error, in seconds.
_RESTART_FIRST = 0.1
_RESTART_MAX = 1.0


async def _run_worker(
    settings: Settings, running: list[asyncio.Future[Any]], stop: asyncio.Event
) -> bool:
    """Run one arq worker until it stops: True when it was asked to (or ended), False when a
    Redis or OS error stopped it (the caller starts another)."""
    try:  # on a cluster this looks up the queue's primary: no node may answer yet
        worker = AuditWorker(**worker_settings(settings) | {"handle_signals": False})
    except (RedisError, RedisClusterException, OSError) as e:
        logger.warning("audit.disconnected", extra={"error": repr(e)})
        return False
    task = asyncio.ensure_future(worker.async_run())
    running[:] = [task]
    try:
        await task
        return True
    except asyncio.CancelledError:
        if stop.is_set():
            return True
        raise
    except (RedisError, RedisClusterException, OSError) as e:
        logger.warning("audit.disconnected", extra={"error": repr(e)})
        return False
    finally:
        running.clear()
        # arq's close can raise what its cancelled job tasks raised; none of it matters now.
        with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
            await worker.close()


if __name__ == "__main__":
    from workers.runtime.logs import configure

    configure()
    asyncio.run(serve(Settings.from_env()))
