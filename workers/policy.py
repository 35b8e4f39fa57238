"""The guarded policy: check a policy block, map a harness's call to an effect, and decide it.

Pure: no Redis, no asyncio. The replica builds a `Guard` per guarded turn from the worker's rules
(`Settings.policy_rules`) and the thread's policy (`Session.policy`), and turns it into the turn's
gate (`workers.harness.Gate`).

Policy block
------------
```
{"default": "allow" | "deny" | "ask",           # when no rule matches (omitted: deny)
 "rules": [{"id": "no-rm",                       # names the rule in verdicts and items
            "effect": "read" | "write" | "exec" | "network",
            "action": "allow" | "deny" | "ask",
            "command": ["rm -rf *", ...],        # exec only: globs (fnmatch, case-sensitive)
            "outside": "" | "work_folder" | "outbox"}]}   # read and write only
```

A malformed block raises `broker.BadItem` naming the offending place, e.g.
`policy.rules[2].action`. Unknown keys, duplicate rule ids, `command` on a rule that is not
`exec`, `outside` on one that is neither `read` nor `write`, and an empty `command` list are
refused too: each would silently mean something other than what its author meant.

Deciding a call
---------------
The call's effect comes from the harness's tool name (`EFFECTS`; Codex's approval methods in
`CODEX_EFFECTS`; every other harness, the scripted one included, uses Claude Code's names). The
worker's rules are tried first, so a machine owner's deny cannot be relaxed by a thread, then the
thread's; the first rule that matches decides, else the thread's `default`. A rule matches a call
of its effect when:

- `exec` with `command` globs. An **allow** rule needs the whole command string to match one of
  its globs, and so must each of the command's top-level commands (and those inside `$(...)`,
  backticks and `sh -c '...'`): a `*` cannot carry a second command through an allow meant for
  the first (`git push*` does not allow `git push && rm -rf /`). This second condition tightens
  the reference, which matches the whole string only. A **deny** or **ask** rule matches when
  the whole string, or any of those commands, matches; a command is tried both as written and
  with leading environment assignments (`FOO=1 cmd`), groupers (`(`, `{ `, `! `), git's
  relocation flags (`git -C dir`, `--git-dir`, `--work-tree`, `-c k=v`, `--no-pager`) and bare
  wrappers (`sudo`, `env`, `exec`, `nohup`, `time`, ... without options) stripped.
  Commands are split on `&& || ; | & |&` and newlines outside quotes and substitutions
  (redirections such as `2>&1` are not separators).
- `read`/`write` with `outside`: the call's path, resolved against the work folder (or the
  outbox, `<work folder>/outbox`), lies outside it. A path that is empty, missing, relative with
  no work folder, or `~`-relative is unresolvable and counts as outside; so does every Codex file
  change, whose request carries no path. Resolution is lexical (`..` is folded; symlinks are not
  followed).
- otherwise, any call of the effect.

A call whose tool maps to no effect (Codex's permissions request, MCP tools) matches no rule and
gets the default. Anything raised while deciding denies the call with the pseudo-rule
`policy_evaluation_error` (`Guard.decide` never raises).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

from broker import BadItem
from workers.harness import GateVerdict

__all__ = [
    "ACTIONS",
    "CODEX_EFFECTS",
    "EFFECTS",
    "EVALUATION_ERROR",
    "MAX_DETAIL",
    "MAX_ID",
    "MAX_REPORTED",
    "OUTBOX",
    "Call",
    "Guard",
    "Policy",
    "Rule",
    "classify",
    "commands",
    "denied_item",
    "parse_policy",
    "parse_rules",
    "refusal",
    "split",
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

#: The pseudo-rule of a call denied because deciding it raised.
EVALUATION_ERROR = "policy_evaluation_error"
#: The outbox: this folder inside the work folder.
OUTBOX = "outbox"
#: The most rules a `policy_applied` item lists.
MAX_REPORTED = 100
#: The longest rule id, and the longest detail a `policy_denied` item quotes.
MAX_ID = 128
MAX_DETAIL = 2000

#: Claude Code's tool names (and every harness's but Codex's).
EFFECTS: dict[str, Effect] = {
    **dict.fromkeys(("Write", "Edit", "MultiEdit", "NotebookEdit"), "write"),
    **dict.fromkeys(("Bash", "BashOutput", "KillShell"), "exec"),
    **dict.fromkeys(("Read", "Glob", "Grep", "NotebookRead"), "read"),
    **dict.fromkeys(("WebFetch", "WebSearch"), "network"),
}
#: Codex's approval methods; `item/permissions/requestApproval` maps to nothing.
CODEX_EFFECTS: dict[str, Effect] = {
    "item/commandExecution/requestApproval": "exec",
    "item/fileChange/requestApproval": "write",
}
_PATH_KEYS = ("file_path", "notebook_path", "path")
_SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh"})
_MAX_DEPTH = 4  # nested substitutions and `sh -c` scripts looked into


# -- the policy block ----------------------------------------------------------------------------


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


# -- commands ------------------------------------------------------------------------------------


def _closing(text: str, start: int) -> int:
    """The index of the `)` closing a `$(` whose body starts at `start` (len(text) if none)."""
    depth, quote, i = 1, "", start
    while i < len(text):
        c = text[i]
        if quote:
            quote = "" if c == quote else quote
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return len(text)


def _separator(text: str, i: int) -> int:
    """The length of the command separator at `text[i]`, or 0."""
    two = text[i : i + 2]
    if two in ("&&", "||", "|&"):
        return 2
    c, before = text[i], text[i - 1] if i else ""
    if c in "\n;":
        return 1
    if c == "&":  # not `2>&1`, `<&3`, `&>file`
        return 0 if before in "<>" or text[i + 1 : i + 2] == ">" else 1
    if c == "|":  # not `>|`
        return 0 if before == ">" else 1
    return 0


def _substitution(text: str, i: int) -> int:
    """The end (exclusive) of a `$(...)` or backtick substitution starting at `i`, or 0."""
    if text.startswith("$(", i):
        return min(_closing(text, i + 2) + 1, len(text))
    if text[i] == "`":
        end = text.find("`", i + 1)
        return len(text) if end < 0 else end + 1
    return 0


def split(command: str) -> tuple[list[str], list[str]]:
    """A command line's top-level commands, and the scripts inside its substitutions.

    Splits on `&& || ; | & |&` and newlines outside quotes and substitutions.
    """
    parts: list[str] = []
    inner: list[str] = []
    buf: list[str] = []
    quote, i = "", 0
    while i < len(command):
        c = command[i]
        end = 0 if quote == "'" else _substitution(command, i)
        step = 1
        if end:
            body = command[i + 2 : end - 1] if c == "$" else command[i + 1 : end - 1]
            inner.append(body)
            step = end - i
        elif quote:
            quote = "" if c == quote else quote
            step = 2 if c == "\\" and quote == '"' else 1
        elif c == "\\":
            step = 2
        elif c in "'\"":
            quote = c
        elif sep := _separator(command, i):
            parts.append("".join(buf))
            buf, i = [], i + sep
            continue
        buf.append(command[i : i + step])
        i += step
    parts.append("".join(buf))
    return [p.strip() for p in parts if p.strip()], inner


_WORD = r"""(?:'[^']*'|"(?:\\.|[^"\\])*"|\\.|[^\s'"\\])+"""
_ENV = re.compile(rf"[A-Za-z_][A-Za-z0-9_]*=(?:{_WORD})?\s+")
_GROUPER = re.compile(r"(?:\(|\{\s|!\s)\s*")
_GIT_FLAGS = re.compile(
    rf"(git\s+)(?:(?:-C|-c|--git-dir|--work-tree)\s+{_WORD}\s+"
    rf"|(?:--git-dir|--work-tree)={_WORD}\s+|--no-pager\s+)+"
)
_CLOSERS = re.compile(r"\s*[)}]+\s*$")
_WRAPPER = re.compile(r"(?:sudo|env|command|builtin|exec|nohup|time|nice)\s+(?=[^-\s])")


def _stripped(command: str) -> str:
    """A command without leading env assignments, groupers and git relocation flags."""
    while True:
        before = command
        command = _GROUPER.sub("", command, count=1) if _GROUPER.match(command) else command
        command = _ENV.sub("", command, count=1) if _ENV.match(command) else command
        command = _GIT_FLAGS.sub(r"\1", command, count=1) if _GIT_FLAGS.match(command) else command
        command = _WRAPPER.sub("", command, count=1) if _WRAPPER.match(command) else command
        command = _CLOSERS.sub("", command)
        if command == before:
            return command


def _masked(command: str) -> str:
    """The command with each substitution replaced by `_`: an env value such as `$(a b)` then
    strips like a word (the substitution's own commands are matched apart)."""
    out: list[str] = []
    quote, i = "", 0
    while i < len(command):
        c = command[i]
        end = 0 if quote == "'" else _substitution(command, i)
        if end:
            out.append("_")
            i = end
            continue
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        out.append(c)
        i += 1
    return "".join(out)


def _shell_script(command: str) -> str | None:
    """The script of `sh -c 'script'` (`bash -lc`, `/bin/zsh -c`, ...), else None."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    if len(argv) != 3 or posixpath.basename(argv[0]) not in _SHELLS:
        return None
    flags = argv[1]
    if flags.startswith("-") and not flags.startswith("--") and "c" in flags:
        return argv[2]
    return None


def commands(command: str, depth: int = 0) -> list[str]:
    """Every command in a command line, as written: top-level ones, then those inside
    substitutions and `sh -c` scripts (recursively, to a bounded depth)."""
    parts, inner = split(command)
    found = list(parts)
    if depth >= _MAX_DEPTH:
        return found
    for part in parts:
        script = _shell_script(_stripped(part))
        if script is not None:
            inner.append(script)
    for body in inner:
        found += commands(body, depth + 1)
    return found


def _allows(globs: Sequence[str], command: str) -> bool:
    def hit(text: str) -> bool:
        return any(fnmatchcase(text, g) for g in globs)

    return hit(command) and all(hit(part) for part in commands(command))


def _catches(globs: Sequence[str], command: str) -> bool:
    candidates = {command}
    for part in commands(command):
        candidates.update((part, _stripped(part), _stripped(_masked(part))))
    return any(fnmatchcase(text, g) for text in candidates for g in globs)


# -- calls ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """What the policy sees of one call."""

    tool: str
    effect: Effect | None
    command: str | None = None
    path: str | None = None

    @property
    def detail(self) -> str:
        """The command, else the path, else the tool's name."""
        return self.command or self.path or self.tool


def _codex_command(value: object) -> str | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = shlex.join(value)
    if not isinstance(value, str) or not value:
        return None
    script = _shell_script(value)  # Codex sends `/bin/bash -lc '<the command>'`
    return script if script is not None else value


def classify(harness: str, tool: str, tool_input: Mapping[str, Any]) -> Call:
    """The effect, command and path of one call, from the harness's tool name and input."""
    if harness == "codex":
        effect = CODEX_EFFECTS.get(tool)
        command = _codex_command(tool_input.get("command")) if effect == "exec" else None
        return Call(tool, effect, command)  # a file change carries no path: outside
    effect = EFFECTS.get(tool)
    if effect == "exec":
        command = tool_input.get("command")
        return Call(tool, effect, command if isinstance(command, str) and command else None)
    if effect in ("read", "write"):
        for key in _PATH_KEYS:
            path = tool_input.get(key)
            if isinstance(path, str) and path:
                return Call(tool, effect, path=path)
    return Call(tool, effect)


def _outside(path: str | None, work_folder: str, folder: str) -> bool:
    """Is `path`, resolved against the work folder, outside `folder` (the work folder or a folder
    inside it)? Unresolvable counts as outside."""
    if not path or path.startswith("~") or not posixpath.isabs(work_folder):
        return True
    base = posixpath.normpath(posixpath.join(work_folder, folder))
    resolved = posixpath.normpath(posixpath.join(work_folder, path))
    return not (resolved == base or resolved.startswith(base.rstrip("/") + "/"))


def _matches(rule: Rule, call: Call, work_folder: str) -> bool:
    if rule.effect != call.effect:
        return False
    if rule.command:
        if call.command is None:
            return False
        check = _allows if rule.action == "allow" else _catches
        return check(rule.command, call.command)
    if rule.outside:
        return _outside(call.path, work_folder, OUTBOX if rule.outside == "outbox" else ".")
    return True


# -- the guard -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Guard:
    """A guarded turn's policy: the worker's rules, then the thread's, then its default."""

    worker: tuple[Rule, ...]
    policy: Policy
    work_folder: str = ""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self.worker + self.policy.rules

    def evaluate(self, harness: str, tool: str, tool_input: Mapping[str, Any]) -> GateVerdict:
        """The verdict on one call (may raise: `decide` is the safe one)."""
        call = classify(harness, tool, tool_input)
        effect = call.effect or ""
        for rule in self.rules:
            if _matches(rule, call, self.work_folder):
                return GateVerdict(rule.action, rule.id, effect, call.detail)
        return GateVerdict(self.policy.default, "", effect, call.detail)

    def decide(self, harness: str, tool: str, tool_input: Mapping[str, Any]) -> GateVerdict:
        """The verdict on one call; an error while deciding denies it (`EVALUATION_ERROR`)."""
        try:
            return self.evaluate(harness, tool, tool_input)
        except Exception:
            return GateVerdict("deny", EVALUATION_ERROR, "", tool if isinstance(tool, str) else "")

    def applied(self) -> dict[str, Any]:
        """The metadata of the `policy_applied` item that starts every guarded turn."""
        rules = self.rules
        listed = [{"id": r.id, "origin": r.origin, "action": r.action} for r in rules]
        meta: dict[str, Any] = {
            "type": "policy_applied",
            "rules": listed[:MAX_REPORTED],
            "default": self.policy.default,
            "counts": {"rules": len(rules), "reported": min(len(rules), MAX_REPORTED)},
        }
        if len(rules) > MAX_REPORTED:
            meta["truncated"] = True
        return meta


def refusal(verdict: GateVerdict) -> str:
    """What a harness tells its agent of a policy deny."""
    if verdict.rule:
        return f"Denied by policy rule '{verdict.rule}'"
    return "Denied by the policy's default"


def denied_item(verdict: GateVerdict) -> tuple[str, dict[str, Any]]:
    """The `policy_denied` item for a deny: its text and its metadata."""
    by = f"policy rule '{verdict.rule}'" if verdict.rule else "the policy's default"
    detail = verdict.detail
    if len(detail) > MAX_DETAIL:  # a command may be long; the item must stay small
        detail = detail[: MAX_DETAIL - 1] + "…"
    meta = {
        "type": "policy_denied",
        "rule": verdict.rule,
        "effect": verdict.effect,
        "detail": detail,
    }
    return f"Blocked by {by}: {detail}", meta
