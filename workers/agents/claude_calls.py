"""The Claude harness's call log: what each tool call got to, recorded as it happens.

The log is one list in the thread's agent store (`CALLS`), appended to (and awaited) at each
step of a call, so that after a crash the replica that finds the turn cut off can say what is
known of the call that was in flight (`describe`). Pure: the harness does the appending.

Records, in order, each a small dict with `e` (the event):

- `turn`: a turn started (only the last turn's calls are described).
- `session` (`sid`): the turn's Claude session id, as soon as it is known.
- `call` (`id`, `tool`, `detail`): the CLI is about to run or ask about a call (the PreToolUse
  hook saw it). From here on it may run: Claude Code runs calls its own engine allows without
  asking us.
- `asking` (`id`): the call waits for a person's approval; it has not run.
- `allowed` (`id`): the permission callback let it run (recorded *before* the CLI is told).
- `refused` (`id`): it was refused; it did not run.
- `deferred` (`id`): the session paused with it pending (a parked wait); it did not run.
- `result` (`id`, `error`, `code`, `text`): its result reached the worker.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.agents.harness import Interruption, describe_delivered

__all__ = ["CALLS", "describe", "detail_of", "last_session", "preface", "result_record"]

#: The agent-store key of the call log (Claude transcripts are `claude:<session uuid>...`).
CALLS = "claude:calls"
#: Longest command or path quoted back in a note.
_DETAIL_MAX = 200
_EXIT = re.compile(r"^\s*Exit code (\d+)")
_INTERRUPTED = "was interrupted; it may or may not have taken effect; check before running it again"


def detail_of(tool_input: object) -> str:
    """What names a call to a person: its command, else its path, else nothing."""
    if isinstance(tool_input, dict):
        for key in ("command", "file_path", "notebook_path", "path", "url", "pattern"):
            value = tool_input.get(key)
            if isinstance(value, str) and value:
                return value if len(value) <= _DETAIL_MAX else value[:_DETAIL_MAX] + "…"
    return ""


def result_record(tool_use_id: str, is_error: bool | None, text: str) -> dict[str, Any]:
    """A `result` record: Bash's exit code is 0 unless Claude Code reported `Exit code N`."""
    found = _EXIT.match(text) if is_error else None
    code = int(found.group(1)) if found else (None if is_error else 0)
    first = text.strip().splitlines()[0][:_DETAIL_MAX] if text.strip() else ""
    return {"e": "result", "id": tool_use_id, "error": bool(is_error), "code": code, "text": first}


@dataclass
class _Call:
    tool: str
    detail: str
    state: str  # call | asking | allowed | refused | deferred | result
    result: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.tool} `{self.detail}`" if self.detail else f"`{self.tool}`"

    def ran(self) -> str:
        r = self.result or {}
        if self.tool == "Bash" and isinstance(r.get("code"), int):
            return f"{self.name} ran, exit code {r['code']}"
        if r.get("error"):
            said = f": {r['text']}" if r.get("text") else ""
            return f"{self.name} ran and returned an error{said}"
        return f"{self.name} ran and succeeded"


def _last_turn(records: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in records:
        if not isinstance(r, dict):
            continue
        if r.get("e") == "turn":
            out = []
        else:
            out.append(r)
    return out


def _calls(records: Sequence[Any]) -> dict[str, _Call]:
    calls: dict[str, _Call] = {}
    for r in _last_turn(records):
        call_id, event = str(r.get("id") or ""), r.get("e")
        if not call_id:
            continue
        if event == "call":
            if call_id not in calls:
                calls[call_id] = _Call(
                    str(r.get("tool") or "?"), str(r.get("detail") or ""), "call"
                )
            continue
        known = calls.setdefault(call_id, _Call("?", "", "call"))
        if event in ("asking", "allowed", "refused", "deferred") and known.state != "result":
            known.state = str(event)
        elif event == "result" and known.state not in ("refused", "deferred", "asking"):
            # (a refusal's result is our own message: that call did not run)
            known.state, known.result = "result", r
    return calls


def describe(records: Sequence[Any] | None) -> str:
    """What is known of the call in flight when the last turn was cut off, in one sentence.

    Every call that may have run with no result recorded is "interrupted; it may or may not
    have taken effect"; with none, the last call, if its result was recorded, "ran, exit code N"
    (the model's next reply was pending); else "" (no call was in flight: the last one was
    refused or still waiting for a person). Never raises for missing or odd records.
    """
    calls = list(_calls(records or []).values())
    open_ = [c for c in calls if c.state in ("call", "allowed")]
    if open_:
        return "; ".join(f"{c.name} {_INTERRUPTED}" for c in open_)
    if calls and calls[-1].state == "result":
        return calls[-1].ran()
    return ""


def last_session(records: Sequence[Any] | None) -> str | None:
    """The Claude session id last recorded, if any (a first turn cut off before its state was
    stored still continues its own session)."""
    for r in reversed(records or []):
        if isinstance(r, dict) and r.get("e") == "session" and isinstance(r.get("sid"), str):
            return str(r["sid"])
    return None


def preface(interruption: Interruption | None) -> str:
    """What the next turn tells the agent before its input, after a cut-off turn ("" if none)."""
    if interruption is None:
        return ""
    parts = ["[Your previous turn was cut off before it ended: the worker running it stopped."]
    if interruption.delivered is not None:
        handed = describe_delivered(interruption.delivered)
        parts.append(f"Before that, you had been handed {handed}; it is not handed over again.")
    if interruption.note:
        parts.append(interruption.note.rstrip(".") + ".")
    return " ".join(parts) + "]"
