"""The Claude harness's questions and answers, as plain data: no SDK, no I/O.

Claude Code's `AskUserQuestion` input becomes the prompt's questions (`ask_questions`: texts
shared by several questions are numbered), and the person's answers go back into that input in
the SDK's documented shape (`updated_input`; see "Questions" in `workers.agents.claude`).
`question_key` says which questions a call asks (the same texts ask the same thing). The rest
are the words of a refusal: a person's denial (`denial_words`, `denied`), a prompt not
delivered or cancelled, and the messages of a parked or pausing run, all saying who refused, or
that nobody did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker import Answer, BadItem, Option, PromptCancelled, PromptUnavailable
from broker.answers import NEGATIVE, is_affirmative
from broker.models import Question

__all__ = [
    "AGENT",
    "ASK_TOOL",
    "PARKED_APPROVAL",
    "PARKED_QUESTION",
    "PAUSING",
    "ask_questions",
    "cancelled",
    "denial_words",
    "denied",
    "not_delivered",
    "question_key",
    "updated_input",
]

AGENT = "Claude"
ASK_TOOL = "AskUserQuestion"


def _fold(text: str) -> str:
    return " ".join(text.split()).casefold()


def _raw_questions(tool_input: dict[str, Any]) -> list[dict[str, Any]]:
    raw = tool_input.get("questions")
    if not isinstance(raw, list) or not raw:
        raise BadItem("questions", "AskUserQuestion needs a non-empty list of questions")
    for i, q in enumerate(raw):
        if not isinstance(q, dict) or not isinstance(q.get("question"), str):
            raise BadItem(f"questions[{i}].question", "expected a string")
    return raw


def ask_questions(tool_input: dict[str, Any]) -> list[Question]:
    """The prompt's questions for an AskUserQuestion input, texts shared by several numbered."""
    raw = _raw_questions(tool_input)
    counts: dict[str, int] = {}
    for q in raw:
        counts[q["question"]] = counts.get(q["question"], 0) + 1
    seen: dict[str, int] = {}
    out = []
    for q in raw:
        text = q["question"]
        seen[text] = seen.get(text, 0) + 1
        if counts[text] > 1:
            text = f"{text} [{seen[text]}/{counts[text]}]"
        options = [
            Option(label=str(o.get("label", "")), description=str(o.get("description") or ""))
            for o in q.get("options") or []
            if isinstance(o, dict)
        ]
        out.append(
            Question(
                question=text,
                header=str(q.get("header") or ""),
                options=options,
                multiSelect=q.get("multiSelect") is True,
            )
        )
    return out


def _one_answer(q: dict[str, Any], given: Sequence[str]) -> tuple[str, dict[str, str]]:
    """One question's answer value and annotation: labels (canonical), else the free text."""
    options = [o for o in q.get("options") or [] if isinstance(o, dict)]
    by_fold = {_fold(str(o.get("label", ""))): o for o in options}
    picked = [by_fold[_fold(a)] for a in given if _fold(a) in by_fold]
    rest = [a.strip() for a in given if _fold(a) not in by_fold and a.strip()]
    if not picked:
        return ", ".join(rest), {}
    note: dict[str, str] = {}
    if rest:
        note["notes"] = " ".join(rest)
    previews = [o["preview"] for o in picked if isinstance(o.get("preview"), str)]
    if len(picked) == 1 and previews:
        note["preview"] = previews[0]
    return ", ".join(str(o["label"]) for o in picked), note


def updated_input(tool_input: dict[str, Any], answers: Sequence[Answer]) -> dict[str, Any]:
    """The AskUserQuestion input with the person's answers, as the SDK documents it.

    Answers are taken by position (one per question, as the broker returns them).
    """
    raw = _raw_questions(tool_input)
    values: dict[str, list[str]] = {}
    notes: dict[str, dict[str, str]] = {}
    for i, q in enumerate(raw):
        given = answers[i].answer if i < len(answers) else []
        value, note = _one_answer(q, given)
        text = q["question"]
        if value:
            values.setdefault(text, []).append(value)
        if note:
            notes.setdefault(text, {}).update(note)
    counts: dict[str, int] = {}
    for q in raw:
        counts[q["question"]] = counts.get(q["question"], 0) + 1
    result: dict[str, str] = {}
    for text, parts in values.items():
        result[text] = "; ".join(parts)
        if counts[text] > 1:
            shared = (
                f"This question was asked {counts[text]} times with the same text; the answers "
                "given are in question order, separated by '; '."
            )
            previous = notes.get(text, {}).get("notes")
            notes.setdefault(text, {})["notes"] = f"{previous} {shared}" if previous else shared
    out = {**tool_input, "answers": result}
    if notes:
        annotations = dict(tool_input.get("annotations") or {})
        for text, note in notes.items():
            annotations[text] = {**(annotations.get(text) or {}), **note}
        out["annotations"] = annotations
    return out


def question_key(tool_input: dict[str, Any]) -> str:
    """The question texts of an AskUserQuestion input: the same texts ask the same thing."""
    return "\n".join(q["question"] for q in _raw_questions(tool_input))


def denial_words(answers: Sequence[Answer], typed: str = "") -> str | None:
    """A denial's words: the typed reply, else extra strings of a structured answer; never a bare
    negative."""
    candidates = [typed.strip()] if typed.strip() else []
    if answers:
        candidates += [a.strip() for a in answers[0].answer[1:] if a.strip()]
    words = " ".join(
        w for w in candidates if w.casefold() not in NEGATIVE and not is_affirmative(w)
    )
    return words or None


def denied(tool: str, words: str | None) -> str:
    said = f' Their words: "{words}"' if words else ""
    return f"The person denied this {tool} call.{said} Do not retry it; choose another approach."


def not_delivered(e: PromptUnavailable | BadItem) -> str:
    cause = e.cause if isinstance(e, PromptUnavailable) else e
    return f"could not be delivered to a person ({cause})"


def cancelled(e: PromptCancelled) -> str:
    return f"was cancelled ({e.reason or 'no reason given'}) before anyone answered"


PARKED_APPROVAL = (
    "Approval unavailable: the request is waiting for a person who has not answered yet, and this "
    "run pauses until they do. Nobody refused this call. Make the same call again to wait for "
    "their answer."
)
PARKED_QUESTION = (
    "Unanswered: the question is waiting for a person who has not answered yet, and this run "
    "pauses until they do. Nobody refused to answer. Ask the same question again to wait for "
    "their answer."
)
PAUSING = (
    "Not run: this run is pausing until a person answers an earlier request. Nobody refused this "
    "call; make it again later."
)
