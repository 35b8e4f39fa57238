"""Packaging and the scripts a new user runs first: what they say, what they build.

These build the project as pip does (an isolated build, a fresh virtualenv), so they are slow
and need the package index that the installation itself needs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What setuptools says when the project's own configuration is at fault (not pip's notes).
SETUPTOOLS_WARNING = re.compile(
    r"SetuptoolsDeprecationWarning|BuildBackendWarning|SetuptoolsWarning|"
    r"_Warning: Package|is absent from the `packages` configuration"
)

pytestmark = pytest.mark.slow


def sources(into: Path) -> Path:
    """A copy of what a build reads (a build writes egg-info and build/ beside it)."""
    for name in ("broker", "workers", "web"):
        shutil.copytree(ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, into / name)
    return into


def run(*argv: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_wheel_builds_without_setuptools_warnings(tmp_path: Path) -> None:
    """The wheel: no warning caused by our configuration (the license is an SPDX string, the
    Lua scripts are package data of a declared package), and every script is in it."""
    src = sources(tmp_path / "src")
    built = run(sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", "dist", ".", cwd=src)
    output = built.stdout + built.stderr
    assert not SETUPTOOLS_WARNING.search(output), SETUPTOOLS_WARNING.search(output)
    (wheel,) = (src / "dist").glob("prompt_broker-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = next(zf.read(n).decode() for n in names if n.endswith("/METADATA"))
    lua = {p.name for p in (ROOT / "broker" / "lua").glob("*.lua")}
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith("broker/lua/")} == lua
    assert "License-Expression: MIT" in metadata
    static = {p.name for p in (ROOT / "web" / "static").glob("*") if p.is_file()}
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith("web/static/")} == static
    # Every package of ours is in it (pyproject lists them one by one: a new one is easy to miss).
    ours = {
        str(p.parent.relative_to(ROOT))
        for top in ("broker", "workers", "web")
        for p in (ROOT / top).rglob("__init__.py")
    }
    missing = ours - {n.rsplit("/", 1)[0] for n in names}
    assert not missing, f"packages not in the wheel (add them to pyproject.toml): {missing}"


def test_editable_install_without_setuptools_warnings(tmp_path: Path) -> None:
    """`pip install -e .`, what scripts/bootstrap does: no warning about broker/lua either."""
    src = sources(tmp_path / "src")
    run(sys.executable, "-m", "venv", tmp_path / "venv", cwd=tmp_path)
    pip = [tmp_path / "venv" / "bin" / "python", "-m", "pip"]
    installed = run(*pip, "install", "-v", "--no-deps", "-e", ".", cwd=src)
    output = installed.stdout + installed.stderr
    assert not SETUPTOOLS_WARNING.search(output), SETUPTOOLS_WARNING.search(output)


def test_scripts_test_says_why_tests_skip(tmp_path: Path) -> None:
    """scripts/test lists every skipped test with its reason (-rs)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import pytest\n\n\ndef test_probe() -> None:\n"
        "    pytest.skip('the probe is skipped on purpose')\n"
    )
    done = run(ROOT / "scripts" / "test", "-q", "-p", "no:cacheprovider", probe, cwd=ROOT)
    assert "SKIPPED [1]" in done.stdout and "the probe is skipped on purpose" in done.stdout


def test_first_bootstrap_says_what_it_installs(tmp_path: Path) -> None:
    """The first scripts/bootstrap of a clean checkout says what it is installing before the
    long quiet install; the second says nothing."""
    clone = tmp_path / "clone"
    run("git", "clone", "-q", ROOT, clone, cwd=tmp_path)
    for name in ("pyproject.toml", "scripts/bootstrap"):  # what is being tested, as it stands
        shutil.copy(ROOT / name, clone / name)
    first = run(clone / "scripts" / "bootstrap", cwd=clone, timeout=900)
    said = first.stderr
    assert "bootstrap: creating .venv with Python 3." in said
    assert "bootstrap: installing prompt-broker (editable) and its dev tools" in said
    assert "pip install -e '.[dev]'" in said
    assert re.search(r"runtime: redis, arq, pydantic", said), said
    assert re.search(r"dev tools: .*pytest.*ruff.*mypy", said), said
    assert said.rstrip().endswith("bootstrap: .venv is ready")
    again = run(clone / "scripts" / "bootstrap", cwd=clone)
    assert again.stderr == ""
