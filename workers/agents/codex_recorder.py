"""What a Codex turn keeps in the agent store as it goes (`Turn.store`): the call ledger's
entries (`workers.agents.codex_transcript` says what they mean) and Codex's rollout, its own
JSONL transcript, mirrored line by line in our words where we stopped a call. `Recorder` writes
both through one queue, in order, and writes a stored rollout back into the next turn's
`CODEX_HOME` (`restore`), so any replica can resume the Codex thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.agents.codex_prompts import item_kind, item_what
from workers.agents.codex_transcript import (
    CALLS_KEY,
    Call,
    calls_of,
    dangling_calls,
    describe,
    interrupted_writer,
    output_line,
    rewrite_line,
)
from workers.agents.harness import Turn

__all__ = ["ROLLOUT", "Recorder", "Rollout", "holds", "output_of", "relative", "store_key"]

logger = logging.getLogger("workers.agents.codex")  # one logger for all the harness's modules

ROLLOUT = re.compile(r"sessions/[A-Za-z0-9_./-]+\.jsonl")

#: A write for the ledger's queue, and the future told whether it was stored (or None).
_Job = tuple[Callable[[], Awaitable[None]], "asyncio.Future[bool] | None"]


def store_key(codex_thread: str) -> str:
    return f"codex:{codex_thread}"


@dataclass
class Rollout:
    """Codex's rollout file for one thread, mirrored into the agent store.

    Store entries are `{"w": writer, "l": line}`; `segments` (kept in the harness state, which
    the replica commits under its lease) lists `[writer, lines]` in order, so lines written by a
    turn whose state never committed (a replica that lost its lease) are ignored.
    """

    codex_thread: str
    rel: str  # the file's path under CODEX_HOME
    segments: list[list[Any]] = field(default_factory=list)
    base: int = 0  # lines restored into the file at turn start
    writer: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    synced: int = 0  # lines this turn added to the store

    def state_segments(self) -> list[list[Any]]:
        return [*self.segments, [self.writer, self.synced]] if self.synced else list(self.segments)


def _restore_lines(entries: Sequence[Any], segments: Sequence[Any]) -> list[str] | None:
    by_writer: dict[str, list[str]] = {}
    for e in entries:
        if isinstance(e, dict) and isinstance(e.get("w"), str) and isinstance(e.get("l"), str):
            by_writer.setdefault(e["w"], []).append(e["l"])
    lines: list[str] = []
    for seg in segments:
        if not (isinstance(seg, list) and len(seg) == 2 and isinstance(seg[1], int)):
            return None
        got = by_writer.get(str(seg[0]), [])[: seg[1]]
        if len(got) < seg[1]:
            return None
        lines += got
    return lines


class Recorder:
    """One turn's writes to the agent store: ledger entries and rollout copies, one at a time
    and in order (`start` runs the queue, `drain` lets it finish)."""

    def __init__(self, turn: Turn, home: Path) -> None:
        self.turn = turn
        self.home = home
        self.rollout: Rollout | None = None
        # Calls this harness stopped with `cancel` (or by interrupting), by call id: the output
        # the model reads for each instead of Codex's "aborted by user" (see `sync`).
        self.told: dict[str, str] = {}
        self.aborted: str | None = None  # replaces Codex's "<turn_aborted>" message, if we ended it
        self.known: set[str] = set()  # call ids already in the ledger
        self.records: asyncio.Queue[_Job | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._record_loop(), name="codex ledger")

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def _record_loop(self) -> None:
        """Ledger entries and rollout copies, one at a time and in order."""
        while (job := await self.records.get()) is not None:
            action, done = job
            try:
                await action()
            except Exception as e:  # Redis down: the record is lost, the turn goes on
                logger.warning("codex.record_failed", extra={"error": repr(e)})
                if done is not None and not done.done():
                    done.set_result(False)
                continue
            if done is not None and not done.done():
                done.set_result(True)

    def _append_entry(self, entry: dict[str, Any]) -> Callable[[], Awaitable[None]]:
        store, writer = self.turn.store, self.rollout.writer if self.rollout else None

        async def append() -> None:
            if store is not None and writer is not None:
                await store.append(CALLS_KEY, [{"w": writer, **entry}])

        return append

    def record_later(self, entry: dict[str, Any]) -> None:
        self.records.put_nowait((self._append_entry(entry), None))

    async def record_now(self, entry: dict[str, Any]) -> bool:
        """Record `entry` before going on; False when it could not be stored."""
        if self.turn.store is None or self.rollout is None:
            return True  # nothing is kept across turns: nobody will read it
        if self.task is None or self.task.done():
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.records.put_nowait((self._append_entry(entry), done))
        return await done

    def record_call(self, item_id: str, what: str, kind: str, *, asked: bool) -> None:
        if not item_id or (item_id in self.known and not asked):
            return
        self.known.add(item_id)
        self.record_later({"ev": "call", "id": item_id, "what": what, "kind": kind, "asked": asked})

    def record_result(self, item: dict[str, Any]) -> None:
        """A call finished: record it, and copy the transcript up to its output at once, so
        a replica killed from now on leaves the truth behind."""
        item_id = str(item.get("id"))
        code = item.get("exitCode")
        self.record_call(item_id, item_what(item), item_kind(item), asked=False)
        self.record_later(
            {
                "ev": "result",
                "id": item_id,
                "status": str(item.get("status") or ""),
                "exit": code if isinstance(code, int) and not isinstance(code, bool) else None,
            }
        )
        self.records.put_nowait((lambda: self.sync(wait_for=output_of(item_id)), None))

    async def drain(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.records.put(None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), 10)

    # -- the rollout -------------------------------------------------------------------------

    async def restore(self, state: dict[str, Any]) -> bool:
        """Write the stored rollout into this turn's CODEX_HOME; True if it can be resumed.

        After a cut-off turn (`Turn.interrupted`) that turn's lines are taken too, up to the
        last one it stored (a call's output is stored as soon as Codex reports it). A call left
        with no output gets one saying what is known of it (`codex_transcript.describe`),
        which Codex would otherwise fill in as "aborted".
        """
        codex_thread, rel, segments = (
            state.get("codex_thread"),
            state.get("rollout"),
            state.get("segments"),
        )
        if not (isinstance(codex_thread, str) and isinstance(rel, str)):
            return False
        if not ROLLOUT.fullmatch(rel) or ".." in rel.split("/"):
            return False
        store = self.turn.store
        if not isinstance(segments, list) or not segments or store is None:
            return False
        entries = await store.load(store_key(codex_thread)) or []
        segments = list(segments)
        ledger: list[Any] | None = None
        if self.turn.interrupted is not None:
            ledger = await store.load(CALLS_KEY) or []
            cut = interrupted_writer(ledger, state)
            if cut is not None:
                segments = _extend(segments, cut, entries)
        lines = _restore_lines(entries, segments)
        if not lines:
            await self.turn.emit(
                f"(The transcript of Codex session {codex_thread} is missing from the store;"
                " starting a new Codex session.)"
            )
            return False
        extra: list[str] = []
        dangling = dangling_calls(lines)
        if dangling:
            if ledger is None:
                ledger = await store.load(CALLS_KEY) or []
            calls = calls_of(ledger)
            for call_id, call_type in dangling:
                call = calls.get(call_id) or Call(call_id, "this call", "other")
                extra.append(
                    output_line([*lines, *extra], call_id, call_type, describe(call) + ".")
                )
        path = self.home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([*lines, *extra]) + "\n")
        # The outputs written here are this turn's own lines: the next `sync` stores them.
        self.rollout = Rollout(codex_thread, rel, segments=segments, base=len(lines))
        return True

    async def sync_now(self, wait_for: Callable[[bytes], bool] | None = None) -> None:
        """`sync`, in order with the ledger's writes."""
        if self.task is None or self.task.done():
            await self.sync(wait_for)
            return
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.records.put_nowait((lambda: self.sync(wait_for), done))
        await done

    async def sync(self, wait_for: Callable[[bytes], bool] | None = None) -> None:
        """Append the rollout's new complete lines to the store, in our words where we stopped
        a call (`codex_transcript.rewrite_line`). With `wait_for`, first wait briefly until
        Codex has written what it looks for (a call, a call's output), so a resume sees it."""
        r, store = self.rollout, self.turn.store
        if r is None or store is None:
            return
        path = self.home / r.rel
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while True:
            try:
                data = await asyncio.to_thread(path.read_bytes)
            except OSError:
                data = b""
            if wait_for is None or wait_for(data) or loop.time() > deadline:
                break
            await asyncio.sleep(0.02)
        complete = data[: data.rfind(b"\n") + 1].decode(errors="replace")
        lines = complete.splitlines()
        new = lines[r.base + r.synced :]
        if new:
            words = [rewrite_line(x, self.told, self.aborted) for x in new]
            await store.append(store_key(r.codex_thread), [{"w": r.writer, "l": x} for x in words])
            r.synced += len(new)


def _extend(segments: list[Any], writer: str, entries: Sequence[Any]) -> list[Any]:
    """`segments` with every line `writer` stored, its own segment grown or added last."""
    count = sum(1 for e in entries if isinstance(e, dict) and e.get("w") == writer and "l" in e)
    if not count:
        return segments
    out = [seg for seg in segments if not (isinstance(seg, list) and seg and seg[0] == writer)]
    return [*out, [writer, count]]


def holds(call_id: str) -> Callable[[bytes], bool]:
    """Does the rollout name `call_id` yet (its call has been written)?"""
    needle = call_id.encode()

    def check(data: bytes) -> bool:
        return not needle or needle in data

    return check


def output_of(call_id: str) -> Callable[[bytes], bool]:
    """Does the rollout hold the output of `call_id` yet?"""
    needle = f'"call_id":"{call_id}"'.encode()

    def check(data: bytes) -> bool:
        return any(b"_call_output" in line and needle in line for line in data.splitlines())

    return check


def relative(path: object, home: Path) -> str:
    """`path` under `home`, as a relative POSIX path ("" when it is not under it)."""
    if not isinstance(path, str):
        return ""
    try:
        return Path(path).relative_to(home).as_posix()
    except ValueError:
        return ""
