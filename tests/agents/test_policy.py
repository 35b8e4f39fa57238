"""The guarded policy's pure rules (workers/agents/policy.py): effects, matching, the verdict.

No Redis, no replica: the replica's use of them is in tests/agents/test_guarded.py; checking a
policy block is in tests/agents/test_policy_rules.py.
"""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.agents import policy
from workers.agents.harness import GateVerdict
from workers.agents.policy import (
    EVALUATION_ERROR,
    MAX_REPORTED,
    Guard,
    classify,
    denied_item,
    parse_policy,
    parse_rules,
    refusal,
)
from workers.agents.policy_shell import commands

WORK = "/work/proj"
COMMAND = "item/commandExecution/requestApproval"
FILE_CHANGE = "item/fileChange/requestApproval"
PERMISSIONS = "item/permissions/requestApproval"


def rule(id_: str, effect: str, action: str, **more: Any) -> dict[str, Any]:
    return {"id": id_, "effect": effect, "action": action, **more}


def guard(
    *rules: dict[str, Any],
    default: str | None = "ask",
    worker: list[dict[str, Any]] | None = None,
    work_folder: str = WORK,
) -> Guard:
    block: dict[str, Any] = {"rules": list(rules)}
    if default is not None:
        block["default"] = default
    worker_rules = parse_rules(worker or [], "worker", "worker")
    return Guard(worker_rules, parse_policy(block), work_folder)


def bash(g: Guard, command: str) -> GateVerdict:
    return g.decide("claude_code", "Bash", {"command": command})


def write(g: Guard, path: str | None, tool: str = "Write") -> GateVerdict:
    return g.decide("claude_code", tool, {} if path is None else {"file_path": path})


# -- effects -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "effect"),
    [
        ("Write", "write"),
        ("Edit", "write"),
        ("MultiEdit", "write"),
        ("NotebookEdit", "write"),
        ("Bash", "exec"),
        ("BashOutput", "exec"),
        ("KillShell", "exec"),
        ("Read", "read"),
        ("Glob", "read"),
        ("Grep", "read"),
        ("NotebookRead", "read"),
        ("WebFetch", "network"),
        ("WebSearch", "network"),
        ("mcp__harness__ask_user", None),
        ("Task", None),
        ("bash", None),  # names are case-sensitive
    ],
)
@pytest.mark.parametrize("harness", ["claude_code", "scripted"])
def test_claude_tool_names_map_to_effects(harness: str, tool: str, effect: str | None) -> None:
    """Claude Code's tool names (and the scripted harness's, the same) map to their effects."""
    assert classify(harness, tool, {}).effect == effect


@pytest.mark.parametrize(
    ("method", "effect"),
    [(COMMAND, "exec"), (FILE_CHANGE, "write"), (PERMISSIONS, None), ("Bash", None)],
)
def test_codex_methods_map_to_effects(method: str, effect: str | None) -> None:
    """Codex's approval methods map to exec and write; its permissions request to nothing."""
    assert classify("codex", method, {"command": "ls"}).effect == effect


def test_call_detail_is_command_else_path_else_tool() -> None:
    """The detail a verdict carries is the command, else the path, else the tool's name."""
    assert classify("claude_code", "Bash", {"command": "ls -l"}).detail == "ls -l"
    assert classify("claude_code", "Edit", {"file_path": "/a/b.py"}).detail == "/a/b.py"
    assert classify("claude_code", "NotebookEdit", {"notebook_path": "n.ipynb"}).detail == "n.ipynb"
    assert classify("claude_code", "Grep", {"pattern": "x", "path": "src"}).detail == "src"
    assert classify("claude_code", "WebFetch", {"url": "https://x"}).detail == "WebFetch"
    assert classify("codex", FILE_CHANGE, {"reason": None}).detail == FILE_CHANGE


def test_codex_command_is_unwrapped_from_its_shell() -> None:
    """Codex sends `/bin/bash -lc '<command>'` (or argv): the command is what is inside."""
    assert classify("codex", COMMAND, {"command": "/bin/bash -lc 'git status'"}).command == (
        "git status"
    )
    assert classify("codex", COMMAND, {"command": ["git", "log", "-1"]}).command == "git log -1"
    assert classify("codex", COMMAND, {"command": "make test"}).command == "make test"
    assert classify("codex", COMMAND, {}).command is None


def test_unmapped_calls_get_the_default() -> None:
    """A call that maps to no effect matches no rule (not even a catch-all) and gets the default."""
    g = guard(rule("all-exec", "exec", "allow"), rule("all-read", "read", "allow"), default="deny")
    v = g.decide("codex", PERMISSIONS, {"permissions": {}})
    assert (v.action, v.rule, v.effect, v.detail) == ("deny", "", "", PERMISSIONS)
    assert g.decide("claude_code", "mcp__harness__ask_user", {}).action == "deny"
    assert guard(default="allow").decide("claude_code", "Task", {}).action == "allow"


# -- order ---------------------------------------------------------------------------------------


def test_first_match_wins() -> None:
    """Of several matching rules the first decides."""
    g = guard(
        rule("ask-make", "exec", "ask", command=["make *"]),
        rule("allow-make", "exec", "allow", command=["make *"]),
    )
    assert bash(g, "make deploy") == GateVerdict("ask", "ask-make", "exec", "make deploy")
    g = guard(
        rule("allow-make", "exec", "allow", command=["make *"]),
        rule("ask-make", "exec", "ask", command=["make *"]),
    )
    assert bash(g, "make deploy").rule == "allow-make"


def test_worker_rules_come_before_the_threads() -> None:
    """A worker's deny cannot be relaxed by a thread's allow; a worker's allow wins too."""
    worker = [
        rule("w-no-push", "exec", "deny", command=["git push*"]),
        rule("w-read", "read", "allow"),
    ]
    g = guard(
        rule("t-all", "exec", "allow", command=["*"]),
        rule("t-no-read", "read", "deny"),
        worker=worker,
    )
    v = bash(g, "git push origin main")
    assert (v.action, v.rule) == ("deny", "w-no-push")
    assert bash(g, "ls").rule == "t-all"
    assert g.decide("claude_code", "Read", {"file_path": "/etc/passwd"}).rule == "w-read"


def test_default_applies_when_nothing_matches_and_is_deny_when_omitted() -> None:
    """No rule matching gives the thread's default; a policy with no default denies."""
    assert bash(guard(default="allow"), "ls") == GateVerdict("allow", "", "exec", "ls")
    assert bash(guard(default="ask"), "ls").action == "ask"
    assert bash(guard(default=None), "ls") == GateVerdict("deny", "", "exec", "ls")


# -- exec: whole commands and segments -----------------------------------------------------------


def test_allow_matches_the_whole_command_only() -> None:
    """An allow rule never matches one segment of a compound command."""
    g = guard(rule("rm-build", "exec", "allow", command=["rm -rf build"]))
    assert bash(g, "rm -rf build").action == "allow"
    assert bash(g, "cd src && rm -rf build").action == "ask"
    assert bash(g, "rm -rf build; rm -rf /").action == "ask"


def test_allow_star_does_not_carry_a_second_command() -> None:
    """`git push*` allows a push, not `git push && rm -rf /`: every part must match too."""
    g = guard(rule("push", "exec", "allow", command=["git push*"]))
    assert bash(g, "git push origin main").action == "allow"
    assert bash(g, "git push && rm -rf /").action == "ask"
    assert bash(g, "git push | sh").action == "ask"
    assert bash(g, "git push $(rm -rf /)").action == "ask"
    assert bash(g, "git push && git push --tags").action == "allow"


def test_deny_and_ask_match_any_segment() -> None:
    """`git push && rm -rf /` is denied by a rule about `rm -rf`, even after an allow would
    have matched its first part."""
    g = guard(
        rule("no-rm", "exec", "deny", command=["rm -rf *"]),
        rule("push", "exec", "allow", command=["git push*"]),
        rule("ask-curl", "exec", "ask", command=["curl *"]),
        default="allow",
    )
    v = bash(g, "git push && rm -rf /")
    assert (v.action, v.rule, v.detail) == ("deny", "no-rm", "git push && rm -rf /")
    for separator in ("&&", "||", ";", "|", "&", "\n", "|&"):
        assert bash(g, f"ls {separator} rm -rf /tmp/x").rule == "no-rm", separator
    assert bash(g, "echo hi | curl -d @- x.example").rule == "ask-curl"
    assert bash(g, "echo hi").action == "allow"


def test_allow_before_deny_is_not_a_hole() -> None:
    """Even when the allow comes first, its star cannot let the denied part through."""
    g = guard(
        rule("push", "exec", "allow", command=["git push*"]),
        rule("no-rm", "exec", "deny", command=["rm -rf *"]),
    )
    assert bash(g, "git push && rm -rf /").rule == "no-rm"


def test_env_prefixed_commands() -> None:
    """Leading env assignments are stripped for deny/ask; an allow needs the whole string."""
    g = guard(
        rule("no-rm", "exec", "deny", command=["rm -rf *"]),
        rule("status", "exec", "allow", command=["git status"]),
    )
    assert bash(g, "FOO=1 rm -rf /").rule == "no-rm"
    assert bash(g, "A='x y' B=\"p q\" C= rm -rf /").rule == "no-rm"
    assert bash(g, "make && LANG=C rm -rf /").rule == "no-rm"
    assert bash(g, "git status").action == "allow"
    assert bash(g, "GIT_DIR=/x git status").action == "ask"


def test_groupers_and_git_relocation_flags_are_stripped() -> None:
    """Groupers, git's relocation flags, bare wrappers and env values with substitutions do not
    hide a denied command."""
    g = guard(
        rule("no-rm", "exec", "deny", command=["rm -rf *"]),
        rule("no-push", "exec", "deny", command=["git push*"]),
        default="allow",
    )
    assert bash(g, "(cd /tmp && rm -rf x)").rule == "no-rm"
    assert bash(g, "{ rm -rf x; }").rule == "no-rm"
    assert bash(g, "! rm -rf x").rule == "no-rm"
    assert bash(g, "git -C /elsewhere push --force").rule == "no-push"
    assert bash(g, "git --git-dir=/x/.git --work-tree /x push").rule == "no-push"
    assert bash(g, "git -c core.pager=cat --no-pager push").rule == "no-push"
    assert bash(g, "git -C /elsewhere status").action == "allow"
    assert bash(g, "sudo rm -rf /").rule == "no-rm"
    assert bash(g, "env LANG=C nohup rm -rf /").rule == "no-rm"
    assert bash(g, "FOO=$(date +%s) rm -rf /").rule == "no-rm"


def test_quoted_separators_do_not_split() -> None:
    """Separators inside quotes, or escaped, are part of the command, not splits."""
    g = guard(
        rule("no-rm", "exec", "deny", command=["rm -rf *"]),
        rule("commit", "exec", "allow", command=["git commit *"]),
    )
    assert bash(g, 'git commit -m "fix && rm -rf /"').action == "allow"
    assert bash(g, "git commit -m 'a; rm -rf /; b'").action == "allow"
    assert bash(g, "git commit -m a\\;\\ rm\\ -rf\\ /").action == "allow"
    assert commands("echo \"a | b\" && echo 'c ; d'") == ['echo "a | b"', "echo 'c ; d'"]


def test_redirections_are_not_separators() -> None:
    """`2>&1`, `&>file`, `>|file` and `<&3` split nothing (a command is its words, without its
    redirections)."""
    assert commands("make 2>&1 | tee log") == ["make", "tee log"]
    assert commands("make &>log; ls >|out") == ["make", "ls"]
    assert commands("a <&3 & b") == ["a", "b"]


def test_substitutions_and_shell_scripts_are_looked_into() -> None:
    """Commands inside `$(...)`, backticks and `sh -c '...'` are matched by deny rules."""
    g = guard(rule("no-rm", "exec", "deny", command=["rm -rf *"]), default="allow")
    assert bash(g, "echo $(rm -rf /)").rule == "no-rm"
    assert bash(g, 'echo "`rm -rf /`"').rule == "no-rm"
    assert bash(g, "bash -c 'cd / && rm -rf x'").rule == "no-rm"
    assert bash(g, "sh -c \"sh -c 'rm -rf x'\"").rule == "no-rm"
    assert bash(g, "echo 'rm -rf $(x)'").action == "allow"  # single quotes: no substitution
    assert commands("a && $(b; c)") == ["a", "$(b; c)", "b", "c"]


def test_codex_command_rules() -> None:
    """Codex's wrapped command is matched as the command inside its shell."""
    g = guard(
        rule("status", "exec", "allow", command=["git status"]),
        rule("no-rm", "exec", "deny", command=["rm -rf *"]),
    )
    assert g.decide("codex", COMMAND, {"command": "/bin/bash -lc 'git status'"}).action == "allow"
    v = g.decide("codex", COMMAND, {"command": "/bin/bash -lc 'ls; rm -rf /'"})
    assert (v.rule, v.detail) == ("no-rm", "ls; rm -rf /")


def test_exec_rules_without_globs_match_every_exec_call() -> None:
    """An exec rule with no `command` matches every exec call, commandless ones included; one
    with globs never matches a call with no command."""
    g = guard(rule("globbed", "exec", "deny", command=["*"]), rule("any", "exec", "ask"))
    assert g.decide("claude_code", "KillShell", {"shell_id": "1"}).rule == "any"
    assert bash(g, "ls").rule == "globbed"


# -- outside -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "outside"),
    [
        ("/work/proj/src/a.py", False),
        ("src/a.py", False),
        ("./src/../a.py", False),
        ("/work/proj", False),
        ("/work/proj/", False),
        ("/work/project/a.py", True),  # a sibling sharing the prefix
        ("/work/proj/../other/a.py", True),
        ("../other/a.py", True),
        ("/etc/passwd", True),
        ("~/.ssh/id_rsa", True),
        ("", True),
        (None, True),
    ],
)
def test_outside_the_work_folder(path: str | None, outside: bool) -> None:
    """Paths resolve against the work folder; empty or unresolvable counts as outside."""
    g = guard(rule("out", "write", "deny", outside="work_folder"), default="allow")
    assert write(g, path).action == ("deny" if outside else "allow")


def test_outside_with_no_work_folder_is_always_outside() -> None:
    """With no work folder nothing resolves: every path counts as outside."""
    g = guard(rule("out", "read", "ask", outside="work_folder"), default="allow", work_folder="")
    assert g.decide("claude_code", "Read", {"file_path": "/work/proj/a"}).action == "ask"
    assert g.decide("claude_code", "Read", {"file_path": "a"}).action == "ask"


def test_outside_the_outbox() -> None:
    """`outbox` is the work folder's `outbox` folder."""
    g = guard(rule("outbox-only", "write", "deny", outside="outbox"), default="allow")
    assert write(g, "outbox/report.md").action == "allow"
    assert write(g, "/work/proj/outbox/x/y.txt").action == "allow"
    assert write(g, "/work/proj/src/a.py").action == "deny"
    assert write(g, "outbox/../src/a.py").action == "deny"


def test_codex_file_change_counts_as_outside() -> None:
    """A Codex file change carries no path, so an outside rule always matches it."""
    g = guard(rule("out", "write", "ask", outside="work_folder"), default="allow")
    assert g.decide("codex", FILE_CHANGE, {"reason": None}).rule == "out"


def test_outside_rule_ignores_other_effects_and_inside_paths() -> None:
    """A write rule does not match reads; a path inside falls through to later rules."""
    g = guard(
        rule("out", "write", "deny", outside="work_folder"),
        rule("edits", "write", "ask"),
        default="allow",
    )
    assert g.decide("claude_code", "Read", {"file_path": "/etc/passwd"}).action == "allow"
    assert write(g, "src/a.py", tool="Edit").rule == "edits"
    assert write(g, "/tmp/x", tool="MultiEdit").rule == "out"
    v = g.decide("claude_code", "NotebookEdit", {"notebook_path": "/tmp/n.ipynb"})
    assert (v.rule, v.effect, v.detail) == ("out", "write", "/tmp/n.ipynb")


# -- errors, items -------------------------------------------------------------------------------


def test_evaluator_error_denies_with_the_pseudo_rule() -> None:
    """Anything raised while deciding denies the call with `policy_evaluation_error`."""
    g = guard(rule("any", "exec", "allow"), default="allow")
    v = g.decide("claude_code", "Bash", None)  # type: ignore[arg-type]
    assert (v.action, v.rule, v.detail) == ("deny", EVALUATION_ERROR, "Bash")


def test_evaluator_error_inside_matching_denies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in matching denies rather than falling through to an allow."""

    def broken(*_args: object) -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(policy, "_matches", broken)
    g = guard(rule("any", "exec", "allow"), default="allow")
    assert bash(g, "ls") == GateVerdict("deny", EVALUATION_ERROR, "", "Bash")


def test_policy_applied_lists_at_most_100_rules() -> None:
    """`policy_applied` lists the rules in force, worker's first, and says when it truncates."""
    small = guard(rule("t1", "exec", "deny"), worker=[rule("w1", "read", "allow")])
    assert small.applied() == {
        "type": "policy_applied",
        "rules": [
            {"id": "w1", "origin": "worker", "action": "allow"},
            {"id": "t1", "origin": "thread", "action": "deny"},
        ],
        "default": "ask",
        "counts": {"rules": 2, "reported": 2},
    }
    many = guard(*(rule(f"r{i}", "read", "allow") for i in range(130)), default="deny")
    meta = many.applied()
    assert len(meta["rules"]) == MAX_REPORTED
    assert meta["counts"] == {"rules": 130, "reported": MAX_REPORTED}
    assert meta["truncated"] is True
    assert meta["rules"][-1]["id"] == "r99"


def test_denied_item_and_refusal_texts() -> None:
    """A deny's item names the rule and the detail; the default names itself."""
    v = GateVerdict("deny", "no-rm", "exec", "rm -rf /")
    assert denied_item(v) == (
        "Blocked by policy rule 'no-rm': rm -rf /",
        {"type": "policy_denied", "rule": "no-rm", "effect": "exec", "detail": "rm -rf /"},
    )
    assert refusal(v) == "Denied by policy rule 'no-rm'"
    default = GateVerdict("deny", "", "network", "WebFetch")
    assert denied_item(default)[0] == "Blocked by the policy's default: WebFetch"
    assert refusal(default) == "Denied by the policy's default"
    long = GateVerdict("deny", "r", "exec", "x" * 10_000)
    _, meta = denied_item(long)
    assert len(meta["detail"]) == policy.MAX_DETAIL and meta["detail"].endswith("…")


# -- properties ----------------------------------------------------------------------------------

# Reserved words (`if`, `do`, ...) are not commands where a shell reads them: leave them out.
RESERVED = {"if", "then", "else", "elif", "fi", "do", "done", "case", "esac", "while", "until",
            "for", "in", "select", "function", "time", "coproc", "!", "{", "}"}  # fmt: skip
# Commands whose words an allow rule cannot see through (a shell reading a script, `eval`,
# `source`, git's `-c`): never allowed by a glob, so left out of the plain parts here.
OPAQUE = {"sh", "bash", "zsh", "dash", "ksh", "mksh", "fish", "busybox", "eval", "source", ".",
          "exec", "alias", "trap", "enable", "builtin", "git", "su"}  # fmt: skip
WORDS = st.text(string.ascii_lowercase + string.digits + "-./", min_size=1, max_size=8).filter(
    lambda w: w not in RESERVED and w not in OPAQUE
)
SIMPLE = st.lists(WORDS, min_size=1, max_size=4).map(" ".join)
SEPARATORS = st.sampled_from([" && ", " || ", "; ", " | ", " & ", "\n", ";", "&&", " |& "])
ENV = st.lists(st.from_regex(r"[A-Z_][A-Z0-9_]{0,4}=[a-z0-9]{0,3}", fullmatch=True), max_size=2)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@given(st.lists(SIMPLE, min_size=2, max_size=5), st.data())
def test_deny_catches_a_denied_part_anywhere(parts: list[str], data: st.DataObject) -> None:
    """A deny glob for one part (env-prefixed or not) catches it in any compound command."""
    target = data.draw(st.integers(0, len(parts) - 1))
    prefixed = [" ".join([*data.draw(ENV), p]) for p in parts]
    line = prefixed[0]
    for part in prefixed[1:]:
        line += data.draw(SEPARATORS) + part
    g = guard(rule("no", "exec", "deny", command=[parts[target]]), default="allow")
    assert bash(g, line).action == "deny"


@given(SIMPLE, st.lists(SIMPLE, min_size=1, max_size=3), st.data())
def test_allow_never_lets_an_unmatched_part_through(
    allowed: str, others: list[str], data: st.DataObject
) -> None:
    """An allow rule `<cmd>*` never allows a compound command with a part that is not `<cmd>...`,
    nor one of several lines (its `*` never matches a newline)."""
    line = allowed
    for part in others:
        line += data.draw(SEPARATORS) + part
    g = guard(rule("ok", "exec", "allow", command=[allowed + "*"]), default="deny")
    expected = all(p.startswith(allowed) for p in others) and "\n" not in line
    assert (bash(g, line).action == "allow") == expected


@given(st.lists(st.sampled_from(["src", "a", "b.py", ".", "x-y"]), max_size=5))
def test_relative_paths_without_dotdot_stay_inside(parts: list[str]) -> None:
    """A relative path with no `..` resolves inside the work folder."""
    g = guard(rule("out", "write", "deny", outside="work_folder"), default="allow")
    assert write(g, "/".join(parts) or ".").action == "allow"


@given(st.text(max_size=30), st.text(max_size=30), JSONISH)
def test_decide_never_raises(harness: str, tool: str, tool_input: Any) -> None:
    """Whatever a harness passes, `decide` gives a verdict and never raises."""
    g = guard(
        rule("rm", "exec", "deny", command=["rm *"]),
        rule("out", "write", "ask", outside="work_folder"),
        default="allow",
    )
    v = g.decide(harness, tool, tool_input)
    assert v.action in ("allow", "deny", "ask")
