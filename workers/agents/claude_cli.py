"""The Claude harness's I/O with the Claude Code CLI, through the SDK's client.

`CliSession` adds to a turn's run the CLI itself: its options (an isolated environment, the
permission mode, the callbacks of `claude_permissions`, the transcript store), connecting
(resuming a session), sending the turn's messages, reading the CLI's messages until its result
(assistant text to the thread, each tool result to the call log and the stored transcript), and
closing it, killing it when the run failed or was cut off. See "Config" and "The CLI's life" in
`workers.agents.claude`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

from claude_agent_sdk import (
    AssistantMessage,
    CanUseToolShadowedWarning,
    ClaudeAgentOptions,
    ClaudeSDKClient,
    HookMatcher,
    ResultMessage,
    SessionStore,
    SystemMessage,
    TextBlock,
    ToolUseBlock,
    UserMessage,
)

from workers.agents import claude_calls, claude_launch
from workers.agents.claude_permissions import Permissions

__all__ = ["ASK_EVERY_CALL", "PARK_SETTLE", "QUIET_ENV", "REPLAY_GRACE", "CliSession"]

#: The harness's one logger: its records keep this name whichever module of the harness logs.
logger = logging.getLogger("workers.agents.claude")

# bypassPermissions (autonomous) shadows the callback for ordinary tools, on purpose; the SDK's
# warning is wrong for AskUserQuestion, which still reaches it.
warnings.filterwarnings("ignore", category=CanUseToolShadowedWarning)

#: A held question waits in the PreToolUse hook: give it a week (below the CLI's timer limit).
HOOK_TIMEOUT = 7 * 24 * 3600.0
#: How long a resumed session gets to start replaying its deferred call.
REPLAY_GRACE = 15.0
#: How long a run may go on after one of its waits parked.
PARK_SETTLE = 30.0
#: Claude Code's traffic is the model's only: no telemetry, update checks or error reports.
QUIET_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
#: Guarded mode's flag settings: a command hook that answers "ask" for every tool call, so that
#: Claude Code's own engine allows nothing silently (reads, read-only shell commands) and every
#: call reaches the permission callback, where the gate decides. A settings hook is loaded when
#: the CLI starts, so unlike the SDK's in-process hook it also sees a call replayed on resume.
ASK_EVERY_CALL = json.dumps(
    {
        "hooks": {
            "PreToolUse": [
                {
                    "matcher": "*",
                    "hooks": [
                        {
                            "type": "command",
                            "command": "echo "
                            + shlex.quote(
                                json.dumps(
                                    {
                                        "hookSpecificOutput": {
                                            "hookEventName": "PreToolUse",
                                            "permissionDecision": "ask",
                                        }
                                    }
                                )
                            ),
                        }
                    ],
                }
            ]
        }
    }
)


class CliSession(Permissions):
    """A turn's run with its CLI: the options, the messages both ways, the close."""

    # -- the CLI ---------------------------------------------------------------------------

    def options(self, scratch: Path, cwd: Path, resume: str | None) -> ClaudeAgentOptions:
        assert self.tmpdir is not None
        env = {
            **QUIET_ENV,
            "CLAUDE_CONFIG_DIR": str(scratch / "config"),
            "HOME": str(scratch / "home"),
            # Short, so Claude Code's socket (<dir>/cc-socks/<pid>.sock, at most 103 bytes) fits
            # in it rather than falling back to a shared /tmp/cc-socks-<uid>.
            "TMPDIR": str(self.tmpdir),
            "XDG_RUNTIME_DIR": str(self.tmpdir),
        }
        if self.config.base_url:
            env["ANTHROPIC_BASE_URL"] = self.config.base_url
        if self.config.api_key:
            env["ANTHROPIC_API_KEY"] = self.config.api_key
        autonomous = self.turn.permissions == "autonomous"
        if autonomous and hasattr(os, "geteuid") and os.geteuid() == 0:
            env["IS_SANDBOX"] = "1"  # bypassPermissions is refused as root otherwise
        cli = self.h.launcher()
        if cli is not None:
            # Which process the supervisor must outlive: it exits at once if this one is gone.
            env[claude_launch.PARENT_ENV] = str(os.getpid())
        for d in ("config", "home"):
            (scratch / d).mkdir(parents=True, exist_ok=True)
        return ClaudeAgentOptions(
            cwd=str(cwd),
            env=env,
            setting_sources=[],
            system_prompt={"type": "preset", "preset": "claude_code"},
            permission_mode="bypassPermissions" if autonomous else "default",
            settings=ASK_EVERY_CALL if self.turn.permissions == "guarded" else None,
            can_use_tool=self.can_use_tool,
            hooks={
                "PreToolUse": [
                    HookMatcher(matcher=None, hooks=[self.pre_tool_use], timeout=HOOK_TIMEOUT)
                ]
            },
            model=self.config.model,
            max_turns=self.config.max_turns,
            resume=resume,
            session_store=cast(SessionStore, self.store) if self.store else None,
            session_store_flush="eager",
            cli_path=cli or self.h.cli_path,
            stderr=self.stderr.append,
        )

    async def next_result(
        self, messages: asyncio.Queue[Any], first: float | None = None
    ) -> ResultMessage | None:
        """Emit assistant text until the CLI's result; None when the stream ended, or when
        nothing happened within `first` seconds (a resume with nothing to replay)."""
        loop = asyncio.get_running_loop()
        while True:
            timeout = None
            if first is not None and not self.activity.is_set():
                timeout = first
            if self.parked is not None:
                timeout = max(0.0, self.parked_at + PARK_SETTLE - loop.time())
            try:
                message = await asyncio.wait_for(messages.get(), timeout)
            except TimeoutError:
                if self.parked is not None:
                    logger.warning("claude.park_settle", extra={"thread_id": self.turn.thread_id})
                    self.kill()
                return None
            if message is None:
                return None
            if isinstance(message, BaseException):
                raise message
            self.activity.set()
            result = await self.take(message)
            if result is not None:
                return result

    async def take(self, message: Any) -> ResultMessage | None:
        if isinstance(message, SystemMessage) and message.subtype == "init":
            await self.started(message.data)
        elif isinstance(message, UserMessage):
            await self.log_results(message)  # as each result arrives, not at the turn's end
        elif isinstance(message, AssistantMessage):
            for block in message.content:
                if isinstance(block, ToolUseBlock) and message.uuid:
                    self.asked_in[block.id] = message.uuid
                if isinstance(block, TextBlock) and block.text.strip():
                    await self.turn.emit(block.text)
        elif isinstance(message, ResultMessage):
            if message.session_id:
                self.session_id = message.session_id
            return message
        return None

    async def started(self, data: dict[str, Any]) -> None:
        """The CLI's init message: the session id, and what its transcript entries carry."""
        sid = data.get("session_id")
        if isinstance(sid, str) and sid:
            self.session_id = sid
            await self.log_session()
        for ours, theirs in (("cwd", "cwd"), ("version", "claude_code_version")):
            if isinstance(data.get(theirs), str):
                self.transcript_meta[ours] = data[theirs]

    async def drive(
        self, scratch: Path, cwd: Path, resume: str | None, prompts: list[str], replay: bool
    ) -> ResultMessage | None:
        """Connect (resuming `resume`), let a deferred call replay, then send each prompt."""
        self.client = client = ClaudeSDKClient(self.options(scratch, cwd, resume))
        messages: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for message in client.receive_messages():
                    messages.put_nowait(message)
            except Exception as e:
                messages.put_nowait(e)
            finally:
                messages.put_nowait(None)

        reader: asyncio.Task[None] | None = None
        ok = False
        try:
            await client.connect()
            reader = asyncio.create_task(pump())
            result = None
            if replay:
                result = await self.next_result(messages, first=REPLAY_GRACE)
                if self.told:
                    # the replayed call's tool_result told the agent; a cut-off turn still must
                    prompts = [p for p in [claude_calls.preface(self.turn.interrupted)] if p]
            for prompt in prompts:
                if self.parked is not None or self.fatal is not None:
                    break
                await client.query(prompt)
                result = await self.next_result(messages)
            ok = True
            return result
        finally:
            if not ok or self.fatal is not None:
                self.kill()  # a failure, a lost thread: the CLI must write nothing more
            await self.close(client, reader)

    async def close(self, client: ClaudeSDKClient, reader: asyncio.Task[None] | None) -> None:
        # The SDK's copy of a resumed transcript (a temporary folder it removes on a clean
        # disconnect): removed here too when the disconnect did not get that far.
        materialized = getattr(getattr(client, "_materialized", None), "config_dir", None)
        try:
            await client.disconnect()
        except asyncio.CancelledError:
            self.kill()
            raise
        except Exception:
            self.kill()
            logger.debug("claude.disconnect_failed", exc_info=True)
        finally:
            if isinstance(materialized, Path):
                shutil.rmtree(materialized, ignore_errors=True)
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
