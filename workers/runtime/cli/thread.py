"""`thread new|close|status|timing`: an agent session's thread, created, ended, inspected, or
given a timing (when its prompts are reminded, escalated and expire: broker/timing.py).

`new` checks the harness config (`--script`, `--config`), the guarded policy (`--policy`) and the
timing flags before anything is written; `close` and `status` refuse an unknown thread, or one
with no session.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from broker import BadItem, Broker, Settings, ThreadNotFound, Timing, parse_duration
from broker.cli import CliError, Command, global_args
from broker.sessions import Session
from workers.agents.policy import validate as validate_policy
from workers.runtime.replica import OnFirstUse, default_harnesses

#: The agent harnesses `thread new --harness` takes (claude_code needs the `claude` extra).
HARNESSES = ("scripted", "claude_code", "codex")


def _thread_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    new = sub.add_parser("new", help="create a thread and its agent session")
    new.add_argument("thread", metavar="THREAD")
    new.add_argument(
        "--harness",
        default="scripted",
        choices=HARNESSES,
        help="the agent harness (default scripted; claude_code needs pip install -e '.[claude]')",
    )
    new.add_argument(
        "--permissions",
        default="approval",
        choices=["approval", "autonomous", "guarded"],
        help="approval: every gated call asks a person (default); autonomous: none do; "
        "guarded: a policy decides each call (needs --policy)",
    )
    new.add_argument(
        "--policy",
        metavar="FILE|JSON",
        help=(
            "the guarded policy block: a JSON file, or the JSON itself"
            " (see workers/agents/policy.py)"
        ),
    )
    group = new.add_mutually_exclusive_group()
    group.add_argument("--script", type=Path, metavar="FILE", help="a scripted agent's JSON script")
    group.add_argument("--config", metavar="JSON", help="the harness config, as JSON")
    new.add_argument("--work-folder", default="", metavar="DIR", help="the agent's work folder")
    new.add_argument("--message", metavar="TEXT", help="post this first message at once")
    _timing_flags(new)
    close = sub.add_parser("close", help="end a thread: its open prompt is cancelled")
    close.add_argument("thread", metavar="THREAD")
    close.add_argument("--reason", default="thread_closed", help="default: %(default)s")
    status = sub.add_parser("status", help="who holds the thread and what it waits on")
    status.add_argument("thread", metavar="THREAD")
    status.add_argument("--json", action="store_true", help="print one JSON document instead")
    timing = sub.add_parser(
        "timing", help="show or set when the thread's prompts are reminded, escalated, expire"
    )
    timing.add_argument("thread", metavar="THREAD")
    timing.add_argument(
        "--prompt", metavar="PROMPT_ID", help="one open prompt's own timing, not the thread's"
    )
    _timing_flags(timing)
    timing.add_argument("--clear", action="store_true", help="remove the timing")
    timing.add_argument("--json", action="store_true", help="print one JSON document instead")
    for action in (new, close, status, timing):
        global_args(action)


def _timing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--remind", metavar="AGES", help="remind people at these ages, e.g. 15m,45m"
    )
    parser.add_argument(
        "--escalate", metavar="AGE:GROUP", help="let GROUP answer too from AGE, e.g. 30m:oncall"
    )
    parser.add_argument(
        "--deadline", metavar="AGE", help="cancel the prompt 'expired' at AGE, e.g. 1h"
    )


def _timing(args: argparse.Namespace) -> Timing | None:
    """The timing the flags give, checked; None when none was given."""
    if args.remind is None and args.escalate is None and args.deadline is None:
        return None
    fields: dict[str, Any] = {}
    if args.remind is not None:
        fields["remind"] = [parse_duration(a, "--remind") for a in args.remind.split(",")]
    if args.escalate is not None:
        age, sep, group = args.escalate.partition(":")
        if not sep or not group:
            raise BadItem(
                "--escalate", f"expected AGE:GROUP, e.g. 30m:oncall, got {args.escalate!r}"
            )
        fields["escalate"] = parse_duration(age, "--escalate")
        fields["escalate_to"] = group
    if args.deadline is not None:
        fields["deadline"] = parse_duration(args.deadline, "--deadline")
    return Timing.parse(fields, "timing")


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and (seconds / size) == round(seconds / size, 1):
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _timing_text(timing: Timing | None) -> str:
    if timing is None:
        return "no timing: its prompts wait as long as it takes"
    parts = []
    if timing.remind:
        parts.append("remind at " + ", ".join(_span(r) for r in sorted(timing.remind)))
    if timing.escalate is not None:
        parts.append(f"escalate to {timing.escalate_to} at {_span(timing.escalate)}")
    if timing.deadline is not None:
        parts.append(f"expire at {_span(timing.deadline)}")
    return "; ".join(parts)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    if args.script is not None:
        try:
            return {"script": orjson.loads(args.script.read_bytes())}
        except OSError as e:
            raise CliError(f"--script: cannot read {args.script}: {e.strerror}") from None
        except orjson.JSONDecodeError as e:
            raise CliError(f"--script: {args.script} is not valid JSON ({e})") from None
    if args.config is not None:
        try:
            config = orjson.loads(args.config)
        except orjson.JSONDecodeError as e:
            raise CliError(f"--config: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CliError("--config: expected a JSON object")
        return config
    return {}


def _policy(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `--policy` block, checked: a malformed one names the offending rule."""
    if args.policy is None:
        if args.permissions == "guarded":
            raise CliError("--policy: POLICY_MISSING: --permissions guarded needs a policy block")
        return None
    if args.permissions != "guarded":
        raise CliError(
            f"--policy: only --permissions guarded takes a policy, not {args.permissions}"
        )
    raw: bytes | str = args.policy
    if not args.policy.lstrip().startswith("{"):
        try:
            raw = Path(args.policy).read_bytes()
        except OSError as e:
            raise CliError(f"--policy: cannot read {args.policy}: {e.strerror}") from None
    try:
        block = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise CliError(f"--policy: not valid JSON ({e})") from None
    validate_policy(block)
    checked: dict[str, Any] = block
    return checked


def _thread_id(args: argparse.Namespace) -> str:
    from broker.keys import check_thread_id

    return check_thread_id(args.thread, "THREAD")


async def _thread_new(b: Broker, args: argparse.Namespace) -> None:
    config = _config(args)
    policy = _policy(args)
    timing = _timing(args)
    harness = default_harnesses().get(args.harness)
    if harness is None:
        have = ", ".join(sorted(default_harnesses()))
        raise CliError(f"--harness: {args.harness} is not installed here (have: {have})")
    try:
        module = (
            harness.module
            if isinstance(harness, OnFirstUse)
            else sys.modules[type(harness).__module__]
        )
    except ImportError as e:  # installed, but it does not import
        raise CliError(f"--harness: {args.harness} cannot be loaded here: {e}") from None
    validate = getattr(module, "validate_config", None)
    if validate is not None:
        validate(config)
    try:
        session = await b.sessions.create(
            args.thread, args.harness, args.permissions, config, args.work_folder, policy=policy
        )
    except BadItem as e:
        raise BadItem("THREAD" if e.field == "thread_id" else e.field, e.problem) from None
    print(f"thread {session.thread_id}: {session.harness} agent, {session.permissions}")
    if timing is not None:
        await b.set_timing(session.thread_id, timing)
        print(f"timing: {_timing_text(timing)}")
    if args.message:
        await b.post_item(args.thread, {"content": [{"type": "text", "text": args.message}]})
        print("message posted: a replica will pick it up")


async def _session(b: Broker, thread_id: str) -> Session:
    """The thread's session; an unknown thread, or one with no session, is an error."""
    try:
        found = await b.sessions.get(thread_id)
    except (KeyError, ValueError, ValidationError) as e:
        raise CliError(
            f"THREAD: the session record of thread {thread_id} is damaged ({e})"
        ) from None
    if found is not None:
        return found
    if not await b.thread_exists(thread_id):
        raise ThreadNotFound(thread_id)
    raise CliError(f"THREAD: thread {thread_id} has items but no agent session")


async def _thread_close(b: Broker, args: argparse.Namespace) -> None:
    thread_id = _thread_id(args)
    # Checked first: closing an unknown thread must write nothing (no partial record).
    session = await _session(b, thread_id)
    if session.status == "closed":
        print(f"thread {thread_id} was already closed")
        return
    await b.sessions.close(thread_id, args.reason)
    print(f"thread {thread_id} closed")


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _status_lines(session: Session, active: str | None) -> list[str]:
    """`thread status` for people: one fact a line."""
    s = session
    holder = (
        f"{s.owner} (lease until {_when(s.lease_until)})"
        if s.owner
        else "no replica (the next adoption sweep gives it one)"
        if s.status != "closed"
        else "no replica (closed)"
    )
    waiting = f"{s.waiting.prompt_id} ({s.waiting.kind})" if s.waiting else "nothing"
    lines = [
        f"thread {s.thread_id}: {s.harness} agent, {s.permissions}, {s.status}",
        f"  held by:       {holder}",
        f"  epoch:         {s.epoch}",
        f"  waiting on:    {waiting}",
        f"  active prompt: {active or 'none'}",
        f"  created:       {_when(s.created_at)}",
    ]
    if s.work_folder:
        lines.append(f"  work folder:   {s.work_folder}")
    if s.grant is not None:
        lines.append(f"  grant:         {s.grant.subject} (by {s.grant.granted_by}, unspent)")
    if s.error:
        lines.append(f"  error:         {s.error}")
    return lines


async def _thread_status(b: Broker, args: argparse.Namespace) -> None:
    thread_id = _thread_id(args)
    session = await _session(b, thread_id)
    if args.json:
        document = session.model_dump(mode="json", exclude={"grant_raw"})
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
        return
    active = await b.active_prompt(thread_id)
    shown = f"{active.prompt_id} ({active.kind}, {active.state})" if active else None
    print("\n".join(_status_lines(session, shown)))


async def _thread_timing(b: Broker, args: argparse.Namespace) -> None:
    """Show the timing that applies (the prompt's own, else the thread's), or set or clear it."""
    from broker.keys import check_prompt_id

    thread_id = _thread_id(args)
    prompt_id = None if args.prompt is None else check_prompt_id(args.prompt, "--prompt")
    timing = _timing(args)
    if args.clear and timing is not None:
        raise CliError("--clear: give either --clear or a timing, not both")
    if not await b.thread_exists(thread_id):
        raise ThreadNotFound(thread_id)
    whose = f"prompt {prompt_id}" if prompt_id else f"thread {thread_id}"
    if args.clear or timing is not None:
        await b.set_timing(thread_id, timing, prompt_id=prompt_id)
    shown = await b.get_timing(thread_id, prompt_id)
    if args.json:
        document = {"thread_id": thread_id, "prompt_id": prompt_id, "timing": shown}
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2, default=_dump).decode())
        return
    print(f"{whose}: {_timing_text(shown)}")


def _dump(value: object) -> object:
    if isinstance(value, Timing):
        return value.model_dump(exclude_none=True)
    raise TypeError(type(value).__name__)


async def cmd_thread(args: argparse.Namespace, settings: Settings) -> int:
    actions = {
        "new": _thread_new,
        "close": _thread_close,
        "status": _thread_status,
        "timing": _thread_timing,
    }
    async with Broker.from_url(settings=settings, socket_connect_timeout=5) as b:
        await actions[args.action](b, args)
    return 0


#: The thread command.
COMMANDS: dict[str, Command] = {
    "thread": Command("create, close or inspect a thread", _thread_args, cmd_thread),
}
