"""The Claude harness's turn control: one turn of a Claude session, start to end.

`Run` is a turn's run complete (state and records, permission callbacks, the CLI's I/O): it
decides whether a deferred call replays first, opens the turn (after a cut-off turn, with what
is known of it), drives the CLI, starts a new session when the stored one is gone, and says how
the turn ended: completed, failed, or parked on a wait (with the state to resume it from).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path

from claude_agent_sdk import ClaudeSDKError, ResultMessage

from workers.agents import claude_calls
from workers.agents.claude_cli import CliSession
from workers.agents.harness import TurnResult

__all__ = ["Run"]


class Run(CliSession):
    """One turn of a Claude session: the CLI, its callbacks, and what the turn ends with."""

    # -- the turn --------------------------------------------------------------------------

    def plan(self) -> bool:
        """Replay a deferred call first? On a resume turn the prompt (the resume text) follows
        only if the replayed call did not take the answer; on a new turn (the prompt it waited on
        was cancelled) the call is refused, then the message follows."""
        before = self.before
        if before is None or not before.deferred or not self.session_id:
            return False
        self.replayed = before.deferred
        return True

    async def go(self) -> TurnResult:
        cwd = self.h.workdir(self.turn)
        if not cwd.is_dir():
            return TurnResult(
                "failed", state=self.state(), error=f"the work folder {cwd} does not exist"
            )
        scratch = Path(tempfile.mkdtemp(prefix="run-", dir=self.h.scratch_dir()))
        self.tmpdir = Path(tempfile.mkdtemp(prefix="pbc-"))
        try:
            return await self.attempt(scratch, cwd)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)
            await asyncio.to_thread(shutil.rmtree, self.tmpdir, True)

    def opening(self) -> str:
        """The turn's first message: after a cut-off turn, what is known of it comes first."""
        told = claude_calls.preface(self.turn.interrupted)
        return f"{told}\n\n{self.turn.prompt}" if told else self.turn.prompt

    async def attempt(self, scratch: Path, cwd: Path) -> TurnResult:
        if self.turn.interrupted is not None and self.session_id is None and self.turn.store:
            # A first turn cut off before its state was stored: continue its own session.
            with contextlib.suppress(Exception):
                records = await self.turn.store.load(claude_calls.CALLS)
                self.session_id = claude_calls.last_session(records)
        await self.log(e="turn")
        replay = self.plan()
        resumed = self.session_id
        first = self.opening()
        try:
            try:
                result = await self.drive(scratch, cwd, resumed, [first], replay)
            except ClaudeSDKError as e:
                if resumed and "No conversation found" in f"{e} {' '.join(self.stderr)}":
                    await self.turn.emit(
                        "(the earlier Claude session could not be found; starting a new one)"
                    )
                    self.session_id, self.replayed = None, None
                    result = await self.drive(scratch, cwd, None, [first], False)
                else:
                    raise
        except ClaudeSDKError as e:
            if self.fatal is not None:
                raise self.fatal from e
            if self.parked is not None:
                return self.parked_result()
            return TurnResult("failed", state=self.state(), error=self.describe(e))
        if self.fatal is not None:
            raise self.fatal
        if self.parked is not None:
            return self.parked_result()
        return self.finished(result)

    def parked_result(self) -> TurnResult:
        assert self.parked is not None
        return TurnResult("parked", state=self.state(self.pending), parked=self.parked)

    def finished(self, result: ResultMessage | None) -> TurnResult:
        if result is None:
            tail = "; ".join(list(self.stderr)[-3:])
            error = "Claude Code stopped without a result" + (f": {tail}" if tail else "")
            return TurnResult("failed", state=self.state(), error=error)
        if result.is_error:
            detail = result.result or "; ".join(result.errors or []) or result.subtype
            return TurnResult("failed", state=self.state(), error=f"Claude Code: {detail}")
        return TurnResult("completed", state=self.state())

    def describe(self, error: BaseException) -> str:
        tail = "; ".join(list(self.stderr)[-3:])
        return f"Claude Code failed: {error}" + (f" ({tail})" if tail else "")
