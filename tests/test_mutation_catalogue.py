"""The mutation catalogues in bench/ stay true to the code: a module split or a rename that
leaves a mutant pointing at code that moved fails here, not months later in a mutation run.

bench/mutation.py holds hand-made mutants (an exact string, to occur once in one file);
bench/mutation_py.py names modules and the functions in them to mutate, with the tests to run.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_catalogue_{name}", ROOT / "bench" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


HAND = load("mutation.py")
GENERATED = load("mutation_py.py")


@pytest.mark.parametrize("mutant", HAND.CATALOGUE, ids=lambda m: m.id)
def test_each_hand_made_mutant_applies_once(mutant: object) -> None:
    path = ROOT / mutant.path  # type: ignore[attr-defined]
    assert path.is_file(), f"{mutant.path} is gone"  # type: ignore[attr-defined]
    count = path.read_text().count(mutant.old)  # type: ignore[attr-defined]
    assert count == 1, f"{mutant.old!r} occurs {count} times in {mutant.path}"  # type: ignore[attr-defined]


def test_every_module_of_the_catalogue_has_mutants_and_tests() -> None:
    used = {m.module for m in HAND.CATALOGUE}
    assert used <= set(HAND.MODULES) and used <= set(HAND.TESTS)
    for args in (a for runs in HAND.TESTS.values() for run in runs for a in run):
        if args.startswith("tests/"):
            assert list(ROOT.glob(args.split("::")[0])), f"no test file {args}"


def _qualnames(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}.{f.name}"
                for f in node.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return names


@pytest.mark.parametrize("name", sorted(GENERATED.TARGETS))
def test_each_generated_target_names_code_that_is_there(name: str) -> None:
    target = GENERATED.TARGETS[name]
    path = ROOT / target.path
    assert path.is_file(), target.path
    missing = set(target.functions) - _qualnames(path)
    assert not missing, f"not in {target.path}: {sorted(missing)}"
    for test in target.tests:
        assert (ROOT / test).exists(), test
