"""A cut-off turn, told: the item the person reads, the record the next turn's agent hears of.

A turn cut off after an answer was handed to it is never replayed: its thread's next holder
posts one item saying so (`interruption_text`) and keeps the same in the session
(`interruption_record`) for the next turn to tell its agent (`interruption_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker import Answer, Prompt
from workers.agents.grants import approves
from workers.agents.harness import Interruption, Resume, describe_delivered


def _resume_of(prompt: Prompt) -> Resume:
    """What a turn is handed of an answered prompt."""
    q = prompt.questions[0]
    approve = approves(prompt.answers)
    return Resume(
        prompt_id=prompt.prompt_id,
        kind=prompt.kind,
        subject=q.subject or "",
        answers=prompt.answers or [],
        verdict=("approve" if approve else "deny") if prompt.kind == "approval" else None,
        text=prompt.answer_text or "",
    )


def interruption_text(delivered: Resume | None, note: str, *, grant: str = "none") -> str:
    """The thread item that tells the person a turn was cut off, and what is known of it.

    `grant`: what became of the one-shot grant the delivered approval minted (`none` when it
    minted none: a held approval is answered in place)."""
    parts = ["the turn was interrupted: the replica running it stopped."]
    if delivered is not None:
        parts.append(f"It had been handed {describe_delivered(delivered)}.")
        if grant == "unused":
            parts.append("Its one-shot approval was not used: the call did not run through it.")
        elif grant == "used":
            parts.append("Its one-shot approval was used.")
    if note:
        parts.append(note.rstrip(".") + ".")
    parts.append("Nothing of that turn is repeated; a call the agent makes again is asked again.")
    return "(" + " ".join(parts) + ")"


def interruption_record(interruption: Interruption) -> dict[str, Any]:
    """An interruption as the session keeps it (JSON)."""
    d = interruption.delivered
    delivered = None
    if d is not None:
        delivered = {
            "prompt_id": d.prompt_id,
            "kind": d.kind,
            "subject": d.subject,
            "answers": [a.model_dump() for a in d.answers],
            "verdict": d.verdict,
            "text": d.text,
        }
    return {"delivered": delivered, "note": interruption.note}


def interruption_of(record: Mapping[str, Any] | None) -> Interruption | None:
    """The interruption a session keeps, back as the harness interface's type."""
    if not record:
        return None
    d = record.get("delivered")
    delivered = None
    if isinstance(d, Mapping):
        delivered = Resume(
            prompt_id=str(d.get("prompt_id", "")),
            kind=d.get("kind", "approval"),
            subject=str(d.get("subject", "")),
            answers=[Answer.model_validate(a) for a in d.get("answers") or []],
            verdict=d.get("verdict"),
            text=str(d.get("text", "")),
        )
    return Interruption(delivered=delivered, note=str(record.get("note", "")))
