"""The command line, run in-process against the real redis-server (and once as a real process).

`main()` runs `asyncio.run` itself, so these tests are plain sync tests and arrange their state
with `asyncio.run` too. Each test has its own key prefix, set through the environment as a user
would, and deletes only its own keys.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
from redis.asyncio import Redis

from broker import Broker, Prompt, Settings
from broker.cli import main
from tests.conftest import delete_prefix, free_port

pytestmark = pytest.mark.real_redis

T = TypeVar("T")
THREAD = "cli-thread"
TARGET = {
    "question": "What's the deployment target?",
    "options": [
        {"label": "staging", "description": "push to staging.example.com"},
        {"label": "production", "description": "push to www.example.com"},
    ],
}
APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
STYLE = {"question": "Any preference for visual style?"}


@dataclass(frozen=True)
class Env:
    url: str
    prefix: str

    def run(self, fn: Callable[[Broker], Awaitable[T]]) -> T:
        """Run `fn` with a Broker on this test's server and prefix (arranging, or checking)."""

        async def go() -> T:
            client = Redis.from_url(self.url, decode_responses=True)
            async with Broker(client, Settings(key_prefix=self.prefix), owns_client=True) as b:
                return await fn(b)

        return asyncio.run(go())

    def ask(self, kind: str, *questions: dict[str, Any], thread: str = THREAD) -> Prompt:
        return self.run(lambda b: b.ask(thread, kind, list(questions)))

    def prompt(self, prompt_id: str, thread: str = THREAD) -> Prompt:
        return self.run(lambda b: b.get_prompt(thread, prompt_id))


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, real_redis_url: str, prefix: str) -> Iterator[Env]:
    """The environment a user would set, and this test's keys deleted afterwards."""
    for name in list(os.environ):
        if name.startswith("PROMPT_BROKER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PROMPT_BROKER_REDIS_URL", real_redis_url)
    monkeypatch.setenv("PROMPT_BROKER_KEY_PREFIX", prefix)
    e = Env(real_redis_url, prefix)
    yield e

    async def cleanup() -> None:
        client = Redis.from_url(real_redis_url, decode_responses=True)
        try:
            await delete_prefix(client, prefix)
        finally:
            await client.aclose()

    asyncio.run(cleanup())


def text_item(text: str, author: str = "user") -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "author": author}


def one_error_line(err: str) -> str:
    """stderr must be exactly one `prompt-broker: error:` line, never a traceback."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("prompt-broker: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_open_lists_pending_prompt(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`open` prints one line per pending prompt: age, thread, id, kind and the question."""
    p = env.ask("ask_user_question", TARGET, STYLE)
    assert main(["open"]) == 0
    out = capsys.readouterr().out
    (line,) = out.splitlines()
    age, thread, prompt_id, kind = line.split()[:4]
    assert age.endswith("s")
    assert (thread, prompt_id, kind) == (THREAD, p.prompt_id, "ask_user_question")
    assert line.endswith("What's the deployment target? (+1 more)")


def test_open_json_and_nothing_waiting(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`open --json` is one JSON list of prompts; with none, the text form says so."""
    assert main(["open"]) == 0
    assert capsys.readouterr().out == "nothing is waiting on a person\n"
    p = env.ask("approval", APPROVAL)
    assert main(["open", "--json"]) == 0
    (doc,) = orjson.loads(capsys.readouterr().out)
    assert (doc["prompt_id"], doc["thread_id"], doc["kind"]) == (p.prompt_id, THREAD, "approval")
    assert doc["age_seconds"] >= 0


def test_show_renders_items_and_active_prompt(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`show` prints each item (options numbered, the ✓ line), the active prompt and the inbox."""

    async def arrange(b: Broker) -> str:
        await b.post_item(THREAD, text_item("an early note", author="alice"))  # queued
        first = await b.ask(THREAD, "ask_user_question", [TARGET])
        await b.post_item(THREAD, text_item("1"))
        await b.wait(THREAD, first.prompt_id, timeout=5)
        assert await b.post_resolution(THREAD, first.prompt_id)
        return (await b.ask(THREAD, "approval", [APPROVAL])).prompt_id

    active = env.run(arrange)
    assert main(["show", THREAD]) == 0
    out = capsys.readouterr().out
    assert "  alice  message\n    an early note\n" in out
    assert (
        "    What's the deployment target?\n      1. staging — push to staging.example.com\n"
        in (out)
    )
    assert "      2. production — push to www.example.com\n" in out
    assert "pending_prompt_resolved" in out
    assert "    ✓ Answered: staging\n" in out
    assert f"active prompt: {active} (approval, asked " in out
    assert out.endswith("inbox: 1 item waiting for the next turn\n")
    assert len(env.run(lambda b: b.take_inbox(THREAD))) == 1  # `show` looked, it did not drain


def test_show_json(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`show --json` is one document: the items, the active prompt and the inbox length."""
    p = env.ask("approval", APPROVAL)
    assert main(["show", THREAD, "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert [i["metadata"]["type"] for i in doc["items"]] == ["pending_prompt"]
    assert doc["active_prompt"]["prompt_id"] == p.prompt_id
    assert doc["inbox"] == 0


def test_answer_text_maps_number_to_label(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`answer T 2` answers the active prompt with the second option's label."""
    p = env.ask("ask_user_question", TARGET)
    assert main(["answer", THREAD, "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"answered {p.prompt_id} on thread {THREAD} (source: text)",
        "  What's the deployment target? → production",
    ]
    record = env.prompt(p.prompt_id)
    assert record.state == "answered"
    assert [a.answer for a in record.answers or []] == [["production"]]


def test_answer_structured(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`--answers` goes to metadata.answers and is used as it stands, one entry per question."""
    p = env.ask("ask_user_question", TARGET, STYLE)
    answers = '[{"answer": ["staging"]}, {"answer": ["dark theme"]}]'
    assert main(["answer", THREAD, "staging · dark", "--answers", answers]) == 0
    assert "(source: structured)" in capsys.readouterr().out
    record = env.prompt(p.prompt_id)
    assert [a.answer for a in record.answers or []] == [["staging"], ["dark theme"]]


def test_answer_refused_structured_says_why(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A partial `--answers` set is refused, the text is mapped, and the output says why."""
    env.ask("ask_user_question", TARGET, STYLE)
    assert main(["answer", THREAD, "1", "--answers", '[{"answer": ["staging"]}]']) == 0
    out = capsys.readouterr().out
    assert "(source: text)" in out
    assert "--answers refused, the text was mapped instead: metadata.answers:" in out


def test_answer_bad_json_is_one_line(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`--answers` that is not JSON: one error line naming --answers, exit 2, nothing posted."""
    p = env.ask("approval", APPROVAL)
    assert main(["answer", THREAD, "yes", "--answers", "[{answer: yes"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("prompt-broker: error: --answers: not valid JSON")
    assert env.prompt(p.prompt_id).state == "pending"


def test_answer_stale_prompt_exits_1(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`--prompt` naming an already answered prompt: exit 1, naming its real state."""
    first = env.ask("approval", APPROVAL)
    env.run(lambda b: b.post_item(THREAD, text_item("yes")))
    second = env.ask("approval", APPROVAL)
    assert main(["answer", THREAD, "no", "--prompt", first.prompt_id]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"prompt {first.prompt_id} on thread {THREAD} is answered" in line
    assert second.prompt_id in line
    assert env.prompt(second.prompt_id).state == "pending"


def test_answer_without_prompt_is_queued(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """With no prompt active, `answer` queues the item in the inbox and says so."""
    assert main(["answer", THREAD, "hello", "--author", "alice"]) == 0
    assert capsys.readouterr().out.startswith("queued itm_")
    items = env.run(lambda b: b.take_inbox(THREAD))
    assert [(i.author, i.text) for i in items] == [("alice", "hello")]


def test_cancel_active_prompt(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`cancel` cancels the active prompt with the reason and prints its id."""
    p = env.ask("approval", APPROVAL)
    assert main(["cancel", THREAD, "--reason", "changed my mind"]) == 0
    assert (
        capsys.readouterr().out == f"cancelled {p.prompt_id} on thread {THREAD}: changed my mind\n"
    )
    record = env.prompt(p.prompt_id)
    assert (record.state, record.reason) == ("cancelled", "changed my mind")


def test_cancel_with_nothing_active(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`cancel` with nothing to cancel is a no-op: it says so and exits 0."""
    assert main(["cancel", THREAD]) == 0
    assert capsys.readouterr().out.startswith("nothing to cancel")
    p = env.ask("approval", APPROVAL)
    env.run(lambda b: b.post_item(THREAD, text_item("yes")))
    assert main(["cancel", THREAD, "--prompt", p.prompt_id]) == 0
    assert capsys.readouterr().out == (
        f"nothing to cancel: prompt {p.prompt_id} on thread {THREAD} is answered\n"
    )


def test_tail_prints_items_and_exits_0_on_ctrl_c(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tail --from-start` prints what is there as `show` does; Ctrl-C exits 0, no traceback."""
    p = env.ask("ask_user_question", TARGET)
    real_entries = Broker.entries
    seen: list[str] = []

    async def entries(self: Broker, thread_id: str, *, after: str = "$", block_ms: int = 0) -> Any:
        seen.append(after)
        if len(seen) > 1:
            raise KeyboardInterrupt
        return await real_entries(self, thread_id, after=after, block_ms=block_ms)

    monkeypatch.setattr(Broker, "entries", entries)
    assert main(["tail", THREAD, "--from-start"]) == 0
    captured = capsys.readouterr()
    assert f"pending_prompt  {p.prompt_id} (ask_user_question)\n" in captured.out
    assert "      2. production — push to www.example.com\n" in captured.out
    assert seen[0] == "0-0"
    assert seen[1] != "0-0"  # it goes on after the last item it printed
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("where", ["env", "flag"])
def test_unreachable_redis_is_one_line(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Nobody listening at the URL (from the env or --redis-url): one error line, exit 2."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    if where == "env":
        monkeypatch.setenv("PROMPT_BROKER_REDIS_URL", url)
        argv = ["open"]
    else:
        argv = ["open", "--redis-url", url]  # a global option after the subcommand works too
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"prompt-broker: error: cannot reach Redis at {url}: ")


def test_unknown_setting_is_one_line(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt PROMPT_BROKER_* variable fails loudly: one line naming it, exit 2."""
    monkeypatch.setenv("PROMPT_BROKER_FOO", "1")
    assert main(["open"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("prompt-broker: error: PROMPT_BROKER_FOO: unknown setting")


def test_usage_errors_exit_2(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """No subcommand, or a bad thread id, is a mistake: exit 2."""
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    capsys.readouterr()
    assert main(["show", "not a thread"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("prompt-broker: error: THREAD: ")


def test_console_script_runs(env: Env) -> None:
    """The installed `prompt-broker` runs as a real process: --help, then `open`."""
    script = Path(sys.executable).with_name("prompt-broker")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "broker.cli"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cmd, *args], check=False, capture_output=True, text=True, timeout=30
        )

    helped = run("--help")
    assert helped.returncode == 0, helped.stderr
    assert all(name in helped.stdout for name in ("open", "show", "answer", "cancel", "tail"))
    p = env.ask("approval", APPROVAL)
    opened = run("open")
    assert opened.returncode == 0, opened.stderr
    assert p.prompt_id in opened.stdout
    assert opened.stderr == ""
