"""The scripted harness's script and config checking (workers/agents/scripted_script.py): a bad
config is refused naming the field, a good one, every step kind included, is accepted.

Running scripts is in tests/agents/test_scripted.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker import BadItem
from tests.agents.test_scripted import CARDS, DEPLOY, NOTE, PICK, write
from workers.agents.scripted_script import DEFAULT_SCRIPT, validate_config


def script_of(*steps: Any) -> dict[str, Any]:
    return {"script": {"turns": [{"steps": list(steps)}]}}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            script_of({"say": "ok"}, {"say": "ok"}, {"tool": 5}),
            "config.script.turns[0].steps[2].tool",
        ),
        (script_of({"sai": "x"}), "config.script.turns[0].steps[0].sai"),
        (script_of({"say": "x", "loud": True}), "config.script.turns[0].steps[0].loud"),
        (script_of({"say": "x", "fail": "y"}), "config.script.turns[0].steps[0]"),
        (script_of({}), "config.script.turns[0].steps[0]"),
        (script_of("say hi"), "config.script.turns[0].steps[0]"),
        (script_of({"tool": "Bash", "input": "ls"}), "config.script.turns[0].steps[0].input"),
        (script_of({"tool": ""}), "config.script.turns[0].steps[0].tool"),
        (script_of({"ask": []}), "config.script.turns[0].steps[0].ask"),
        (
            script_of({"ask": [{"question": "q", "multiselect": True}]}),
            "config.script.turns[0].steps[0].ask[0].multiselect",
        ),
        (
            script_of({"ask": [{"question": "q", "multiSelect": "yes"}]}),
            "config.script.turns[0].steps[0].ask[0].multiSelect",
        ),
        (
            script_of({"ask": [{"question": "q", "options": [{"label": 1}]}]}),
            "config.script.turns[0].steps[0].ask[0].options[0].label",
        ),
        (script_of({"sleep": "5"}), "config.script.turns[0].steps[0].sleep"),
        (script_of({"sleep": -1}), "config.script.turns[0].steps[0].sleep"),
        (script_of({"sleep": True}), "config.script.turns[0].steps[0].sleep"),
        ({"script": {"turns": [{"match": 3, "steps": []}]}}, "config.script.turns[0].match"),
        ({"script": {"turns": [{"steps": [], "when": "x"}]}}, "config.script.turns[0].when"),
        ({"script": {"turns": [{}]}}, "config.script.turns[0].steps"),
        ({"script": {"entries": []}}, "config.script.turns"),
        ({"script": {"turns": [], "name": "x"}}, "config.script.name"),
        ({"script": []}, "config.script"),
        ({"script": None}, "config.script"),
        ({"scrip": {}}, "config.scrip"),
        ({"script": {"turns": []}, "script_file": "/x.json"}, "config"),
        ({"script_file": "relative.json"}, "config.script_file"),
        ({"script_file": 7}, "config.script_file"),
    ],
)
def test_validate_config_names_the_field(config: dict[str, Any], field: str) -> None:
    """A bad config is refused with BadItem naming the offending field."""
    with pytest.raises(BadItem) as info:
        validate_config(config)
    assert info.value.field == field


def test_validate_config_checks_a_readable_script_file(tmp_path: Path) -> None:
    """A script_file readable at creation is checked then, naming the field inside the file."""
    path = tmp_path / "script.json"
    write(path, {"say": "ok"}, {"tool": ["Bash"]})
    with pytest.raises(BadItem) as info:
        validate_config({"script_file": str(path)})
    assert info.value.field == "config.script_file"
    assert f"{path}: turns[0].steps[1].tool" in info.value.problem


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"script": {"turns": []}},
        script_of(
            {"say": "x"},
            DEPLOY,
            {"tool": "Read", "input": {"file_path": "/a", "limit": 3}},
            {"ask": [PICK, CARDS, NOTE]},
            {"fail": "no"},
            {"sleep": 1},
            {"sleep": 0.25},
        ),
        {"script": DEFAULT_SCRIPT},
    ],
    ids=["empty", "no-turns", "every-step", "default"],
)
def test_validate_config_accepts_good_configs(config: dict[str, Any]) -> None:
    """Well-formed configs, every step kind included, are accepted."""
    validate_config(config)
