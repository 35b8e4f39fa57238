"""The library's subcommands: `open`, `show`, `answer`, `cancel` and `tail`, each its arguments and
its async handler.

Each handler connects with `_connect` (a Broker on its own pool, with a connect timeout), does
its one job and prints through `broker.cli_render`. The table of commands, the parser and the
entry point that run these are in `broker.cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from typing import Any, cast

import orjson
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from broker import (
    BadItem,
    Broker,
    BrokerUnavailable,
    PromptNotFound,
    Settings,
    ThreadNotFound,
)
from broker._cluster import cluster_client
from broker.cli_render import (
    _age,
    _columns,
    _first_question,
    _note,
    _one_line,
    _print,
    _print_json,
    _routed_lines,
    _safe_url,
    _when,
    render_item,
)
from broker.keys import check_prompt_id, check_thread_id

__all__ = ["CliError", "cmd_answer", "cmd_cancel", "cmd_open", "cmd_show", "cmd_tail"]

#: How long one XREAD of `tail` blocks before it asks again (a dead connection shows up then).
TAIL_BLOCK_MS = 5_000
#: Seconds to connect; blocking reads (`tail`) must not have a read timeout, so only this one.
CONNECT_TIMEOUT = 5.0
DEFAULT_CANCEL_REASON = "cancelled from the command line"
#: Seconds `tail` waits between tries while Redis is unreachable (doubling up to the last).
TAIL_RETRY = (0.2, 0.5, 1.0, 2.0)


class CliError(Exception):
    """A mistake in the command line itself: bad `--answers` JSON, an unusable Redis URL."""


# -- connecting ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _connect(settings: Settings) -> AsyncIterator[Broker]:
    """A Broker on its own pool, closed on the way out.

    Not `Broker.from_url`: it takes no client options, and a CLI must not hang for minutes on a
    host that drops packets, so the connection gets a connect timeout (and no read timeout:
    `tail` blocks on XREAD).
    """
    try:
        if settings.redis_cluster:  # one node of a Redis Cluster: its cluster client
            nodes = cluster_client(
                settings.redis_url, decode_responses=True, socket_connect_timeout=CONNECT_TIMEOUT
            )
            client = cast(Redis, nodes)  # as in Broker.from_url: it answers every command
        else:
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
        running = [] if args.json else await _running_turns(broker)
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
    if not args.json and running:
        shown = ", ".join(f"{t} ({owner or 'no replica'})" for t, owner in running[:_RUNNING_SHOWN])
        more = len(running) - _RUNNING_SHOWN
        _print(
            f"turns running (no prompt yet): {shown}" + (f", and {more} more" if more > 0 else "")
        )
    return 0


#: Running turns `open` names; past that it counts them.
_RUNNING_SHOWN = 10


async def _running_turns(broker: Broker) -> list[tuple[str, str]]:
    """(thread, holder) of every thread whose agent's turn runs now and waits on no prompt:
    work in progress, not yet waiting on a person. Read from the lease indexes' threads."""
    threads = sorted(await broker.sessions.holders())
    found: list[tuple[str, str]] = []
    for start in range(0, len(threads), 1000):
        page = threads[start : start + 1000]
        pipe = broker.redis.pipeline(transaction=False)
        for t in page:
            pipe.hmget(broker.thread(t).session, ["status", "wait", "owner"])
        for t, (status, wait, owner) in zip(page, await pipe.execute(), strict=True):
            if _text(status) == "running" and not wait:
                found.append((t, _text(owner)))
    return found


def _text(value: str | bytes | None) -> str:
    return value.decode() if isinstance(value, bytes) else value or ""


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
        try:
            session = await broker.sessions.get(thread_id)
        except (KeyError, ValueError):  # a damaged record: `thread status` says so; show the rest
            session = None
        # LLEN, never take_inbox: looking must not drain the next turn's input.
        # (redis-py types its sync and asyncio commands as one: the cast picks the async side.)
        inbox = await cast("Awaitable[int]", broker.redis.llen(broker.thread(thread_id).inbox))
    if args.json:
        _print_json(
            {
                "thread_id": thread_id,
                "items": [item.model_dump(mode="json") for item in items],
                "active_prompt": active.model_dump(mode="json") if active else None,
                "session": None
                if session is None
                else {"status": session.status, "owner": session.owner or None},
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
    if active is not None and active.escalated_to:
        active_line += f", escalated to {active.escalated_to}"
    _print("", f"active prompt: {active_line}")
    if session is not None:
        _print(f"agent: {_session_line(session)}")
    _print(f"inbox: {inbox} item{'' if inbox == 1 else 's'} waiting for the next turn")
    return 0


def _session_line(session: Any) -> str:
    """What the thread's agent is doing, in a line: a running turn shows as running."""
    holder = f" on {session.owner}" if session.owner else ""
    if session.status == "running" and session.waiting is not None:
        return f"{session.harness}, its turn{holder} waits on {session.waiting.prompt_id}"
    if session.status == "running":
        return f"{session.harness}, a turn is running{holder}"
    if session.status == "parked":
        waiting = session.waiting.prompt_id if session.waiting else "a prompt"
        return f"{session.harness}, parked: resumes when {waiting} is answered"
    return f"{session.harness}, {session.status}"


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


async def _last_entry_id(broker: Broker, thread_id: str) -> str:
    """Where "from now" starts, as a concrete id.

    `entries(after="$")` in a loop would drop what arrives between one XREAD timing out and the
    next being sent; reading from the last id that exists now has no such gap.
    """
    last = await broker.redis.xrevrange(broker.thread(thread_id).items, count=1)
    return str(last[0][0]) if last else "0-0"
