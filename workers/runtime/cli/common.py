"""What every command group of the runtime's command line uses: log level, own name, Redis source.

`_level` (the log level `-v` asks for), `_me` (how to run this command again), `_explicit_redis`
(whether a Redis server was named, else a command finds or starts its own), and `_HANDED`, the
`--redis-url` help of the commands a fleet starts (and `token`, which needs none).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _level(args: argparse.Namespace) -> int:
    return logging.DEBUG if args.verbose >= 2 else logging.INFO


def _me() -> str:
    """How to run this command again: the console script's path, or `prompt-broker`."""
    argv0 = Path(sys.argv[0])
    return str(argv0) if argv0.name == "prompt-broker" else "prompt-broker"


def _explicit_redis(args: argparse.Namespace) -> bool:
    return args.redis_url is not None or "PROMPT_BROKER_REDIS_URL" in os.environ


#: What a fleet's own processes are handed (PROMPT_BROKER_REDIS_URL): they never look around.
_HANDED = "the Redis server (default: PROMPT_BROKER_REDIS_URL, else redis://127.0.0.1:6379/0)"
