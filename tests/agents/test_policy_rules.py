"""The guarded policy's rules (workers/agents/policy_rules.py): checking a policy block and the
worker's rules, each malformed place named.

Deciding calls by the rules is in tests/agents/test_policy.py.
"""

from __future__ import annotations

import pytest

from broker import BadItem, Settings
from tests.agents.test_policy import rule
from workers.agents.policy_rules import Policy, parse_policy, parse_rules, validate


@pytest.mark.parametrize(
    ("block", "field"),
    [
        ([], "policy"),
        ({"default": "allow", "rulez": []}, "policy.rulez"),
        ({"default": "maybe"}, "policy.default"),
        ({"rules": {}}, "policy.rules"),
        ({"rules": ["deny"]}, "policy.rules[0]"),
        ({"rules": [{"effect": "exec", "action": "deny"}]}, "policy.rules[0].id"),
        ({"rules": [rule("", "exec", "deny")]}, "policy.rules[0].id"),
        ({"rules": [rule("x" * 129, "exec", "deny")]}, "policy.rules[0].id"),
        (
            {"rules": [rule("a", "exec", "deny"), rule("b", "delete", "deny")]},
            "policy.rules[1].effect",
        ),
        (
            {
                "rules": [
                    rule("a", "read", "allow"),
                    rule("b", "write", "ask"),
                    rule("c", "exec", "maybe"),
                ]
            },
            "policy.rules[2].action",
        ),
        ({"rules": [rule("a", "exec", True)]}, "policy.rules[0].action"),
        ({"rules": [rule("a", "exec", "deny", commands=["rm *"])]}, "policy.rules[0].commands"),
        ({"rules": [rule("a", "write", "deny", command=["rm *"])]}, "policy.rules[0].command"),
        ({"rules": [rule("a", "exec", "deny", command=[])]}, "policy.rules[0].command"),
        ({"rules": [rule("a", "exec", "deny", command="rm *")]}, "policy.rules[0].command"),
        ({"rules": [rule("a", "exec", "deny", command=["rm *", 3])]}, "policy.rules[0].command[1]"),
        (
            {"rules": [rule("a", "exec", "deny", command=["rm *", " "])]},
            "policy.rules[0].command[1]",
        ),
        ({"rules": [rule("a", "write", "deny", outside="home")]}, "policy.rules[0].outside"),
        ({"rules": [rule("a", "exec", "deny", outside="work_folder")]}, "policy.rules[0].outside"),
        ({"rules": [rule("a", "network", "deny", outside="outbox")]}, "policy.rules[0].outside"),
        ({"rules": [rule("a", "exec", "deny"), rule("a", "read", "allow")]}, "policy.rules[1].id"),
    ],
)
def test_malformed_policy_names_the_offending_place(block: object, field: str) -> None:
    """A malformed block raises BadItem naming the rule and field at fault."""
    with pytest.raises(BadItem) as caught:
        validate(block)
    assert caught.value.field == field
    assert "\n" not in str(caught.value)


def test_bad_action_message_says_what_is_allowed() -> None:
    """The message for a bad action lists the actions, so the fix is obvious."""
    with pytest.raises(BadItem, match=r"policy\.rules\[0\]\.action: expected one of 'allow', "):
        validate({"rules": [rule("a", "exec", "maybe")]})


def test_well_formed_policy_parses() -> None:
    """A good block parses; an omitted default is deny and rules keep their order and origin."""
    p = parse_policy(
        {
            "rules": [
                rule("rm", "exec", "deny", command=["rm -rf *"]),
                rule("out", "write", "ask", outside="work_folder"),
                rule("net", "network", "allow"),
            ]
        }
    )
    assert p.default == "deny"
    assert [(r.id, r.origin) for r in p.rules] == [
        ("rm", "thread"),
        ("out", "thread"),
        ("net", "thread"),
    ]
    assert p.rules[0].command == ("rm -rf *",)
    assert p.rules[1].outside == "work_folder"
    assert parse_policy({}) == Policy("deny", ())


def test_worker_rules_are_named_by_their_setting() -> None:
    """Worker rules from the environment parse as worker rules; errors name the variable."""
    s = Settings.from_env(
        {"PROMPT_BROKER_POLICY_RULES": '[{"id": "no-net", "effect": "network", "action": "deny"}]'}
    )
    (r,) = parse_rules(s.policy_rules, "PROMPT_BROKER_POLICY_RULES", "worker")
    assert (r.id, r.origin) == ("no-net", "worker")
    assert Settings().policy_rules == []
    with pytest.raises(BadItem) as caught:
        parse_rules([rule("a", "exec", "nope")], "PROMPT_BROKER_POLICY_RULES", "worker")
    assert caught.value.field == "PROMPT_BROKER_POLICY_RULES[0].action"
    with pytest.raises(BadItem) as caught:
        Settings.from_env({"PROMPT_BROKER_POLICY_RULES": "[{"})
    assert caught.value.field == "PROMPT_BROKER_POLICY_RULES"
