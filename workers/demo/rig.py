"""What a harness brings to the demo's scenario: the `Rig` interface and the `Case`s it builds.

`workers.demo.scenario` runs a rig's cases (its own scripted rig, or a real agent CLI's from
`workers.demo.cases`) and checks each one: the prompts it asks, the lines its agent prints, the
`Effect`s that must hold afterwards. Both import this module; it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "Effect", "Expected", "Rig"]

#: A check made once the scenario is over: what it checks, and whether it holds.
Effect = tuple[str, Callable[[], bool]]
#: An expected substring of agent output lines, exactly once; a tuple: one of them, once in all.
Expected = str | tuple[str, ...]


@dataclass
class Case:
    """One thread of the scenario: its script, how the person answers, what must come out."""

    thread: str
    steps: list[dict[str, Any]]  # a scripted agent's steps (empty for a real agent)
    answers: list[dict[str, Any]]  # one item per prompt, in order
    # substrings of agent output lines, each exactly once; a tuple: one of them, once in all
    expect: list[Expected]
    victim: bool = False  # asked to be on the replica that gets killed
    prompts: int = 0
    notes: list[str] = field(default_factory=list)
    message: str = "Please go ahead."  # the person's first message
    config: dict[str, Any] | None = None  # a real agent's harness config (None: scripted)
    work_folder: str = ""
    effects: list[Effect] = field(default_factory=list)  # what must hold afterwards


class Rig:
    """What a harness brings to the scenario (`workers.demo.scenario` runs it): the scripted agents
    (`workers.demo.scenario.ScriptedRig`), or a real agent CLI below."""

    harness = "scripted"
    label = "scripted agents"  # the agents, in words
    patience = 30.0  # seconds to wait for one agent step (a real CLI starts slowly)
    session_key: str | None = None  # the harness state's key naming the agent session, if any
    session_word = ""  # that session, in words: "Claude session", "Codex thread"

    def __init__(self) -> None:
        self.env: dict[str, str] = {}  # extra environment for the fleet's processes

    def cases(self, tag: str) -> list[Case]:
        raise NotImplementedError

    def evidence(self, case: Case, doomed: bool) -> list[str]:
        """What else is wrong with the thread, seen from outside the broker (the model's side)."""
        return []

    def close(self) -> None:
        pass
