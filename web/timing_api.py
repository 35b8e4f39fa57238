"""Timings over HTTP: `GET`/`PUT /v1/threads/{thread}/timing` and
`.../prompts/{prompt}/timing`, and the effective timing every prompt's JSON carries.

Setting a timing takes the `answer` scope within the caller's `threads` glob: how long a prompt
may wait, and who is asked after it, is the person's call on their own threads. Members of a
group a prompt was escalated to may answer it but not change its timing. Reading one takes
`read`, like the prompt: a prompt's timing is in its JSON anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from broker import Broker, Prompt, ThreadNotFound, Timing, parse_duration
from broker.keys import check_prompt_id
from web import access, inputs
from web.auth import Gate
from web.errors import json_response

__all__ = ["get_timing", "parse_timing", "put_timing", "read_timings", "timing_json"]


async def read_timings(broker: Broker, prompts: Sequence[Prompt]) -> dict[str, Timing | None]:
    """Each prompt's effective timing (its own, else its thread's, as `Broker.get_timing`
    says), by prompt id: one round trip for a whole page (the two records' fields, pipelined)."""
    if not prompts:
        return {}
    threads = sorted({p.thread_id for p in prompts})
    pipe = broker.redis.pipeline(transaction=False)
    for p in prompts:
        pipe.hget(broker.thread(p.thread_id).prompt(p.prompt_id), "timing")
    for t in threads:
        pipe.hget(broker.thread(t).timing, "spec")
    got = await pipe.execute()
    own, of_thread = got[: len(prompts)], dict(zip(threads, got[len(prompts) :], strict=True))
    return {
        p.prompt_id: Timing.from_spec(spec or of_thread[p.thread_id])
        for p, spec in zip(prompts, own, strict=True)
    }


def timing_json(timing: Timing | None, prompt: Prompt | None = None) -> dict[str, Any]:
    """`timing` (its JSON, or None) and, for a prompt with a deadline, `deadline_at`."""
    deadline_at = None
    if timing is not None and timing.deadline is not None and prompt is not None:
        deadline_at = prompt.created_at + timedelta(seconds=timing.deadline)
    return {
        "timing": None if timing is None else timing.model_dump(exclude_none=True),
        "deadline_at": deadline_at,
    }


def _seconds(value: object, field: str) -> object:
    return parse_duration(value, field) if isinstance(value, str) else value


def parse_timing(body: object) -> Timing | None:
    """A PUT's body: the Timing JSON (durations in seconds, or as `15m`, `2h`, `1d`), or `null`
    to clear it. `BadItem` naming the field (`timing.deadline`) otherwise."""
    if body is None:
        return None
    if isinstance(body, dict):
        body = dict(body)
        for name in ("deadline", "escalate"):
            if name in body:
                body[name] = _seconds(body[name], f"timing.{name}")
        if isinstance(body.get("remind"), list):
            body["remind"] = [
                _seconds(r, f"timing.remind.{i}") for i, r in enumerate(body["remind"])
            ]
    return Timing.parse(body)


async def _answer(broker: Broker, request: Request) -> dict[str, Any]:
    """What both methods answer: the ids, the effective timing and (a prompt's) `deadline_at`."""
    thread_id = inputs.thread_id(request)
    raw = request.path_params.get("prompt_id")
    if raw is None:
        return {"thread_id": thread_id, **timing_json(await broker.get_timing(thread_id))}
    prompt = await broker.get_prompt(thread_id, check_prompt_id(raw))
    timings = await read_timings(broker, [prompt])
    return {
        "thread_id": thread_id,
        "prompt_id": prompt.prompt_id,
        **timing_json(timings[prompt.prompt_id], prompt),
    }


async def get_timing(broker: Broker, gate: Gate, request: Request) -> Response:
    thread_id = inputs.thread_id(request)
    raw = request.path_params.get("prompt_id")
    if raw is None:
        gate.require(request, "read", thread_id)
        if not await broker.thread_exists(thread_id):
            raise ThreadNotFound(thread_id)
    else:
        caller = gate.require(request, "read")
        await access.readable_prompt(broker, caller, thread_id, check_prompt_id(raw))
    return json_response(await _answer(broker, request))


async def put_timing(broker: Broker, gate: Gate, request: Request) -> Response:
    thread_id = inputs.thread_id(request)
    gate.require(request, "answer", thread_id)  # the glob only: escalation does not widen it
    raw = request.path_params.get("prompt_id")
    prompt_id = None if raw is None else check_prompt_id(raw)
    timing = parse_timing(inputs.parse_json(await inputs.raw_body(request)))
    await broker.set_timing(thread_id, timing, prompt_id=prompt_id)
    return json_response(await _answer(broker, request))
