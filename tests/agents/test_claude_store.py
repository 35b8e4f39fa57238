"""The Claude harness's transcript store (`workers.agents.claude_store`) over an agent store in
memory (`MemoryStore`, which test_claude.py's direct runs use too): no CLI."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "claude_agent_sdk",
    reason="claude-agent-sdk is not installed (the `claude` extra): the Claude Code harness is "
    "unavailable, so its tests are skipped",
)

from workers.agents.claude_store import RedisSessionStore


class MemoryStore:
    def __init__(self) -> None:
        self.data: dict[str, list[Any]] = {}

    async def append(self, key: str, entries: Any) -> None:
        self.data.setdefault(key, []).extend(entries)

    async def load(self, key: str) -> list[Any] | None:
        return list(self.data[key]) if key in self.data else None


async def test_session_store_dedups_by_uuid_and_lists_subkeys() -> None:
    memory = MemoryStore()
    store = RedisSessionStore(memory)
    key: Any = {"project_key": "-tmp-a", "session_id": "s1"}
    entry = {
        "type": "assistant",
        "uuid": "u1",
        "message": {"content": [{"type": "tool_use", "id": "toolu_1"}]},
    }
    await store.append(key, [entry, {"type": "last-prompt"}])
    await store.append(key, [entry, {"type": "last-prompt"}])  # a retried batch
    assert [e["type"] for e in memory.data["claude:s1"]] == [
        "assistant",
        "last-prompt",
        "last-prompt",
    ]
    assert await store.stored("toolu_1", within=0.1)
    assert not await store.stored("toolu_2", within=0.1)
    other: Any = {"project_key": "-elsewhere", "session_id": "s1"}  # another replica's cwd
    assert await RedisSessionStore(memory).load(other) == memory.data["claude:s1"]
    sub: Any = {"project_key": "-tmp-a", "session_id": "s1", "subpath": "subagents/agent-1"}
    await store.append(sub, [{"type": "user", "uuid": "u2"}])
    await store.append(sub, [{"type": "user", "uuid": "u3"}])
    assert await store.list_subkeys({"project_key": "x", "session_id": "s1"}) == [
        "subagents/agent-1"
    ]
