"""The Codex harness: the real Codex CLI (`codex app-server`, pinned 0.171.0) behind the agent
interface (`workers.agents.harness`).

Each turn spawns `codex app-server` (JSON-RPC over stdio: one JSON object per line, no
`"jsonrpc"` field) with its own, fresh `CODEX_HOME`, whose `config.toml` points at the model
provider from the thread's config. The Codex thread lives on between turns, on any replica: its
id is the harness `state`, and its rollout (Codex's own JSONL transcript) is kept in Redis through
`Turn.store`, written back into the next turn's `CODEX_HOME` and continued with `thread/resume`.

Config
------
The thread's harness config (every key optional; anything else is refused with `BadItem`):

- `model`: the model slug (a catalogue slug such as `gpt-5.5` gets Codex's `apply_patch` tool).
- `base_url`: a Responses API endpoint (`http(s)://.../v1`); with it Codex uses this provider
  (`wire_api = "responses"`), else Codex's default provider.
- `api_key`, or `api_key_env` (the name of an environment variable of the replica holding it):
  the provider's key, handed to Codex in its environment, never written to disk.
- `approval_policy`: `on-request` (default) or `untrusted`, under `approval` permissions;
  `guarded` always runs `untrusted` (Codex then asks for every command and file change, so the
  worker's deny rules see every call; under `on-request` its sandbox runs what it allows
  unasked), and `autonomous` always runs `never`.
- `sandbox`: `read-only`, `workspace-write` (default) or `danger-full-access`; `autonomous`
  always runs `danger-full-access`.

What Codex asks, and what it is told
------------------------------------
Server requests become prompts through `turn.handle.ask`, one at a time:

- `item/commandExecution/requestApproval`, `item/fileChange/requestApproval` and
  `item/permissions/requestApproval` ask an `approval` (subject: the method; grant key
  `<method>:<command>` for commands only). Options: `Approve`, `Deny`, and `Approve for this
  session` where the request offers a session-wide approval. Replies use Codex's vocabulary:
  `accept` / `acceptForSession` for an approval; `decline` for a person's denial only where the
  request offers it (its `availableDecisions`; Codex 0.171.0 offers none for commands, so a
  denied command gets `cancel`); `cancel` otherwise: a policy `deny`, and whenever nobody
  refused (the prompt was cancelled, could not be delivered, or parked). A permissions request
  is answered `{permissions, scope}`: the requested profile with scope `turn` or `session`, or
  an empty profile (and its turn interrupted).
- `item/tool/requestUserInput` asks an `ask_user_question` (one question per Codex question; free
  text is always accepted, as Codex offers "Other"), answered `{answers: {<id>: {answers:
  [...]}}}`. Its reply has no refusal, so when nobody answered, the turn is interrupted first.
- Any other server request is answered at once: a refusal in its own vocabulary where it has one
  (`cancel`, `abort`, a failed dynamic tool call), else a JSON-RPC error. Never silence.

`cancel` makes Codex write "aborted by user" as the call's output and "The user interrupted the
previous turn on purpose" after it, neither true. The transcript is rewritten as it is stored
(see `codex_recorder.Recorder.sync`): the model reads our words there instead (`Approval
unavailable: ...`, `Denied by policy rule ...`, `The person denied ...`, `Approval pending:
...`). Except when parked, a follow-up turn starts at once with the same words as its input, so
the model's very next request carries them (Codex's `turn/steer` cannot: a cancelled turn is
over, and `decline` would show the model "rejected by user" in that same request).

Every call is recorded as it goes (`workers.agents.codex_transcript`: its approval request, our
reply before it is sent, its result and the transcript up to its output the moment Codex reports
it), so after a crash `describe_interruption` says "ran, exit code N" or "was interrupted; it may or
may not have taken effect", and the next turn (`Turn.interrupted`) resumes a transcript that
ends in that truth rather than in Codex's "aborted".

Under `guarded` permissions `turn.gate("codex", method, params)` decides first: `allow`
approves, `deny` refuses (as above), `ask` asks a person. Agent messages are posted with
`turn.emit`.

Parking: when `handle.ask` raises `PromptParked`, the harness answers `cancel` (or interrupts),
lets the turn end, and returns `parked` with the Codex thread in `state` (also stored with the
prompt, so a replica that dies while Codex waits loses nothing). The answer starts a resume turn,
possibly elsewhere: the same Codex thread is resumed with the resume text, the agent retries, and
the replica's one-shot grant answers the retried approval.

The binary is `find_codex()`'s: `$CODEX_BIN`, else the repository's pinned npm install (`npm
install` at the root; its native binary is run directly, with no node shim), else `codex` on
PATH. Per-turn homes are temporary folders (`pb-codex-*`, removed after the turn); those of a
replica that was killed are swept by the next harness on the host (`sweep_homes`). Session-wide
approvals (`acceptForSession`, scope `session`) last as long as Codex's process: this turn.

The parts, each a module of its own: `codex_config` (the binary, the config, the per-turn
homes), `codex_prompts` (Codex's requests as questions, answers as its replies, our words),
`codex_rpc` (the app-server process and its JSON-RPC), `codex_recorder` (the ledger's writes and
the rollout's copy in the store), `codex_transcript` (what they say after a crash) and
`codex_turn` (one turn, start to end). This module is the harness, and the public face.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker import BadItem
from workers.agents.codex_config import (
    DEFAULT_FEATURES,
    HOME_PREFIX,
    OWNER,
    PINNED_VERSION,
    CodexConfig,
    find_codex,
    parse_config,
    sweep_homes,
    validate_config,
)
from workers.agents.codex_prompts import (
    APPROVAL_METHODS,
    COMMAND,
    FILE_CHANGE,
    PERMISSIONS,
    SESSION_LABEL,
    USER_INPUT,
    answers_payload,
    approval_payload,
    approval_question,
    other_reply,
    user_input_questions,
)
from workers.agents.codex_rpc import CodexError, Trace
from workers.agents.codex_transcript import CALLS_KEY, calls_of, describe, interrupted_writer
from workers.agents.codex_turn import Run
from workers.agents.harness import AgentStore, Turn, TurnResult

logger = logging.getLogger("workers.agents.codex")

#: What other code imports from here: the harness, and (re-exported from `codex_config` and
#: `codex_prompts`) the config, the methods and the question/reply mapping.
__all__ = [
    "APPROVAL_METHODS",
    "COMMAND",
    "FILE_CHANGE",
    "PERMISSIONS",
    "PINNED_VERSION",
    "SESSION_LABEL",
    "USER_INPUT",
    "CodexConfig",
    "CodexHarness",
    "answers_payload",
    "approval_payload",
    "approval_question",
    "find_codex",
    "other_reply",
    "parse_config",
    "sweep_homes",
    "user_input_questions",
    "validate_config",
]


# -- the harness -----------------------------------------------------------------------------


class CodexHarness:
    """The real Codex CLI as a coding agent (see the module docstring)."""

    name = "codex"

    def __init__(
        self,
        binary: str | None = None,
        *,
        home_root: str | None = None,
        features: Sequence[str] = DEFAULT_FEATURES,
        trace: Trace | None = None,
    ) -> None:
        self._binary = binary
        self.home_root = home_root
        self.features = tuple(features)
        self.trace = trace
        self._swept = False

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        """The last call of the cut-off turn, from the call ledger
        (`workers.agents.codex_transcript`): "ran, exit code N" when its result was recorded, "did
        not run" when it provably did not (refused, or still waiting for approval), else
        "interrupted; it may or may not have taken effect"."""
        if store is None:
            return ""
        try:
            ledger = await store.load(CALLS_KEY) or []
        except Exception:
            logger.warning("codex.ledger_unreadable", extra={"thread_id": thread_id})
            return (
                "What the interrupted turn was doing is not known (its record could not be read);"
                " check before running its last call again"
            )
        writer = interrupted_writer(ledger, state)
        if writer is None:
            return ""
        calls = calls_of(ledger, writer)
        return describe(list(calls.values())[-1]) if calls else ""

    async def run_turn(self, turn: Turn) -> TurnResult:
        try:
            cfg = parse_config(turn.config)
        except BadItem as e:
            return TurnResult("failed", state=turn.state, error=f"the codex harness: {e}")
        binary = find_codex(self._binary)
        if binary is None:
            return TurnResult(
                "failed",
                state=turn.state,
                error="the codex CLI is not installed: run `npm install` at the repository root"
                " (package.json pins @openai/codex), or set CODEX_BIN",
            )
        if not self._swept:
            self._swept = True
            await asyncio.to_thread(sweep_homes, self.home_root)
        result, follow_up = await self._run_once(binary, turn, cfg)
        if follow_up and result.status == "completed" and turn.store is not None:
            # Codex's turn was ended on our behalf (nobody could answer, or a refusal Codex's
            # reply cannot carry): tell the agent now, in a turn of its own, rather than when
            # the person next writes. Once: a second such stop waits for the next turn.
            again = replace(turn, prompt="", state=result.state, resume=None, interrupted=None)
            told, _ = await self._run_once(binary, again, cfg)
            if told.status == "failed":  # the notes stay in the state: the next turn tells them
                logger.warning("codex.follow_up_failed", extra={"error": told.error})
                return result
            return told
        return result

    async def _run_once(self, binary: str, turn: Turn, cfg: CodexConfig) -> tuple[TurnResult, bool]:
        home = Path(tempfile.mkdtemp(prefix=HOME_PREFIX, dir=self.home_root))
        (home / OWNER).write_text(str(os.getpid()))
        run = Run(binary, turn, cfg, home, features=self.features, trace=self.trace)
        try:
            return await run.run(), run.follow_up
        except CodexError as e:
            tail = run.app.stderr_tail()
            error = f"codex: {e}" + (f" (stderr: {tail})" if tail else "")
            return TurnResult("failed", state=turn.state, error=error), False
        finally:
            await run.close()
            await asyncio.to_thread(shutil.rmtree, home, True)
