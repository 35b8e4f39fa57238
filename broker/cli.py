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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import orjson
from pydantic import ValidationError
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from broker import (
    BadItem,
    Broker,
    BrokerError,
    BrokerUnavailable,
    Item,
    Prompt,
    PromptNotFound,
    Question,
    Routed,
    Settings,
    StaleAnswer,
    ThreadClosed,
    ThreadNotFound,
    __version__,
    render_content,
)
from broker.keys import check_prompt_id, check_thread_id

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

PROG = "prompt-broker"
#: How long one XREAD of `tail` blocks before it asks again (a dead connection shows up then).
TAIL_BLOCK_MS = 5_000
#: Seconds to connect; blocking reads (`tail`) must not have a read timeout, so only this one.
CONNECT_TIMEOUT = 5.0
QUESTION_CHARS = 60
DEFAULT_CANCEL_REASON = "cancelled from the command line"
DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV = "PROMPT_BROKER_REDIS_URL"
#: Seconds `tail` waits between tries while Redis is unreachable (doubling up to the last).
TAIL_RETRY = (0.2, 0.5, 1.0, 2.0)


class CliError(Exception):
    """A mistake in the command line itself: bad `--answers` JSON, an unusable Redis URL."""


Handler = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]


# -- the local fleet -----------------------------------------------------------------------------


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


# -- output --------------------------------------------------------------------------------------


def _print(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _print_json(document: Any) -> None:
    sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    sys.stdout.flush()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(moment: datetime) -> str:
    """A time as people read it: UTC, to the second."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _safe_url(url: str | None) -> str:
    """The URL with any password masked: it goes into error messages."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url or "?")


def render_item(item: Item) -> str:
    """An item as `show` and `tail` print it: a header line, then its text indented."""
    head = [_when(item.created_at), item.author, item.type or "message", *_item_refs(item)]
    return "\n".join(["  ".join(head), *("    " + line for line in _item_body(item))])


def _item_refs(item: Item) -> list[str]:
    """The prompt an item is about: its own (a prompt or resolution) or the one it names."""
    meta = item.metadata
    prompt = meta.get("prompt")
    refs: list[str] = []
    if isinstance(prompt, dict):
        detail = prompt.get("prompt_state" if item.type == "pending_prompt_resolved" else "kind")
        refs.append(f"{prompt.get('prompt_id', '?')} ({detail})")
    if isinstance(meta.get("prompt_id"), str):
        refs.append(f"for {meta['prompt_id']}")
    if meta.get("answers"):
        refs.append("with metadata.answers")
    return refs


def _item_body(item: Item) -> list[str]:
    lines: list[str] = []
    for block in item.content:
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            lines.extend(block["text"].splitlines())
        elif block.get("type") == "file" and isinstance(block.get("file"), dict):
            lines.append(f"[file: {block['file'].get('alias', '?')}]")
        else:
            lines.append(f"[{block.get('type', '?')} block]")
    if not item.text and item.type == "pending_prompt":
        lines.extend(_questions_text(item.metadata.get("prompt")).splitlines())
    return lines


def _questions_text(prompt: object) -> str:
    """A prompt item without text (not ours, but possible on the wire): render its questions."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("questions"), list):
        return ""
    try:
        return render_content([Question.model_validate(q) for q in prompt["questions"]])
    except ValidationError:
        return ""


def _first_question(prompt: Prompt) -> str:
    text = _truncate(_one_line(prompt.questions[0].question), QUESTION_CHARS)
    more = len(prompt.questions) - 1
    return text + (f" (+{more} more)" if more else "")


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows as aligned lines; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    ]


def _routed_lines(thread_id: str, routed: Routed) -> list[str]:
    if routed.outcome == "queued":
        return [
            f"queued {routed.item_id} on thread {thread_id}: no prompt is active, "
            "so it waits in the inbox for the next turn"
        ]
    if routed.outcome == "posted":
        return [
            f"posted {routed.item_id} on thread {thread_id}: its author is the broker's "
            "own identity, so it is never an answer"
        ]
    lines = [f"answered {routed.prompt_id} on thread {thread_id} (source: {routed.source})"]
    if routed.refused_answers:
        lines.append(f"  --answers refused, the text was mapped instead: {routed.refused_answers}")
    lines.extend(
        f"  {_one_line(a.question)} → {', '.join(a.answer) if a.answer else '(nothing)'}"
        for a in routed.answers or []
    )
    return lines


# -- connecting ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _connect(settings: Settings) -> AsyncIterator[Broker]:
    """A Broker on its own pool, closed on the way out.

    Not `Broker.from_url`: it takes no client options, and a CLI must not hang for minutes on a
    host that drops packets, so the connection gets a connect timeout (and no read timeout:
    `tail` blocks on XREAD).
    """
    try:
        client = Redis.from_url(
            settings.redis_url, decode_responses=True, socket_connect_timeout=CONNECT_TIMEOUT
        )
    except ValueError as e:
        raise CliError(
            f"--redis-url / PROMPT_BROKER_REDIS_URL {_safe_url(settings.redis_url)}: {e}"
        ) from None
    async with Broker(client, settings, owns_client=True) as broker:
        yield broker


async def _server_now(broker: Broker) -> datetime:
    """The Redis server's clock, which stamped every prompt: ages are measured against it."""
    seconds, micros = await broker.redis.time()
    return datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, tz=UTC)


async def _state_of(broker: Broker, thread_id: str, prompt_id: str) -> str:
    try:
        return (await broker.get_prompt(thread_id, prompt_id)).state
    except PromptNotFound:
        return "unknown"


async def _require_thread(broker: Broker, thread_id: str) -> None:
    """A typo must not look like an empty thread: an unknown one is an error."""
    if not await broker.thread_exists(thread_id):
        raise ThreadNotFound(thread_id)


# -- subcommands ---------------------------------------------------------------------------------


def _thread_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("thread", metavar="THREAD", help="the thread id")


def _json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")


def _open_args(parser: argparse.ArgumentParser) -> None:
    _json_arg(parser)


async def cmd_open(args: argparse.Namespace, settings: Settings) -> int:
    """One line per pending prompt, oldest first: age, thread, prompt id, kind, question."""
    async with _connect(settings) as broker:
        prompts = await broker.open_prompts()
        now = await _server_now(broker)
    ages = [(now - p.created_at).total_seconds() for p in prompts]
    if args.json:
        _print_json(
            [
                {"age_seconds": round(max(0.0, age), 3), **p.model_dump(mode="json")}
                for p, age in zip(prompts, ages, strict=True)
            ]
        )
    elif prompts:
        rows = [
            [_age(age), p.thread_id, p.prompt_id, p.kind, _first_question(p)]
            for p, age in zip(prompts, ages, strict=True)
        ]
        _print(*_columns(rows))
    else:
        _print("nothing is waiting on a person")
    return 0


def _show_args(parser: argparse.ArgumentParser) -> None:
    _thread_arg(parser)
    _json_arg(parser)


async def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    """The thread's items, then its active prompt and how many items wait in its inbox."""
    thread_id = check_thread_id(args.thread, "THREAD")
    async with _connect(settings) as broker:
        await _require_thread(broker, thread_id)
        items = await broker.items(thread_id)
        active = await broker.active_prompt(thread_id)
        # LLEN, never take_inbox: looking must not drain the next turn's input.
        # (redis-py types its sync and asyncio commands as one: the cast picks the async side.)
        inbox = await cast("Awaitable[int]", broker.redis.llen(broker.thread(thread_id).inbox))
    if args.json:
        _print_json(
            {
                "thread_id": thread_id,
                "items": [item.model_dump(mode="json") for item in items],
                "active_prompt": active.model_dump(mode="json") if active else None,
                "inbox": inbox,
            }
        )
        return 0
    _print(*(render_item(item) for item in items))
    if not items:
        _print(f"thread {thread_id} has no items")
    active_line = (
        f"{active.prompt_id} ({active.kind}, asked {_when(active.created_at)})"
        if active
        else "none"
    )
    _print(
        "",
        f"active prompt: {active_line}",
        f"inbox: {inbox} item{'' if inbox == 1 else 's'} waiting for the next turn",
    )
    return 0


def _answer_args(parser: argparse.ArgumentParser) -> None:
    _thread_arg(parser)
    parser.add_argument(
        "text",
        metavar="TEXT",
        help="the answer as a person types it ('2', 'yes', 'staging', free text); with "
        "--answers, a summary for people reading the thread",
    )
    parser.add_argument(
        "--answers",
        metavar="JSON",
        help="structured answers, one per question, sent as metadata.answers: "
        '\'[{"question": "...", "answer": ["label"]}]\'',
    )
    parser.add_argument(
        "--prompt",
        metavar="PROMPT_ID",
        help="answer this prompt only: refused if it is no longer the thread's active one",
    )
    parser.add_argument("--author", metavar="NAME", help="the item's author (default: user)")
    parser.add_argument(
        "--create",
        action="store_true",
        help="start the thread if it does not exist yet (default: an unknown thread is refused, "
        "so a typo cannot start one)",
    )
    _json_arg(parser)


#: Where the Broker names an item's field, the CLI names the flag that filled it.
_FLAGS = (
    ("metadata.answers", "--answers"),
    ("metadata.prompt_id", "--prompt"),
    ("author", "--author"),
    ("content", "TEXT"),
    ("thread_id", "THREAD"),
)


def _flag_name(field: str) -> str:
    for api, flag in _FLAGS:
        if field == api or field.startswith((api + ".", api + "[")):
            return flag + field[len(api) :]
    return field


def _answer_item(args: argparse.Namespace) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    if args.answers is not None:
        try:
            answers = orjson.loads(args.answers)
        except orjson.JSONDecodeError as e:
            raise CliError(f"--answers: not valid JSON ({e})") from None
        # Checked here whether or not a prompt is active: queued, it would be stored unchecked.
        if not isinstance(answers, list):
            raise CliError(
                "--answers: expected a JSON list with one "
                '{"question": ..., "answer": [...]} object per question, '
                f"got {_json_kind(answers)}"
            )
        _check_answers_shape(answers)
        metadata["answers"] = answers
    if args.prompt is not None:
        metadata["prompt_id"] = check_prompt_id(args.prompt, "--prompt")
    item: dict[str, Any] = {"content": [{"type": "text", "text": args.text}], "metadata": metadata}
    if args.author is not None:
        item["author"] = args.author
    return item


def _check_answers_shape(answers: list[Any]) -> None:
    """Each entry an object whose `answer` is a list of strings (`question`, if given, a string).

    Whether the set fits the prompt (count, questions) is the broker's to judge when it routes
    the item: it refuses a set that does not and maps the text. A set of the wrong shape is a
    mistake in the command line, refused whether or not a prompt is active.
    """
    for i, entry in enumerate(answers):
        where = f"--answers[{i}]"
        if not isinstance(entry, dict):
            raise CliError(
                f'{where}: expected a {{"question", "answer"}} object, got {_json_kind(entry)}'
            )
        chosen = entry.get("answer")
        if not isinstance(chosen, list) or not all(isinstance(a, str) for a in chosen):
            raise CliError(f'{where}.answer: expected a list of strings, e.g. ["staging"]')
        if "question" in entry and not isinstance(entry["question"], str):
            raise CliError(f"{where}.question: expected a string")


def _json_kind(value: object) -> str:
    kinds = {dict: "an object", str: "a string", bool: "a boolean", int: "a number"}
    kinds[float] = "a number"
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


async def cmd_answer(args: argparse.Namespace, settings: Settings) -> int:
    """Post TEXT to the thread: it answers the active prompt, or waits in the inbox."""
    thread_id = check_thread_id(args.thread, "THREAD")
    item = _answer_item(args)
    async with _connect(settings) as broker:
        try:
            routed = await broker.post_item(thread_id, item, create=args.create)
        except BadItem as e:
            raise BadItem(_flag_name(e.field), e.problem) from None
        except ThreadNotFound:
            raise CliError(
                f"THREAD: no thread {thread_id}: nothing was ever posted to it and it has no "
                "session (a typo? --create starts it); nothing was written"
            ) from None
    if args.json:
        _print_json({"thread_id": thread_id, **routed.model_dump(mode="json")})
    else:
        _print(*_routed_lines(thread_id, routed))
    return 0


def _cancel_args(parser: argparse.ArgumentParser) -> None:
    _thread_arg(parser)
    parser.add_argument(
        "--reason",
        metavar="TEXT",
        default=DEFAULT_CANCEL_REASON,
        help="why, for the agent and the audit item (default: %(default)r)",
    )
    parser.add_argument(
        "--prompt",
        metavar="PROMPT_ID",
        help="cancel this prompt only, and only while it is pending (default: the active one)",
    )
    _json_arg(parser)


async def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    """Cancel the active prompt (or --prompt); nothing to cancel is not an error."""
    thread_id = check_thread_id(args.thread, "THREAD")
    prompt_id = None if args.prompt is None else check_prompt_id(args.prompt, "--prompt")
    async with _connect(settings) as broker:
        await _require_thread(broker, thread_id)
        cancelled = await broker.cancel(thread_id, args.reason, prompt_id=prompt_id)
        state = None
        if cancelled is None and prompt_id is not None:
            state = await _state_of(broker, thread_id, prompt_id)
    if args.json:
        _print_json(
            {
                "thread_id": thread_id,
                "cancelled": cancelled.model_dump(mode="json") if cancelled else None,
                **({"prompt_id": prompt_id, "state": state} if state else {}),
            }
        )
    elif cancelled is not None:
        reason = f": {cancelled.reason}" if cancelled.reason else ""
        _print(f"cancelled {cancelled.prompt_id} on thread {thread_id}{reason}")
    elif prompt_id is not None:
        _print(f"nothing to cancel: prompt {prompt_id} on thread {thread_id} is {state}")
    else:
        _print(f"nothing to cancel: no prompt is active on thread {thread_id}")
    return 0


def _tail_args(parser: argparse.ArgumentParser) -> None:
    _thread_arg(parser)
    parser.add_argument(
        "--from-start", action="store_true", help="print the items already on the thread first"
    )


async def cmd_tail(args: argparse.Namespace, settings: Settings) -> int:
    """Print the thread's new items as they arrive, until Ctrl-C; ride out Redis outages."""
    thread_id = check_thread_id(args.thread, "THREAD")
    async with _connect(settings) as broker:
        await _require_thread(broker, thread_id)
        after = "0-0" if args.from_start else await _last_entry_id(broker, thread_id)
        lost_at: float | None = None
        tries = 0
        while True:
            try:
                entries = await broker.entries(thread_id, after=after, block_ms=TAIL_BLOCK_MS)
            except _UNREACHABLE as e:
                # A blip (a restart, a failover, a dropped connection): the next command
                # reconnects, and reading after the last id printed loses and repeats nothing.
                if lost_at is None:
                    lost_at = time.monotonic()
                    _note(f"lost Redis ({_one_line(str(e))}); reconnecting, then going on")
                await asyncio.sleep(TAIL_RETRY[min(tries, len(TAIL_RETRY) - 1)])
                tries += 1
                continue
            if lost_at is not None:
                _note(f"reconnected after {time.monotonic() - lost_at:.1f} s")
                lost_at, tries = None, 0
            for sid, item in entries:
                _print(render_item(item))
                after = sid


#: What an unreachable Redis raises: ours where the library wraps it, redis-py's where not.
_UNREACHABLE = (
    BrokerUnavailable,
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    OSError,
)


def _note(message: str) -> None:
    """A line about what the command is doing (not its output): stderr."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


async def _last_entry_id(broker: Broker, thread_id: str) -> str:
    """Where "from now" starts, as a concrete id.

    `entries(after="$")` in a loop would drop what arrives between one XREAD timing out and the
    next being sent; reading from the last id that exists now has no such gap.
    """
    last = await broker.redis.xrevrange(broker.thread(thread_id).items, count=1)
    return str(last[0][0]) if last else "0-0"


# -- the parser and dispatch ---------------------------------------------------------------------


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
