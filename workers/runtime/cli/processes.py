"""`worker` and `audit`: the long-running processes a fleet starts (one replica, the audit worker).

Both follow their fleet (`--parent`, not in `--help`): a fleet's process gets SIGTERM when the
fleet dies, even by kill -9.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from broker import Settings
from broker.cli import CliError, Command
from workers.runtime import audit
from workers.runtime.cli.common import _HANDED, _level
from workers.runtime.logs import configure
from workers.runtime.run import run_replica


def _parent_arg(parser: argparse.ArgumentParser) -> None:
    # How a fleet starts its processes: not for people, so not in --help.
    parser.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)


def _worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id", default=None, help="this replica's name (default: host-pid-random)")
    _parent_arg(parser)


def _stop_with_parent(parent: int | None) -> None:
    """A fleet's process gets SIGTERM when the fleet dies, even by kill -9: none outlives it.

    Linux only (prctl PR_SET_PDEATHSIG); elsewhere the fleet's own stop is all there is.
    """
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the fleet died before we asked to follow it
        raise CliError(f"the fleet (pid {parent}) that started this process is gone")


async def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    _stop_with_parent(args.parent)
    await run_replica(settings, replica_id=args.id)
    return 0


async def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    configure(_level(args))
    _stop_with_parent(args.parent)
    await audit.serve(settings)
    return 0


#: The process commands.
COMMANDS: dict[str, Command] = {
    "worker": Command(
        "run one replica until SIGTERM/SIGINT",
        _worker_args,
        cmd_worker,
        0,
        finds_fleet=False,
        redis_help=_HANDED,
    ),
    "audit": Command(
        "run the audit worker (arq)",
        _parent_arg,
        cmd_audit,
        0,
        finds_fleet=False,
        redis_help=_HANDED,
    ),
}
