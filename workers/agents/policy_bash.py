"""The guarded policy's reading of a bash parse tree: parsing a script, and a command's words.

`parse` parses a script with tree-sitter-bash, a real shell grammar (with non-ASCII characters
masked, which crash the grammar); `node_text` reads a node's text from the script being walked;
`decode` gives a word's value with its quoting removed (`r''m`, `\\rm`, `"rm"`, `$'rm'` are all
`rm`), or None when it expands; `words` a simple command's words, and `stdin` the literal text a
here-document or here-string feeds it. `workers.agents.policy_shell` walks the tree with these.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import tree_sitter_bash
from tree_sitter import Language, Node, Parser, Tree

__all__ = ["Site", "Word", "decode", "node_text", "parse", "stdin", "word", "words"]

_BASH = Language(tree_sitter_bash.language())
_parsers = threading.local()  # a Parser is not safe to share between threads
_source = threading.local()  # the bytes of the script being walked (`parse`)
_NON_ASCII = re.compile(rb"[\x80-\xff]")

_ANSI = re.compile(
    r"\\(x[0-9a-fA-F]{1,2}|u[0-9a-fA-F]{1,4}|U[0-9a-fA-F]{1,8}|[0-7]{1,3}|c.|.)", re.S
)
_ANSI_CHARS = {
    "a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "n": "\n", "r": "\r",
    "t": "\t", "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?",
}  # fmt: skip
_UNQUOTED_ESCAPE = re.compile(r"\\(.)", re.S)
_DQ_ESCAPE = re.compile(r'\\([$`"\\\n])')
_NOT_WORDS = frozenset({"variable_assignment", "file_redirect", "herestring_redirect"})

Word = tuple[str, bool]  # a word's value (as written when not literal), and whether it is literal
Site = tuple["Node", "Node | None"]  # a command node and its parent


def parse(text: str) -> tuple[Tree, bytes]:
    """A script's parse tree, and its bytes (which `node_text` reads nodes from).

    The grammar is given the script with every byte of a non-ASCII character replaced by `x`:
    tree-sitter-bash crashes the process on some characters (`{` then U+DF1A8 segfaults it),
    and bash itself reads them as ordinary word characters, as it does `x` (no Unicode blank
    separates words in bash). The lengths in bytes are the same, so each node's text is read
    from the real script."""
    data = text.encode("utf-8", "surrogatepass")
    _source.data = data
    return _parser().parse(_NON_ASCII.sub(b"x", data)), data


def node_text(node: Node) -> str:
    """A node's text, from the script being walked (`parse`)."""
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


def decode(node: Node) -> str | None:
    """A word's value with quoting removed, or None when it expands (`$x`, `$(...)`, ...)."""
    kind = node.type
    simple = _DECODERS.get(kind)
    if simple is not None:
        return simple(node_text(node))
    if kind == "string":
        plain = all(c.type in ('"', "string_content") for c in node.children)
        return _double_quoted(node_text(node)[1:-1]) if plain else None
    if kind not in ("concatenation", "translated_string"):
        return None
    parts: list[str] = []
    for child in node.children:
        if child.type == "$" and not child.is_named:  # `$"..."`: a translated string
            continue
        value = decode(child)
        if value is None:
            return None
        parts.append(value)
    return "".join(parts)


def word(node: Node) -> Word:
    value = decode(node)
    return (value, True) if value is not None else (node_text(node), False)


def words(node: Node, parent: Node | None) -> list[Word]:
    """A command's words: its name and arguments, and the words bash reads as arguments that
    the grammar hangs on a redirection after the command (`echo > f hi`). The parent comes from
    the walk: `Node.parent` searches down from the root, slow in a deep tree."""
    words: list[Word] = []
    for child in node.children:  # an unnamed `$` before a string makes it `$"..."`: the same
        if not child.is_named or child.type in _NOT_WORDS:
            continue
        target = child.children[0] if child.type == "command_name" and child.children else child
        words.append(word(target))
    if parent is not None and parent.type == "redirected_statement":
        for redirect in parent.children:
            if redirect.type == "file_redirect":
                named = [c for c in redirect.children if c.is_named and c.type != "file_descriptor"]
                words += [word(c) for c in named[1:]]
    return words


def stdin(site: Site) -> Word | None:
    """The literal text a here-document or here-string feeds a command, if any."""
    node, parent = site
    places = list(node.children)
    if parent is not None and parent.type == "redirected_statement":
        places += parent.children
    for place in places:
        if place.type == "herestring_redirect":
            named = [c for c in place.children if c.is_named]
            return word(named[0]) if named else ("", True)
        if place.type == "heredoc_redirect":
            for child in place.children:
                if child.type == "heredoc_body":
                    return node_text(child), True
            return "", True
    return None


def _parser() -> Parser:
    parser: Parser | None = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = Parser(_BASH)
    return parser
