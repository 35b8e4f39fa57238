"""An example webhook receiver: checks each delivery's signature, drops repeats, and turns the
events into chat-style messages with a link to answer in the inbox.

Deliveries run concurrently and are retried on their own, so they can arrive out of order: an
opening, reminder or escalation that arrives after its prompt's end (answered or cancelled) is
acknowledged but not said, so a chat never asks someone to answer a prompt it already called done.

    uvicorn --factory web.receiver:from_env   # RECEIVER_SECRET, INBOX_URL (http://127.0.0.1:8420)

A real one would post `messages` to a chat; this one keeps them in a list (and logs them).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from web.webhooks import sign

__all__ = ["Receiver", "from_env"]

logger = logging.getLogger("web.receiver")

#: Deliveries signed longer ago than this are refused: a captured one cannot be replayed later.
MAX_AGE = 300
_KINDS = 10_000  # prompts whose kind it remembers (for their reminders' words)
_ENDED = 10_000  # prompts whose end it remembers (to drop a late opening or reminder)
_ENDS = ("prompt.answered", "prompt.cancelled")


def _age(seconds: object) -> str:
    """`45s`, `15m`, `1h 30m`, `2d 1h`: how long a prompt has waited, in a chat line."""
    s = int(seconds) if isinstance(seconds, int | float) else 0
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    big, small = (86400, 3600) if s >= 86400 else (3600, 60)
    unit = {86400: "d", 3600: "h", 60: "m"}
    rest = (s % big) // small
    return f"{s // big}{unit[big]}" + (f" {rest}{unit[small]}" if rest else "")


class Receiver:
    """The receiver's state: what it said, and the deliveries it has seen (its dedupe)."""

    def __init__(self, secret: str, inbox_url: str) -> None:
        self.secret = secret
        self.inbox_url = inbox_url.rstrip("/")
        self.messages: list[str] = []
        self.seen: set[str] = set()
        self.kinds: dict[str, str] = {}  # prompt id -> its kind, from its prompt.opened
        self.ended: dict[str, None] = {}  # prompts answered or cancelled, oldest first

    def message(self, event: dict[str, Any]) -> str | None:
        """The chat line for one event, or None for one that arrived after its prompt's end."""
        thread, prompt = event.get("thread_id", "?"), event.get("prompt_id", "?")
        link = f"{self.inbox_url}/#/threads/{thread}/prompts/{prompt}"
        name = event.get("event")
        if prompt in self.ended:
            return None  # its end was said: a late opening, reminder or second end is stale
        if name in _ENDS:
            if len(self.ended) >= _ENDED:
                del self.ended[next(iter(self.ended))]
            self.ended[prompt] = None
        if name == "prompt.opened":
            if len(self.kinds) >= _KINDS:
                self.kinds.clear()
            self.kinds[prompt] = event.get("kind", "prompt")
            return f"[{thread}] a {event.get('kind', 'prompt')} waits on you: answer at {link}"
        if name == "prompt.answered":
            self.kinds.pop(prompt, None)
            return f"[{thread}] answered by {event.get('answered_by') or 'someone'} ({link})"
        waited = f"a {self.kinds.get(prompt, 'prompt')} has waited {_age(event.get('age_s'))}"
        if name == "prompt.reminder":
            n, of = event.get("reminder", "?"), event.get("of", "?")
            return f"[{thread}] reminder {n} of {of}: {waited}: answer at {link}"
        if name == "prompt.escalated":
            return f"[{thread}] escalated to {event.get('to', '?')}: {waited}: answer at {link}"
        self.kinds.pop(prompt, None)
        return f"[{thread}] cancelled: {event.get('reason') or 'no reason given'} ({link})"

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        stamp = request.headers.get("x-prompt-broker-timestamp", "")
        given = request.headers.get("x-prompt-broker-signature", "")
        delivery = request.headers.get("x-prompt-broker-delivery", "")
        if not stamp.isascii() or not stamp.isdigit() or abs(time.time() - int(stamp)) > MAX_AGE:
            return PlainTextResponse("stale or missing timestamp", 400)
        if not hmac.compare_digest(given, sign(self.secret, int(stamp), body)):
            return PlainTextResponse("bad signature", 401)
        if delivery in self.seen:
            return PlainTextResponse("already had it")  # at least once: a retry repeats
        self.seen.add(delivery)
        text = self.message(orjson.loads(body))
        if text is None:
            logger.info("receiver.stale", extra={"delivery": delivery})
            return PlainTextResponse("ok (after the prompt's end: not said)")
        self.messages.append(text)
        logger.info("receiver.message", extra={"text": text})
        return PlainTextResponse("ok")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/hook", self.handle, methods=["POST"])])


def from_env() -> Starlette:
    secret = os.environ["RECEIVER_SECRET"]
    return Receiver(secret, os.environ.get("INBOX_URL", "http://127.0.0.1:8420")).app()
