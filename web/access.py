"""Who may read and answer what, past the `threads` glob: escalation widens it.

A prompt whose timing escalated it (`Prompt.escalated_to`, set by a timekeeper) may be read and
answered by the identities in that group (`Identity.groups`) even outside their glob: the prompt
itself, its thread's view while it is the thread's active prompt, its events in `/v1/events`,
and an answer that names it (`metadata.prompt_id`). Nothing else of that thread: not its other
prompts, its timing, a cancel, a message. Every refusal is the glob's own 403, whether or not
the thread or the prompt exists, so a token learns nothing of threads it may not see.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker import BadItem, Broker, BrokerError, Prompt, PromptNotFound, events
from web.auth import Caller
from web.errors import ApiError

__all__ = [
    "Visibility",
    "answerable_prompt",
    "escalated_to_caller",
    "forbidden",
    "readable_prompt",
    "viewable_thread",
]

_KNOWN = 10_000  # prompts one stream remembers the escalation of, before it starts afresh


def forbidden() -> ApiError:
    return ApiError(403, "forbidden", "this token may not see that thread")


def escalated_to_caller(caller: Caller, prompt: Prompt) -> bool:
    """Whether the prompt was escalated to one of the caller's groups."""
    return prompt.escalated_to is not None and prompt.escalated_to in caller.identity.groups


async def _escalated(broker: Broker, caller: Caller, thread_id: str, prompt_id: str) -> Prompt:
    if not caller.identity.groups:
        raise forbidden()
    try:
        prompt = await broker.get_prompt(thread_id, prompt_id)
    except PromptNotFound:
        raise forbidden() from None
    if not escalated_to_caller(caller, prompt):
        raise forbidden()
    return prompt


async def readable_prompt(broker: Broker, caller: Caller, thread_id: str, prompt_id: str) -> Prompt:
    """The prompt, if the caller may read it: in its glob (404 if there is none), or escalated
    to one of its groups (else 403)."""
    if caller.sees(thread_id):
        return await broker.get_prompt(thread_id, prompt_id)
    return await _escalated(broker, caller, thread_id, prompt_id)


async def viewable_thread(broker: Broker, caller: Caller, thread_id: str) -> None:
    """403 unless the thread is in the caller's glob or its active prompt was escalated to one
    of the caller's groups."""
    if caller.sees(thread_id):
        return
    if caller.identity.groups:
        active = await broker.active_prompt(thread_id)
        if active is not None and escalated_to_caller(caller, active):
            return
    raise forbidden()


async def answerable_prompt(
    broker: Broker, caller: Caller, thread_id: str, body: Mapping[str, Any]
) -> None:
    """Outside the caller's glob, an item may only answer a prompt escalated to the caller's
    groups, and must name it (`metadata.prompt_id`): the library then refuses it as stale
    (409) if that prompt is no longer the active one, so it is never queued as a message."""
    if caller.sees(thread_id):
        return
    metadata = body.get("metadata")
    named = metadata.get("prompt_id") if isinstance(metadata, Mapping) else None
    if not caller.identity.groups or not isinstance(named, str) or not named:
        raise forbidden()
    try:
        await _escalated(broker, caller, thread_id, named)
    except BadItem:  # a malformed id reads as no such prompt: the same 403
        raise forbidden() from None


class Visibility:
    """Which events one `/v1/events` stream shows: those of the threads in its caller's glob,
    and those of prompts escalated to the caller's groups (from their `prompt.escalated` on).

    Only a caller with groups ever looks further than the glob: an event of another thread is
    shown once its prompt's escalation to one of them was seen on the stream or, for a prompt
    escalated before the stream began, read from its record (once per prompt)."""

    def __init__(self, broker: Broker, caller: Caller, thread_id: str | None = None) -> None:
        self.broker = broker
        self.caller = caller
        self.thread_id = thread_id
        self.groups = frozenset(caller.identity.groups)
        self._known: dict[str, bool] = {}

    def _remember(self, prompt_id: str, mine: bool) -> bool:
        if len(self._known) >= _KNOWN:
            self._known.clear()
        self._known[prompt_id] = mine
        return mine

    async def __call__(self, event: events.Event) -> bool:
        if self.thread_id is not None:
            return event.thread_id == self.thread_id
        if self.caller.sees(event.thread_id):
            return True
        if not self.groups:
            return False
        if event.name == events.ESCALATED:
            return self._remember(event.prompt_id, event.data.get("to") in self.groups)
        known = self._known.get(event.prompt_id)
        if known is None:
            known = await self._look(event)
        return known

    async def _look(self, event: events.Event) -> bool:
        """Whether an event's prompt, not seen on this stream before, was escalated to us."""
        if event.name == events.OPENED:
            return self._remember(event.prompt_id, False)  # nothing is escalated as it opens
        try:
            prompt = await self.broker.get_prompt(event.thread_id, event.prompt_id)
        except PromptNotFound:
            return self._remember(event.prompt_id, False)
        except BrokerError:
            return False  # Redis is away, or not an id at all: not shown, not remembered
        return self._remember(event.prompt_id, escalated_to_caller(self.caller, prompt))
