"""Prometheus metrics of the fleet's processes: every metric is defined here, each documented.

Three sources, so no hot path of a replica pays for a metric:

- **Fleet metrics** (`prompt_broker_open_prompts`, waits, audit backlog, resolutions, time to
  answer, ...) are read from Redis by a `FleetSampler`, which the audit worker runs: it samples
  `workers.runtime.ops_status.fleet_status` every `PROMPT_BROKER_OPS_SAMPLE` seconds and follows the
  prompt event stream for resolutions. They describe the whole fleet: aggregate them with
  `max` (not `sum`) if more than one process exports them.
- **Turn metrics** come from wrapping each harness of a replica (`instrument`): one counter
  increment and one histogram observation per turn.
- **Event counters** (adoptions, lost threads, demoted waits, pub/sub reconnects, audit
  reconnects) count the log events the processes already write (`LogCounter`),
  whatever log level the process prints.

All live in `REGISTRY`, served at `/metrics` by `workers.runtime.health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import events
from broker.keys import Keys
from workers.agents.harness import Harness, Turn, TurnResult
from workers.runtime.background import in_background
from workers.runtime.ops_status import FleetStatus, fleet_status

__all__ = ["REGISTRY", "FleetSampler", "LogCounter", "instrument"]

REGISTRY = CollectorRegistry(auto_describe=True)
#: Seconds a turn may run without asking anything (0: no limit); read by `workers.runtime.health`.
TURN_TIMEOUT_ENV = "PROMPT_BROKER_OPS_TURN_TIMEOUT"

#: Seconds to days: a person may answer at once or after a weekend.
ANSWER_BUCKETS = (1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 86400, 3 * 86400,
                  7 * 86400)  # fmt: skip
TURN_BUCKETS = (0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 1800, 3600)

# -- fleet (sampled from Redis) ---------------------------------------------------------------
OPEN_PROMPTS = Gauge(
    "prompt_broker_open_prompts", "Prompts waiting on a person, by kind.", ["kind"],
    registry=REGISTRY,
)  # fmt: skip
OLDEST_OPEN = Gauge(
    "prompt_broker_oldest_open_prompt_age_seconds",
    "Age of the oldest open prompt (0 when none is open).",
    registry=REGISTRY,
)
OLDEST_UNHELD = Gauge(
    "prompt_broker_oldest_unheld_prompt_age_seconds",
    "Age of the oldest open prompt on a thread no live replica holds (0 when none): its "
    "answer would reach nobody until a replica adopts the thread.",
    registry=REGISTRY,
)
PROMPT_DEADLINE = Gauge(
    "prompt_broker_prompt_deadline_seconds",
    "The fleet-wide prompt deadline the audit worker enforces (PROMPT_BROKER_OPS_PROMPT_DEADLINE;"
    " 0: none), for alerting on a prompt older than it.",
    registry=REGISTRY,
)
WAITS = Gauge(
    "prompt_broker_waits",
    "Agent waits on open prompts: held (a live turn blocked in place) or parked (turn ended).",
    ["mode"],
    registry=REGISTRY,
)
THREADS = Gauge("prompt_broker_threads", "Threads in the lease index.", registry=REGISTRY)
THREADS_UNHELD = Gauge(
    "prompt_broker_threads_unheld",
    "Threads whose owner is no live replica (waiting for adoption).",
    registry=REGISTRY,
)
REPLICAS_LIVE = Gauge(
    "prompt_broker_replicas_live", "Replicas that beat within one lease TTL.", registry=REGISTRY
)
TURNS_RUNNING = Gauge(
    "prompt_broker_turns_running", "Turns running and not waiting on a person.", registry=REGISTRY
)
AUDIT_BACKLOG = Gauge(
    "prompt_broker_audit_backlog",
    "Resolutions whose audit item is not posted yet.",
    registry=REGISTRY,
)
AUDIT_LAG = Gauge(
    "prompt_broker_audit_lag_seconds",
    "Age of the oldest resolution whose audit item is not posted yet (0 when none).",
    registry=REGISTRY,
)
PROMPTS_OPENED = Counter(
    "prompt_broker_prompts_opened", "Prompts opened, by kind.", ["kind"], registry=REGISTRY
)
RESOLUTIONS = Counter(
    "prompt_broker_resolutions",
    "Prompts resolved: outcome answered or cancelled; source structured or text (answers); "
    "surface the answer came through (http, cli, ...; 'none' for cancellations by the broker).",
    ["outcome", "source", "surface"],
    registry=REGISTRY,
)
TIME_TO_ANSWER = Histogram(
    "prompt_broker_time_to_answer_seconds",
    "From a prompt's creation to its resolution, by outcome.",
    ["outcome"],
    buckets=ANSWER_BUCKETS,
    registry=REGISTRY,
)
SAMPLE_ERRORS = Counter(
    "prompt_broker_sample_errors",
    "Fleet samples that failed (Redis unreachable); the fleet gauges keep their last value.",
    registry=REGISTRY,
)

# -- turns (this replica) ---------------------------------------------------------------------
TURNS = Counter(
    "prompt_broker_turns",
    "Turns run by this replica, by harness and how they ended: completed, parked (waiting on a "
    "person with the turn ended), failed (the harness reported a failure), error (it raised).",
    ["harness", "outcome"],
    registry=REGISTRY,
)
TIMED_OUT = Counter(
    "prompt_broker_turns_timed_out",
    "Turns stopped for running the turn timeout without asking anything (also counted in "
    "prompt_broker_turns_total as failed).",
    ["harness"],
    registry=REGISTRY,
)
TURN_SECONDS = Histogram(
    "prompt_broker_turn_seconds",
    "Wall time of a turn, by harness (held waits included).",
    ["harness"],
    buckets=TURN_BUCKETS,
    registry=REGISTRY,
)

# -- events this process logged ---------------------------------------------------------------
ADOPTIONS = Counter(
    "prompt_broker_adoptions",
    "Threads this replica claimed (new threads, and those of dead or stopped replicas).",
    registry=REGISTRY,
)
ADOPTION_SECONDS = Histogram(
    "prompt_broker_adoption_wait_seconds",
    "How long each adopted thread waited with no live holder before a replica claimed it "
    "(server time: from its holder's death, its release or its creation).",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
    registry=REGISTRY,
)
ADOPTION_ROUNDS = Counter(
    "prompt_broker_adoption_rounds", "Adoption pages that claimed threads.", registry=REGISTRY
)
LOST_THREADS = Counter(
    "prompt_broker_lost_threads",
    "Threads this replica found claimed by another (it was paused or cut off past its lease).",
    registry=REGISTRY,
)
BEATS_LATE = Counter(
    "prompt_broker_heartbeats_late",
    "Heartbeats that ended more than half a lease TTL after the last one that got through "
    "began (the record came close to running out; the log's replica.beat_late says why).",
    registry=REGISTRY,
)
EXPIRATIONS = Counter(
    "prompt_broker_replica_expirations",
    "Times this replica found its own record run out: it dropped every thread and joined again.",
    registry=REGISTRY,
)
DEMOTED = Counter(
    "prompt_broker_waits_demoted",
    "Held waits demoted to parked (past held_waits_max).",
    registry=REGISTRY,
)
RESUBSCRIBES = Counter(
    "prompt_broker_pubsub_reconnects",
    "Pub/sub connections lost and re-made (every channel is then resubscribed).",
    registry=REGISTRY,
)
AUDIT_RECONNECTS = Counter(
    "prompt_broker_audit_reconnects",
    "Audit worker restarts after a Redis error.",
    registry=REGISTRY,
)

#: Log event -> (counter, the record attribute holding how many, or None for one).
_LOGGED: dict[str, tuple[Counter, str | None]] = {
    "replica.adopted": (ADOPTIONS, "threads"),
    "replica.lost_thread": (LOST_THREADS, None),
    "replica.beat_late": (BEATS_LATE, None),
    "replica.expired": (EXPIRATIONS, None),
    "wait.demoted": (DEMOTED, None),
    "waiter.disconnected": (RESUBSCRIBES, None),
    "audit.disconnected": (AUDIT_RECONNECTS, None),
}


#: The loggers whose events are counted.
_COUNTED_LOGGERS = (
    "workers.runtime.replica",
    "broker.waiter",
    "workers.runtime.audit",
)


class LogCounter(logging.Filter):
    """Counts the log events in `_LOGGED` as they are logged, whatever level is printed.

    It sits on each counted logger as a filter, with the logger let down to INFO: it counts the
    record, then lets it through only if the level configured before would have (so counting
    never changes what a process prints)."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold  # the logger's own level before; NOTSET: its parent's

    def filter(self, record: logging.LogRecord) -> bool:
        found = _LOGGED.get(record.msg if isinstance(record.msg, str) else "")
        if found is not None:
            counter, attribute = found
            n = getattr(record, attribute, 1) if attribute else 1
            counter.inc(n if isinstance(n, int) and n > 0 else 1)
            if counter is ADOPTIONS:
                ADOPTION_ROUNDS.inc()
                for waited in getattr(record, "waited_s", ()) or ():
                    ADOPTION_SECONDS.observe(float(waited))
        if self.threshold:
            return record.levelno >= self.threshold
        parent = logging.getLogger(record.name).parent
        return parent is None or record.levelno >= parent.getEffectiveLevel()


def count_logs() -> None:
    """Put the log counter on every counted logger (once)."""
    for name in _COUNTED_LOGGERS:
        logger = logging.getLogger(name)
        if any(isinstance(f, LogCounter) for f in logger.filters):
            continue
        logger.addFilter(LogCounter(logger.level))
        logger.setLevel(min(logger.level or logging.INFO, logging.INFO))


# -- harness wrapper --------------------------------------------------------------------------


class _Watched:
    """A turn's handle that tells the watchdog when the agent waits on a person."""

    def __init__(self, handle: Any, clock: _Clock) -> None:
        self._handle = handle
        self._clock = clock

    async def ask(self, kind: Any, questions: Any, *, state: Any = None) -> Any:
        self._clock.waiting += 1
        try:
            return await self._handle.ask(kind, questions, state=state)
        finally:
            self._clock.waiting -= 1
            self._clock.since = time.monotonic()  # an answer starts the quiet time again


@dataclass
class _Clock:
    since: float = field(default_factory=time.monotonic)
    waiting: int = 0


def _timeout_text(seconds: float) -> str:
    return (
        f"it ran {seconds:g} s without asking anything or ending, and was stopped "
        f"(the turn timeout, {TURN_TIMEOUT_ENV}); nothing it had not finished was kept"
    )


class _Instrumented:
    """A harness that counts and times its turns, and stops a turn that runs `turn_timeout`
    seconds without asking anything (time spent waiting on a person does not count); everything
    else goes to the harness."""

    def __init__(self, harness: Harness, turn_timeout: float = 0) -> None:
        self._harness = harness
        self.name = harness.name
        self.turn_timeout = turn_timeout

    async def run_turn(self, turn: Turn) -> TurnResult:
        started = time.monotonic()
        outcome = "error"
        try:
            result = await self._run(turn)
            outcome = result.status
            return result
        finally:
            TURNS.labels(self.name, outcome).inc()
            TURN_SECONDS.labels(self.name).observe(time.monotonic() - started)

    async def _run(self, turn: Turn) -> TurnResult:
        if not self.turn_timeout:
            return await self._harness.run_turn(turn)
        clock = _Clock()
        task = asyncio.ensure_future(
            self._harness.run_turn(dataclasses.replace(turn, handle=_Watched(turn.handle, clock)))
        )
        try:
            while True:
                quiet = 0.0 if clock.waiting else time.monotonic() - clock.since
                left = max(0.05, self.turn_timeout - quiet)
                done, _ = await asyncio.wait({task}, timeout=min(left, 1.0))
                if done:
                    return task.result()
                if not clock.waiting and time.monotonic() - clock.since >= self.turn_timeout:
                    break
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elif not task.cancelled():
                # Cancelled (the thread was lost) just as the turn ended with an error: the
                # error is retrieved here, the cancellation goes on.
                task.exception()
        TIMED_OUT.labels(self.name).inc()
        logging.getLogger("workers.runtime.metrics").warning(
            "turn.timed_out", extra={"thread_id": turn.thread_id, "timeout": self.turn_timeout}
        )
        return TurnResult("failed", state=turn.state, error=_timeout_text(self.turn_timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._harness, name)


def instrument(harnesses: dict[str, Harness], turn_timeout: float = 0) -> None:
    """Wrap every harness of `harnesses` (in place) to count and time its turns, and to stop
    a turn quiet for `turn_timeout` seconds (0: never)."""
    for name, harness in list(harnesses.items()):
        if isinstance(harness, _Instrumented):
            harness.turn_timeout = turn_timeout
        else:
            harnesses[name] = _Instrumented(harness, turn_timeout)


# -- fleet sampler ----------------------------------------------------------------------------


#: Every prompt kind seen open (the two the broker asks start at 0).
_kinds: set[str] = {"approval", "ask_user_question"}


def publish(status: FleetStatus) -> None:
    """Set the fleet gauges from one reading."""
    _kinds.update(status.open_by_kind)
    for kind in _kinds:  # a kind with no open prompt left reads 0, not its last count
        OPEN_PROMPTS.labels(kind).set(status.open_by_kind.get(kind, 0))
    OLDEST_OPEN.set(status.oldest_open_age_s)
    OLDEST_UNHELD.set(status.oldest_unheld_age_s)
    WAITS.labels("held").set(status.held_waits)
    WAITS.labels("parked").set(status.parked_waits)
    THREADS.set(status.threads)
    THREADS_UNHELD.set(status.threads_unheld)
    REPLICAS_LIVE.set(status.replicas_live)
    TURNS_RUNNING.set(status.turns_running)
    AUDIT_BACKLOG.set(status.audit_backlog)
    AUDIT_LAG.set(status.audit_lag_s)


_FIELDS = ("kind", "created", "resolved", "source", "via")


class FleetSampler:
    """Samples the fleet gauges and follows the event stream for resolutions (from its start)."""

    def __init__(self, redis: Redis, keys: Keys, ttl_ms: int, interval: float) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_ms = ttl_ms
        self.interval = interval
        self._after: str | None = None

    async def sample(self) -> None:
        """One reading: the gauges, and the events since the last one."""
        if self._after is None:
            self._after = await events.last_event_id(self.redis, self.keys)
        publish(await fleet_status(self.redis, self.keys, self.ttl_ms))
        while True:
            batch = await events.read_after(self.redis, self.keys, self._after)
            if not batch:
                return
            await self._count(batch)
            self._after = batch[-1].id

    async def _count(self, batch: list[events.Event]) -> None:
        resolved = [e for e in batch if e.name != events.OPENED]
        pipe = self.redis.pipeline(transaction=False)
        for e in resolved:
            pipe.hmget(self.keys.thread(e.thread_id).prompt(e.prompt_id), list(_FIELDS))
        records = await pipe.execute() if resolved else []
        for e in batch:
            if e.name == events.OPENED:
                PROMPTS_OPENED.labels(str(e.data.get("kind") or "unknown")).inc()
        for e, row in zip(resolved, records, strict=True):
            _, created, done, source, via = (v.decode() if isinstance(v, bytes) else v for v in row)
            outcome = "answered" if e.name == events.ANSWERED else "cancelled"
            RESOLUTIONS.labels(
                outcome,
                source or ("none" if outcome == "cancelled" else "unknown"),
                via or "none",
            ).inc()
            if created and done:
                TIME_TO_ANSWER.labels(outcome).observe(max(0.0, (int(done) - int(created)) / 1000))

    async def run(self) -> None:
        """Sample until cancelled; a failed sample is counted and retried next interval."""
        while True:
            try:
                await self.sample()
            except (RedisError, OSError) as e:
                SAMPLE_ERRORS.inc()
                logging.getLogger("workers.runtime.metrics").warning(
                    "metrics.sample_failed", extra={"error": repr(e)}
                )
            await asyncio.sleep(self.interval)


@contextlib.asynccontextmanager
async def sampling(sampler: FleetSampler | None) -> Any:
    """Run `sampler` (if any) in the background for the duration of the block."""
    if sampler is None:
        yield
        return
    async with in_background(sampler.run(), "fleet-sampler"):
        yield


def labels_of(mapping: Mapping[str, str]) -> str:
    """`{a="x",b="y"}` for a test or an alert rule."""
    return "{" + ",".join(f'{k}="{v}"' for k, v in mapping.items()) + "}"
