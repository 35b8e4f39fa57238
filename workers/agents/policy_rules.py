"""The guarded policy's rules: the rule model and the checking of a policy block.

A `Rule` is one checked rule (its id, effect, action, command globs and `outside`), a `Policy` a
thread's checked block (its default and rules). `parse_rules` checks a list of rules (the worker's
`Settings.policy_rules`, a thread's), `parse_policy` a thread's block, and `validate` refuses a
malformed one; each raises `broker.BadItem` naming the offending place. The block's format and
what each rule means are described in `workers.agents.policy`, which decides calls by these rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from broker import BadItem

__all__ = [
    "ACTIONS",
    "MAX_ID",
    "Action",
    "Effect",
    "Origin",
    "Outside",
    "Policy",
    "Rule",
    "parse_policy",
    "parse_rules",
    "validate",
]

Effect = Literal["read", "write", "exec", "network"]
Action = Literal["allow", "deny", "ask"]
Outside = Literal["", "work_folder", "outbox"]
Origin = Literal["worker", "thread"]

ACTIONS: tuple[Action, ...] = ("allow", "deny", "ask")
_EFFECTS: tuple[Effect, ...] = ("read", "write", "exec", "network")
_OUTSIDES: tuple[Outside, ...] = ("", "work_folder", "outbox")
_RULE_KEYS = ("id", "effect", "action", "command", "outside")

#: The longest rule id.
MAX_ID = 128


@dataclass(frozen=True)
class Rule:
    """One checked rule."""

    id: str
    effect: Effect
    action: Action
    command: tuple[str, ...] = ()
    outside: Outside = ""
    origin: Origin = "thread"


@dataclass(frozen=True)
class Policy:
    """A thread's checked policy block."""

    default: Action = "deny"
    rules: tuple[Rule, ...] = ()


def _choice(raw: Mapping[str, Any], key: str, allowed: Sequence[str], where: str) -> Any:
    value = raw.get(key)
    if not isinstance(value, str) or value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise BadItem(f"{where}.{key}", f"expected one of {shown}, got {value!r}")
    return value


def _globs(raw: Mapping[str, Any], effect: str, where: str) -> tuple[str, ...]:
    if "command" not in raw:
        return ()
    if effect != "exec":
        raise BadItem(f"{where}.command", f"only exec rules take command globs, not {effect}")
    value = raw["command"]
    if not isinstance(value, list) or not value:
        raise BadItem(f"{where}.command", "expected a non-empty list of globs (omit it for all)")
    for j, glob in enumerate(value):
        if not isinstance(glob, str) or not glob.strip():
            raise BadItem(f"{where}.command[{j}]", "expected a non-empty glob string")
    return tuple(value)


def _rule(raw: object, where: str, origin: Origin) -> Rule:
    if not isinstance(raw, Mapping):
        raise BadItem(where, "expected a rule object ({id, effect, action, ...})")
    for key in raw:
        if key not in _RULE_KEYS:
            raise BadItem(f"{where}.{key}", f"unknown field (a rule has {', '.join(_RULE_KEYS)})")
    rule_id = raw.get("id")
    if not isinstance(rule_id, str) or not rule_id.strip() or len(rule_id) > MAX_ID:
        raise BadItem(f"{where}.id", f"expected a string of 1 to {MAX_ID} characters naming it")
    effect = _choice(raw, "effect", _EFFECTS, where)
    action = _choice(raw, "action", ACTIONS, where)
    outside: Outside = _choice(raw, "outside", _OUTSIDES, where) if "outside" in raw else ""
    if outside and effect not in ("read", "write"):
        raise BadItem(f"{where}.outside", f"only read and write rules take outside, not {effect}")
    return Rule(rule_id, effect, action, _globs(raw, effect, where), outside, origin)


def parse_rules(raw: object, where: str, origin: Origin = "thread") -> tuple[Rule, ...]:
    """Check a list of rules; `BadItem` names the first bad one as `<where>[i].<field>`."""
    if not isinstance(raw, list):
        raise BadItem(where, "expected a list of rules")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        rule = _rule(item, f"{where}[{i}]", origin)
        if rule.id in seen:
            raise BadItem(
                f"{where}[{i}].id", f"duplicate id {rule.id!r} (also at [{seen[rule.id]}])"
            )
        seen[rule.id] = i
        rules.append(rule)
    return tuple(rules)


def parse_policy(raw: object, where: str = "policy") -> Policy:
    """Check a thread's policy block; `BadItem` names the offending place under `where`."""
    if not isinstance(raw, Mapping):
        raise BadItem(where, 'expected an object: {"default": ..., "rules": [...]}')
    for key in raw:
        if key not in ("default", "rules"):
            raise BadItem(f"{where}.{key}", "unknown field (a policy has default and rules)")
    default: Action = _choice(raw, "default", ACTIONS, where) if "default" in raw else "deny"
    rules = parse_rules(raw["rules"], f"{where}.rules") if "rules" in raw else ()
    return Policy(default, rules)


def validate(raw: object) -> None:
    """Refuse a malformed policy block with `BadItem` naming the offending rule."""
    parse_policy(raw)
