"""The `Broker`'s read-side queries (`Reads`, which `Broker` inherits): a prompt's record, the
active prompt, the thread's items and new entries, the inbox drained for the next turn, every
open prompt, whether a thread exists, and the waiter's reads of resolved prompts.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import cast

import orjson

from broker import _codec
from broker._base import BrokerBase, _reaching
from broker._waiter import Wake
from broker.checks import _check_count, _check_stream_id
from broker.errors import PromptNotFound
from broker.indexes import Indexes
from broker.keys import check_prompt_id
from broker.models import Item, Prompt

__all__ = ["Reads"]


# take_inbox: the whole list, emptied, in one step.
_TAKE_ALL = "local r = redis.call('LRANGE', KEYS[1], 0, -1); redis.call('DEL', KEYS[1]); return r"


class Reads(BrokerBase):
    """The read side of the `Broker`: prompts, the thread's items, the inbox, the open
    prompts, and the records the waiter reads."""

    indexes: Indexes  # set by `Broker.__init__`: the discovery indexes, by bucket

    @_reaching("reading the prompt", False)
    async def get_prompt(self, thread_id: str, prompt_id: str) -> Prompt:
        """The prompt's record; `PromptNotFound` if there is none."""
        self._check_open()
        tk = self.thread(thread_id)
        keys = [tk.prompt(check_prompt_id(prompt_id)), tk.items]
        flat = await self._scripts.call(self.redis, "prompt", keys, [])
        if not flat:
            raise PromptNotFound(thread_id, prompt_id)
        return _codec.prompt_from_hash(thread_id, prompt_id, _pairs(flat))

    @_reaching("reading the active prompt", False)
    async def active_prompt(self, thread_id: str) -> Prompt | None:
        """The thread's active (pending) prompt, or None."""
        self._check_open()
        prompt_id = await self.redis.get(self.thread(thread_id).active)
        if not prompt_id:
            return None
        try:
            prompt = await self.get_prompt(thread_id, prompt_id)
        except PromptNotFound:
            return None
        return prompt if prompt.state == "pending" else None

    @_reaching("reading the thread", False)
    async def items(
        self, thread_id: str, *, after: str | None = None, count: int | None = None
    ) -> list[Item]:
        """The thread's items in order (after the item whose stream id is `after`, if given)."""
        self._check_open()
        key = self.thread(thread_id).items
        if after is not None:
            _check_stream_id(after, "after")
        count = _check_count(count, "count")
        out: list[Item] = []
        start = f"({after}" if after else "-"
        while count is None or len(out) < count:
            page = 1000 if count is None else min(1000, count - len(out))
            entries = await self.redis.xrange(key, start, "+", count=page)
            out.extend(_codec.item_from_entry(sid, fields) for sid, fields in entries)
            if len(entries) < page:
                break
            start = f"({entries[-1][0]}"
        return out

    @_reaching("reading the thread", False)
    async def entries(
        self, thread_id: str, *, after: str = "$", block_ms: int = 0
    ) -> list[tuple[str, Item]]:
        """Block until new items arrive after stream id `after` ('$': from now). For `tail`."""
        self._check_open()
        key = self.thread(thread_id).items
        if after != "$":
            _check_stream_id(after, "after")
        block_ms = _check_count(block_ms, "block_ms") or 0
        reply = await self.redis.xread({key: after}, block=block_ms, count=1000)
        return [(sid, _codec.item_from_entry(sid, f)) for _, entries in reply for sid, f in entries]

    @_reaching("taking the inbox", None)
    async def take_inbox(self, thread_id: str) -> list[Item]:
        """Drain the thread's inbox atomically, in order: the next turn's input."""
        self._check_open()
        key = self.thread(thread_id).inbox
        # One script, not MULTI/EXEC: redis-py's cluster client has no transactions.
        raw: list[str] = await cast(Awaitable[list[str]], self.redis.eval(_TAKE_ALL, 1, key))
        return [_codec.item_from_inbox(r) for r in raw]

    @_reaching("listing open prompts", False)
    async def open_prompts(self, limit: int | None = None) -> list[Prompt]:
        """Every pending prompt, oldest first: what is waiting on a person."""
        self._check_open()
        limit = _check_count(limit, "limit")
        members = await self.indexes.open.members(self.redis)
        pairs = [self.keys.split_member(m) for m in members]
        out: list[Prompt] = []
        for chunk in range(0, len(pairs), 500):
            part = pairs[chunk : chunk + 500]
            pipe = self.redis.pipeline(transaction=False)
            for thread_id, prompt_id in part:
                tk = self.thread(thread_id)
                self._scripts.queue(pipe, "prompt", [tk.prompt(prompt_id), tk.items], [])
            rows = await self._scripts.run_pipeline(self.redis, pipe)
            gone = []
            for (thread_id, prompt_id), flat in zip(part, rows, strict=True):
                h = _pairs(flat)
                if h.get("state") == "pending":
                    out.append(_codec.prompt_from_hash(thread_id, prompt_id, h))
                elif not h:
                    gone.append(self.keys.member(thread_id, prompt_id))
            if gone:
                # Members with no record at all (a fenced ask's leftover): an index entry nobody
                # else would ever remove. The ask pipeline adds a member only after its record.
                await self.indexes.open.remove(self.redis, gone)
            if limit is not None and len(out) >= limit:
                return out[:limit]
        return out

    @_reaching("checking the thread", False)
    async def thread_exists(self, thread_id: str) -> bool:
        """True once the thread has items or an agent session (a closed thread still exists)."""
        self._check_open()
        tk = self.thread(thread_id)
        return bool(await self.redis.exists(tk.items, tk.session))

    async def _read_wakes(self, pairs: list[tuple[str, str]]) -> dict[str, Wake]:
        """The waiter's reader: the resolved prompts among `pairs`, as wake messages."""
        pipe = self.redis.pipeline(transaction=False)
        for thread_id, prompt_id in pairs:
            pipe.hmget(self.thread(thread_id).prompt(prompt_id), ["state", "answers", "reason"])
        wakes: dict[str, Wake] = {}
        for (_, prompt_id), (state, answers, reason) in zip(
            pairs, await pipe.execute(), strict=True
        ):
            if state == "answered":
                wakes[prompt_id] = {
                    "prompt_id": prompt_id,
                    "state": state,
                    "answers": orjson.loads(answers),
                }
            elif state == "cancelled":
                wakes[prompt_id] = {"prompt_id": prompt_id, "state": state, "reason": reason}
            elif state is None:
                wakes[prompt_id] = {"prompt_id": prompt_id, "state": "missing"}
        return wakes


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))
