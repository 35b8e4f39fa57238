"""The guarded policy: check a policy block, map a harness's call to an effect, and decide it.

Pure: no Redis. The replica builds a `Guard` per guarded turn from the worker's rules
(`Settings.policy_rules`) and the thread's policy (`Session.policy`), and turns it into the turn's
gate (`workers.agents.harness.Gate`), awaiting `Guard.decide_async`.

This module maps calls to effects and decides them. The rule model and the checking of a block
are in `workers.agents.policy_rules`, the shell analysis of a command (`analyse`, `Script`) in
`workers.agents.policy_shell`, over the parse-tree reading of `workers.agents.policy_bash`; their
public names are importable from here too (`__all__`).

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
thread's; the first rule of the call's effect that matches decides, else the thread's `default`.

Commands are parsed with tree-sitter-bash, a real shell grammar, into simple commands (a name
and its words), wherever they sit: in lists and pipelines, `$(...)`, backticks, `<(...)`,
`if`/`for`/`while`/`case` bodies, subshells, `{ ...; }`, function bodies, and the scripts of
`bash -c '...'`, `eval '...'`, a here-document fed to a shell, `find -exec`, `xargs` and git
aliases (`git -c alias.x=...`), to a nesting depth of `MAX_DEPTH`. A command longer than
`MAX_COMMAND` characters is not parsed at all. Where the tree shows signs that the grammar
read the command otherwise than bash would (a parse error, a blank or newline inside a word, a
newline inside one command, a reserved word as a command name), deny rules also see the command
cut at every character that can end a command, and it counts as not fully seen.

- An `exec` **allow** rule with globs allows only what it can prove: every simple command in the
  tree, and the whole string, matches one of its globs (`*` never matches a newline, so an
  allowed command is one line), and every construct is plain: words that are unquoted, '...' or
  "..." with no `$`, backtick or backslash inside, joined by `; && || | |& &`, with no
  redirection but to `/dev/null` or another descriptor. Substitutions, expansions (`$x`),
  assignments, here-documents, `$'...'`, functions, loops, conditionals, subshells, `eval`,
  `source`, nested scripts, git's `-c`, a parse error, or anything past a limit cannot be proven:
  the rule then asks (`ask` with its id), unless a later deny rule matches.
- An `exec` **deny** or **ask** rule with globs matches when the whole string, or any simple
  command, matches one of its globs in any of its forms: as written; its words with quoting
  removed (`r''m`, `\\rm`, `"rm"`, `$'rm'` are all `rm`); with the name's folder dropped
  (`/bin/rm` is `rm`); behind wrappers (`sudo`, `env`, `nohup`, `timeout 5`, `xargs -0`, ... :
  each of the first `MAX_WRAPPED` words after a wrapper is tried as the start of the command);
  git without its global options (`-C dir`, `-c k=v`, `--git-dir`, ...) and with `-c alias.x=`
  expanded; `find ... -delete` as `rm`; and each form with a space appended, so `rm *` also
  catches a bare `rm` (as `xargs rm` runs it).
- A command with parts no rule can see (a command name that is an expansion or a glob, a
  non-literal `eval` or `bash -c` script, a shell reading its script from a pipe, a parse error,
  past `MAX_DEPTH` or `MAX_COMMAND`) is asked (`UNCHECKED`) where it would otherwise be allowed,
  when any deny or ask rule could have matched the part unseen.
- A shell command's other effects are seen too, by deny and ask rules of their effect (an allow
  rule never widens them, and the default does not apply): a redirection to a file is a `write`
  of that file (`<` a `read`), and `curl`, `wget`, `ssh`, `git push`, ... are `network`. Of all
  the call's effects the strictest verdict wins (deny, then ask).
- `read`/`write` with `outside`: the call's paths (`file_path`, `notebook_path`, `path`, and
  Glob's and Grep's `pattern` and Grep's `glob`), resolved against the work folder (or the
  outbox, `<work folder>/outbox`), lie outside it, lexically or once symlinks are followed (a
  link inside the work folder to a file outside is outside). A path that is empty, missing, not a
  string, relative with no work folder, `~`-relative or an expansion is unresolvable and counts
  as outside; so does every Codex file change, whose request carries no path, a glob pattern
  with `..` or a brace holding a path, and a relative redirection after a `cd` in the command.
- otherwise, any call of the effect.

A call whose tool maps to no effect (Codex's permissions request, MCP tools) matches no rule and
gets the default. Anything raised while deciding denies the call with the pseudo-rule
`policy_evaluation_error` (`Guard.decide` never raises). Deciding takes time linear in the
command's length; `Guard.decide_async` runs long commands in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

from workers.agents.harness import GateVerdict
from workers.agents.policy_rules import (
    ACTIONS,
    MAX_ID,
    Effect,
    Policy,
    Rule,
    parse_policy,
    parse_rules,
    validate,
)
from workers.agents.policy_shell import (
    MAX_COMMAND,
    MAX_DEPTH,
    MAX_WRAPPED,
    Script,
    analyse,
    commands,
    plain_argv,
    shell_c,
)

__all__ = [
    "ACTIONS",
    "ASYNC_OVER",
    "CODEX_EFFECTS",
    "EFFECTS",
    "EVALUATION_ERROR",
    "MAX_COMMAND",
    "MAX_DEPTH",
    "MAX_DETAIL",
    "MAX_ID",
    "MAX_REPORTED",
    "MAX_WRAPPED",
    "OUTBOX",
    "UNCHECKED",
    "Call",
    "Guard",
    "Policy",
    "Rule",
    "Script",
    "analyse",
    "classify",
    "commands",
    "denied_item",
    "parse_policy",
    "parse_rules",
    "refusal",
    "validate",
]

#: The pseudo-rule of a call denied because deciding it raised.
EVALUATION_ERROR = "policy_evaluation_error"
#: The pseudo-rule of a call asked because part of its command could not be checked.
UNCHECKED = "policy_unchecked"
#: The outbox: this folder inside the work folder.
OUTBOX = "outbox"
#: The most rules a `policy_applied` item lists.
MAX_REPORTED = 100
#: The longest detail a `policy_denied` item quotes.
MAX_DETAIL = 2000
#: Commands longer than this are decided in a worker thread by `Guard.decide_async`.
ASYNC_OVER = 2048

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
_PATTERN_KEYS: dict[str, tuple[str, ...]] = {"Glob": ("pattern",), "Grep": ("pattern", "glob")}


# -- calls ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """What the policy sees of one call."""

    tool: str
    effect: Effect | None
    command: str | None = None
    path: str | None = None
    #: Every path the call names, and every path pattern (Glob's and Grep's).
    paths: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    #: A path field that is present but no usable string: counts as outside.
    unresolved: bool = False
    #: The folder a command runs in, when the harness says (Codex's `cwd`).
    cwd: str = ""

    @property
    def detail(self) -> str:
        """The command, else the path, else the tool's name."""
        return self.command or self.path or self.tool


def _codex_command(value: object) -> str | None:
    """Codex's command: the script inside `/bin/bash -lc '<script>'` (a string or argv), else
    the command itself."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        script = shell_c(value)
        return script if script is not None else shlex.join(value)
    if not isinstance(value, str) or not value:
        return None
    argv = plain_argv(value)
    script = shell_c(argv) if argv is not None else None
    return script if script is not None else value


def _strings(tool_input: Mapping[str, Any], keys: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    """The non-empty strings under `keys`, and whether one of them held something else."""
    found: list[str] = []
    bad = False
    for key in keys:
        if key in tool_input:
            value = tool_input[key]
            if isinstance(value, str) and value:
                found.append(value)
            else:
                bad = True
    return tuple(found), bad


def classify(harness: str, tool: str, tool_input: Mapping[str, Any]) -> Call:
    """The effect, command and paths of one call, from the harness's tool name and input."""
    if harness == "codex":
        effect = CODEX_EFFECTS.get(tool)
        if effect != "exec":
            return Call(tool, effect)  # a file change carries no path: outside
        cwd = tool_input.get("cwd")
        command = _codex_command(tool_input.get("command"))
        return Call(tool, effect, command, cwd=cwd if isinstance(cwd, str) else "")
    effect = EFFECTS.get(tool)
    if effect == "exec":
        command = tool_input.get("command")
        return Call(tool, effect, command if isinstance(command, str) and command else None)
    if effect in ("read", "write"):
        paths, bad = _strings(tool_input, _PATH_KEYS)
        patterns, bad_pattern = _strings(tool_input, _PATTERN_KEYS.get(tool, ()))
        first = (paths or patterns or (None,))[0]
        return Call(tool, effect, path=first, paths=paths, patterns=patterns,
                    unresolved=bad or bad_pattern)  # fmt: skip
    return Call(tool, effect)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outside(path: str | None, work_folder: str, folder: str, base: str = "") -> bool:
    """Is `path`, resolved against `base` (else the work folder), outside `folder` (the work
    folder or a folder inside it), lexically or once symlinks are followed? Unresolvable counts
    as outside."""
    if not path or path.startswith("~") or not posixpath.isabs(work_folder):
        return True
    root = posixpath.normpath(posixpath.join(work_folder, folder))
    joined = posixpath.join(base if posixpath.isabs(base) else work_folder, path)
    if not _within(posixpath.normpath(joined), root):
        return True
    try:  # a link inside the folder may lead out of it; `..` after a link is the link's parent
        return not _within(os.path.realpath(joined), os.path.realpath(root))
    except (OSError, ValueError):
        return True


_BRACE = re.compile(r"\{[^{}]*\}")


def _pattern_outside(pattern: str, work_folder: str, folder: str) -> bool:
    """A glob pattern reaches outside when a path it names does, when it climbs (`..` may
    follow a `**` of any depth), or when a brace alternative holds a path of its own."""
    if ".." in pattern.split("/"):
        return True
    if any(c in group for group in _BRACE.findall(pattern) for c in ("/", "~", "..")):
        return True
    return _outside(pattern, work_folder, folder)


def _call_outside(call: Call, work_folder: str, folder: str) -> bool:
    if call.unresolved or not (call.paths or call.patterns):
        return True
    return any(_outside(p, work_folder, folder) for p in call.paths) or any(
        _pattern_outside(p, work_folder, folder) for p in call.patterns
    )


# -- matching ------------------------------------------------------------------------------------

Match = Literal["yes", "no", "unproven"]
_STRICTNESS = {"allow": 0, "ask": 1, "deny": 2}


def _globs_hit(globs: Sequence[str], text: str, *, one_line: bool) -> bool:
    if one_line and "\n" in text:  # an allow glob's `*` never carries a second line
        return False
    return any(fnmatchcase(text, g) for g in globs)


@dataclass(frozen=True)
class _Context:
    call: Call
    work_folder: str
    script: Script | None  # an exec call's command, analysed

    def folder(self, rule: Rule) -> str:
        return OUTBOX if rule.outside == "outbox" else "."


def _exec_match(rule: Rule, ctx: _Context) -> Match:
    command, script = ctx.call.command, ctx.script
    if command is None or script is None:
        return "no"
    if rule.action == "allow":
        whole = _globs_hit(
            rule.command, command.strip(), one_line=True
        )  # a last newline is no line
        if not (whole and all(_globs_hit(rule.command, c, one_line=True) for c in script.commands)):
            return "no"
        return "yes" if script.plain and not script.unseen else "unproven"
    if _globs_hit(rule.command, command, one_line=False) or any(
        _globs_hit(rule.command, form, one_line=False) for form in script.forms
    ):
        return "yes"
    return "no"


def _matches(rule: Rule, ctx: _Context) -> Match:
    """Does `rule` decide the call (of the call's own effect)?"""
    call = ctx.call
    if rule.effect != call.effect:
        return "no"
    if rule.command:
        return _exec_match(rule, ctx)
    if rule.outside:
        return "yes" if _call_outside(call, ctx.work_folder, ctx.folder(rule)) else "no"
    return "yes"


def _side_hits(rule: Rule, path: str, ctx: _Context) -> bool:
    """Does a read or write rule match a command's redirection to `path`?"""
    if not rule.outside:
        return True
    script = ctx.script
    relative = not posixpath.isabs(path)
    if relative and script is not None and script.moved:  # after a `cd`, from where?
        return True
    return _outside(path, ctx.work_folder, ctx.folder(rule), ctx.call.cwd)


def _stricter(a: GateVerdict, b: GateVerdict | None) -> GateVerdict:
    return b if b is not None and _STRICTNESS[b.action] > _STRICTNESS[a.action] else a


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
        script = analyse(call.command) if call.effect == "exec" and call.command else None
        ctx = _Context(call, self.work_folder, script)
        verdict = self._first_match(ctx)
        if script is None:
            return verdict
        verdict = _stricter(verdict, self._side_effects(ctx, script))
        if verdict.action == "allow" and script.unseen and self._watched():
            verdict = GateVerdict("ask", UNCHECKED, verdict.effect, verdict.detail)
        return verdict

    def _first_match(self, ctx: _Context) -> GateVerdict:
        """The first rule of the call's effect that matches; an allow rule that cannot prove the
        command asks, unless a later deny rule matches."""
        call = ctx.call
        effect, rules = call.effect or "", self.rules
        for i, rule in enumerate(rules):
            found = _matches(rule, ctx)
            if found == "no":
                continue
            if found == "unproven":
                for later in rules[i + 1 :]:
                    if later.action == "deny" and _matches(later, ctx) == "yes":
                        return GateVerdict("deny", later.id, effect, call.detail)
                return GateVerdict("ask", rule.id, effect, call.detail)
            return GateVerdict(rule.action, rule.id, effect, call.detail)
        return GateVerdict(self.policy.default, "", effect, call.detail)

    def _side_effects(self, ctx: _Context, script: Script) -> GateVerdict | None:
        """The strictest deny or ask that a command's writes, reads and network use meet."""
        items: list[tuple[Effect, str]] = [("write", p) for p in sorted(script.writes)]
        items += [("read", p) for p in sorted(script.reads)]
        if script.network:
            items.append(("network", ""))
        strictest: GateVerdict | None = None
        for effect, path in items:
            for rule in self.rules:
                if rule.effect != effect or not (
                    effect == "network" or _side_hits(rule, path, ctx)
                ):
                    continue
                if rule.action != "allow":
                    found = GateVerdict(rule.action, rule.id, effect, ctx.call.detail)
                    strictest = found if strictest is None else _stricter(strictest, found)
                break
        return strictest

    def _watched(self) -> bool:
        """Could a deny or ask rule have matched a part of a command that was not seen?"""
        return any(
            r.action != "allow" and (r.effect != "exec" or bool(r.command)) for r in self.rules
        )

    def decide(self, harness: str, tool: str, tool_input: Mapping[str, Any]) -> GateVerdict:
        """The verdict on one call; an error while deciding denies it (`EVALUATION_ERROR`)."""
        try:
            return self.evaluate(harness, tool, tool_input)
        except Exception:
            return GateVerdict("deny", EVALUATION_ERROR, "", tool if isinstance(tool, str) else "")

    async def decide_async(
        self, harness: str, tool: str, tool_input: Mapping[str, Any]
    ) -> GateVerdict:
        """`decide`, in a worker thread when the command is long, so a replica's event loop
        (leases, other threads) never waits on one decision."""
        if _size(tool_input) <= ASYNC_OVER:
            return self.decide(harness, tool, tool_input)
        try:
            return await asyncio.to_thread(self.decide, harness, tool, tool_input)
        except Exception:  # no thread to run it in: still a verdict, never a raise
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


def _size(tool_input: object) -> int:
    """About how much text deciding a call must read (its command's length)."""
    try:
        command = tool_input.get("command") if isinstance(tool_input, Mapping) else None
        if isinstance(command, list):
            return sum(len(c) for c in command if isinstance(c, str))
        return len(command) if isinstance(command, str) else 0
    except Exception:
        return ASYNC_OVER + 1  # odd input: decide it off the loop, where a surprise costs nothing


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
