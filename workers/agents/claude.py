"""The Claude Code harness: the real Claude Code CLI, through `claude-agent-sdk`, as an agent.

Optional: it needs the `claude` extra (`pip install 'prompt-broker[claude]'`, which pins
`claude-agent-sdk==0.2.189`; the SDK bundles the CLI). `workers.runtime.replica.default_harnesses`
registers it as `claude_code` only when the SDK imports.

Config
------
The thread's harness config is an object with any of these keys (anything else is refused with
`broker.BadItem` naming the field; `validate_config` checks one):

- `base_url`: the Anthropic API endpoint (`ANTHROPIC_BASE_URL`); tests point it at a fake.
- `api_key`: the key (`ANTHROPIC_API_KEY`); without it, the worker's own environment's is used.
- `model`: the model name; without it, Claude Code's default.
- `max_turns`: model round trips per turn (default `DEFAULT_MAX_TURNS`).

Every run is isolated: a scratch `CLAUDE_CONFIG_DIR` and `HOME` (under the harness's scratch
root) and `TMPDIR`/`XDG_RUNTIME_DIR` (a short temporary folder, so Claude Code's socket lands
there too), all removed after the run; no filesystem settings (`setting_sources=[]`), Claude
Code's own system prompt, the quieting variables (`QUIET_ENV`: no telemetry, no update checks,
no traffic but the model's), and the work folder as `cwd` (without one, a per-thread folder under
the harness's scratch root). Assistant text goes to the thread as agent output, one item per text
block.

Permissions
-----------
- `approval`: Claude Code's `default` mode. Calls its own engine allows (reads, read-only shell
  commands) run silently; every other call reaches the permission callback, which raises an
  `approval` prompt built by `workers.agents.harness.approval_question` (agent "Claude"), so its
  subject and grant key are the replica's grants'. An affirmative answer (`broker.verdict`) allows
  the call. A person's denial refuses it, saying the person denied it, with their words when the
  answer carried any beyond a bare "no" (a parked answer's typed text, or extra strings in a
  structured answer). A prompt that was not delivered, was cancelled or was parked refuses it
  with `Approval unavailable: ...`, saying that nobody refused it.
- `guarded`: every tool call reaches the permission callback, read-only ones included: a
  `PreToolUse` command hook in the CLI's flag settings (`ASK_EVERY_CALL`) answers "ask" for
  every call, so Claude Code's own engine allows nothing silently, and a worker's deny rules bind
  every call. The callback consults the policy gate (`Turn.gate`) first: `allow` allows, `deny`
  refuses with `Denied by policy rule '<id>'`, `ask` raises the approval prompt. A gate that
  raises denies (`policy_evaluation_error`). Questions are never gated.
- `autonomous`: `bypassPermissions` (with `IS_SANDBOX=1` when running as root, which Claude Code
  otherwise refuses): no approval prompts; `AskUserQuestion` still asks a person.

Questions
---------
Claude Code's own `AskUserQuestion` tool raises an `ask_user_question` prompt with its questions
(an option's `preview` is not shown to the person; it is echoed back in the annotations when that
option is the one picked). The answer goes back in the SDK's documented shape:
`Allow(updated_input={**input, "answers": {<exact question text>: <value>}})`, where the value is
the chosen label, multi-select labels joined by `", "`, or the person's free text. Answer strings
that are not labels, given next to a label (a structured answer), become the question's
`annotations[<text>]["notes"]`. A question with no answer is left out (Claude Code reports only
the answered ones). Answers are keyed by text, so questions sharing a text cannot be told apart
there: the person sees them numbered (`<text> [1/2]`, `<text> [2/2]`), and the one key gets every
answer in question order joined by `"; "`, with a note saying so. An unanswered question (not
delivered, cancelled) is refused with a message saying nobody refused to answer.

Held and parked waits
---------------------
A held wait blocks inside Claude Code's callback (the CLI keeps running, ~200 MB). When the
replica parks a wait (`PromptParked`: wait mode `parked`, the held-wait cap, a clean stop), the
turn ends and the Claude session pauses durably, in Claude Code's own way where it fits:

- Questions are asked from a `PreToolUse` hook, which can return `permissionDecision: "defer"`:
  the CLI stops with the call pending, and the turn ends `parked` with state
  `{"session_id", "pending": {..., "deferred": <tool_use_id>}}`.
- Approvals are asked from the permission callback (only the CLI knows which calls need one), which
  cannot defer: a parked approval is refused `Approval unavailable: ...` (asking the agent to make
  the same call again), and the hook defers the agent's next call, whatever it is. If the agent
  ends its turn instead, the turn ends `parked` with no deferred call.

The transcript lives in Redis: the SDK's `session_store` is backed by `Turn.store` (the thread's
agent store, mirrored eagerly; each ask first waits for the call's transcript entry to land), so
the session resumes on any replica. The answer starts a resume turn there:

- With a deferred call: the same session is resumed with no prompt (`ClaudeSDKClient(resume=...)`
  and `connect()`), and Claude Code replays the pending call with the same `tool_use_id`. If it
  is the call that asked (same question texts; same grant key): a question is answered from
  `Turn.resume`; an approval is refused with the person's denial, or (approved) asks again and the
  replica's one-shot grant answers it. Any other deferred call is refused "not run yet", with the
  resume text. Claude Code's hook may or may not fire on resume (claude-agent-sdk-python #993), so
  the hook never defers a call that has an answer, and the callback gives that same answer either
  way. If the answer did not reach the agent this way (nothing replayed within `REPLAY_GRACE`, or
  the replayed call needed no permission), the resume text (`Turn.prompt`) follows as a message.
  A new turn (not a resume: the prompt was cancelled) refuses the replayed call, saying nobody
  answered or refused it, then sends its message.
- Without one (the agent ended its turn, or a replica died while holding the wait and the state
  came from the ask): the session is resumed with the resume text as the message; Claude Code
  closes the interrupted call itself ("[Tool call interrupted ...]"), and the agent retries.

A run that keeps going after it parked is stopped after `PARK_SETTLE` seconds. A run that is
cancelled (a lost lease) kills its CLI at once, so nothing more is written to the transcript.

The CLI's life
--------------
On Linux the CLI runs under a small supervisor (`workers.agents.claude_launch`, the SDK's `cli_path`
points at a wrapper script that starts it): a child subreaper with a parent-death signal, so
the CLI and every command it started (Claude Code starts each Bash command in a session of its
own) die with the replica however it dies, SIGKILL included. The harness's own kill goes
through it too (`claude_launch.KILL_TREE`), so a killed CLI leaves no command running.

A turn cut off
--------------
Each call's progress is recorded in the thread's agent store as it happens
(`workers.agents.claude_calls`: seen, waiting for a person, allowed, refused, its result), and each
tool result is put into the stored transcript as it arrives (Claude Code's own copy lags the
next model call by about 0.1 s). `describe_interruption` reads that log: "Bash `<command>` ran,
exit code N" when the result was recorded, else "... was interrupted; it may or may not have
taken effect; check before running it again". The next turn (`Turn.interrupted`) continues the
same session and tells the agent what it had been handed and that note, in brackets, before its
input.

Every later turn of the thread continues the same Claude session (`TurnResult.state`'s
`session_id`); if the store no longer has it, a new session starts, and the agent says so.

Layout
------
This module is the harness's public face (`ClaudeHarness`, its config and the names below); the
parts live beside it: `claude_config` (the config), `claude_answers` (questions and answers as
data), `claude_store` (the transcript store), `claude_calls` (reading the call log),
`claude_launch` (the CLI's supervisor), and one turn's run in layers: `claude_state` (its state
and records), `claude_permissions` (the callbacks), `claude_cli` (the CLI's I/O) and
`claude_turn` (the turn's control).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from broker import BadItem
from workers.agents import claude_calls, claude_launch
from workers.agents.claude_answers import ask_questions, updated_input
from workers.agents.claude_cli import QUIET_ENV
from workers.agents.claude_config import (
    DEFAULT_MAX_TURNS,
    HARNESS,
    ClaudeConfig,
    parse_config,
    validate_config,
)
from workers.agents.claude_store import RedisSessionStore
from workers.agents.claude_turn import Run
from workers.agents.harness import AgentStore, Turn, TurnResult

__all__ = [
    "DEFAULT_MAX_TURNS",
    "HARNESS",
    "QUIET_ENV",
    "ClaudeConfig",
    "ClaudeHarness",
    "RedisSessionStore",
    "ask_questions",
    "parse_config",
    "updated_input",
    "validate_config",
]

logger = logging.getLogger("workers.agents.claude")


def _bundled_cli() -> str | None:
    """The CLI the SDK bundles (where the SDK itself looks first)."""
    import claude_agent_sdk

    path = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
    return str(path) if path.is_file() else None


class ClaudeHarness:
    """The real Claude Code CLI as an agent (see the module docstring)."""

    name = HARNESS

    def __init__(
        self, *, scratch_root: str | os.PathLike[str] | None = None, cli_path: str | None = None
    ) -> None:
        self.root = (
            Path(scratch_root)
            if scratch_root
            else Path(tempfile.gettempdir()) / "prompt-broker-claude"
        )
        self.cli_path = cli_path
        self._launcher: str | None = None  # "" when there is none

    def scratch_dir(self) -> Path:
        runs = self.root / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        return runs

    def workdir(self, turn: Turn) -> Path:
        if turn.work_folder:
            return Path(turn.work_folder)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", turn.thread_id)
        folder = self.root / "work" / safe
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def launcher(self) -> str | None:
        """The supervised CLI (`workers.agents.claude_launch`) as one executable, written once; None
        off Linux or with no CLI found (the SDK then runs, or fails to find, the CLI itself)."""
        if self._launcher is not None or not sys.platform.startswith("linux"):
            return self._launcher or None
        real = self.cli_path or _bundled_cli() or shutil.which("claude")
        if real is None:
            self._launcher = ""
            return None
        folder = self.root / "bin"
        folder.mkdir(parents=True, exist_ok=True)
        script = (
            "#!/bin/sh\n"
            f"exec {shlex.quote(sys.executable)} -I -S {shlex.quote(claude_launch.__file__)} "
            f'{shlex.quote(real)} "$@"\n'
        )
        # Atomic: replicas sharing a scratch root may write it at the same time.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".claude-")
        with os.fdopen(fd, "w") as f:
            f.write(script)
        os.chmod(tmp, 0o755)
        target = folder / "claude-supervised"
        os.replace(tmp, target)
        self._launcher = str(target)
        return self._launcher

    async def describe_interruption(
        self, thread_id: str, state: dict[str, Any] | None, store: AgentStore | None
    ) -> str:
        """What the call log says of the call in flight (`workers.agents.claude_calls.describe`)."""
        if store is None:
            return ""
        try:
            records = await store.load(claude_calls.CALLS)
        except Exception:
            logger.warning("claude.call_log_unreadable", extra={"thread_id": thread_id})
            return (
                "what the call in flight had done could not be read; any call may or may not "
                "have taken effect; check before running it again"
            )
        return claude_calls.describe(records)

    async def run_turn(self, turn: Turn) -> TurnResult:
        try:
            config = parse_config(turn.config)
        except BadItem as e:
            return TurnResult(
                "failed", state=turn.state, error=f"the claude_code harness config: {e}"
            )
        run = Run(self, turn, config)
        try:
            return await run.go()
        except asyncio.CancelledError:
            run.kill()
            raise
