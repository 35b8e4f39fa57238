"""The guarded policy: check a policy block, map a harness's call to an effect, and decide it.

Pure: no Redis. The replica builds a `Guard` per guarded turn from the worker's rules
(`Settings.policy_rules`) and the thread's policy (`Session.policy`), and turns it into the turn's
gate (`workers.agents.harness.Gate`), awaiting `Guard.decide_async`.

This module maps calls to effects and decides them. The rule model and the checking of a block
are in `workers.agents.policy_rules`; its public names are importable from here too (`__all__`).

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
import itertools
import os
import posixpath
import re
import shlex
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

import tree_sitter_bash
from tree_sitter import Language, Node, Parser, Tree

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
#: The longest command parsed (characters); a longer one is not looked into at all.
MAX_COMMAND = 128 * 1024
#: How deeply nested scopes (`$(...)`, subshells, bodies, `bash -c` scripts) are looked into.
MAX_DEPTH = 8
#: How many words after a wrapper (`sudo -u root ...`) are tried as the start of its command.
MAX_WRAPPED = 16
#: Commands longer than this are decided in a worker thread by `Guard.decide_async`.
ASYNC_OVER = 2048
_MAX_FORMS = 64  # forms of one simple command
_MAX_TARGETS = 256  # distinct redirection targets
_MAX_PARSED = 2 * MAX_COMMAND  # characters parsed for one call, nested scripts included

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
_SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "mksh", "fish", "busybox"})


# -- commands ------------------------------------------------------------------------------------

_BASH = Language(tree_sitter_bash.language())
_parsers = threading.local()  # a Parser is not safe to share between threads
_source = threading.local()  # the bytes of the script being walked (`_parse`)
_NON_ASCII = re.compile(rb"[\x80-\xff]")

#: Named nodes and tokens an allow rule can prove: plain words joined by list and pipe operators.
_PLAIN_NODES = frozenset(
    {
        "program", "list", "pipeline", "command", "command_name", "word", "raw_string",
        "string", "string_content", "number", "concatenation", "comment",
        "redirected_statement", "file_redirect", "file_descriptor",
    }
)  # fmt: skip
_PLAIN_TOKENS = frozenset(
    {";", "&&", "||", "|", "|&", "&", '"', ">", ">>", "<", "&>", "&>>", ">&", "<&", ">|",
     ">&-", "<&-"}
)  # fmt: skip
#: Nodes that open a nested scope; `MAX_DEPTH` counts them (and nested scripts). A function
#: counts once, by its body.
_NESTING = frozenset(
    {
        "command_substitution", "process_substitution", "subshell", "compound_statement",
        "if_statement", "while_statement", "for_statement",
        "c_style_for_statement", "case_statement", "arithmetic_expansion", "expansion",
    }
)  # fmt: skip
#: One unquoted, '...' or "..." (no `$`, backtick or backslash) word: what bash and the grammar
#: cannot read differently. Checked on an allowed command's text besides its parse tree.
_SAFE_WORD = r"""(?!#)(?:[^\s$`'"\\()<>|&;]|\\[^\n]|'[^'\n]*'|"[^"$`\\\n]*")+"""
_SAFE = re.compile(rf"{_SAFE_WORD}(?:[ \t]+{_SAFE_WORD})*")
#: Redirection targets that are no file.
_NO_FILE = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})
_WRITES = frozenset({">", ">>", "&>", "&>>", ">|", ">&", "<>"})
#: Commands that run the rest of their words as a command (options and values skipped by trying
#: each word as the start); `command -v` only looks a name up.
_WRAPPERS = frozenset(
    {
        "sudo", "doas", "env", "exec", "command", "builtin", "nohup", "time", "nice", "ionice",
        "timeout", "stdbuf", "setsid", "xargs", "parallel", "chronic", "unbuffer", "taskset",
        "chroot", "flock", "coproc", "watch", "su", "ssh", "nsenter", "runuser", "strace",
        "ltrace", "script",
    }
)  # fmt: skip
#: Reserved words: met as a command name, the grammar has misread a compound command
#: (tree-sitter-bash reads `! if a; then b; fi` as commands `if a`, `then b`, `fi`). The
#: command after one is tried as a wrapper's is.
_RESERVED = frozenset(
    {"!", "{", "}", "if", "then", "else", "elif", "fi", "do", "done", "while", "until", "for",
     "case", "esac", "in", "select", "function", "[[", "]]"}
)  # fmt: skip
#: Commands no allow rule proves, whatever their words.
_UNPLAIN = frozenset({"eval", "source", ".", "exec", "alias", "trap", "enable", "builtin"})
_NETWORK = frozenset(
    {
        "curl", "wget", "nc", "ncat", "netcat", "socat", "telnet", "ssh", "scp", "sftp",
        "rsync", "ftp", "http", "https", "aria2c", "lynx", "w3m", "links",
    }
)  # fmt: skip
_GIT_NETWORK = frozenset({"push", "fetch", "pull", "clone", "ls-remote"})
_GIT_VALUED = frozenset(
    {"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env", "--super-prefix"}
)
_FIND_EXEC = frozenset({"-exec", "-execdir", "-ok", "-okdir"})
_MOVES = frozenset({"cd", "pushd", "popd"})
_SCRIPT_TAILS = frozenset({"watch", "ssh"})
_GLOBBY = re.compile(r"[*?\[{]")
_ANSI = re.compile(
    r"\\(x[0-9a-fA-F]{1,2}|u[0-9a-fA-F]{1,4}|U[0-9a-fA-F]{1,8}|[0-7]{1,3}|c.|.)", re.S
)
_ANSI_CHARS = {
    "a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "n": "\n", "r": "\r",
    "t": "\t", "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?",
}  # fmt: skip
_UNQUOTED_ESCAPE = re.compile(r"\\(.)", re.S)
_DQ_ESCAPE = re.compile(r'\\([$`"\\\n])')
_ESCAPED_OR_BLANK = re.compile(r"\\.|[ \t\n]", re.S)
_CUTS = re.compile(r"[\n;&|()`{}<>]|\$\(")
_QUOTING = re.compile(r"\$(?=['\"])|['\"\\]")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_ONE_LINE = frozenset(
    {"simple_expansion", "variable_name", "special_variable_name", "number", "file_descriptor"}
)
_ONE_COMMAND = frozenset({"command", "command_name", "concatenation", "file_redirect",
                          "redirected_statement", "variable_assignment"})  # fmt: skip
_REDIRECTS = frozenset({"file_redirect", "herestring_redirect"})
_NOT_WORDS = frozenset({"variable_assignment", "file_redirect", "herestring_redirect"})

Word = tuple[str, bool]  # a word's value (as written when not literal), and whether it is literal
Site = tuple["Node", "Node | None"]  # a command node and its parent


@dataclass
class Script:
    """What a command line does, as far as its parse shows (`analyse`)."""

    #: Every simple command as written, in the order met.
    commands: list[str] = field(default_factory=list)
    #: Every form of every simple command that deny and ask rules are matched against.
    forms: set[str] = field(default_factory=set)
    #: Files written and read by redirections ("" when the target does not resolve).
    writes: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)
    #: Network commands (`curl ...`), as their words.
    network: list[str] = field(default_factory=list)
    #: Why some part could not be seen ("" when all of it was).
    unseen: str = ""
    #: Every construct is one an allow rule can prove.
    plain: bool = True
    #: A `cd` or the like: relative paths do not resolve against the work folder.
    moved: bool = False
    parsed: int = 0

    def hide(self, why: str) -> None:
        self.unseen = self.unseen or why
        self.plain = False


def _parse(text: str) -> tuple[Tree, bytes]:
    """A script's parse tree, and its bytes (which `_text` reads nodes from).

    The grammar is given the script with every byte of a non-ASCII character replaced by `x`:
    tree-sitter-bash crashes the process on some characters (`{` then U+DF1A8 segfaults it),
    and bash itself reads them as ordinary word characters, as it does `x` (no Unicode blank
    separates words in bash). The lengths in bytes are the same, so each node's text is read
    from the real script."""
    data = text.encode("utf-8", "surrogatepass")
    _source.data = data
    return _parser().parse(_NON_ASCII.sub(b"x", data)), data


def _text(node: Node) -> str:
    """A node's text, from the script being walked (`_parse`)."""
    raw: bytes = _source.data[node.start_byte : node.end_byte]
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # a node edge inside a character: keep what can be read
        return raw.decode("utf-8", "replace")


def _ansi_c(body: str) -> str:
    """The value of `$'...'`."""

    def one(m: re.Match[str]) -> str:
        escape = m[1]
        try:
            if escape[0] in "xuU" and len(escape) > 1:
                return chr(int(escape[1:], 16))
            if escape[0] in "01234567":
                return chr(int(escape, 8))
        except (ValueError, OverflowError):
            return ""
        if escape[0] == "c" and len(escape) == 2:
            return chr(ord(escape[1]) & 0x1F)
        return _ANSI_CHARS.get(escape, "\\" + escape)

    return _ANSI.sub(one, body)


def _unquoted(raw: str) -> str:  # `\x` is x, and a backslash-newline joins lines
    return _UNQUOTED_ESCAPE.sub(lambda m: "" if m[1] == "\n" else m[1], raw)


def _double_quoted(raw: str) -> str:
    return _DQ_ESCAPE.sub(lambda m: "" if m[1] == "\n" else m[1], raw)


_DECODERS: dict[str, Callable[[str], str]] = {
    "word": _unquoted,
    "number": str,
    "raw_string": lambda raw: raw[1:-1],
    "ansi_c_string": lambda raw: _ansi_c(raw[2:-1]),
}


def _decode(node: Node) -> str | None:
    """A word's value with quoting removed, or None when it expands (`$x`, `$(...)`, ...)."""
    kind = node.type
    simple = _DECODERS.get(kind)
    if simple is not None:
        return simple(_text(node))
    if kind == "string":
        plain = all(c.type in ('"', "string_content") for c in node.children)
        return _double_quoted(_text(node)[1:-1]) if plain else None
    if kind not in ("concatenation", "translated_string"):
        return None
    parts: list[str] = []
    for child in node.children:
        if child.type == "$" and not child.is_named:  # `$"..."`: a translated string
            continue
        value = _decode(child)
        if value is None:
            return None
        parts.append(value)
    return "".join(parts)


def _word(node: Node) -> Word:
    value = _decode(node)
    return (value, True) if value is not None else (_text(node), False)


def _words(node: Node, parent: Node | None) -> list[Word]:
    """A command's words: its name and arguments, and the words bash reads as arguments that
    the grammar hangs on a redirection after the command (`echo > f hi`). The parent comes from
    the walk: `Node.parent` searches down from the root, slow in a deep tree."""
    words: list[Word] = []
    for child in node.children:  # an unnamed `$` before a string makes it `$"..."`: the same
        if not child.is_named or child.type in _NOT_WORDS:
            continue
        target = child.children[0] if child.type == "command_name" and child.children else child
        words.append(_word(target))
    if parent is not None and parent.type == "redirected_statement":
        for redirect in parent.children:
            if redirect.type == "file_redirect":
                named = [c for c in redirect.children if c.is_named and c.type != "file_descriptor"]
                words += [_word(c) for c in named[1:]]
    return words


def _stdin(site: Site) -> Word | None:
    """The literal text a here-document or here-string feeds a command, if any."""
    node, parent = site
    places = list(node.children)
    if parent is not None and parent.type == "redirected_statement":
        places += parent.children
    for place in places:
        if place.type == "herestring_redirect":
            named = [c for c in place.children if c.is_named]
            return _word(named[0]) if named else ("", True)
        if place.type == "heredoc_redirect":
            for child in place.children:
                if child.type == "heredoc_body":
                    return _text(child), True
            return "", True
    return None


def _redirect(node: Node, s: Script) -> None:
    """A redirection to a file is a write of it (`<`, a read); to a descriptor, nothing."""
    tokens = [c.type for c in node.children if not c.is_named]
    named = [c for c in node.children if c.is_named and c.type != "file_descriptor"]
    op = tokens[0] if tokens else ""
    if len(named) > 1:  # words after the target are the command's arguments
        s.plain = False
    if op in (">&-", "<&-") or not named:
        return
    target = named[0]
    if op in (">&", "<&") and target.type == "number":
        return
    value = _decode(target)
    path = value if value is not None else ""
    if path in _NO_FILE:
        return
    s.plain = False
    if op in _WRITES:
        s.writes.add(path)
    if op in ("<", "<>"):
        s.reads.add(path)


def _git(argv: list[Word], s: Script) -> list[Word] | None:
    """Git's command without its global options, a `-c alias.x=...` expanded; None when that
    is the command itself."""
    aliases: dict[str, str] = {}
    i = 1
    while i < len(argv):
        word = argv[i][0]
        if word in _GIT_VALUED:
            s.plain = s.plain and word not in ("-c", "--config-env")  # config can run commands
            if word == "-c" and i + 1 < len(argv):
                key, _, value = argv[i + 1][0].partition("=")
                if key.lower().startswith("alias."):
                    aliases[key[6:]] = value
            i += 2
        elif word.startswith("-"):
            s.plain = s.plain and not word.startswith("--config-env")
            i += 1
        else:
            break
    if i >= len(argv):
        return None
    rest = argv[i:]
    alias = aliases.get(rest[0][0])
    if alias is None:
        return [("git", True), *rest] if i > 1 else None  # None: nothing to strip
    if alias.startswith("!"):  # a shell alias: its script runs
        return [("sh", True), ("-c", True), (alias[1:], True)]
    return [("git", True), *((w, True) for w in alias.split()), *rest[1:]]


def _is_option(word: str) -> bool:
    return len(word) > 1 and word[0] in "-+"


def _scripts(argv: list[Word]) -> tuple[str, list[Word]]:
    """How a shell invocation gets its script: ("c", candidates) for `-c` (both the word right
    after it, as su reads it, and the first free word, as bash does), ("file", []) for a script
    file, ("stdin", []) when it reads standard input."""
    i, candidates = 1, []
    while i < len(argv):
        word = argv[i][0]
        if word in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file"):
            i += 2
            continue
        if word == "--":
            i += 1
            break
        if not _is_option(word):
            break
        if word == "--command" or (not word.startswith("--") and "c" in word):
            candidates.append(i + 1)
        i += 1
    if candidates:
        places = dict.fromkeys([*candidates, i])
        return "c", [argv[j] for j in places if j < len(argv)]
    return ("file", []) if i < len(argv) else ("stdin", [])


def _nested(script: Word, nest: int, s: Script, pending: list[tuple[str, int]]) -> None:
    s.plain = False
    if not script[1]:
        s.hide("a script that is not literal")
    elif nest + 1 > MAX_DEPTH:
        s.hide("nested deeper than MAX_DEPTH")
    else:
        pending.append((script[0], nest + 1))


def _shell(
    argv: list[Word], site: Site | None, nest: int, s: Script, pending: list[tuple[str, int]]
) -> None:
    """A shell's script (`bash -c`, a here-document fed to `sh`) is analysed as a command."""
    how, scripts = _scripts(argv)
    if how == "c":
        for script in scripts:
            _nested(script, nest, s, pending)
    elif how == "stdin":
        stdin = _stdin(site) if site is not None else None
        if stdin is None:
            s.hide("a shell reading its script from standard input")
        else:
            _nested(stdin, nest, s, pending)


def _successors(argv: list[Word], s: Script) -> list[list[Word]]:
    """The commands a command runs with its own words: behind a wrapper, git's, find's."""
    head = posixpath.basename(argv[0][0]) if argv[0][1] else ""
    # An assignment the grammar took for a name (`_= cmd`: tree-sitter-bash reads `_=` as one)
    # runs what follows, as a wrapper does.
    wraps = head in _WRAPPERS or argv[0][0] in _RESERVED or bool(_ASSIGNMENT.match(argv[0][0]))
    if wraps and not (head == "command" and any(w in ("-v", "-V") for w, _ in argv)):
        return [argv[i:] for i in range(1, min(len(argv), MAX_WRAPPED + 1))]
    if head == "git":
        found = _git(argv, s)
        return [found] if found is not None else []
    if head == "find":
        runs = [argv[i + 1 :] for i, (w, _) in enumerate(argv[:-1]) if w in _FIND_EXEC]
        if any(w == "-delete" for w, _ in argv):
            runs.append([("rm", True), *argv[1:]])
        return runs
    return []


def _variant(
    argv: list[Word], site: Site | None, nest: int, s: Script, pending: list[tuple[str, int]]
) -> None:
    """One form of a simple command: matched by deny rules, and looked into."""
    name, literal = argv[0]
    if name in _RESERVED:
        s.hide("a reserved word read as a command name")
    elif not literal or _GLOBBY.search(name):
        s.hide("a command name that is not literal")
        return
    words = [w for w, _ in argv]
    joined = " ".join(words)
    head = posixpath.basename(name)
    s.forms.update((joined, joined + " "))
    if head and head != name:
        bare = " ".join([head, *words[1:]])
        s.forms.update((bare, bare + " "))
    _scripts_run(argv, site, nest, s, pending)
    if head in _MOVES:
        s.moved = True
    if head in _NETWORK or (head == "git" and len(words) > 1 and words[1] in _GIT_NETWORK):
        s.network.append(joined)


def _scripts_run(
    argv: list[Word], site: Site | None, nest: int, s: Script, pending: list[tuple[str, int]]
) -> None:
    """The scripts a command runs from its words: a shell's, su's, trap's, watch's and ssh's,
    eval's."""
    head = posixpath.basename(argv[0][0])
    if head in _SHELLS:
        _shell(argv, site, nest, s, pending)
    elif head == "su":  # `su [-] [user] -c script`, the script anywhere after the options
        scripts = [argv[i + 1] for i, (w, _) in enumerate(argv[:-1]) if w in ("-c", "--command")]
        for script in scripts:
            _nested(script, nest, s, pending)
    elif head == "trap" and len(argv) > 1:  # its first word runs later, as a script
        _nested(argv[1], nest, s, pending)
    elif head in _SCRIPT_TAILS:  # the words after the options are a (remote) shell's script
        for i in range(1, min(len(argv), MAX_WRAPPED + 1)):
            rest = argv[i:]
            _nested((" ".join(w for w, _ in rest), all(lit for _, lit in rest)), nest, s, pending)
    elif head == "eval":
        rest = argv[1:]
        _nested((" ".join(w for w, _ in rest), all(lit for _, lit in rest)), nest, s, pending)


def _expand(
    argv: list[Word], site: Site | None, nest: int, s: Script, pending: list[tuple[str, int]]
) -> None:
    """Every form of one simple command (behind its wrappers, git's options, ...), breadth
    first, at most `_MAX_FORMS` of them."""
    todo, seen = [argv], 0
    while todo:
        current = todo.pop(0)
        seen += 1
        _variant(current, site, nest, s, pending)
        if seen + len(todo) < _MAX_FORMS:  # past it the next pass hides: no need to build more
            todo += [found for found in _successors(current, s) if found]
        else:
            s.hide("more forms than can be tried")


def _command(site: Site, nest: int, s: Script, pending: list[tuple[str, int]]) -> None:
    """A simple command: its forms for deny rules, and whether an allow rule can prove it."""
    text = _text(site[0])
    if not text:  # a command the grammar supplied as missing (`a |`): a parse error, hidden
        return
    s.commands.append(text)
    s.forms.update((text, text + " "))
    argv = _words(*site)
    if not argv:
        return
    if not _SAFE.fullmatch(text) or argv[0][0] in _UNPLAIN or _ASSIGNMENT.match(argv[0][0]):
        s.plain = False
    _expand(argv, site, nest, s, pending)


def _bare_blank(text: str) -> bool:
    """Does unquoted text hold a blank or newline that is not escaped (bash splits words, and
    ends commands, there)?"""
    if " " not in text and "\t" not in text and "\n" not in text:
        return False
    return any(m[0] in " \t\n" for m in _ESCAPED_OR_BLANK.finditer(text))


def _misread(node: Node, data: bytes) -> bool:
    """Has the grammar read a blank or a newline, which split words and end commands in bash,
    as part of a word, or a newline inside a command (between its words, a redirection and its
    target)? tree-sitter-bash reads `a` newline `\\rm` as one command, `! { { rm; }; }` as one
    named `{ {`, `$` newline `rm` as `$rm`, and `a | b` newline `rm 2>x` as `b rm 2>x`."""
    kind = node.type
    if kind == "word":
        return _bare_blank(_text(node))
    if kind in _ONE_LINE:
        return b"\n" in data[node.start_byte : node.end_byte]
    if kind not in _ONE_COMMAND:
        return False
    children = node.children
    for before, after in itertools.pairwise(children):
        if kind == "redirected_statement" and after.type not in _REDIRECTS:
            continue  # a here-document's body follows on the next lines
        gap = data[before.end_byte : after.start_byte]
        if b"\n" in gap.replace(b"\\\n", b""):  # a line continuation is no new line
            return True
    return False


def _rough(text: str, nest: int, s: Script, pending: list[tuple[str, int]]) -> None:
    """Where the grammar may have misread a script, deny rules also see it cut at every
    character that can end a command, quoted or not, with its quotes dropped: more forms than
    bash would run, never fewer."""
    for segment in _CUTS.split(text):
        words = [_QUOTING.sub("", w) for w in segment.split()]
        while words and _ASSIGNMENT.match(words[0]):
            words.pop(0)
        if words:
            _expand([(w, True) for w in words], None, nest, s, pending)


def _scan(text: str, depth: int, s: Script, pending: list[tuple[str, int]]) -> None:
    """One script's parse tree, walked without recursion (a tree may be 60,000 deep)."""
    tree, data = _parse(text)
    misread = tree.root_node.has_error
    if misread:  # the walk goes on: deny rules still see what parsed, and the rough cuts
        s.hide("a parse error")
        _rough(text, depth, s, pending)
    stack: list[tuple[Node, int, Node | None]] = [(tree.root_node, depth, None)]
    while stack:
        node, nest, parent = stack.pop()
        kind = node.type
        if not misread and _misread(node, data):
            misread = True
            s.hide("a script the grammar may read otherwise than bash")
            _rough(text, depth, s, pending)
        if kind not in (_PLAIN_NODES if node.is_named else _PLAIN_TOKENS):
            s.plain = False
        if kind in _NESTING:
            nest += 1
            if nest > MAX_DEPTH:
                s.hide("nested deeper than MAX_DEPTH")
                continue
        if kind == "command":
            _command((node, parent), nest, s, pending)
        elif kind == "file_redirect":
            _redirect(node, s)
        stack.extend((child, nest, node) for child in reversed(node.children))


def _parser() -> Parser:
    parser: Parser | None = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = Parser(_BASH)
    return parser


def analyse(command: str) -> Script:
    """What a command line runs, writes, reads and reaches, as far as its parse shows."""
    s = Script()
    if len(command) > MAX_COMMAND:
        s.hide("longer than MAX_COMMAND")
        return s
    if "\0" in command:  # the grammar stops reading at a NUL: what follows would go unseen
        s.hide("a NUL character")
    pending = [(command, 0)]
    while pending:
        text, depth = pending.pop(0)
        s.parsed += len(text)
        if s.parsed > _MAX_PARSED:
            s.hide("more nested script than can be parsed")
            break
        _scan(text, depth, s, pending)
    if len(s.writes) + len(s.reads) > _MAX_TARGETS:
        s.hide("more redirections than can be checked")
    return s


def commands(command: str) -> list[str]:
    """Every simple command in a command line, as written, in the order met (nested scripts
    after the line they are in)."""
    return analyse(command).commands


def _plain_argv(command: str) -> list[str] | None:
    """The words of a command line that is one simple command of literal words, else None."""
    if len(command) > MAX_COMMAND or "\0" in command:
        return None
    tree, _ = _parse(command)
    root = tree.root_node
    named = [c for c in root.children if c.is_named]
    if root.has_error or len(named) != 1 or named[0].type != "command":
        return None
    node = named[0]
    if any(
        c.type in ("variable_assignment", "file_redirect", "herestring_redirect")
        for c in node.children
    ):
        return None
    words = _words(node, root)
    return [w for w, _ in words] if all(lit for _, lit in words) else None


def _shell_c(argv: Sequence[str]) -> str | None:
    """The script of `sh -c 'script'` (`bash -lc`, `/bin/zsh -c`, ...), else None."""
    if len(argv) != 3 or posixpath.basename(argv[0]) not in _SHELLS:
        return None
    flags = argv[1]
    if flags.startswith("-") and not flags.startswith("--") and "c" in flags:
        return argv[2]
    return None


def _globs_hit(globs: Sequence[str], text: str, *, one_line: bool) -> bool:
    if one_line and "\n" in text:  # an allow glob's `*` never carries a second line
        return False
    return any(fnmatchcase(text, g) for g in globs)


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
        script = _shell_c(value)
        return script if script is not None else shlex.join(value)
    if not isinstance(value, str) or not value:
        return None
    argv = _plain_argv(value)
    script = _shell_c(argv) if argv is not None else None
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
