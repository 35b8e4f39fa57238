"""The guarded policy's shell analysis (workers/agents/policy_shell.py): a command line splits
into its simple commands, and any text at all splits without raising.

What the policy decides of the parts is in tests/agents/test_policy.py; commands built to slip
past the analysis are in tests/agents/test_policy_adversarial.py.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.agents.test_policy import SEPARATORS, SIMPLE
from workers.agents.policy_shell import commands


@given(st.lists(SIMPLE, min_size=1, max_size=5), st.data())
def test_split_finds_the_parts_joined_by_separators(parts: list[str], data: st.DataObject) -> None:
    """Simple commands joined by any separators split back into those commands."""
    line = parts[0]
    for part in parts[1:]:
        line += data.draw(SEPARATORS) + part
    assert commands(line) == parts


@given(st.text(max_size=40))
def test_single_quoted_text_is_never_split(inner: str) -> None:
    """Whatever a single-quoted argument holds, the command stays one part (a NUL ends the
    grammar's reading, and is asked about: tests/agents/test_policy_adversarial.py)."""
    inner = inner.replace("'", "").replace("\0", "")
    assert commands(f"echo '{inner}'") == [f"echo '{inner}'"]


@given(st.text(max_size=60))
def test_commands_never_raises_on_any_text(line: str) -> None:
    """Any text at all (unbalanced quotes, stray parens) splits without raising."""
    parts = commands(line)
    assert all(isinstance(p, str) and p for p in parts)
