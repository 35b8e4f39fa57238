"""What Codex asks, in the broker's terms, and what it is told back: its approval and
`requestUserInput` requests as prompt questions (`approval_question`, `user_input_questions`),
a person's answers as Codex's replies (`decision_of`, `approval_payload`, `answers_payload`),
the refusals of requests nobody is asked (`other_reply`), and the words the model reads when a
call was stopped without a person refusing it (`unanswered_words`, `ended_words`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from broker import Answer, Option, Question
from broker.answers import is_affirmative
from workers.agents.harness import Interruption, describe_delivered

__all__ = [
    "APPROVAL_METHODS",
    "COMMAND",
    "FILE_CHANGE",
    "PERMISSIONS",
    "SESSION_LABEL",
    "USER_INPUT",
    "Decision",
    "NotAnswered",
    "Outcome",
    "answers_payload",
    "approval_payload",
    "approval_question",
    "call_what",
    "decision_of",
    "ended_words",
    "interruption_words",
    "item_kind",
    "item_what",
    "offers",
    "other_reply",
    "request_what",
    "unanswered_words",
    "user_input_questions",
    "why_unanswered",
]

COMMAND = "item/commandExecution/requestApproval"
FILE_CHANGE = "item/fileChange/requestApproval"
PERMISSIONS = "item/permissions/requestApproval"
USER_INPUT = "item/tool/requestUserInput"
APPROVAL_METHODS = (COMMAND, FILE_CHANGE, PERMISSIONS)

#: The option that approves for the rest of the Codex session (`acceptForSession`, or scope
#: `session`). Only a structured answer can pick it: typed text maps to Approve or Deny.
SESSION_LABEL = "Approve for this session"


# -- questions -------------------------------------------------------------------------------


def _str(params: dict[str, Any], key: str) -> str:
    value = params.get(key)
    return value.strip() if isinstance(value, str) else ""


def _offers_session(method: str, params: dict[str, Any]) -> bool:
    """Does this request offer a session-wide approval? Permissions always do (scope
    `session`); a command or file change does unless its `availableDecisions` leaves it out."""
    if method == PERMISSIONS:
        return True
    offered = params.get("availableDecisions")
    if isinstance(offered, list):
        return "acceptForSession" in offered
    return True


def _permissions_text(permissions: object) -> str:
    if not isinstance(permissions, dict):
        return ""
    parts = []
    network = permissions.get("network")
    if isinstance(network, dict) and network.get("enabled"):
        parts.append("network access")
    fs = permissions.get("fileSystem")
    if isinstance(fs, dict):
        for mode in ("read", "write"):
            paths = fs.get(mode)
            if isinstance(paths, list) and paths:
                parts.append(f"{mode} access to " + ", ".join(f"`{p}`" for p in paths))
    return "; ".join(parts)


def _changes_text(changes: object) -> str:
    if not isinstance(changes, list):
        return ""
    lines = []
    for change in changes[:20]:
        if not isinstance(change, dict):
            continue
        kind = change.get("kind")
        what = kind.get("type") if isinstance(kind, dict) else kind
        lines.append(f"`{change.get('path', '?')}`" + (f" ({what})" if what else ""))
    if len(changes) > 20:
        lines.append(f"and {len(changes) - 20} more")
    return "\n".join(lines)


def approval_question(method: str, params: dict[str, Any], changes: object = None) -> Question:
    """The `approval` question for one Codex approval request (reference section 3.2).

    `changes` is the file-change item's `changes` (from its `item/started`), since the request
    itself names no file.
    """
    reason = _str(params, "reason")
    grant_key = None
    if method == COMMAND:
        command = _str(params, "command")
        text = reason or "Allow Codex to run this command?"
        if command:
            text += f"\n\n`{command}`"
            grant_key = f"{method}:{command}"
        cwd = _str(params, "cwd")
        if cwd:
            text += f"\n\nin {cwd}"
        header, approve = "shell", "run this command"
    elif method == FILE_CHANGE:
        text = reason or "Allow Codex to change these files?"
        listed = _changes_text(changes)
        if listed:
            text += "\n\n" + listed
        root = _str(params, "grantRoot")
        if root:
            text += f"\n\nand to write under `{root}` for the rest of the session"
        header, approve = "file change", "apply the change"
    else:
        text = reason or "Allow Codex more permissions?"
        asked = _permissions_text(params.get("permissions"))
        if asked:
            text += f"\n\nIt asks for {asked}."
        header, approve = "permissions", "for this turn only"
    options = [
        Option(label="Approve", description=approve),
        Option(label="Deny", description="refuse it; Codex carries on without it"),
    ]
    if _offers_session(method, params):
        options.append(
            Option(label=SESSION_LABEL, description="and don't ask again for it this session")
        )
    return Question(
        question=text,
        header=header,
        options=options,
        multiSelect=False,
        subject=method,
        grant_key=grant_key,
    )


def user_input_questions(params: dict[str, Any]) -> list[Question]:
    """One `ask_user_question` question per Codex question, in order."""
    out = []
    for q in params.get("questions") or []:
        if not isinstance(q, dict):
            continue
        text = str(q.get("question") or q.get("header") or q.get("id") or "")
        if q.get("isSecret"):
            text += "\n\n(Your answer will be visible in this thread.)"
        options = [
            Option(label=str(o.get("label", "")), description=str(o.get("description") or ""))
            for o in q.get("options") or []
            if isinstance(o, dict)
        ]
        out.append(Question(question=text, header=str(q.get("header") or "")[:40], options=options))
    return out


# -- replies ---------------------------------------------------------------------------------

Decision = Literal["accept", "session", "decline", "cancel"]


def approval_payload(method: str, params: dict[str, Any], decision: Decision) -> dict[str, Any]:
    """The reply to an approval request, in the protocol's own vocabulary.

    `accept` / `session` approve (for `session`, Codex's session-wide form); `decline` is a
    refusal (a person's, or the policy's); `cancel` says nobody decided and ends Codex's turn.
    A permissions request has no cancel: it gets an empty grant (the turn is interrupted apart).
    """
    if method == PERMISSIONS:
        if decision in ("accept", "session"):
            granted = params.get("permissions")
            scope = "session" if decision == "session" else "turn"
            return {"permissions": granted if isinstance(granted, dict) else {}, "scope": scope}
        return {"permissions": {}, "scope": "turn"}
    if decision == "session" and not _offers_session(method, params):
        decision = "accept"
    word = {"accept": "accept", "session": "acceptForSession"}.get(decision, decision)
    return {"decision": word}


def answers_payload(params: dict[str, Any], answers: Sequence[Answer]) -> dict[str, Any]:
    """`{answers: {<question id>: {answers: [...]}}}` for a `requestUserInput`."""
    out: dict[str, Any] = {}
    questions = [q for q in params.get("questions") or [] if isinstance(q, dict)]
    for i, q in enumerate(questions):
        labels = list(answers[i].answer) if i < len(answers) else []
        out[str(q.get("id", i))] = {"answers": labels}
    return {"answers": out}


def other_reply(method: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """`(result, error)` for a server request this harness does not put to a person: a refusal
    in its own vocabulary where it has one (not a person's denial), else a JSON-RPC error."""
    if method == "mcpServer/elicitation/request":
        return {"action": "cancel"}, None
    if method == "item/tool/call":
        text = "this client registered no dynamic tools; nothing was run"
        return {"contentItems": [{"type": "inputText", "text": text}], "success": False}, None
    if method in ("execCommandApproval", "applyPatchApproval"):
        return {"decision": "abort"}, None
    return None, {"code": -32601, "message": f"{method} is not supported by prompt-broker"}


# -- when nobody answered --------------------------------------------------------------------


@dataclass
class NotAnswered:
    """Nobody answered: the prompt parked, was cancelled, or could not be delivered."""

    why: Literal["parked", "cancelled", "unavailable"]
    detail: str = ""


Outcome = list[Answer] | NotAnswered


# -- words for calls -------------------------------------------------------------------------


def item_kind(item: dict[str, Any]) -> str:
    return "command" if item.get("type") == "commandExecution" else "file"


def item_what(item: dict[str, Any]) -> str:
    if item.get("type") == "commandExecution":
        command = item.get("command")
        return command if isinstance(command, str) and command else "a command"
    return _changes_what(item.get("changes"))


def _changes_what(changes: object) -> str:
    paths = (
        [str(c.get("path")) for c in changes if isinstance(c, dict) and c.get("path")]
        if isinstance(changes, list)
        else []
    )
    return "the file change to " + ", ".join(paths[:5]) if paths else "a file change"


def call_what(method: str, params: dict[str, Any], changes: object) -> str:
    """What the ledger calls the call an approval request is for."""
    if method == COMMAND:
        return _str(params, "command") or "a command"
    if method == FILE_CHANGE:
        return _changes_what(changes)
    return "a permissions request"


def offers(method: str, params: dict[str, Any], decision: str) -> bool:
    """May we reply `decision`? Where the request lists `availableDecisions`, only if listed
    (Codex 0.171.0 lists `accept`, an execpolicy amendment and `cancel` for commands, so a
    command is never answered `decline`); else if the method's reply has that decision."""
    offered = params.get("availableDecisions")
    if isinstance(offered, list):
        return decision in offered
    return method != PERMISSIONS


def ended_words(why: str) -> str:
    """What the model reads where Codex would say the person interrupted the turn."""
    return (
        f"This turn was ended by prompt-broker, not by the person: {why}. Nobody interrupted you."
    )


def why_unanswered(outcome: NotAnswered) -> str:
    if outcome.why == "parked":
        return "a question is waiting for a person, and the answer comes back in a later turn"
    if outcome.why == "cancelled":
        return f"a question was cancelled before anyone answered ({outcome.detail})"
    return f"a question could not be put to a person ({outcome.detail})"


def unanswered_words(outcome: NotAnswered, what: str, head: str = "Approval") -> tuple[str, str]:
    """`(the call's output, the note)` when nobody answered: never a refusal. `head` is what
    was asked for (`Approval`, or `Question` for Codex's own questions)."""
    if outcome.why == "parked":
        return (
            f"{head} pending: the request for {what} is waiting for a person. Nothing was run"
            " and nobody refused it; their answer comes back in your next turn.",
            "",
        )
    if outcome.why == "cancelled":
        text = (
            f"{head} unavailable: the request for {what} was cancelled ({outcome.detail})"
            " before anyone answered. Nothing was run and nobody refused it."
        )
        return text, text
    text = (
        f"{head} unavailable: the request for {what} could not be put to a person"
        f" ({outcome.detail}). Nothing was run and nobody refused it; asking again will retry."
    )
    return text, text


def request_what(method: str, params: dict[str, Any]) -> str:
    if method == COMMAND:
        command = _str(params, "command")
        return f"approval to run `{command}`" if command else "approval to run a command"
    if method == FILE_CHANGE:
        return "approval of a file change"
    return "more permissions"


def decision_of(answers: Sequence[Answer]) -> Decision:
    """A person's answer to a Codex approval: only an affirmative label approves; the session
    option approves session-wide; anything else (including malformed answers) declines."""
    label = answers[0].answer[0] if answers and answers[0].answer else ""
    if " ".join(label.split()).casefold() == SESSION_LABEL.casefold():
        return "session"
    return "accept" if is_affirmative(label) else "decline"


def interruption_words(cut: Interruption | None) -> list[str]:
    """What the agent is told first when its previous turn was cut off."""
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
