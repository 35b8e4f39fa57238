"""Wire models: thread items, prompts, questions and answers, exactly as the protocol shapes them.

Everything here is a frozen pydantic model. What we own forbids unknown fields, so a misspelt
`multiselect` is an error rather than a single-select question.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = [
    "Answer",
    "AnsweredPayload",
    "CancelledPayload",
    "Item",
    "Kind",
    "Option",
    "PendingPromptMetadata",
    "PendingPromptPayload",
    "Prompt",
    "PromptState",
    "Question",
    "ResolvedMetadata",
    "Routed",
]

Kind = Literal["approval", "ask_user_question", "text"]
PromptState = Literal["pending", "answered", "cancelled"]
KINDS: tuple[Kind, ...] = ("approval", "ask_user_question", "text")


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Option(_Wire):
    """One choice of a question: the label is what a person picks, by name or number."""

    label: str
    description: str = ""


class Question(_Wire):
    """One question of a prompt, as stored in `metadata.prompt.questions[]`.

    `subject` and `grant_key` are the structural fields approval questions carry (the display name
    of what is approved, and the exact call); they are left out of the wire form when absent.
    """

    question: str
    header: str = ""
    options: list[Option] = Field(default_factory=list)
    multiSelect: bool = False
    subject: str | None = None
    grant_key: str | None = None

    def wire(self) -> dict[str, Any]:
        """The question as it goes on the wire (absent structural fields left out)."""
        return self.model_dump(exclude_none=True)


class Answer(_Wire):
    """The answer to one question: zero or more labels, or free text, always a list."""

    question: str
    answer: list[str]


#: A list of answers, validated in one call (the wake's path: a wait returning them).
ANSWERS: TypeAdapter[list[Answer]] = TypeAdapter(list[Answer])


class PendingPromptPayload(_Wire):
    prompt_id: str
    kind: Kind
    prompt_state: Literal["pending"] = "pending"
    questions: list[Question]


class PendingPromptMetadata(_Wire):
    """`metadata` of a `pending_prompt` item."""

    type: Literal["pending_prompt"] = "pending_prompt"
    prompt: PendingPromptPayload


class AnsweredPayload(_Wire):
    prompt_id: str
    kind: Kind
    prompt_state: Literal["answered"] = "answered"
    answers: list[Answer]


class CancelledPayload(_Wire):
    prompt_id: str
    kind: Kind
    prompt_state: Literal["cancelled"] = "cancelled"
    reason: str


class ResolvedMetadata(_Wire):
    """`metadata` of a `pending_prompt_resolved` item: answers or a reason, never both."""

    type: Literal["pending_prompt_resolved"] = "pending_prompt_resolved"
    prompt: Annotated[AnsweredPayload | CancelledPayload, Field(discriminator="prompt_state")]


class Item(BaseModel):
    """One thread item. `created_at` is the Redis server's clock (the stream entry's time)."""

    model_config = ConfigDict(frozen=True)

    id: str
    author: str
    content: list[dict[str, Any]]
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime

    @property
    def type(self) -> str:
        """`metadata.type`, or `""` for an ordinary message."""
        value = self.metadata.get("type")
        return value if isinstance(value, str) else ""

    @property
    def text(self) -> str:
        """Every non-empty text block, joined by newlines."""
        return "\n".join(
            b["text"]
            for b in self.content
            if b.get("type") == "text" and isinstance(b.get("text"), str) and b["text"]
        )


class Prompt(BaseModel):
    """A prompt as the broker records it in `pp:{T}:prompt:<id>`."""

    model_config = ConfigDict(frozen=True)

    prompt_id: str
    thread_id: str
    kind: Kind
    questions: list[Question]
    state: PromptState
    item_id: str
    created_at: datetime
    answers: list[Answer] | None = None
    reason: str | None = None
    source: Literal["structured", "text"] | None = None
    answer_item_id: str | None = None
    answer_text: str | None = None  # the person's words, when the answer was mapped from text
    answered_by: str | None = None  # the answer item's author
    answered_via: str | None = None  # the surface it came through, when the poster named one
    resolved_at: datetime | None = None
    delivered_at: datetime | None = None
    audit_item_id: str | None = None
    escalated_to: str | None = None  # the token scope its timing widened answering to


class Routed(BaseModel):
    """What happened to a posted item.

    `answered`: it answered `prompt_id` with `answers`, arrived at by `source`. `queued`: no prompt
    was active, so it waits in the inbox for the next turn. `posted`: the broker's own item (or
    agent output), added to the thread and never taken as an answer. `refused_answers` says why a
    `metadata.answers` set was refused when the item's text was mapped instead.
    """

    model_config = ConfigDict(frozen=True)

    outcome: Literal["answered", "queued", "posted"]
    item_id: str
    prompt_id: str | None = None
    answers: list[Answer] | None = None
    source: Literal["structured", "text"] | None = None
    refused_answers: str | None = None
