"""The ground the `Broker`'s parts stand on: `BrokerBase` (the state they share), `_reaching`
(redis-py's outage errors as `BrokerUnavailable`, so a public method raises only our own
errors) and new ids.

The `Broker` (broker/client.py) is one class made of parts, each a module of its own: the
reads (broker/reads.py), waiting and delivery (broker/delivery.py), routing what people post
(broker/routing.py); asking, cancelling and the lifecycle stay in the client.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from redis.asyncio import Redis
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker._batch import Coalescer
from broker._scripts import Scripts, slot_map_error
from broker._waiter import Waiter
from broker.errors import BrokerClosed, BrokerError, BrokerUnavailable
from broker.keys import Keys, ThreadKeys
from broker.settings import Settings

__all__ = ["BrokerBase"]

#: What "Redis could not be reached" looks like from redis-py (and the OS under it).
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
#: Redis answered, but will not write: over `maxmemory`, or a replica that became read-only; or
#: a Redis Cluster that would not run it anywhere (a slot moving or uncovered: redis-py followed
#: MOVED/ASK/TRYAGAIN or CLUSTERDOWN until it gave up).
_REFUSING = (OutOfMemoryError, ReadOnlyError, ClusterError, ClusterDownError, SlotNotCoveredError)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _reaching(
    what: str, took_effect: bool | None
) -> Callable[[Callable[_P, Awaitable[_R]]], Callable[_P, Coroutine[Any, Any, _R]]]:
    """Turn redis-py's "cannot reach Redis" and "Redis will not write" into `BrokerUnavailable`,
    so a public method raises only our own errors. `took_effect` is what is known of the call
    when that happens (False: nothing was written; None: unknown)."""

    def decorate(fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, Coroutine[Any, Any, _R]]:
        @functools.wraps(fn)
        async def reaching(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return await fn(*args, **kwargs)
            except BrokerError:
                raise  # BrokerUnavailable is an OSError too: ours already
            except TimeoutError:
                raise  # the builtin one is an OSError: a caller's timeout, not an outage
            except _REFUSING as e:
                # Redis refuses a write before making it, and each of our steps that can be
                # refused is one script or one MULTI: refused, it did nothing.
                raise BrokerUnavailable(what, e, False, refused=True) from e
            except _UNREACHABLE as e:
                raise BrokerUnavailable(what, e, took_effect) from e
            except RedisClusterException as e:  # not a RedisError: redis-py's cluster client
                known = slot_map_error(e)  # no slot map (no node answered ...), or a mistake
                if known is None:
                    raise
                refused = not isinstance(known, RedisConnectionError)
                raise BrokerUnavailable(what, known, took_effect, refused=refused) from e

        return reaching

    return decorate


#: Every pair of Crockford base32 digits (the alphabet of a ULID), by the 10 bits it encodes.
_PAIRS = [
    a + b for a in "0123456789ABCDEFGHJKMNPQRSTVWXYZ" for b in "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
]


class _Ulids:
    """New ULIDs (48 bits of ms time, 80 random), strictly increasing within the process, as
    python-ulid makes them (`ULID()`), in a handful of lookups instead of its objects: an id is
    minted on every ask and post, on the person's path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms = self._random = 0
        self._encoded_ms, self._time = 0, _PAIRS[0] * 5  # `_time` encodes `_encoded_ms`

    def __call__(self) -> str:
        ms = time.time_ns() // 1_000_000
        with self._lock:
            if ms > self._ms:
                self._ms, self._random = ms, int.from_bytes(os.urandom(10), "big")
            else:  # the same millisecond, or the clock stepped back: the next one up
                self._random += 1
                if self._random >> 80:  # all 80 bits used up in one ms: borrow the next ms
                    self._ms, self._random = self._ms + 1, 0
            if self._ms != self._encoded_ms:  # once per ms
                t = self._encoded_ms = self._ms
                self._time = "".join(_PAIRS[(t >> s) & 1023] for s in (40, 30, 20, 10, 0))
            r, encoded = self._random, self._time
        return (
            encoded
            + _PAIRS[r >> 70]
            + _PAIRS[(r >> 60) & 1023]
            + _PAIRS[(r >> 50) & 1023]
            + _PAIRS[(r >> 40) & 1023]
            + _PAIRS[(r >> 30) & 1023]
            + _PAIRS[(r >> 20) & 1023]
            + _PAIRS[(r >> 10) & 1023]
            + _PAIRS[r & 1023]
        )


new_ulid = _Ulids()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{new_ulid()}"


def now_ms() -> int:
    """This machine's clock in ms (index scores; Redis's own clock is the scripts')."""
    return time.time_ns() // 1_000_000


class BrokerBase:
    """What every part of the `Broker` shares: the state `Broker.__init__` sets (declared here, so
    each part type-checks on its own) and the two steps a call begins with."""

    settings: Settings
    redis: Redis
    queue_redis: Redis | None  # arq's queues, when on a Redis of their own (queue_url)
    keys: Keys
    identity: str
    _scripts: Scripts
    _batch: Coalescer  # the hot path's commands, one pipeline per turn of the loop
    _queue_batch: Coalescer | None  # the audit jobs on queue_redis, coalesced the same way
    _waiter: Waiter
    _closed: bool
    _deliveries: set[asyncio.Task[None]]
    # The stream trimming policy every script that adds an item applies (_retain.lua).
    _retention: tuple[int, int]

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosed

    def thread(self, thread_id: str) -> ThreadKeys:
        return self.keys.thread(thread_id)
