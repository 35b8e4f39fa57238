"""The layout holds: imports flow one way between the packages, and no module imports in a circle.

`broker` (the library) imports nothing of ours; `web` (the HTTP server) imports `broker` only;
`workers.agents` imports `broker`; `workers.runtime` imports `broker` and `workers.agents`;
`workers.demo` may import all of those, and the command line (`workers.runtime.cli`) dispatches to
every part. Function-level and type-checking imports count too.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "web", "workers")

#: package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "broker": set(),
    "web": {"broker"},
    "workers.agents": {"broker"},
    "workers.runtime": {"broker", "workers.agents"},
    "workers.demo": {"broker", "workers.agents", "workers.runtime"},
    # the application's one command line dispatches to every part (`serve`, `demo`, ...)
    "workers.runtime.cli": {"broker", "web", "workers.agents", "workers.runtime", "workers.demo"},
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            found[_module(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of ours that `name` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES}
    return out - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _area(module: str) -> str | None:
    for area in sorted(ALLOWED, key=len, reverse=True):
        if module == area or module.startswith(area + "."):
            return area
    return None


def test_every_module_belongs_to_an_area() -> None:
    """Each module of `workers` lives in one of its subpackages; none is left at the top."""
    loose = [m for m in MODULES if _area(m) is None and m != "workers"]
    assert loose == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module: str) -> None:
    """A module imports only from its own area and the areas below it."""
    area = _area(module)
    if area is None:
        return
    wrong = sorted(
        target
        for target in GRAPH[module]
        if (other := _area(target)) is not None and other != area and other not in ALLOWED[area]
    )
    assert wrong == [], f"{module} imports {wrong}, outside {sorted(ALLOWED[area])}"


def test_no_import_circles() -> None:
    """No module reaches itself through its imports (package `__init__` re-exports excepted)."""
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str], seen: set[str]) -> None:
        for nxt in sorted(GRAPH[node]):
            if nxt in stack:
                cycle = [*stack[stack.index(nxt) :], nxt]
                # a package importing its own submodules (a front door) is not a circle
                if not any(a == b.rpartition(".")[0] for a, b in pairwise(cycle)):
                    cycles.append(cycle)
                continue
            if nxt not in seen:
                seen.add(nxt)
                visit(nxt, [*stack, nxt], seen)

    for start in sorted(GRAPH):
        visit(start, [start], {start})
    assert cycles == [], f"import circles: {cycles[:5]}"
