"""One turn of one Codex thread (`Run`): the app-server started, the Codex thread opened or
resumed and a Codex turn run to its end; meanwhile Codex's approval and `requestUserInput`
requests put to a person one at a time (or decided by the worker's gate), its agent messages
posted, and the refusals nobody made told to the model in our words. What it records goes
through `workers.agents.codex_recorder`; its words and replies come from
`workers.agents.codex_prompts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker import Kind, PromptCancelled, PromptUnavailable, Question
from workers.agents.codex_config import SANDBOX_POLICY, CodexConfig, approval_policy, sandbox_mode
from workers.agents.codex_prompts import (
    APPROVAL_METHODS,
    COMMAND,
    FILE_CHANGE,
    PERMISSIONS,
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
    interruption_words,
    item_kind,
    item_what,
    offers,
    other_reply,
    request_what,
    unanswered_words,
    user_input_questions,
    why_unanswered,
)
from workers.agents.codex_recorder import ROLLOUT, Recorder, Rollout, holds, relative
from workers.agents.codex_rpc import AppServer, CodexError, Rpc, Trace
from workers.agents.harness import GateVerdict, PromptParked, Turn, TurnResult

__all__ = ["Run"]

logger = logging.getLogger("workers.agents.codex")  # one logger for all the harness's modules

START_TIMEOUT = 60.0  # seconds for the app-server to answer initialize / thread / turn start


class Run:
    """One turn of one Codex thread: a process, its JSON-RPC connection, its prompts."""

    def __init__(
        self,
        binary: str,
        turn: Turn,
        cfg: CodexConfig,
        home: Path,
        *,
        features: Sequence[str],
        trace: Trace | None,
    ) -> None:
        self.binary = binary
        self.turn = turn
        self.cfg = cfg
        self.home = home
        self.features = features
        self.app = AppServer(binary, home, trace)
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
        return approval_policy(self.cfg, self.turn.permissions)

    @property
    def sandbox(self) -> str:
        return sandbox_mode(self.cfg, self.turn.permissions)

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
            self.features,
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
            START_TIMEOUT,
        )
        await self.rpc.notify("initialized")
        thread = await self._open_thread(restored)
        self.thread_id = str(thread["id"])
        path = thread.get("path")
        if self.recorder.rollout is None or self.recorder.rollout.codex_thread != self.thread_id:
            rel = relative(path, self.home)
            self.recorder.rollout = Rollout(self.thread_id, rel) if ROLLOUT.fullmatch(rel) else None
        if self.recorder.rollout is not None:
            start = state.get("writer") if isinstance(state.get("writer"), str) else None
            self.recorder.record_later(
                {"ev": "turn", "from": start, "codex_thread": self.thread_id}
            )
        told = [
            *interruption_words(self.turn.interrupted),
            *self._old_notes(state),
            self.turn.prompt,
        ]
        text = "\n\n".join(told).strip() or "(continue)"
        started = await self.rpc.call(
            "turn/start",
            {
                "threadId": self.thread_id,
                "input": [{"type": "text", "text": text, "text_elements": []}],
                "approvalPolicy": self.policy,
                "sandboxPolicy": SANDBOX_POLICY[self.sandbox],
            },
            START_TIMEOUT,
        )
        self.turn_id = str(started["turn"]["id"])
        finished = await self._wait_turn()
        return await self._result(finished)

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
                    START_TIMEOUT,
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
        res = await self.rpc.call("thread/start", common, START_TIMEOUT)
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
