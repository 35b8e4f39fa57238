"""The command line, run in-process against the real redis-server and against the session's Redis
Cluster (and once as a real process).

`main()` runs `asyncio.run` itself, so these tests are plain sync tests and arrange their state
with `asyncio.run` too. Each test has its own key prefix, set through the environment as a user
would, and deletes only its own keys.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker import Broker, Prompt, Settings
from broker.cli import main
from tests.conftest import cluster_runs_wanted, delete_prefix, free_port

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
    cluster: bool = False  # the URL names a node of the session's Redis Cluster

    @property
    def vars(self) -> dict[str, str]:
        """The PROMPT_BROKER_* variables a user would set for this server and prefix."""
        chosen = {"PROMPT_BROKER_REDIS_URL": self.url, "PROMPT_BROKER_KEY_PREFIX": self.prefix}
        return chosen | ({"PROMPT_BROKER_REDIS_CLUSTER": "true"} if self.cluster else {})

    def client(self) -> Redis:
        if self.cluster:
            return cast(Redis, RedisCluster.from_url(self.url, decode_responses=True))
        return Redis.from_url(self.url, decode_responses=True)

    def run(self, fn: Callable[[Broker], Awaitable[T]]) -> T:
        """Run `fn` with a Broker on this test's server and prefix (arranging, or checking)."""

        async def go() -> T:
            settings = Settings(key_prefix=self.prefix)
            async with Broker(self.client(), settings, owns_client=True) as b:
                return await fn(b)

        return asyncio.run(go())

    def ask(self, kind: str, *questions: dict[str, Any], thread: str = THREAD) -> Prompt:
        return self.run(lambda b: b.ask(thread, kind, list(questions)))

    def prompt(self, prompt_id: str, thread: str = THREAD) -> Prompt:
        return self.run(lambda b: b.get_prompt(thread, prompt_id))


#: The real server, and the session's cluster too (unless PB_CLUSTER_TESTS=0): the CLI on both.
SERVERS = ["real"] + (
    [pytest.param("cluster", marks=pytest.mark.cluster)] if cluster_runs_wanted() else []
)


@pytest.fixture(params=SERVERS)
def env(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, prefix: str
) -> Iterator[Env]:
    """The environment a user would set, and this test's keys deleted afterwards."""
    if request.param == "cluster":
        e = Env(request.getfixturevalue("redis_cluster").url, prefix, cluster=True)
    else:
        e = Env(request.getfixturevalue("real_redis_url"), prefix)
    for name in list(os.environ):
        if name.startswith("PROMPT_BROKER_"):
            monkeypatch.delenv(name)
    for name, value in e.vars.items():
        monkeypatch.setenv(name, value)
    yield e

    async def cleanup() -> None:
        client = e.client()
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
        await b.settle()  # the delivery is recorded (after `wait` returns): it may be audited
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
    assert main(["answer", THREAD, "hello", "--author", "alice", "--create"]) == 0
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
    env.run(lambda b: b.post_item(THREAD, text_item("a first message")))  # the thread exists
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


def test_a_queue_url_that_is_no_redis_url_is_one_line(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PROMPT_BROKER_QUEUE_URL must name a Redis: one line naming the variable, exit 2."""
    monkeypatch.setenv("PROMPT_BROKER_QUEUE_URL", "http://127.0.0.1:6379")
    assert main(["open"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("prompt-broker: error: PROMPT_BROKER_QUEUE_URL: "), line
    assert "is not a Redis URL" in line


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


# -- a typo cannot start or break a thread ---------------------------------------------------------


def cli_process(
    *args: str | bytes, env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """`prompt-broker ARGS` as a real process (bytes arguments go through as they are)."""
    return subprocess.run(
        [sys.executable, "-m", "workers.runtime.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        errors="replace",
    )


def test_answer_unknown_thread_refused(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`answer nosuch 2`: one line naming THREAD and --create, exit 2, nothing written."""
    assert main(["answer", "nosuch", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("prompt-broker: error: THREAD: no thread nosuch")
    assert "--create" in line
    assert env.run(lambda b: b.thread_exists("nosuch")) is False
    assert main(["answer", "nosuch", "hello", "--create"]) == 0
    assert capsys.readouterr().out.startswith("queued itm_")
    assert [i.text for i in env.run(lambda b: b.take_inbox("nosuch"))] == ["hello"]


def test_answer_closed_thread_refused(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """Answering a closed thread is refused (exit 1, one line), even with --create."""

    async def arrange(b: Broker) -> None:
        await b.sessions.create("done", "scripted")
        await b.sessions.close("done")

    env.run(arrange)
    for argv in (["answer", "done", "2"], ["answer", "done", "2", "--create"]):
        assert main(argv) == 1
        line = one_error_line(capsys.readouterr().err)
        assert line == "prompt-broker: error: THREAD: thread done is closed: it takes no more items"
    assert env.run(lambda b: b.take_inbox("done")) == []


@pytest.mark.parametrize("command", ["show", "cancel", "tail"])
def test_unknown_thread_is_an_error(env: Env, command: str) -> None:
    """`show`, `cancel` and `tail` of a thread that never existed: one line, exit 2, at once
    (`tail` refuses instead of waiting forever for a thread that is not there)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    run = cli_process(
        command,
        "nosuch",
        env=clean | env.vars,
        timeout=20,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    line = one_error_line(run.stderr)
    assert line.startswith("prompt-broker: error: THREAD: no thread nosuch"), line
    assert env.run(lambda b: b.thread_exists("nosuch")) is False


def test_answers_not_a_list_refused_always(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`--answers` that is JSON but not a list is refused naming --answers, even when no
    prompt is active (it would have been queued unchecked), and nothing is queued."""
    env.run(lambda b: b.post_item(THREAD, text_item("hello")))
    env.run(lambda b: b.take_inbox(THREAD))
    for answers in ('{"question": "q", "answer": ["a"]}', '"yes"', "3", "null"):
        assert main(["answer", THREAD, "yes", "--answers", answers]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith("prompt-broker: error: --answers: expected a JSON list"), line
        assert "TEXT" not in line
    assert env.run(lambda b: b.take_inbox(THREAD)) == []


def test_undecodable_argument_is_one_line(env: Env) -> None:
    """`prompt-broker answer T $'\\xff\\xfe'`: bytes that are not UTF-8 get one line, exit 2."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    env.run(lambda b: b.post_item(THREAD, text_item("hello")))
    run = cli_process(
        "answer",
        THREAD,
        b"\xff\xfe",
        env=clean | env.vars,
    )
    assert run.returncode == 2, run.stderr
    line = one_error_line(run.stderr)
    assert "argument 3" in line and "not UTF-8 text" in line and "\\xff\\xfe" in line
    assert len(env.run(lambda b: b.take_inbox(THREAD))) == 1  # only the first message


# -- finding the local fleet -----------------------------------------------------------------------


def record_fleet(home: Path, url: str, *, keeps_data: bool = True) -> Path:
    folder = home / "prompt-broker"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fleet.json"
    path.write_bytes(orjson.dumps({"url": url, "server": "redis-server", "keeps_data": keeps_data}))
    return path


def test_no_url_finds_the_local_fleet(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --redis-url, no PROMPT_BROKER_REDIS_URL: the commands use the address the local fleet
    recorded, and say so on stderr; a flag or the variable wins over it, silently."""
    p = env.ask("approval", APPROVAL)
    monkeypatch.delenv("PROMPT_BROKER_REDIS_URL")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    path = record_fleet(tmp_path, env.url)
    assert main(["open"]) == 0
    captured = capsys.readouterr()
    assert p.prompt_id in captured.out
    assert captured.err == (
        f"prompt-broker: using the local fleet's Redis at {env.url} (recorded in {path}); "
        "--redis-url or PROMPT_BROKER_REDIS_URL chooses another\n"
    )
    record_fleet(tmp_path, f"redis://127.0.0.1:{free_port()}/0")  # a fleet elsewhere
    assert main(["open", "--redis-url", env.url]) == 0
    captured = capsys.readouterr()
    assert p.prompt_id in captured.out and captured.err == ""
    monkeypatch.setenv("PROMPT_BROKER_REDIS_URL", env.url)
    assert main(["show", THREAD]) == 0
    assert capsys.readouterr().err == ""


def test_local_fleet_not_running_says_so(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorded fleet is not running: the error says whose Redis it was and how to start
    it; an embedded (fakeredis) fleet is named as keeping nothing."""
    monkeypatch.delenv("PROMPT_BROKER_REDIS_URL")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    url = f"redis://127.0.0.1:{free_port()}/0"
    path = record_fleet(tmp_path, url, keeps_data=False)
    assert main(["open"]) == 2
    note, error = capsys.readouterr().err.splitlines()
    assert note.startswith(f"prompt-broker: using the local fleet's Redis at {url}")
    assert "an embedded fakeredis server that keeps nothing" in note
    assert error.startswith(f"prompt-broker: error: cannot reach Redis at {url}: ")
    assert f"the local fleet recorded in {path} is not running" in error
    assert "scripts/run" in error


def test_no_fleet_recorded_uses_the_default(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no fleet recorded, the default URL, and nothing said about choosing."""
    monkeypatch.delenv("PROMPT_BROKER_REDIS_URL")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    code = main(["open"])
    captured = capsys.readouterr()
    assert "local fleet" not in captured.err
    if code != 0:  # nothing at the default address on this machine
        assert "redis://127.0.0.1:6379/0" in one_error_line(captured.err)


def test_help_states_the_real_defaults() -> None:
    """`--help` of each command says where its Redis comes from when none is given."""
    script = [sys.executable, "-m", "workers.runtime.cli"]

    def helped(*args: str) -> str:
        run = subprocess.run(
            [*script, *args, "--help"], capture_output=True, text=True, timeout=30, check=True
        )
        return " ".join(run.stdout.split())

    assert "else the local fleet's" in helped("open")
    assert "else the local fleet's" in helped("thread", "status")
    up = helped("up")
    assert "a private redis-server of the fleet's own" in up and "--data-dir" in up
    assert "keeps nothing" in up
    demo = helped("demo")
    assert "throwaway private redis-server" in demo
    assert "{scripted,claude_code,codex}" in demo
    assert "{scripted,claude_code,codex}" in helped("thread", "new")


# -- tail rides out a Redis blip -------------------------------------------------------------------


@pytest.mark.slow
def test_tail_reconnects_after_redis_restart(redis_server_factory: Any, tmp_path: Path) -> None:
    """Redis restarts under `tail`: it says so, reconnects, and goes on after the last item it
    printed: the next item is printed, and none twice."""
    server = redis_server_factory()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
    env = clean | {"PROMPT_BROKER_REDIS_URL": server.url, "PYTHONUNBUFFERED": "1"}

    def post(text: str) -> None:
        async def go() -> None:
            async with Broker.from_url(server.url) as b:
                await b.post_item("blip", text_item(text))

        asyncio.run(go())

    post("before")
    out = tmp_path / "tail.out"
    with out.open("w") as sink, (tmp_path / "tail.err").open("w") as err_sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.runtime.cli", "tail", "blip", "--from-start"],
            env=env,
            stdout=sink,
            stderr=err_sink,
        )
        try:
            wait_for(lambda: "before" in out.read_text(), "the first item")
            server.restart()  # SIGKILL, then the same port again (AOF kept the stream)
            post("after")
            wait_for(lambda: "after" in out.read_text(), "the item after the restart", 30)
            assert proc.poll() is None, "tail exited on the blip"
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
    text = out.read_text()
    assert text.count("    before\n") == 1 and text.count("    after\n") == 1, text
    err = (tmp_path / "tail.err").read_text()
    assert "lost Redis" in err and "reconnected after" in err and "Traceback" not in err
    assert proc.returncode == 0


def wait_for(check: Callable[[], bool], what: str, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_data_home_follows_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The fleet's data folder: $XDG_DATA_HOME/prompt-broker, else ~/.local/share/prompt-broker."""
    from broker.cli import data_home, fleet_record

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_home() == tmp_path / "xdg" / "prompt-broker"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fleet_record() == tmp_path / "home" / ".local/share/prompt-broker/fleet.json"


def test_library_field_names_are_the_flags(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A refusal from the library names the flag that set the field, not the API's name."""
    env.run(lambda b: b.post_item(THREAD, text_item("hello")))
    assert main(["answer", THREAD, "yes", "--author", "x" * 10_000]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("prompt-broker: error: --author")


def test_answers_shape_refusals_name_the_flag(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A list of the wrong things, with no prompt active, is refused naming --answers (never
    TEXT) and nothing is queued; `[]` on an active prompt is reported refused, the text mapped."""
    env.run(lambda b: b.post_item(THREAD, text_item("hello")))
    env.run(lambda b: b.take_inbox(THREAD))
    for answers, named in (
        ("[1, 2]", "--answers[0]: expected"),
        ('[{"answer": "staging"}]', "--answers[0].answer: expected a list of strings"),
        ('[{"answer": ["a"]}, {"question": 3, "answer": []}]', "--answers[1].question"),
    ):
        assert main(["answer", THREAD, "yes", "--answers", answers]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"prompt-broker: error: {named}"), line
    assert env.run(lambda b: b.take_inbox(THREAD)) == []
    p = env.ask("approval", APPROVAL)
    assert main(["answer", THREAD, "1", "--answers", "[]"]) == 0
    out = capsys.readouterr().out
    assert f"answered {p.prompt_id}" in out and "(source: text)" in out
    assert "--answers refused, the text was mapped instead" in out
