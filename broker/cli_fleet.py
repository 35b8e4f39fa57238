"""The local fleet's record, as the command line reads it: where `prompt-broker up` keeps its data.

A local fleet (`workers.runtime.fleet`) writes `fleet.json` in its data folder with its Redis
address; the commands find the fleet's Redis there when no URL is given. This module holds the
data folder's place (`data_home`), the record's path (`fleet_record`) and its reading
(`read_local_fleet`, a `LocalFleet`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import orjson

__all__ = ["LocalFleet", "data_home", "fleet_record", "read_local_fleet"]


def data_home() -> Path:
    """The data folder of the local fleet (`prompt-broker up`, `scripts/run`): its Redis data
    and `fleet.json`. `$XDG_DATA_HOME/prompt-broker`, else `~/.local/share/prompt-broker`."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not base:
        try:
            base = str(Path.home() / ".local" / "share")
        except RuntimeError:  # no home directory to be found: the working folder, then
            base = ".local/share"
    return Path(base) / "prompt-broker"


def fleet_record(data_dir: Path | None = None) -> Path:
    """Where a local fleet records its Redis address (in `data_dir`, default `data_home()`)."""
    return (data_home() if data_dir is None else data_dir) / "fleet.json"


@dataclass(frozen=True, slots=True)
class LocalFleet:
    """What a local fleet recorded about its Redis: where it is and whether it keeps data."""

    url: str
    port: int
    keeps_data: bool
    path: Path


def read_local_fleet(data_dir: Path | None = None) -> LocalFleet | None:
    """The fleet recorded in `data_dir` (default `data_home()`), or None if there is none."""
    path = fleet_record(data_dir)
    try:
        document = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    url = document.get("url") if isinstance(document, dict) else None
    if not isinstance(url, str) or not url:
        return None
    try:
        port = urlsplit(url).port or 0
    except ValueError:
        return None
    return LocalFleet(url, port, document.get("keeps_data") is True, path)
