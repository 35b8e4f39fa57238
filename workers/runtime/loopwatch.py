"""A watch on a replica's event loop: when the loop has not come round for a while, say where it
is stuck (`replica.loop_blocked`, with the stack of the loop's thread at that moment).

A replica's lease is its heartbeat, and the beat runs on the event loop. Something that holds the
loop without yielding (a synchronous call, a long computation, an import) keeps the beat back
however healthy Redis is, and the record can run out. `replica.beat_late` tells that the loop
was held (a long `gap_s` with a short `beat_s`); this tells by what.

A task on the loop notes the time every `TICK` s; a daemon thread looks every `TICK` s too. When
the note is older than the threshold, the thread logs the loop thread's stack once for that
stall, and `replica.loop_unblocked` when the loop comes round again, with how long it was held.
Both threads only read and write one float and log: the watch costs a wake-up every `TICK` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import traceback

from workers.runtime.holding import logger

__all__ = ["TICK", "LoopWatch", "blocked_after"]

#: Seconds between the loop's notes, and between the watching thread's looks (each a wake-up of
#: the process: at 0.1 s the watch cost an idle replica 0.4% of a core here, at 0.2 s half that).
TICK = 0.2
#: Frames of the loop thread's stack a report keeps (the innermost ones).
FRAMES = 25


def blocked_after(lease_ttl: float) -> float:
    """Seconds without the loop coming round that count as blocked: a quarter of the lease TTL
    (beats start every third of it), at least 0.5 s (well past a tick) and at most 1 s."""
    return max(0.5, min(1.0, lease_ttl / 4))


class LoopWatch:
    """Watches the running event loop for stalls longer than `threshold` s (`start`, `stop`)."""

    def __init__(self, replica: str, threshold: float) -> None:
        self.replica, self.threshold = replica, threshold
        self.stalls = 0  # reported so far
        self._noted = time.monotonic()
        self._loop_thread = 0
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        """Start watching the running loop (call it on that loop)."""
        self._loop_thread = threading.get_ident()
        self._noted = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._note(), name="loop watch")
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2 * TICK + 1)

    async def _note(self) -> None:
        try:
            while True:
                self._noted = time.monotonic()
                await asyncio.sleep(TICK)
        finally:  # stopped, or its loop is closing: nothing to watch any more
            self._stopped.set()

    def _watch(self) -> None:
        reported_at: float | None = None  # the note of the stall reported, if one is on
        while not self._stopped.wait(TICK):
            noted = self._noted
            held = time.monotonic() - noted
            if held > self.threshold and reported_at != noted:
                reported_at = noted
                self.stalls += 1
                logger.warning(
                    "replica.loop_blocked",
                    extra={
                        "replica": self.replica,
                        "blocked_s": round(held, 3),
                        "stack": self._stack(),
                    },
                )
            elif reported_at is not None and noted != reported_at:
                # It came round: the stall lasted from that note to this one, less a tick.
                logger.info(
                    "replica.loop_unblocked",
                    extra={
                        "replica": self.replica,
                        "blocked_s": round(max(0.0, noted - reported_at - TICK), 3),
                    },
                )
                reported_at = None

    def _stack(self) -> list[str]:
        """The loop thread's stack now, innermost last: `file:line in function`."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return []
        summary = traceback.extract_stack(frame)[-FRAMES:]
        return [f"{f.filename}:{f.lineno} in {f.name}" for f in summary]
