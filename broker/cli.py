"""The command line: what waits on a person, a thread read aloud, answering, cancelling, following.

    prompt-broker open [--json]
    prompt-broker show THREAD [--json]
    prompt-broker answer THREAD TEXT [--answers JSON] [--prompt PROMPT_ID] [--author NAME]
                         [--create] [--json]
    prompt-broker cancel THREAD [--reason TEXT] [--prompt PROMPT_ID] [--json]
    prompt-broker tail THREAD [--from-start]

Redis is `--redis-url`, else `PROMPT_BROKER_REDIS_URL`, else the local fleet's (the address
`prompt-broker up` records in `fleet.json` in its data folder; the command says so on stderr),
else redis://127.0.0.1:6379/0. The key prefix comes from `PROMPT_BROKER_KEY_PREFIX` only. A
mistake prints one `prompt-broker: error: ...` line on stderr and exits 2 (1 for an answer to a
prompt that is no longer active, or to a closed thread). A subcommand is one entry in `COMMANDS`:
its help line, a function adding its arguments, and an async handler.

This module is the table of commands, the parser, logging and the entry point; the commands
themselves are in `broker.cli_commands`, what they print in `broker.cli_render`, and the local
fleet's record in `broker.cli_fleet`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors

from broker import (
    BadItem,
    BrokerError,
    BrokerUnavailable,
    Settings,
    StaleAnswer,
    ThreadClosed,
    ThreadNotFound,
    __version__,
)
from broker.cli_commands import (
    CliError,
    _answer_args,
    _cancel_args,
    _flag_name,
    _open_args,
    _show_args,
    _tail_args,
    cmd_answer,
    cmd_cancel,
    cmd_open,
    cmd_show,
    cmd_tail,
)
from broker.cli_fleet import LocalFleet, data_home, fleet_record, read_local_fleet
from broker.cli_render import PROG, _note, _one_line, _safe_url

__all__ = [
    "COMMANDS",
    "CliError",
    "Command",
    "Handler",
    "LocalFleet",
    "Parser",
    "build_parser",
    "data_home",
    "fleet_record",
    "global_args",
    "main",
    "read_local_fleet",
]

logger = logging.getLogger("broker.cli")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV = "PROMPT_BROKER_REDIS_URL"


Handler = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]


#: Where a command that talks to an existing Redis finds it when none is given.
FIND_REDIS = (
    "the Redis server (default: PROMPT_BROKER_REDIS_URL, else the local fleet's, recorded by "
    f"`prompt-broker up` in {fleet_record()}, else {DEFAULT_URL})"
)


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its help line, what adds its arguments, its handler, its Ctrl-C exit status.

    `finds_fleet`: with no Redis given, look for the local fleet's (False for the commands that
    bring their own or are handed one: `up`, `demo`, a fleet's processes). `redis_help` is its
    `--redis-url` help, saying what the default really is.
    """

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Handler
    interrupted: int = 130  # 0 for a command that runs until Ctrl-C, like `tail`
    finds_fleet: bool = True
    redis_help: str = FIND_REDIS


COMMANDS: dict[str, Command] = {
    "open": Command("list the prompts waiting on a person", _open_args, cmd_open),
    "show": Command("print a thread, its active prompt and its inbox", _show_args, cmd_show),
    "answer": Command(
        "post an answer (or a message) to an existing thread", _answer_args, cmd_answer
    ),
    "cancel": Command("cancel a thread's active prompt", _cancel_args, cmd_cancel),
    "tail": Command(
        "follow a thread's new items until Ctrl-C", _tail_args, cmd_tail, interrupted=0
    ),
}

_EPILOG = f"""\
environment:
  PROMPT_BROKER_REDIS_URL    the Redis server (--redis-url wins over it)
  PROMPT_BROKER_KEY_PREFIX   the key prefix (default pp); there is no flag for it
  any other PROMPT_BROKER_* must name a setting: a misspelt one is an error
  XDG_DATA_HOME              the local fleet's data folder is $XDG_DATA_HOME/prompt-broker

With neither --redis-url nor PROMPT_BROKER_REDIS_URL, the commands use the local fleet that
`prompt-broker up` (scripts/run) started, from the address it records in
{fleet_record()}, and say so on stderr; with no fleet recorded, {DEFAULT_URL}.

exit status: 0 done, 1 an answer named a prompt that is no longer active or a closed thread,
2 a mistake (an unknown thread included)
"""


class Parser(argparse.ArgumentParser):
    """The root parser. `subparsers` is where a subcommand's parser is added."""

    subparsers: argparse._SubParsersAction[argparse.ArgumentParser]


def global_args(
    parser: argparse.ArgumentParser, *, root: bool = False, redis_help: str = FIND_REDIS
) -> None:
    """Options accepted before or after the subcommand; the subcommand's copy never resets them.

    A command with subcommands of its own (`thread new`) adds them to each of those too.
    """
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        default=None if root else argparse.SUPPRESS,
        help=redis_help,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0 if root else argparse.SUPPRESS,
        help="log more: -v info, -vv debug and a failure's traceback (logs go to stderr)",
    )


def build_parser(commands: dict[str, Command] | None = None) -> Parser:
    """The whole command line, built from `commands` (default `COMMANDS`)."""
    parser = Parser(
        prog=PROG,
        description="Carry coding agents' questions to a person and the answers back, on Redis.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    global_args(parser, root=True)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.subparsers = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        title="commands",
        parser_class=argparse.ArgumentParser,
    )
    for name, command in (COMMANDS if commands is None else commands).items():
        sub = parser.subparsers.add_parser(name, help=command.help, description=command.help)
        global_args(sub, redis_help=command.redis_help)
        command.arguments(sub)
    return parser


# -- logging -------------------------------------------------------------------------------------

_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _Formatter(logging.Formatter):
    """The library logs stable event names with `extra=`; show those fields after the name."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        fields = "".join(f" {k}={v}" for k, v in extra.items() if v is not None)
        return f"{head}{fields}{sep}{tail}"


@contextlib.contextmanager
def _logging(verbosity: int) -> Iterator[None]:
    """Configure logging for one run of `main`, and undo it after (tests call `main` in-process)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    old_level = root.level
    root.addHandler(handler)
    root.setLevel((logging.WARNING, logging.INFO)[verbosity] if verbosity < 2 else logging.DEBUG)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


# -- the entry point -----------------------------------------------------------------------------


def _report(error: Exception, url: str | None, fleet: LocalFleet | None = None) -> int:
    """Print one line for an expected failure; return the exit status."""
    unreachable = isinstance(error, redis_errors.ConnectionError | redis_errors.TimeoutError) or (
        isinstance(error, BrokerUnavailable) and not error.refused
    )
    if unreachable:
        message = f"cannot reach Redis at {_safe_url(url)}: {error}"
    elif isinstance(error, BrokerUnavailable):
        message = f"Redis at {_safe_url(url)}: {error}"
    elif isinstance(error, redis_errors.RedisError):
        message = f"Redis at {_safe_url(url)} said: {error}"
    elif isinstance(error, ThreadNotFound):
        message = (
            f"THREAD: no thread {error.thread_id}: nothing was ever posted to it and it has no "
            "session"
        )
    elif isinstance(error, ThreadClosed):
        message = f"THREAD: thread {error.thread_id} is closed: it takes no more items"
    elif isinstance(error, BadItem):  # the library's field names, said as the flags that set them
        message = str(BadItem(_flag_name(error.field), error.problem))
    else:
        message = str(error)
    if fleet is not None and unreachable:
        message += (
            f" (the local fleet recorded in {fleet.path} is not running: start it with "
            "`scripts/run` or `prompt-broker up`, or pass --redis-url)"
        )
    logger.debug("cli.failed", exc_info=error)  # the traceback, for -vv only
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr, flush=True)
    return 1 if isinstance(error, StaleAnswer | ThreadClosed) else 2


def _local_fleet(command: Command, args: argparse.Namespace) -> LocalFleet | None:
    """With no Redis given, the local fleet to use, said on stderr; else None."""
    if args.redis_url is not None or URL_ENV in os.environ or not command.finds_fleet:
        return None
    fleet = read_local_fleet()
    if fleet is not None:
        caveat = "" if fleet.keeps_data else ": an embedded fakeredis server that keeps nothing"
        _note(
            f"using the local fleet's Redis at {_safe_url(fleet.url)} (recorded in {fleet.path}"
            f"{caveat}); --redis-url or PROMPT_BROKER_REDIS_URL chooses another"
        )
    return fleet


def _run(command: Command, args: argparse.Namespace) -> int:
    url: str | None = args.redis_url
    fleet: LocalFleet | None = None
    try:
        fleet = _local_fleet(command, args)
        settings = Settings.from_env(redis_url=fleet.url if fleet else args.redis_url)
        url = settings.redis_url
        return asyncio.run(command.run(args, settings))
    except KeyboardInterrupt:
        return command.interrupted
    except (BrokerError, CliError, redis_errors.RedisError) as e:
        return _report(e, url, fleet)


def _not_text(argv: Sequence[str]) -> str | None:
    """The first argument that is not text (bytes that are not UTF-8), described; else None.

    Python hands such bytes over as lone surrogates, which nothing downstream can encode.
    """
    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")
            return f"argument {i} ('{shown}') is not UTF-8 text: every argument must be text"
    return None


def main(argv: Sequence[str] | None = None, commands: dict[str, Command] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 on a usage error).

    `commands` replaces `COMMANDS`: the runtime (`workers.runtime.cli`) adds its own to the
    library's.
    """
    commands = COMMANDS if commands is None else commands
    problem = _not_text(sys.argv[1:] if argv is None else argv)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
        return 2
    args = build_parser(commands).parse_args(argv)
    with _logging(args.verbose):
        return _run(commands[args.command], args)


if __name__ == "__main__":
    raise SystemExit(main())
