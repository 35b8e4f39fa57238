"""Bounded memory: a closed thread expires whole, streams are trimmed but never past a prompt
that still needs its entry, and agent transcripts are compressed and expire with their thread."""

from __future__ import annotations

import asyncio
import zlib

import orjson
import pytest

from broker import Broker
from tests.conftest import BrokerFactory
from tests.helpers import index_members, text
from workers.runtime.agent_store import AgentStore, decode_element, encode_batch

TEXT = [{"question": "Name?"}]


async def thread_keys(b: Broker, thread_id: str) -> dict[str, int]:
    """Every key of the thread with its TTL in ms (-1: none)."""
    pattern = b.thread(thread_id).base + "*"
    keys = [k async for k in b.redis.scan_iter(match=pattern, count=1000)]
    return {k: await b.redis.pttl(k) for k in keys}


def transcript(n: int) -> list[dict[str, object]]:
    """Entries shaped like a Claude Code transcript's."""
    return [
        {
            "type": "assistant" if i % 2 else "user",
            "uuid": f"0b6c1e9e-5a4f-4c1b-9d1e-{i:012d}",
            "parentUuid": f"0b6c1e9e-5a4f-4c1b-9d1e-{i - 1:012d}",
            "sessionId": "5f0c2c7e-1111-4a4a-8b8b-000000000001",
            "timestamp": f"2026-12-01T11:{i % 60:02d}:00.000Z",
            "message": {
                "role": "assistant" if i % 2 else "user",
                "content": [
                    {"type": "text", "text": f"Step {i}: reading the file and running the tests."}
                ],
            },
        }
        for i in range(n)
    ]


async def closed_thread(b: Broker, thread_id: str) -> None:
    """A thread with everything a session leaves: items, an inbox, an answered and delivered
    and audited prompt, an idempotency record, agent data, then an open prompt it closes on."""
    await b.sessions.create(thread_id, "scripted")
    await b.post_item(thread_id, text("queued for the next turn"))
    p1 = await b.ask(thread_id, "text", TEXT)
    await b.post_item(thread_id, text("Ann"), idempotency_key="k1")
    assert [a.answer for a in await b.wait(thread_id, p1.prompt_id, timeout=5)] == [["Ann"]]
    await b.settle()
    assert await b.post_resolution(thread_id, p1.prompt_id)
    p2 = await b.ask(thread_id, "text", TEXT)
    await AgentStore(b, thread_id).append("claude:s1", transcript(40))
    await AgentStore(b, thread_id).append("codex:calls", [{"id": 1}])
    await b.sessions.close(thread_id)
    # The cancelled prompt's audit item lands after the close: it must not outlive the thread.
    assert await b.post_resolution(thread_id, p2.prompt_id)


async def test_closed_thread_leaves_no_key_behind(make_broker: BrokerFactory) -> None:
    b = await make_broker(closed_ttl=1)
    await closed_thread(b, "t")
    # A turn finishing after the close writes its transcript: it takes the thread's time.
    await AgentStore(b, "t").append("claude:late", transcript(3))
    left = await thread_keys(b, "t")
    expected = {"items", "session", "inbox", "agents", "idems"}
    assert expected <= {k.rsplit(":", 1)[-1] for k in left}
    assert all(0 < ttl <= 1000 for ttl in left.values()), left
    await asyncio.sleep(1.3)
    assert await thread_keys(b, "t") == {}
    # Its index entries went with its prompts: the open and audit indexes name nothing of it.
    assert await index_members(b, "open") == []
    assert await index_members(b, "audit") == []


async def test_closed_ttl_zero_keeps_a_closed_thread(make_broker: BrokerFactory) -> None:
    b = await make_broker(closed_ttl=0)
    await closed_thread(b, "t")
    left = await thread_keys(b, "t")
    kept = {k: ttl for k, ttl in left.items() if ":prompt:" not in k and ":idem:" not in k}
    assert len(kept) >= 6 and all(ttl == -1 for ttl in kept.values()), left


async def test_an_open_thread_never_expires(make_broker: BrokerFactory) -> None:
    """Cancelling on a thread that is not closed retires nothing; an open prompt, a parked
    session and its data keep no TTL."""
    b = await make_broker(closed_ttl=1)
    await b.sessions.create("t", "scripted")
    await b.ask("t", "text", TEXT)
    await b.cancel("t", "test")
    p = await b.ask("t", "text", TEXT)
    await AgentStore(b, "t").append("claude:s1", transcript(5))
    left = await thread_keys(b, "t")
    assert all(ttl == -1 for k, ttl in left.items() if ":prompt:" not in k or p.prompt_id in k)


async def post_self(b: Broker, thread_id: str, n: int) -> None:
    for i in range(n):
        await b.post_item(thread_id, {**text(f"output {i}"), "author": b.identity})


async def test_stream_trimmed_by_count_never_past_an_unaudited_prompt(
    make_broker: BrokerFactory,
) -> None:
    b = await make_broker(stream_max_items=10)
    tk = b.thread("t")
    await post_self(b, "t", 5)
    p = await b.ask("t", "text", TEXT)
    await post_self(b, "t", 300)
    # The five older items went; the open prompt's entry stopped the trim: it and all after it
    # stay, over the limit, while it is open.
    assert await b.redis.xlen(tk.items) == 301
    assert (await b.get_prompt("t", p.prompt_id)).questions[0].question == "Name?"
    await b.post_item("t", text("Ann"))
    # Answered but not yet delivered and audited: its entry is still needed.
    assert await b.redis.xlen(tk.items) == 302
    await b.wait("t", p.prompt_id, timeout=5)
    await b.settle()  # the delivery mark is written in the background
    await b.post_resolution("t", p.prompt_id)  # unpinned, and trimmed in the same step
    await post_self(b, "t", 1)
    # Trimmed to ten by the audit; one post more is within the slack (31 over the limit).
    assert await b.redis.xlen(tk.items) == 11
    texts = [i.text for i in await b.items("t")]
    # The newest ten then: outputs 292 to 299, the answer, its audit item; and the last post.
    assert texts[:9] == [*(f"output {i}" for i in range(292, 300)), "Ann"]
    assert texts[-1] == "output 0"
    await post_self(b, "t", 31)
    assert await b.redis.xlen(tk.items) == 10  # 32 over: back to the limit


async def test_stream_trimmed_by_age_never_past_an_open_prompt(
    make_broker: BrokerFactory,
) -> None:
    b = await make_broker(stream_max_age=1, stream_max_items=0)
    tk = b.thread("t")
    await post_self(b, "t", 150)
    p = await b.ask("t", "text", TEXT)
    await post_self(b, "t", 150)
    await asyncio.sleep(1.1)
    await post_self(b, "t", 1)
    # Everything older than the open prompt went; the prompt's entry and all after it stayed.
    assert await b.redis.xlen(tk.items) == 152
    got = await b.get_prompt("t", p.prompt_id)
    assert got.questions[0].question == "Name?"
    await b.cancel("t", "done")
    await b.post_resolution("t", p.prompt_id)
    await post_self(b, "t", 1)
    # The post after the sleep, the cancel's audit item and the last post: under a second old.
    assert await b.redis.xlen(tk.items) == 3


async def test_transcripts_compressed_and_old_entries_still_read(broker: Broker) -> None:
    tk = broker.thread("t")
    old = transcript(3)
    # Written before compression: one plain JSON element per entry.
    await broker.redis.rpush(tk.agent("claude:s1"), *(orjson.dumps(e) for e in old))
    store = AgentStore(broker, "t")
    new = transcript(60)[3:]
    await store.append("claude:s1", new)
    await store.append("claude:s1", [{"small": 1}])
    assert await store.load("claude:s1") == [*old, *new, {"small": 1}]
    assert await store.load("nothing") is None
    raw = await broker.redis.execute_command(
        "LRANGE", tk.agent("claude:s1"), 3, 3, NEVER_DECODE=True
    )
    plain = len(orjson.dumps(new))
    assert raw[0][:1] == b"\x01"
    assert len(raw[0]) * 3 < plain, (len(raw[0]), plain)


def test_codec_round_trip() -> None:
    entries = transcript(20)
    (element,) = encode_batch(entries)
    assert decode_element(element) == entries
    assert encode_batch([{"a": 1}]) == [b'{"a":1}']  # too small to pay for zlib's overhead
    with pytest.raises(zlib.error):
        decode_element(b"\x01not zlib")


async def test_a_prompt_whose_entry_was_trimmed_still_expires_with_its_thread(
    make_broker: BrokerFactory,
) -> None:
    """An audited prompt's record outlives its trimmed entry (`resolved_ttl`): closing the
    thread still finds it and gives it the thread's expiry."""
    b = await make_broker(stream_max_items=5, closed_ttl=1)
    await b.sessions.create("t", "scripted")
    p = await b.ask("t", "text", TEXT)
    await b.post_item("t", text("Ann"))
    await b.wait("t", p.prompt_id, timeout=5)
    await b.settle()
    await b.post_resolution("t", p.prompt_id)
    await post_self(b, "t", 40)
    assert all(i.type != "pending_prompt" for i in await b.items("t"))  # its entry is gone
    assert await b.redis.ttl(b.thread("t").prompt(p.prompt_id)) > 86400
    await b.sessions.close("t")
    assert 0 < await b.redis.pttl(b.thread("t").prompt(p.prompt_id)) <= 1000
    await asyncio.sleep(1.3)
    assert await thread_keys(b, "t") == {}


async def test_entries_appended_one_at_a_time_are_folded_into_batches(broker: Broker) -> None:
    """Harnesses mirror a transcript an entry at a time: every 16 elements the trailing plain
    ones become one compressed batch; the entries read back the same, in order."""
    store = AgentStore(broker, "t")
    key = broker.thread("t").agent("claude:s1")
    entries = [{"n": i, "text": f"step {i}"} for i in range(40)]  # each too small alone
    plain = sum(len(orjson.dumps(e)) for e in entries)
    for e in entries:
        await store.append("claude:s1", [e])
    assert await store.load("claude:s1") == entries
    # 16 folded into one; at 16 elements again, the 15 plain after it; then 9 plain.
    assert await broker.redis.llen(key) == 1 + 1 + 9
    stored = await broker.redis.execute_command("LRANGE", key, 0, -1, NEVER_DECODE=True)
    assert sum(len(e) for e in stored) * 2 < plain
    # A fold whose read is stale (an append landed since) writes nothing.
    before = await broker.redis.execute_command("LRANGE", key, 0, -1, NEVER_DECODE=True)
    stale = await broker.compact_agent_data(
        "t", "claude:s1", length=9, count=4, batch=b"\x01x", first=before[-4]
    )
    assert stale is False
    assert await broker.redis.execute_command("LRANGE", key, 0, -1, NEVER_DECODE=True) == before
