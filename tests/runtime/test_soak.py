"""The fault soak (bench/soak.py): its checker catches what it must, and a short soak is clean.

The checker is fed records with planted faults (an answer lost, one resolved twice, a command run
twice, ...) and must name each; the same records without them must pass. Then the soak itself
runs for about 30 s: real replica processes and the audit worker on a private redis-server, faults
on a fixed seed's schedule, and zero violations.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from broker import Answer, Item, Prompt, Question

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import soak  # noqa: E402 - bench/ is not a package

NOW = datetime(2026, 12, 1, tzinfo=UTC)
IDS = itertools.count()
T = "soak000"


def approval(pid: str, mark: str, label: str, **fields: Any) -> Prompt:
    q = Question(question=f"Allow `Bash`?\n\n`echo MARK-{mark} | tee -a /x`", subject="Bash")
    answers = [Answer(question=q.question, answer=[label])]
    return Prompt(
        prompt_id=pid,
        thread_id=T,
        kind="approval",
        questions=[q],
        state="answered",
        item_id=f"itm_{pid}",
        created_at=NOW,
        answers=answers,
        answer_item_id=f"ans_{pid}",
        delivered_at=NOW,
        audit_item_id=f"aud_{pid}",
        **fields,
    )


def item(type_: str, text: str = "", **metadata: Any) -> Item:
    return Item(
        id=f"itm_{next(IDS)}",
        author="prompt-broker",
        content=[{"type": "text", "text": text}],
        metadata={"type": type_, **metadata},
        created_at=NOW,
    )


def resolved(p: Prompt) -> Item:
    prompt = {"prompt_id": p.prompt_id, "kind": p.kind, "prompt_state": p.state}
    prompt["answers"] = [a.model_dump() for a in p.answers or []]
    return Item(
        id=p.audit_item_id or "",
        author="prompt-broker",
        content=[],
        metadata={"type": "pending_prompt_resolved", "prompt": prompt, "surface": "soak-a"},
        created_at=NOW,
    )


def acked(p: Prompt) -> soak.Attempt:
    answers = [a.model_dump() for a in p.answers or []]
    a = soak.Attempt(T, "a", "named-text", p.prompt_id, "answered", p.prompt_id, p.answer_item_id)
    a.answers = answers
    return a


def records(folder: Path, *, planted: bool) -> soak.Checker:
    """One thread's records after a run: two approvals, clean or with every fault planted."""
    ok = approval("prm_1", f"{T}.0", "Approve")
    denied = approval("prm_2", f"{T}.1", "Deny")
    lines = [f"Ran Bash `echo MARK-{T}.0 | tee -a /x`:\nMARK-{T}.0", f"END {T}.0"]
    lines += [
        f"Did not run Bash `echo MARK-{T}.1 | tee -a /x`: the person denied it.",
        f"END {T}.1",
    ]
    attempts = [acked(ok), acked(denied)]
    ran = [f"MARK-{T}.0"]
    grants = [item("approval_granted", granted_by="prm_1")]
    prompts = [ok, denied]
    logs = ['{"event": "turn.resume", "prompt_id": "prm_1"}']
    if planted:
        lines.append(lines[0])  # the command's output said twice
        ran += [f"MARK-{T}.0", f"MARK-{T}.1"]  # run twice; a denied one run
        attempts.append(acked(ok))  # a second answer acknowledged for one prompt
        attempts[-1].item_id = "ans_other"  # ... and it is not the recorded one: lost
        grants += [item("approval_granted", granted_by="prm_1")]  # a second grant
        grants += [item("approval_granted", granted_by="prm_2")]  # a grant for a denial
        prompts.append(
            approval(
                "prm_3",
                f"{T}.2",
                "Approve",
            ).model_copy(update={"delivered_at": None, "audit_item_id": None})
        )  # answered, never delivered
        logs += ['{"event": "prompt.delivered", "first": true, "prompt_id": "prm_1"}']
        logs += ["Task exception was never retrieved"]
        lines.append("My previous turn was interrupted before it ended. I will not repeat it.")
    items = [item("agent_output", line) for line in lines] + grants
    items += [resolved(p) for p in prompts if p.delivered_at]
    if planted:
        items.append(resolved(ok))  # audited twice
    (folder / "logs").mkdir()
    (folder / "logs" / "held-1.log").write_text("\n".join(logs) + "\n")
    (folder / "ran.txt").write_text("\n".join(ran) + "\n")
    found: list[str] = []
    run = SimpleNamespace(
        attempts=attempts,
        folder=folder,
        threads={T: SimpleNamespace(kinds=["approval"] * 3)},
        violation=lambda kind, *rest: found.append(kind),
        observer=None,
    )
    checker = soak.Checker(run)  # type: ignore[arg-type]
    checker.items = {T: items}
    checker.audit_items = {i.id: i.metadata for i in items if i.type == "pending_prompt_resolved"}
    checker.prompts = {p.prompt_id: p for p in prompts}
    checker.found = found  # type: ignore[attr-defined]
    return checker


def judge(checker: soak.Checker) -> list[str]:
    checker.answers()
    checker.audit()
    checker.grants()
    checker.outputs()
    checker.runs()
    checker.logs()
    return sorted(checker.found)  # type: ignore[attr-defined]


def test_checker_passes_clean_records(tmp_path: Path) -> None:
    """Records of a run where everything happened once, as it should, give no violation."""
    assert judge(records(tmp_path, planted=False)) == []


def test_checker_names_every_planted_fault(tmp_path: Path) -> None:
    """Each planted fault is reported under its own kind."""
    assert judge(records(tmp_path, planted=True)) == sorted(
        [
            "resolved_twice",  # two answers acknowledged for prm_1
            "lost",  # ... and one of them is not the recorded answer
            "lost",  # prm_3 answered, never delivered
            "audit_count",  # prm_1 audited twice
            "granted_twice",  # prm_1
            "grant_unearned",  # prm_2 was denied
            "said_twice",  # MARK-0's output line
            "ran_twice",  # MARK-0 in the file twice
            "ran_unapproved",  # MARK-1 was denied, yet ran
            "handed_twice",  # a resume and a held delivery of prm_1
            "log",  # a task exception nobody retrieved
            "told_twice",  # an interruption told that never happened
        ]
    )


def test_checker_sees_a_wrong_answer(tmp_path: Path) -> None:
    """An agent that says it ran a command the person denied is caught."""
    checker = records(tmp_path, planted=False)
    checker.items[T][2] = item("agent_output", f"Ran Bash `echo MARK-{T}.1 | tee -a /x`:\nMARK")
    assert "wrong_answer" in judge(checker)


@pytest.mark.slow
@pytest.mark.real_redis
def test_short_soak_has_no_violations(tmp_path: Path) -> None:
    """About 30 s of jobs, racing answers and faults (replica kill -9 and SIGSTOP, pub/sub kills,
    audit worker kill -9, one Redis kill -9): the checker finds nothing wrong."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    out = tmp_path / "summary.json"
    argv = [sys.executable, str(ROOT / "bench" / "soak.py"), "--seed", "3", "--threads", "12"]
    argv += ["--seconds", "30", "--replicas", "3", "--folder", str(tmp_path / "run")]
    argv += ["--json", str(out)]
    proc = subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    summary = orjson.loads(out.read_bytes())
    if summary.get("evidence"):
        print(Path(summary["evidence"]).read_text()[:20000])
    assert summary["violations"] == {}, summary["violations"]
    assert proc.returncode == 0
    assert summary["prompts"] >= 50 and summary["answers"] >= 40, summary
    assert summary["commands_run"] > 0 and summary["output_lines_checked"] > 0, summary
    assert summary["faults"].get("redis_kill9") == 1, summary["faults"]
    assert sum(summary["faults"].values()) >= 5, summary["faults"]


def sampler(found: list[str]) -> soak.Soak:
    """The soak's sampler state, with no processes or Redis behind it."""
    run = soak.Soak.__new__(soak.Soak)
    run.seen = {pid: soak.Seen(T) for pid in ("prm_1", "prm_2")}
    run.procs = [SimpleNamespace(name="held-1"), SimpleNamespace(name="audit")]  # type: ignore[list-item]
    run.redis_back_at = 0.0
    run.reported = set()
    run.violation = lambda kind, *rest: found.append(kind)  # type: ignore[method-assign]
    return run


def test_sampler_sees_two_pending_a_wrong_lock_and_a_stranded_prompt() -> None:
    """A snapshot with two pending prompts, the lock on neither, and the open prompt held by no
    live lease for longer than allowed is reported three ways; a healthy one is not."""
    found: list[str] = []
    run = sampler(found)
    wait = orjson.dumps({"prompt_id": "prm_2"}).decode()
    run.judge(T, {"prm_1": "answered", "prm_2": "pending"}, "prm_2", ["held-1", "2000", wait], 1000)
    assert found == []
    run.seen["prm_2"].stranded_since = soak.time.monotonic() - soak.STRANDED_AFTER - 1
    run.judge(T, {"prm_1": "pending", "prm_2": "pending"}, None, ["gone", "0", wait], 1000)
    assert sorted(found) == ["lock_mismatch", "stranded", "two_pending"]


@pytest.mark.skipif(not soak.SURFACE_NAMES, reason="this checkout's post_item names no surface")
def test_checker_sees_an_audit_item_naming_another_surface(tmp_path: Path) -> None:
    """An answer made through one surface but audited as another's is caught."""
    checker = records(tmp_path, planted=False)
    audited = next(iter(checker.audit_items))
    checker.audit_items[audited] = {**checker.audit_items[audited], "surface": "soak-b"}
    assert judge(checker) == ["audit_fields"]
