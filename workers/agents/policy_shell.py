"""The guarded policy's shell analysis: what a command line runs, writes, reads and reaches.

`analyse` parses a command line (`workers.agents.policy_bash`) and walks its tree into a `Script`:
every simple command wherever it sits (lists, pipelines, substitutions, bodies, and the scripts of
`bash -c`, `eval`, here-documents fed to a shell, `find -exec`, `xargs`, git aliases), each in every
form a deny rule is matched against (quoting removed, behind wrappers, git's options dropped, ...),
its redirections and network use, whether an allow rule can prove all of it (`plain`), and why any
part went unseen. It fails closed: a parse error, a sign that the grammar read the command
otherwise than bash would, or a limit passed (`MAX_COMMAND`, `MAX_DEPTH`, ...) marks the script
unseen, never silently smaller. What the policy makes of a `Script` is in `workers.agents.policy`.
"""

from __future__ import annotations

import itertools
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tree_sitter import Node

from workers.agents import policy_bash as bash
from workers.agents.policy_bash import Site, Word

__all__ = [
    "MAX_COMMAND",
    "MAX_DEPTH",
    "MAX_WRAPPED",
    "Script",
    "analyse",
    "commands",
    "plain_argv",
    "shell_c",
]

#: The longest command parsed (characters); a longer one is not looked into at all.
MAX_COMMAND = 128 * 1024
#: How deeply nested scopes (`$(...)`, subshells, bodies, `bash -c` scripts) are looked into.
MAX_DEPTH = 8
#: How many words after a wrapper (`sudo -u root ...`) are tried as the start of its command.
MAX_WRAPPED = 16
_MAX_FORMS = 64  # forms of one simple command
_MAX_TARGETS = 256  # distinct redirection targets
_MAX_PARSED = 2 * MAX_COMMAND  # characters parsed for one call, nested scripts included
_SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "mksh", "fish", "busybox"})


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
    value = bash.decode(target)
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
        stdin = bash.stdin(site) if site is not None else None
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
    text = bash.node_text(site[0])
    if not text:  # a command the grammar supplied as missing (`a |`): a parse error, hidden
        return
    s.commands.append(text)
    s.forms.update((text, text + " "))
    argv = bash.words(*site)
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
        return _bare_blank(bash.node_text(node))
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
    tree, data = bash.parse(text)
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


def plain_argv(command: str) -> list[str] | None:
    """The words of a command line that is one simple command of literal words, else None."""
    if len(command) > MAX_COMMAND or "\0" in command:
        return None
    tree, _ = bash.parse(command)
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
    words = bash.words(node, root)
    return [w for w, _ in words] if all(lit for _, lit in words) else None


def shell_c(argv: Sequence[str]) -> str | None:
    """The script of `sh -c 'script'` (`bash -lc`, `/bin/zsh -c`, ...), else None."""
    if len(argv) != 3 or posixpath.basename(argv[0]) not in _SHELLS:
        return None
    flags = argv[1]
    if flags.startswith("-") and not flags.startswith("--") and "c" in flags:
        return argv[2]
    return None
