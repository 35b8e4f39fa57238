"""The Codex CLI and what each turn runs it with: finding the binary (`find_codex`), a thread's
harness config checked (`parse_config`) and written out as the turn's `config.toml`, the
approval policy and sandbox a turn runs under for the thread's permissions, and the per-turn
`CODEX_HOME` folders a dead replica leaves behind (`sweep_homes`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from broker import BadItem

__all__ = [
    "DEFAULT_FEATURES",
    "HOME_PREFIX",
    "KEY_ENV",
    "OWNER",
    "PINNED_VERSION",
    "SANDBOX_POLICY",
    "CodexConfig",
    "approval_policy",
    "config_toml",
    "find_codex",
    "parse_config",
    "sandbox_mode",
    "sweep_homes",
    "validate_config",
]

#: The Codex CLI version whose protocol this harness speaks (package.json pins it).
PINNED_VERSION = "0.171.0"

#: Codex features the harness turns on: questions outside Plan mode, and the permissions tool.
DEFAULT_FEATURES = ("default_mode_request_user_input", "request_permissions_tool")

_POLICIES = ("on-request", "untrusted")
_SANDBOXES = ("read-only", "workspace-write", "danger-full-access")
SANDBOX_POLICY = {
    "read-only": {"type": "readOnly"},
    "workspace-write": {"type": "workspaceWrite"},
    "danger-full-access": {"type": "dangerFullAccess"},
}
KEY_ENV = "PB_CODEX_API_KEY"
HOME_PREFIX = "pb-codex-"
OWNER = "owner.pid"  # in each CODEX_HOME: the replica process's pid, for `sweep_homes`


# -- finding the CLI -------------------------------------------------------------------------


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_codex(explicit: str | None = None) -> str | None:
    """The Codex binary: `explicit`, `$CODEX_BIN`, the repo's pinned npm install (its native
    binary, so no node shim sits between us and Codex), its `.bin/codex`, or `codex` on PATH."""
    for candidate in (explicit, os.environ.get("CODEX_BIN")):
        if candidate:
            return candidate if os.access(candidate, os.X_OK) else None
    modules = _repo_root() / "node_modules"
    for native in sorted(modules.glob("@openai/codex-*/vendor/*/bin/codex")):
        if os.access(native, os.X_OK):
            return str(native)
    shim = modules / ".bin" / "codex"
    if os.access(shim, os.X_OK):
        return str(shim)
    return shutil.which("codex")


# -- config ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodexConfig:
    """A thread's Codex config, checked."""

    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    api_key_env: str | None = None
    approval_policy: str = "on-request"
    sandbox: str = "workspace-write"


_KEYS = ("model", "base_url", "api_key", "api_key_env", "approval_policy", "sandbox")


def parse_config(config: object) -> CodexConfig:
    """Check a thread's Codex config; `BadItem` names the offending field."""
    if not isinstance(config, dict):
        raise BadItem("config", "expected an object")
    for key, value in config.items():
        if key not in _KEYS:
            raise BadItem(
                f"config.{key}", f"unknown key; the codex harness takes {', '.join(_KEYS)}"
            )
        if not isinstance(value, str) or not value:
            raise BadItem(f"config.{key}", "expected a non-empty string")
    base_url = config.get("base_url")
    if base_url is not None:
        url = urlparse(base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise BadItem("config.base_url", "expected an http(s) URL such as http://host/v1")
    if "api_key" in config and "api_key_env" in config:
        raise BadItem("config", "give api_key or api_key_env, not both")
    policy = config.get("approval_policy", "on-request")
    if policy not in _POLICIES:
        raise BadItem("config.approval_policy", f"expected one of {', '.join(_POLICIES)}")
    sandbox = config.get("sandbox", "workspace-write")
    if sandbox not in _SANDBOXES:
        raise BadItem("config.sandbox", f"expected one of {', '.join(_SANDBOXES)}")
    return CodexConfig(
        model=config.get("model"),
        base_url=base_url,
        api_key=config.get("api_key"),
        api_key_env=config.get("api_key_env"),
        approval_policy=policy,
        sandbox=sandbox,
    )


def approval_policy(cfg: CodexConfig, permissions: str) -> str:
    """Codex's approval policy for a turn under the thread's `permissions`."""
    if permissions == "autonomous":
        return "never"
    if permissions == "guarded":
        # `untrusted` asks for every command and every file change, whatever the sandbox:
        # the only policy under which the worker's deny rules see every call. Under
        # `on-request` Codex runs what its sandbox allows without asking anyone.
        return "untrusted"
    return cfg.approval_policy


def sandbox_mode(cfg: CodexConfig, permissions: str) -> str:
    """Codex's sandbox for a turn under the thread's `permissions`."""
    return "danger-full-access" if permissions == "autonomous" else cfg.sandbox


def validate_config(config: dict[str, Any]) -> None:
    """Refuse a config the codex harness cannot run (`BadItem` names the field)."""
    parse_config(config)


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def config_toml(
    cfg: CodexConfig, features: Sequence[str] = DEFAULT_FEATURES, *, has_key: bool = True
) -> str:
    """`$CODEX_HOME/config.toml` for one turn: the provider, and nothing that phones home.

    The key itself is never written: Codex reads it from `$PB_CODEX_API_KEY` (`has_key`).
    """
    lines = []
    if cfg.model:
        lines.append(f"model = {_toml(cfg.model)}")
    if cfg.base_url:
        lines.append('model_provider = "prompt_broker"')
    lines.append("suppress_unstable_features_warning = true")
    if cfg.base_url:
        lines += [
            "",
            "[model_providers.prompt_broker]",
            'name = "prompt-broker thread provider"',
            f"base_url = {_toml(cfg.base_url)}",
            'wire_api = "responses"',
            "supports_websockets = false",
        ]
        if has_key:
            lines.append(f"env_key = {_toml(KEY_ENV)}")
    lines += ["", "[analytics]", "enabled = false", "", "[feedback]", "enabled = false"]
    lines += ["", "[features]", "plugins = false", "remote_plugin = false", "apps = false"]
    lines += [f"{name} = true" for name in features]
    return "\n".join(lines) + "\n"


# -- per-turn homes --------------------------------------------------------------------------


def sweep_homes(root: str | None = None) -> int:
    """Remove the per-turn CODEX_HOMEs that a dead process left behind (a SIGKILLed replica
    cannot clean up after itself); returns how many. Homes of live processes are kept."""
    removed = 0
    for home in Path(root or tempfile.gettempdir()).glob(f"{HOME_PREFIX}*"):
        try:
            pid = int((home / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being set up
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(home, ignore_errors=True)
        removed += 1
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
