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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker import BadItem, Kind, PromptCancelled, PromptUnavailable, Question
from workers.agents.codex_config import (
    DEFAULT_FEATURES,
    HOME_PREFIX,
    OWNER,
    PINNED_VERSION,
    SANDBOX_POLICY,
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
    Decision,
    NotAnswered,
    Outcome,
    answers_payload,
    approval_payload,
    approval_question,
    call_what,
    decision_of,
    ended_words,
    item_kind,
    item_what,
    offers,
    other_reply,
    request_what,
    unanswered_words,
    user_input_questions,
    why_unanswered,
)
from workers.agents.codex_recorder import ROLLOUT, Recorder, Rollout, holds
from workers.agents.codex_rpc import AppServer, CodexError, Rpc, Trace
from workers.agents.codex_transcript import (
    CALLS_KEY,
    calls_of,
    describe,
    interrupted_writer,
)
from workers.agents.harness import (
    AgentStore,
    GateVerdict,
    PromptParked,
    Turn,
    TurnResult,
    describe_delivered,
)

logger = logging.getLogger("workers.agents.codex")

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

_START_TIMEOUT = 60.0  # seconds for the app-server to answer initialize / thread / turn start


# -- one turn --------------------------------------------------------------------------------


class _Run:
    """One turn of one Codex thread: a process, its JSON-RPC connection, its prompts."""

    def __init__(
        self, harness: CodexHarness, binary: str, turn: Turn, cfg: CodexConfig, home: Path
    ) -> None:
        self.h = harness
        self.binary = binary
        self.turn = turn
        self.cfg = cfg
        self.home = home
        self.app = AppServer(binary, home, harness.trace)
        self.rpc: Rpc | None = None
        self.recorder = Recorder(turn, home)  # the ledger and the rollout's copy in the store
        self.thread_id: str | None = None
        self.turn_id: str | None = None
        self.done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.fatal: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.lock = asyncio.Lock()  # one question to a person at a time
        self.parked: PromptParked | None = None
        self.notes: list[str] = []  # told to the agent at the start of its next turn
        self.follow_up = False  # tell the agent at once, in a follow-up turn (see `run_turn`)
        self.items: dict[str, dict[str, Any]] = {}  # item/started, by id (file changes)
        self.tasks: set[asyncio.Task[None]] = set()
        self.emits: asyncio.Queue[str | None] = asyncio.Queue()
        self.emitter: asyncio.Task[None] | None = None

    # -- policy ------------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        if self.turn.permissions == "autonomous":
            return "never"
        if self.turn.permissions == "guarded":
            # `untrusted` asks for every command and every file change, whatever the sandbox:
            # the only policy under which the worker's deny rules see every call. Under
            # `on-request` Codex runs what its sandbox allows without asking anyone.
            return "untrusted"
        return self.cfg.approval_policy

    @property
    def sandbox(self) -> str:
        return "danger-full-access" if self.turn.permissions == "autonomous" else self.cfg.sandbox

    @property
    def cwd(self) -> str:
        folder = self.turn.work_folder
        if folder and os.path.isdir(folder):
            return folder
        work = self.home / "work"
        work.mkdir(exist_ok=True)
        return str(work)

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> TurnResult:
        state = self.turn.state or {}
        restored = await self.recorder.restore(state)
        self.rpc = await self.app.spawn(
            self.cfg,
            self.h.features,
            self.cwd,
            thread_id=self.turn.thread_id,
            on_request=self._on_request,
            on_notification=self._on_notification,
        )
        self.emitter = asyncio.create_task(self._emit_loop(), name="codex emit")
        self.recorder.start()
        await self.rpc.call(
            "initialize",
            {
                "clientInfo": {"name": "prompt-broker", "title": "prompt-broker", "version": "0"},
                "capabilities": {"experimentalApi": False, "requestAttestation": False},
            },
            _START_TIMEOUT,
        )
        await self.rpc.notify("initialized")
        thread = await self._open_thread(restored)
        self.thread_id = str(thread["id"])
        path = thread.get("path")
        if self.recorder.rollout is None or self.recorder.rollout.codex_thread != self.thread_id:
            rel = _relative(path, self.home)
            self.recorder.rollout = Rollout(self.thread_id, rel) if ROLLOUT.fullmatch(rel) else None
        if self.recorder.rollout is not None:
            start = state.get("writer") if isinstance(state.get("writer"), str) else None
            self.recorder.record_later(
                {"ev": "turn", "from": start, "codex_thread": self.thread_id}
            )
        told = [*self._interruption(), *self._old_notes(state), self.turn.prompt]
        text = "\n\n".join(told).strip() or "(continue)"
        started = await self.rpc.call(
            "turn/start",
            {
                "threadId": self.thread_id,
                "input": [{"type": "text", "text": text, "text_elements": []}],
                "approvalPolicy": self.policy,
                "sandboxPolicy": SANDBOX_POLICY[self.sandbox],
            },
            _START_TIMEOUT,
        )
        self.turn_id = str(started["turn"]["id"])
        finished = await self._wait_turn()
        return await self._result(finished)

    def _interruption(self) -> list[str]:
        """What the agent is told first when its previous turn was cut off."""
        cut = self.turn.interrupted
        if cut is None:
            return []
        parts = ["Your previous turn was cut off before it ended: the replica running it stopped."]
        if cut.delivered is not None:
            parts.append(
                f"Before that you had been handed {describe_delivered(cut.delivered)}; it is"
                " not handed over again."
            )
        if cut.note:
            parts.append(cut.note.rstrip(".") + ".")
        parts.append("Nothing of that turn is repeated; a call you make again is asked again.")
        return [" ".join(parts)]

    def _old_notes(self, state: dict[str, Any]) -> list[str]:
        notes = state.get("notes")
        return [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []

    async def _open_thread(self, restored: bool) -> dict[str, Any]:
        assert self.rpc is not None
        common: dict[str, Any] = {
            "cwd": self.cwd,
            "approvalPolicy": self.policy,
            "sandbox": self.sandbox,
        }
        if self.cfg.model:
            common["model"] = self.cfg.model
        if restored and self.recorder.rollout is not None:
            try:
                res = await self.rpc.call(
                    "thread/resume",
                    {
                        "threadId": self.recorder.rollout.codex_thread,
                        "excludeTurns": True,
                        **common,
                    },
                    _START_TIMEOUT,
                )
                return dict(res["thread"])
            except CodexError as e:
                logger.warning(
                    "codex.resume_failed",
                    extra={"thread_id": self.turn.thread_id, "error": str(e)},
                )
                await self.turn.emit(
                    f"(The Codex session {self.recorder.rollout.codex_thread} could not be resumed:"
                    f" {e}. Starting a new one.)"
                )
                self.recorder.rollout = None
        res = await self.rpc.call("thread/start", common, _START_TIMEOUT)
        return dict(res["thread"])

    async def _wait_turn(self) -> dict[str, Any]:
        assert self.rpc is not None
        waits: set[asyncio.Future[Any]] = {self.done, self.fatal, self.rpc.closed}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.fatal.done():
            raise self.fatal.result()
        if self.done.done():
            return self.done.result()
        raise CodexError("the codex app-server exited in the middle of the turn")

    async def _result(self, finished: dict[str, Any]) -> TurnResult:
        await self._drain_emits()
        await self.app.stop()
        await self.recorder.drain()
        await self.recorder.sync()
        state = self._state()
        status = finished.get("status")
        if self.parked is not None:
            return TurnResult("parked", state=state, parked=self.parked)
        if status == "failed":
            error = finished.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            return TurnResult("failed", state=state, error=f"codex: {message or 'turn failed'}")
        return TurnResult("completed", state=state)

    def _state(self, *, open: bool = False) -> dict[str, Any]:
        """The harness state; `open` for one stored with a question, in the middle of the turn
        (so a replica that finds the turn cut off knows which turn's ledger to read)."""
        state: dict[str, Any] = {"codex_thread": self.thread_id}
        if self.recorder.rollout is not None:
            state["rollout"] = self.recorder.rollout.rel
            state["segments"] = self.recorder.rollout.state_segments()
            state["writer"] = self.recorder.rollout.writer
            if open:
                state["open"] = True
        if self.notes:
            state["notes"] = list(self.notes)
        return state

    # -- teardown ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Whatever happened, leave nothing running."""
        for task in self.tasks:
            task.cancel()
        self.recorder.cancel()
        if self.emitter is not None and not self.emitter.done():
            self.emitter.cancel()
        await self.app.close()

    # -- output ------------------------------------------------------------------------------

    async def _emit_loop(self) -> None:
        while (text := await self.emits.get()) is not None:
            try:
                await self.turn.emit(text)
            except Exception as e:  # a lost lease, a fenced post: the turn must stop
                self._fail(e)
                return

    async def _drain_emits(self) -> None:
        if self.emitter is None:
            return
        await self.emits.put(None)
        waits: set[asyncio.Future[Any]] = {self.emitter, self.fatal}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.fatal.done():
            raise self.fatal.result()

    def _fail(self, e: BaseException) -> None:
        if not self.fatal.done():
            self.fatal.set_result(e)

    def _on_notification(self, msg: dict[str, Any]) -> None:
        method = msg.get("method")
        params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
        assert isinstance(params, dict)
        if method == "item/started":
            item = params.get("item")
            if isinstance(item, dict) and item.get("type") in ("fileChange", "commandExecution"):
                item_id = str(item.get("id"))
                if item.get("type") == "fileChange":
                    self.items[item_id] = item
                self.recorder.record_call(item_id, item_what(item), item_kind(item), asked=False)
        elif method == "item/completed":
            item = params.get("item")
            if isinstance(item, dict) and item.get("type") == "agentMessage":
                text = item.get("text")
                if isinstance(text, str) and text.strip():
                    self.emits.put_nowait(text)
            elif isinstance(item, dict) and item.get("type") in ("fileChange", "commandExecution"):
                self.recorder.record_result(item)
        elif (
            method == "turn/completed"
            and params.get("threadId") in (None, self.thread_id)
            and not self.done.done()
        ):
            turn = params.get("turn")
            self.done.set_result(turn if isinstance(turn, dict) else {})

    # -- server requests ---------------------------------------------------------------------

    def _on_request(self, msg: dict[str, Any]) -> None:
        task = asyncio.create_task(self._answer(msg), name=f"codex {msg.get('method')}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, msg: dict[str, Any]) -> None:
        assert self.rpc is not None
        method = str(msg.get("method"))
        params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
        assert isinstance(params, dict)
        replied = False
        result: dict[str, Any] | None
        try:
            if method in APPROVAL_METHODS:
                result = await self._approval(method, params)
            elif method == USER_INPUT:
                result = await self._user_input(params)
            else:
                result, error = other_reply(method)
                if error is not None:
                    await self.rpc.reply_error(msg["id"], error)
                    replied = True
                    return
                logger.info("codex.request_refused", extra={"method": method})
            assert result is not None
            await self.rpc.reply(msg["id"], result)
            replied = True
        except CodexError as e:
            logger.warning("codex.reply_failed", extra={"method": method, "error": str(e)})
        except asyncio.CancelledError:
            replied = True  # the turn is being torn down with its process: nothing to say
            raise
        except Exception:
            logger.exception("codex.request_failed", extra={"method": method})
        finally:
            if not replied and self.rpc is not None and not self.fatal.done():
                with contextlib.suppress(CodexError, OSError):
                    await self.rpc.reply_error(
                        msg["id"], {"code": -32603, "message": "prompt-broker could not answer"}
                    )

    async def _ask(self, kind: Kind, questions: list[Question], item_id: str) -> Outcome:
        async with self.lock:
            if self.parked is not None:
                return NotAnswered("parked")
            await self.recorder.sync_now(wait_for=holds(item_id))
            try:
                return await self.turn.handle.ask(kind, questions, state=self._state(open=True))
            except PromptParked as e:
                self.parked = e
                return NotAnswered("parked")
            except PromptCancelled as e:
                return NotAnswered("cancelled", e.reason or "no reason given")
            except PromptUnavailable as e:
                return NotAnswered("unavailable", str(e.cause))
            except Exception as e:  # e.g. the replica lost the thread: the turn stops here
                self._fail(e)
                raise

    async def _approval(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        item_id = str(params.get("itemId", ""))
        changes = self.items.get(item_id, {}).get("changes")
        what = request_what(method, params)
        if item_id:
            self.recorder.known.add(item_id)
            call = call_what(method, params, changes)
            kind = {COMMAND: "command", FILE_CHANGE: "file"}.get(method, "permissions")
            entry = {"ev": "call", "id": item_id, "what": call, "kind": kind, "asked": True}
            await self.recorder.record_now(entry)
        if self.turn.permissions == "autonomous":  # Codex runs `never`: it should not ask
            return await self._reply(method, params, item_id, "accept")
        if self.turn.permissions == "guarded" and self.turn.gate is not None:
            try:
                verdict = await self.turn.gate("codex", method, params)
            except Exception:
                logger.exception("codex.gate_failed", extra={"method": method})
                verdict = GateVerdict("deny", rule="policy_evaluation_error")
            if verdict.action == "allow":
                return await self._reply(method, params, item_id, "accept")
            if verdict.action == "deny":
                logger.info("codex.policy_denied", extra={"method": method, "rule": verdict.rule})
                refusal = f"Denied by policy rule '{verdict.rule or 'default'}'"
                return await self._refuse(
                    method,
                    params,
                    item_id,
                    output=f"{refusal}: {what} was refused and nothing was run. Nobody was asked.",
                    note=f"{refusal}: your request for {what} was refused by the worker's policy,"
                    " not by a person, and nothing was run. Carry on without it.",
                    why="the worker's policy refused a call",
                )
        question = approval_question(method, params, changes)
        outcome = await self._ask("approval", [question], item_id)
        if isinstance(outcome, NotAnswered):
            return await self._unanswered(method, params, item_id, outcome, what)
        decision = decision_of(outcome)
        if decision == "session" and self.turn.permissions == "guarded":
            decision = "accept"  # a session-wide approval would keep later calls from the gate
        if decision == "decline" and not offers(method, params, "decline"):
            return await self._refuse(
                method,
                params,
                item_id,
                output=f"The person denied {what}; nothing was run.",
                note=f"The person denied your request for {what}; nothing was run. Carry on"
                " without it, or ask them what they would rather you do.",
                why="the person denied a call",
            )
        return await self._reply(method, params, item_id, decision)

    async def _reply(
        self, method: str, params: dict[str, Any], item_id: str, decision: Decision
    ) -> dict[str, Any]:
        """The reply, once the ledger holds it: a crash after this reads as "may have run"."""
        payload = approval_payload(method, params, decision)
        recorded = await self.recorder.record_now(
            {"ev": "reply", "id": item_id, "decision": decision}
        )
        if not recorded and decision in ("accept", "session"):
            # Unrecorded, an approval could run a call that a replica taking over would
            # report as never run: refuse it instead; asking again will retry.
            outcome = NotAnswered("unavailable", "the approval could not be recorded")
            return await self._unanswered(
                method, params, item_id, outcome, request_what(method, params)
            )
        return payload

    async def _refuse(
        self,
        method: str,
        params: dict[str, Any],
        item_id: str,
        *,
        output: str,
        note: str,
        why: str,
        follow_up: bool = True,
    ) -> dict[str, Any]:
        """Stop a call nobody (or the policy, or a person where `decline` is not offered)
        approved, in words of our own: `cancel` ends Codex's turn; the model reads `output` as
        the call's result instead of Codex's "aborted by user" (the transcript is rewritten as
        it is stored), and `note` right after, in a follow-up turn started at once."""
        if item_id:
            self.recorder.told[item_id] = output
        self.recorder.aborted = ended_words(why)
        if note:
            self.notes.append(note)
        self.follow_up = self.follow_up or follow_up
        if method == PERMISSIONS:  # its reply has no cancel: interrupt, then grant nothing
            await self._interrupt()
        await self.recorder.record_now({"ev": "reply", "id": item_id, "decision": "cancel"})
        return approval_payload(method, params, "cancel")

    async def _unanswered(
        self, method: str, params: dict[str, Any], item_id: str, outcome: NotAnswered, what: str
    ) -> dict[str, Any]:
        output, note = unanswered_words(outcome, what)
        return await self._refuse(
            method,
            params,
            item_id,
            output=output,
            note=note,
            why=why_unanswered(outcome),
            follow_up=outcome.why != "parked",
        )

    async def _user_input(self, params: dict[str, Any]) -> dict[str, Any]:
        questions = user_input_questions(params)
        if not questions:
            return {"answers": {}}
        item_id = str(params.get("itemId", ""))
        outcome = await self._ask("ask_user_question", questions, item_id)
        if isinstance(outcome, NotAnswered):
            output, note = unanswered_words(outcome, "an answer to your question", "Question")
            if item_id:
                self.recorder.told[item_id] = output
            self.recorder.aborted = ended_words(why_unanswered(outcome))
            if note:
                self.notes.append(note)
            self.follow_up = self.follow_up or outcome.why != "parked"
            await self._interrupt()  # its reply cannot refuse: end the turn before replying
            return {"answers": {}}  # no answer to any question
        return answers_payload(params, outcome)

    async def _interrupt(self) -> None:
        if self.rpc is None or self.thread_id is None or self.turn_id is None:
            return
        with contextlib.suppress(CodexError):
            await self.rpc.call(
                "turn/interrupt", {"threadId": self.thread_id, "turnId": self.turn_id}, 10
            )


def _relative(path: object, home: Path) -> str:
    """`path` under `home`, as a relative POSIX path ("" when it is not under it)."""
    if not isinstance(path, str):
        return ""
    try:
        return Path(path).relative_to(home).as_posix()
    except ValueError:
        return ""


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
        run = _Run(self, binary, turn, cfg, home)
        try:
            return await run.run(), run.follow_up
        except CodexError as e:
            tail = run.app.stderr_tail()
            error = f"codex: {e}" + (f" (stderr: {tail})" if tail else "")
            return TurnResult("failed", state=turn.state, error=error), False
        finally:
            await run.close()
            await asyncio.to_thread(shutil.rmtree, home, True)
