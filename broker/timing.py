"""Deadlines, reminders and escalation for prompts: what a thread or a prompt carries, and the
steps that carry it out (the `Timings` part of the `Broker`).

A `Timing` says, in seconds after a prompt opened: when to remind people (`remind`), when to
widen who may answer (`escalate`, to the token scope `escalate_to`), and when the prompt
expires (`deadline`). A thread's timing applies to every prompt asked on it; a prompt's own
timing replaces its thread's. Without one nothing changes: a prompt waits as long as it takes.

At the deadline the prompt is cancelled with reason `expired`, never approved and never
denied: its agent is told the prompt is unavailable because it expired, as for any prompt nobody
answered.

How it runs (docs/architecture.md has the keys):

- The timing is recorded as its steps (`[age_ms, "remind"|"escalate"|"expire", n]`, in order):
  a thread's in `<base>timing`, a prompt's in its record (`timing`).
- `<prefix>:due` (sorted set) names each prompt with timing, scored by when its next step is
  due (server time, ms). Only a hint: `step.lua` decides from the record and the server's clock.
- `step.lua` runs a prompt's due steps once: it records the last step taken in the record
  (`fired`), so any number of timekeepers may race on one prompt and each step happens once.
  Steps missed while every timekeeper was down collapse into one (the latest reminder).
- Expiry is not recorded as fired: it is the broker's own `cancel` of that prompt, which acts
  only while the prompt is pending, so a timekeeper that dies between the two is followed by
  another that cancels it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Self

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker._base import _reaching
from broker.errors import BadItem, PromptNotFound, ThreadClosed, ThreadNotFound
from broker.keys import check_prompt_id
from broker.reads import Reads

__all__ = ["Step", "Timing", "Timings", "parse_duration"]

#: The longest any step may be set after a prompt opens.
MAX_SECONDS = 366 * 86400
MAX_REMINDERS = 20

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)?\s*")


def parse_duration(text: str, field: str = "duration") -> float:
    """`90`, `90s`, `15m`, `1.5h`, `2d`, `1w` -> seconds. `BadItem` naming `field` otherwise."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise BadItem(field, f"expected a duration such as 90s, 15m, 2h or 1d, got {text!r}")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not 0 < seconds <= MAX_SECONDS:
        raise BadItem(field, f"must be more than 0 and at most 366 days, got {text!r}")
    return seconds


class Timing(BaseModel):
    """When, after a prompt opens, to remind, to escalate and to expire it (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deadline: float | None = Field(default=None, gt=0, le=MAX_SECONDS)
    remind: tuple[float, ...] = ()
    escalate: float | None = Field(default=None, gt=0, le=MAX_SECONDS)
    escalate_to: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$"
    )

    @model_validator(mode="after")
    def _in_order(self) -> Self:
        if len(self.remind) > MAX_REMINDERS:
            raise ValueError(f"at most {MAX_REMINDERS} reminders")
        if any(not 0 < r <= MAX_SECONDS for r in self.remind):
            raise ValueError("each reminder must be more than 0 and at most 366 days")
        if len(set(self.remind)) != len(self.remind):
            raise ValueError("two reminders at the same time")
        if (self.escalate is None) != (self.escalate_to is None):
            raise ValueError("escalate and escalate_to go together")
        if self.deadline is not None:
            late = [
                r for r in (*self.remind, self.escalate) if r is not None and r >= self.deadline
            ]
            if late:
                raise ValueError("reminders and escalation must come before the deadline")
        if self.deadline is None and not self.remind and self.escalate is None:
            raise ValueError("empty: give a deadline, reminders or an escalation")
        return self

    @classmethod
    def parse(cls, value: object, field: str = "timing") -> Timing:
        """A `Timing` from its JSON shape, or `BadItem` naming what is wrong and where."""
        if isinstance(value, Timing):
            return value
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(p) for p in (field, *error["loc"]))
            raise BadItem(where, error["msg"].removeprefix("Value error, ")) from None

    def steps(self) -> list[list[Any]]:
        """The steps in the order they come: `[age_ms, kind, n]` (n: the reminder's number)."""
        out: list[list[Any]] = [
            [round(r * 1000), "remind", i] for i, r in enumerate(sorted(self.remind), 1)
        ]
        if self.escalate is not None:
            out.append([round(self.escalate * 1000), "escalate", self.escalate_to])
        out.sort(key=lambda s: s[0])
        if self.deadline is not None:
            out.append([round(self.deadline * 1000), "expire", 0])
        return out

    def spec(self) -> bytes:
        """What the records hold: the timing itself (to show) and its steps (for step.lua)."""
        return orjson.dumps({"timing": self.model_dump(exclude_none=True), "steps": self.steps()})

    @classmethod
    def from_spec(cls, spec: str | bytes | None) -> Timing | None:
        if not spec:
            return None
        return cls.model_validate(orjson.loads(spec)["timing"])


@dataclass(frozen=True, slots=True)
class Step:
    """What one look at a prompt's timing did.

    `outcome`: `fired` (a reminder or an escalation was taken now), `expire` (its deadline has
    come: cancel it), `early` (nothing due yet), `gone` (no longer pending), `none` (no timing).
    `next_ms`: when its next step is due (server time), or None."""

    outcome: Literal["fired", "expire", "early", "gone", "none"]
    kind: str = ""  # fired: remind or escalate (the last step taken)
    reminder: int = 0  # fired: the last reminder's number, 0 if none was taken now
    reminders: int = 0  # how many reminders the timing has
    escalated_to: str = ""  # fired: the scope it was escalated to now, if it was
    age_ms: int = 0
    next_ms: int | None = None


class Timings(Reads):
    """Setting and reading a thread's or a prompt's timing, and taking its due steps."""

    @_reaching("setting a timing", None)
    async def set_timing(
        self,
        thread_id: str,
        timing: Timing | dict[str, Any] | None,
        *,
        prompt_id: str | None = None,
    ) -> None:
        """Give the thread (every prompt asked on it, the active one too) or one pending prompt
        a timing; None clears it. `ThreadNotFound`, `ThreadClosed`, `PromptNotFound` (not
        pending), `BadItem` (a timing that does not hold)."""
        self._check_open()
        tk = self.thread(thread_id)
        checked = None if timing is None else Timing.parse(timing)
        if prompt_id is not None:
            check_prompt_id(prompt_id)
        status = await self._scripts.call(
            self.redis,
            "timing",
            [tk.timing, tk.session, tk.items, tk.active],
            [b"" if checked is None else checked.spec(), prompt_id or "", tk.base],
        )
        if status == "nothread":
            raise ThreadNotFound(thread_id)
        if status == "closed":
            raise ThreadClosed(thread_id)
        if status == "notpending":
            raise PromptNotFound(thread_id, prompt_id or "")
        # The prompt it now applies to (the named one, or the thread's active one) is looked at
        # by the timekeeper at once; `step` works out when its next step is really due.
        target = prompt_id or await self.redis.get(tk.active)
        if target:
            target = target.decode() if isinstance(target, bytes) else target
            due = self.indexes.due.key(thread_id)
            await self.redis.zadd(due, {self.keys.member(thread_id, target): 0})

    @_reaching("reading a timing", False)
    async def get_timing(self, thread_id: str, prompt_id: str | None = None) -> Timing | None:
        """The timing that applies: the prompt's own if it has one, else its thread's."""
        self._check_open()
        tk = self.thread(thread_id)
        if prompt_id is not None:
            own = await self.redis.hget(tk.prompt(check_prompt_id(prompt_id)), "timing")  # type: ignore[misc]
            if own:
                return Timing.from_spec(own)
        return Timing.from_spec(await self.redis.hget(tk.timing, "spec"))  # type: ignore[misc]

    @_reaching("taking a timing step", None)
    async def step_timing(self, thread_id: str, prompt_id: str) -> Step:
        """Take the prompt's due steps (reminders, escalation) once, whoever else looks too;
        say whether its deadline has come (the caller cancels it)."""
        self._check_open()
        tk = self.thread(thread_id)
        reply = await self._scripts.call(
            self.redis, "step", [tk.prompt(check_prompt_id(prompt_id)), tk.timing], []
        )
        outcome, *rest = (r.decode() if isinstance(r, bytes) else str(r) for r in reply)
        if outcome in ("gone", "none"):
            return Step(outcome)  # type: ignore[arg-type]
        kind, reminder, reminders, escalated, age, nxt = rest
        return Step(
            outcome,  # type: ignore[arg-type]
            kind=kind,
            reminder=int(reminder),
            reminders=int(reminders),
            escalated_to=escalated,
            age_ms=int(age),
            next_ms=int(nxt) if nxt else None,
        )
