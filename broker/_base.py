"""The ground the `Broker`'s parts stand on: `BrokerBase` (the state they share), `_reaching`
(redis-py's outage errors as `BrokerUnavailable`, so a public method raises only our own
errors) and new ids.

The `Broker` (broker/client.py) is one class made of parts, each a module of its own: the
reads (broker/reads.py), waiting and delivery (broker/delivery.py), routing what people post
(broker/routing.py); asking, cancelling and the lifecycle stay in the client.
"""

from __future__ import annotations

import asyncio
import base64
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


#: RFC 4648 base32 to Crockford's, the alphabet of a ULID.
_CROCKFORD = bytes.maketrans(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", b"0123456789ABCDEFGHJKMNPQRSTVWXYZ"
)


class _Ulids:
    """New ULIDs (48 bits of ms time, 80 random), strictly increasing within the process, as
    python-ulid makes them (`ULID()`), in a few C calls instead of its objects: an id is
    minted on every ask and post, where each microsecond is the person's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms = self._random = 0

    def __call__(self) -> str:
        ms = time.time_ns() // 1_000_000
        with self._lock:
            if ms > self._ms:
                self._ms, self._random = ms, int.from_bytes(os.urandom(10), "big")
            else:  # the same millisecond, or the clock stepped back: the next one up
                self._random += 1
                if self._random >> 80:
                    self._ms, self._random = self._ms + 1, 0
            value = self._ms << 80 | self._random
        # 26 characters of 5 bits, the first two bits zero: base32 of the 130 bits, shifted
        # to the top of 17 bytes.
        encoded = base64.b32encode((value << 6).to_bytes(17, "big"))
        return encoded[:26].translate(_CROCKFORD).decode()


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
    keys: Keys
    identity: str
    _scripts: Scripts
    _batch: Coalescer  # the hot path's commands, one pipeline per turn of the loop
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
