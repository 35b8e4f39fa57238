"""The JSON routes under `/v1`: each checks who calls, then calls the `Broker` API."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from broker import (
    Broker,
    BrokerError,
    Item,
    Prompt,
    PromptNotFound,
    StaleAnswer,
    ThreadNotFound,
    Timing,
)
from broker.keys import check_prompt_id, check_thread_id
from broker.sessions import Session
from web import access, idempotency, inputs, sse, timing_api
from web.auth import COOKIE, Caller, Gate
from web.errors import ApiError, bad, from_broker, json_response
from web.settings import ApiSettings
from web.thread_scan import scan_page
from web.webhooks import Dispatcher

__all__ = ["Api"]

_ITEMS_SHOWN = 1000
_SCAN_BUDGET = 2000  # index entries one page of prompts looks at, at most


def item_json(item: Item) -> dict[str, Any]:
    return {
        "id": item.id,
        "author": item.author,
        "type": item.type,
        "content": item.content,
        "metadata": item.metadata,
        "created_at": item.created_at,
    }


def session_json(session: Session | None) -> dict[str, Any] | None:
    if session is None:
        return None
    return {
        "harness": session.harness,
        "status": session.status,
        "owner": session.owner,
        "epoch": session.epoch,
        "work_folder": session.work_folder,
        "created_at": session.created_at,
        "waiting": session.waiting.model_dump() if session.waiting else None,
    }


class Api:
    """The handlers, over one Broker and the identity gate."""

    def __init__(
        self,
        broker: Broker,
        settings: ApiSettings,
        gate: Gate,
        hub: sse.EventHub,
        hooks: Dispatcher | None = None,
    ):
        self.broker = broker
        self.settings = settings
        self.gate = gate
        self.hub = hub
        self.hooks = hooks

    # -- helpers -------------------------------------------------------------------------------

    async def _session(self, thread_id: str) -> Session | None:
        return await self.broker.sessions.get(thread_id)

    async def _answered_by(self, prompt: Prompt) -> str | None:
        """The author of the item that answered the prompt (the token's name, via the API)."""
        if prompt.answer_item_id is None:
            return None
        for item in reversed(await self.broker.items(prompt.thread_id)):
            if item.id == prompt.answer_item_id:
                return item.author
        return None

    async def prompt_json(
        self,
        prompt: Prompt,
        session: Session | None = None,
        *,
        lookup: bool = True,
        timings: Mapping[str, Timing | None] | None = None,
    ) -> dict[str, Any]:
        """A prompt's JSON: its record, its thread's harness and folder, its effective timing
        (`timings`: read for a page at once; else read here) and when its deadline falls."""
        if session is None and lookup:
            session = await self._session(prompt.thread_id)
        if timings is None:
            timings = await timing_api.read_timings(self.broker, [prompt])
        out = prompt.model_dump(exclude={"questions"})
        out["questions"] = [q.wire() for q in prompt.questions]
        out["harness"] = session.harness if session else None
        out["work_folder"] = session.work_folder if session else None
        out.update(timing_api.timing_json(timings.get(prompt.prompt_id), prompt))
        if prompt.state == "answered" and prompt.answered_by is None:
            out["answered_by"] = await self._answered_by(prompt)  # a record from before it kept one
        return out

    async def _check_thread(self, thread_id: str) -> None:
        if not await self.broker.thread_exists(thread_id):
            raise from_broker(ThreadNotFound(thread_id))

    # -- reading -------------------------------------------------------------------------------

    async def list_prompts(self, request: Request) -> Response:
        caller = self.gate.require(request, "read")
        state = request.query_params.get("state", "open")
        if state != "open":
            raise bad("state", "only `open` is listed (what waits on a person)")
        page = inputs.limit(request)
        after = inputs.decode_cursor(request)
        if after is not None and not (
            isinstance(after, list)
            and len(after) == 2
            and isinstance(after[0], int)
            and isinstance(after[1], str)
        ):
            raise bad("cursor", "not a cursor this server gave out")
        prompts, next_cursor = await self._open_page(caller, page, after)
        threads = sorted({p.thread_id for p in prompts})
        got, timings = await asyncio.gather(
            asyncio.gather(*(self._session(t) for t in threads)),
            timing_api.read_timings(self.broker, prompts),
        )
        sessions = dict(zip(threads, got, strict=True))
        out = [
            await self.prompt_json(p, sessions[p.thread_id], lookup=False, timings=timings)
            for p in prompts
        ]
        return json_response({"prompts": out, "next_cursor": next_cursor})

    async def _open_page(
        self, caller: Caller, limit: int, after: list[Any] | None
    ) -> tuple[list[Prompt], str | None]:
        """One page of the open index, oldest first, from just after `after` ([ms, member]).

        The index is read directly (a read: only the Broker writes it), its buckets merged in
        score order (broker/indexes.py); each record decides. A page looks at no more than
        `_SCAN_BUDGET` entries, so a token that sees few threads gets short pages with a cursor
        rather than one slow answer.
        """
        start = after[0] if after else "-inf"
        found: list[Prompt] = []
        offset = 0
        size = limit + 1  # most entries are pending: read about one page, then more in bulk
        index = self.broker.indexes.open
        async with contextlib.aclosing(index.walk(self.broker.redis, start, batch=size)) as walk:
            while True:
                batch = await _take(walk, size)
                offset += len(batch)
                for member, score, prompt in await self._pending(caller, batch, after):
                    found.append(prompt)
                    if len(found) == limit:
                        return found, inputs.encode_cursor([score, member])
                if len(batch) < size:
                    return found, None
                if offset >= _SCAN_BUDGET:
                    last, at = batch[-1]
                    return found, inputs.encode_cursor([int(at), last])
                size = 200

    async def _pending(
        self, caller: Caller, batch: list[tuple[str, float]], after: list[Any] | None
    ) -> list[tuple[str, int, Prompt]]:
        """The pending prompts of a batch of index entries past `after` the caller may see: in
        its glob, or (a caller with groups) escalated to one of its groups."""
        wanted = []
        for member, score in batch:
            if after is not None and (int(score), member) <= (after[0], after[1]):
                continue
            thread, prompt_id = self.broker.keys.split_member(member)
            if caller.identity.groups or caller.sees(thread):
                wanted.append((member, int(score), thread, prompt_id))
        got = await asyncio.gather(
            *(self.broker.get_prompt(t, p) for _, _, t, p in wanted), return_exceptions=True
        )
        out = []
        for (member, score, _, _), prompt in zip(wanted, got, strict=True):
            if isinstance(prompt, PromptNotFound):
                continue  # an index entry whose record is gone: the sweep drops it
            if isinstance(prompt, BaseException):
                raise prompt
            if prompt.state != "pending":
                continue
            if caller.sees(prompt.thread_id) or access.escalated_to_caller(caller, prompt):
                out.append((member, score, prompt))
        return out

    async def list_threads(self, request: Request) -> Response:
        caller = self.gate.require(request, "read")
        page = inputs.limit(request)
        cursor = inputs.decode_cursor(request)
        prefix = self.broker.keys.prefix
        match = f"{prefix}:{{*}}:items"
        keys, next_page = await scan_page(self.broker.redis, cursor, match, page * 4)
        threads = []
        for key in keys:
            thread_id = key[len(prefix) + 2 : -len("}:items")]
            if not caller.sees(thread_id):
                continue
            session = await self._session(thread_id)
            active = await self.broker.active_prompt(thread_id)
            threads.append(
                {
                    "thread_id": thread_id,
                    "active_prompt_id": active.prompt_id if active else None,
                    "harness": session.harness if session else None,
                    "status": session.status if session else None,
                }
            )
        next_cursor = inputs.encode_cursor(next_page) if next_page is not None else None
        return json_response({"threads": threads, "next_cursor": next_cursor})

    async def get_thread(self, request: Request) -> Response:
        thread_id = inputs.thread_id(request)
        caller = self.gate.require(request, "read")
        await access.viewable_thread(self.broker, caller, thread_id)
        await self._check_thread(thread_id)
        items = await self.broker.items(thread_id)
        session = await self._session(thread_id)
        active = await self.broker.active_prompt(thread_id)
        return json_response(
            {
                "thread_id": thread_id,
                "items": [item_json(i) for i in items[-_ITEMS_SHOWN:]],
                "truncated": len(items) > _ITEMS_SHOWN,
                "active_prompt": await self.prompt_json(active, session) if active else None,
                "session": session_json(session),
            }
        )

    async def get_prompt(self, request: Request) -> Response:
        thread_id = inputs.thread_id(request)
        caller = self.gate.require(request, "read")
        prompt_id = check_prompt_id(request.path_params["prompt_id"])
        prompt = await access.readable_prompt(self.broker, caller, thread_id, prompt_id)
        out = await self.prompt_json(prompt)
        out["item"] = None
        for item in await self.broker.items(thread_id):
            if item.id == prompt.item_id:
                out["item"] = item_json(item)
                break
        return json_response(out)

    # -- writing -------------------------------------------------------------------------------

    async def post_item(self, request: Request) -> Response:
        thread_id = inputs.thread_id(request)
        caller = self.gate.require(request, "answer")
        if not caller.sees(thread_id) and not caller.identity.groups:
            raise access.forbidden()  # before the body is read, as ever
        body, raw = await inputs.json_body(request)
        await access.answerable_prompt(self.broker, caller, thread_id, body)
        key = request.headers.get("idempotency-key")
        if key is None:
            status, out = await self._post(thread_id, caller, body)
            return json_response(out, status)
        tk = self.broker.thread(thread_id)
        claimed = await idempotency.claim(self.broker.redis, tk, caller.name, key, raw)
        if not isinstance(claimed, idempotency.Claim):
            first_status, first = claimed
            return json_response(first, first_status, {"Idempotent-Replayed": "true"})
        try:
            status, out = await self._post(thread_id, caller, body, key)
        except BrokerError as e:
            error = from_broker(e)
            await idempotency.finish(self.broker.redis, claimed, error.status, error.body())
            raise error from None
        except ApiError as e:
            await idempotency.finish(self.broker.redis, claimed, e.status, e.body())
            raise
        except BaseException:
            await idempotency.release(self.broker.redis, claimed)
            raise
        await idempotency.finish(self.broker.redis, claimed, status, out)
        return json_response(out, status)

    async def _post(
        self, thread_id: str, caller: Caller, body: Mapping[str, Any], key: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Post as the caller: the author is the token's name whatever the body says, the
        surface `http` (both recorded on the prompt it answers and its audit item). With an
        Idempotency-Key the library makes the write itself at most once, even when Redis went
        away before our own record of the answer could be kept."""
        item = {k: v for k, v in body.items() if k != "author"}
        item["author"] = caller.name
        try:
            routed = await self.broker.post_item(
                thread_id,
                item,
                create=False,
                surface="http",
                idempotency_key=None if key is None else f"http\0{caller.name}\0{key}",
            )
        except StaleAnswer as e:
            raise await self._stale(e) from None
        return 200, routed.model_dump()

    async def _stale(self, error: StaleAnswer) -> ApiError:
        """409 with the named prompt's real state: answered by whom and when, or why cancelled."""
        api_error = from_broker(error)
        try:
            prompt = await self.broker.get_prompt(error.thread_id, error.prompt_id)
        except PromptNotFound:
            api_error.extra["prompt"] = None
        else:
            api_error.extra["prompt"] = await self.prompt_json(prompt)
        return api_error

    async def cancel(self, request: Request) -> Response:
        thread_id = inputs.thread_id(request)
        caller = self.gate.require(request, "answer", thread_id)
        body, _ = await inputs.json_body(request, optional=True)
        unknown = sorted(set(body) - {"reason", "prompt_id"})
        if unknown:
            raise bad(unknown[0], "unknown field (a cancel takes reason, prompt_id)")
        reason = body.get("reason", f"cancelled by {caller.name}")
        prompt_id = body.get("prompt_id")
        if prompt_id is not None:
            check_prompt_id(prompt_id)
        await self._check_thread(thread_id)
        cancelled = await self.broker.cancel(thread_id, reason, prompt_id=prompt_id)
        return json_response(
            {"cancelled": await self.prompt_json(cancelled) if cancelled else None}
        )

    # -- timing ------------------------------------------------------------------------------

    async def get_timing(self, request: Request) -> Response:
        return await timing_api.get_timing(self.broker, self.gate, request)

    async def put_timing(self, request: Request) -> Response:
        return await timing_api.put_timing(self.broker, self.gate, request)

    # -- sign-in -------------------------------------------------------------------------------

    def _session_body(self, caller: Caller) -> dict[str, Any]:
        expires = Gate.expiry(caller.cookie) if caller.cookie else None
        return {
            "name": caller.name,
            "scopes": list(caller.identity.scopes),
            "threads": caller.identity.threads,
            "groups": list(caller.identity.groups),
            "csrf_token": self.gate.csrf_token(caller),
            "expires_at": expires,
        }

    async def sign_in(self, request: Request) -> Response:
        self.gate.check_origin(request)  # no signing a visitor in from another site
        body, _ = await inputs.json_body(request)
        token = body.get("token")
        if not isinstance(token, str) or not token:
            raise bad("token", "expected the token, a string")
        identity = self.gate.identify(token)
        if identity is None:
            raise ApiError(
                401, "unauthenticated", "unknown token", headers={"WWW-Authenticate": "Bearer"}
            )
        cookie, _expires = self.gate.new_cookie(identity)
        out = self._session_body(Caller(identity, cookie))
        response = json_response(out)
        response.set_cookie(
            COOKIE,
            cookie,
            max_age=self.settings.session_ttl,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def whoami(self, request: Request) -> Response:
        return json_response(self._session_body(self.gate.caller(request)))

    async def sign_out(self, request: Request) -> Response:
        self.gate.caller(request)  # a cookie write: the CSRF token is checked
        response = Response(status_code=204)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return response

    # -- webhooks ------------------------------------------------------------------------------

    async def webhooks(self, request: Request) -> Response:
        self.gate.require(request, "admin")
        subscribed = [
            {"id": h.id, "url": h.url, "events": list(h.events)} for h in self.settings.webhooks
        ]
        failed = await self.hooks.failures() if self.hooks else []
        return json_response({"webhooks": subscribed, "failed": failed})

    async def replay_webhook(self, request: Request) -> Response:
        self.gate.require(request, "admin")
        delivery = request.path_params["delivery"]
        if self.hooks is None or not await self.hooks.replay(delivery):
            raise ApiError(404, "not_found", f"no failed delivery {delivery!r}")
        return json_response({"replayed": delivery})

    # -- events --------------------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        thread_id = request.path_params.get("thread_id")
        if thread_id is not None:
            check_thread_id(thread_id)
        caller = self.gate.require(request, "read", thread_id)
        visible = access.Visibility(self.broker, caller, thread_id)
        body = sse.stream(
            self.hub, request.headers.get("last-event-id"), visible, self.settings.heartbeat
        )
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


async def _take(entries: AsyncIterator[tuple[str, float]], n: int) -> list[tuple[str, float]]:
    """The next `n` entries of a walk (fewer at its end)."""
    out: list[tuple[str, float]] = []
    while len(out) < n:
        try:
            out.append(await anext(entries))
        except StopAsyncIteration:
            break
    return out
