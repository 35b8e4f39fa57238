"""The Claude harness's config: the thread's harness config object, checked.

`parse_config` turns a thread's config (`base_url`, `api_key`, `model`, `max_turns`: see
`workers.agents.claude`) into a `ClaudeConfig`, refusing anything else with `broker.BadItem`
naming the field; `validate_config` only checks one. Pure: no SDK, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker import BadItem

__all__ = ["DEFAULT_MAX_TURNS", "HARNESS", "ClaudeConfig", "parse_config", "validate_config"]

HARNESS = "claude_code"
DEFAULT_MAX_TURNS = 50
_CONFIG_KEYS = ("base_url", "api_key", "model", "max_turns")


@dataclass(frozen=True)
class ClaudeConfig:
    base_url: str | None = None
    api_key: str | None = None
    model: str | None = None
    max_turns: int = DEFAULT_MAX_TURNS


def parse_config(config: object) -> ClaudeConfig:
    """A thread's Claude config, checked; `BadItem` names the field."""
    if not isinstance(config, dict):
        raise BadItem("config", "expected an object")
    for key in config:
        if key not in _CONFIG_KEYS:
            raise BadItem(
                f"config.{key}", f"unknown key; claude_code takes {', '.join(_CONFIG_KEYS)}"
            )
    for key in ("base_url", "api_key", "model"):
        value = config.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise BadItem(f"config.{key}", "expected a non-empty string")
    turns = config.get("max_turns", DEFAULT_MAX_TURNS)
    if type(turns) is not int or turns < 1:
        raise BadItem("config.max_turns", "expected a positive integer")
    return ClaudeConfig(config.get("base_url"), config.get("api_key"), config.get("model"), turns)


def validate_config(config: dict[str, Any]) -> None:
    """Refuse a config the Claude harness cannot run, with `BadItem` naming the field."""
    parse_config(config)
