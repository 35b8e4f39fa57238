"""`prompt-broker demo`: a self-driving scenario on a local fleet, checked end to end.

Several threads run scripted agents that ask every kind of prompt; a simulated person answers
with text and with structured answers; one replica is killed (SIGKILL) while it holds waits, its
threads are answered while it is dead and adopted by the others. Then every thread is checked:
each prompt resolved once, each answer delivered once and audited once, each expected line of
agent output present exactly once. The transcripts and a one-line verdict are printed; the exit
status is non-zero if anything was lost or doubled.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ulid import ULID

from broker import Broker, Item, Prompt, Settings
from broker.cli import render_item
from workers.fleet import Fleet

__all__ = ["run_demo"]

TARGET = {
    "question": "Where should it deploy?",
    "header": "target",
    "options": [
        {"label": "staging", "description": "push to staging.example.com"},
        {"label": "production", "description": "push to www.example.com"},
    ],
}
SECTIONS = {
    "question": "Which sections?",
    "multiSelect": True,
    "options": [{"label": "KPI cards"}, {"label": "Table"}, {"label": "Chart"}],
}
NAME = {"question": "What should the dashboard be called?"}


def _tool(command: str, output: str) -> dict[str, Any]:
    return {"tool": "Bash", "input": {"command": command}, "output": output}


@dataclass
class Case:
    """One thread of the scenario: its script, how the person answers, what must come out."""

    thread: str
    steps: list[dict[str, Any]]
    answers: list[dict[str, Any]]  # one item per prompt, in order
    expect: list[str]  # substrings of agent output lines, each exactly once
    victim: bool = False  # asked to be on the replica that gets killed
    prompts: int = 0
    notes: list[str] = field(default_factory=list)


def _text(t: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": t}]}


def _cases(tag: str) -> list[Case]:
    structured = {
        "content": [{"type": "text", "text": "staging · KPI cards, Chart · Ops board"}],
        "metadata": {
            "answers": [
                {"question": TARGET["question"], "answer": ["staging"]},
                {"question": SECTIONS["question"], "answer": ["KPI cards", "Chart"]},
                {"question": NAME["question"], "answer": ["Ops board"]},
            ]
        },
    }
    cases = [
        Case(
            f"{tag}-approve",
            [{"say": "Deploying."}, _tool("make deploy", "deployed"), {"say": "Deploy finished."}],
            [_text("yes")],
            ["Ran Bash `make deploy`", "Deploy finished."],
        ),
        Case(
            f"{tag}-deny",
            [_tool("rm -rf /srv/data", "deleted"), {"say": "Trying another way."}],
            [_text("no, that is production data")],
            ["Did not run Bash `rm -rf /srv/data`", "Trying another way."],
        ),
        Case(
            f"{tag}-form",
            [{"ask": [TARGET, SECTIONS, NAME]}, {"say": "Building it."}],
            [structured],
            ["staging", "KPI cards, Chart", "Ops board", "Building it."],
        ),
        Case(f"{tag}-pick", [{"ask": [SECTIONS]}], [_text("1, 3")], ["KPI cards, Chart"]),
        Case(f"{tag}-free", [{"ask": [NAME]}], [_text("Revenue wall")], ["Revenue wall"]),
    ]
    for i in range(1, 4):
        approve = i != 2
        cases.append(
            Case(
                f"{tag}-adopt{i}",
                [_tool(f"make migrate-{i}", f"migrated {i}"), {"say": f"Migration {i} handled."}],
                [_text("approve" if approve else "deny")],
                [
                    f"Ran Bash `make migrate-{i}`"
                    if approve
                    else f"Did not run Bash `make migrate-{i}`",
                    f"Migration {i} handled.",
                ],
                victim=True,
            )
        )
    return cases


async def _until(check: Any, within: float, what: str) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _active(b: Broker, thread: str) -> Prompt | None:
    return await b.active_prompt(thread)


async def _answer_next(b: Broker, case: Case, within: float = 20) -> None:
    """Wait for the thread's next prompt, answer it as the case says."""
    prompt = await _until(lambda: _active(b, case.thread), within, f"a prompt on {case.thread}")
    await b.post_item(case.thread, case.answers[case.prompts])
    case.prompts += 1
    case.notes.append(f"answered {prompt.prompt_id}")


async def _settled(b: Broker, case: Case) -> bool:
    session = await b.sessions.get(case.thread)
    if session is None or session.status != "idle" or session.waiting is not None:
        return False
    items = await b.items(case.thread)
    return any(i.type == "turn_end" for i in items) and await b.active_prompt(case.thread) is None


async def _audited(b: Broker, thread: str) -> bool:
    items = await b.items(thread)
    asked = [i for i in items if i.type == "pending_prompt"]
    resolved = [i for i in items if i.type == "pending_prompt_resolved"]
    return len(resolved) >= len(asked)


def _check(case: Case, items: list[Item], prompts: dict[str, Prompt]) -> list[str]:
    """Everything wrong with one thread's outcome (empty when all is well)."""
    problems: list[str] = []
    outputs = [i.text for i in items if i.type == "agent_output"]
    for expected in case.expect:
        n = sum(1 for line in outputs if expected in line)
        if n != 1:
            problems.append(f"output {expected!r} seen {n} times")
    asked = [i.metadata["prompt"]["prompt_id"] for i in items if i.type == "pending_prompt"]
    resolved = Counter(
        i.metadata["prompt"]["prompt_id"] for i in items if i.type == "pending_prompt_resolved"
    )
    for prompt_id in asked:
        if resolved[prompt_id] != 1:
            problems.append(f"{prompt_id} has {resolved[prompt_id]} resolution items")
        p = prompts[prompt_id]
        if p.state != "answered" or p.delivered_at is None:
            problems.append(f"{prompt_id} is {p.state}, delivered={p.delivered_at is not None}")
    if len(asked) != len(case.answers):
        problems.append(f"{len(asked)} prompts asked, {len(case.answers)} expected")
    return problems


async def run_demo(
    settings: Settings, workers: int = 3, *, embedded: bool = True, logs: Path | None = None
) -> bool:
    """Run the scenario on a fresh local fleet; print transcripts and a verdict; True if OK."""
    workers = max(workers, 2)  # one is killed: the others adopt
    tag = "demo-" + str(ULID())[-6:].lower()
    settings = settings.model_copy(
        update={
            "lease_ttl": 3.0,
            "adopt_interval": 0.2,
            "sweep_interval": 2.0,
            "key_prefix": settings.key_prefix if embedded else f"pbdemo{tag[5:]}",
        }
    )
    fleet = Fleet(settings, workers, log_dir=logs, restart=False)
    print(f"demo: starting {workers} replicas and the audit worker...", flush=True)
    await fleet.start(embedded=embedded)
    await fleet.ready()
    where = fleet.embedded.kind if fleet.embedded else fleet.url
    print(f"demo: on {where}", flush=True)
    started = time.monotonic()
    try:
        async with Broker.from_url(fleet.url, settings) as b:
            return await _scenario(b, fleet, tag, started)
    finally:
        await fleet.stop()


async def _scenario(b: Broker, fleet: Fleet, tag: str, started: float) -> bool:
    cases = _cases(tag)
    for case in cases:
        script = {"script": {"turns": [{"steps": case.steps}]}}
        await b.sessions.create(case.thread, "scripted", "approval", script)
        await b.post_item(case.thread, _text("Please go ahead."))
    print(f"demo: {len(cases)} threads created; waiting for their agents to ask...", flush=True)
    for case in cases:
        await _until(lambda c=case: _active(b, c.thread), 30, f"a prompt on {case.thread}")
    owner = {c.thread: await _owner(b, c.thread) for c in cases}
    # The victim: the replica holding the most of the threads meant for adoption.
    victim = Counter(owner[c.thread] for c in cases if c.victim).most_common(1)[0][0]
    doomed = [c for c in cases if owner[c.thread] == victim]
    print(
        f"demo: killing {victim} (SIGKILL) while it holds {len(doomed)} waiting threads", flush=True
    )
    fleet.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    # Answer everything now: the victim's threads while it is dead and before anyone adopted them.
    await asyncio.gather(*(_answer_next(b, c) for c in cases))
    for case in cases:
        await _until(lambda c=case: _settled(b, c), 30, f"{case.thread} to finish its turn")
    adopted_after = time.monotonic() - killed_at
    for case in cases:
        await _until(lambda c=case: _audited(b, c.thread), 20, f"{case.thread}'s audit items")
    problems = {c.thread: p for c in cases if (p := await _report(b, c, victim, c in doomed))}
    total = sum(len(c.answers) for c in cases)
    elapsed = time.monotonic() - started
    print()
    for thread, found in problems.items():
        for problem in found:
            print(f"demo: PROBLEM {thread}: {problem}")
    if problems:
        n = sum(map(len, problems.values()))
        print(f"demo: FAILED: {n} problems in {len(problems)} threads ({elapsed:.1f} s)")
        return False
    print(
        f"demo: OK: {len(cases)} threads, {total} prompts, each answered, delivered and audited "
        f"exactly once; {victim} was killed holding {len(doomed)} waits, which were adopted and "
        f"resumed elsewhere within {adopted_after:.1f} s ({elapsed:.1f} s in all)"
    )
    return True


async def _owner(b: Broker, thread: str) -> str:
    session = await b.sessions.get(thread)
    return session.owner if session else ""


async def _report(b: Broker, case: Case, victim: str, doomed: bool) -> list[str]:
    """Print the thread's transcript; return what is wrong with it."""
    items = await b.items(case.thread)
    prompts = {}
    for i in items:
        if i.type == "pending_prompt":
            prompt_id = i.metadata["prompt"]["prompt_id"]
            prompts[prompt_id] = await b.get_prompt(case.thread, prompt_id)
    found = _check(case, items, prompts)
    owner = await _owner(b, case.thread)
    if doomed and owner == victim:
        found.append(f"still owned by the killed {victim}")
    print(f"\n== {case.thread}  (held by {owner or 'nobody'})")
    for item in items:
        print(render_item(item))
    return found
