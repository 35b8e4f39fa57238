"""The Claude harness's transcript store: the SDK's `SessionStore`, kept in Redis.

`RedisSessionStore` backs the SDK's `session_store` with the thread's agent store (`Turn.store`),
so a Claude session's transcript outlives the replica that ran it and resumes on any other. It
also tells an ask when its call's transcript entry has landed (`stored`), so a prompt (and its
resume state) is posted only once the session could be resumed at that call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, cast

from claude_agent_sdk import SessionKey, SessionListSubkeysKey, SessionStoreEntry

from workers.agents.harness import AgentStore

__all__ = ["MIRROR_WAIT", "RedisSessionStore"]

#: How long an ask waits for the call's transcript entry to reach the store.
MIRROR_WAIT = 5.0


class RedisSessionStore:
    """The SDK's `SessionStore` over a thread's agent store (`Turn.store`, in Redis).

    Keys are `claude:<session_id>[:<subpath>]`: the thread scopes them, so the SDK's
    `project_key` (derived from the working directory, which may differ between replicas) is not
    part of the key. Entries with a `uuid` are appended once (the SDK's idempotency key).
    Only `append`, `load` and `list_subkeys` are implemented (the SDK probes for the others).
    It also records which tool calls have reached the store, so an ask can wait for its call's
    transcript entry before it (and its resume state) is posted.
    """

    def __init__(self, store: AgentStore) -> None:
        self._store = store
        self._uuids: dict[str, set[str]] = {}
        self._subkeys: set[str] = set()
        self._tool_uses: set[str] = set()
        self._changed = asyncio.Event()

    @staticmethod
    def _key(key: SessionKey | SessionListSubkeysKey) -> str:
        subpath = cast(dict[str, Any], key).get("subpath")
        return f"claude:{key['session_id']}" + (f":{subpath}" if subpath else "")

    async def _seen(self, name: str) -> set[str]:
        if name not in self._uuids:
            loaded = await self._store.load(name) or []
            self._uuids[name] = {
                str(e["uuid"]) for e in loaded if isinstance(e, dict) and e.get("uuid")
            }
        return self._uuids[name]

    async def append(self, key: SessionKey, entries: list[SessionStoreEntry]) -> None:
        name = self._key(key)
        seen = await self._seen(name)
        fresh = []
        for entry in entries:
            uuid = entry.get("uuid")
            if uuid:
                if uuid in seen:
                    continue
                seen.add(uuid)
            fresh.append(entry)
        if not fresh:
            return
        subpath = cast(dict[str, Any], key).get("subpath")
        if subpath and name not in self._subkeys:
            await self._store.append(f"claude:{key['session_id']}:subkeys", [subpath])
            self._subkeys.add(name)
        await self._store.append(name, fresh)
        self._note_tool_uses(fresh)

    def _note_tool_uses(self, entries: Sequence[Any]) -> None:
        for entry in entries:
            message = entry.get("message") if entry.get("type") == "assistant" else None
            content = message.get("content") if isinstance(message, dict) else None
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    self._tool_uses.add(str(block.get("id")))
        self._changed.set()

    async def load(self, key: SessionKey) -> list[SessionStoreEntry] | None:
        loaded = await self._store.load(self._key(key))
        if loaded:
            self._uuids[self._key(key)] = {str(e["uuid"]) for e in loaded if e.get("uuid")}
            self._note_tool_uses(loaded)
        return loaded

    async def list_subkeys(self, key: SessionListSubkeysKey) -> list[str]:
        loaded = await self._store.load(f"claude:{key['session_id']}:subkeys") or []
        return list(dict.fromkeys(str(s) for s in loaded))

    async def stored(self, tool_use_id: str, within: float = MIRROR_WAIT) -> bool:
        """Wait (bounded) until the transcript entry holding this tool call is in the store."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while tool_use_id not in self._tool_uses:
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True
