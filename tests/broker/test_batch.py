"""The hot path's ids (broker/_base.py) and its pool check (broker/client.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis
from ulid import ULID

from broker import Broker, Settings, _base

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}


# -- ids -----------------------------------------------------------------------------------------


def test_new_ids_are_ulids_of_now() -> None:
    """An id is `prefix_` and a ULID (python-ulid reads it back) of this millisecond."""
    before = time.time_ns() // 1_000_000
    minted = _base._new_id("prm")
    after = time.time_ns() // 1_000_000
    prefix, _, value = minted.partition("_")
    assert prefix == "prm" and len(value) == 26
    parsed = ULID.from_str(value)
    assert str(parsed) == value
    assert before <= parsed.milliseconds <= after


def test_new_ids_strictly_increase_within_a_millisecond_and_when_the_clock_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ids minted in one millisecond, or after the clock stepped back, still sort in the order
    they were made (as python-ulid's `ULID()` does)."""
    ulids = _base._Ulids()
    now = [1_700_000_000_000 * 1_000_000]
    monkeypatch.setattr(_base.time, "time_ns", lambda: now[0])
    ids = [ulids() for _ in range(1000)]
    now[0] -= 5_000 * 1_000_000  # five seconds back
    ids += [ulids() for _ in range(10)]
    now[0] += 10_000 * 1_000_000
    ids.append(ulids())
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert ULID.from_str(ids[-1]).milliseconds == now[0] // 1_000_000


# -- the pool's check ----------------------------------------------------------------------------


async def test_a_connection_holding_an_unread_reply_is_not_reused_as_is(
    real_redis_url: str, prefix: str
) -> None:
    """A pooled connection with a reply nobody read (a caller gone mid-command) is made again
    before its next command, which gets its own reply, not the stale one."""
    async with Broker.from_url(real_redis_url, Settings(key_prefix=prefix)) as b:
        key = f"{prefix}:stale"
        await b.redis.set(key, "fresh")
        pool = b.redis.connection_pool
        conn = await pool.get_connection()
        await conn.send_command("PING")
        await asyncio.sleep(0.05)  # the PONG has arrived and sits unread
        await pool.release(conn)
        assert await b.redis.get(key) == "fresh"
        await b.redis.delete(key)


async def test_a_connection_the_server_closed_is_made_again(
    real_redis_url: str, prefix: str
) -> None:
    """A pooled connection the server has closed (CLIENT KILL) is made again at checkout: the
    next command just works."""
    async with Broker.from_url(real_redis_url, Settings(key_prefix=prefix)) as b:
        victim = await b.redis.client_id()  # the pool's one connection, used again next
        async with Redis.from_url(real_redis_url) as killer:
            assert await killer.client_kill_filter(_id=victim) == 1
        await asyncio.sleep(0.05)  # its end of stream has arrived
        assert await b.redis.ping() is True
        assert await b.redis.client_id() != victim
