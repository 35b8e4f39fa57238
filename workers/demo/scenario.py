"""`prompt-broker demo`: a self-driving scenario on a local fleet, checked end to end.

Several threads run scripted agents that ask every kind of prompt; a simulated person answers
with text and with structured answers; one replica is killed (SIGKILL) while it holds waits, its
threads are answered while it is dead and adopted by the others. Then every thread is checked:
each prompt resolved once, each answer delivered once and audited once, each expected line of
agent output present exactly once. The transcripts and a one-line verdict are printed; the exit
status is non-zero if anything was lost or doubled.

`--harness claude_code|codex` runs the same scenario on the real agent CLIs against a fake model
in this process (`workers.demo.cases`), with what those agents can do checked too: the files
approved commands write, the session resumed after the kill, the processes gone with the victim.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ulid import ULID

from broker import Broker, Item, Prompt, Settings
from broker.cli_render import render_item
from workers.demo.cases import agent_rig
from workers.demo.rig import Case, Rig
from workers.runtime.fleet import Fleet

__all__ = ["HARNESSES", "ScriptedRig", "run_demo"]

#: What `--harness` takes: the scripted agents, or a real agent CLI against a fake model.
HARNESSES = ("scripted", "claude_code", "codex")

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


class ScriptedRig(Rig):
    """The scripted agents: no model, no network."""

    def cases(self, tag: str) -> list[Case]:
        return _cases(tag)


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
        either = (expected,) if isinstance(expected, str) else expected
        n = sum(1 for line in outputs if any(e in line for e in either))
        if n != 1:
            shown = repr(expected) if isinstance(expected, str) else " or ".join(map(repr, either))
            problems.append(f"output {shown} seen {n} times")
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
    for end in (i for i in items if i.type == "turn_end"):
        if end.metadata.get("status") != "completed":
            problems.append(f"a turn ended {end.metadata.get('status')}: {end.text}")
    return problems


def _rig(harness: str) -> Rig:
    if harness == "scripted":
        return ScriptedRig()
    if harness not in HARNESSES:
        raise ValueError(f"no demo for {harness!r} (have: {', '.join(HARNESSES)})")
    return agent_rig(harness)


async def run_demo(
    settings: Settings,
    workers: int = 3,
    *,
    embedded: bool = True,
    logs: Path | None = None,
    harness: str = "scripted",
) -> bool:
    """Run the scenario on a fresh local fleet; print transcripts and a verdict; True if OK.

    `harness`: `scripted` (the default), or `claude_code` / `codex` for the real agent CLIs
    against a fake model (`workers.demo.cases`; `missing_cli` says what to install first).
    """
    workers = max(workers, 2)  # one is killed: the others adopt
    tag = "demo-" + str(ULID())[-6:].lower()
    update: dict[str, Any] = {
        "lease_ttl": 3.0,
        "adopt_interval": 0.2,
        "sweep_interval": 2.0,
        "key_prefix": settings.key_prefix if embedded else f"pbdemo{tag[5:]}",
    }
    if harness != "scripted":  # the kill must find real agents waiting in place
        update |= {"wait_mode": "held", "held_waits_max": max(settings.held_waits_max, 8)}
    settings = settings.model_copy(update=update)
    rig = _rig(harness)
    try:
        fleet = Fleet(settings, workers, log_dir=logs, env=rig.env, restart=False)
        started = 0.0
        print(f"demo: starting {workers} replicas and the audit worker...", flush=True)
        try:
            await fleet.start(embedded=embedded)
            await fleet.ready()
            where = fleet.embedded.kind if fleet.embedded else fleet.url
            print(f"demo: on {where}", flush=True)
            started = time.monotonic()
            async with Broker.from_url(fleet.url, settings) as b:
                return await _scenario(b, fleet, rig, tag, started)
        except TimeoutError as e:
            elapsed = time.monotonic() - started if started else 0.0
            hint = "" if logs else " (--logs DIR keeps each process's log)"
            print(f"demo: FAILED: {e} ({elapsed:.1f} s){hint}", flush=True)
            return False
        finally:
            await fleet.stop()
    finally:
        rig.close()


async def _scenario(b: Broker, fleet: Fleet, rig: Rig, tag: str, started: float) -> bool:
    cases = rig.cases(tag)
    patience = rig.patience
    for case in cases:
        config = case.config
        if config is None:
            config = {"script": {"turns": [{"steps": case.steps}]}}
        await b.sessions.create(case.thread, rig.harness, "approval", config, case.work_folder)
        await b.post_item(case.thread, _text(case.message))
    print(f"demo: {len(cases)} threads created; waiting for their agents to ask...", flush=True)
    for case in cases:
        await _until(lambda c=case: _active(b, c.thread), patience, f"a prompt on {case.thread}")
    owner = {c.thread: await _owner(b, c.thread) for c in cases}
    agent = {c.thread: await _agent_session(b, c.thread, rig.session_key) for c in cases}
    # The victim: the replica holding the most of the threads meant for adoption.
    victim = Counter(owner[c.thread] for c in cases if c.victim).most_common(1)[0][0]
    doomed = [c for c in cases if owner[c.thread] == victim]
    proc = fleet.replica(victim).proc
    children = _descendants(proc.pid) if proc is not None else []
    print(
        f"demo: killing {victim} (SIGKILL) while it holds {len(doomed)} waiting threads", flush=True
    )
    fleet.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    # Answer everything now: the victim's threads while it is dead and before anyone adopted them.
    await asyncio.gather(*(_answer_next(b, c, patience) for c in cases))
    for case in cases:
        await _until(lambda c=case: _settled(b, c), 2 * patience, f"{case.thread} to finish")
    adopted_after = time.monotonic() - killed_at
    for case in cases:
        await _until(lambda c=case: _audited(b, c.thread), 20, f"{case.thread}'s audit items")
    problems: dict[str, list[str]] = {}
    for c in cases:
        found = await _report(b, rig, c, victim=victim, doomed=c in doomed, agent=agent[c.thread])
        if found:
            problems[c.thread] = found
    outlived = await _outlived(children)
    if outlived:
        problems[victim] = [
            f"{len(outlived)} of its child processes (agent CLIs) outlived it: pids {outlived}, "
            "killed now"
        ]
    elif children:
        print(f"\ndemo: the {len(children)} processes under {victim} (its agent CLIs) died with it")
    elapsed = time.monotonic() - started
    return _verdict(rig, cases, problems, victim, len(doomed), adopted_after, elapsed)


def _verdict(  # noqa: PLR0917 - the scenario's numbers
    rig: Rig,
    cases: list[Case],
    problems: dict[str, list[str]],
    victim: str,
    doomed: int,
    adopted_after: float,
    elapsed: float,
) -> bool:
    """Print the problems and the one-line verdict; True when there were none."""
    print()
    for thread, found in problems.items():
        for problem in found:
            print(f"demo: PROBLEM {thread}: {problem}")
    if problems:
        n = sum(map(len, problems.values()))
        print(f"demo: FAILED: {n} problems in {len(problems)} threads ({elapsed:.1f} s)")
        return False
    total = sum(len(c.answers) for c in cases)
    on = "" if rig.harness == "scripted" else f" on {rig.label}"
    same = f" (each in the same {rig.session_word})" if rig.session_key else ""
    print(
        f"demo: OK: {len(cases)} threads{on}, {total} prompts, each answered, delivered and "
        f"audited exactly once; {victim} was killed holding {doomed} waits, which were "
        f"adopted and resumed elsewhere{same} within {adopted_after:.1f} s ({elapsed:.1f} s in all)"
    )
    return True


async def _owner(b: Broker, thread: str) -> str:
    session = await b.sessions.get(thread)
    return session.owner if session else ""


async def _agent_session(b: Broker, thread: str, key: str | None) -> str | None:
    """The agent session the thread's harness state names (its Claude session, Codex thread)."""
    if key is None:
        return None
    session = await b.sessions.get(thread)
    value = (session.state or {}).get(key) if session is not None else None
    return value if isinstance(value, str) else None


async def _report(
    b: Broker, rig: Rig, case: Case, *, victim: str, doomed: bool, agent: str | None
) -> list[str]:
    """Print the thread's transcript and what was checked; return what is wrong with it."""
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
    adopted = f"; adopted from the killed {victim}" if doomed else ""
    print(f"\n== {case.thread}  (held by {owner or 'nobody'}{adopted})")
    for item in items:
        print(render_item(item))
    checks: list[tuple[str, bool]] = [(what, holds()) for what, holds in case.effects]
    if rig.session_key is not None:
        after = await _agent_session(b, case.thread, rig.session_key)
        same = agent is not None and after == agent
        checks.append((f"the same {rig.session_word} throughout: {agent}", same))
    for what, ok in checks:
        print(f"  {'✓' if ok else '✗'} {what}")
        if not ok:
            found.append(f"not so: {what}")
    found += rig.evidence(case, doomed)
    return found


def _descendants(pid: int) -> list[int]:
    """Every live descendant of process `pid` (Linux /proc; elsewhere none are found)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an unreaped orphan (a zombie) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


async def _outlived(pids: list[int], within: float = 15.0) -> list[int]:
    """The processes of the killed replica (its agent CLIs) still running after `within`
    seconds; they are killed, so the demo leaves nothing behind."""
    left = [p for p in pids if _alive(p)]
    for _ in range(int(within / 0.2)):
        if not left:
            break
        await asyncio.sleep(0.2)
        left = [p for p in left if _alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left
