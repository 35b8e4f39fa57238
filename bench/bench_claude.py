"""Benchmark the Claude Code harness: the real bundled CLI, a fake model on loopback, a replica.

One in-process replica (`workers.runtime.replica.Replica`) with the `claude_code` harness, on a
private `redis-server` (free port, no persistence, stopped by its pid at the end), and the scripted
fake Messages API (`workers/demo/fakes/anthropic.py`). Each run is a new thread whose model calls
Bash once (`date +%s.%N > <file>`: the command records when it ran) and a "person" approves it.

1. request -> prompt: from the moment the fake model finished sending the tool call (wall clock,
   after `message_stop`) to the `pending_prompt` item's `created_at` (Redis server clock, ms; same
   host). Held waits (the CLI's permission callback asks) and, separately, questions asked from
   the PreToolUse hook (AskUserQuestion).
2. answer -> tool running: from just before the person's `post_item` to the time the command
   wrote. Held: the CLI is waiting in the callback. Parked (wait mode `parked`): the turn ended
   with the Claude session deferred; the answer starts a resume turn, which starts a new CLI,
   resumes the session from Redis, replays the deferred call, and the grant approves it.
3. memory per waiting agent: with N threads held at once, the RSS and PSS of each waiting CLI
   process (children of this process), and this process's RSS growth; parked, the processes
   left (none) and the Redis bytes each parked session keeps (transcript list + session hash).

    .venv/bin/python bench/bench_claude.py            # 20 runs each, 5 held at once
    .venv/bin/python bench/bench_claude.py --runs 5   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.private_redis import PrivateRedis, free_port  # noqa: E402
from broker import Broker, Settings  # noqa: E402
from workers.agents.claude import ClaudeHarness  # noqa: E402
from workers.agents.claude_launch import descendants  # noqa: E402
from workers.demo.fakes.anthropic import FakeAnthropic, Script, text, tool_use  # noqa: E402
from workers.runtime.replica import Replica  # noqa: E402

T = TypeVar("T")
FAST = {"lease_ttl": 5.0, "adopt_interval": 0.05, "sweep_interval": 1.0}
QUESTION = {
    "question": "Which database?",
    "header": "Database",
    "options": [
        {"label": "SQLite", "description": "one file"},
        {"label": "Postgres", "description": "a server"},
    ],
    "multiSelect": False,
}


async def until(check: Callable[[], Awaitable[T | None]], what: str, within: float = 60) -> T:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def p50(values: list[float]) -> str:
    if not values:
        return "n/a"
    ms = sorted(v * 1000 for v in values)
    p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
    return f"p50 {statistics.median(ms):7.1f} ms   p90 {p90:7.1f} ms   (n={len(ms)})"


# -- processes -------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def claude_processes() -> list[int]:
    """The CLIs below this process (each under its supervisor, `workers.agents.claude_launch`)."""
    found = []
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/exe").resolve().name == "claude":
                found.append(pid)
    return found


def supervisors() -> list[int]:
    found = []
    for pid in children(os.getpid()):
        with contextlib.suppress(OSError):
            if b"claude_launch.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in kB."""
    rss = pss = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


# -- the rig ---------------------------------------------------------------------------------------


class Rig:
    def __init__(self, url: str, root: Path, fake: FakeAnthropic) -> None:
        self.url, self.root, self.fake = url, root, fake
        self.prefix = "b" + uuid.uuid4().hex[:8]
        self.work = root / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.person = Broker(Redis.from_url(url, decode_responses=True), self.settings())
        self.replicas: list[tuple[Replica, asyncio.Event, asyncio.Task[None], Broker]] = []
        self.n = 0

    def settings(self, **overrides: Any) -> Settings:
        return Settings(key_prefix=self.prefix, **(FAST | overrides))

    async def replica(self, name: str, **overrides: Any) -> Replica:
        b = Broker(Redis.from_url(self.url, decode_responses=True), self.settings(**overrides))
        harness = ClaudeHarness(scratch_root=self.root / f"scratch-{name}")
        r = Replica(b, harnesses={"claude_code": harness}, replica_id=name)
        stop = asyncio.Event()
        self.replicas.append((r, stop, asyncio.create_task(r.run(stop)), b))
        return r

    async def stop_all(self) -> None:
        for _, stop, task, b in self.replicas:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 20)
            await b.aclose()
        self.replicas = []

    async def thread(self, replies: list[Any]) -> str:
        self.n += 1
        tid = f"c{self.n}"
        marker = f"[run {self.prefix} {self.n}]"
        self.fake.script.conversations[marker] = replies
        config = {"base_url": self.fake.url, "api_key": "sk-ant-dummy-offline"}
        await self.person.sessions.create(
            tid, "claude_code", "approval", config, work_folder=str(self.work)
        )
        await self.person.post_item(tid, {"content": [{"type": "text", "text": f"{marker}: go"}]})
        return tid

    async def prompt_item(self, tid: str) -> Any:
        async def check() -> Any:
            items = await self.person.items(tid)
            return next((i for i in items if i.type == "pending_prompt"), None)

        return await until(check, f"the prompt on {tid}")

    async def status(self, tid: str, want: str) -> None:
        async def check() -> bool:
            s = await self.person.sessions.get(tid)
            return s is not None and s.status == want

        await until(check, f"{tid} {want}")

    async def ended(self, tid: str) -> None:
        async def check() -> bool:
            items = await self.person.items(tid)
            s = await self.person.sessions.get(tid)
            done = any(i.type == "turn_end" for i in items)
            return done and s is not None and s.status == "idle"

        await until(check, f"{tid} to end")

    def request_sent(self, name: str) -> float:
        """When the fake model finished sending the last call to `name`."""
        for r in reversed(self.fake.requests):
            if any(b.get("type") == "tool_use" and b["name"] == name for b in r.reply):
                return r.sent_at
        raise LookupError(name)

    async def cleanup(self) -> None:
        keys = [k async for k in self.person.redis.scan_iter(match=f"{self.prefix}:*")]
        for i in range(0, len(keys), 500):
            await self.person.redis.delete(*keys[i : i + 500])
        await self.person.aclose()


def bash_then_done(stamp: Path) -> list[Any]:
    return [
        [tool_use("Bash", {"command": f"date +%s.%N > {stamp}", "description": "stamp"})],
        [text("done")],
    ]


def retry_then_done(stamp: Path) -> list[Any]:
    command = f"date +%s.%N > {stamp}"

    def retry(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [tool_use("Bash", {"command": command, "description": "stamp"})]

    return [[tool_use("Bash", {"command": command, "description": "stamp"})], retry, [text("done")]]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


async def wait_file(path: Path) -> float:
    async def check() -> float | None:
        raw = await asyncio.to_thread(_read, path)
        return float(raw) if raw else None

    return await until(check, f"{path}")


# -- measurements ----------------------------------------------------------------------------------


async def held_runs(rig: Rig, runs: int) -> tuple[list[float], list[float]]:
    await rig.replica("held")
    to_prompt, to_tool = [], []
    for i in range(runs):
        stamp = rig.root / f"held-{i}.txt"
        tid = await rig.thread(bash_then_done(stamp))
        item = await rig.prompt_item(tid)
        to_prompt.append(item.created_at.timestamp() - rig.request_sent("Bash"))
        await asyncio.sleep(0.2)  # the CLI settles in its callback
        answered = time.time()
        await rig.person.post_item(tid, {"content": [{"type": "text", "text": "yes"}]})
        to_tool.append(await wait_file(stamp) - answered)
        await rig.ended(tid)
    await rig.stop_all()
    return to_prompt, to_tool


async def question_runs(rig: Rig, runs: int) -> list[float]:
    await rig.replica("ask")
    to_prompt = []
    for _ in range(runs):
        tid = await rig.thread(
            [[tool_use("AskUserQuestion", {"questions": [QUESTION]})], [text("ok")]]
        )
        item = await rig.prompt_item(tid)
        to_prompt.append(item.created_at.timestamp() - rig.request_sent("AskUserQuestion"))
        await rig.person.post_item(tid, {"content": [{"type": "text", "text": "1"}]})
        await rig.ended(tid)
    await rig.stop_all()
    return to_prompt


async def parked_runs(rig: Rig, runs: int) -> list[float]:
    await rig.replica("parked", wait_mode="parked")
    to_tool = []
    for i in range(runs):
        stamp = rig.root / f"parked-{i}.txt"
        tid = await rig.thread(retry_then_done(stamp))
        await rig.prompt_item(tid)

        async def deferred(tid: str = tid) -> bool:
            s = await rig.person.sessions.get(tid)
            return bool(
                s and s.status == "parked" and (s.state or {}).get("pending", {}).get("deferred")
            )

        await until(deferred, f"{tid} deferred")
        answered = time.time()
        await rig.person.post_item(tid, {"content": [{"type": "text", "text": "yes"}]})
        to_tool.append(await wait_file(stamp) - answered)
        await rig.ended(tid)
    await rig.stop_all()
    return to_tool


async def memory(rig: Rig, waiting: int) -> None:
    base_rss, _ = memory_kb(os.getpid())
    await rig.replica("mem-held")
    tids = [await rig.thread(bash_then_done(rig.root / f"mem-{i}.txt")) for i in range(waiting)]
    for tid in tids:
        await rig.prompt_item(tid)
    await until(lambda: _true(len(claude_processes()) >= waiting), "the waiting CLIs")
    await asyncio.sleep(1.0)
    procs = claude_processes()
    mems = [memory_kb(p) for p in procs]
    sups = [memory_kb(p) for p in supervisors()]
    held_rss, _ = memory_kb(os.getpid())
    print(f"held:   {len(procs)} CLI processes waiting in the permission callback")
    for pid, (rss, pss) in zip(procs, mems, strict=True):
        print(f"        pid {pid}: RSS {rss / 1024:6.1f} MB   PSS {pss / 1024:6.1f} MB")
    avg_rss = statistics.mean(m[0] for m in mems) / 1024
    avg_pss = statistics.mean(m[1] for m in mems) / 1024
    print(f"        per waiting agent: RSS {avg_rss:.1f} MB, PSS {avg_pss:.1f} MB (CLI); "
          f"this process grew {(held_rss - base_rss) / 1024:.1f} MB for all {waiting}")  # fmt: skip
    if sups:
        sup_rss = statistics.mean(m[0] for m in sups) / 1024
        sup_pss = statistics.mean(m[1] for m in sups) / 1024
        print(f"        its supervisor (workers.agents.claude_launch): RSS {sup_rss:.1f} MB, "
              f"PSS {sup_pss:.1f} MB ({len(sups)} running)")  # fmt: skip
    for tid in tids:
        await rig.person.post_item(tid, {"content": [{"type": "text", "text": "yes"}]})
    for tid in tids:
        await rig.ended(tid)
    await rig.stop_all()

    await rig.replica("mem-parked", wait_mode="parked")
    tids = [await rig.thread(retry_then_done(rig.root / f"memp-{i}.txt")) for i in range(waiting)]
    for tid in tids:
        await rig.status(tid, "parked")
    await until(lambda: _true(not claude_processes()), "the CLIs to exit", within=30)
    parked_rss, _ = memory_kb(os.getpid())
    stored = []
    for tid in tids:
        s = await rig.person.sessions.get(tid)
        assert s is not None and s.state is not None
        keys = rig.person.thread(tid)
        transcript = keys.agent(f"claude:{s.state['session_id']}")
        size = await rig.person.redis.memory_usage(transcript) or 0
        size += await rig.person.redis.memory_usage(keys.session) or 0
        stored.append(size)
    grew = (parked_rss - base_rss) / 1024
    print(f"parked: {len(claude_processes())} CLI processes left for {waiting} parked agents; "
          f"this process {grew:+.1f} MB vs. before the held phase")  # fmt: skip
    print(f"        Redis per parked agent (transcript + session): "
          f"{statistics.mean(stored) / 1024:.1f} KiB")  # fmt: skip
    await rig.stop_all()


async def _true(value: bool) -> bool:
    return value


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--waiting", type=int, default=5)
    args = parser.parse_args()
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH")
    server = PrivateRedis(exe, free_port(), Path(tempfile.mkdtemp(prefix="bench-claude-redis-")))
    server.start()
    root = Path(tempfile.mkdtemp(prefix="bench-claude-"))
    fake = FakeAnthropic(Script({})).start()
    rig = Rig(server.url, root, fake)
    try:
        print(f"claude_code harness, {args.runs} runs each; {os.cpu_count()} CPUs")
        to_prompt, to_tool = await held_runs(rig, args.runs)
        questions = await question_runs(rig, args.runs)
        parked = await parked_runs(rig, args.runs)
        print("request -> prompt item (approval, permission callback):  " + p50(to_prompt))
        print("request -> prompt item (question, PreToolUse hook):      " + p50(questions))
        print("answer -> Bash running, held (CLI waiting):              " + p50(to_tool))
        print("answer -> Bash running, parked (resume on a new CLI):    " + p50(parked))
        await memory(rig, args.waiting)
    finally:
        await rig.stop_all()
        await rig.cleanup()
        fake.stop()
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
