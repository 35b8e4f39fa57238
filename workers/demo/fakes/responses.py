"""A scripted fake of the OpenAI Responses API, stdlib only, for driving the real Codex CLI offline.

Codex (`codex app-server`, 0.171.0) calls `POST <base_url>/responses` with `stream: true` and
reads server-sent events. This server answers on 127.0.0.1 with no model: **the person's own
message is the script.** Each line of the newest user message that starts with a directive is one
step of the agent's turn:

- `run: <command>`: call the shell tool (`exec_command`) with `cmd = <command>`.
- `run!: <command>`: the same, asking to run it outside the sandbox
  (`sandbox_permissions: "require_escalated"`, with a justification), so Codex asks for approval
  under `on-request`.
- `patch: <path> <text>`: call `apply_patch` adding the file `<path>` with one line `<text>`.
- `ask: <json>`: call `request_user_input` with `{"questions": <json>}` (a list of
  `{id, header, question, options: [{label, description}]}`).
- `perm: <json>`: call `request_permissions` with `<json>` as its arguments.
- `say: <text>`: the agent says `<text>` (a message, not a tool call).

Steps run in order: the n-th model call of a turn (counted by the tool outputs after the newest
user message) makes the n-th step. After the last step the agent's final message quotes the last
tool output: `done: <output>`. A user message with no directive is answered:

- `... APPROVED ... Retry ...` (a replica's resume text after an approval): repeat the newest tool
  call in the history exactly (a fresh call id), then finish as above.
- `... DENIED ...`, or a message starting `The person denied` / `Denied by policy rule` (the
  Codex harness telling its agent of a refusal): `understood, not retrying`.
- anything else: `noted: <the message>`.

Every request is recorded in `FakeResponses.requests` (the parsed body's summary), for tests.
Run it standalone with `python -m workers.demo.fakes.responses --port 0` (prints its base URL).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeResponses", "Request", "plan"]

_DIRECTIVE = re.compile(r"^(run!?|patch|ask|perm|say):\s?(.*)$")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_CALLS = ("function_call", "custom_tool_call")
#: How the Codex harness tells its agent of a refusal at once (a follow-up turn's input).
_REFUSED = ("The person denied", "Denied by policy rule")
_ids = itertools.count(1)


@dataclass
class Request:
    """One model call, as the fake saw it."""

    at: float  # time.time() when it arrived (wall clock: compared with Redis item times)
    model: str
    tools: list[str]
    user_text: str  # the newest user message
    history: list[str]  # every user message in the input, oldest first
    step: int  # tool outputs since that message
    last_output: str | None  # the newest tool output, if any
    reply: list[dict[str, Any]] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict, repr=False)  # the request as sent

    def texts(self) -> list[str]:
        """Every text the model was given in `input` (messages, tool outputs), oldest first."""
        out = []
        for item in self.body.get("input") or []:
            if not isinstance(item, dict):
                continue
            if item.get("type") in _OUTPUTS:
                out.append(_output_text(item))
            elif item.get("type", "message") == "message":
                out.append(_text_of(item))
        return out

    def outputs(self) -> dict[str, str]:
        """Every tool output in `input`, by call id."""
        return {
            str(i.get("call_id")): _output_text(i)
            for i in self.body.get("input") or []
            if isinstance(i, dict) and i.get("type") in _OUTPUTS
        }


def _text_of(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(c.get("text", "") for c in content if isinstance(c, dict) and "text" in c)
    return ""


def _is_user(item: dict[str, Any]) -> bool:
    if item.get("type", "message") != "message" or item.get("role") != "user":
        return False
    text = _text_of(item)
    return not text.lstrip().startswith(("<environment_context", "<user_instructions", "# AGENTS"))


def _output_text(item: dict[str, Any]) -> str:
    out = item.get("output")
    if isinstance(out, str):
        return out
    if isinstance(out, list):
        return "".join(o.get("text", "") for o in out if isinstance(o, dict))
    if isinstance(out, dict):
        return str(out.get("content", out))
    return json.dumps(out)


def _tool_names(body: dict[str, Any]) -> list[str]:
    names = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            names.append(str(t.get("name") or t.get("type")))
    return names


def _shell_tool(tools: list[str]) -> str:
    for name in ("exec_command", "shell_command", "shell"):
        if name in tools:
            return name
    return "exec_command"


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{next(_ids)}",
        "call_id": f"call_{next(_ids)}",
        "name": name,
        "arguments": json.dumps(arguments),
    }


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "id": f"msg_{next(_ids)}",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _step(kind: str, arg: str, tools: list[str]) -> dict[str, Any]:
    if kind in ("run", "run!"):
        args: dict[str, Any] = {"cmd": arg, "yield_time_ms": 10000}
        name = _shell_tool(tools)
        if name != "exec_command":
            args = {"command": arg}
        if kind == "run!":
            args["sandbox_permissions"] = "require_escalated"
            args["justification"] = f"needs to run `{arg}` outside the sandbox"
        return _call(name, args)
    if kind == "patch":
        path, _, text = arg.partition(" ")
        patch = f"*** Begin Patch\n*** Add File: {path}\n+{text}\n*** End Patch\n"
        return {
            "type": "custom_tool_call",
            "id": f"ctc_{next(_ids)}",
            "call_id": f"call_{next(_ids)}",
            "name": "apply_patch",
            "input": patch,
        }
    if kind == "ask":
        return _call("request_user_input", {"questions": json.loads(arg)})
    if kind == "perm":
        return _call("request_permissions", json.loads(arg))
    return _message(arg)


def _repeat(call: dict[str, Any]) -> dict[str, Any]:
    again = {k: v for k, v in call.items() if k in ("type", "name", "arguments", "input")}
    again["id"] = f"rp_{next(_ids)}"
    again["call_id"] = f"call_{next(_ids)}"
    return again


def plan(body: dict[str, Any]) -> Request:
    """What the fake model answers to one request body (see the module docstring)."""
    items = [i for i in body.get("input") or [] if isinstance(i, dict)]
    tools = _tool_names(body)
    last_user = max((n for n, i in enumerate(items) if _is_user(i)), default=-1)
    user_text = _text_of(items[last_user]) if last_user >= 0 else ""
    after = items[last_user + 1 :]
    outputs = [i for i in after if i.get("type") in _OUTPUTS]
    last_output = _output_text(outputs[-1]) if outputs else None
    req = Request(
        at=time.time(),
        model=str(body.get("model", "")),
        tools=tools,
        user_text=user_text,
        history=[_text_of(i) for i in items if _is_user(i)],
        step=len(outputs),
        last_output=last_output,
        body=body,
    )
    steps = [
        (m[1], m[2])
        for m in (_DIRECTIVE.match(line.strip()) for line in user_text.splitlines())
        if m
    ]
    if steps:
        if req.step < len(steps):
            req.reply = [_step(*steps[req.step], tools)]
        else:
            req.reply = [_message(f"done: {last_output}")]
        return req
    if "APPROVED" in user_text and "Retry" in user_text:
        earlier = [i for i in items[:last_user] if i.get("type") in _CALLS]
        if req.step == 0 and earlier:
            req.reply = [_repeat(earlier[-1])]
        else:
            req.reply = [_message(f"done: {last_output}")]
        return req
    if "DENIED" in user_text or user_text.startswith(_REFUSED):
        req.reply = [_message("understood, not retrying")]
        return req
    req.reply = [_message(f"noted: {user_text}")]
    return req


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n".encode()


class FakeResponses:
    """The fake Responses API on 127.0.0.1: `start()`, use `.base_url`, `stop()`.

    `responder` decides each reply (default: `plan`); `hold` (seconds) delays every reply, and
    `delay(request)`, when set, the seconds to hold that one (a model call left pending).
    """

    def __init__(
        self, port: int = 0, responder: Callable[[dict[str, Any]], Request] = plan
    ) -> None:
        self.responder = responder
        self.requests: list[Request] = []
        self.other: list[str] = []  # any request that was not POST .../responses
        self.hold = 0.0
        self.delay: Callable[[Request], float] | None = None
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake.other.append(f"GET {self.path}")
                self._send(404, b"{}", "application/json")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self.path.rstrip("/").endswith("/responses"):
                    fake.other.append(f"POST {self.path}")
                    self._send(404, b"{}", "application/json")
                    return
                body = json.loads(raw or b"{}")
                req = fake.responder(body)
                with fake._lock:
                    fake.requests.append(req)
                wait = fake.hold or (fake.delay(req) if fake.delay is not None else 0.0)
                if wait:
                    time.sleep(wait)
                self._send(200, fake.stream(req.reply), "text/event-stream")

            def _send(self, status: int, data: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @staticmethod
    def stream(items: list[dict[str, Any]]) -> bytes:
        rid = f"resp_{next(_ids)}"
        out = [_sse("response.created", {"response": {"id": rid}})]
        for item in items:
            out.append(_sse("response.output_item.added", {"item": item}))
            out.append(_sse("response.output_item.done", {"item": item}))
        usage = {
            "input_tokens": 10,
            "input_tokens_details": None,
            "output_tokens": 5,
            "output_tokens_details": None,
            "total_tokens": 15,
        }
        out.append(_sse("response.completed", {"response": {"id": rid, "usage": usage}}))
        return b"".join(out)

    def start(self) -> FakeResponses:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fake-responses", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FakeResponses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with FakeResponses(args.port) as fake:
        print(fake.base_url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
