"""A scripted fake Anthropic Messages API on 127.0.0.1, for driving the real Claude Code CLI.

Standard library only. It answers `POST /v1/messages` (any query string) with a streamed reply
(server-sent events, in the shape the real API streams), `count_tokens` and
`/v1/models` just in case, and 404 otherwise. Every request body is recorded.

The model is scripted per conversation, so concurrent sessions, resumes and retries need no
coordination: a `Script` maps a marker (a substring of the conversation's first user message;
the longest marker found wins) to a list of replies, and the reply sent is the one at index
"number of assistant messages already in the request". A reply is a list of blocks
(`text(...)`, `tool_use(...)`) or a callable taking the request's `messages` and returning
blocks, for replies that depend on what the model was told (e.g. branch on a tool_result). A
request whose index is past the end gets a short closing text; a request with no `tools` (a side
call) gets a short text too.

    server = FakeAnthropic(Script({"write the file": [[tool_use("Bash", {...})], [text("done")]]}))
    server.start(); ...; server.tool_results("toolu_...")  # what the model was told
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Block = dict[str, Any]
Reply = list[Block] | Callable[[list[dict[str, Any]]], list[Block]]

__all__ = [
    "FakeAnthropic",
    "Script",
    "first_user_text",
    "last_user_text",
    "text",
    "tool_results_in",
    "tool_use",
]

_ids = itertools.count(1)


def text(words: str) -> Block:
    return {"type": "text", "text": words}


def tool_use(name: str, tool_input: dict[str, Any], tool_id: str | None = None) -> Block:
    """A tool call; without `tool_id` each reply gets a fresh, unique `toolu_` id."""
    block: Block = {"type": "tool_use", "name": name, "input": tool_input}
    if tool_id is not None:
        block["id"] = tool_id
    return block


def _content(message: Mapping[str, Any]) -> list[Block]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]


def _text_of(block: Block) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(c.get("text", "") for c in content if isinstance(c, dict))
    return ""


def tool_results_in(messages: Sequence[Mapping[str, Any]]) -> dict[str, Block]:
    """Every tool_result in a conversation, by tool_use id (the last one wins), with its text
    under `"text"`."""
    out: dict[str, Block] = {}
    for message in messages:
        if message.get("role") != "user":
            continue
        for block in _content(message):
            if block.get("type") == "tool_result":
                out[str(block.get("tool_use_id"))] = {**block, "text": _text_of(block)}
    return out


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text blocks of the conversation's last user message, joined."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return "\n".join(
                b.get("text", "") for b in _content(message) if b.get("type") == "text"
            )
    return ""


def first_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text blocks of the conversation's first user message, joined (where markers are)."""
    for message in messages:
        if message.get("role") == "user":
            return "\n".join(
                b.get("text", "") for b in _content(message) if b.get("type") == "text"
            )
    return ""


@dataclass
class Script:
    """Replies per conversation: the longest marker found in its first user message wins."""

    conversations: dict[str, list[Reply]]
    closing: str = "All done."

    def reply(self, messages: list[dict[str, Any]]) -> list[Block]:
        first = first_user_text(messages)
        index = sum(1 for m in messages if m.get("role") == "assistant")
        found = [m for m in self.conversations if m in first]
        if not found:
            return [text("I have no script for this conversation.")]
        replies = self.conversations[max(found, key=len)]  # "RUN-1" must not take "RUN-10"'s
        if index >= len(replies):
            return [text(self.closing)]
        reply = replies[index]
        return list(reply(messages) if callable(reply) else reply)


@dataclass
class Request:
    """One recorded `POST /v1/messages`."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float  # time.monotonic() when it arrived
    reply: list[Block] = field(default_factory=list)
    sent_at: float = 0.0  # time.time() when the whole reply had been written

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])


class FakeAnthropic:
    """The fake API server; `start()` serves on a free loopback port in a daemon thread."""

    def __init__(self, script: Script | None = None, *, chunk_pause: float = 0.0) -> None:
        self.script = script or Script({})
        self.chunk_pause = chunk_pause  # a pause before `message_delta`, to stretch a stream
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeAnthropic:
        fake = self

        class Handler(_Handler):
            server_fake = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # -- what the model saw -------------------------------------------------------------------

    def main_requests(self) -> list[Request]:
        """Requests that carried tools (the agent's own turns, not side calls)."""
        with self._lock:
            return [r for r in self.requests if r.body.get("tools")]

    def tool_results(self, tool_use_id: str) -> list[Block]:
        """Every tool_result for `tool_use_id` the model received, in request order (a
        conversation's later requests repeat earlier results: each request is listed once)."""
        out: list[Block] = []
        for r in self.main_requests():
            found = tool_results_in(r.messages).get(tool_use_id)
            if found is not None and (not out or out[-1] != found):
                out.append(found)
        return out

    def tool_uses(self, name: str | None = None) -> list[Block]:
        """Every tool_use block the fake model sent, in order."""
        with self._lock:
            blocks = [b for r in self.requests for b in r.reply if b.get("type") == "tool_use"]
        return [b for b in blocks if name is None or b["name"] == name]

    def first_request_with(self, tool_use_id: str) -> Request | None:
        for r in self.main_requests():
            if tool_use_id in tool_results_in(r.messages):
                return r
        return None

    # -- serving ------------------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _reply_for(self, body: dict[str, Any]) -> list[Block]:
        if not body.get("tools"):
            return [text("ok")]
        blocks = self.script.reply(list(body.get("messages") or []))
        out = []
        for block in blocks:
            if block.get("type") == "tool_use" and "id" not in block:
                fresh = f"toolu_{next(_ids):04d}{uuid.uuid4().hex[:16]}"
                block = {**block, "id": fresh}  # noqa: PLW2901 - a copy with an id
            out.append(block)
        return out


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _events(model: str, blocks: list[Block]) -> tuple[list[bytes], list[bytes]]:
    """The reply as SSE: (everything up to the last content block, the closing events)."""
    head = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": f"msg_{uuid.uuid4().hex[:24]}",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": 10,
                        "output_tokens": 1,
                        "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0,
                    },
                },
            },
        ),
        _sse("ping", {"type": "ping"}),
    ]
    for i, b in enumerate(blocks):
        if b["type"] == "tool_use":
            start = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
            raw = json.dumps(b["input"])
            deltas = [
                {"type": "input_json_delta", "partial_json": raw[j : j + 20]}
                for j in range(0, len(raw), 20)
            ] or [{"type": "input_json_delta", "partial_json": "{}"}]
        else:
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": b["text"]}]
        head.append(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": i, **{"content_block": start}},
            )
        )
        for d in deltas:
            head.append(
                _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})
            )
        head.append(_sse("content_block_stop", {"type": "content_block_stop", "index": i}))
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    tail = [
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 5},
            },
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]
    return head, tail


class _Handler(BaseHTTPRequestHandler):
    server_fake: FakeAnthropic
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:16]}")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path.startswith("/v1/models"):
            self._json(200, {"data": [], "has_more": False, "first_id": None, "last_id": None})
        else:
            self._json(
                404, {"type": "error", "error": {"type": "not_found_error", "message": path}}
            )

    def do_POST(self) -> None:
        fake = self.server_fake
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        if path.endswith("/count_tokens"):
            self._json(200, {"input_tokens": 10})
            return
        if path != "/v1/messages":
            self._json(
                404, {"type": "error", "error": {"type": "not_found_error", "message": path}}
            )
            return
        request = Request(path, dict(self.headers.items()), body, time.monotonic())
        request.reply = fake._reply_for(body)
        fake._record(request)
        head, tail = _events(str(body.get("model") or "claude-fake"), request.reply)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:16]}")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            self._chunk(b"".join(head))
            if fake.chunk_pause:
                time.sleep(fake.chunk_pause)
            self._chunk(b"".join(tail))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            request.sent_at = time.time()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
