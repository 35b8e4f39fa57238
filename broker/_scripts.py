"""The Lua scripts: loaded once per server, called by SHA, reloaded when the server forgot them.

Each script lives in `broker/lua/<name>.lua` with its KEYS, ARGV and replies documented at the
top; `_lib.lua` and `_retain.lua` (retention: stream trimming, retiring a closed thread) are
prepended to each (Redis has no `require`). We call EVALSHA ourselves rather
than through redis-py's `Script`, because a pipeline holding a `Script` first asks SCRIPT EXISTS:
one more round trip on every call of the hot path.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ClusterDownError, NoScriptError, RedisClusterException, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = [
    "NAMES",
    "Command",
    "Script",
    "Scripts",
    "raise_first",
    "slot_map_error",
    "slot_node",
    "stack_of",
]

#: One command as a pipeline holds it: its arguments, and the options redis-py routes it by.
Command = tuple[tuple[Any, ...], dict[str, Any]]

NAMES = (
    "ask",
    "route",
    "cancel",
    "deliver",
    "audit",
    "enqueue",
    "create",
    "claim",
    "release",
    "update",
    "look",
    "resume",
    "grant",
    "beat",
    "prompt",
    "interrupt",
    "close",
    "agent",
    "compact",
    "timing",
    "step",
)


def slot_map_error(e: RedisClusterException) -> RedisConnectionError | ClusterDownError | None:
    """What a RedisClusterException (redis-py's own, not a RedisError) means when the cluster
    client could not (re)build its slot map, so it sent nothing; None for its other ones,
    mistakes in the call (keys of two slots ...), which are not an outage.

    No node it knows answered ("Redis Cluster cannot be connected", raised from the last node's
    error): a connection error. The nodes that answered are no cluster nodes, or leave slots
    uncovered: the cluster is down for us, as CLUSTERDOWN says.
    """
    if e.__cause__ is None and not str(e).startswith("All slots are not covered"):
        return None
    why = f"the cluster's slot map could not be read: {e}"
    if isinstance(e.__cause__, RedisConnectionError | OSError):
        return RedisConnectionError(why)
    return ClusterDownError(why)  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


def _load(name: str, cluster: bool = False) -> Script:
    lua = resources.files("broker") / "lua"
    parts = [(lua / f).read_text() for f in ("_lib.lua", "_retain.lua", f"{name}.lua")]
    source = "\n".join(parts)
    if cluster:
        # On a cluster the bells are sharded: SPUBLISH reaches only the shard owning the
        # channel's slot (the thread's, by its hash tag), where PUBLISH would reach every node.
        source = source.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


class Scripts:
    """Typed access to every script, for one Redis client."""

    def __init__(self, cluster: bool = False) -> None:
        self.by_name = {name: _load(name, cluster) for name in NAMES}

    async def call(self, redis: Redis, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run one script; if the server lost it (restart, SCRIPT FLUSH), load it and run again."""
        return await self.call_command(redis, self.command(name, keys, args))

    async def call_command(self, redis: Redis, command: tuple[Any, ...]) -> Any:
        """`call`, of a command `command` made; raises its reply when that is an error."""
        try:
            reply = await self._execute_one(redis, command, {})
        except RedisClusterException as e:
            raise (slot_map_error(e) or e) from e
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _by_sha(self) -> dict[str, Script]:
        return {s.sha: s for s in self.by_name.values()}

    def command(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        """The EVALSHA of script `name`, as a pipeline's command."""
        script = self.by_name[name]
        return ("EVALSHA", script.sha, len(keys), *keys, *args)

    def queue(self, pipe: Pipeline, name: str, keys: list[str], args: list[Any]) -> None:
        """Add a script call to a pipeline; `run_pipeline` retries it if the server lost it."""
        # redis-py 5.x's cluster pipeline refuses `evalsha()`, not the command itself: it routes
        # EVALSHA by its keys like any other.
        pipe.execute_command(*self.command(name, keys, args))

    async def run_pipeline(self, redis: Redis, pipe: Pipeline) -> list[Any]:
        """Execute a non-transactional pipeline of script calls and plain commands.

        A NOSCRIPT reply means that script did not run at all, so loading it and running that
        call again (in order) is exactly what the pipeline meant. Any other error is raised (a
        cluster client's missing slot map as `slot_map_error` says).
        """
        results = await self.execute(redis, stack_of(pipe), pipe)
        raise_first(results)
        return results

    async def execute(
        self, redis: Redis, stack: list[Command], pipe: Pipeline | None = None
    ) -> list[Any]:
        """Run `stack` as one pipeline (`pipe`, when it already holds it); each command's reply,
        or the error it got in its place. NOSCRIPT is repaired (the lost calls run again)."""
        try:
            return await self._execute(redis, stack, pipe)
        except RedisClusterException as e:
            raise (slot_map_error(e) or e) from e

    async def _execute(
        self, redis: Redis, stack: list[Command], pipe: Pipeline | None
    ) -> list[Any]:
        if pipe is None and len(stack) == 1:  # one command: no pipeline to set up
            return [await self._execute_one(redis, *stack[0])]
        if pipe is None:
            pipe = redis.pipeline(transaction=False)
            for args, options in stack:
                pipe.execute_command(*args, **options)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        lost = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if lost:
            # Load each lost script once, then run every refused call again in one pipeline
            # (in order): a pipeline of 10,000 renewals costs 2 more round trips, not 20,000.
            by_sha = self._by_sha()
            for sha in dict.fromkeys(str(stack[i][0][1]) for i in lost):
                await redis.script_load(by_sha[sha].source)
            again = redis.pipeline(transaction=False)
            for i in lost:
                again.execute_command(*stack[i][0], **stack[i][1])
            for i, result in zip(lost, await again.execute(raise_on_error=False), strict=True):
                results[i] = result
        return results

    async def _execute_one(
        self, redis: Redis, args: tuple[Any, ...], options: dict[str, Any]
    ) -> Any:
        """One command's reply, or the error Redis answered with (NOSCRIPT repaired)."""
        if (
            isinstance(redis, RedisCluster)
            and args[0] == "EVALSHA"
            and "target_nodes" not in options
        ):
            # Sent to the slot's node by name, so redis-py's cluster client does not run it a
            # second time when the reply is lost (it retries a command blindly after a timeout
            # or a dropped connection): a script that ran would run twice, a second prompt or
            # an answer's words queued again. The error comes to the caller instead, who finds
            # out what happened. MOVED and ASK are still followed.
            options = {**options, "target_nodes": await slot_node(redis, args[3])}
        try:
            return await redis.execute_command(*args, **options)  # type: ignore[no-untyped-call]
        except NoScriptError:
            await redis.script_load(self._by_sha()[str(args[1])].source)
        except ResponseError as e:
            return e
        try:
            return await redis.execute_command(*args, **options)  # type: ignore[no-untyped-call]
        except ResponseError as e:
            return e


async def slot_node(redis: RedisCluster, key: str) -> Any:
    """The primary owning `key`'s slot, the slot map read (again) first when redis-py wants it."""
    if redis._initialize:
        await redis.initialize()
    return redis.get_node_from_key(key)


def raise_first(results: list[Any]) -> None:
    """Raise the first error a pipeline's replies hold: a reply error, or the connection's (a
    cluster pipeline gives a node's connection error as its commands' replies)."""
    for result in results:
        if isinstance(result, Exception):
            raise result


def stack_of(pipe: Pipeline) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The pipeline's commands as (args, options): a cluster pipeline keeps them elsewhere. A
    plain pipeline's are already so (redis-py queues `(args tuple, options dict)` and never
    changes them; its reset makes a new list): a shallow copy, not one of every command."""
    if isinstance(pipe, ClusterPipeline):
        return [(tuple(c.args), dict(c.kwargs)) for c in pipe._command_stack]
    return list(cast(list[Command], pipe.command_stack))
