"""`in_background`: run one coroutine as a task for the duration of a block, then cancel it and
wait for it to end (the fleet sampler, the deadline expirer, the timekeeper)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

__all__ = ["in_background"]


@contextlib.asynccontextmanager
async def in_background(work: Coroutine[Any, Any, Any], name: str) -> AsyncIterator[None]:
    """`work` runs as the task `name` while the block runs; it is cancelled when the block ends
    and awaited, so nothing of it outlives the block."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
