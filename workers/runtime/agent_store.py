"""A harness's durable session data (Claude Code transcripts, Codex call records), in Redis.

Each thread's data lives in lists `<prefix>:{T}:agent:<name>` under the thread's hash tag, so
any replica can resume the session. One `append` call is one list element:

- a batch worth compressing (`_MIN_COMPRESS` bytes of JSON or more) is stored as `\\x01` then
  zlib (level 6, with a preset dictionary of the field names transcripts repeat) of a JSON array
  of its entries;
- a smaller one, or data written before compression, is plain JSON of one entry. JSON text never
  starts with `\\x01`, so both read back side by side.

Why zlib: it is in the standard library (no new dependency on every replica), it is fast enough
to be invisible beside a model call (tens of microseconds per entry), and on transcripts it
takes 3 to 5x (bench/bench_broker.py `--memory` prints the figure). zstd would gain perhaps a
fifth more and needs a package; lz4 is faster but compresses JSON less.

The names are registered beside the lists (agent.lua), so closing the thread expires them with
it; a list written after the close takes the closed thread's remaining time.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import orjson
from redis.asyncio import Redis

from broker import Broker

__all__ = ["AgentStore", "decode_element", "encode_batch"]

_COMPRESSED = b"\x01"
_MIN_COMPRESS = 256  # below this zlib's header and checksum outweigh what it saves
_LEVEL = 6
_COMPACT_EVERY = 16  # every this many elements, the trailing plain ones are folded together
_COMPACT_MIN = 4
# Strings Claude Code and Codex transcripts repeat in nearly every entry: a preset dictionary
# lets even a single small entry compress (zlib matches against it from the first byte).
_ZDICT = (
    b'"type":"assistant""type":"user""message":{"role":"assistant","content":[{"type":"text",'
    b'"text":"tool_use","tool_result","tool_use_id":"input":{"command":"id":"toolu_'
    b'"parentUuid":"uuid":"sessionId":"timestamp":"2026-"cwd":"/"isSidechain":false,'
    b'"userType":"external","version":"gitBranch":"requestId":"model":"claude-"usage":'
    b'{"input_tokens":"output_tokens":"cache_read_input_tokens":"stop_reason":"end_turn"'
    b'"call_id":"arguments":"output":"status":"completed","function_call"'
)


def encode_batch(entries: Sequence[Any]) -> list[bytes]:
    """The list elements that store `entries` (one compressed element, or one plain each)."""
    plain = [orjson.dumps(e) for e in entries]
    if sum(len(p) for p in plain) < _MIN_COMPRESS:
        return plain
    packed = b"[" + b",".join(plain) + b"]"
    c = zlib.compressobj(_LEVEL, zdict=_ZDICT)
    return [_COMPRESSED + c.compress(packed) + c.flush()]


def decode_element(raw: bytes) -> list[Any]:
    """The entries one list element holds (a compressed batch, or one plain JSON entry)."""
    if raw[:1] == _COMPRESSED:
        d = zlib.decompressobj(zdict=_ZDICT)
        data = d.decompress(raw[1:]) + d.flush()
        batch: list[Any] = orjson.loads(data)
        return batch
    return [orjson.loads(raw)]


class AgentStore:
    """A harness's durable session data for one thread (see the module docstring)."""

    def __init__(self, broker: Broker, thread_id: str) -> None:
        self._broker = broker
        self._redis: Redis = broker.redis
        self._thread_id = thread_id
        self._keys = broker.thread(thread_id)

    async def append(self, key: str, entries: Sequence[Any]) -> None:
        if not entries:
            return
        length = await self._broker.append_agent_data(self._thread_id, key, encode_batch(entries))
        if length % _COMPACT_EVERY == 0:
            await self._compact(key, length)

    async def _compact(self, key: str, length: int) -> None:
        """Fold the trailing run of plain elements into one compressed batch.

        Harnesses mirror their transcripts an entry at a time, and one entry alone compresses
        poorly; sixteen together take zlib's window. Only plain elements are folded, so each
        entry is compressed once, and a batch is never re-read to grow it.
        """
        tail: list[bytes] = await self._redis.execute_command(  # type: ignore[no-untyped-call]
            "LRANGE", self._keys.agent(key), -_COMPACT_EVERY, -1, NEVER_DECODE=True
        )
        run = 0
        for element in reversed(tail):
            if element[:1] == _COMPRESSED:
                break
            run += 1
        if run < _COMPACT_MIN:
            return
        plain = tail[len(tail) - run :]
        batch = encode_batch([e for element in plain for e in decode_element(element)])
        if len(batch) == 1 and batch[0][:1] == _COMPRESSED:
            await self._broker.compact_agent_data(
                self._thread_id, key, length=length, count=run, batch=batch[0], first=plain[0]
            )

    async def load(self, key: str) -> list[Any] | None:
        # Compressed elements are bytes: read without the client's decoding.
        raw: list[bytes] = await self._redis.execute_command(  # type: ignore[no-untyped-call]
            "LRANGE", self._keys.agent(key), 0, -1, NEVER_DECODE=True
        )
        if not raw:
            return None
        return [entry for element in raw for entry in decode_element(element)]
