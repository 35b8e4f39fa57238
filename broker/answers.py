"""Answer mapping and content rendering: pure functions, no Redis, no asyncio.

The rules are those of answering a prompt: a structured set first (checked against the prompt,
`accept_structured`), text mapped per kind as the fallback. Over the earlier implementation ("the
reference" below) there are documented improvements, each of which only turns what would have
been handed back as raw "Other" text into a label:

* Multi-select labels that contain spaces can be chosen by name. Text is split into segments at
  commas; within a segment the longest run of words that matches a label wins, and otherwise each
  word is resolved alone. So `KPI cards, Table` gives `["KPI cards", "Table"]` where the reference
  gave `["Table"]`. Where no multi-word label matches, the result is the reference's.
* Only ASCII digits are numbers. `²` or `٣` is text (the reference raised on them).
* Labels and replies are compared trimmed, with inner whitespace collapsed and case-folded
  (`str.casefold`), so a label `"Table "` matches `Table` and `KPI   cards` matches
  `KPI cards`; affirmatives are case-folded too.
* `map_text` answers only the questions it is given (a prompt always has at least one).

Text mapping is split in two so the answer path can run inside Redis in one round trip:
`prepare()` does everything that needs Python's Unicode (trim, case-fold, split, parse numbers) and
needs no prompt; `map_prepared()` does the rest against a prompt's `Matcher`s, and
`broker/lua/route.lua` is a line-for-line port of it (a property test holds the two equal).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from broker.models import Answer, Kind, Question

__all__ = [
    "AFFIRMATIVE",
    "MAX_DIGITS",
    "NEGATIVE",
    "Matcher",
    "Prepared",
    "Token",
    "accept_structured",
    "answered_content",
    "cancelled_content",
    "check_structured",
    "is_affirmative",
    "map_prepared",
    "map_text",
    "matchers",
    "prepare",
    "render_content",
    "verdict",
]

#: Trimmed, case-folded texts (and labels) that approve. Exact membership, on purpose: a false
#: "yes" is far worse than a false "no".
AFFIRMATIVE = frozenset({"approve", "approved", "yes", "y", "ok", "allow", "1"})
#: Bare negatives: a denial that says nothing more (used when telling an agent why it was denied).
NEGATIVE = frozenset({"deny", "denied", "no", "n", "nope", "reject", "rejected", "0"})
#: Longer numbers are never an option index (and Lua's doubles hold shorter ones exactly).
MAX_DIGITS = 9

_COMMAS = re.compile(r",+")


class Token(TypedDict):
    """One word of a reply: `f` folded (trimmed, case-folded), `n` its number or 0 if none."""

    f: str
    n: int


class Prepared(TypedDict):
    """A reply made ready for mapping: everything Unicode-sensitive is done here."""

    raw: str  # the original text, untrimmed: the "Other" answer
    aff: bool  # an affirmative (approval) reply
    whole: Token  # the whole reply as one token (single-select)
    segs: list[list[Token]]  # comma-separated segments, each split into words (multi-select)


class Matcher(TypedDict):
    """What mapping needs of one question, stored with the prompt at ask time."""

    question: str
    qfold: str  # the question folded: a structured answer's `question` must fold to it
    multi: bool
    labels: list[str]  # canonical labels, in option order (index N-1 answers "N")
    folds: list[str]  # the same labels folded; "" never matches


def _fold(text: str) -> str:
    """Trim, collapse inner whitespace, case-fold."""
    return " ".join(text.split()).casefold()


def _token(text: str) -> Token:
    word = text.strip()
    number = 0
    if word.isascii() and word.isdigit():  # ASCII only: "²".isdigit() is True too
        digits = word.lstrip("0")
        number = int(digits) if digits and len(digits) <= MAX_DIGITS else 0
    return {"f": _fold(word), "n": number}


def prepare(text: str) -> Prepared:
    """Prepare a reply for mapping against any prompt. Never raises on any string."""
    stripped = text.strip()
    segments = [seg.split() for seg in _COMMAS.split(stripped)]
    return {
        "raw": text,
        "aff": is_affirmative(text),
        "whole": _token(stripped),
        "segs": [[_token(w) for w in words] for words in segments if words],
    }


def matchers(questions: Sequence[Question]) -> list[Matcher]:
    """The per-question data `map_prepared` (and route.lua) needs."""
    return [
        {
            "question": q.question,
            "qfold": _fold(q.question),
            "multi": q.multiSelect,
            "labels": [o.label for o in q.options],
            "folds": [_fold(o.label) for o in q.options],
        }
        for q in questions
    ]


def is_affirmative(label: object) -> bool:
    """True only for a string that, trimmed and case-folded, is in `AFFIRMATIVE`."""
    return isinstance(label, str) and label.strip().casefold() in AFFIRMATIVE


def _by_label(fold: str, m: Matcher) -> str | None:
    if not fold:
        return None
    for label, label_fold in zip(m["labels"], m["folds"], strict=True):
        if label_fold and label_fold == fold:
            return label
    return None


def _resolve(tok: Token, m: Matcher) -> str | None:
    """A number within 1..len picks that option; otherwise a whole-label match; else None."""
    if 1 <= tok["n"] <= len(m["labels"]):
        return m["labels"][tok["n"] - 1]
    return _by_label(tok["f"], m)


def _resolve_segment(words: list[Token], m: Matcher) -> list[str]:
    """Greedy: at each word, the longest run of words naming a label wins; else the word alone."""
    out: list[str] = []
    i = 0
    while i < len(words):
        picked = None
        for j in range(len(words), i + 1, -1):  # runs of two words or more, longest first
            picked = _by_label(" ".join(w["f"] for w in words[i:j]), m)
            if picked is not None:
                i = j
                break
        if picked is None:
            picked = _resolve(words[i], m)
            i += 1
        if picked is not None:
            out.append(picked)
    return out


def _map_question(p: Prepared, m: Matcher) -> list[str]:
    if not m["labels"]:
        return [p["raw"]]
    if not m["multi"]:
        label = _resolve(p["whole"], m)
        return [label] if label is not None else [p["raw"]]
    picked = [label for seg in p["segs"] for label in _resolve_segment(seg, m)]
    return picked or [p["raw"]]


def map_prepared(kind: Kind, ms: Sequence[Matcher], p: Prepared) -> list[list[str]]:
    """One answer list per question (route.lua mirrors this exactly)."""
    if kind == "text":
        return [[p["raw"]] for _ in ms]
    if kind == "approval":
        return [["Approve" if p["aff"] else "Deny"] for _ in ms]
    return [_map_question(p, m) for m in ms]


def map_text(kind: Kind, questions: Sequence[Question], text: str) -> list[Answer]:
    """Map a plain-text reply to one answer per question, by the table in docs/protocol.md."""
    mapped = map_prepared(kind, matchers(questions), prepare(text))
    return [Answer(question=q.question, answer=a) for q, a in zip(questions, mapped, strict=True)]


def check_structured(raw: Any) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Check a `metadata.answers` set's shape (it is checked against the prompt later).

    Returns `(entries, None)` for a usable set, `(None, None)` when there is none, and
    `(None, why)` when it is malformed or empty: the caller maps the text instead and reports
    why. Entries keep `question` (and `qfold`, it folded) only when the surface sent one.
    """
    if raw is None:
        return None, None
    if not isinstance(raw, list):
        return None, f"metadata.answers: expected a list, got {type(raw).__name__}"
    if not raw:
        return None, "metadata.answers: an empty list answers no question"
    entries: list[dict[str, Any]] = []
    for i, entry in enumerate(raw):
        checked = _check_entry(entry, f"metadata.answers[{i}]")
        if isinstance(checked, str):
            return None, checked
        entries.append(checked)
    return entries, None


def _check_entry(entry: Any, where: str) -> dict[str, Any] | str:
    """One entry of a set, made ready for route.lua, or why it is malformed."""
    if not isinstance(entry, dict):
        return f"{where}: expected an object, got {type(entry).__name__}"
    answer = entry.get("answer")
    if not isinstance(answer, list) or not all(isinstance(a, str) for a in answer):
        return f"{where}.answer: expected a list of strings"
    question = entry.get("question")
    if question is not None and not isinstance(question, str):
        return f"{where}.question: expected a string"
    named = {"question": question, "qfold": _fold(question)} if question else {}
    return {"answer": answer} | named


def accept_structured(
    ms: Sequence[Matcher], entries: Sequence[Mapping[str, Any]]
) -> tuple[list[Answer] | None, str | None]:
    """Check a well-shaped set against the prompt: `(answers, None)` or `(None, why)`.

    One entry per question, in order. An entry that names its question must name the prompt's
    question at that position, compared folded (whitespace and case may differ); the answers
    then carry the prompt's own wording. route.lua runs this same check (a test holds the two
    equal); this copy is what tests and callers can reason with.
    """
    if len(entries) != len(ms):
        return None, (
            f"metadata.answers: the prompt has {len(ms)} question(s), the item answers "
            f"{len(entries)}"
        )
    for i, (entry, m) in enumerate(zip(entries, ms, strict=True)):
        if "qfold" in entry and entry["qfold"] != m["qfold"]:
            return None, (
                f'metadata.answers[{i}].question: "{entry["question"]}" is not question {i + 1} '
                f'of the prompt ("{m["question"]}")'
            )
    return [
        Answer(question=m["question"], answer=list(e["answer"]))
        for e, m in zip(entries, ms, strict=True)
    ], None


def verdict(answers: Any) -> Literal["approve", "deny"]:
    """Read an approval verdict from an answer set: its first label, through `AFFIRMATIVE`.

    Anything malformed (not a list, empty, a non-string label) denies; it never raises.
    """
    first: Any = answers[0] if isinstance(answers, list) and answers else None
    if isinstance(first, Answer):
        labels: Any = first.answer
    elif isinstance(first, dict):
        labels = first.get("answer")
    else:
        labels = None
    label = labels[0] if isinstance(labels, list) and labels else None
    return "approve" if is_affirmative(label) else "deny"


def render_content(questions: Sequence[Question]) -> str:
    """A `pending_prompt` item's text: the questions and their numbered options, nothing else."""
    lines: list[str] = []
    for q in questions:
        lines.append(q.question)
        for n, o in enumerate(q.options, 1):
            lines.append(f"  {n}. {o.label}" + (f" — {o.description}" if o.description else ""))
    return "\n".join(lines)


def answered_content(answers: Sequence[Answer]) -> str:
    """`✓ Answered: ` then labels joined by `, ` within an answer and `; ` between answers."""
    return "✓ Answered: " + "; ".join(", ".join(a.answer) for a in answers)


def cancelled_content(reason: str) -> str:
    """`✗ Cancelled`, plus `: <reason>` when there is one."""
    return "✗ Cancelled" + (f": {reason}" if reason else "")
