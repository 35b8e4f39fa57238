"""Between Redis records and the wire models: item bodies, stream entries, prompt hashes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from broker.answers import answered_content, cancelled_content, render_content
from broker.models import (
    Answer,
    AnsweredPayload,
    CancelledPayload,
    Item,
    Kind,
    PendingPromptMetadata,
    PendingPromptPayload,
    Prompt,
    Question,
    ResolvedMetadata,
)

__all__ = [
    "body",
    "item_from_entry",
    "item_from_inbox",
    "ms_datetime",
    "pending_body",
    "prompt_from_hash",
    "resolved_body",
    "sid_datetime",
]


def ms_datetime(ms: int | str) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, tz=UTC)


def sid_datetime(sid: str) -> datetime:
    """A stream entry id's time: the Redis server's clock when the item was added."""
    return ms_datetime(sid.partition("-")[0])


def body(text: str, metadata: Mapping[str, Any]) -> bytes:
    return orjson.dumps({"content": [{"type": "text", "text": text}], "metadata": metadata})


def pending_body(prompt_id: str, kind: Kind, questions: Sequence[Question]) -> bytes:
    meta = PendingPromptMetadata(
        prompt=PendingPromptPayload(prompt_id=prompt_id, kind=kind, questions=list(questions))
    )
    return body(render_content(questions), meta.model_dump(exclude_none=True))


def resolved_body(prompt: Prompt) -> bytes:
    payload: AnsweredPayload | CancelledPayload
    if prompt.state == "answered":
        answers = prompt.answers or []
        payload = AnsweredPayload(prompt_id=prompt.prompt_id, kind=prompt.kind, answers=answers)
        text = answered_content(answers)
    else:
        reason = prompt.reason or ""
        payload = CancelledPayload(prompt_id=prompt.prompt_id, kind=prompt.kind, reason=reason)
        text = cancelled_content(reason)
    metadata: dict[str, Any] = ResolvedMetadata(prompt=payload).model_dump()
    # Who answered and through which surface sit beside `prompt`, which keeps the protocol's shape.
    if prompt.state == "answered" and prompt.answered_by:
        metadata["answered_by"] = prompt.answered_by
    if prompt.state == "answered" and prompt.answered_via:
        metadata["surface"] = prompt.answered_via
    return body(text, metadata)


def item_from_entry(sid: str, fields: Mapping[str, str]) -> Item:
    data = orjson.loads(fields["body"])
    return Item(
        id=fields["id"],
        author=fields["author"],
        content=data["content"],
        metadata=data.get("metadata") or {},
        created_at=sid_datetime(sid),
    )


def item_from_inbox(raw: str) -> Item:
    entry = orjson.loads(raw)
    return item_from_entry(entry["sid"], entry)


def _opt_ms(value: str | None) -> datetime | None:
    return ms_datetime(value) if value else None


def _questions(h: Mapping[str, str]) -> list[Question]:
    """A prompt's questions, from its item's body (`_body`, read beside the hash)."""
    body = h.get("_body")
    if not body:
        return []
    raw = orjson.loads(body)["metadata"]["prompt"]["questions"]
    return [Question.model_validate(q) for q in raw]


def prompt_from_hash(thread_id: str, prompt_id: str, h: Mapping[str, str]) -> Prompt:
    answers = h.get("answers")
    return Prompt(
        prompt_id=prompt_id,
        thread_id=thread_id,
        kind=h["kind"],
        questions=_questions(h),
        state=h["state"],
        item_id=h["item"],
        created_at=ms_datetime(h["created"]),
        answers=[Answer.model_validate(a) for a in orjson.loads(answers)] if answers else None,
        reason=h.get("reason"),
        source=h.get("source"),
        answer_item_id=h.get("answer_item"),
        answer_text=h.get("text"),
        answered_by=h.get("by"),
        answered_via=h.get("via"),
        resolved_at=_opt_ms(h.get("resolved")),
        delivered_at=_opt_ms(h.get("delivered")),
        audit_item_id=h.get("audit_item"),
        escalated_to=h.get("escalated"),
    )
