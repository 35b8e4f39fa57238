"""The scripted harness's script: its model, its checking, and where a turn's script comes from.

A script is turns of steps (`Say`, `Tool`, `Ask`, `Fail`, `Sleep`), checked strictly by pydantic
models into a frozen `Script`; `parse_script` checks one, `validate_config` checks a thread's
harness config (`{"script": ...}`, `{"script_file": ...}` or `{}` for `DEFAULT_SCRIPT`), and
`load_script` gives the script a turn runs. The format and what each step does are described in
`workers.agents.scripted`, which runs the turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker import LIMITS, BadItem, Question

__all__ = [
    "DEFAULT_SCRIPT",
    "Ask",
    "Entry",
    "Fail",
    "Say",
    "Script",
    "Sleep",
    "Step",
    "Tool",
    "load_script",
    "parse_script",
    "validate_config",
]

#: The script of a thread created with an empty config.
DEFAULT_SCRIPT: dict[str, Any] = {
    "turns": [
        {
            "steps": [
                {
                    "ask": [
                        {
                            "question": "Pick one",
                            "header": "pick",
                            "options": [{"label": "A"}, {"label": "B"}],
                        }
                    ]
                }
            ]
        }
    ]
}


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Say(_Spec):
    """The agent outputs `say`."""

    say: str


class Tool(_Spec):
    """A tool call: approved first under `approval` permissions, then `output` is shown (or,
    with `shell`, `input.command` really runs and its output is shown)."""

    tool: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)
    output: str = ""
    shell: bool = False


class Ask(_Spec):
    """An `ask_user_question` prompt."""

    ask: list[Question] = Field(min_length=1, max_length=LIMITS["questions"])


class Fail(_Spec):
    """The turn fails with `fail` as its error."""

    fail: str


class Sleep(_Spec):
    """Simulated work: wait `sleep` seconds (at most `MAX_SLEEP`)."""

    sleep: float = Field(ge=0, allow_inf_nan=False)


Step = Say | Tool | Ask | Fail | Sleep
_STEPS: dict[str, type[Say] | type[Tool] | type[Ask] | type[Fail] | type[Sleep]] = {
    "say": Say,
    "tool": Tool,
    "ask": Ask,
    "fail": Fail,
    "sleep": Sleep,
}
_STEP_KEYS = ", ".join(_STEPS)


class _EntrySpec(_Spec):
    match: str | None = None
    steps: list[dict[str, Any]]


class _ScriptSpec(_Spec):
    turns: list[_EntrySpec]


@dataclass(frozen=True)
class Entry:
    """One entry of a script: the steps a turn runs when its prompt matches."""

    match: str | None
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Script:
    """A parsed, checked script."""

    turns: tuple[Entry, ...]

    def pick(self, prompt: str) -> int | None:
        """The entry for this prompt: the first whose `match` it holds, else the first without."""
        for i, entry in enumerate(self.turns):
            if entry.match is not None and entry.match in prompt:
                return i
        for i, entry in enumerate(self.turns):
            if entry.match is None:
                return i
        return None

    def step_at(self, entry: int, step: int) -> Step | None:
        """The step at a saved position, or None when the script no longer has it."""
        if 0 <= entry < len(self.turns) and 0 <= step < len(self.turns[entry].steps):
            return self.turns[entry].steps[step]
        return None


# -- parsing and checking ------------------------------------------------------------------------


def _path(prefix: str, loc: Sequence[int | str]) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _bad(prefix: str, error: ValidationError, unknown: str = "unknown field") -> BadItem:
    err = error.errors()[0]
    problem = unknown if err["type"] == "extra_forbidden" else err["msg"]
    return BadItem(_path(prefix, err["loc"]) or "script", problem)


def _parse_step(raw: dict[str, Any], where: str) -> Step:
    actions = [key for key in raw if key in _STEPS]
    if len(actions) > 1:
        raise BadItem(where, f"a step does one thing, this one has {', '.join(actions)}")
    if not actions:
        if not raw:
            raise BadItem(where, f"an empty step; a step is one of {_STEP_KEYS}")
        raise BadItem(f"{where}.{next(iter(raw))}", f"unknown step; a step is one of {_STEP_KEYS}")
    try:
        return _STEPS[actions[0]].model_validate(raw, strict=True)
    except ValidationError as e:
        raise _bad(where, e, f"unknown field for a {actions[0]} step") from None


def parse_script(raw: object, prefix: str = "") -> Script:
    """Check a script (a decoded JSON object); `BadItem` names the field, under `prefix`."""
    if not isinstance(raw, dict):
        raise BadItem(prefix or "script", 'expected an object: {"turns": [...]}')
    try:
        spec = _ScriptSpec.model_validate(raw, strict=True)
    except ValidationError as e:
        raise _bad(prefix, e) from None
    return Script(
        tuple(
            Entry(
                match=entry.match,
                steps=tuple(
                    _parse_step(step, _path(prefix, ("turns", i, "steps", j)))
                    for j, step in enumerate(entry.steps)
                ),
            )
            for i, entry in enumerate(spec.turns)
        )
    )


_DEFAULT = parse_script(DEFAULT_SCRIPT)


@dataclass(frozen=True)
class _Source:
    inline: object = None
    has_inline: bool = False
    path: str | None = None


def _source(config: object) -> _Source:
    if not isinstance(config, dict):
        raise BadItem("config", "expected an object")
    for key in config:
        if key not in ("script", "script_file"):
            raise BadItem(
                f"config.{key}", "unknown key; the scripted harness takes script or script_file"
            )
    if "script" in config and "script_file" in config:
        raise BadItem("config", "give script or script_file, not both")
    if "script_file" not in config:
        return _Source(inline=config.get("script"), has_inline="script" in config)
    path = config["script_file"]
    if not isinstance(path, str) or not Path(path).is_absolute():
        raise BadItem("config.script_file", "expected an absolute path to a JSON script file")
    return _Source(path=path)


def _parse_file(path: str, data: bytes) -> Script:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise BadItem("config.script_file", f"{path} is not JSON ({e})") from None
    try:
        return parse_script(raw)
    except BadItem as e:
        raise BadItem("config.script_file", f"{path}: {e}") from None


def validate_config(config: dict[str, Any]) -> None:
    """Refuse a config the scripted harness cannot run, with `BadItem` naming the field.

    A `script_file` is checked when it can be read here; one that cannot is accepted, since
    it is read at every turn, perhaps on another host.
    """
    source = _source(config)
    if source.path is not None:
        try:
            data = Path(source.path).read_bytes()
        except OSError:
            return
        _parse_file(source.path, data)
    elif source.has_inline:
        parse_script(source.inline, "config.script")


async def load_script(config: dict[str, Any]) -> Script:
    """The script a turn runs: inline, freshly read from `script_file`, or the default."""
    source = _source(config)
    if source.path is not None:
        try:
            data = await asyncio.to_thread(Path(source.path).read_bytes)
        except OSError as e:
            raise BadItem("config.script_file", f"cannot read {source.path}: {e}") from None
        return _parse_file(source.path, data)
    if source.has_inline:
        return parse_script(source.inline, "config.script")
    return _DEFAULT
