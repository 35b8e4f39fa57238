"""Benchmark the Codex harness: the real Codex CLI against the fake Responses API, on a replica.

One in-process replica (`workers.runtime.replica.Replica`) with the Codex harness runs on a private
`redis-server` (no persistence, a free port, stopped by its pid at the end); a "person" answers
through a Broker. Each run is one thread whose agent (Codex, model `gpt-5.5` served by
`workers/demo/fakes/responses.py` on 127.0.0.1) runs `date +%s.%N > ran.txt` outside its sandbox, so
Codex asks an approval. Per run:

- **request -> prompt item**: from the model's tool call (the fake's reply, wall clock) to the
  `pending_prompt` item on the thread (its Redis stream time, ms). Split into model call ->
  Codex's `requestApproval` reaching the harness (Codex itself) and that -> the item (ours).
- **answer -> command running**: from just before the person's `yes` is posted to the time the
  command wrote into `ran.txt`; and to the harness sending Codex `accept` (held: the answer
  reaching the waiting call; parked: a new app-server, `thread/resume`, the model's retry and
  the grant), the rest being Codex starting the command.
- **memory per waiting agent**: held, the RSS of the waiting `codex app-server` process tree
  (sampled while it waits); parked, no process is left (checked), and what the wait costs is the
  thread's Redis keys (`MEMORY USAGE`), mostly the stored Codex rollout.

Held runs answer in place; parked runs (`wait_mode=parked`) end the turn, and the answer starts a
resume turn (a new app-server, `thread/resume` from the stored rollout, the agent's retry
answered by the one-shot grant). Prints p50 / p90 / min / max over the runs; exits 0.

    .venv/bin/python bench/bench_codex.py            # 20 held + 20 parked runs
    .venv/bin/python bench/bench_codex.py --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
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

from bench.private_redis import free_port, private_redis  # noqa: E402
from broker import Broker, Item, Settings  # noqa: E402
from workers.agents.codex import COMMAND, PINNED_VERSION, CodexHarness, find_codex  # noqa: E402
from workers.demo.fakes.responses import FakeResponses  # noqa: E402
from workers.runtime.replica import Replica  # noqa: E402

T = TypeVar("T")
FAST: dict[str, Any] = {"lease_ttl": 2.0, "adopt_interval": 0.05, "sweep_interval": 1.0}


async def until(check: Callable[[], Awaitable[T | None]], within: float = 60.0) -> T:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        await asyncio.sleep(0.005)


def tree_rss_kb(pid: int) -> int:
    """RSS of a process and its descendants, in kB (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                stack += [int(c) for c in children]
        except OSError:
            continue
    return total


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class Wire:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], float]] = []

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        self.events.append((event, data, time.time()))

    def spawned(self, thread_id: str) -> list[int]:
        return [d["pid"] for e, d, _ in self.events if e == "spawn" and d["thread_id"] == thread_id]

    def accept_sent(self, after: float) -> float | None:
        for e, d, t in self.events:
            if e == "send" and t >= after and d["msg"].get("result") == {"decision": "accept"}:
                return t
        return None

    def approval_at(self, pid: int) -> float | None:
        for e, d, t in self.events:
            if e == "recv" and d["pid"] == pid and d["msg"].get("method") == COMMAND:
                return t
        return None


async def one_run(
    person: Broker, fake: FakeResponses, wire: Wire, work: Path, parked: bool
) -> dict[str, float]:
    thread_id = f"b{uuid.uuid4().hex[:10]}"
    folder = work / thread_id
    folder.mkdir()
    ran = folder / "ran.txt"
    config = {"base_url": fake.base_url, "api_key": "dummy", "model": "gpt-5.5"}
    await person.sessions.create(thread_id, "codex", "approval", config, work_folder=str(folder))
    message = f"run!: date +%s.%N > {ran}"
    await person.post_item(thread_id, {"content": [{"type": "text", "text": message}]})

    async def prompt_item() -> Item | None:
        items = await person.items(thread_id)
        return next((i for i in items if i.type == "pending_prompt"), None)

    item = await until(prompt_item)
    (pid,) = wire.spawned(thread_id)
    model_call = next(r.at for r in fake.requests if r.user_text == message and r.step == 0)
    codex_asked = wire.approval_at(pid) or float("nan")
    out: dict[str, float] = {
        "request->item": item.created_at.timestamp() - model_call,
        "model->codex request": codex_asked - model_call,
        "codex request->item": item.created_at.timestamp() - codex_asked,
    }
    if parked:
        session = await until(lambda: _parked(person, thread_id))
        await until(lambda: _true(not alive(pid)), 10)
        keys = [k async for k in person.redis.scan_iter(match=f"*{thread_id}*", count=1000)]
        sizes = [await person.redis.memory_usage(k) or 0 for k in keys]
        out["redis bytes while parked"] = float(sum(sizes))
        out["rss kB while waiting"] = 0.0
        assert session
    else:
        await asyncio.sleep(0.3)  # let it settle into the wait
        out["rss kB while waiting"] = float(max(tree_rss_kb(pid) for _ in range(3)))
    answered = time.time()
    await person.post_item(thread_id, {"content": [{"type": "text", "text": "yes"}]})
    await until(lambda: _true(ran.exists() and ran.read_text().strip() != ""))
    out["answer->command ran"] = float(ran.read_text().strip()) - answered
    out["answer->accept sent"] = (wire.accept_sent(answered) or float("nan")) - answered

    async def ended() -> bool:
        s = await person.sessions.get(thread_id)
        return s is not None and s.status == "idle"

    await until(ended)
    return out


async def _parked(person: Broker, thread_id: str) -> bool:
    s = await person.sessions.get(thread_id)
    return s is not None and s.status == "parked"


async def _true(value: bool) -> bool:
    return value


def summary(name: str, values: list[float], unit: str, scale: float = 1.0) -> str:
    vs = sorted(v * scale for v in values)
    p90 = vs[min(len(vs) - 1, round(0.9 * (len(vs) - 1)))]
    return (
        f"  {name:<26} p50 {statistics.median(vs):9.1f} {unit:<3} p90 {p90:9.1f}"
        f"   min {vs[0]:9.1f}   max {vs[-1]:9.1f}   (n={len(vs)})"
    )


async def bench(url: str, runs: int) -> None:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    with FakeResponses() as fake, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in ("held", "parked"):
            wire = Wire()
            settings = Settings(key_prefix=prefix, wait_mode=mode, **FAST)
            b = Broker(Redis.from_url(url, decode_responses=True), settings)
            person = Broker(Redis.from_url(url, decode_responses=True), settings)
            replica = Replica(b, harnesses={"codex": CodexHarness(trace=wire)}, replica_id=mode)
            stop = asyncio.Event()
            task = asyncio.create_task(replica.run(stop))
            results = [await one_run(person, fake, wire, work, mode == "parked")]  # warm-up
            results = [
                await one_run(person, fake, wire, work, mode == "parked") for _ in range(runs)
            ]
            stop.set()
            await task
            await b.aclose()
            await person.aclose()
            print(f"\n{mode} waits ({runs} runs, after one warm-up):")
            for key, unit, scale in (
                ("request->item", "ms", 1000),
                ("model->codex request", "ms", 1000),
                ("codex request->item", "ms", 1000),
                ("answer->accept sent", "ms", 1000),
                ("answer->command ran", "ms", 1000),
                ("rss kB while waiting", "MB", 1 / 1024),
                ("redis bytes while parked", "kB", 1 / 1024),
            ):
                values = [r[key] for r in results if key in r]
                if values:
                    print(summary(key, values, unit, scale))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    codex = find_codex()
    if codex is None:
        raise SystemExit("the codex CLI is not installed: `npm install` at the repository root")
    with tempfile.TemporaryDirectory(prefix="pb-codex-version-") as home:
        version = subprocess.run(
            [codex, "--version"],
            check=True,
            capture_output=True,
            text=True,
            env=dict(os.environ, CODEX_HOME=home),
        ).stdout.strip()
    print(f"codex: {codex} ({version}; pinned {PINNED_VERSION})")
    print(f"host: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH")
    with private_redis(exe, free_port()) as url:
        asyncio.run(bench(url, args.runs))


if __name__ == "__main__":
    main()
