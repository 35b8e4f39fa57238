"""What the Codex harness records of each tool call as it happens, and what it makes of it after
a crash: the call ledger, the truth about a call that was in flight, and the edits it makes to
Codex's own transcript (the rollout) before Codex reads it again.

The ledger is a list in the agent store (`Turn.store`, key `codex-calls`), one entry per event,
each tagged with the writing turn (`w`, the rollout writer of `workers.agents.codex_recorder`):

- `{"ev": "turn", "from": <writer of the state the turn started from, or null>}` when the turn
  has its Codex thread;
- `{"ev": "call", "id", "what", "kind", "asked"}` when a call is known: its approval request
  arrived (`asked`: true), or Codex reported it started without asking;
- `{"ev": "reply", "id", "decision"}` just *before* the reply to its approval is sent, so a
  crash between the two reads as "may have run", never as "did not run";
- `{"ev": "result", "id", "status", "exit"}` when Codex reports the call finished.

A call's result is recorded the moment Codex reports it, and the rollout lines up to its output
are copied to the store at the same time: a replica killed afterwards leaves behind the truth
("ran, exit code N"), not a transcript that stops at the approval request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "CALLS_KEY",
    "Call",
    "calls_of",
    "dangling_calls",
    "describe",
    "interrupted_writer",
    "output_line",
    "rewrite_line",
]

CALLS_KEY = "codex-calls"

_OUTPUT_TYPES = {
    "function_call": "function_call_output",
    "custom_tool_call": "custom_tool_call_output",
}
_ABORT_TAG = "<turn_aborted>"


@dataclass
class Call:
    """One tool call, as the ledger knows it."""

    id: str
    what: str  # what to call it in a sentence: the command, or "the file change to ..."
    kind: str  # command | file | permissions | question | other
    asked: bool = False  # an approval request arrived for it
    reply: str | None = None  # the decision we sent (recorded before sending)
    status: str | None = None  # Codex's final item status, once it finished
    exit: int | None = None


def _entries_of(entries: Sequence[Any], writer: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in entries
        if isinstance(e, dict)
        and isinstance(e.get("ev"), str)
        and (writer is None or e.get("w") == writer)
    ]


def interrupted_writer(entries: Sequence[Any], state: dict[str, Any] | None) -> str | None:
    """The turn that was cut off, given the session's last committed state.

    A state stored mid-turn (with a question, `open`) names that turn itself. A state stored at
    a turn's end names the finished turn, so the cut-off one is the latest turn that started
    from it. None when nothing in the ledger fits.
    """
    state = state or {}
    writer = state.get("writer")
    if state.get("open") and isinstance(writer, str):
        return writer
    start = writer if isinstance(writer, str) else None
    found = None
    for e in _entries_of(entries):
        if e["ev"] == "turn" and e.get("from") == start and isinstance(e.get("w"), str):
            found = e["w"]
    return found


def calls_of(entries: Sequence[Any], writer: str | None = None) -> dict[str, Call]:
    """The calls in the ledger (of one writer, or all), in the order they became known."""
    calls: dict[str, Call] = {}
    for e in _entries_of(entries, writer):
        call_id = e.get("id")
        if not isinstance(call_id, str) or not call_id:
            continue
        call = calls.get(call_id)
        if e["ev"] == "call":
            if call is None:
                call = calls[call_id] = Call(
                    call_id, str(e.get("what") or "a call"), str(e.get("kind") or "other")
                )
            call.asked = call.asked or bool(e.get("asked"))
        elif call is None:
            continue
        elif e["ev"] == "reply" and isinstance(e.get("decision"), str):
            call.reply = e["decision"]
        elif e["ev"] == "result":
            call.status = str(e.get("status") or "")
            code = e.get("exit")
            call.exit = code if isinstance(code, int) and not isinstance(code, bool) else None
    return calls


def describe(call: Call) -> str:
    """One sentence for the agent and the person: the truth as far as it is known.

    Never "aborted" or "failed" for a call that may have run.
    """
    name = f"`{call.what}`"
    if call.status is not None:
        return _finished(call, name)
    if call.reply is None and call.asked:
        return f"{name} did not run: it was still waiting for approval when the turn stopped"
    if call.reply in ("decline", "cancel"):
        return f"{name} did not run: it was not approved"
    return _unsure(name)


def _unsure(name: str) -> str:
    return (
        f"{name} was interrupted; it may or may not have taken effect;"
        " check before running it again"
    )


def _finished(call: Call, name: str) -> str:
    if call.status == "declined":
        if call.reply == "cancel":
            return f"{name} did not run: it was stopped before anyone approved it"
        return f"{name} did not run: it was refused"
    if call.exit is not None:
        return f"{name} ran, exit code {call.exit}"
    if call.status == "completed":
        return f"{name} ran to completion"
    return _unsure(name)


# -- the rollout: Codex's own transcript, one JSON object per line ------------------------------


def _parse(line: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _payload(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    if obj is None or obj.get("type") != "response_item":
        return None
    payload = obj.get("payload")
    return payload if isinstance(payload, dict) else None


def dangling_calls(lines: Sequence[str]) -> list[tuple[str, str]]:
    """`(call_id, call type)` of every tool call in the transcript that has no output.

    Codex fills such a call in as "aborted" when it reads the transcript back, which invites the
    model to run again a call that may have run; the harness writes the truth there instead.
    """
    calls: dict[str, str] = {}
    answered: set[str] = set()
    for line in lines:
        payload = _payload(_parse(line))
        if payload is None or not isinstance(payload.get("call_id"), str):
            continue
        kind = payload.get("type")
        if kind in _OUTPUT_TYPES:
            calls.setdefault(payload["call_id"], str(kind))
        elif kind in _OUTPUT_TYPES.values():
            answered.add(payload["call_id"])
    return [(cid, kind) for cid, kind in calls.items() if cid not in answered]


def _ordinal(lines: Sequence[str]) -> int:
    for line in reversed(lines):
        obj = _parse(line)
        if obj is not None and isinstance(obj.get("ordinal"), int):
            return int(obj["ordinal"])
    return len(lines) - 1


def output_line(lines: Sequence[str], call_id: str, call_type: str, text: str) -> str:
    """A rollout line giving the call `call_id` the output `text` (appended after `lines`)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    payload = {
        "type": _OUTPUT_TYPES.get(call_type, "function_call_output"),
        "call_id": call_id,
        "output": text,
    }
    return json.dumps(
        {
            "timestamp": now,
            "ordinal": _ordinal(lines) + 1,
            "type": "response_item",
            "payload": payload,
        },
        separators=(",", ":"),
    )


def rewrite_line(line: str, told: dict[str, str], aborted: str | None) -> str:
    """`line` with our words where Codex put its own for a call we stopped.

    `told` maps a call id to the output the model must read for it (Codex writes "aborted by
    user" for a call answered `cancel`); `aborted`, when the harness itself ended Codex's turn,
    replaces the "<turn_aborted> The user interrupted the previous turn on purpose" message
    Codex adds: nobody interrupted anything.
    """
    if not told and aborted is None:
        return line
    obj = _parse(line)
    payload = _payload(obj)
    if obj is None or payload is None:
        return line
    kind = payload.get("type")
    if kind in _OUTPUT_TYPES.values() and payload.get("call_id") in told:
        payload["output"] = told[str(payload["call_id"])]
        return json.dumps(obj, separators=(",", ":"))
    if aborted is not None and kind == "message" and payload.get("role") == "user":
        content = payload.get("content")
        if isinstance(content, list) and any(
            isinstance(c, dict) and str(c.get("text", "")).lstrip().startswith(_ABORT_TAG)
            for c in content
        ):
            payload["content"] = [{"type": "input_text", "text": aborted}]
            return json.dumps(obj, separators=(",", ":"))
    return line
