"""Coalescing: the hot path's commands that coroutines send while others are in flight go to
Redis as one pipeline (`Coalescer`).

Each `ask`, `post_item` and delivery record is one round trip of its own. Fifty threads at once
used to mean fifty round trips, each a write, a wake-up and a read on both sides: on one Redis
that per-round-trip work (system calls, the event loop's turns, redis-py's pipeline set-up) cost
more than the scripts themselves. A caller with nothing else in flight does not wait: its
commands go out at once. Otherwise its submission is queued, and what is queued goes out as
one pipeline, in order: at the end of the current turn of the loop while fewer than `WINDOW`
round trips are in flight, or else once they have all ended (`HOLD` at most). Each caller gets
its own commands' replies back, and the errors `Scripts.run_pipeline` would have raised for
them alone.

Waiting for the round trips out, not only for the turn, matters most on a Redis Cluster:
redis-py's cluster pipeline takes more turns of the loop per round trip, so callers come back
in more turns, and batches made per turn were three times as many for the same commands.

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
#: Round trips in flight (each a lone call or a batch) from which a submission no longer goes at
#: the end of its turn but waits for them all to end. Measured (one process, 20 threads, 5 s):
#: with one, a lone server did 19,100-19,600 lifecycles against 22,700-23,800 going at every
#: turn's end; with two, 22,000-23,200, in a quarter fewer round trips, and a one-shard cluster
#: 12,400-13,100 against 9,600 (redis-py's cluster pipeline, taking more turns per round trip,
#: had broken the batches up: 2.1 reads per lifecycle on the server, now 0.7).
WINDOW = 2
#: Seconds a submission waits at most for the round trips out to end: one stuck on a dead
#: connection (redis-py has no read timeout unless one is given) holds the others this long.
HOLD = 0.005


class Coalescer:
    """Runs the submissions queued meanwhile as one pipeline on `redis`; one per Broker."""

    def __init__(self, redis: Redis, scripts: Scripts) -> None:
        self._redis, self._scripts = redis, scripts
        self._queued: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]] = []
        self._count = 0
        self._busy = 0  # round trips in flight
        self._due: asyncio.Handle | None = None  # the flush of what is queued, when set
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
            self._done()

    async def submit(self, commands: Sequence[Command]) -> list[Any]:
        if not self._busy and not self._queued:
            # Nothing else in flight: no turn to wait for, and nobody to share it with. It
            # goes out now, from the caller's own task (a lone call pays nothing for this).
            self._busy += 1
            try:
                results = await self._scripts.execute(self._redis, list(commands))
            finally:
                self._done()
        else:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[list[Any]] = loop.create_future()
            self._queued.append((commands, done))
            self._count += len(commands)
            if self._count >= MAX_BATCH:
                self._flush()
            elif self._due is None:
                self._due = loop.call_soon(self._kick)  # at the end of this turn
            results = await done
        raise_first(results)
        return results

    def _kick(self) -> None:
        """The end of the turn a submission was queued in: out it goes while fewer than
        `WINDOW` round trips are out; else when they have ended, or after `HOLD` at most."""
        if self._busy < WINDOW:
            self._flush()
        else:
            self._due = asyncio.get_running_loop().call_later(HOLD, self._flush)

    def _done(self) -> None:
        """A round trip in flight ended; the last one out: what queued meanwhile goes now."""
        self._busy -= 1
        if self._queued and not self._busy:
            self._flush()

    def _flush(self) -> None:
        """Send what was queued (at the end of a turn, when a round trip ended, or when a batch
        is full)."""
        if self._due is not None:
            self._due.cancel()  # when it is what runs now, a no-op
            self._due = None
        batch, self._queued, self._count = self._queued, [], 0
        if not batch:
            return
        self._busy += 1
        task = asyncio.get_running_loop().create_task(self._execute(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _execute(
        self, batch: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]]
    ) -> None:
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
            self._done()
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
