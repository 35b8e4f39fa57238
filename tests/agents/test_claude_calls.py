"""The Claude harness's call log, read (`workers.agents.claude_calls`): pure, so no SDK and no CLI.
(Its writing, as a turn runs and is cut off, is tested end to end in test_claude.py.)"""

from __future__ import annotations

from typing import Any

from broker import Answer
from workers.agents.claude_calls import describe, preface, result_record
from workers.agents.harness import Interruption, Resume


def test_describe_reads_the_call_log() -> None:
    """The pure reading of the call log: refusals, deferrals and waits for a person are not in
    flight; an allowed call with no result is; a recorded result ran; an old turn is ignored;
    odd records never raise."""

    def call(i: str, tool: str = "Bash") -> dict[str, Any]:
        return {"e": "call", "id": i, "tool": tool, "detail": f"cmd {i}"}

    old = [{"e": "turn"}, call("a"), {"e": "allowed", "id": "a"}]
    assert describe([*old, {"e": "turn"}]) == ""
    assert describe(old).startswith("Bash `cmd a` was interrupted; it may or may not")
    ran = [*old, result_record("a", False, "(Bash completed with no output)")]
    assert describe(ran) == "Bash `cmd a` ran, exit code 0"
    assert describe([*ran, call("b"), {"e": "asking", "id": "b"}]) == ""  # waits for a person
    assert describe([*ran, call("b"), {"e": "refused", "id": "b"}]) == ""
    assert describe([*ran, call("b"), {"e": "deferred", "id": "b"}]) == ""
    refused = [*ran, call("b"), {"e": "refused", "id": "b"}, result_record("b", True, "Denied")]
    assert describe(refused) == ""  # a refusal's result is not a run
    write = [{"e": "turn"}, call("w", "Write"), result_record("w", True, "EACCES\nmore")]
    assert describe(write) == "Write `cmd w` ran and returned an error: EACCES"
    both = [*old, call("b"), {"e": "allowed", "id": "b"}]
    assert describe(both).count("was interrupted") == 2
    assert describe(None) == describe([]) == describe([5, "x", {"e": "result"}]) == ""
    assert describe([{"e": "call", "id": "z"}]).startswith("`?` was interrupted")


def test_preface_tells_the_delivered_answer_and_the_note() -> None:
    delivered = Resume(
        "prm_1", "approval", "Bash", [Answer(question="q", answer=["yes"])], "approve"
    )
    told = preface(Interruption(delivered=delivered, note="Bash `x` ran, exit code 0"))
    assert "you had been handed the person approved `Bash` (prompt prm_1)" in told
    assert told.endswith("Bash `x` ran, exit code 0.]")
    assert preface(None) == ""
