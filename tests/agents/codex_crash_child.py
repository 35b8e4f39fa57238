"""A stand-in replica for the Codex crash tests: one real Codex turn, its agent store and the
state stored with its question kept in Redis (as a replica keeps them), every question
approved. The test SIGKILLs this process mid-turn and reads what it left behind.

Run as `python -m tests.agents.codex_crash_child REDIS_URL PREFIX BASE_URL WORK PROMPT`; it prints
`spawn <pid>` for each Codex process it starts and `done <status>` at the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from broker import Answer, Question
from workers.agents.codex import CodexHarness
from workers.agents.harness import Turn


class RedisStore:
    """An `AgentStore` in Redis: JSON lists under `<prefix>:agent:<key>`."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix

    async def append(self, key: str, entries: Sequence[Any]) -> None:
        if entries:
            await self.redis.rpush(f"{self.prefix}:agent:{key}", *(json.dumps(e) for e in entries))  # type: ignore[misc]

    async def load(self, key: str) -> list[Any] | None:
        raw = await self.redis.lrange(f"{self.prefix}:agent:{key}", 0, -1)  # type: ignore[misc]
        return [json.loads(r) for r in raw] if raw else None


class Approve:
    """Approves every question, first storing the state it was given (as `ask` does)."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix

    async def ask(
        self, kind: Any, questions: Sequence[Question], *, state: dict[str, Any] | None = None
    ) -> list[Answer]:
        await self.redis.set(f"{self.prefix}:state", json.dumps(state))
        return [Answer(question=questions[0].question, answer=["Approve"])]


async def main(url: str, prefix: str, base_url: str, work: str, prompt: str) -> None:
    redis = Redis.from_url(url, decode_responses=True)

    def trace(event: str, data: dict[str, Any]) -> None:
        if event == "spawn":
            print(f"spawn {data['pid']}", flush=True)

    async def emit(text: str) -> None:
        pass

    turn = Turn(
        thread_id="crash",
        prompt=prompt,
        permissions="approval",
        config={"base_url": base_url, "api_key": "dummy-key", "model": "gpt-5.5"},
        state=None,
        handle=Approve(redis, prefix),
        emit=emit,
        work_folder=work,
        store=RedisStore(redis, prefix),
    )
    result = await CodexHarness(trace=trace).run_turn(turn)
    print(f"done {result.status}", flush=True)
    await redis.aclose()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
