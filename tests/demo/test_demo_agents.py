"""`prompt-broker demo --harness claude_code|codex`: the demo on the real agent CLIs.

Real processes end to end (`python -m workers.runtime.cli demo --harness ...`: its own redis-server,
the replicas, the real CLI against the fake model in the demo's process), skipped with the reason
when that CLI is not installed; the one-line errors; and the fake model's scripts, whose every
path (held, resumed after the kill, parked) the real runs reach only where the threads land.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workers.demo import cases as demo_agents
from workers.demo.cases import (
    SECTIONS,
    TARGET,
    _claude_approval,
    _claude_ask,
    missing_cli,
)

CLAUDE_MISSING = missing_cli("claude_code")
CODEX_MISSING = missing_cli("codex")


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    return subprocess.run(
        [sys.executable, "-m", "workers.runtime.cli", "demo", *args],
        env=clean | (env or {}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def passed(run: subprocess.CompletedProcess[str], label: str) -> None:
    """Exit 0, the OK verdict, a killed replica's threads resumed in the same agent sessions,
    and the demo's temporary folder (work folders, the CLIs' scratch) gone."""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    verdict = run.stdout.strip().splitlines()[-1]
    assert verdict.startswith(f"demo: OK: 6 threads on {label}"), verdict
    assert "6 prompts, each answered, delivered and audited exactly once" in verdict
    assert "adopted from the killed replica-" in run.stdout
    assert "died with it" in run.stdout  # the killed replica's CLIs did not linger
    assert "✗" not in run.stdout
    roots = set(re.findall(r"/\S*pb-demo-[A-Za-z0-9_]+", run.stdout))
    assert roots and not any(Path(r).exists() for r in roots)


@pytest.mark.slow
@pytest.mark.skipif(CLAUDE_MISSING is not None, reason=str(CLAUDE_MISSING))
def test_demo_on_the_real_claude_code_cli() -> None:
    passed(demo("--harness", "claude_code"), "the real Claude Code CLI")


@pytest.mark.slow
@pytest.mark.skipif(CODEX_MISSING is not None, reason=str(CODEX_MISSING))
def test_demo_on_the_real_codex_cli() -> None:
    passed(demo("--harness", "codex"), "the real Codex CLI")


def test_demo_unknown_harness_is_refused_with_the_choices() -> None:
    """An unknown `--harness` is argparse's usage error naming the choices: exit 2, no traceback,
    nothing started."""
    run = demo("--harness", "gpt")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == (
        "prompt-broker demo: error: argument --harness: invalid choice: 'gpt' "
        "(choose from 'scripted', 'claude_code', 'codex')"
    )
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


def test_demo_without_the_codex_cli_says_how_to_install_it(tmp_path: Path) -> None:
    """`$CODEX_BIN` naming nothing executable: Codex counts as not installed."""
    run = demo("--harness", "codex", env={"CODEX_BIN": str(tmp_path / "no-codex")})
    assert run.returncode == 2
    assert run.stderr.startswith("prompt-broker: error: --harness codex: the Codex CLI is not")
    assert "`npm ci`" in run.stderr and run.stderr.count("\n") == 1


def test_missing_claude_code_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_agents.importlib.util, "find_spec", lambda _name: None)
    missing = missing_cli("claude_code")
    assert missing is not None and "pip install -e '.[claude]'" in missing


# -- the fake model's scripts, on every path ---------------------------------------------------


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def said(words: str) -> dict[str, Any]:
    return {"type": "text", "text": words}


def result(words: str, error: bool = False) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "toolu_1", "content": words, "is_error": error}


def reply(script: list[Any], *messages: dict[str, Any]) -> dict[str, Any]:
    """The model's (single) block after `messages`."""
    convo = [user(said("t: please go ahead.")), *messages]
    index = sum(1 for m in convo if m["role"] == "assistant")
    step = script[index]
    (block,) = step(convo) if callable(step) else step
    return dict(block)


CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash"}]}


@pytest.mark.parametrize(
    ("told", "then"),
    [
        (user(result("Bash completed")), "ran"),  # held, approved
        (user(result("The person denied this Bash call.", True)), "refused"),  # held, denied
        (user(result("[Tool call interrupted]", True), said("... was APPROVED ...")), "call"),
        (user(result("[Tool call interrupted]", True), said("... was DENIED ...")), "refused"),
        (user(result("Approval unavailable: waiting", True)), "call"),  # parked: ask again
    ],
)
def test_claude_approval_script_on_every_path(told: dict[str, Any], then: str) -> None:
    script = _claude_approval("echo hi > x", "Say hi", "ran", "refused")
    first = reply(script)
    assert first["name"] == "Bash" and first["input"]["command"] == "echo hi > x"
    got = reply(script, CALL, told)
    if then == "call":
        assert got["type"] == "tool_use" and got["input"]["command"] == "echo hi > x"
    else:
        assert got == {"type": "text", "text": then}


@pytest.mark.parametrize(
    "told",
    [
        # held: the AskUserQuestion call's result, in the SDK's words
        user(
            result(
                f'User has answered your questions: "{TARGET}"="staging", "{SECTIONS}"="KPI '
                'cards, Chart". You can now continue.'
            )
        ),
        # resumed after the kill: the interrupted call, and the resume text
        user(
            result("[Tool call interrupted]", True),
            said(f"The person answered:\n- {TARGET}: staging\n- {SECTIONS}: KPI cards, Chart"),
        ),
    ],
)
def test_claude_ask_script_repeats_the_answers_either_way(told: dict[str, Any]) -> None:
    script = _claude_ask()
    assert reply(script)["name"] == "AskUserQuestion"
    got = reply(script, CALL, told)
    assert got == {"type": "text", "text": "Deploying to staging with KPI cards, Chart."}


# -- the demo's modules ------------------------------------------------------------------------


def _imported(module: Path) -> set[str]:
    """Every module `module` imports, at any depth of its code (function bodies included)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_demo_modules_import_one_way() -> None:
    """`workers.demo.scenario` imports `workers.demo.cases`, never the other way round: no
    circle."""
    workers = Path(__file__).resolve().parents[2] / "workers"
    assert "workers.demo.cases" in _imported(workers / "demo" / "scenario.py")
    assert not {"workers.demo.scenario", "workers.demo"} & _imported(workers / "demo" / "cases.py")
