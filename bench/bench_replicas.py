"""Benchmark replica processes: adoption after SIGKILL, adopting 10,000 open prompts, footprint.

Every replica here is a real process (`python -m workers.runtime.cli worker --id NAME`), started
with the settings printed at the top; figures are printed beside their floors:

0. an idle replica holding nothing: its CPU and redis-server's (process CPU time over a window).
1. adoption time after SIGKILL: two replicas, a few threads whose scripted agent waits (held) on
   an approval, SIGKILL the replica holding most of them, and time from the kill until the other
   replica's claim is visible in each thread's session record (polled every 5 ms). Floor: the
   lease TTL (the victim's replica record is never taken before it runs out, by design); target:
   within TTL + 1 s.
2. seconds for ONE fresh replica to adopt N open prompts (held by a dead replica whose record ran
   out), from its process start until every session is owned by it and marked `parked`. Floor:
   the same per-thread Redis work (the claim, the session and inbox read, the prompt's state,
   update.lua, SUBSCRIBE) pipelined by one client in this process.
3. what that replica holds afterwards: its Redis connections (server side, matched to the
   process's own sockets), its pub/sub subscriptions, its RSS beside an idle replica's, and its
   CPU and redis-server's while nothing happens (targets: under 2% and 1% of a core). 2. and 3.
   run for N = --prompts (10,000) and again for N = --large (100,000).

Everything runs against a private `redis-server` started here on a free port (no persistence)
and stopped by its pid at the end; every process started here is stopped by its pid. The script
exits 0 whether or not a target is met: it reports.

    .venv/bin/python bench/bench_replicas.py            # 20 kills, 10,000 prompts
    .venv/bin/python bench/bench_replicas.py --quick    # 5 kills, 1,000 prompts: about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
import redis
from private_redis import free_port, private_redis, server_cpu_seconds
from redis.asyncio import Redis

from broker import Broker, Keys, Settings
from workers.agents.harness import approval_question
from workers.runtime.adoption import ADOPT_PAGE

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
#: A scripted agent that asks one approval (`Bash make deploy`) and waits on it.
SCRIPT = {
    "turns": [
        {
            "steps": [
                {"tool": "Bash", "input": {"command": "make deploy"}, "output": "deployed"},
            ]
        }
    ]
}
CONFIG = {"script": SCRIPT}
QUESTION = approval_question("Bash", {"command": "make deploy"})
#: What the scripted harness saves with that ask (entry 0, step 0), so a resume could continue.
AGENT_STATE = {"turn": 0, "step": 0}
DEAD = "dead-replica"

ADOPT_SLACK_S = 1.0  # target: adopted within lease TTL + this
CONNECTIONS_TARGET = 4
POLL_S = 0.005
BENCH_NAME = "bench"  # CLIENT SETNAME of every connection this script opens


# -- small helpers -------------------------------------------------------------------------------


def pct(samples: list[float], p: float) -> float:
    """The nearest-rank percentile `p` (0-100) of `samples`."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def _client(url: str, name: str = BENCH_NAME) -> Redis:
    """A client whose every connection is named `name` (CLIENT SETNAME): told apart from the
    replica's in CLIENT LIST."""
    client: Redis = Redis.from_url(url, decode_responses=True, client_name=name)
    return client


async def in_batches(make: Callable[[int], Awaitable[T]], count: int, batch: int) -> list[T]:
    out: list[T] = []
    for start in range(0, count, batch):
        out += await asyncio.gather(*(make(i) for i in range(start, min(count, start + batch))))
    return out


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


# -- a private redis-server ----------------------------------------------------------------------


# -- replica processes ---------------------------------------------------------------------------


class ReplicaProcess:
    """One `python -m workers.runtime.cli worker --id NAME` process, stopped by its own pid."""

    def __init__(self, name: str, settings: Settings, log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
        for key, value in settings.model_dump().items():
            text = orjson.dumps(value).decode() if isinstance(value, list | dict) else str(value)
            env[f"PROMPT_BROKER_{key.upper()}"] = text
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workers.runtime.cli", "worker", "--id", name],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=out,
            )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def warmed(self) -> bool:
        """It has logged the end of its deferred harness import (`harness.loaded`)."""
        return '"event":"harness.loaded"' in self.log.read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    async def stop(self, grace: float = 60.0) -> float | None:
        """SIGTERM, wait; SIGKILL past `grace` s. Seconds to exit, or None if it was killed."""
        if not self.alive():
            await asyncio.to_thread(self.proc.wait)
            return 0.0
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
            return None
        return time.perf_counter() - t0

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def check(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"replica {self.name} exited with {self.proc.returncode}:\n{self.tail()}"
            )


async def until(
    what: str, check: Callable[[], Awaitable[bool]], within: float, procs: list[ReplicaProcess]
) -> float:
    """Poll `check` every 10 ms until true; seconds taken. Fails if a replica died meanwhile."""
    t0 = time.perf_counter()
    while not await check():
        for p in procs:
            p.check()
        if time.perf_counter() - t0 > within:
            logs = "\n".join(f"--- {p.name}:\n{p.tail()}" for p in procs)
            raise RuntimeError(f"timed out after {within:.0f} s waiting for {what}\n{logs}")
        await asyncio.sleep(0.01)
    return time.perf_counter() - t0


async def replicas_up(r: Redis, keys: Keys, procs: list[ReplicaProcess]) -> float:
    async def beating() -> bool:
        return int(await r.zcard(keys.replicas)) >= len(procs)

    return await until(f"{len(procs)} replicas to beat", beating, 60, procs)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, ... of a process, in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.startswith("Vm") and value.strip().endswith("kB"):
            out[name] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def local_ports(pid: int, server_port: int) -> set[int]:
    """Local ports of the process's TCP sockets connected to `server_port` (from /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                local, remote, inode = cols[1], cols[2], cols[9]
                if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == server_port:
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


# -- 1. adoption after SIGKILL -------------------------------------------------------------------


@dataclass
class KillRun:
    victim_threads: int
    survivor_threads: int
    lease_left: list[float] = field(default_factory=list)  # s of lease left at the kill
    adopted: list[float] = field(default_factory=list)  # kill -> claim visible, per thread
    parked: list[float] = field(default_factory=list)  # kill -> marked parked, per thread

    @property
    def all_adopted(self) -> float:
        return max(self.adopted)


async def _start_held_threads(
    b: Broker, r: Redis, threads: list[str], procs: list[ReplicaProcess]
) -> dict[str, str]:
    """Create the threads, post a message to each, wait until each agent's approval is held;
    returns thread -> owner."""
    for t in threads:
        await b.sessions.create(t, "scripted", "approval", CONFIG)
    await asyncio.gather(
        *(b.post_item(t, {"content": [{"type": "text", "text": "deploy please"}]}) for t in threads)
    )
    owners: dict[str, str] = {}

    async def all_held() -> bool:
        pipe = r.pipeline(transaction=False)
        for t in threads:
            pipe.hmget(b.thread(t).session, ["owner", "status", "wait"])
        rows = await pipe.execute()
        owners.clear()
        owners.update({t: row[0] for t, row in zip(threads, rows, strict=True)})
        return all(status == "running" and wait for _, status, wait in rows)

    await until("every agent to hold its approval", all_held, 60, procs)
    return owners


async def _watch_adoption(
    r: Redis, b: Broker, victim: str, threads: list[str], *, t_kill: float, within: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Poll the victim's threads every POLL_S: when each is claimed by someone else, and
    when each is marked parked by its new owner (seconds after the kill)."""
    adopted: dict[str, float] = {}
    parked: dict[str, float] = {}
    keys = [b.thread(t).session for t in threads]
    while len(parked) < len(threads):
        pipe = r.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, ["owner", "status"])
        rows = await pipe.execute()
        now = time.perf_counter() - t_kill
        for t, (owner, status) in zip(threads, rows, strict=True):
            if owner and owner != victim:
                adopted.setdefault(t, now)
                if status == "parked":
                    parked.setdefault(t, now)
        if now > within:
            raise RuntimeError(f"{len(threads) - len(parked)} threads not adopted in {within} s")
        await asyncio.sleep(POLL_S)
    return adopted, parked


async def kill_run(url: str, base: Settings, run: int, threads: int, log_dir: Path) -> KillRun:
    settings = base.model_copy(update={"key_prefix": f"kill{run}-{uuid.uuid4().hex[:6]}"})
    keys = Keys(settings.key_prefix)
    procs = [ReplicaProcess(f"k{run}-r{i}", settings, log_dir) for i in (1, 2)]
    r = _client(url)
    b = Broker(_client(url), settings, owns_client=True)
    try:
        await replicas_up(r, keys, procs)
        names = [f"held-{i}" for i in range(threads)]
        owners = await _start_held_threads(b, r, names, procs)
        victim_name, _ = Counter(owners.values()).most_common(1)[0]
        victim = next(p for p in procs if p.name == victim_name)
        mine = [t for t in names if owners[t] == victim_name]
        t_kill = time.perf_counter()
        victim.kill()
        # The victim can beat no more after the kill: read what its record had left (the lease
        # of every thread it holds).
        pipe = r.pipeline(transaction=False)
        pipe.time()
        pipe.hget(keys.replica_records, victim_name)
        (sec, usec), raw = await pipe.execute()
        since_kill_ms = (time.perf_counter() - t_kill) * 1000
        now_ms = int(sec) * 1000 + int(usec) // 1000 - since_kill_ms
        until_ms = int(str(raw).partition("|")[2] or 0)
        out = KillRun(len(mine), threads - len(mine))
        out.lease_left = [(until_ms - now_ms) / 1000 for _ in mine]
        within = 3 * settings.lease_ttl + 10 * settings.adopt_interval + 10
        adopted, parked = await _watch_adoption(
            r, b, victim_name, mine, t_kill=t_kill, within=within
        )
        out.adopted = [adopted[t] for t in mine]
        out.parked = [parked[t] for t in mine]
        return out
    finally:
        for p in procs:
            await p.stop(30)
        await b.aclose()
        await r.aclose()


async def bench_kill(url: str, settings: Settings, args: argparse.Namespace, log: Path) -> Any:
    runs: list[KillRun] = []
    t0 = time.perf_counter()
    for i in range(args.runs):
        runs.append(await kill_run(url, settings, i, args.threads, log))
    seconds = time.perf_counter() - t0
    ttl = settings.lease_ttl
    every = [x for run in runs for x in run.adopted]
    last = [run.all_adopted for run in runs]
    left = [x for run in runs for x in run.lease_left]
    lag = [a - lf for run in runs for a, lf in zip(run.adopted, run.lease_left, strict=True)]
    parked = [x for run in runs for x in run.parked]
    split = Counter(f"{run.victim_threads}/{run.survivor_threads}" for run in runs)
    print(
        f"\n1. Adoption after SIGKILL: {args.runs} runs of 2 replica processes, {args.threads} "
        f"threads each holding an approval; SIGKILL the replica holding most ({seconds:.0f} s)"
    )
    print(
        f"   lease_ttl {ttl:g} s (the replica record, beaten every ttl/3 +-20%), adopt_interval "
        f"{settings.adopt_interval:g} s (+-20%), URGENT_MS 500; threads killed/kept per run: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(split.items()))
    )
    print(f"   {'':58} {'p50':>8} {'p99':>8} {'max':>8}")
    rows = [
        ("floor: the lease TTL", [ttl]),
        ("kill -> every thread of the victim claimed (per run)", last),
        ("kill -> claim visible, each thread", every),
        ("  of which: lease left at the kill (by design)", left),
        ("  of which: lease expiry -> claim visible (adopt loop)", lag),
        ("kill -> the adopter marked the held wait parked, each", parked),
    ]
    for label, xs in rows:
        print(f"   {label:58} {pct(xs, 50):7.3f}s {pct(xs, 99):7.3f}s {max(xs):7.3f}s")
    print(
        "   each run, killed/kept threads: kill -> all claimed (s): "
        + ", ".join(
            f"{run.victim_threads}/{run.survivor_threads} {run.all_adopted:.2f}" for run in runs
        )
    )
    p50, p99 = pct(last, 50), pct(last, 99)
    target = ttl + ADOPT_SLACK_S
    print(
        f"   excess over the lease TTL (per run): p50 {p50 - ttl:+.3f} s, p99 {p99 - ttl:+.3f} s"
        f"   target p99 <= TTL + {ADOPT_SLACK_S:g} s = {target:g} s: {verdict(p99 <= target)}"
    )
    return p50, p99, ttl, target


# -- 2. one replica adopts N open prompts --------------------------------------------------------


async def prepare_dead(
    url: str, settings: Settings, n: int, batch: int
) -> tuple[float, tuple[float, float]]:
    """N threads, each with a session held by DEAD (lease run out), status running (its agent
    was holding a wait) and one open approval asked under that lease. Returns (seconds taken,
    the floor: seconds one client takes to do an adoption's Redis work on all of them)."""
    b = Broker(_client(url, "bench-prep"), settings, owns_client=True)
    names = [f"adopt-{i:06d}" for i in range(n)]
    t0 = time.perf_counter()
    dead, _, _ = await b.sessions.join(DEAD, 1)  # its record runs out at once
    try:
        for start in range(0, n, batch):
            chunk = names[start : start + batch]
            await asyncio.gather(
                *(b.sessions.create(t, "scripted", "approval", CONFIG) for t in chunk)
            )
            epochs = await b.sessions.claim_many(chunk, DEAD, dead)
            await asyncio.gather(
                *(b.sessions.update(t, epochs[t], status="running") for t in chunk)
            )
            await asyncio.gather(
                *(
                    b.ask(t, "approval", [QUESTION], epoch=epochs[t], agent_state=AGENT_STATE)
                    for t in chunk
                )
            )
        prepared = time.perf_counter() - t0
        # A live fleet's server has every script loaded (the dead replica beat and claimed):
        # so does this one, so the adopter pays no NOSCRIPT retries the fleet would not.
        for script in b._scripts.by_name.values():
            await b.redis.script_load(script.source)
        floor = await adoption_floor(url, b, names, batch)
    finally:
        await b.aclose()  # its pub/sub connection subscribed every wake channel: gone now
    return prepared, floor


async def adoption_floor(url: str, b: Broker, names: list[str], batch: int) -> tuple[float, float]:
    """What adopting every thread costs Redis, done by one client in pages of ADOPT_PAGE, as
    the replica does: per page a look at the replica records and at the candidates, then the
    claims (Sessions.claim_many with the dead holder seen: its index entry, claim.lua on pages
    of threads, the index writes; as a replica "floor" whose record is made to run out at the
    end, so the threads stay adoptable), then SUBSCRIBE to each one's wake channel on one
    pub/sub connection and look.lua on pages of them (Sessions.look_many, which parks each).
    Untimed at the end: every status set back to running, for the replica to park.
    The replica does this and its own bookkeeping."""
    sub = _client(url, "bench-floor")
    pubsub = sub.pubsub()
    t0 = time.perf_counter()
    wanted, done = set(names), 0
    cpu0 = time.process_time()
    try:
        floor, _, _ = await b.sessions.join("floor", 600_000)
        while done < len(names):
            seen = await b.sessions.candidates(await b.sessions.look(), ADOPT_PAGE)
            chunk = [t for t in seen.expired if t in wanted]
            if not chunk:
                raise RuntimeError(f"the floor found {len(names) - done} threads no more")
            epochs = await b.sessions.claim_many(chunk, "floor", floor, seen.dead)
            chunk = list(epochs)
            wanted -= set(chunk)
            done += len(chunk)
            await pubsub.subscribe(*(b.thread(t).wake for t in chunk))
            # As "floor": each parks the session the dead replica left running.
            looks = await b.sessions.look_many("floor", floor, epochs)
            if set(looks.values()) != {"parked"}:
                raise RuntimeError("the floor's looks did not park every session")
        # "floor" dies now (its record's deadline just past): the threads are adoptable again,
        # and the replica's `waited` figures count from now, not from 1970
        dead_at = await b.sessions.server_ms() - 1
        await b.redis.hset(b.keys.replica_records, "floor", f"{floor}|{dead_at}")  # type: ignore[misc]
        confirmed = 0
        while confirmed < len(names):
            msg = await pubsub.get_message(timeout=10)
            if msg is None:
                raise RuntimeError("the floor's SUBSCRIBE confirmations stopped coming")
            confirmed += msg["type"] == "subscribe"
        took = time.perf_counter() - t0, time.process_time() - cpu0
        # Untimed: each session running again, as the dead replica left it (the replica has
        # them to park too).
        for start in range(0, len(names), 1000):
            pipe = b.redis.pipeline(transaction=False)
            for t in names[start : start + 1000]:
                pipe.hset(b.thread(t).session, "status", "running")
            await pipe.execute()
        return took
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await sub.aclose()


@dataclass
class Adoption:
    n: int
    beat: float  # start -> the replica's first heartbeat visible (process up, connected)
    first: float  # start -> the first claim visible
    owned: float  # start -> every session owned by it
    parked: float  # start -> every session owned by it and parked
    cpu_beat: float = 0.0  # the replica's CPU seconds when its first heartbeat was seen
    cpu_done: float = 0.0  # ... when every session was owned by it and parked


#: The watch's look at the sessions not seen parked yet, run on the bench's private server (the
#: session keys are not declared: one server, no cluster). KEYS[1] a list of their keys, in a
#: shuffled order; ARGV[1] the adopter. It pops the head while that one is owned by the adopter
#: and parked, and stops at the first that is not: a look costs a step or two while the adoption
#: is under way, and each session is read about once in all, not once a look. Returns how many
#: are left (0: every one is parked).
WATCH_LUA = """
while true do
  local key = redis.call('LINDEX', KEYS[1], 0)
  if not key then return 0 end
  local owner, status = unpack(redis.call('HMGET', key, 'owner', 'status'))
  if owner ~= ARGV[1] or status ~= 'parked' then return redis.call('LLEN', KEYS[1]) end
  redis.call('LPOP', KEYS[1])
end
"""


class AdoptionWatch:
    """Watches the adoption from outside, one round trip a look whatever the count: the
    adopter's holds index (its size: claimed so far) and `WATCH_LUA` (every one parked yet?).
    An earlier watch read a window of 1,000 sessions per look in Python: on two cores it lagged
    the adoption by up to 0.4 s; one that walked every session left held the server 10 to 20 ms
    a look, slowing the replica it watched."""

    KEY = "bench:adoption:unparked"

    def __init__(self, r: Redis, keys: Keys, names: list[str], replica: str) -> None:
        self.r, self.keys, self.replica, self.n = r, keys, replica, len(names)
        self.sessions = [keys.thread(t).session for t in names]
        random.Random(7).shuffle(self.sessions)  # adoption takes them in no particular order
        self.holds: str | None = None  # the adopter's holds index, once its record is seen
        self.first: float | None = None  # a claim seen
        self.owned: float | None = None  # all claimed
        self.beat: float | None = None  # its record seen

    async def start(self) -> None:
        await self.r.delete(self.KEY)
        for i in range(0, self.n, 1000):
            await self.r.rpush(self.KEY, *self.sessions[i : i + 1000])  # type: ignore[misc]

    async def poll(self, t0: float) -> bool:
        """One look; True when every thread is owned and parked."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self.keys.replica_records, self.replica)
        pipe.scard(self.holds or self.KEY + ":none")
        pipe.eval(WATCH_LUA, 1, self.KEY, self.replica)
        record, claimed, left = await pipe.execute()
        now = time.perf_counter() - t0
        if record and self.holds is None:
            self.beat = now
            self.holds = self.keys.holds(self.replica, record.partition("|")[0])
        if claimed and self.first is None:
            self.first = now
        if claimed >= self.n and self.owned is None:
            self.owned = now
        return bool(left == 0)


async def bench_adopt(
    url: str, settings: Settings, n: int, batch: int, log: Path
) -> tuple[Adoption, tuple[float, float], ReplicaProcess, set[str]]:
    r = _client(url)
    keys = Keys(settings.key_prefix)
    names = [f"adopt-{i:06d}" for i in range(n)]
    prepared, floor = await prepare_dead(url, settings, n, batch)
    before = {c["id"] for c in await r.client_list()}
    watch = AdoptionWatch(r, keys, names, "adopter")
    await watch.start()
    t0 = time.perf_counter()
    proc = ReplicaProcess("adopter", settings, log)
    cpu_beat = 0.0
    deadline = t0 + max(120.0, n / 50)
    while True:
        done = await watch.poll(t0)
        if watch.beat is not None and not cpu_beat:
            cpu_beat = cpu_seconds(proc.pid)
        if done:
            break
        now = time.perf_counter() - t0
        proc.check()
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{n} not all adopted\n{proc.tail()}")
        await asyncio.sleep(0.01)
    now = time.perf_counter() - t0
    owned = watch.owned or now
    result = Adoption(
        n, watch.beat or now, watch.first or now, owned, now, cpu_beat, cpu_seconds(proc.pid)
    )
    print(
        f"\n2. One replica process adopts {n:,} open prompts held by a dead replica "
        f"(leases run out, each session `running` with its agent's approval pending)"
    )
    print(
        f"   prepared in {prepared:.1f} s ({batch} threads at a time); lease_ttl "
        f"{settings.lease_ttl:g} s, adopt_interval {settings.adopt_interval:g} s, "
        f"redis_connections {settings.redis_connections}, sweep_interval "
        f"{settings.sweep_interval:g} s"
    )
    print(f"   {'from the process start (Popen) until':58} {'seconds':>8}")
    for label, value in [
        ("its first heartbeat is visible (imports, connect)", result.beat),
        ("its first claim is visible", result.first),
        (f"all {n:,} sessions owned by it", result.owned),
        (f"all {n:,} sessions owned by it and parked (the figure)", result.parked),
    ]:
        print(f"   {label:58} {value:7.2f}s")
    rate = n / result.parked
    steady = n / max(1e-9, result.parked - result.first)
    print(
        f"   adoption rate: {rate:,.0f} threads/s from the start, {steady:,.0f} threads/s from "
        "the first claim"
    )
    floor_s, floor_cpu = floor
    print(
        f"   floor: the same Redis work pipelined by one client here: {floor_s:.2f} s "
        f"({n / floor_s:,.0f} threads/s); the replica took {result.parked / floor_s:.1f}x"
    )
    print(
        f"   CPU time (not wall clock: the machine is shared): the replica process "
        f"{result.cpu_done:.2f} s in all, {result.cpu_done - result.cpu_beat:.2f} s after its "
        f"first heartbeat (the adoption); the floor's client {floor_cpu:.2f} s"
    )
    print(f"   for scale: the adopt loop claims pages of {ADOPT_PAGE} back to back while full")
    return result, floor, proc, before


# -- 3. what one replica holds -------------------------------------------------------------------


@dataclass
class Footprint:
    rss_kb: int
    hwm_kb: int
    connections: list[dict[str, Any]]  # CLIENT LIST entries of the replica's own sockets
    new_clients: int  # CLIENT LIST entries new since before the replica started, not ours
    sockets: int  # the replica's TCP sockets to the server, client side


async def footprint(r: Redis, proc: ReplicaProcess, port: int, before: set[str]) -> Footprint:
    ports = local_ports(proc.pid, port)
    clients = await r.client_list()
    mine = [c for c in clients if int(c["addr"].rsplit(":", 1)[1]) in ports]
    new = [
        c for c in clients if c["id"] not in before and not c.get("name", "").startswith(BENCH_NAME)
    ]
    st = proc_status(proc.pid)
    return Footprint(st["VmRSS"], st["VmHWM"], mine, len(new), len(ports))


async def idle_floor(
    url: str, base: Settings, port: int, log: Path, window: float
) -> tuple[Footprint, Busy]:
    """An idle replica (no threads), after a few adopt sweeps and a heartbeat; and its CPU (and
    redis-server's) over `window` s."""
    settings = base.model_copy(update={"key_prefix": f"idle-{uuid.uuid4().hex[:6]}"})
    r = _client(url)
    before = {c["id"] for c in await r.client_list()}
    proc = ReplicaProcess("idle", settings, log)
    try:
        await replicas_up(r, Keys(settings.key_prefix), [proc])
        await asyncio.sleep(max(2.0, 2 * settings.adopt_interval, settings.lease_ttl / 3 * 1.3))
        if importlib.util.find_spec("claude_agent_sdk") is not None:
            # Its start-up ends with the SDK's import, deferred to a thread of its own
            # (`OnFirstUse`): an idle replica is one that has done it.
            await until("the replica's deferred harness import", proc.warmed, 60, [proc])
        fp = await footprint(r, proc, port, before)
        return fp, await busy(r, proc.pid, window)
    finally:
        await proc.stop(30)
        await r.aclose()


async def subscriptions(r: Redis, b: Broker, names: list[str]) -> tuple[int, int]:
    """(wake channels with a subscriber, total subscribers) over the threads' channels."""
    with_sub = total = 0
    for start in range(0, len(names), 1000):
        chunk = [b.thread(t).wake for t in names[start : start + 1000]]
        for _, count in await r.pubsub_numsub(*chunk):
            with_sub += count > 0
            total += int(count)
    return with_sub, total


@dataclass
class Busy:
    """CPU use over a window, in 1 s buckets: the replica process and the redis-server."""

    replica: list[float] = field(default_factory=list)  # fraction of one core, per bucket
    server: list[float] = field(default_factory=list)
    rss_kb: int = 0  # the replica's RSS at the end of the window


async def _server_cpu(r: Redis) -> float:
    return server_cpu_seconds(await r.info("cpu"))


async def busy(r: Redis, pid: int, seconds: float) -> Busy:
    out = Busy()
    t, cpu, srv = time.perf_counter(), cpu_seconds(pid), await _server_cpu(r)
    deadline = t + seconds
    while time.perf_counter() < deadline:
        await asyncio.sleep(1.0)
        t1, cpu1, srv1 = time.perf_counter(), cpu_seconds(pid), await _server_cpu(r)
        out.replica.append((cpu1 - cpu) / (t1 - t))
        out.server.append((srv1 - srv) / (t1 - t))
        t, cpu, srv = t1, cpu1, srv1
    out.rss_kb = proc_status(pid)["VmRSS"]
    return out


async def bench_footprint(
    url: str,
    settings: Settings,
    proc: ReplicaProcess,
    *,
    port: int,
    before: set[str],
    n: int,
    idle: Footprint,
    window: float,
) -> tuple[Footprint, int, Busy]:
    r = _client(url)
    b = Broker(r, settings)
    try:
        await asyncio.sleep(1.0)
        fp = await footprint(r, proc, port, before)
        with_sub, total = await subscriptions(r, b, [f"adopt-{i:06d}" for i in range(n)])
        load = await busy(r, proc.pid, window)
        stop_s = await proc.stop(120)
    finally:
        await r.aclose()
    conns = len(fp.connections)
    subs = [int(c.get("sub", 0)) for c in fp.connections]
    print(f"\n3. One replica holding {n:,} parked threads (right after 2.)")
    print(
        f"   Redis connections: {conns} on the server side (CLIENT LIST entries on the replica's"
        f" own {fp.sockets} sockets, from /proc/{proc.pid}/fd); cross-check, new non-bench "
        f"clients since it started: {fp.new_clients}   target <= {CONNECTIONS_TARGET}: "
        f"{verdict(conns <= CONNECTIONS_TARGET)}"
    )
    for c in fp.connections:
        print(
            f"     id {c['id']:>5} age {c['age']:>4}s  cmd {c['cmd']:<10} sub {c['sub']:>6}  "
            f"tot-mem {int(c.get('tot-mem', 0)):>9,} B  omem {c['omem']}"
        )
    pubsub = sum(1 for s in subs if s)
    print(
        f"     = {pubsub} pub/sub + {conns - pubsub} command connection(s), with "
        f"redis_connections {settings.redis_connections}"
    )
    print(
        f"   pub/sub: {sum(subs):,} channels on its connections (CLIENT LIST sub=); PUBSUB NUMSUB "
        f"over the {n:,} wake channels: {with_sub:,} with a subscriber, {total:,} subscribers"
    )
    for label, rss in [("right after adoption", fp.rss_kb), (f"{window:.0f} s later", load.rss_kb)]:
        print(
            f"   RSS {label:22} {rss / 1024:6.1f} MiB   floor: an idle replica "
            f"{idle.rss_kb / 1024:.1f} MiB   -> {(rss - idle.rss_kb) * 1024 / n:,.0f} B per "
            "parked thread"
        )
    print(
        f"   CPU holding them, nothing answered, over {len(load.replica)} s (process CPU time "
        f"over the window; one record write every ~{settings.lease_ttl / 3:.2f} s whatever it "
        f"holds, one adoption look every ~{settings.adopt_interval:g} s, no timer re-read):"
    )
    for label, xs in [("replica process", load.replica), ("redis-server", load.server)]:
        print(
            f"     {label:16} mean {sum(xs) / len(xs) * 100:4.0f}% of a core, busiest second "
            f"{max(xs) * 100:4.0f}%"
        )
    said = f"{stop_s:.1f} s" if stop_s is not None else "did not exit within 120 s: SIGKILLed"
    print(f"   clean stop (SIGTERM -> exit, releasing {n:,} threads): {said}")
    return fp, conns, load


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_replicas.py",
        description="Benchmark real replica processes on a private redis-server: adoption time "
        "after SIGKILL beside the lease TTL, seconds for one replica to adopt N open prompts "
        "beside the same Redis work pipelined by one client, and that replica's Redis "
        "connections, pub/sub subscriptions and RSS beside an idle replica's. Exits 0 either way.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="5 kills and 1,000 prompts: about a minute"
    )
    parser.add_argument(
        "--runs", type=int, default=None, metavar="N", help="SIGKILL runs (default 20, quick 5)"
    )
    parser.add_argument(
        "--threads", type=int, default=4, metavar="N", help="held threads per kill run (default 4)"
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        metavar="N",
        help="open prompts one replica adopts (default 10000, quick 1000)",
    )
    parser.add_argument(
        "--large",
        type=int,
        default=None,
        metavar="N",
        help="a second, larger adoption whose idle cost is measured too (default 100000, quick "
        "5000; 0: none)",
    )
    parser.add_argument(
        "--batch", type=int, default=500, metavar="N", help="threads prepared at once (500)"
    )
    parser.add_argument(
        "--lease-ttl", type=float, default=2.0, metavar="S", help="lease_ttl (default 2 s)"
    )
    parser.add_argument(
        "--adopt-interval",
        type=float,
        default=None,
        metavar="S",
        help=f"adopt_interval (default: the settings' {Settings().adopt_interval:g} s)",
    )
    parser.add_argument(
        "--cpu-window",
        type=float,
        default=None,
        metavar="S",
        help="seconds the CPU of each replica (idle, holding N) is sampled (default 10, quick 5)",
    )
    parser.add_argument(
        "--only", choices=["kill", "adopt"], action="append", help="run only this part"
    )
    parser.add_argument(
        "--logs", type=Path, default=None, metavar="DIR", help="keep the replicas' logs here"
    )
    parser.add_argument(
        "--redis-server",
        default=shutil.which("redis-server"),
        metavar="PATH",
        help="the redis-server binary to start (default: the one on PATH)",
    )
    parser.add_argument("--port", type=int, default=0, help="the private server's port (free)")
    args = parser.parse_args(argv)
    args.runs = args.runs or (5 if args.quick else 20)
    args.prompts = args.prompts or (1_000 if args.quick else 10_000)
    if args.large is None:
        args.large = 5_000 if args.quick else 100_000
    if args.cpu_window is None:
        args.cpu_window = 5.0 if args.quick else 10.0
    if args.redis_server is None:
        parser.error("redis-server is not on PATH: pass --redis-server")
    if min(args.runs, args.threads, args.prompts, args.batch) < 1:
        parser.error("counts must be positive")
    return args


@dataclass
class Summary:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def add(self, figure: str, value: str, floor: str, target: str, met: str) -> None:
        self.rows.append((figure, value, floor, target, met))

    def print(self) -> None:
        head = ("figure", "value", "floor", "target", "met")
        widths = [max(len(row[i]) for row in [head, *self.rows]) for i in range(5)]
        print("\nSUMMARY")
        for row in [head, *self.rows]:
            print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


async def run(args: argparse.Namespace, url: str, port: int, log: Path) -> Summary:
    only = set(args.only or ["kill", "adopt"])
    overrides: dict[str, Any] = {"redis_url": url, "lease_ttl": args.lease_ttl}
    if args.adopt_interval is not None:
        overrides["adopt_interval"] = args.adopt_interval
    settings = Settings(**overrides)
    async with _client(url) as r:
        version = (await r.info("server"))["redis_version"]
    print(
        f"prompt-broker replica benchmark: private redis-server {version} at {url}; python "
        f"{platform.python_version()}, redis-py {redis.__version__}; {os.cpu_count()} CPUs, "
        f"load average {load_average()} at the start"
    )
    print(
        f"settings: lease_ttl {settings.lease_ttl:g} s, adopt_interval "
        f"{settings.adopt_interval:g} s, wait_mode {settings.wait_mode}, held_waits_max "
        f"{settings.held_waits_max}, max_turns {settings.max_turns}, redis_connections "
        f"{settings.redis_connections}, sweep_interval {settings.sweep_interval:g} s"
    )
    summary = Summary()
    if "kill" in only:
        p50, p99, ttl, target = await bench_kill(url, settings, args, log)
        lease = f"{ttl:g} s (lease TTL)"
        goal = f"p99 <= {target:g} s"
        summary.add("adoption after SIGKILL, p50", f"{p50:.3f} s", lease, goal, "")
        summary.add(
            "adoption after SIGKILL, p99", f"{p99:.3f} s", lease, goal, verdict(p99 <= target)
        )
    if "adopt" in only:
        await _adopt_and_footprint(args, settings, url, port=port, log=log, summary=summary)
    print(f"\nload average {load_average()} at the end (other work on this machine adds noise)")
    return summary


def _cpu(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


async def _adopt_and_footprint(
    args: argparse.Namespace, base: Settings, url: str, *, port: int, log: Path, summary: Summary
) -> None:
    idle, idle_load = await idle_floor(url, base, port, log, args.cpu_window)
    print(
        f"\n0. An idle replica holding nothing, over {len(idle_load.replica)} s: replica "
        f"{_cpu(idle_load.replica) * 100:.2f}% of a core, redis-server "
        f"{_cpu(idle_load.server) * 100:.2f}%"
    )
    summary.add(
        "idle CPU, 0 threads (replica / redis)",
        f"{_cpu(idle_load.replica) * 100:.2f}% / {_cpu(idle_load.server) * 100:.2f}%",
        "-",
        "< 2% / < 1%",
        verdict(_cpu(idle_load.replica) < 0.02 and _cpu(idle_load.server) < 0.01),
    )
    for n in [args.prompts, *([args.large] if args.large else [])]:
        settings = base.model_copy(update={"key_prefix": f"adopt-{uuid.uuid4().hex[:6]}"})
        adoption, floor, proc, before = await bench_adopt(url, settings, n, args.batch, log)
        try:
            fp, conns, load = await bench_footprint(
                url,
                settings,
                proc,
                port=port,
                before=before,
                n=n,
                idle=idle,
                window=args.cpu_window,
            )
        finally:
            await proc.stop(120)
        cpu, srv = _cpu(load.replica), _cpu(load.server)
        summary.add(
            f"idle CPU, {n:,} parked (replica / redis)",
            f"{cpu * 100:.2f}% / {srv * 100:.2f}%",
            f"{_cpu(idle_load.replica) * 100:.2f}% / {_cpu(idle_load.server) * 100:.2f}% (0)",
            "< 2% / < 1%",
            verdict(cpu < 0.02 and srv < 0.01),
        )
        floor_s, floor_cpu = floor
        summary.add(
            f"one replica adopts {n:,} prompts",
            f"{adoption.parked:.2f} s ({n / adoption.parked:,.0f}/s)",
            f"{floor_s:.2f} s (same Redis work, 1 client)",
            "<= 1 s" if n <= 10_000 else "none given",
            verdict(adoption.parked <= 1.0) if n <= 10_000 else "-",
        )
        summary.add(
            f"  its CPU time after its first beat, {n:,}",
            f"{adoption.cpu_done - adoption.cpu_beat:.2f} s ({adoption.cpu_done:.2f} s in all)",
            f"{floor_cpu:.2f} s (the floor client's CPU)",
            "-",
            "-",
        )
        summary.add(
            f"  of which from its first claim, {n:,}",
            f"{adoption.parked - adoption.first:.2f} s",
            f"start -> first heartbeat {adoption.beat:.2f} s",
            "-",
            "-",
        )
        summary.add(
            f"Redis connections, {n:,} parked",
            str(conns),
            f"{len(idle.connections)} (idle replica)",
            f"<= {CONNECTIONS_TARGET}",
            verdict(conns <= CONNECTIONS_TARGET),
        )
        summary.add(
            f"RSS, {n:,} parked",
            f"{fp.rss_kb / 1024:.1f} MiB "
            f"({load.rss_kb / 1024:.1f} MiB {args.cpu_window:.0f} s later)",
            f"{idle.rss_kb / 1024:.1f} MiB (idle replica)",
            "none given",
            "-",
        )
        subs = sum(int(c.get("sub", 0)) for c in fp.connections)
        summary.add(
            f"pub/sub channels, {n:,} parked", f"{subs:,}", f"{n:,} (one per thread)", "-", "-"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    port = args.port or free_port()
    with contextlib.ExitStack() as stack:
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            log = args.logs
        else:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-replicas-")))
        url = stack.enter_context(private_redis(args.redis_server, port))
        summary = asyncio.run(run(args, url, port, log))
    summary.print()
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
