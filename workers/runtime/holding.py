"""What a replica holds, and the state its parts share: the base every part of `Replica` builds on.

A thread held by lease (`_Thread`), a turn's held wait (`_HeldWait`), the signal that a thread is
no longer this replica's (`_Lost`); `Holder` declares the replica's state (set by
`Replica.__init__`) and the few moves every part makes on it: have a thread looked at now
(`kick`) or soon in a batch (`suspect`, `_retry_later`), and let a lost thread go (`_drop`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from broker import Broker, Settings
from workers.agents import policy
from workers.agents.harness import Harness

# The replica's one logger, whichever part logs: its events are counted (runtime/metrics.py).
logger = logging.getLogger("workers.runtime.replica")


class _Lost(Exception):
    """This replica no longer holds the thread: stop, and write nothing more for it."""


@dataclass
class _Thread:
    """A thread this replica holds."""

    thread_id: str
    epoch: int
    task: asyncio.Task[None] | None = None
    kicked: bool = False
    listener: Any = None
    # claimed, its first look not done yet: that look (after its SUBSCRIBE is confirmed) covers
    # whatever a subscription confirmation might say was missed
    fresh: bool = True
    # prompt -> the token of a resume attempt whose reply never came: its retry reuses it, so a
    # lost reply is the same delivery, not a refused second one
    tokens: dict[str, str] = field(default_factory=dict)


@dataclass
class _HeldWait:
    thread_id: str
    prompt_id: str
    kind: str
    subject: str
    demoted: asyncio.Event = field(default_factory=asyncio.Event)


class Holder:
    """The state of one replica (see `Replica`), and the moves on it every part makes."""

    broker: Broker
    settings: Settings
    harnesses: dict[str, Harness]
    id: str
    threads: dict[str, _Thread]
    _held: OrderedDict[str, _HeldWait]  # by thread, oldest first
    _slots: asyncio.Semaphore
    _kicks: set[str]
    _kick_event: asyncio.Event
    _stopping: bool
    _tasks: list[asyncio.Task[None]]
    ttl_ms: int
    incarnation: str
    _last_beat: float | None  # time.monotonic() when the last write that proved it alive began
    _suspects: set[str]
    _suspect_event: asyncio.Event
    _adopted: asyncio.Event  # set once the first adoption pass has ended
    policy_rules: tuple[policy.Rule, ...]

    def kick(self, thread_id: str) -> None:
        """Look at the thread soon (its bell rang, or it was just adopted)."""
        t = self.threads.get(thread_id)
        if t is None or self._stopping:
            return
        if t.task is not None and not t.task.done():
            t.kicked = True  # the running turn looks again when it ends
            return
        self._kicks.add(thread_id)
        self._kick_event.set()

    def suspect(self, thread_id: str) -> None:
        """Have the thread's records read soon, in a batch (a bell may have been missed)."""
        if thread_id in self.threads and not self._stopping:
            self._suspects.add(thread_id)
            self._suspect_event.set()

    def _retry_later(self, thread_ids: set[str]) -> None:
        """Look again after `sweep_interval`: the look that failed (a Redis error) is owed."""
        loop = asyncio.get_running_loop()
        for thread_id in thread_ids:
            loop.call_later(self.settings.sweep_interval, self.suspect, thread_id)

    def _drop(self, thread_id: str) -> None:
        t = self.threads.pop(thread_id, None)
        if t is None:
            return
        self.broker.unlisten(thread_id, t.listener)
        # Out of the held waits now, as the cap takes one (waits.py): a dropped thread holds
        # nothing, though its wait's task ends a turn or more later.
        held = self._held.pop(thread_id, None)
        if held is not None:
            held.demoted.set()
        if t.task is not None and not t.task.done() and t.task is not asyncio.current_task():
            t.task.cancel()
        logger.warning("replica.lost_thread", extra={"replica": self.id, "thread_id": thread_id})
