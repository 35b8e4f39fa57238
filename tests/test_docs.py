"""The docs and the front door stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import redis

import broker
from broker import Settings
from broker.cli import COMMANDS
from workers.cli import RUNTIME

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_front_door_exports_resolve() -> None:
    """Every name in `broker.__all__` exists, once, and the public errors and models are there."""
    assert len(set(broker.__all__)) == len(broker.__all__)
    for name in broker.__all__:
        assert hasattr(broker, name), name
    for module in (broker.errors, broker.models):
        for name in module.__all__:
            if name[0].isupper() and not name.endswith("Payload") and "Metadata" not in name:
                assert name in broker.__all__, f"{module.__name__}.{name} is not exported"


def test_readme_lists_every_setting_with_its_default() -> None:
    """Each setting appears in the README's table with its real default."""
    for name, field in Settings.model_fields.items():
        row = re.search(rf"\| `PROMPT_BROKER_{name.upper()}` \| `([^`]*)` \|", README)
        assert row is not None, f"PROMPT_BROKER_{name.upper()} is not in the README"
        assert row.group(1) == str(field.default), name


def test_readme_lists_every_command() -> None:
    """Each CLI command appears in the README's command list."""
    for name in {**COMMANDS, **RUNTIME}:
        assert f"prompt-broker {name}" in README, name


def test_readme_set_up_commands_exist() -> None:
    """The README's two set-up commands are executable scripts in the repo."""
    root = Path(__file__).parent.parent
    for script in ("scripts/run", "scripts/test"):
        assert f"{script} " in README
        path = root / script
        assert path.is_file() and path.stat().st_mode & 0o111, script


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
