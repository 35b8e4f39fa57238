"""The checks of a caller's input, before anything is written: `LIMITS` and what each public
method refuses with `BadItem` (prompts, items, JSON values, ids, epochs, names).

Pure functions, no Redis: the `Broker` (broker/client.py and the parts it is made of) calls
them first, so a bad argument raises and writes nothing.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from broker.answers import check_structured, prepare
from broker.errors import BadItem
from broker.keys import check_prompt_id
from broker.models import KINDS, Kind, Question

__all__ = ["LIMITS"]

#: Documented input limits: past them a call raises `BadItem` and writes nothing.
LIMITS = {
    "item_bytes": 64 * 1024,  # an item's content and metadata, as JSON
    "questions": 20,  # questions in one prompt
    "options": 50,  # options in one question
    "author_chars": 128,
    "reason_chars": 1000,  # a cancel's reason
    "depth": 64,  # nesting of objects and lists in content, metadata and agent state
}

_RESERVED_TYPES = frozenset(
    {
        "pending_prompt",
        "pending_prompt_resolved",
        "approval_granted",
        "policy_denied",
        "policy_applied",  # its presence tells an orchestrator the policy was enforced
    }
)
_ITEM_KEYS = frozenset({"content", "metadata", "author"})
_STREAM_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")
_SURFACE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")


def _epoch(epoch: int | None) -> str:
    checked = _check_epoch(epoch)
    return "" if checked is None else str(checked)


def _check_size(body: bytes, field: str) -> None:
    if len(body) > LIMITS["item_bytes"]:
        raise BadItem(
            field, f"{len(body)} bytes as JSON, over the {LIMITS['item_bytes']}-byte limit"
        )


def _check_prompt(kind: object, questions: object) -> tuple[Kind, list[Question]]:
    if kind not in KINDS:
        raise BadItem("kind", f"{kind!r} is not a prompt kind (one of {', '.join(KINDS)})")
    if isinstance(questions, str | bytes) or not isinstance(questions, Sequence):
        raise BadItem("questions", "expected a list of questions")
    if not questions:
        raise BadItem("questions", "a prompt needs at least one question")
    if len(questions) > LIMITS["questions"]:
        raise BadItem(
            "questions", f"{len(questions)} questions, over the limit of {LIMITS['questions']}"
        )
    qs: list[Question] = []
    for i, q in enumerate(questions):
        try:
            qs.append(q if isinstance(q, Question) else Question.model_validate(q))
        except ValidationError as e:
            err = e.errors()[0]
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            raise BadItem(f"questions[{i}]{loc}", err["msg"]) from None
        if len(qs[-1].options) > LIMITS["options"]:
            raise BadItem(f"questions[{i}].options", f"over the limit of {LIMITS['options']}")
        _check_json(qs[-1].model_dump(exclude_none=True), f"questions[{i}]")
    if kind in ("approval", "text") and len(qs) != 1:
        raise BadItem("questions", f"a {kind} prompt has exactly one question, not {len(qs)}")
    if kind == "text" and qs[0].options:
        raise BadItem("questions[0].options", "a text prompt has no options")
    return kind, qs


class _CheckedItem:
    """An inbound item, checked and made ready for route.lua."""

    __slots__ = (
        "author",
        "body",
        "is_self",
        "malformed",
        "named",
        "prepared",
        "refusal",
        "structured",
        "type",
    )

    def __init__(self, author: str, body: bytes, type_: str, is_self: bool) -> None:
        self.author, self.body, self.type, self.is_self = author, body, type_, is_self
        self.named = ""
        self.structured: bytes | str = ""
        self.refusal = ""
        self.malformed = False  # a set of the wrong shape: refused even when it would be queued
        self.prepared: bytes | str = ""


def _check_item(item: Mapping[str, Any] | BaseModel, identity: str) -> _CheckedItem:
    data = item.model_dump() if isinstance(item, BaseModel) else item
    if not isinstance(data, Mapping):
        raise BadItem("item", f"expected an object, got {type(data).__name__}")
    unknown = [k for k in data if k not in _ITEM_KEYS]
    if unknown:
        unknown.sort(key=repr)
        name = unknown[0] if isinstance(unknown[0], str) else repr(unknown[0])
        raise BadItem(
            _key_path("item", _check_text(name, "item")),
            "unknown field (an item has content, metadata, author)",
        )
    author = _check_author(data.get("author", "user"))
    content = data.get("content", [])
    text, has_file = _check_content(content)
    metadata, type_ = _check_metadata(data.get("metadata"))
    _check_json(content, "content")
    _check_json(metadata, "metadata")
    is_self = author == identity
    if type_ in _RESERVED_TYPES and not is_self:
        raise BadItem("metadata.type", f"{type_!r} items are posted by the broker only")
    body = _dumps({"content": content, "metadata": metadata}, "item")
    _check_size(body, "item")
    checked = _CheckedItem(author, body, type_, is_self)
    if is_self:
        return checked
    named = metadata.get("prompt_id")
    if named is not None:
        checked.named = check_prompt_id(named, "metadata.prompt_id")
    _check_answers(checked, metadata.get("answers"), text, has_file)
    return checked


def _check_answers(checked: _CheckedItem, raw: object, text: str, has_file: bool) -> None:
    """A person's `metadata.answers`, and the text to map when there is no usable set."""
    if raw is not None and not isinstance(raw, list):
        # Checked whatever the thread's state: a queued item must not carry it unchecked.
        raise BadItem(
            "metadata.answers",
            f"expected a list of {{question, answer}} objects, got {type(raw).__name__}",
        )
    entries, refusal = check_structured(raw)
    checked.malformed = refusal is not None and raw != []
    if entries is not None:
        checked.structured = orjson.dumps(entries)
    checked.refusal = refusal or ""
    if text or has_file:
        checked.prepared = orjson.dumps(prepare(text))
    elif entries is None:
        if refusal:
            raise BadItem("metadata.answers", refusal.removeprefix("metadata.answers: "))
        raise BadItem("content", "no text, no file and no metadata.answers: nothing to post")


def _check_author(author: object) -> str:
    limit = LIMITS["author_chars"]
    if not isinstance(author, str) or not author or len(author) > limit:
        raise BadItem("author", f"expected a non-empty string of at most {limit} characters")
    return _check_text(author, "author")


def _check_metadata(metadata: object) -> tuple[Mapping[str, Any], str]:
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, Mapping):
        raise BadItem("metadata", f"expected an object, got {type(metadata).__name__}")
    type_ = metadata.get("type", "")
    if not isinstance(type_, str):
        raise BadItem("metadata.type", "expected a string")
    return metadata, type_


def _check_content(content: object) -> tuple[str, bool]:
    """The item's text (non-empty text blocks joined by newlines) and whether it has a file."""
    if not isinstance(content, list):
        raise BadItem("content", f"expected a list of blocks, got {type(content).__name__}")
    texts: list[str] = []
    has_file = False
    for i, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise BadItem(f"content[{i}]", "expected an object with a string `type`")
        if block["type"] == "text":
            if not isinstance(block.get("text"), str):
                raise BadItem(f"content[{i}].text", "expected a string")
            if block["text"]:
                texts.append(block["text"])
        elif block["type"] == "file":
            file = block.get("file")
            if (
                not isinstance(file, Mapping)
                or not isinstance(file.get("alias"), str)
                or not file["alias"]
            ):
                raise BadItem(f"content[{i}].file.alias", "expected a non-empty string")
            has_file = True
    return "\n".join(texts), has_file


def _check_text(value: str, field: str) -> str:
    """A string Redis and JSON can carry: lone surrogates (from undecodable bytes, say) cannot."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadItem(
                field, f"not valid Unicode text: a lone surrogate at character {e.start}"
            ) from None
    return value


def _key_path(field: str, key: str) -> str:
    simple = key.isascii() and key.replace("_", "a").replace("-", "a").isalnum()
    return f"{field}.{key}" if simple else f"{field}[{key!a}]"


def _check_json(value: object, field: str, depth: int = 0) -> None:
    """Everything in `value` can be stored as JSON, or BadItem names the first place it cannot
    (instead of the encoder's error, which names no field)."""
    limit = LIMITS["depth"]
    if depth > limit:
        raise BadItem(field, f"nested more than {limit} levels deep")
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise BadItem(field, f"the key {key!r} is not a string")
            if type(inner) is str and key.isascii() and inner.isascii() and depth < limit:
                continue  # the common leaf, and nothing in it to name: no path to build
            path = _key_path(field, key)
            _check_text(key, path)
            _check_json(inner, path, depth + 1)
    elif isinstance(value, list | tuple):
        for i, inner in enumerate(value):
            _check_json(inner, f"{field}[{i}]", depth + 1)
    else:
        _check_scalar(value, field)


def _check_scalar(value: object, field: str) -> None:
    if isinstance(value, str):
        _check_text(value, field)
    elif value is None or isinstance(value, bool):
        return
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise BadItem(field, "an integer outside the 64-bit range JSON readers accept")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise BadItem(field, f"{value} is not a JSON number")
    else:
        try:
            orjson.dumps(value)  # what the encoder takes as it is: datetimes, UUIDs, ...
        except (TypeError, orjson.JSONEncodeError):
            raise BadItem(
                field, f"a {type(value).__name__} is not JSON (objects, lists, strings, numbers)"
            ) from None


def _check_epoch(epoch: object) -> int | None:
    if epoch is None:
        return None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise BadItem("epoch", f"expected a lease epoch (a non-negative integer), got {epoch!r}")
    return epoch


def _check_count(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise BadItem(field, f"expected a non-negative integer, got {value!r}")
    return value


def _check_stream_id(value: object, field: str) -> str:
    if not isinstance(value, str) or not _STREAM_ID.fullmatch(value):
        raise BadItem(field, f"{value!r} is not a stream id (like 1700000000000-0)")
    return value


def _dumps(value: object, field: str) -> bytes:
    """orjson, with anything it still refuses (after the checks above) as our own error."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise BadItem(field, f"cannot be stored as JSON ({e})") from None


def _check_surface(surface: object) -> None:
    if surface is not None and (not isinstance(surface, str) or not _SURFACE.fullmatch(surface)):
        raise BadItem("surface", f"{surface!r} is not a surface name (1-32 of a-z 0-9 . _ -)")


def _idempotency(key: object) -> str:
    """The key as route.lua keeps it: hashed, so any string of the caller's fits a key name."""
    if key is None:
        return ""
    if not isinstance(key, str) or not key or len(key) > 255:
        raise BadItem("idempotency_key", "expected a non-empty string of at most 255 characters")
    return hashlib.sha256(_check_text(key, "idempotency_key").encode()).hexdigest()
