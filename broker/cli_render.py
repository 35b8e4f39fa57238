"""What the command line prints: items, prompts, routing outcomes, ages and times, as people read
them.

The commands (`broker.cli_commands`) and the entry point (`broker.cli`) print through these:
`render_item` is an item as `show` and `tail` print it (the demo prints its threads with it too);
`_note` is a line on stderr about what the command is doing; `_safe_url` masks a password.
"""

from __future__ import annotations

import re
import sys
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import ValidationError

from broker import Item, Prompt, Question, Routed, render_content

__all__ = ["PROG", "render_item"]

PROG = "prompt-broker"
QUESTION_CHARS = 60


def _print(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _print_json(document: Any) -> None:
    sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    sys.stdout.flush()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(moment: datetime) -> str:
    """A time as people read it: UTC, to the second."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _safe_url(url: str | None) -> str:
    """The URL with any password masked: it goes into error messages."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url or "?")


def render_item(item: Item) -> str:
    """An item as `show` and `tail` print it: a header line, then its text indented."""
    head = [_when(item.created_at), item.author, item.type or "message", *_item_refs(item)]
    return "\n".join(["  ".join(head), *("    " + line for line in _item_body(item))])


def _item_refs(item: Item) -> list[str]:
    """The prompt an item is about: its own (a prompt or resolution) or the one it names."""
    meta = item.metadata
    prompt = meta.get("prompt")
    refs: list[str] = []
    if isinstance(prompt, dict):
        detail = prompt.get("prompt_state" if item.type == "pending_prompt_resolved" else "kind")
        refs.append(f"{prompt.get('prompt_id', '?')} ({detail})")
    if isinstance(meta.get("prompt_id"), str):
        refs.append(f"for {meta['prompt_id']}")
    if meta.get("answers"):
        refs.append("with metadata.answers")
    return refs


def _item_body(item: Item) -> list[str]:
    lines: list[str] = []
    for block in item.content:
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            lines.extend(block["text"].splitlines())
        elif block.get("type") == "file" and isinstance(block.get("file"), dict):
            lines.append(f"[file: {block['file'].get('alias', '?')}]")
        else:
            lines.append(f"[{block.get('type', '?')} block]")
    if not item.text and item.type == "pending_prompt":
        lines.extend(_questions_text(item.metadata.get("prompt")).splitlines())
    return lines


def _questions_text(prompt: object) -> str:
    """A prompt item without text (not ours, but possible on the wire): render its questions."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("questions"), list):
        return ""
    try:
        return render_content([Question.model_validate(q) for q in prompt["questions"]])
    except ValidationError:
        return ""


def _first_question(prompt: Prompt) -> str:
    text = _truncate(_one_line(prompt.questions[0].question), QUESTION_CHARS)
    more = len(prompt.questions) - 1
    return text + (f" (+{more} more)" if more else "")


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows as aligned lines; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    ]


def _routed_lines(thread_id: str, routed: Routed) -> list[str]:
    if routed.outcome == "queued":
        return [
            f"queued {routed.item_id} on thread {thread_id}: no prompt is active, "
            "so it waits in the inbox for the next turn"
        ]
    if routed.outcome == "posted":
        return [
            f"posted {routed.item_id} on thread {thread_id}: its author is the broker's "
            "own identity, so it is never an answer"
        ]
    lines = [f"answered {routed.prompt_id} on thread {thread_id} (source: {routed.source})"]
    if routed.refused_answers:
        lines.append(f"  --answers refused, the text was mapped instead: {routed.refused_answers}")
    lines.extend(
        f"  {_one_line(a.question)} → {', '.join(a.answer) if a.answer else '(nothing)'}"
        for a in routed.answers or []
    )
    return lines


def _note(message: str) -> None:
    """A line about what the command is doing (not its output): stderr."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
