"""What one turn of the Claude harness holds, and what it records as it goes.

`RunState` is the base of a turn's run (`workers.agents.claude_turn.Run`): the Claude session it
continues, what the last turn parked on and what this one parks on (`Pending`, kept in the
turn's state), the CLI's client and its kill switch, and the recording a crash relies on: the
call log (`workers.agents.claude_calls`: each call's steps, awaited as they happen) and each
tool result mirrored into the stored transcript as it arrives. The layers above it add the
permission callbacks (`claude_permissions`), the CLI's I/O (`claude_cli`) and the turn's
control (`claude_turn`). `Host` is what a run needs of the harness that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, cast

from claude_agent_sdk import (
    ClaudeSDKClient,
    PermissionResult,
    SessionKey,
    SessionStoreEntry,
    ToolResultBlock,
    UserMessage,
)

from workers.agents import claude_calls, claude_launch
from workers.agents.claude_answers import ASK_TOOL
from workers.agents.claude_config import ClaudeConfig
from workers.agents.claude_store import RedisSessionStore
from workers.agents.harness import PromptParked, Turn

__all__ = ["Host", "Pending", "RunState"]

#: The harness's one logger: its records keep this name whichever module of the harness logs.
logger = logging.getLogger("workers.agents.claude")


class Host(Protocol):
    """What a run needs of its harness (`workers.agents.claude.ClaudeHarness`)."""

    cli_path: str | None

    def scratch_dir(self) -> Path: ...

    def workdir(self, turn: Turn) -> Path: ...

    def launcher(self) -> str | None: ...


@dataclass
class Pending:
    """The call a parked prompt was about, and the call the session was deferred on."""

    call: str  # tool_use_id of the call that asked
    tool: str
    kind: str
    key: str | None  # what makes a later call "the same": the grant key, or the question texts
    prompt_id: str | None = None
    deferred: str | None = None

    def dump(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def load(cls, raw: object) -> Pending | None:
        if not isinstance(raw, dict):
            return None
        try:
            return cls(
                call=str(raw["call"]),
                tool=str(raw["tool"]),
                kind=str(raw["kind"]),
                key=raw.get("key"),
                prompt_id=raw.get("prompt_id"),
                deferred=raw.get("deferred"),
            )
        except KeyError:
            return None


class RunState:
    """One turn of a Claude session: its state, its records, and its CLI's kill switch."""

    def __init__(self, harness: Host, turn: Turn, config: ClaudeConfig) -> None:
        self.h = harness
        self.turn = turn
        self.config = config
        state = turn.state or {}
        sid = state.get("session_id")
        self.session_id: str | None = sid if isinstance(sid, str) and sid else None
        self.before = Pending.load(state.get("pending"))  # what the last turn parked on
        self.store = RedisSessionStore(turn.store) if turn.store is not None else None
        self.parked: PromptParked | None = None
        self.pending: Pending | None = None  # what this turn parked on
        self.parked_at = 0.0
        self.decided: dict[str, PermissionResult] = {}  # answers the hook got, for the callback
        self.replayed: str | None = None  # the deferred call this turn answers on replay
        self.told = False  # the replayed call's answer told the agent what the resume text says
        self.fatal: BaseException | None = None
        self.activity = asyncio.Event()
        self.stderr: deque[str] = deque(maxlen=40)
        self.client: ClaudeSDKClient | None = None
        self.tmpdir: Path | None = None
        self.logged: set[str] = set()  # calls in the call log this turn
        self.logged_session: str | None = None
        self.asked_in: dict[str, str] = {}  # tool_use id -> uuid of the assistant entry holding it
        self.transcript_meta: dict[str, Any] = {}  # cwd, version: as Claude Code writes them

    # -- the call log ----------------------------------------------------------------------

    async def log(self, **record: Any) -> None:
        """Append one record to the call log, awaited (so a crash right after it is known).
        A store that fails loses the record, never the call: `describe` then says less."""
        if self.turn.store is None:
            return
        try:
            await self.turn.store.append(claude_calls.CALLS, [record])
        except Exception:
            logger.warning("claude.call_log_failed", extra={"thread_id": self.turn.thread_id})

    async def log_call(self, call: str, tool: str, tool_input: object) -> None:
        if call and call not in self.logged and tool != ASK_TOOL:
            self.logged.add(call)
            await self.log_session()
            await self.log(e="call", id=call, tool=tool, detail=claude_calls.detail_of(tool_input))

    async def log_step(self, call: str, event: str) -> None:
        if call in self.logged:
            await self.log(e=event, id=call)

    async def log_session(self) -> None:
        if self.session_id and self.session_id != self.logged_session:
            self.logged_session = self.session_id
            await self.log(e="session", sid=self.session_id)

    async def log_results(self, message: UserMessage) -> None:
        content = message.content if isinstance(message.content, list) else []
        for block in content:
            if isinstance(block, ToolResultBlock) and block.tool_use_id in self.logged:
                raw = block.content
                text = raw if isinstance(raw, str) else ""
                if isinstance(raw, list):
                    text = "\n".join(str(c.get("text", "")) for c in raw if isinstance(c, dict))
                record = claude_calls.result_record(block.tool_use_id, block.is_error, text)
                await self.log(**record)
        await self.mirror_result(message)

    async def mirror_result(self, message: UserMessage) -> None:
        """Put a tool result into the stored transcript as soon as it arrives.

        Claude Code writes its transcript on a timer, so its own copy of a result reaches the
        store about 0.1 s after the model has been called with it: a replica killed in that
        window would resume a session that says the call's outcome is unknown, though it ran.
        The entry written here is the one Claude Code writes (same uuid and parent, so the
        later copy is a duplicate the store drops), minus bookkeeping fields it does not need to
        resume."""
        blocks = message.content if isinstance(message.content, list) else []
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        if not results or message.parent_tool_use_id or not message.uuid:
            return
        parent = self.asked_in.get(results[0].tool_use_id)
        if self.store is None or not self.session_id or parent is None:
            return
        entry = {
            "parentUuid": parent,
            "isSidechain": False,
            "type": "user",
            "message": {
                "role": "user",
                "content": [
                    {
                        "tool_use_id": b.tool_use_id,
                        "type": "tool_result",
                        "content": b.content,
                        "is_error": b.is_error,
                    }
                    for b in results
                ],
            },
            "uuid": message.uuid,
            "timestamp": datetime.now(UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "toolUseResult": message.tool_use_result,
            "sourceToolAssistantUUID": parent,
            "userType": "external",
            "entrypoint": "sdk-py",
            "sessionId": self.session_id,
            **self.transcript_meta,
        }
        key: SessionKey = {"project_key": "", "session_id": self.session_id}
        try:
            await self.store.append(key, [cast(SessionStoreEntry, entry)])
        except Exception:
            logger.warning("claude.result_mirror_failed", extra={"thread_id": self.turn.thread_id})

    # -- state -----------------------------------------------------------------------------

    def state(self, pending: Pending | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.session_id:
            out["session_id"] = self.session_id
        if pending is not None:
            out["pending"] = pending.dump()
        return out

    # -- the CLI's kill switch -------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the CLI and everything it started: it writes nothing more (no aborted call
        reaches the transcript). Through the supervisor, which kills the whole tree; a SIGKILL
        of the supervisor itself would leave the CLI's commands (each in a session of its own)
        running."""
        transport = getattr(self.client, "_transport", None)
        process = getattr(transport, "_process", None)
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if self.h.launcher() is not None:
                    process.send_signal(claude_launch.KILL_TREE)
                else:
                    process.kill()
