"""The docs and the front door stay true to the code, and the house refers only to itself.

The README is the front page; the detail lives in docs/. Tables the code defines (settings,
commands, keys, scripts) are checked against the code. No Markdown file, docstring or comment
links or points outside the repository, names a file that is not there, or cites the numbered
edge cases of a document the repository does not have.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import broker
from broker import Settings
from broker.cli import COMMANDS
from broker.events import event_key
from broker.keys import Keys
from workers.runtime.cli import RUNTIME

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
OPERATIONS = (DOCS / "operations.md").read_text()
PROTOCOL = (DOCS / "protocol.md").read_text()
HTTP = (DOCS / "http.md").read_text()
ARCHITECTURE = (DOCS / "architecture.md").read_text()
MARKDOWN = [*sorted(ROOT.glob("*.md")), *sorted(DOCS.rglob("*.md"))]
CODE_DIRS = tuple(d for d in ("broker", "workers", "web", "tests", "bench") if (ROOT / d).is_dir())
BUILD_FILES = (".ci/run", "Dockerfile", "docker-compose.yml", "pyproject.toml")


# -- the front door and the tables -----------------------------------------------------------


def test_front_door_exports_resolve() -> None:
    """Every name in `broker.__all__` exists, once, and the public errors and models are there."""
    assert len(set(broker.__all__)) == len(broker.__all__)
    for name in broker.__all__:
        assert hasattr(broker, name), name
    for module in (broker.errors, broker.models):
        for name in module.__all__:
            if name[0].isupper() and not name.endswith("Payload") and "Metadata" not in name:
                assert name in broker.__all__, f"{module.__name__}.{name} is not exported"


def test_operations_lists_every_setting_with_its_default() -> None:
    """Each setting appears in the configuration table of docs/operations.md, with its default
    (an empty one written "(empty)")."""
    for name, field in Settings.model_fields.items():
        row = re.search(
            rf"\| `PROMPT_BROKER_{name.upper()}` \| (?:`([^`]+)`|\(empty\)) \|", OPERATIONS
        )
        assert row is not None, f"PROMPT_BROKER_{name.upper()} is not in docs/operations.md"
        assert (row.group(1) or "") == str(field.default), name


def test_http_lists_every_api_setting_with_its_default() -> None:
    """Each of the HTTP server's settings is in docs/http.md's table, with its real default."""
    from web.settings import ApiSettings

    for name, field in ApiSettings.model_fields.items():
        row = re.search(rf"\| `PROMPT_BROKER_API_{name.upper()}` \| ([^|]*) \|", HTTP)
        assert row is not None, f"PROMPT_BROKER_API_{name.upper()} is not in docs/http.md"
        if field.default == ():  # an empty list of identities or subscriptions
            expected = "`[]`"
        elif name == "session_secret":
            expected = "(random per process)"
        else:
            expected = f"`{field.default}`"
        assert row.group(1) == expected, name


def test_http_lists_every_route() -> None:
    """Every route the HTTP app serves is in the routes table of docs/http.md."""
    from starlette.routing import Route

    from web.app import create_app
    from web.settings import ApiSettings

    app = create_app(ApiSettings(), Settings())
    paths = {r.path for r in app.routes if isinstance(r, Route)}
    assert "/v1/prompts" in paths
    for path in paths:
        shown = path.replace("{thread_id}", "{thread}").replace("{prompt_id}", "{prompt}")
        found = re.search(rf"`(GET|POST|DELETE)[^`]* {re.escape(shown)}[`?]", HTTP)
        assert found, f"{path} is not in docs/http.md"


def test_operations_lists_every_command() -> None:
    """Each CLI command appears in the command list of docs/operations.md."""
    for name in {**COMMANDS, **RUNTIME}:
        assert f"prompt-broker {name}" in OPERATIONS, name


def test_protocol_lists_every_limit() -> None:
    """Each of `broker.LIMITS` is in the limits table of docs/protocol.md, with its value."""
    for name, value in broker.LIMITS.items():
        row = re.search(rf"^\|([^|\n]*)\|([^|\n]*)\| `{name}` \|$", PROTOCOL, re.M)
        assert row is not None, f"LIMITS[{name!r}] is not in docs/protocol.md"
        shown = row.group(2).replace(",", "")
        assert re.search(rf"\b{value}\b", shown) or f"{value // 1024} KiB" in shown, (name, shown)


def test_architecture_lists_every_key() -> None:
    """Every key and channel `broker/keys.py` builds is in the data model of architecture.md."""
    keys = Keys("pp")
    thread = keys.thread("T")
    names = [
        thread.items,
        thread.active,
        thread.inbox,
        thread.session,
        thread.wake,
        thread.prompt("<prompt_id>"),
        thread.agent("<name>"),
        thread.agents,
        thread.prompts,
        thread.idems,
        thread.timing,
        keys.open,
        keys.due,
        keys.audit,
        keys.leases,
        keys.replicas,
        keys.replica_records,
        keys.holds("<replica>", "<incarnation>"),
        keys.audit_queue,
        "arq:job:" + keys.audit_job_id("T", "<prompt_id>"),
        event_key(keys),
    ]
    for name in names:
        assert f"| `{name}` |" in ARCHITECTURE, f"{name} is not in docs/architecture.md"
    built = {n for n in dir(thread) if not n.startswith("_")} - {"thread_id", "base"}
    known = {"items", "active", "inbox", "session", "wake", "prompt", "agent"}
    assert built <= known | {"agents", "prompts", "idems", "timing"}, (
        f"a new per-thread key ({built}): add it to docs/architecture.md and to this test"
    )


def test_architecture_lists_every_script() -> None:
    """Every Lua script in broker/lua is named in architecture.md."""
    for script in sorted((ROOT / "broker" / "lua").glob("*.lua")):
        assert f"`{script.name}`" in ARCHITECTURE, f"{script.name} is not in docs/architecture.md"


def test_architecture_lists_every_record_field() -> None:
    """Every field of a prompt's or a session's hash the code reads or writes (and each value a
    script writes) is named in architecture.md."""
    fields: set[str] = set()
    hash_call = re.compile(r"redis\.call\('H(?:SET|GET|MGET|DEL|INCRBY)'\s*,\s*[^,)]+(,[^\n]*)?\)")
    for script in (ROOT / "broker" / "lua").glob("*.lua"):
        for call in hash_call.finditer(script.read_text()):
            fields |= set(re.findall(r"'([A-Za-z_]+)'", call.group(1) or ""))
    for module in ("sessions.py", "_codec.py"):
        source = (ROOT / "broker" / module).read_text()
        fields |= set(re.findall(r'\bh(?:\.get\(|\[)"([a-z][a-z_]*)"', source))
    assert {"state", "delivered", "wait", "harness"} <= fields  # the readers found them
    missing = sorted(f for f in fields if f"`{f}`" not in ARCHITECTURE)
    assert not missing, f"not in docs/architecture.md: {missing}"


def test_operations_names_only_log_events_that_exist() -> None:
    """Every log event the Logs section of docs/operations.md names is logged somewhere."""
    section = OPERATIONS.split("## Logs", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`([a-z]+\.[a-z_]+)`", section)
    assert len(named) >= 8
    code = "".join(p.read_text() for d in ("broker", "workers") for p in (ROOT / d).rglob("*.py"))
    for event in named:
        assert f'"{event}"' in code, f"no log event {event!r} in broker/ or workers/"


def test_operations_lists_every_metric() -> None:
    """Every Prometheus metric the fleet's processes (`workers/runtime/metrics.py`) and the HTTP
    server (`web/metrics.py`) define is named in docs/operations.md."""
    source = "".join(
        (ROOT / f).read_text() for f in ("workers/runtime/metrics.py", "web/metrics.py")
    )
    names = re.findall(r"(?:Gauge|Counter|Histogram)\(\s*\"(prompt_broker_\w+)\"", source)
    assert len(names) >= 14 and "prompt_broker_http_requests" in names
    missing = [n for n in names if f"`{n}`" not in OPERATIONS]
    assert not missing, f"not in docs/operations.md: {missing}"


def test_operations_names_only_tests_that_exist() -> None:
    """Every test the crash-test matrix of docs/operations.md names is a test in tests/."""
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", OPERATIONS)
    assert len(named) >= 10
    for module, test in named:
        found = sorted((ROOT / "tests").rglob(module))  # tests mirror the packages' layout
        assert found, f"{module} is not a test file"
        source = found[0].read_text()
        assert re.search(rf"^(async )?def {test}\(", source, re.M), f"{module}::{test}"


def test_readme_set_up_commands_exist() -> None:
    """The README's two set-up commands are executable scripts in the repo."""
    for script in ("scripts/run", "scripts/test"):
        assert f"{script} " in README
        path = ROOT / script
        assert path.is_file() and path.stat().st_mode & 0o111, script


def test_readme_is_a_front_page() -> None:
    """The README reads in five minutes (about 1,000 words at most) and links to every doc."""
    assert len(README.split()) <= 1000, f"{len(README.split())} words"
    for doc in sorted(DOCS.glob("*.md")):
        assert f"](docs/{doc.name})" in README, f"the README does not link docs/{doc.name}"


@pytest.mark.real_redis
def test_readme_example_runs(
    real_redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The README's library example runs as written and prints what it says it prints."""
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    monkeypatch.setenv("PROMPT_BROKER_KEY_PREFIX", prefix)
    source = code.group(1).replace("redis://127.0.0.1:6379/0", real_redis_url)
    try:
        exec(compile(source, "README.md", "exec"), {"__name__": "readme"})
    finally:
        client = redis.Redis.from_url(real_redis_url)
        keys = list(client.scan_iter(match=f"{prefix}:*")) + list(
            client.scan_iter(match=f"arq:*:{prefix}:*")
        )
        if keys:
            client.delete(*keys)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("answered [Answer(") and "answer=['production']" in out[0]
    assert "answer=['production']" in out[1]


# -- references: only to the repository itself ---------------------------------------------------

#: An edge-case number of an outside document: a capital E and one to three digits, alone.
EDGE_CASE = re.compile(r"\bE\d{1,3}\b")
#: Codes in a linter's suppression comments (`noqa:` then codes such as F401) are not edge cases.
NOQA = re.compile(r"noqa(?::\s*[A-Z]+\d+(?:\s*,\s*[A-Z]+\d+)*)?")
#: Documents that live beside the repository, not in it.
OUTSIDE_DOCS = re.compile(r"\bDESIGN\b|\bSTYLE\.md\b|reference-behaviour|interactive-prompts")
#: A path that climbs out of its folder, or one that starts at a top-level folder of the repo
#: (or at the outside folders such references used to name).
PATH = re.compile(
    r"(?<![\w/$~.{<-])((?:\.\./)+[\w./*-]*[\w/*]|(?:broker|workers|web|tests|bench|docs|scripts|"
    r"spec|shared)/[\w./*-]*[\w/*])"
)
#: A Markdown file named on its own (`README.md`).
MD_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
#: A Markdown link `[text](target)` or a reference definition `[label]: target`.
LINK = re.compile(
    r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _python_texts(path: Path) -> Iterator[tuple[int, str]]:
    """The comments and docstrings of a Python file, with their line numbers."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], NOQA.sub("", token.string)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield first.lineno, first.value.value


def _lua_texts(path: Path) -> Iterator[tuple[int, str]]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if "--" in line:
            yield n, line[line.index("--") :]


def _hash_comments(path: Path) -> Iterator[tuple[int, str]]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if "#" in line:
            yield n, line[line.index("#") :]


def _sources() -> Iterator[tuple[Path, int, str]]:
    """Every comment and docstring in broker/, workers/, web/, tests/ and bench/, the comments
    of the scripts and the build files, and every Markdown file."""
    for path in [*sorted((ROOT / "scripts").iterdir()), *(ROOT / f for f in BUILD_FILES)]:
        if path.is_file():
            for line, text in _hash_comments(path):
                yield path, line, text
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix == ".py":
                texts = _python_texts(path)
            elif path.suffix == ".lua":
                texts = _lua_texts(path)
            else:
                continue
            for line, text in texts:
                yield path, line, text
    for path in MARKDOWN:
        yield path, 1, path.read_text()


def _inside(path: Path) -> bool:
    return path == ROOT or ROOT in path.parents


def problems(path: Path, text: str) -> list[str]:
    """What in `text` (found in `path`) refers outside the repository or to a missing file."""
    found = [f"edge-case number {m.group()}" for m in EDGE_CASE.finditer(text)]
    found += [f"outside document {m.group()}" for m in OUTSIDE_DOCS.finditer(text)]
    for m in PATH.finditer(text):
        ref = m.group(1)
        target = (path.parent / ref if ref.startswith("..") else ROOT / ref).resolve()
        if not _inside(target):
            found.append(f"{ref} leaves the repository")
        elif "*" in ref:  # a glob (`tests/test_guards_*.py`): it must match something
            if not any(ROOT.glob(str(target.relative_to(ROOT)))):
                found.append(f"{ref} matches no file")
        elif not target.exists():
            found.append(f"{ref} does not exist")
    for m in MD_NAME.finditer(text):
        if not any((base / m.group(1)).exists() for base in (ROOT, DOCS, path.parent)):
            found.append(f"{m.group(1)} does not exist")
    return found


def _anchors(markdown: str) -> set[str]:
    """The heading anchors a Markdown file has, as GitHub makes them."""
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """The links of a Markdown file (its `text`, if given) that leave the repository or lead
    nowhere."""
    prose = INLINE_CODE.sub("", FENCE.sub("", path.read_text() if text is None else text))
    found = []
    for m in LINK.finditer(prose):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith("//"):
            found.append(f"{target} leaves the repository")
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not _inside(dest):
            found.append(f"{target} leaves the repository")
        elif not dest.exists():
            found.append(f"{target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            found.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return found


def test_references_stay_inside_the_repository() -> None:
    """No Markdown file, docstring or comment points outside the repo or cites an edge case."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {problem}"
        for path, line, text in _sources()
        for problem in problems(path, text)
    ]
    found += [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in MARKDOWN
        for problem in link_problems(path)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("the contract is [the spec](../shared/spec/interactive-prompts.md)", True),
        ("see ../shared/DESIGN.md", True),
        ("as DESIGN orders it", True),
        ("the reference got this wrong (E" + "27)", True),
        ("see spec/reference-behaviour.md", True),
        ("built by broker/scripts.py", True),
        ("see docs/nowhere.md", True),
        ("the tests in tests/nothing_*.py", True),
        ("the tests in tests/test_docs*.py", False),
        ("see NOWHERE.md", True),
        ("see broker/_scripts.py and docs/protocol.md", False),
        ("# noqa: E" + "402 - after sys.path", False),
        ("a 2E1 value, an E2E test, `cd <dir> && make`", False),
    ],
)
def test_reference_check_catches_what_it_should(text: str, bad: bool) -> None:
    """The reference check itself: outside paths, missing files and edge-case numbers fail;
    paths in the repo, linter codes and look-alikes pass."""
    here = ROOT / "tests" / "test_docs.py"
    assert bool(problems(here, NOQA.sub("", text))) is bad, problems(here, text)


@pytest.mark.parametrize(
    ("link", "bad"),
    [
        ("[design](../shared/DESIGN.md)", True),
        ("[site](https://example.com/)", True),
        ("[missing](docs/nowhere.md)", True),
        ("[no such heading](docs/protocol.md#nowhere)", True),
        ("[protocol](docs/protocol.md)", False),
        ("[keys](docs/architecture.md#the-data-model)", False),
        ("`[not a link](../outside.md)` in code", False),
    ],
)
def test_link_check_catches_what_it_should(link: str, bad: bool) -> None:
    """The link check itself, on a Markdown page at the repository's root."""
    page, text = ROOT / "README.md", f"# Page\n\n{link}\n"
    assert bool(link_problems(page, text)) is bad, link_problems(page, text)
