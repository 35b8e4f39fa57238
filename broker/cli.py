"""The command line: what waits on a person, a thread read aloud, answering, cancelling, following.

    prompt-broker open [--json]
    prompt-broker show THREAD [--json]
    prompt-broker answer THREAD TEXT [--answers JSON] [--prompt PROMPT_ID] [--author NAME] [--json]
    prompt-broker cancel THREAD [--reason TEXT] [--prompt PROMPT_ID] [--json]
    prompt-broker tail THREAD [--from-start]

Redis is `--redis-url`, else `PROMPT_BROKER_REDIS_URL`, else the default; the key prefix comes from
`PROMPT_BROKER_KEY_PREFIX` only. A mistake prints one `prompt-broker: error: ...` line on stderr
and exits 2 (1 for an answer to a prompt that is no longer active). A subcommand is one entry in
`COMMANDS`: its help line, a function adding its arguments, and an async handler.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import orjson
from pydantic import ValidationError
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from broker import (
    BadItem,
    Broker,
    BrokerError,
    Item,
    Prompt,
    PromptNotFound,
    Question,
    Routed,
    Settings,
    StaleAnswer,
    __version__,
    render_content,
)
from broker.keys import check_prompt_id, check_thread_id

__all__ = ["COMMANDS", "CliError", "Command", "Handler", "Parser", "build_parser", "main"]

logger = logging.getLogger("broker.cli")

PROG = "prompt-broker"
#: How long one XREAD of `tail` blocks before it asks again (a dead connection shows up then).
TAIL_BLOCK_MS = 5_000
#: Seconds to connect; blocking reads (`tail`) must not have a read timeout, so only this one.
CONNECT_TIMEOUT = 5.0
QUESTION_CHARS = 60
DEFAULT_CANCEL_REASON = "cancelled from the command line"


class CliError(Exception):
    """A mistake in the command line itself: bad `--answers` JSON, an unusable Redis URL."""


Handler = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]


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
    _json_arg(parser)


#: Where the Broker names an item's field, the CLI names the flag that filled it.
_FLAGS = (
    ("metadata.answers", "--answers"),
    ("metadata.prompt_id", "--prompt"),
    ("author", "--author"),
    ("content", "TEXT"),
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
            metadata["answers"] = orjson.loads(args.answers)
        except orjson.JSONDecodeError as e:
            raise CliError(f"--answers: not valid JSON ({e})") from None
    if args.prompt is not None:
        metadata["prompt_id"] = check_prompt_id(args.prompt, "--prompt")
    item: dict[str, Any] = {"content": [{"type": "text", "text": args.text}], "metadata": metadata}
    if args.author is not None:
        item["author"] = args.author
    return item


async def cmd_answer(args: argparse.Namespace, settings: Settings) -> int:
    """Post TEXT to the thread: it answers the active prompt, or waits in the inbox."""
    thread_id = check_thread_id(args.thread, "THREAD")
    item = _answer_item(args)
    async with _connect(settings) as broker:
        try:
            routed = await broker.post_item(thread_id, item)
        except BadItem as e:
            raise BadItem(_flag_name(e.field), e.problem) from None
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
    """Print the thread's new items as they arrive, until Ctrl-C."""
    thread_id = check_thread_id(args.thread, "THREAD")
    async with _connect(settings) as broker:
        after = "0-0" if args.from_start else await _last_entry_id(broker, thread_id)
        while True:
            for sid, item in await broker.entries(thread_id, after=after, block_ms=TAIL_BLOCK_MS):
                _print(render_item(item))
                after = sid


async def _last_entry_id(broker: Broker, thread_id: str) -> str:
    """Where "from now" starts, as a concrete id.

    `entries(after="$")` in a loop would drop what arrives between one XREAD timing out and the
    next being sent; reading from the last id that exists now has no such gap.
    """
    last = await broker.redis.xrevrange(broker.thread(thread_id).items, count=1)
    return str(last[0][0]) if last else "0-0"


# -- the parser and dispatch ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its help line, what adds its arguments, its handler, its Ctrl-C exit status."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Handler
    interrupted: int = 130  # 0 for a command that runs until Ctrl-C, like `tail`


COMMANDS: dict[str, Command] = {
    "open": Command("list the prompts waiting on a person", _open_args, cmd_open),
    "show": Command("print a thread, its active prompt and its inbox", _show_args, cmd_show),
    "answer": Command("post an answer (or a message) to a thread", _answer_args, cmd_answer),
    "cancel": Command("cancel a thread's active prompt", _cancel_args, cmd_cancel),
    "tail": Command(
        "follow a thread's new items until Ctrl-C", _tail_args, cmd_tail, interrupted=0
    ),
}

_EPILOG = """\
environment:
  PROMPT_BROKER_REDIS_URL    the Redis server (--redis-url wins over it)
  PROMPT_BROKER_KEY_PREFIX   the key prefix (default pp); there is no flag for it
  any other PROMPT_BROKER_* must name a setting: a misspelt one is an error

exit status: 0 done, 1 an answer named a prompt that is no longer active, 2 a mistake
"""


class Parser(argparse.ArgumentParser):
    """The root parser. `subparsers` is where a subcommand's parser is added."""

    subparsers: argparse._SubParsersAction[argparse.ArgumentParser]


def _global_args(parser: argparse.ArgumentParser, *, root: bool) -> None:
    """Options accepted before or after the subcommand; the subcommand's copy never resets them."""
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        default=None if root else argparse.SUPPRESS,
        help="the Redis server (default: PROMPT_BROKER_REDIS_URL, else redis://127.0.0.1:6379/0)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0 if root else argparse.SUPPRESS,
        help="log more: -v info, -vv debug (logs go to stderr)",
    )


def build_parser(commands: dict[str, Command] | None = None) -> Parser:
    """The whole command line, built from `commands` (default `COMMANDS`)."""
    common = argparse.ArgumentParser(add_help=False)
    _global_args(common, root=False)
    parser = Parser(
        prog=PROG,
        description="Carry coding agents' questions to a person and the answers back, on Redis.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _global_args(parser, root=True)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.subparsers = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        title="commands",
        parser_class=argparse.ArgumentParser,
    )
    for name, command in (COMMANDS if commands is None else commands).items():
        sub = parser.subparsers.add_parser(
            name, help=command.help, description=command.help, parents=[common]
        )
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


def _report(error: Exception, url: str | None) -> int:
    """Print one line for an expected failure; return the exit status."""
    if isinstance(error, redis_errors.ConnectionError | redis_errors.TimeoutError):
        message = f"cannot reach Redis at {_safe_url(url)}: {error}"
    elif isinstance(error, redis_errors.RedisError):
        message = f"Redis at {_safe_url(url)} said: {error}"
    else:
        message = str(error)
    logger.info("cli.failed", exc_info=error)  # the traceback, for -v only
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr, flush=True)
    return 1 if isinstance(error, StaleAnswer) else 2


def _run(command: Command, args: argparse.Namespace) -> int:
    url: str | None = args.redis_url
    try:
        settings = Settings.from_env(redis_url=args.redis_url)
        url = settings.redis_url
        return asyncio.run(command.run(args, settings))
    except KeyboardInterrupt:
        return command.interrupted
    except (BrokerError, CliError, redis_errors.RedisError) as e:
        return _report(e, url)


def main(argv: Sequence[str] | None = None, commands: dict[str, Command] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 on a usage error).

    `commands` replaces `COMMANDS`: the runtime (`workers.cli`) adds its own to the library's.
    """
    commands = COMMANDS if commands is None else commands
    args = build_parser(commands).parse_args(argv)
    with _logging(args.verbose):
        return _run(commands[args.command], args)


if __name__ == "__main__":
    raise SystemExit(main())
