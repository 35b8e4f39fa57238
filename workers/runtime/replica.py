"""A replica: holds threads by lease, runs their agents' turns, waits held or parked, adopts.

One replica process runs many agent sessions against the shared Redis. Its loops:

- **heartbeat**: every `lease_ttl / 3`, one write proves this replica's incarnation alive for
  `lease_ttl` more (its replica record), whatever it holds: a thread's lease is its holder's
  liveness. A beat that finds the record expired (this process was paused past its deadline) or
  taken by another incarnation drops every thread at once, touching nothing, and joins again as
  a new incarnation.
- **adopt**: every `adopt_interval`, read the replica records and claim a fair share of the
  threads that have no live holder (a replica's record expired, a thread was released by a clean
  stop or freed by a restart, or it is new), in pipelined pages. A claim bumps the thread's
  fencing epoch.
- **examine**: whenever a thread's bell rings (an item queued, a prompt resolved) and no turn of
  it is running here, read its records and do what they say: resume a parked turn whose prompt
  was answered, adopt a dead replica's open prompt as parked, report a turn that was cut off, or
  start a turn for queued messages. Nothing is re-read on a timer: a bell can only be missed
  while the pub/sub connection is down, and its resubscription has the threads looked at (in
  pipelined batches: only those with something to do are examined); a look that failed on a
  Redis error is tried again later.

Nothing is handed to an agent twice. A held answer (deliver.lua) and a parked one taken into a
resume turn (resume.lua, which also mints the approval's one-shot grant) are each marked
delivered in one step under the holder's epoch, once per prompt, ever. A turn cut off after that
(its replica killed, paused past its lease, or cut off from Redis) is never replayed: whoever next
holds the thread posts one item saying so, with the answer it had been handed and what its harness
knows of the call in flight (interrupt.lua, which also ends the turn, so the item is posted once),
and the next turn tells its agent the same before anything else (`Turn.interrupted`).

Waits: an agent's `ask` blocks in place (held) until answered; past `held_waits_max` held waits
the oldest is demoted to parked: its turn ends, the prompt stays open, and its answer starts a
resume turn. A clean stop (SIGTERM) demotes every held wait and releases every lease; it never
cancels a prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.exceptions import RedisError
from ulid import ULID

from broker import (
    Answer,
    BadItem,
    Broker,
    BrokerError,
    BrokerUnavailable,
    Fenced,
    Grant,
    Kind,
    Prompt,
    PromptNotFound,
    Question,
    Session,
    Settings,
    ThreadClosed,
)
from broker.sessions import delivery_token
from workers.agents import policy
from workers.agents.grants import approves, covers, resume_text
from workers.agents.harness import (
    Gate,
    GateVerdict,
    Harness,
    Interruption,
    PromptParked,
    Resume,
    Turn,
    TurnResult,
    describe_delivered,
)

# A harness's durable session data: compressed, and expiring with its closed thread.
from workers.runtime.agent_store import AgentStore as _Store

logger = logging.getLogger("workers.runtime.replica")

__all__ = ["Replica", "default_harnesses"]

OUTPUT = "agent_output"
#: The reason a prompt still open when its turn completed is cancelled with.
RUN_ENDED = "the run ended"
#: A thread whose lease ran out this long ago is taken by any replica, however loaded.
URGENT_MS = 500
#: Expired leases one adoption look takes; a full page means more wait: look again at once.
ADOPT_PAGE = 1000


def default_harnesses() -> dict[str, Harness]:
    from workers.agents.codex import CodexHarness
    from workers.agents.scripted import ScriptedHarness

    harnesses: dict[str, Harness] = {"scripted": ScriptedHarness(), "codex": CodexHarness()}
    try:  # the `claude` extra: only when claude-agent-sdk is installed
        from workers.agents.claude import ClaudeHarness
    except ImportError:
        pass
    else:
        harnesses["claude_code"] = ClaudeHarness()
    return harnesses


class _Lost(Exception):
    """This replica no longer holds the thread: stop, and write nothing more for it."""


@dataclass
class _Thread:
    """A thread this replica holds."""

    thread_id: str
    epoch: int
    task: asyncio.Task[None] | None = None
    kicked: bool = False
    listener: Any = None
    # claimed, its first look not done yet: that look (after its SUBSCRIBE is confirmed) covers
    # whatever a subscription confirmation might say was missed
    fresh: bool = True
    # prompt -> the token of a resume attempt whose reply never came: its retry reuses it, so a
    # lost reply is the same delivery, not a refused second one
    tokens: dict[str, str] = field(default_factory=dict)


@dataclass
class _HeldWait:
    thread_id: str
    prompt_id: str
    kind: str
    subject: str
    demoted: asyncio.Event = field(default_factory=asyncio.Event)


class Replica:
    """One replica process's worth of agent sessions."""

    def __init__(
        self,
        broker: Broker,
        harnesses: Mapping[str, Harness] | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.broker = broker
        self.settings: Settings = broker.settings
        self.harnesses = dict(harnesses) if harnesses is not None else default_harnesses()
        self.id = replica_id or f"{socket.gethostname()}-{os.getpid()}-{str(ULID())[-6:]}"
        self.threads: dict[str, _Thread] = {}
        self._held: OrderedDict[str, _HeldWait] = OrderedDict()  # by thread, oldest first
        self._slots = asyncio.Semaphore(self.settings.max_turns)
        self._kicks: set[str] = set()
        self._kick_event = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.ttl_ms = int(self.settings.lease_ttl * 1000)
        self.incarnation = ""  # set by `join`: a new one for every start
        self._suspects: set[str] = set()
        self._suspect_event = asyncio.Event()
        # The worker's own policy rules: a malformed one stops the replica before it starts.
        self.policy_rules = policy.parse_rules(
            self.settings.policy_rules, "PROMPT_BROKER_POLICY_RULES", "worker"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set, then stop cleanly (see `shutdown`)."""
        await self._join()
        logger.info("replica.started", extra={"replica": self.id, "incarnation": self.incarnation})
        self._tasks = [
            asyncio.create_task(
                self._loop(self._adopt, self.settings.adopt_interval), name="adopt"
            ),
            asyncio.create_task(
                self._loop(self._heartbeat, self.settings.lease_ttl / 3), name="beat"
            ),
            asyncio.create_task(self._suspect_loop(), name="sweep"),
            asyncio.create_task(self._kick_loop(), name="kicks"),
        ]
        try:
            await stop.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Park every held wait, let turns settle (bounded), release every lease. Never cancels
        a prompt: the next replica adopts them as they are."""
        if self._stopping:
            return
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for held in list(self._held.values()):
            held.demoted.set()
        turns = [t.task for t in self.threads.values() if t.task is not None and not t.task.done()]
        if turns:
            _, pending = await asyncio.wait(turns, timeout=self.settings.shutdown_grace)
            for task in pending:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait(pending, timeout=1)
        released = 0
        epochs = {t.thread_id: t.epoch for t in self.threads.values()}
        with contextlib.suppress(BrokerError, OSError, ConnectionError):
            released = await self.broker.sessions.release_all(self.id, self.incarnation, epochs)
        logger.info("replica.stopped", extra={"replica": self.id, "released": released})

    async def _loop(self, step: Any, interval: float) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica.loop_failed", extra={"loop": step.__name__})
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))

    # -- leases ------------------------------------------------------------------------------

    async def _adopt(self) -> None:
        # Each page's threads are subscribed to and looked at while the next page is claimed.
        attaching: list[asyncio.Task[None]] = []
        try:
            while not self._stopping and await self._adopt_page(ADOPT_PAGE, attaching):
                pass
        finally:
            if attaching:
                await asyncio.gather(*attaching, return_exceptions=True)

    async def _join(self) -> None:
        """Start a new incarnation; free what former ones of this id held (dead now): the one
        on the record, and this process's own last one (its record may be gone already)."""
        sessions = self.broker.sessions
        previous = self.incarnation
        self.incarnation, _, former = await sessions.join(self.id, self.ttl_ms)
        for old in {former, previous} - {""}:
            freed = await sessions.free(self.id, old)
            logger.info("replica.freed_former", extra={"replica": self.id, "threads": freed})

    async def _adopt_page(self, limit: int, attaching: list[asyncio.Task[None]]) -> bool:
        """One look at the threads without a live holder; True if it claimed a full page."""
        fleet = await self.broker.sessions.look()
        if self.incarnation not in {r.incarnation for r in fleet.alive().values()}:
            return False  # dead itself (the heartbeat will join again): claims would not last
        seen = await self.broker.sessions.candidates(fleet, limit)
        candidates = [t for t in seen.expired if t not in self.threads]
        if not candidates:
            return False
        # Spread threads over the live replicas: one holding its fair share already takes only
        # threads nobody else took within URGENT_MS; and nobody takes more than a share a sweep.
        alive = max(1, seen.replicas)
        if len(self.threads) >= -(-seen.threads // alive):
            candidates = [t for t in candidates if seen.now - seen.expired[t] > URGENT_MS]
        random.shuffle(candidates)
        candidates = candidates[: -(-len(candidates) // alive)]
        claimed = await self.broker.sessions.claim_many(
            candidates, self.id, self.incarnation, seen.dead
        )
        for thread_id, epoch in claimed.items():
            self.threads[thread_id] = _Thread(thread_id, epoch, listener=self._kicker(thread_id))
        attaching.append(asyncio.create_task(self._attach(claimed)))
        if claimed:
            logger.info("replica.adopted", extra={"replica": self.id, "threads": len(claimed)})
        return len(claimed) >= limit

    async def _attach(self, claimed: Mapping[str, int]) -> None:
        """Hold the claimed threads: listen to all their bells (one SUBSCRIBE), look at each."""
        held = {t: self.threads[t] for t in claimed if t in self.threads}
        await self.broker.listen_many({t: h.listener for t, h in held.items()})
        # One batched look, not one examination each: most adopted threads just wait.
        try:
            for t in held.values():
                t.fresh = False
            await self._sweep(set(held))
        except (BrokerError, OSError, ConnectionError):
            logger.exception("replica.loop_failed", extra={"loop": "attach"})
            self._retry_later(set(claimed))

    def _kicker(self, thread_id: str) -> Any:
        def ring(_channel: str, wake: Mapping[str, Any]) -> None:
            if wake.get("resubscribed"):
                t = self.threads.get(thread_id)
                if t is not None and not t.fresh:
                    self.suspect(thread_id)  # a bell may have rung meanwhile: look in a batch
            else:
                self.kick(thread_id)

        return ring

    def _drop(self, thread_id: str) -> None:
        t = self.threads.pop(thread_id, None)
        if t is None:
            return
        self.broker.unlisten(thread_id, t.listener)
        held = self._held.get(thread_id)
        if held is not None:
            held.demoted.set()
        if t.task is not None and not t.task.done() and t.task is not asyncio.current_task():
            t.task.cancel()
        logger.warning("replica.lost_thread", extra={"replica": self.id, "thread_id": thread_id})

    async def _heartbeat(self) -> None:
        """One write, whatever is held. Found dead: every thread may be another's by now."""
        if await self.broker.sessions.beat(self.id, self.incarnation, self.ttl_ms) is not None:
            return
        logger.warning(
            "replica.expired",
            extra={
                "replica": self.id,
                "incarnation": self.incarnation,
                "threads": len(self.threads),
            },
        )
        for thread_id in list(self.threads):
            self._drop(thread_id)
        await self._join()

    def suspect(self, thread_id: str) -> None:
        """Have the thread's records read soon, in a batch (a bell may have been missed)."""
        if thread_id in self.threads and not self._stopping:
            self._suspects.add(thread_id)
            self._suspect_event.set()

    async def _suspect_loop(self) -> None:
        while True:
            await self._suspect_event.wait()
            await asyncio.sleep(0.05)  # gather a resubscription's worth into one batch
            self._suspect_event.clear()
            suspects, self._suspects = self._suspects, set()
            try:
                await self._sweep(suspects)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica.loop_failed", extra={"loop": "sweep"})
                self._retry_later(suspects)

    def _retry_later(self, thread_ids: set[str]) -> None:
        """Look again after `sweep_interval`: the look that failed (a Redis error) is owed."""
        loop = asyncio.get_running_loop()
        for thread_id in thread_ids:
            loop.call_later(self.settings.sweep_interval, self.suspect, thread_id)

    async def _sweep(self, thread_ids: set[str] | None = None) -> None:
        """Look at threads (all when None) for work a missed bell would have announced: read
        their records in pipelines and kick only the threads that have something to do."""
        if thread_ids is None:
            threads = list(self.threads.values())
        else:
            threads = [t for i in thread_ids if (t := self.threads.get(i)) is not None]
        idle = [t for t in threads if t.task is None or t.task.done()]
        for i in range(0, len(idle), 500):
            for thread_id in await self._needing_a_look(idle[i : i + 500]):
                self.kick(thread_id)

    async def _needing_a_look(self, threads: list[_Thread]) -> list[str]:
        """Of these idle threads, those with something to do, from their records read in
        pipelines. A dead holder's held wait (status running, its prompt pending, no turn here)
        is adopted as parked right here, in one pipeline, rather than by a look each."""
        redis = self.broker.redis
        pipe = redis.pipeline(transaction=False)
        for t in threads:
            keys = self.broker.thread(t.thread_id)
            pipe.hmget(keys.session, ["owner", "inc", "epoch", "status", "wait"])
            pipe.llen(keys.inbox)
        rows = await pipe.execute()
        look: list[str] = []
        waiting: list[tuple[_Thread, str, str]] = []
        for t, (owner, inc, epoch, status, wait), queued in zip(
            threads, rows[::2], rows[1::2], strict=True
        ):
            lost = owner != self.id or inc != self.incarnation or epoch != str(t.epoch)
            if lost or queued or (not wait and status in ("running", "parked")):
                look.append(t.thread_id)  # lost, messages waiting, a turn that died: look
            elif wait:
                waiting.append((t, orjson.loads(wait)["prompt_id"], status))
        if not waiting:
            return look
        pipe = redis.pipeline(transaction=False)
        for t, prompt_id, _ in waiting:
            pipe.hget(self.broker.thread(t.thread_id).prompt(prompt_id), "state")
        states = await pipe.execute()
        park: list[_Thread] = []
        for (t, _, status), state in zip(waiting, states, strict=True):
            if state != "pending":
                look.append(t.thread_id)  # answered, cancelled or gone: act on it
            elif status != "parked":
                park.append(t)
        return look + await self._park(park)

    async def _park(self, threads: list[_Thread]) -> list[str]:
        """Mark these sessions parked, in one pipeline; those refused (fenced) need a look."""
        if not threads:
            return []
        redis = self.broker.redis
        pipe = redis.pipeline(transaction=False)
        for t in threads:
            session = self.broker.thread(t.thread_id).session
            self.broker._scripts.queue(pipe, "update", [session], [t.epoch, "status", "parked"])
        replies = await self.broker._scripts.run_pipeline(redis, pipe)
        # fenced: another holder has it now; the look finds it lost and drops it
        return [t.thread_id for t, r in zip(threads, replies, strict=True) if r[0] != "ok"]

    # -- examining threads -------------------------------------------------------------------

    def kick(self, thread_id: str) -> None:
        """Look at the thread soon (its bell rang, or it was just adopted)."""
        t = self.threads.get(thread_id)
        if t is None or self._stopping:
            return
        if t.task is not None and not t.task.done():
            t.kicked = True  # the running turn looks again when it ends
            return
        self._kicks.add(thread_id)
        self._kick_event.set()

    async def _kick_loop(self) -> None:
        while True:
            await self._kick_event.wait()
            self._kick_event.clear()
            kicks, self._kicks = self._kicks, set()
            for thread_id in kicks:
                t = self.threads.get(thread_id)
                if t is not None and (t.task is None or t.task.done()):
                    t.task = asyncio.create_task(self._examine(t), name=f"thread {thread_id}")

    async def _examine(self, t: _Thread) -> None:
        try:
            while not self._stopping:
                t.kicked = False
                await self._step(t)
                if not t.kicked:
                    return
        except _Lost:
            self._drop(t.thread_id)
        except Fenced:
            self._drop(t.thread_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("replica.thread_failed", extra={"thread_id": t.thread_id})
            self._retry_later({t.thread_id})

    async def _step(self, t: _Thread) -> None:
        """Do what the thread's records say, once."""
        session = await self.broker.sessions.get(t.thread_id, lease=False)
        if session is None or session.owner != self.id or session.epoch != t.epoch:
            raise _Lost
        if session.holder_incarnation != self.incarnation:
            raise _Lost
        if session.status == "closed":
            raise _Lost
        if session.waiting is not None:
            if await self._waiting(t, session, session.waiting.prompt_id):
                return
        elif session.status in ("running", "parked"):
            # A turn was cut off (its replica died, paused past its lease, or lost Redis) with
            # nothing waited on: perhaps after an answer was handed to it.
            await self._interrupted(t, session, waited=None)
        inbox = await self.broker.take_inbox(t.thread_id)
        if inbox:
            text = "\n\n".join(i.text for i in inbox if i.text)
            session = await self.broker.sessions.get(t.thread_id, lease=False) or session
            await self._run_turn(t, session, text, None)

    async def _waiting(self, t: _Thread, session: Session, prompt_id: str) -> bool:
        """Act on the prompt the session waits on; True when nothing more is to be done now."""
        try:
            prompt = await self.broker.get_prompt(t.thread_id, prompt_id)
        except PromptNotFound:
            prompt = None
        if prompt is not None and prompt.state == "pending":
            if session.status != "parked":  # a dead replica's held wait: adopt as parked
                await self._update(t, status="parked")
            return True
        if prompt is not None and prompt.state == "answered":
            if await self._resume(t, session, prompt):
                t.kicked = True  # look again: messages may have queued meanwhile
                return True
            # Handed over before, to a turn that was cut off: tell, never replay.
            await self._interrupted(t, session, waited=prompt)
        elif session.status == "running":
            # A held wait whose turn was cut off, its prompt since cancelled (or gone): the
            # agent will never get an answer, and its turn did not end. Tell that too.
            await self._update(t, wait=None)
            await self._interrupted(t, session, waited=None)
        else:
            await self._update(t, status="idle", wait=None)
        return False

    async def _interrupted(self, t: _Thread, session: Session, waited: Prompt | None) -> None:
        """Report a cut-off turn once: the person gets one item with what is known, the session
        keeps it for the next turn to tell the agent, and nothing of that turn is replayed."""
        delivered_id = waited.prompt_id if waited is not None else session.delivered
        delivered: Resume | None = None
        if delivered_id:
            try:
                prompt = await self.broker.get_prompt(t.thread_id, delivered_id)
            except PromptNotFound:
                prompt = None
            if prompt is not None and prompt.state == "answered":
                delivered = _resume_of(prompt)
        note = await self._describe(t, session)
        grant = "none"
        if delivered is not None and delivered.verdict == "approve":
            grant = await self.broker.sessions.grant_of(t.thread_id, delivered.prompt_id)
        interruption = Interruption(delivered=delivered, note=note)
        told = await self.broker.sessions.interrupt(
            t.thread_id,
            t.epoch,
            interruption_text(delivered, note, grant=grant),
            metadata={"interrupted": {"delivered": delivered_id or None, "note": note}},
            interruption=interruption_record(interruption),
            waited=waited.prompt_id if waited is not None else None,
        )
        if told:
            logger.info(
                "turn.interrupted",
                extra={"thread_id": t.thread_id, "prompt_id": delivered_id, "note": note},
            )

    async def _describe(self, t: _Thread, session: Session) -> str:
        """The harness's account of the call in flight; "" when it has none or fails to say."""
        harness = self.harnesses.get(session.harness)
        if harness is None:
            return ""
        try:
            async with asyncio.timeout(10):
                return await harness.describe_interruption(
                    t.thread_id, session.state, _Store(self.broker, t.thread_id)
                )
        except asyncio.CancelledError:
            raise
        except Exception:  # the interruption is reported all the same, without its note
            logger.exception("turn.interruption_undescribed", extra={"thread_id": t.thread_id})
            return ""

    # -- turns -------------------------------------------------------------------------------

    async def _resume(self, t: _Thread, session: Session, prompt: Prompt) -> bool:
        """Run the resume turn of an answered parked prompt, if its answer was never handed
        over; False when it was (the turn that got it was cut off)."""
        q = prompt.questions[0]
        approve = approves(prompt.answers)
        grant = None
        if prompt.kind == "approval" and approve and q.subject:
            grant = Grant(subject=q.subject, grant_key=q.grant_key, granted_by=prompt.prompt_id)
        token = t.tokens.setdefault(prompt.prompt_id, delivery_token())
        handed = await self.broker.sessions.resume(
            t.thread_id, prompt.prompt_id, t.epoch, grant, token
        )
        del t.tokens[prompt.prompt_id]  # a reply came: the next attempt is a new one
        if handed.outcome == "already":
            logger.warning(
                "turn.resume_refused",
                extra={"thread_id": t.thread_id, "prompt_id": prompt.prompt_id},
            )
            return False
        if handed.outcome == "unanswered":
            return True  # the record moved on (the prompt is gone): look again
        logger.info("turn.resume", extra={"thread_id": t.thread_id, "prompt_id": prompt.prompt_id})
        await self._run_turn(
            t, session, resume_text(prompt, session.work_folder), _resume_of(prompt)
        )
        return True

    async def _run_turn(
        self, t: _Thread, session: Session, text: str, resume: Resume | None
    ) -> None:
        harness = self.harnesses.get(session.harness)
        interrupted = interruption_of(session.interrupted)
        slot = _Slot(self._slots)
        await slot.acquire()
        try:
            # The interruption is told to this turn's agent, and only to it.
            if resume is None:
                await self._update(t, status="running", interrupted=None, delivered=None)
            elif interrupted is not None:
                await self._update(t, interrupted=None)
            if harness is None:
                result = TurnResult("failed", error=f"no harness {session.harness!r} here")
            else:
                result = await self._call_harness(
                    t, session, harness, text, resume=resume, slot=slot, interrupted=interrupted
                )
        finally:
            slot.release()
        await self._end_turn(t, result)

    async def _call_harness(
        self,
        t: _Thread,
        session: Session,
        harness: Harness,
        text: str,
        *,
        resume: Resume | None,
        slot: _Slot,
        interrupted: Interruption | None = None,
    ) -> TurnResult:
        try:
            gate = await self._gate(t, session) if session.permissions == "guarded" else None
        except BadItem as e:
            return TurnResult("failed", error=f"the thread's policy cannot be enforced: {e}")
        turn = Turn(
            thread_id=t.thread_id,
            prompt=text,
            permissions=session.permissions,
            config=session.config,
            state=session.state,
            handle=_Handle(self, t, slot),
            emit=lambda line: self._emit(t, line),
            resume=resume,
            work_folder=session.work_folder,
            gate=gate,
            store=_Store(self.broker, t.thread_id),
            interrupted=interrupted,
        )
        try:
            return await harness.run_turn(turn)
        except (_Lost, Fenced, asyncio.CancelledError):
            raise
        except (RedisError, BrokerUnavailable):
            # Redis trouble (down, loading its data, timing out), not the agent's: the turn is
            # cut off as if this replica had stopped, and its records decide on the next look
            # (a parked wait resumes, a cut-off turn is reported), never a failed turn that
            # would drop a wait whose answer may already be given.
            logger.warning("turn.redis_trouble", extra={"thread_id": t.thread_id}, exc_info=True)
            raise
        except Exception as e:
            logger.exception("turn.crashed", extra={"thread_id": t.thread_id})
            return TurnResult("failed", error=f"the agent crashed: {e!r}")

    async def _gate(self, t: _Thread, session: Session) -> Gate:
        """A guarded turn's gate, once its `policy_applied` item is posted. `BadItem` when the
        thread's policy is missing or malformed (a thread created around
        `workers.agents.policy`)."""
        if session.policy is None:
            raise BadItem("policy", "POLICY_MISSING: guarded permissions need a policy block")
        try:
            thread_policy = policy.parse_policy(session.policy)
        except BadItem as e:
            raise BadItem(e.field, f"POLICY_INVALID: {e.problem}") from None
        guard = policy.Guard(self.policy_rules, thread_policy, session.work_folder)
        applied = guard.applied()
        counts = applied["counts"]
        summary = f"policy applied: {counts['rules']} rules, default {thread_policy.default}"
        await self._post(t, summary, "policy_applied", None, applied)

        async def gate(harness: str, tool: str, tool_input: dict[str, Any]) -> GateVerdict:
            verdict = await guard.decide_async(harness, tool, tool_input)
            logger.info(
                "policy.verdict",
                extra={"thread_id": t.thread_id, "action": verdict.action, "rule": verdict.rule},
            )
            if verdict.action == "deny" and verdict.rule != policy.EVALUATION_ERROR:
                content, meta = policy.denied_item(verdict)
                try:
                    await self._post(t, content, "policy_denied", None, meta)
                except (BrokerError, OSError):  # the call stays refused; only the item is lost
                    logger.exception("policy.denied_not_posted", extra={"thread_id": t.thread_id})
            return verdict

        return gate

    async def _end_turn(self, t: _Thread, result: TurnResult) -> None:
        state = _json(result.state)
        if result.status == "parked":
            await self._update(t, status="parked", hstate=state, delivered=None)
            logger.info("turn.parked", extra={"thread_id": t.thread_id})
            return
        if result.status == "failed":
            await self.broker.cancel(t.thread_id, result.error, epoch=t.epoch)
            await self._post(t, f"✗ the turn failed: {result.error}", "turn_end", "failed")
            if await self._answered_wait(t):
                # The person answered what the agent waited on before the turn failed: that
                # answer is not dropped; the session stays parked on it and resumes.
                await self._update(t, status="parked", hstate=state, error=result.error)
                t.kicked = True
                return
            await self._update(
                t, status="idle", wait=None, hstate=state, error=result.error, delivered=None
            )
            return
        # A run that ended leaves no question behind for nobody to take the answer of.
        await self.broker.cancel(t.thread_id, RUN_ENDED, epoch=t.epoch)
        await self._post(t, "", "turn_end", "completed")
        await self._update(t, status="idle", wait=None, hstate=state, error=None, delivered=None)

    async def _answered_wait(self, t: _Thread) -> bool:
        """Whether the session waits on a prompt that is answered and not yet handed over."""
        session = await self.broker.sessions.get(t.thread_id, lease=False)
        if session is None or session.waiting is None:
            return False
        try:
            prompt = await self.broker.get_prompt(t.thread_id, session.waiting.prompt_id)
        except PromptNotFound:
            return False
        return prompt.state == "answered" and prompt.delivered_at is None

    async def _update(self, t: _Thread, **fields: str | None) -> None:
        await self.broker.sessions.update(t.thread_id, t.epoch, **fields)

    async def _emit(self, t: _Thread, line: str) -> None:
        await self._post(t, line, OUTPUT, None)

    async def _post(
        self,
        t: _Thread,
        text: str,
        type_: str,
        status: str | None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        meta: dict[str, Any] = {**(extra or {}), "type": type_}
        if status is not None:
            meta["status"] = status
        content = [{"type": "text", "text": text}] if text else []
        try:
            await self.broker.post_item(
                t.thread_id,
                {"content": content, "metadata": meta, "author": self.broker.identity},
                epoch=t.epoch,
            )
        except (Fenced, ThreadClosed) as e:
            raise _Lost from e

    # -- held waits --------------------------------------------------------------------------

    def held_count(self) -> int:
        return len(self._held)

    def _enter_hold(self, held: _HeldWait) -> None:
        self._held.pop(held.thread_id, None)
        self._held[held.thread_id] = held
        while len(self._held) > self.settings.held_waits_max:
            _, oldest = self._held.popitem(last=False)
            oldest.demoted.set()
            logger.info("wait.demoted", extra={"thread_id": oldest.thread_id, "why": "held_cap"})

    def _leave_hold(self, held: _HeldWait) -> None:
        if self._held.get(held.thread_id) is held:
            del self._held[held.thread_id]


class _Slot:
    """A turn's claim on one of the replica's turn slots; a held wait gives it back meanwhile."""

    def __init__(self, sem: asyncio.Semaphore) -> None:
        self._sem = sem
        self._held = False

    async def acquire(self) -> None:
        await self._sem.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._sem.release()


class _Handle:
    """The prompt handle a turn's agent asks through."""

    def __init__(self, replica: Replica, t: _Thread, slot: _Slot) -> None:
        self.r = replica
        self.t = t
        self.slot = slot

    async def ask(
        self,
        kind: Kind,
        questions: Sequence[Question],
        *,
        state: dict[str, Any] | None = None,
    ) -> list[Answer]:
        b, t = self.r.broker, self.t
        qs = [q if isinstance(q, Question) else Question.model_validate(q) for q in questions]
        subject = (qs[0].subject or "") if qs else ""
        if kind == "approval" and subject:
            granted = await self._spend_grant(qs[0])
            if granted is not None:
                return granted
        try:
            prompt = await b.ask(t.thread_id, kind, qs, epoch=t.epoch, agent_state=state)
        except Fenced as e:
            raise _Lost from e
        if self.r.settings.wait_mode == "parked" or self.r._stopping:
            raise PromptParked(prompt.prompt_id, kind, subject)
        return await self._hold(prompt, subject)

    async def _spend_grant(self, q: Question) -> list[Answer] | None:
        b, t = self.r.broker, self.t
        session = await b.sessions.get(t.thread_id, lease=False)
        if session is None or session.grant is None or session.grant.subject != q.subject:
            return None
        if not covers(session.grant.grant_key, q.grant_key, session.work_folder):
            return None
        try:
            item = await b.sessions.spend_grant(session, t.epoch, q.question)
        except Fenced as e:
            raise _Lost from e
        if item is None:
            return None
        logger.info("grant.spent", extra={"thread_id": t.thread_id, "subject": q.subject})
        return [Answer(question=q.question, answer=["Approve"])]

    async def _hold(self, prompt: Prompt, subject: str) -> list[Answer]:
        """Wait in place. The turn's slot is given back meanwhile and taken again only when
        the answer came: a demoted or cancelled hold must never block on a slot."""
        held = _HeldWait(self.t.thread_id, prompt.prompt_id, prompt.kind, subject)
        self.r._enter_hold(held)
        self.slot.release()
        wait = asyncio.ensure_future(
            self.r.broker.wait(
                self.t.thread_id, prompt.prompt_id, epoch=self.t.epoch, deliver=False
            )
        )
        demoted = asyncio.ensure_future(held.demoted.wait())
        try:
            await asyncio.wait({wait, demoted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            demoted.cancel()
            self.r._leave_hold(held)
            if not wait.done():
                wait.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await wait
        if wait.cancelled():
            raise PromptParked(prompt.prompt_id, prompt.kind, subject)
        try:
            answers = wait.result()
            # Out of the hold now: a demotion can no longer cancel the delivery half-way.
            handed = await self.r.broker.sessions.deliver(
                self.t.thread_id, prompt.prompt_id, self.t.epoch, delivery_token()
            )
        except Fenced as e:
            raise _Lost from e
        if handed.outcome != "handed":
            # Handed over before (or gone): never twice. Stop touching the thread; its next
            # holder finds the turn cut off and reports it.
            logger.warning(
                "prompt.delivery_refused",
                extra={"thread_id": self.t.thread_id, "prompt_id": prompt.prompt_id},
            )
            raise _Lost
        await self.slot.acquire()
        return answers


def _resume_of(prompt: Prompt) -> Resume:
    """What a turn is handed of an answered prompt."""
    q = prompt.questions[0]
    approve = approves(prompt.answers)
    return Resume(
        prompt_id=prompt.prompt_id,
        kind=prompt.kind,
        subject=q.subject or "",
        answers=prompt.answers or [],
        verdict=("approve" if approve else "deny") if prompt.kind == "approval" else None,
        text=prompt.answer_text or "",
    )


def interruption_text(delivered: Resume | None, note: str, *, grant: str = "none") -> str:
    """The thread item that tells the person a turn was cut off, and what is known of it.

    `grant`: what became of the one-shot grant the delivered approval minted (`none` when it
    minted none: a held approval is answered in place)."""
    parts = ["the turn was interrupted: the replica running it stopped."]
    if delivered is not None:
        parts.append(f"It had been handed {describe_delivered(delivered)}.")
        if grant == "unused":
            parts.append("Its one-shot approval was not used: the call did not run through it.")
        elif grant == "used":
            parts.append("Its one-shot approval was used.")
    if note:
        parts.append(note.rstrip(".") + ".")
    parts.append("Nothing of that turn is repeated; a call the agent makes again is asked again.")
    return "(" + " ".join(parts) + ")"


def interruption_record(interruption: Interruption) -> dict[str, Any]:
    """An interruption as the session keeps it (JSON)."""
    d = interruption.delivered
    delivered = None
    if d is not None:
        delivered = {
            "prompt_id": d.prompt_id,
            "kind": d.kind,
            "subject": d.subject,
            "answers": [a.model_dump() for a in d.answers],
            "verdict": d.verdict,
            "text": d.text,
        }
    return {"delivered": delivered, "note": interruption.note}


def interruption_of(record: Mapping[str, Any] | None) -> Interruption | None:
    """The interruption a session keeps, back as the harness interface's type."""
    if not record:
        return None
    d = record.get("delivered")
    delivered = None
    if isinstance(d, Mapping):
        delivered = Resume(
            prompt_id=str(d.get("prompt_id", "")),
            kind=d.get("kind", "approval"),
            subject=str(d.get("subject", "")),
            answers=[Answer.model_validate(a) for a in d.get("answers") or []],
            verdict=d.get("verdict"),
            text=str(d.get("text", "")),
        )
    return Interruption(delivered=delivered, note=str(record.get("note", "")))


def _json(value: Any) -> str | None:
    return orjson.dumps(value).decode() if value is not None else None
