"""Routing what people post (`Routing`, which `Broker` inherits): `post_item` adds an item to
the thread and, in the same atomic step (route.lua), answers the active prompt with it or
queues it for the next turn; and finds out what happened when the call was cut off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import BaseModel
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import events
from broker._base import BrokerBase, _new_id, _reaching
from broker._scripts import slot_node
from broker._waiter import hand_over
from broker.checks import _check_item, _check_surface, _CheckedItem, _epoch, _idempotency
from broker.errors import (
    BadItem,
    BrokerUnavailable,
    Fenced,
    StaleAnswer,
    ThreadClosed,
    ThreadNotFound,
)
from broker.keys import ThreadKeys
from broker.models import Routed

__all__ = ["Routing"]

logger = logging.getLogger("broker")


class Routing(BrokerBase):
    """Routing what people post: an item answers the active prompt, or is queued for the
    next turn, or is refused."""

    @_reaching("posting the item", False)
    async def post_item(
        self,
        thread_id: str,
        item: Mapping[str, Any] | BaseModel,
        *,
        epoch: int | None = None,
        create: bool = True,
        surface: str | None = None,
        idempotency_key: str | None = None,
    ) -> Routed:
        """Add an item to the thread and route it, atomically: it answers the active prompt, or
        is queued for the next turn, or (naming a prompt that is not active) raises
        `StaleAnswer` with that prompt's real state and writes nothing.

        Items whose author is the broker's identity are only added (`outcome="posted"`). With
        `epoch`, the post is fenced to that lease: a replica that lost the thread posts nothing.
        With `create=False`, a thread that does not exist yet (no items, no session) raises
        `ThreadNotFound` instead of being started. A closed thread raises `ThreadClosed`.
        Neither writes anything; both are decided in the same atomic step as the post.
        `surface` names what the item came through (`"http"`, `"cli"`, ...): an answer records
        it, with the item's author, on the prompt (`answered_via`, `answered_by`) and the audit
        item (`metadata.surface`, `metadata.answered_by`). With `idempotency_key`, a post that
        took effect under that key on this thread (within a day) is not made again: the first
        outcome is returned, with the first item's id, whatever the item says this time.
        """
        self._check_open()
        tk = self.thread(thread_id)
        p = _check_item(item, self.identity)
        _check_surface(surface)
        idem = _idempotency(idempotency_key)
        item_id = _new_id("itm")
        # On one server route.lua writes an answer's event in its own step (one round trip, not
        # two); on a cluster the event stream lives in another slot: `_answered_event` writes it.
        events_key = [] if self.keys.cluster else [events.event_key(self.keys)]
        keys = [tk.items, tk.active, tk.inbox, tk.session, *events_key]
        args = [
            item_id,
            p.author,
            p.type,
            p.body,
            "self" if p.is_self else "user",
            p.named,
            p.structured,
            p.refusal,
            p.prepared,
            tk.base,
            tk.wake,
            _epoch(epoch),
            "1" if create else "0",
            "1" if p.malformed else "0",
            surface or "",
            idem,
            *self._retention,
            *([thread_id, events.EVENTS_MAXLEN] if events_key else []),
        ]
        replicas: int | None = None  # how many replicas confirmed it, when WAIT is on
        try:
            if self.settings.wait_replicas and not p.is_self:  # the broker's own: never answers
                reply, replicas = await self._route_and_wait(tk, keys, args)
            else:
                reply = await self._batch.call("route", keys, args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            reply = await self._route_outcome_unknown(tk, item_id, keys, args, e)
        repeated = reply[0] == "repeat"
        if repeated:
            reply = orjson.loads(reply[1])
        status, *rest = reply
        _raise_refused(thread_id, epoch, p, status, rest)
        if status != "answered":
            return Routed(outcome=status, item_id=rest[0])
        item_id, prompt_id, answers, source, refusal = rest
        if not repeated and hand_over(prompt_id, answers):
            # A wait on this loop had its answer from the reply (the bell comes after it): one
            # turn of the loop lets the woken agent run before this caller's own bookkeeping.
            await asyncio.sleep(0)
        if repeated:
            return _answered(item_id, prompt_id, answers, source, refusal)
        if not events_key:
            await self._answered_event(thread_id, prompt_id, source, p.author)
        logger.info(
            "prompt.answered",
            extra={"thread_id": thread_id, "prompt_id": prompt_id, "source": source},
        )
        wanted = self.settings.wait_replicas
        if wanted and (replicas or 0) < wanted:
            raise self._unconfirmed(thread_id, prompt_id, replicas)
        return _answered(item_id, prompt_id, answers, source, refusal)

    async def _answered_event(
        self, thread_id: str, prompt_id: str, source: str, answered_by: str
    ) -> None:
        """On a cluster: the answer's `prompt.answered` event, after route.lua committed it."""
        pipe = self.redis.pipeline(transaction=False)
        events.queue_event(
            pipe,
            self.keys,
            events.ANSWERED,
            thread_id,
            prompt_id,
            source=source,
            answered_by=answered_by,
        )
        try:
            # Coalesced: the answers of one turn share the round trip to the stream's node.
            await self._batch.run(pipe)
        except (RedisError, OSError) as e:
            # Only a notice (route.lua cannot write it: another slot); pages also poll, and
            # the answer itself is committed and its bell rung.
            logger.warning(
                "prompt.event_lost",
                extra={"thread_id": thread_id, "prompt_id": prompt_id, "error": repr(e)},
            )

    async def _route_and_wait(
        self, tk: ThreadKeys, keys: list[str], args: list[Any]
    ) -> tuple[list[Any], int | None]:
        """route.lua, then `WAIT wait_replicas timeout` on the same connection (WAIT counts the
        replicas that have that connection's writes): the reply and how many confirmed it, or
        None when that is not known (the slot moved: the script ran on another connection)."""
        n, ms = self.settings.wait_replicas, max(1, round(self.settings.wait_timeout * 1000))
        target: dict[str, Any] = {}
        if isinstance(self.redis, RedisCluster):
            target["target_nodes"] = await slot_node(self.redis, tk.items)
        script = self._scripts.by_name["route"]
        while True:
            pipe = self.redis.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", n, ms, **target)
            routed, confirmed = await pipe.execute(raise_on_error=False)
            if not isinstance(routed, NoScriptError):
                break
            await self.redis.script_load(script.source)  # then both again: it did not run
        if isinstance(routed, BaseException):
            raise routed
        if isinstance(confirmed, BaseException) or (
            target and self.redis.get_node_from_key(tk.items).name != target["target_nodes"].name  # type: ignore[attr-defined]
        ):
            return list(routed), None
        return list(routed), int(confirmed)

    def _unconfirmed(self, thread_id: str, prompt_id: str, replicas: int | None) -> Exception:
        """The answer is committed on the primary (and its bell rung: the agent may have it),
        but fewer replicas than `wait_replicas` confirmed it in `wait_timeout`: a failover now
        could lose it. `BrokerUnavailable` with `took_effect=True`: a surface that retries with
        the same idempotency key gets the first outcome, or answers again if it was lost."""
        got = "an unknown number" if replicas is None else str(replicas)
        why = _Unconfirmed(
            f"{got} of the {self.settings.wait_replicas} replicas asked for confirmed the "
            f"answer within {self.settings.wait_timeout:g} s; it is on the primary, and a "
            "failover now could lose it"
        )
        logger.warning(
            "prompt.answer_unconfirmed",
            extra={"thread_id": thread_id, "prompt_id": prompt_id, "replicas": replicas},
        )
        return BrokerUnavailable(f"answering {thread_id}/{prompt_id}", why, True)

    async def _route_outcome_unknown(
        self, tk: ThreadKeys, item_id: str, keys: list[str], args: list[Any], error: Exception
    ) -> list[Any]:
        """The route call failed in flight. Find out whether it happened; if not, try once more.

        The item id was minted here, so the thread stream says whether it was added; if it was,
        the inbox or the answered prompt's record says how it was routed.
        """
        try:
            found = await self._find_routed(tk, item_id)
            if found is not None:
                return found
            return list(await self._scripts.call(self.redis, "route", keys, args))
        except (RedisConnectionError, RedisTimeoutError, OSError) as e2:
            raise BrokerUnavailable("posting the item", e2, None) from error

    async def _find_routed(self, tk: ThreadKeys, item_id: str) -> list[Any] | None:
        entries = await self.redis.xrevrange(tk.items, "+", "-", count=1000)
        ids = [fields.get("id") for _, fields in entries]
        if item_id not in ids:
            return None
        at = ids.index(item_id)
        if entries[at][1].get("author") == self.identity:
            return ["posted", item_id]
        for _, fields in entries[at + 1 :]:
            if fields.get("type") != "pending_prompt":
                continue
            prompt_id = orjson.loads(fields["body"])["metadata"]["prompt"]["prompt_id"]
            h: dict[str, str] = await self.redis.hgetall(tk.prompt(prompt_id))  # type: ignore[misc]
            if h.get("answer_item") == item_id:
                return ["answered", item_id, prompt_id, h["answers"], h["source"], ""]
        return ["queued", item_id]


class _Unconfirmed(RedisError):
    """Fewer replicas than `wait_replicas` confirmed an answer's commit in time."""


def _answered(item_id: str, prompt_id: str, answers: str, source: str, refusal: str) -> Routed:
    # One validation of the whole reply (pydantic's own code: on the wake's path, cheaper than
    # building its parts one by one).
    return Routed.model_validate(
        {
            "outcome": "answered",
            "item_id": item_id,
            "prompt_id": prompt_id,
            "answers": orjson.loads(answers),
            "source": source,
            "refused_answers": refusal or None,
        }
    )


def _raise_refused(
    thread_id: str, epoch: int | None, p: _CheckedItem, status: str, rest: list[Any]
) -> None:
    """Raise the error for a route reply that wrote nothing; return for one that did."""
    if status == "fenced":
        raise Fenced(thread_id, epoch or 0, int(rest[0]) if rest[0] else None)
    if status == "closed":
        raise ThreadClosed(thread_id)
    if status == "notfound":
        raise ThreadNotFound(thread_id)
    if status == "stale":
        state, active = rest
        raise StaleAnswer(thread_id, p.named, state, active or None)
    if status == "bad":
        why = str(rest[0])
        where, sep, problem = why.partition(": ")
        if sep and where.startswith("metadata.answers"):
            raise BadItem(where, problem)
        raise BadItem("metadata.answers" if p.structured or p.refusal else "content", why)
