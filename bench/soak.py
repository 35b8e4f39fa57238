"""A randomized fault soak: real replicas, scripted agents, racing answerers, faults; then a check.

What runs, all on a private redis-server (AOF on, fsynced on every write) started here:

- a fleet of real replica processes (`python -m workers.runtime.cli worker --id NAME`), most holding
  waits in place (`wait_mode=held`, a small held-wait cap so the oldest are parked) and some
  parking every prompt (`wait_mode=parked`), plus the audit worker (`... audit`);
- `--threads` threads of the scripted agent, each sent one job after another. A job asks an
  approval whose command prints a unique marker (`echo MARK-<thread>.<job>`), a single-select,
  multi-select, free-text or several-question prompt, or an approval then a question, then says
  `END <thread>.<job>`;
- people answering through several surfaces at once: typed text (naming the prompt or not),
  structured answers, two surfaces racing on one prompt, an answer naming an old prompt id, a
  cancel, the `prompt-broker answer` command, messages while nothing is asked;
- faults on a random schedule: kill -9 and restart of a replica, SIGSTOP past the lease then
  SIGCONT (sometimes with a pub/sub kill while it is stopped), `CLIENT KILL TYPE pubsub`, kill -9
  of the audit worker, and one kill -9 of Redis restarted from its AOF.

While it runs a sampler reads every open prompt in one MULTI: at most one pending prompt per
thread, the active pointer naming it, and no open prompt left without a live lease holder for
long; and no process of the fleet may exit but by its own fault. After `--seconds` the faults
stop, every process is brought back, the open prompts must all be held by a live replica's
lease, then everything is answered and the run settles. The checker then reads the records, the
items and the logs (see `Checker`). The summary lists the prompts, answers, faults by kind and
violations by kind; the exit status is 1 on any violation.
The seed fixes the scripts, the people's choices and the fault schedule; timing still varies.

    .venv/bin/python bench/soak.py --seed 1 --threads 40 --seconds 60
    .venv/bin/python bench/soak.py --seed 7 --threads 200 --seconds 90 --replicas 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from private_redis import PrivateRedis, free_port
from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import Broker, BrokerError, BrokerUnavailable, Item, Prompt, Settings, StaleAnswer
from broker._codec import item_from_entry
from workers.agents.grants import approves

ROOT = Path(__file__).resolve().parent.parent
LABELS = ["Alpha", "Beta", "Gamma", "Delta"]
#: Log lines that are a violation wherever they appear.
BAD_LOG_LINES = ("Task exception was never retrieved", "pubsub connection not set")
#: What the agent says of a step, by the mark it carries: a command run or refused, an answer
#: (or a question gone unanswered), the end of the job.
MARKER = re.compile(r"^(?:Ran|Did not run) Bash `echo MARK-(\S+) ")
QUESTION = re.compile(r"^(?:The questions? \")?Q0-(\S+) ")
END = re.compile(r"^END (\S+)$")
COMMAND = re.compile(r"echo MARK-(\S+) ")
#: Log events counted for the summary: how the waits went (held, parked, resumed, adopted).
EVENTS = ("turn.", "wait.", "replica.adopted", "replica.lost_thread", "grant.", "waiter.")
#: Seconds an open prompt may go without a live lease holder before it counts as stranded.
STRANDED_AFTER = 10.0
DOWN = (BrokerUnavailable, RedisError, OSError, asyncio.TimeoutError)
#: Whether this checkout's `post_item` takes the surface's name (a checkout before it does not).
SURFACE_NAMES = "surface" in inspect.signature(Broker.post_item).parameters


# -- what each thread's agent does -------------------------------------------------------------


def question(mark: str, i: int, style: str) -> dict[str, Any]:
    q: dict[str, Any] = {"question": f"Q{i}-{mark} {style}", "header": style.rsplit(maxsplit=1)[-1]}
    if style != "say something":
        q["options"] = [{"label": label} for label in LABELS]
        q["multiSelect"] = style == "pick some"
    return q


def job(rng: random.Random, mark: str, ran: Path | None) -> tuple[str, list[dict[str, Any]]]:
    """One job's kind and steps; every text it makes the agent say carries `mark`."""
    kind = rng.choices(
        ["approval", "single", "multi", "free", "several", "approval+ask"], [35, 15, 15, 10, 15, 10]
    )[0]
    steps: list[dict[str, Any]] = []
    if rng.random() < 0.3:  # a turn busy when a fault strikes
        steps.append({"sleep": round(rng.uniform(0.2, 1.0), 2)})
    # The command really runs (`shell`): it prints its marker and appends it to `ran`, so the
    # file, not the agent's word, says how often each approved command ran.
    # (Without `ran`, for a checkout whose agent cannot run commands, the marker is its output.)
    command = f"echo MARK-{mark} | tee -a {ran or '/dev/null'}"
    tool: dict[str, Any] = {"tool": "Bash", "input": {"command": command}}
    tool |= {"shell": True} if ran is not None else {"output": f"MARK-{mark}"}
    styles = {"single": ["pick one"], "multi": ["pick some"], "free": ["say something"]}
    if kind in ("approval", "approval+ask"):
        steps.append(tool)
    if kind in styles:
        steps.append({"ask": [question(mark, 0, styles[kind][0])]})
    if kind in ("several", "approval+ask"):
        n = rng.randint(2, 3) if kind == "several" else 1
        pool = ["pick one", "pick some", "say something"]
        steps.append({"ask": [question(mark, i, rng.choice(pool)) for i in range(n)]})
    steps.append({"say": f"END {mark}"})
    return kind, steps


def script(
    rng: random.Random, thread: str, jobs: int, ran: Path | None
) -> tuple[dict[str, Any], list[str]]:
    """A thread's script: entry k runs on a message holding `[job-k]`; nothing else matches."""
    entries, kinds = [], []
    for k in range(jobs):
        kind, steps = job(rng, f"{thread}.{k}", ran)
        entries.append({"match": f"[job-{k}]", "steps": steps})
        kinds.append(kind)
    return {"turns": entries}, kinds


def text_answer(rng: random.Random, prompt: Prompt) -> str:
    if prompt.kind == "approval":
        return rng.choice(["yes", "approve", "ok"] if rng.random() < 0.7 else ["no", "not now"])
    if all(q.multiSelect for q in prompt.questions):
        return rng.choice(["1, 3", "Alpha, Gamma", "2", "Beta and Delta"])
    return rng.choice(["2", "Gamma", "1", "something else entirely", "4"])


def structured_answer(rng: random.Random, prompt: Prompt) -> list[dict[str, Any]]:
    out = []
    for q in prompt.questions:
        if prompt.kind == "approval":
            labels = ["Approve" if rng.random() < 0.7 else "Deny"]
        elif not q.options:
            labels = [f"typed {rng.randrange(10**6)}"]
        elif q.multiSelect:
            labels = sorted(rng.sample(LABELS, rng.randint(1, 3)), key=LABELS.index)
        else:
            labels = [rng.choice(LABELS)]
        out.append({"question": q.question, "answer": labels})
    return out


def rendered(prompt: Prompt) -> str:
    """What the scripted agent says for an answered question prompt (see
    workers.agents.scripted)."""
    lines = []
    answers = prompt.answers or []
    for i, q in enumerate(prompt.questions):
        labels = ", ".join(answers[i].answer) if i < len(answers) else ""
        lines.append(f"{q.question}: {labels or '(no answer)'}")
    return "\n".join(lines)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    """One process of the fleet; `down` while a fault keeps it down on purpose."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    down: bool = False
    stopped: bool = False
    exits: int = 0  # deaths nobody asked for
    log_at: int = 0

    def spawn(self) -> None:
        self.down = False
        if self.alive():
            return  # never two of one name: the first would run on, unwatched
        with self.log.open("ab") as out:
            self.log_at = out.tell()  # where this incarnation's log begins
            cwd = self.env["PYTHONPATH"]
            self.popen = subprocess.Popen(self.argv, env=self.env, cwd=cwd, stdout=out, stderr=out)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            os.kill(self.popen.pid, sig)


def env_for(settings: Settings, tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    for name, value in settings.model_dump().items():
        text = orjson.dumps(value).decode() if isinstance(value, list | dict) else str(value)
        env[f"PROMPT_BROKER_{name.upper()}"] = text
    env["PYTHONPATH"] = str(tree)  # the code under test: this checkout, or --tree
    return env


# -- the record of what people did -------------------------------------------------------------


@dataclass
class Attempt:
    """One thing a surface did, and what the broker said back."""

    thread: str
    surface: str
    how: str  # text, named-text, structured, race, stale, cancel, cli, message
    target: str | None  # the prompt it meant (named or not)
    outcome: str = ""  # answered, queued, stale, cancelled, none, bad, error
    prompt_id: str | None = None  # what it answered or cancelled
    item_id: str | None = None
    answers: list[dict[str, Any]] | None = None
    sent: list[dict[str, Any]] | None = None  # structured answers sent
    source: str | None = None
    detail: str = ""


@dataclass
class Seen:
    """A prompt the sampler follows until it is resolved."""

    thread: str
    pending: bool = True
    stranded_since: float | None = None


@dataclass
class Violation:
    kind: str
    thread: str
    prompt_id: str | None
    detail: str


@dataclass
class Thread:
    thread_id: str
    kinds: list[str]
    rng: random.Random
    inbox: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    last: str = "0-0"  # the last stream entry read
    prompts: list[str] = field(default_factory=list)
    jobs_started: int = 0


# -- the soak ----------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.folder = folder
        self.server = PrivateRedis(args.redis_server, free_port(), folder / "redis", aof=True)
        self.settings = Settings(
            redis_url=self.server.url,
            key_prefix="pp",
            lease_ttl=args.lease_ttl,
            adopt_interval=0.2,
            sweep_interval=1.0,
            held_waits_max=3,
            audit_grace=3.0,
        )
        self.procs: list[Proc] = []
        self.threads: dict[str, Thread] = {}
        self.seen: dict[str, Seen] = {}
        self.attempts: list[Attempt] = []
        self.violations: list[Violation] = []
        self.reported: set[tuple[str, str]] = set()
        self.faults: Counter[str] = Counter()
        self.timeline: list[str] = []
        self.phase = "run"  # run -> quiet -> settle -> done
        self.started = time.monotonic()
        self.redis_back_at = 0.0
        self.cli = asyncio.Semaphore(2)
        self.samples = 0

    def note(self, what: str) -> None:
        wall = time.strftime("%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        line = f"{time.monotonic() - self.started:7.2f} {wall}Z {what}"
        self.timeline.append(line)
        with (self.folder / "soak.log").open("a") as f:
            f.write(line + "\n")

    def violation(self, kind: str, thread: str, prompt_id: str | None, detail: str) -> None:
        if prompt_id is not None and (kind, prompt_id) in self.reported:
            return  # the sampler sees a standing fault again and again: once is enough
        self.reported.add((kind, prompt_id or ""))
        self.violations.append(Violation(kind, thread, prompt_id, detail))
        self.note(f"VIOLATION {kind} {thread} {prompt_id}: {detail}")

    # -- set-up ----------------------------------------------------------------------------

    async def start(self) -> None:
        (self.folder / "redis").mkdir(parents=True)
        (self.folder / "logs").mkdir()
        (self.folder / "scripts").mkdir()
        await asyncio.to_thread(self.server.start)
        kwargs = {"socket_timeout": 5, "socket_connect_timeout": 2}
        self.observer = Broker.from_url(self.server.url, self.settings, **kwargs)
        self.redis: Redis = self.observer.redis
        self.surfaces = [Broker.from_url(self.server.url, self.settings, **kwargs) for _ in "abc"]
        py = sys.executable
        held = self.args.replicas - self.args.parked_replicas
        for i in range(self.args.replicas):
            mode = "held" if i < held else "parked"
            name = f"{mode}-{i + 1}"
            env = env_for(self.settings.model_copy(update={"wait_mode": mode}), self.args.tree)
            argv = [py, "-m", "workers.runtime.cli", "worker", "--id", name]
            self.procs.append(Proc(name, argv, env, self.folder / "logs" / f"{name}.log"))
        audit_argv = [py, "-m", "workers.runtime.cli", "audit"]
        log = self.folder / "logs" / "audit.log"
        self.procs.append(Proc("audit", audit_argv, env_for(self.settings, self.args.tree), log))
        for p in self.procs:
            p.spawn()
        jobs = int(self.args.seconds) + 20
        for n in range(self.args.threads):
            t = f"soak{n:03d}"
            rng = random.Random(f"{self.args.seed}/{t}/script")
            ran = self.folder / "ran.txt" if self.args.shell else None
            body, kinds = script(rng, t, jobs, ran)
            path = self.folder / "scripts" / f"{t}.json"
            path.write_bytes(orjson.dumps(body))
            config = {"script_file": str(path)}
            await self.observer.sessions.create(t, "scripted", "approval", config)
            self.threads[t] = Thread(t, kinds, random.Random(f"{self.args.seed}/{t}/person"))
        await self.until_replicas_beat(60)

    async def until_replicas_beat(self, within: float) -> None:
        """Until every replica beat within the last lease (server time)."""
        deadline = time.monotonic() + within
        key, ttl = self.observer.keys.replicas, int(self.settings.lease_ttl * 1000)
        while True:
            since = await self.observer.sessions.server_ms() - ttl
            if await self.redis.zcount(key, since, "+inf") >= self.args.replicas:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not come up")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for p in self.procs:
            p.down = True
            if p.stopped:
                p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        for p in self.procs:
            if p.popen is not None:
                try:
                    await asyncio.to_thread(p.popen.wait, 20)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
        for b in [self.observer, *self.surfaces]:
            with contextlib.suppress(Exception):
                await b.aclose()
        await asyncio.to_thread(self.server.stop)

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> None:
        loops = [self.supervise(), self.poll(), self.sample()]
        background = [asyncio.create_task(c) for c in loops]
        faults = asyncio.create_task(self.fault_schedule())
        drivers = [asyncio.create_task(self.drive(t)) for t in self.threads.values()]
        await asyncio.sleep(self.args.seconds)
        self.phase = "quiet"
        self.note("faults stop; every process comes back")
        faults.cancel()
        await asyncio.gather(faults, *drivers, return_exceptions=True)
        await self.restore()
        await self.check_open_prompts_held()
        self.phase = "settle"
        self.note("answering what is open; settling")
        settled = await self.watched(self.settle(), self.args.settle + 30, "settling")
        self.phase = "done"
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if not settled:
            self.violation("not_settled", "-", None, await self.unsettled())

    async def supervise(self) -> None:
        """Start again what died unasked: a violation, since every process of the fleet must
        ride out every fault but its own kill."""
        while True:
            await asyncio.sleep(0.3)
            for p in self.procs:
                if not p.down and not p.alive():
                    code = p.popen.returncode if p.popen else None
                    p.exits += 1
                    with p.log.open("rb") as f:
                        f.seek(p.log_at)
                        mine = f.read().decode(errors="replace").splitlines()
                    last = mine[-12:]
                    if mine and all("cannot reach Redis" in line for line in mine):
                        # Started (after its kill) while Redis was away: it refuses to start,
                        # in one line, as designed; only a running process must ride it out.
                        self.note(f"{p.name} refused to start: Redis unreachable")
                    else:
                        why = f"exited {code} unasked; its log ends:\n" + "\n".join(last)
                        self.violation("exited", p.name, None, why)
                    p.spawn()

    async def restore(self) -> None:
        for p in self.procs:
            if p.stopped:
                p.signal(signal.SIGCONT)
                p.stopped = False
            if not p.alive():
                p.spawn()
        if self.server.proc is None:
            await asyncio.to_thread(self.server.start)
        await self.until_replicas_beat(30)

    # -- faults ----------------------------------------------------------------------------

    def healthy(self) -> list[Proc]:
        return [p for p in self.procs[:-1] if p.alive() and not p.down and not p.stopped]

    async def fault_schedule(self) -> None:
        rng = random.Random(f"{self.args.seed}/faults")
        redis_at = self.started + rng.uniform(0.3, 0.6) * self.args.seconds
        redis_done = self.args.seconds < 15 or self.args.no_redis_kill
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(rng.expovariate(1 / self.args.fault_every))
                if not redis_done and time.monotonic() >= redis_at:
                    redis_done = True
                    kind = "redis_kill9"
                else:
                    kinds = ["replica_kill9", "replica_stop", "pubsub_kill", "audit_kill9"]
                    kind = rng.choices(kinds, [30, 30, 25, 15])[0]
                task = asyncio.create_task(self.fault(kind, random.Random(rng.random())))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def fault(self, kind: str, rng: random.Random) -> None:
        healthy = self.healthy()
        if kind in ("replica_kill9", "replica_stop") and len(healthy) < 2:
            return  # keep one replica serving
        try:
            if kind == "replica_kill9":
                await self.kill_and_restart(rng.choice(healthy), rng.uniform(0.2, 3.0))
            elif kind == "audit_kill9" and not self.procs[-1].down:
                await self.kill_and_restart(self.procs[-1], rng.uniform(0.2, 3.0))
            elif kind == "replica_stop":
                await self.pause(rng.choice(healthy), rng)
            elif kind == "pubsub_kill":
                killed = await self.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                self.note(f"CLIENT KILL TYPE pubsub: {killed}")
            elif kind == "redis_kill9":
                await self.kill_redis(rng.uniform(0.5, 2.0))
            self.faults[kind] += 1
        except DOWN as e:
            self.note(f"fault {kind} not made: {e!r}")

    async def kill_and_restart(self, p: Proc, after: float) -> None:
        p.down = True
        self.note(f"kill -9 {p.name}")
        p.signal(signal.SIGKILL)
        try:
            await asyncio.sleep(after)
        finally:
            self.note(f"start {p.name}")
            p.spawn()

    async def pause(self, p: Proc, rng: random.Random) -> None:
        p.stopped = True
        p.signal(signal.SIGSTOP)
        self.note(f"SIGSTOP {p.name}")
        try:
            if rng.random() < 0.5:
                await asyncio.sleep(0.3)
                killed = await self.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                self.faults["pubsub_kill_while_stopped"] += 1
                self.note(f"CLIENT KILL TYPE pubsub while {p.name} is stopped: {killed}")
            await asyncio.sleep(self.settings.lease_ttl + rng.uniform(0.5, 2.5))
        finally:
            p.signal(signal.SIGCONT)
            p.stopped = False
            self.note(f"SIGCONT {p.name}")

    async def kill_redis(self, down_for: float) -> None:
        self.note("kill -9 redis-server")
        await asyncio.to_thread(self.server.kill)
        await asyncio.sleep(down_for)
        await asyncio.to_thread(self.server.start)
        self.redis_back_at = time.monotonic()
        self.note("redis-server restarted from its AOF")

    # -- watching the threads --------------------------------------------------------------

    async def poll(self) -> None:
        """Read every thread's new items (one pipeline) and hand them to its driver."""
        key = self.observer.thread
        while True:
            await asyncio.sleep(0.2)
            threads = list(self.threads.values())
            try:
                pipe = self.redis.pipeline(transaction=False)
                for t in threads:
                    pipe.xrange(key(t.thread_id).items, f"({t.last}", "+", count=500)
                pages = await pipe.execute()
            except DOWN:
                continue
            for t, page in zip(threads, pages, strict=True):
                for sid, fields in page:
                    t.last = sid
                    item = item_from_entry(sid, fields)
                    if item.type == "pending_prompt":
                        prompt_id = item.metadata["prompt"]["prompt_id"]
                        t.prompts.append(prompt_id)
                        self.seen.setdefault(prompt_id, Seen(t.thread_id))
                    t.inbox.put_nowait(item)

    async def sample(self) -> None:
        """Every 0.3 s, judge a consistent snapshot of every prompt not yet seen resolved."""
        while True:
            await asyncio.sleep(0.3)
            by_thread: dict[str, list[str]] = defaultdict(list)
            for pid, s in self.seen.items():
                if s.pending:
                    by_thread[s.thread].append(pid)
            try:
                now_ms, rows = await self.snapshot(by_thread)
            except DOWN:
                for pids in by_thread.values():
                    for pid in pids:  # nobody can hold anything while Redis is away
                        self.seen[pid].stranded_since = None
                continue
            self.samples += 1
            for t, (active, session, states) in rows.items():
                self.judge(t, dict(zip(by_thread[t], states, strict=True)), active, session, now_ms)

    async def snapshot(
        self, by_thread: dict[str, list[str]]
    ) -> tuple[int, dict[str, tuple[str | None, list[str | None], list[str | None]]]]:
        """In one MULTI (so no script runs in between): the server time, and per thread its
        active pointer, its session's owner, lease and wait, and its prompts' states."""
        tk = self.observer.thread
        pipe = self.redis.pipeline(transaction=True)
        pipe.time()
        # Liveness per replica (`inc|until` records) where this checkout has it, else per thread
        # (the session's own `lease_until`).
        records = getattr(self.observer.keys, "replica_records", None)
        if records:
            pipe.hgetall(records)
        else:
            pipe.echo("")
        for t, pids in by_thread.items():
            pipe.get(tk(t).active)
            pipe.hmget(tk(t).session, ["owner", "lease_until", "inc", "wait"])
            for pid in pids:
                pipe.hget(tk(t).prompt(pid), "state")
        replies = await pipe.execute()
        now_ms = int(replies[0][0]) * 1000 + int(replies[0][1]) // 1000
        alive = replies[1] or {}
        rows, at = {}, 2
        for t, pids in by_thread.items():
            owner, until, inc, wait = replies[at + 1]
            if inc is not None:  # the holder's record says how long it lives
                rec_inc, _, rec_until = str(alive.get(owner) or "").partition("|")
                until = rec_until if rec_inc == inc else None
            rows[t] = (replies[at], [owner, until, wait], replies[at + 2 : at + 2 + len(pids)])
            at += 2 + len(pids)
        return now_ms, rows

    def judge(
        self,
        t: str,
        states: dict[str, str | None],
        active: str | None,
        session: list[str | None],
        now_ms: int,
    ) -> None:
        """One pending prompt at most, the lock naming it, and a live lease holding it."""
        pending = [pid for pid, state in states.items() if state == "pending"]
        for pid, state in states.items():
            self.seen[pid].pending = state not in ("answered", "cancelled")
        if len(pending) > 1:
            self.violation("two_pending", t, pending[0], f"pending at once: {pending}")
        if pending and active != pending[-1]:
            self.violation("lock_mismatch", t, pending[-1], f"active is {active!r}")
        owner, until, wait = session
        waits_on = orjson.loads(wait)["prompt_id"] if wait else None
        replicas = {p.name for p in self.procs[:-1]}
        held = owner in replicas and int(until or 0) > now_ms and waits_on in pending
        self.stranded(t, pending, held)

    def stranded(self, thread: str, pending: list[str], held: bool) -> None:
        now = time.monotonic()
        for pid in pending:
            s = self.seen[pid]
            if held or now - self.redis_back_at < STRANDED_AFTER:
                s.stranded_since = None
            elif s.stranded_since is None:
                s.stranded_since = now
            elif now - s.stranded_since > STRANDED_AFTER:
                self.violation(
                    "stranded",
                    thread,
                    pid,
                    f"no live lease holder for {now - s.stranded_since:.1f} s",
                )
                s.stranded_since = None

    async def check_open_prompts_held(self) -> None:
        """At a quiet point, with every process back: every open prompt is held by a running
        replica's lease and its session waits on it (adoption may take a few leases' time)."""
        deadline = time.monotonic() + 3 * self.settings.lease_ttl + 10
        running = {p.name for p in self.procs[:-1] if p.alive() and not p.stopped}
        while True:
            await asyncio.sleep(self.settings.lease_ttl)
            unheld = await self.unheld(running)
            if not unheld or time.monotonic() > deadline:
                break
        for thread, pid, why in unheld:
            self.violation("open_unheld", thread, pid, why)

    async def unheld(self, running: set[str]) -> list[tuple[str, str, str]]:
        out = []
        now = await self.observer.sessions.server_ms()
        for member in await self.observer.indexes.open.members(self.redis):
            thread, pid = self.observer.keys.split_member(member)
            try:
                prompt = await self.observer.get_prompt(thread, pid)
            except BrokerError:
                continue
            s = await self.observer.sessions.get(thread)
            if prompt.state != "pending" or s is None:
                continue
            until = int(s.lease_until.timestamp() * 1000) if s.lease_until else 0
            waits = s.waiting.prompt_id if s.waiting else None
            if s.owner not in running or until <= now or waits != pid:
                out.append(
                    (thread, pid, f"owner {s.owner!r}, lease {until - now} ms, waits {waits}")
                )
        return out

    # -- people ----------------------------------------------------------------------------

    async def drive(self, t: Thread) -> None:
        """Send the thread job after job; answer whatever it asks; now and then chat."""
        while self.phase == "run" and t.jobs_started < len(t.kinds):
            k = t.jobs_started
            t.jobs_started += 1
            await self.message(t, f"[job-{k}] please")
            await self.follow(t, f"{t.thread_id}.{k}")
            if t.rng.random() < 0.15:
                await self.message(t, "just checking in, no rush")

    async def follow(self, t: Thread, mark: str) -> None:
        """Answer the thread's prompts until the job says END, its turn ends badly, or nothing
        happens for a while (a turn cut off before it asked anything)."""
        idle = 0.0
        while self.phase == "run" and idle < 15:
            try:
                item = await asyncio.wait_for(t.inbox.get(), 1.0)
            except TimeoutError:
                idle += 1.0
                continue
            idle = 0.0
            if item.type == "pending_prompt":
                await self.answer(t, item.metadata["prompt"]["prompt_id"])
            elif self.job_over(item, mark):
                return

    @staticmethod
    def job_over(item: Item, mark: str) -> bool:
        if item.type == "agent_output":
            return item.text == f"END {mark}" or item.text.startswith("(the turn was interrupted")
        return item.type == "turn_end" and item.metadata.get("status") == "failed"

    async def message(self, t: Thread, words: str) -> None:
        await self.post(Attempt(t.thread_id, "a", "message", None), {"content": _text(words)})

    async def answer(self, t: Thread, prompt_id: str) -> None:
        """Answer one prompt as people might: after a pause (held or parked by then), through
        one surface, or two racing, or after a try with an old prompt's id; or cancel it."""
        rng = t.rng
        delay = rng.choice([0, 0, rng.uniform(0, 1), rng.uniform(1, 4), rng.uniform(4, 8)])
        await asyncio.sleep(delay)
        try:
            prompt = await self.observer.get_prompt(t.thread_id, prompt_id)
        except (*DOWN, BrokerError):
            return
        how = rng.choices(
            ["text", "named-text", "structured", "race", "stale", "cancel", "cli"],
            [15, 25, 20, 15, 10, 7, 8 if self.args.cli else 0],
        )[0]
        s1, s2 = rng.sample(["a", "b", "c"], 2)
        if how == "stale":
            how = "named-text"
            earlier = t.prompts[: t.prompts.index(prompt_id)] if prompt_id in t.prompts else []
            if earlier:  # resolved before this one was asked: never the active prompt
                old = rng.choice(earlier)
                await self.post(Attempt(t.thread_id, s1, "stale", old), self.item(rng, prompt, old))
        if how == "race":
            other = (
                self.cancel(Attempt(t.thread_id, s2, "race-cancel", prompt_id))
                if rng.random() < 0.25
                else self.post(
                    Attempt(t.thread_id, s2, "race", prompt_id),
                    self.item(rng, prompt, prompt_id, structured=True),
                )
            )
            mine = self.post(
                Attempt(t.thread_id, s1, "race", prompt_id), self.item(rng, prompt, prompt_id)
            )
            await asyncio.gather(mine, other)
        elif how == "cancel":
            await self.cancel(Attempt(t.thread_id, s1, "cancel", prompt_id))
        elif how == "cli":
            await self.answer_by_cli(t, prompt)
        else:
            named = how != "text"
            item = self.item(
                rng, prompt, prompt_id if named else None, structured=how == "structured"
            )
            await self.post(Attempt(t.thread_id, s1, how, prompt_id), item)

    def item(
        self, rng: random.Random, prompt: Prompt, named: str | None, *, structured: bool = False
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"prompt_id": named} if named else {}
        if structured:
            meta["answers"] = structured_answer(rng, prompt)
            return {"content": [], "metadata": meta}
        return {"content": _text(text_answer(rng, prompt)), "metadata": meta}

    async def post(self, a: Attempt, item: dict[str, Any]) -> None:
        """Post as a person would. Through a Redis outage only an item naming its prompt is
        retried: if the first try took effect, the retry is refused as stale. A message is not
        (it might be queued twice, and its job run twice, which is no fault of the broker's)."""
        b = self.surfaces["abc".index(a.surface)]
        a.sent = item.get("metadata", {}).get("answers")
        self.attempts.append(a)
        tries = 30 if item.get("metadata", {}).get("prompt_id") else 1
        for _ in range(tries):
            try:
                routed = await b.post_item(a.thread, item, **self.surface(a))
            except StaleAnswer as e:
                a.outcome, a.detail = "stale", e.state
            except BrokerError as e:
                if isinstance(e, BrokerUnavailable):
                    a.outcome, a.detail = "error", repr(e)
                    await asyncio.sleep(0.5)
                    continue
                a.outcome, a.detail = "bad", str(e)
            except DOWN as e:
                a.outcome, a.detail = "error", repr(e)
                await asyncio.sleep(0.5)
                continue
            else:
                a.outcome, a.item_id, a.prompt_id = routed.outcome, routed.item_id, routed.prompt_id
                a.answers = [x.model_dump() for x in routed.answers or []] or None
                a.source = routed.source
            return

    @staticmethod
    def surface(a: Attempt) -> dict[str, str]:
        """Name the surface to the broker, where it takes a name (the audit item then says it)."""
        return {"surface": f"soak-{a.surface}"} if SURFACE_NAMES else {}

    async def cancel(self, a: Attempt) -> None:
        b = self.surfaces["abc".index(a.surface)]
        self.attempts.append(a)
        for _ in range(30):
            try:
                cancelled = await b.cancel(
                    a.thread, "soak: cancelled by a person", prompt_id=a.target
                )
            except DOWN as e:
                a.outcome, a.detail = "error", repr(e)
                await asyncio.sleep(0.5)
                continue
            a.outcome = "cancelled" if cancelled is not None else "none"
            a.prompt_id = cancelled.prompt_id if cancelled is not None else None
            return

    async def answer_by_cli(self, t: Thread, prompt: Prompt) -> None:
        """`prompt-broker answer THREAD TEXT --prompt ID --json`, as a person at a shell."""
        a = Attempt(t.thread_id, "cli", "cli", prompt.prompt_id)
        self.attempts.append(a)
        words = text_answer(t.rng, prompt)
        argv = [sys.executable, "-m", "workers.runtime.cli", "answer", t.thread_id, words]
        argv += ["--prompt", prompt.prompt_id, "--json"]
        async with self.cli:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env_for(self.settings, self.args.tree),
                cwd=self.args.tree,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await proc.communicate()
        if proc.returncode == 0:
            routed = orjson.loads(out)
            a.outcome, a.item_id, a.prompt_id = (
                routed["outcome"],
                routed["item_id"],
                routed["prompt_id"],
            )
            a.answers, a.source = routed.get("answers"), routed.get("source")
        else:
            stale = b"is answered" in err or b"is cancelled" in err
            a.outcome, a.detail = "stale" if stale else "error", err.decode(errors="replace")
            if not stale:
                self.note(f"prompt-broker answer failed: {a.detail.strip()[-300:]}")

    # -- settling --------------------------------------------------------------------------

    async def watched(self, step: Coroutine[Any, Any, bool], limit: float, what: str) -> bool:
        """Run `step`, allowed `limit` seconds: a step whose own deadline passed long ago is
        stuck in a call that never returned, which is a violation (its stack is the evidence,
        and every task's is in tasks.txt); the run then goes on to its report."""
        task = asyncio.create_task(step)
        done, _ = await asyncio.wait({task}, timeout=limit)
        if done:
            return task.result()
        _dump_tasks(self.folder)
        why = f"{what} made no progress in {limit:.0f} s:\n{_awaiting(task)}"
        self.violation("stuck", "-", None, why)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False

    async def settle(self) -> bool:
        """Answer every open prompt at once until nothing is open, running or unaudited."""
        deadline = time.monotonic() + self.args.settle
        rng = random.Random(f"{self.args.seed}/settle")
        while time.monotonic() < deadline:
            try:
                for p in await self.observer.open_prompts():
                    await self.post(
                        Attempt(p.thread_id, "a", "settle", p.prompt_id),
                        {
                            "content": _text(text_answer(rng, p)),
                            "metadata": {"prompt_id": p.prompt_id},
                        },
                    )
                if not await self.unsettled():
                    return True
            except DOWN:
                pass
            await asyncio.sleep(1.0)
        return False

    async def unsettled(self) -> str:
        """What is still moving: sessions not idle, inboxes, open or unaudited prompts."""
        busy = []
        for t in self.threads:
            s = await self.observer.sessions.get(t)
            if s is None or s.status != "idle" or s.waiting is not None:
                busy.append(f"{t}: {s.status if s else 'no session'}")
            elif await self.redis.llen(self.observer.thread(t).inbox):
                busy.append(f"{t}: inbox")
        # The records decide, not the indexes (an ask cut off by an outage can leave an index
        # entry with no record behind it).
        open_ = len(await self.observer.open_prompts())
        pipe = self.redis.pipeline(transaction=False)
        for pid, seen in self.seen.items():
            pipe.hmget(self.observer.thread(seen.thread).prompt(pid), ["state", "audit_item"])
        rows = await pipe.execute()
        unaudited = sum(1 for state, item in rows if state != "pending" and not item)
        if busy or unaudited or open_:
            return f"{open_} open, {unaudited} unaudited, busy: {busy[:10]}"
        return ""


def _mark(text: str) -> str | None:
    found = COMMAND.search(text)
    return found[1] if found else None


def _event(line: str) -> dict[str, Any]:
    if not line.startswith("{"):
        return {}
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {}  # a line cut short by a kill -9
    return event if isinstance(event, dict) else {}


def _labels(answers: list[dict[str, Any]]) -> list[list[str]]:
    return [a["answer"] for a in answers]


def _text(words: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": words}]


# -- the checker --------------------------------------------------------------------------------


class Checker:
    """Everything the records, the items and the logs must say after a soak.

    - no answer lost: every answer a surface was told it made is the prompt's recorded answer
      (same item, same answers; structured ones as sent), and every answered prompt was delivered;
    - none resolved twice: at most one answer or cancel acknowledged per prompt;
    - exactly one `pending_prompt_resolved` per resolved prompt, naming its kind and state with
      its answers or reason, and it is the item the record points at; none for an undelivered one;
    - at most one `approval_granted` per prompt, and only for a prompt whose answer approved;
    - each approved command ran at most once (its marker in the file it appends to), and only
      after an answer approving it was delivered;
    - no marker, question answer or END line said twice; what the agent says of an answer is
      what some delivered answer to that step says; no interruption told more often than turns
      were cut off;
    - no answer handed over twice by the logs (a held delivery or a resume turn);
    - no log line of `BAD_LOG_LINES` in any process's log.

    The sampler's checks (one pending prompt per thread, the lock naming it, a live lease holding
    every open prompt) run during the soak, in `Soak.judge` and `Soak.check_open_prompts_held`.
    """

    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.b = soak.observer
        self.prompts: dict[str, Prompt] = {}
        self.items: dict[str, list[Item]] = {}
        self.lines_checked = 0
        self.audit_items: dict[str, dict[str, Any]] = {}  # item id -> metadata
        self.index_dangling: list[str] = []
        self.commands_run = 0
        self.events: Counter[str] = Counter()

    def bad(self, kind: str, thread: str, prompt_id: str | None, detail: str) -> None:
        self.soak.violation(kind, thread, prompt_id, detail)

    async def read(self) -> None:
        for t in self.soak.threads:
            self.items[t] = await self.b.items(t)
            for i in self.items[t]:
                if i.type == "pending_prompt_resolved":
                    self.audit_items[i.id] = i.metadata
                if i.type == "pending_prompt":
                    pid = i.metadata["prompt"]["prompt_id"]
                    self.prompts[pid] = await self.b.get_prompt(t, pid)

    def answers(self) -> None:
        acked: dict[str, list[Attempt]] = defaultdict(list)
        for a in self.soak.attempts:
            if a.outcome in ("answered", "cancelled") and a.prompt_id:
                acked[a.prompt_id].append(a)
        for pid, got in acked.items():
            p = self.prompts.get(pid)
            if p is None:
                self.bad("lost", got[0].thread, pid, "acknowledged, but the thread never asked it")
                continue
            if len(got) > 1:
                said = [(a.how, a.surface, a.outcome) for a in got]
                self.bad("resolved_twice", p.thread_id, pid, f"acknowledged {len(got)}x: {said}")
            for a in got:
                self.acknowledged(p, a)
        for p in self.prompts.values():
            if p.state == "answered" and p.delivered_at is None:
                self.bad("lost", p.thread_id, p.prompt_id, "answered, never delivered")

    def acknowledged(self, p: Prompt, a: Attempt) -> None:
        """What a surface was told it did is what the record says."""
        if a.outcome == "cancelled":
            if p.state != "cancelled":
                self.bad("lost", p.thread_id, p.prompt_id, f"cancel acknowledged, now {p.state}")
            return
        recorded = [x.model_dump() for x in p.answers or []]
        if p.state != "answered" or p.answer_item_id != a.item_id or recorded != a.answers:
            why = f"{a.how} answer {a.item_id} {a.answers} acknowledged; the record: "
            self.bad(
                "lost", p.thread_id, p.prompt_id, f"{why}{p.state} {p.answer_item_id} {recorded}"
            )
        elif a.source == "structured" and a.sent and _labels(a.sent) != _labels(recorded):
            self.bad("lost", p.thread_id, p.prompt_id, f"sent {a.sent}, recorded {recorded}")
        elif SURFACE_NAMES and a.surface in "abc" and p.audit_item_id:
            said = self.audit_items.get(p.audit_item_id, {}).get("surface")
            if said != f"soak-{a.surface}":
                why = f"answered through soak-{a.surface}; the audit item says {said!r}"
                self.bad("audit_fields", p.thread_id, p.prompt_id, why)

    def audit(self) -> None:
        resolved: dict[str, list[Item]] = defaultdict(list)
        for items in self.items.values():
            for i in items:
                if i.type == "pending_prompt_resolved":
                    resolved[i.metadata["prompt"]["prompt_id"]].append(i)
        for pid, p in self.prompts.items():
            got = resolved.pop(pid, [])
            due = p.state == "cancelled" or (p.state == "answered" and p.delivered_at is not None)
            if len(got) != (1 if due else 0):
                why = f"{len(got)} resolution items; {p.state}, delivered {p.delivered_at}"
                self.bad("audit_count", p.thread_id, pid, why)
            elif got:
                self.audited_as(p, got[0])
        for pid, got in resolved.items():
            self.bad("audit_count", "?", pid, f"{len(got)} resolution items of an unknown prompt")

    def audited_as(self, p: Prompt, item: Item) -> None:
        """The resolution item says what the record says, and is the one it points at."""
        want: dict[str, Any] = {"prompt_id": p.prompt_id, "kind": p.kind, "prompt_state": p.state}
        if p.state == "answered":
            want["answers"] = [a.model_dump() for a in p.answers or []]
        else:
            want["reason"] = p.reason
        meta = item.metadata["prompt"]
        if meta != want or item.id != p.audit_item_id:
            why = f"item {item.id} {meta}; record {p.audit_item_id} {want}"
            self.bad("audit_fields", p.thread_id, p.prompt_id, why)

    def grants(self) -> None:
        for t, items in self.items.items():
            by = Counter(
                i.metadata.get("granted_by") for i in items if i.type == "approval_granted"
            )
            for pid, n in by.items():
                p = self.prompts.get(str(pid))
                if n > 1:
                    self.bad("granted_twice", t, pid, f"{n} approval_granted items")
                if p is None or p.state != "answered" or not approves(p.answers):
                    why = f"granted by a prompt that did not approve: {p and p.answers}"
                    self.bad("grant_unearned", t, pid, why)

    def outputs(self) -> None:
        """Each step's lines said at most once; each line about an answer true to one that was
        delivered for that step."""
        for t, items in self.items.items():
            lines = [i.text for i in items if i.type == "agent_output"]
            delivered = [p for p in self.prompts.values() if p.thread_id == t and p.delivered_at]
            said: Counter[str] = Counter()
            for line in lines:
                said.update(f"marker {m}" for m in MARKER.findall(line))
                said.update(f"answer to {m}" for m in QUESTION.findall(line))
                said.update(f"end of {m}" for m in END.findall(line))
                if not self.true_to(line, delivered):
                    self.bad("wrong_answer", t, None, f"{line!r}: no delivered answer says so")
                self.lines_checked += 1
            for what, n in said.items():
                if n > 1:
                    self.bad("said_twice", t, None, f"{what} said {n} times")
            # A cut-off turn is reported once and its next turn tells the agent once.
            cut = sum(1 for x in lines if x.startswith("(the turn was interrupted"))
            told = sum(1 for x in lines if x.startswith("My previous turn was interrupted"))
            if told > cut:
                self.bad("told_twice", t, None, f"{told} tells of {cut} interrupted turns")

    @staticmethod
    def true_to(line: str, delivered: list[Prompt]) -> bool:
        """A line about an answer says what a delivered answer to its step said."""
        step = MARKER.match(line)
        if step is not None and (line.startswith("Ran") or "the person denied it" in line):
            ran = line.startswith("Ran")
            return any(
                p.kind == "approval"
                and _mark(p.questions[0].question) == step[1]
                and approves(p.answers) == ran
                for p in delivered
            )
        if line.startswith("Q0-"):
            return any(rendered(p) == line for p in delivered if p.kind == "ask_user_question")
        return True

    def runs(self) -> None:
        """Each approved command ran at most once (by the file it appends to), and only after
        a delivered answer approved it."""
        path = self.soak.folder / "ran.txt"
        ran = Counter(path.read_text().split()) if path.exists() else Counter()
        approved = {
            _mark(p.questions[0].question)
            for p in self.prompts.values()
            if p.kind == "approval" and p.delivered_at and approves(p.answers)
        }
        for marker, n in ran.items():
            mark = marker.removeprefix("MARK-")
            thread = mark.rpartition(".")[0]
            if n > 1:
                self.bad("ran_twice", thread, None, f"`echo {marker}` ran {n} times")
            if mark not in approved:
                self.bad("ran_unapproved", thread, None, f"`echo {marker}` ran, never approved")
        self.commands_run = sum(ran.values())

    def logs(self) -> None:
        """The bad lines, and each hand-over of an answer: a held wait's first delivery record
        or a resume turn (the same events tests/runtime/test_crash.py counts)."""
        handed: Counter[str] = Counter()
        for path in sorted((self.soak.folder / "logs").glob("*.log")):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for bad in BAD_LOG_LINES:
                    if bad in line:
                        self.bad("log", path.stem, None, f"{path.name}:{n}: {line[:200]}")
                event = _event(line)
                name = event.get("event")
                if isinstance(name, str) and name.startswith(EVENTS):
                    self.events[name] += 1
                if (name == "prompt.delivered" and event.get("first")) or name == "turn.resume":
                    handed[str(event.get("prompt_id"))] += 1
        for pid, n in handed.items():
            if n > 1:
                thread = p.thread_id if (p := self.prompts.get(pid)) else "?"
                self.bad("handed_twice", thread, pid, f"handed to an agent {n} times (logs)")

    async def dangling(self) -> list[str]:
        """`open` index entries with no pending record behind them (the records decide, so
        this is a figure, not a violation: nobody is shown such a prompt)."""
        out = []
        for member in await self.b.indexes.open.members(self.b.redis):
            pid = self.b.keys.split_member(member)[1]
            if self.prompts.get(pid) is None or self.prompts[pid].state != "pending":
                out.append(member)
        return out

    async def check(self) -> None:
        await self.read()
        self.index_dangling = await self.dangling()
        self.answers()
        self.audit()
        self.grants()
        self.outputs()
        self.runs()


# -- the report --------------------------------------------------------------------------------


def summary(soak: Soak, checker: Checker, took: float) -> dict[str, Any]:
    outcomes = Counter(f"{a.how}:{a.outcome}" for a in soak.attempts)
    states = Counter(p.state for p in checker.prompts.values())
    return {
        "seed": soak.args.seed,
        "threads": soak.args.threads,
        "seconds": soak.args.seconds,
        "replicas": soak.args.replicas,
        "took_s": round(took, 1),
        "jobs": sum(t.jobs_started for t in soak.threads.values()),
        "jobs_by_kind": dict(
            Counter(k for t in soak.threads.values() for k in t.kinds[: t.jobs_started])
        ),
        "prompts": len(checker.prompts),
        "prompt_states": dict(states),
        "delivered": sum(1 for p in checker.prompts.values() if p.delivered_at),
        "answers": sum(1 for a in soak.attempts if a.outcome == "answered"),
        "cancels": sum(1 for a in soak.attempts if a.outcome == "cancelled"),
        "attempts": dict(sorted(outcomes.items())),
        "approvals_granted": sum(
            1 for items in checker.items.values() for i in items if i.type == "approval_granted"
        ),
        "faults": dict(sorted(soak.faults.items())),
        "unasked_exits": {p.name: p.exits for p in soak.procs if p.exits},
        "samples": soak.samples,
        "output_lines_checked": checker.lines_checked,
        "commands_run": checker.commands_run,
        "open_index_dangling": checker.index_dangling,
        "events": dict(sorted(checker.events.items())),
        "violations": dict(Counter(v.kind for v in soak.violations)),
    }


def evidence(soak: Soak, checker: Checker) -> Path:
    """Each violation with its thread's items and every log line naming its prompt or thread."""
    path = soak.folder / "violations.txt"
    logs = {
        p.name: p.read_text(errors="replace").splitlines()
        for p in (soak.folder / "logs").glob("*.log")
    }
    with path.open("w") as out:
        for v in soak.violations[:30]:
            out.write(f"\n=== {v.kind} thread={v.thread} prompt={v.prompt_id}\n{v.detail}\n")
            for i in checker.items.get(v.thread, []):
                out.write(
                    f"  item {i.id} {i.type or 'message':24} {i.author:14} {i.text[:160]!r}\n"
                )
            needle = v.prompt_id or f'"thread_id":"{v.thread}"'
            for name, lines in logs.items():
                out.writelines(f"  {name}: {line[:400]}\n" for line in lines if needle in line)
        out.write("\n=== timeline\n" + "\n".join(soak.timeline) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=40)
    p.add_argument("--seconds", type=float, default=60, help="how long faults and jobs run")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--parked-replicas", type=int, default=1, help="of --replicas, wait_mode=parked")
    p.add_argument("--lease-ttl", type=float, default=2.0)
    p.add_argument("--fault-every", type=float, default=2.5, help="mean seconds between faults")
    p.add_argument("--no-redis-kill", action="store_true", help="skip the one Redis kill -9")
    p.add_argument("--no-cli", dest="cli", action="store_false", help="no `prompt-broker answer`")
    p.add_argument(
        "--no-shell",
        dest="shell",
        action="store_false",
        help="approved commands do not really run (for a checkout whose scripted agent cannot)",
    )
    p.add_argument("--settle", type=float, default=120, help="seconds allowed to settle")
    p.add_argument("--folder", type=Path, default=None, help="keep logs and records here")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument(
        "--tree",
        type=Path,
        default=ROOT,
        help="run the replicas, the audit worker and the CLI from this checkout (default: ours)",
    )
    p.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    args = p.parse_args(argv)
    if not 1 <= args.parked_replicas < args.replicas:
        p.error("--parked-replicas: at least 1, and fewer than --replicas")
    return args


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a task waits: each coroutine it awaits, outermost first, down to the future."""
    lines, coro = [repr(task)], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        inner = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        if inner is None or not hasattr(inner, "cr_frame"):
            lines.append(f"  awaiting {inner!r}")
            break
        coro = inner
    return "\n".join(lines)


def _dump_tasks(folder: Path) -> None:
    """Write where every asyncio task waits to `tasks.txt` in the folder (also on SIGUSR1):
    where a run that stopped moving is stuck."""
    with (folder / "tasks.txt").open("a") as f:
        f.write(f"-- {time.strftime('%H:%M:%S')} --\n")
        for task in asyncio.all_tasks():
            f.write(_awaiting(task) + "\n")


async def main_async(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    soak = Soak(args, folder)
    began = time.monotonic()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks, folder)
    try:
        await soak.start()
        await soak.run()
        checker = Checker(soak)
        await checker.check()
    finally:
        await soak.stop()
    checker.logs()
    result = summary(soak, checker, time.monotonic() - began)
    result["folder"] = str(folder)
    if soak.violations:
        result["evidence"] = str(evidence(soak, checker))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    print(f"soak: {command}\n  logs and records in {folder}", flush=True)
    result = asyncio.run(main_async(args, folder))
    result["command"] = command
    for key, value in result.items():
        print(f"  {key}: {value}")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    bad = sum(result["violations"].values())
    print(f"soak: {'FAILED, ' + str(bad) + ' violations' if bad else 'no violations'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
