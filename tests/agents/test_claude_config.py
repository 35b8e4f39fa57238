"""The Claude harness's config (`workers.agents.claude_config`): pure, so no SDK and no CLI."""

from __future__ import annotations

from typing import Any

import pytest

from broker import BadItem
from workers.agents.claude_config import parse_config


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ([], "config"),
        ({"base_url": 5}, "config.base_url"),
        ({"max_turns": 0}, "config.max_turns"),
        ({"max_turns": True}, "config.max_turns"),
        ({"script": {}}, "config.script"),
    ],
)
def test_parse_config_names_the_field(config: Any, field: str) -> None:
    with pytest.raises(BadItem) as e:
        parse_config(config)
    assert e.value.field == field
