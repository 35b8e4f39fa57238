"""A replica: holds threads by lease, runs their agents' turns, waits held or parked, adopts.

One replica process runs many agent sessions against the shared Redis. Its loops:

- **heartbeat**: every `lease_ttl / 3`, one write proves this replica's incarnation alive for
  `lease_ttl` more (its replica record), whatever it holds: a thread's lease is its holder's
  liveness. A beat that finds the record expired (this process was paused past its deadline) or
  taken by another incarnation drops every thread at once, touching nothing, and joins again as
  a new incarnation.
- **adopt**: every `adopt_interval`, read the replica records and claim a fair share of the
  threads that have no live holder (a replica's record expired, a thread was released by a clean
  stop or freed by a restart, or it is new), in pipelined pages. A claim bumps the thread's
  fencing epoch.
- **examine**: whenever a thread's bell rings (an item queued, a prompt resolved) and no turn of
  it is running here, read its records and do what they say: resume a parked turn whose prompt
  was answered, adopt a dead replica's open prompt as parked, report a turn that was cut off, or
  start a turn for queued messages. Nothing is re-read on a timer: a bell can only be missed
  while the pub/sub connection is down, and its resubscription has the threads looked at (in
  pipelined batches: only those with something to do are examined); a look that failed on a
  Redis error is tried again later.

Nothing is handed to an agent twice. A held answer (deliver.lua) and a parked one taken into a
resume turn (resume.lua, which also mints the approval's one-shot grant) are each marked
delivered in one step under the holder's epoch, once per prompt, ever. A turn cut off after that
(its replica killed, paused past its lease, or cut off from Redis) is never replayed: whoever next
holds the thread posts one item saying so, with the answer it had been handed and what its harness
knows of the call in flight (interrupt.lua, which also ends the turn, so the item is posted once),
and the next turn tells its agent the same before anything else (`Turn.interrupted`).

Waits: an agent's `ask` blocks in place (held) until answered; past `held_waits_max` held waits
the oldest is demoted to parked: its turn ends, the prompt stays open, and its answer starts a
resume turn. A clean stop (SIGTERM) demotes every held wait and releases every lease; it never
cancels a prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import os
import random
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ulid import ULID

from broker import Broker, BrokerError, Settings
from workers.agents import policy
from workers.agents.harness import AgentStore, Harness, Turn, TurnResult
from workers.runtime.adoption import Adoption
from workers.runtime.examine import Examining
from workers.runtime.heartbeat import Heartbeat
from workers.runtime.holding import _HeldWait, _Thread, logger

__all__ = ["OnFirstUse", "Replica", "default_harnesses"]


def default_harnesses() -> dict[str, Harness]:
    from workers.agents.codex import CodexHarness
    from workers.agents.scripted import ScriptedHarness

    harnesses: dict[str, Harness] = {"scripted": ScriptedHarness(), "codex": CodexHarness()}
    # The `claude` extra: only when claude-agent-sdk is installed; imported on first use.
    if importlib.util.find_spec("claude_agent_sdk") is not None:
        harnesses["claude_code"] = OnFirstUse(
            "claude_code", "workers.agents.claude", "ClaudeHarness"
        )
    return harnesses


class OnFirstUse:
    """A harness whose module is imported when it is first used, not when the replica starts.

    Importing the Claude Agent SDK (and the MCP client under it) took about 0.9 s of 1.6 s
    to import a replica's modules here, and a replica that starts after a crash has its
    record to write and threads to adopt first. `warm` imports it on a thread of its own: the
    replica starts that once its first adoption pass has ended (`Replica._warm`).
    A turn that needs it sooner imports it then (waiting for the thread's import, if any)."""

    def __init__(self, name: str, module: str, cls: str) -> None:
        self.name, self._module, self._cls = name, module, cls
        self._harness: Harness | None = None
        self._lock = threading.Lock()

    def load(self) -> Harness:
        with self._lock:
            if self._harness is None:
                started = time.perf_counter()
                self._harness = getattr(importlib.import_module(self._module), self._cls)()
                logger.info(
                    "harness.loaded",
                    extra={
                        "harness": self.name,
                        "seconds": round(time.perf_counter() - started, 3),
                        "on": threading.current_thread().name,
                    },
                )
            return self._harness

    @property
    def loaded(self) -> bool:
        return self._harness is not None

    @property
    def module(self) -> ModuleType:
        """The harness's module (`thread new` finds its `validate_config` there)."""
        return importlib.import_module(self._module)

    def warm(self) -> None:
        """Import it now, on a daemon thread of its own, unless it already is."""
        if self._harness is None:
            threading.Thread(
                target=self._load_logged, name=f"import-{self.name}", daemon=True
            ).start()

    def _load_logged(self) -> None:
        try:
            self.load()
        except Exception as e:  # a broken install: its turns fail saying so, the replica runs on
            logger.error("harness.import_failed", extra={"harness": self.name, "error": repr(e)})

    async def run_turn(self, turn: Turn) -> TurnResult:
        return await self.load().run_turn(turn)

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        return await self.load().describe_interruption(thread_id, state, store)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never the import for a private name (copy, pickle ...)
            raise AttributeError(name)
        return getattr(self.load(), name)


class Replica(Heartbeat, Adoption, Examining):
    """One replica process's worth of agent sessions.

    Its parts, each a class of its own module: `Heartbeat` (liveness), `Adoption` (claiming
    threads; its `Sweeping`, the batched looks), `Examining` (a rung thread's records acted on;
    its `Turns`, whose `HeldWaits` hold an agent's asks), all on the state `Holder` declares."""

    def __init__(
        self,
        broker: Broker,
        harnesses: Mapping[str, Harness] | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.broker = broker
        self.settings: Settings = broker.settings
        self.harnesses = dict(harnesses) if harnesses is not None else default_harnesses()
        self.id = replica_id or f"{socket.gethostname()}-{os.getpid()}-{str(ULID())[-6:]}"
        self.threads: dict[str, _Thread] = {}
        self._held: OrderedDict[str, _HeldWait] = OrderedDict()  # by thread, oldest first
        self._slots = asyncio.Semaphore(self.settings.max_turns)
        self._kicks: set[str] = set()
        self._kick_event = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.ttl_ms = int(self.settings.lease_ttl * 1000)
        self.incarnation = ""  # set by `join`: a new one for every start
        self._last_beat: float | None = None
        self._suspects: set[str] = set()
        self._suspect_event = asyncio.Event()
        self._adopted = asyncio.Event()
        # The worker's own policy rules: a malformed one stops the replica before it starts.
        self.policy_rules = policy.parse_rules(
            self.settings.policy_rules, "PROMPT_BROKER_POLICY_RULES", "worker"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set, then stop cleanly (see `shutdown`)."""
        await self._join()
        logger.info("replica.started", extra={"replica": self.id, "incarnation": self.incarnation})
        self._tasks = [
            asyncio.create_task(
                self._loop(self._adopt, self.settings.adopt_interval), name="adopt"
            ),
            asyncio.create_task(
                self._loop(self._heartbeat, self.settings.lease_ttl / 3), name="beat"
            ),
            asyncio.create_task(self._suspect_loop(), name="sweep"),
            asyncio.create_task(self._kick_loop(), name="kicks"),
            asyncio.create_task(self._warm(), name="warm"),
        ]
        try:
            await stop.wait()
        finally:
            await self.shutdown()

    async def _warm(self) -> None:
        """Import the harnesses left for their first use (`OnFirstUse`) on threads of their
        own, once the first adoption pass has ended (its pages claimed back to back, each
        page's threads subscribed and looked at): an import holds the interpreter for most of
        a second, which a replica adopting a dead one's threads should not share."""
        await self._adopted.wait()
        for harness in self.harnesses.values():
            warm = getattr(harness, "warm", None)  # through the metrics wrapper too
            if callable(warm):
                warm()

    async def shutdown(self) -> None:
        """Park every held wait, let turns settle (bounded), release every lease. Never cancels
        a prompt: the next replica adopts them as they are."""
        if self._stopping:
            return
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for held in list(self._held.values()):
            held.demoted.set()
        turns = [t.task for t in self.threads.values() if t.task is not None and not t.task.done()]
        if turns:
            _, pending = await asyncio.wait(turns, timeout=self.settings.shutdown_grace)
            for task in pending:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait(pending, timeout=1)
        released = 0
        epochs = {t.thread_id: t.epoch for t in self.threads.values()}
        with contextlib.suppress(BrokerError, OSError, ConnectionError):
            released = await self.broker.sessions.release_all(self.id, self.incarnation, epochs)
        logger.info("replica.stopped", extra={"replica": self.id, "released": released})

    async def _loop(self, step: Any, interval: float) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica.loop_failed", extra={"loop": step.__name__})
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))
