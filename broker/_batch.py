"""Coalescing: the hot path's commands that coroutines send in one turn of the event loop go to
Redis as one pipeline (`Coalescer`).

Each `ask`, `post_item` and delivery record is one round trip of its own. Fifty threads at once
used to mean fifty round trips, each a write, a wake-up and a read on both sides: on one Redis
that per-round-trip work (system calls, the event loop's turns, redis-py's pipeline set-up) cost
more than the scripts themselves. Here a submission waits for the end of the current turn of
the loop, when every submission made meanwhile goes out in one pipeline, in order; each caller
gets its own commands' replies back, and the errors `Scripts.run_pipeline` would have raised for
them alone. A caller with nothing else in flight does not wait: its commands go out at once.

What a caller sees is what a pipeline of its own gives it:
- its commands run in its order, one after another on one connection (not a transaction: other
  connections' commands may run in between, as they may between a pipeline's);
- a NOSCRIPT is repaired for the calls it hit (`Scripts.execute`), the rest are not run again;
- a command's own error (a reply) is raised to that caller only;
- when the connection fails (an error, a timeout, a cancelled batch), every caller in the batch
  gets that error and, as with a pipeline of its own, does not know which of its commands ran.
  A caller cancelled while its batch is in flight does not stop the batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from broker._scripts import Command, Scripts, raise_first, stack_of

__all__ = ["Coalescer"]

#: Commands in one pipeline at most: a larger batch goes out as several, side by side.
MAX_BATCH = 512


class Coalescer:
    """Runs each turn's submissions as one pipeline on `redis`; one per Broker."""

    def __init__(self, redis: Redis, scripts: Scripts) -> None:
        self._redis, self._scripts = redis, scripts
        self._queued: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]] = []
        self._count = 0
        self._busy = 0  # submissions in flight
        self._flushing: set[asyncio.Task[None]] = set()

    async def run(self, pipe: Pipeline) -> list[Any]:
        """The replies to `pipe`'s commands (queued, never executed), run with this turn's
        others; raises as `Scripts.run_pipeline(redis, pipe)` would."""
        return await self.submit(stack_of(pipe))

    async def call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """One script call, as `Scripts.call` makes it."""
        command = self._scripts.command(name, keys, args)
        if self._busy or self._queued:
            (reply,) = await self.submit([(command, {})])
            return reply
        # Alone: straight to the one-command path (the wake's path: no layers in between).
        self._busy += 1
        try:
            return await self._scripts.call_command(self._redis, command)
        finally:
            self._busy -= 1

    async def submit(self, commands: Sequence[Command]) -> list[Any]:
        if not self._busy and not self._queued:
            # Nothing else in flight: no turn to wait for, and nobody to share it with. It
            # goes out now, from the caller's own task (a lone call pays nothing for this).
            self._busy += 1
            try:
                results = await self._scripts.execute(self._redis, list(commands))
            finally:
                self._busy -= 1
        else:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[list[Any]] = loop.create_future()
            if not self._queued:
                loop.call_soon(self._flush)
            self._queued.append((commands, done))
            self._count += len(commands)
            if self._count >= MAX_BATCH:
                self._flush()
            results = await done
        raise_first(results)
        return results

    def _flush(self) -> None:
        """Send what was queued this turn (called at its end, or when a batch is full)."""
        batch, self._queued, self._count = self._queued, [], 0
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._execute(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _execute(
        self, batch: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]]
    ) -> None:
        self._busy += 1
        try:
            results = await self._scripts.execute(
                self._redis, [c for commands, _ in batch for c in commands]
            )
        except Exception as e:  # the connection failed: each caller learns it
            for _, done in batch:
                if not done.done():
                    done.set_exception(e)
            return
        except BaseException:  # the batch itself was cancelled (the loop is closing)
            for _, done in batch:
                done.cancel()
            raise
        finally:
            self._busy -= 1
        at = 0
        for commands, done in batch:
            mine, at = results[at : at + len(commands)], at + len(commands)
            if not done.done():  # its caller was cancelled: the commands ran all the same
                done.set_result(mine)

    async def aclose(self) -> None:
        """Wait for the batches in flight (their callers are waiting on them too)."""
        if self._queued:
            self._flush()
        while self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)
