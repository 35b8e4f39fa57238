"""A CPU quota for processes of the benchmark's own: each one in a cgroup of its own, allowed
`percent` of one CPU (the kernel's CFS bandwidth control), so that a redis-server is the limit
of a run and not the machine's few cores shared by everything.

A Redis deployment that outgrows one primary does so because that primary's CPU is spent: this
makes each redis-server a smaller machine of its own, the same for every server of a run.
Needs a writable cgroup CPU controller (v2's `cpu.max`, or v1's `cpu.cfs_quota_us`): root in a
container that lets it, or a delegated cgroup. `CpuCapError` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["CpuCapError", "cpu_capped", "quota_percent"]

#: The quota's period: short, so a throttled server pauses for a few ms at a time (longer only
#: where the quota would fall under the kernel's least, 1 ms).
PERIOD_US = 10_000
_LEAST_QUOTA_US = 1_000
_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu")


class CpuCapError(RuntimeError):
    """The CPU quota cannot be set here."""


def _root() -> tuple[Path, bool]:
    """The cgroup directory to make ours under, and whether it is cgroup v2."""
    if (_V2 / "cgroup.controllers").is_file():
        if "cpu" not in (_V2 / "cgroup.subtree_control").read_text().split():
            raise CpuCapError(f"cgroup v2 without the cpu controller enabled in {_V2}")
        return _V2, True
    if (_V1 / "cpu.cfs_quota_us").is_file():
        return _V1, False
    raise CpuCapError(f"no cgroup CPU controller at {_V2} or {_V1}")


@contextlib.contextmanager
def cpu_capped(pids: Iterable[int], percent: float) -> Iterator[None]:
    """Each of `pids` (with all its threads) limited to `percent` of one CPU until the end of
    the block; then moved back and its cgroup removed."""
    if not 0 < percent <= 100:
        raise CpuCapError(f"a CPU cap is a percentage of one CPU in (0, 100], not {percent}")
    root, v2 = _root()
    quota, period = _quota(percent)
    made: list[tuple[Path, int]] = []
    try:
        for pid in pids:
            group = root / f"prompt-broker-bench-{uuid.uuid4().hex[:8]}"
            try:
                group.mkdir()
            except OSError as e:
                raise CpuCapError(f"cannot make a cgroup under {root}: {e}") from e
            made.append((group, pid))
            if v2:
                (group / "cpu.max").write_text(f"{quota} {period}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for group, pid in made:
            with contextlib.suppress(OSError):  # it may have exited: nothing to move
                (root / "cgroup.procs").write_text(str(pid))
            with contextlib.suppress(OSError):
                os.rmdir(group)


def _quota(percent: float) -> tuple[int, int]:
    """(quota, period) in microseconds for `percent` of one CPU."""
    period = max(PERIOD_US, round(_LEAST_QUOTA_US * 100 / percent))
    return round(period * percent / 100), period


def quota_percent(percent: float) -> float:
    """The share of one CPU the quota for `percent` gives, as the kernel is told it."""
    quota, period = _quota(percent)
    return quota * 100 / period
