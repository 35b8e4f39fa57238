"""The guarded policy end to end: in-process replicas on both backends, the scripted harness's
gate, and `thread new --policy` on the command line.

Replicas run as in tests/runtime/test_replica.py (with its helpers); the policy's pure rules are in
tests/agents/test_policy.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from broker import Answer, BadItem, Broker, Item, Kind, Question, Settings, map_text
from tests.conftest import BrokerFactory, delete_prefix
from tests.helpers import of_type, outputs, text
from tests.runtime.test_replica import (
    Fleet,
    active,
    script,
    session,
    status_is,
    turn_ends,
)
from workers.agents import policy
from workers.agents.harness import GateVerdict, Permissions, Turn
from workers.agents.policy import EVALUATION_ERROR, validate
from workers.agents.scripted import ScriptedHarness
from workers.runtime.cli import main
from workers.runtime.replica import Replica

POLICY: dict[str, Any] = {
    "default": "ask",
    "rules": [
        {"id": "no-rm", "effect": "exec", "action": "deny", "command": ["rm -rf *"]},
        {"id": "git-read", "effect": "exec", "action": "allow", "command": ["git status*"]},
        {"id": "deploys", "effect": "exec", "action": "ask", "command": ["make deploy*"]},
    ],
}


def bash(command: str, output: str = "") -> dict[str, Any]:
    return {"tool": "Bash", "input": {"command": command}, "output": output}


async def start_guarded(
    b: Broker, thread_id: str, config: dict[str, Any], block: dict[str, Any] | None = None
) -> None:
    block = POLICY if block is None else block
    validate(block)
    await b.sessions.create(
        thread_id, "scripted", "guarded", config, work_folder="/work/proj", policy=block
    )
    await b.post_item(thread_id, text("go"))


def after_message(items: Sequence[Item]) -> list[Item]:
    """The thread's items after the person's first message."""
    return list(items[1:])


# -- replicas ------------------------------------------------------------------------------------


async def test_allow_runs_silently_with_no_prompt_and_no_item(fleet: Fleet, person: Broker) -> None:
    """An allowed call runs with no prompt and no policy item, after `policy_applied`."""
    await fleet.start("r1")
    await start_guarded(person, "t1", script(bash("git status", "clean"), {"say": "done"}))
    items = await turn_ends(person, "t1")
    assert [i.type for i in after_message(items)] == [
        "policy_applied",
        "agent_output",
        "agent_output",
        "turn_end",
    ]
    assert outputs(items) == ["Ran Bash `git status`:\nclean", "done"]
    assert of_type(items, "pending_prompt") == []
    assert of_type(items, "policy_denied") == []


async def test_deny_refuses_names_the_rule_and_asks_nobody(fleet: Fleet, person: Broker) -> None:
    """A denied call is not run, the agent is told the rule, a `policy_denied` item names it, and
    no person is asked."""
    await fleet.start("r1")
    command = "git status && rm -rf /"
    await start_guarded(person, "t1", script(bash(command, "gone"), {"say": "after"}))
    items = await turn_ends(person, "t1")
    assert outputs(items) == [
        f"Did not run Bash `{command}`: Denied by policy rule 'no-rm'.",
        "after",
    ]
    (denied,) = of_type(items, "policy_denied")
    assert denied.text == f"Blocked by policy rule 'no-rm': {command}"
    assert denied.metadata == {
        "type": "policy_denied",
        "rule": "no-rm",
        "effect": "exec",
        "detail": command,
    }
    assert denied.author == person.identity
    assert of_type(items, "pending_prompt") == []
    assert (await person.active_prompt("t1")) is None
    (end,) = of_type(items, "turn_end")
    assert end.metadata["status"] == "completed"


async def test_ask_raises_an_ordinary_approval_prompt(fleet: Fleet, person: Broker) -> None:
    """An `ask` verdict is exactly the approval path: a pending approval prompt, then the run."""
    await fleet.start("r1")
    await start_guarded(person, "t1", script(bash("make deploy", "deployed")))
    p = await active(person, "t1")
    assert p.kind == "approval"
    assert p.questions[0].subject == "Bash"
    assert p.questions[0].grant_key == "Bash:make deploy"
    await person.post_item("t1", text("yes"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["Ran Bash `make deploy`:\ndeployed"]
    assert of_type(items, "policy_denied") == []
    assert len(of_type(items, "pending_prompt")) == 1


async def test_allow_deny_ask_and_default_in_one_turn(fleet: Fleet, person: Broker) -> None:
    """One turn through every verdict, in order; the default (ask) covers an unmatched call."""
    await fleet.start("r1")
    config = script(
        bash("git status", "clean"),
        bash("rm -rf build", "removed"),
        {"tool": "WebFetch", "input": {"url": "https://example.com"}, "output": "page"},
        {"say": "end"},
    )
    await start_guarded(person, "t1", config)
    p = await active(person, "t1")
    assert p.questions[0].subject == "WebFetch"
    await person.post_item("t1", text("no"))
    items = await turn_ends(person, "t1")
    assert outputs(items) == [
        "Ran Bash `git status`:\nclean",
        "Did not run Bash `rm -rf build`: Denied by policy rule 'no-rm'.",
        "Did not run WebFetch: the person denied it.",
        "end",
    ]
    assert [i.metadata["rule"] for i in of_type(items, "policy_denied")] == ["no-rm"]
    types = [i.type for i in after_message(items)]
    assert types[0] == "policy_applied"
    assert types.index("policy_denied") < types.index("pending_prompt")


async def test_policy_applied_starts_every_guarded_turn(fleet: Fleet, person: Broker) -> None:
    """Each guarded turn, resume turns included, starts with `policy_applied` listing the rules
    in force, the worker's first."""
    worker = [{"id": "w-no-net", "effect": "network", "action": "deny"}]
    await fleet.start("r1", wait_mode="parked", policy_rules=worker)
    await start_guarded(person, "t1", script(bash("make deploy", "deployed"), {"say": "end"}))
    await status_is(person, "t1", "parked")
    items = await person.items("t1")
    (applied,) = of_type(items, "policy_applied")
    assert applied.author == person.identity
    assert applied.metadata == {
        "type": "policy_applied",
        "rules": [
            {"id": "w-no-net", "origin": "worker", "action": "deny"},
            {"id": "no-rm", "origin": "thread", "action": "deny"},
            {"id": "git-read", "origin": "thread", "action": "allow"},
            {"id": "deploys", "origin": "thread", "action": "ask"},
        ],
        "default": "ask",
        "counts": {"rules": 4, "reported": 4},
    }
    assert items.index(applied) == 1  # right after the person's message: the turn's first item
    await person.post_item("t1", text("yes"))  # the resume turn re-asks; the grant answers
    items = await turn_ends(person, "t1")
    assert len(of_type(items, "policy_applied")) == 2
    assert outputs(items) == ["Ran Bash `make deploy`:\ndeployed", "end"]
    assert len(of_type(items, "approval_granted")) == 1


async def test_worker_rules_come_first(fleet: Fleet, person: Broker) -> None:
    """A worker's deny cannot be relaxed by a thread's allow."""
    worker = [{"id": "w-no-push", "effect": "exec", "action": "deny", "command": ["git push*"]}]
    await fleet.start("r1", policy_rules=worker)
    block = {"default": "allow", "rules": [{"id": "t-all", "effect": "exec", "action": "allow"}]}
    await start_guarded(person, "t1", script(bash("git push origin main")), block)
    items = await turn_ends(person, "t1")
    assert outputs(items) == [
        "Did not run Bash `git push origin main`: Denied by policy rule 'w-no-push'."
    ]
    (denied,) = of_type(items, "policy_denied")
    assert denied.metadata["rule"] == "w-no-push"


SMUGGLE_POLICY: dict[str, Any] = {
    "default": "ask",
    "rules": [
        {"id": "git-ok", "effect": "exec", "action": "allow", "command": ["git status*"]},
        {"id": "no-rm", "effect": "exec", "action": "deny", "command": ["rm *"]},
        {"id": "no-touch", "effect": "exec", "action": "deny", "command": ["touch *"]},
        {"id": "w-out", "effect": "write", "action": "deny", "outside": "work_folder"},
    ],
}
#: Commands a hand-written splitter once let through an allow rule, silently, on a fleet; the
#: last is long enough to be decided in a worker thread.
SMUGGLED = [
    ("git status <(touch x)", "no-touch"),
    ("git status # it's fine\ntouch x", "no-touch"),
    ("git status $'\\'' ; touch x", "no-touch"),
    ("git status > /etc/cron.d/x", "w-out"),
    ("git status " + "a " * policy.ASYNC_OVER + "; touch x", "no-touch"),
]


async def test_smuggled_commands_never_run_on_a_replica(fleet: Fleet, person: Broker) -> None:
    """On a replica, each command that smuggles a payload past the allow rule is refused by the
    deny rule it hides from, with a `policy_denied` item; none runs, no one is asked."""
    await fleet.start("r1")
    steps = [bash(command, "ran") for command, _ in SMUGGLED]
    await start_guarded(person, "t1", script(*steps, {"say": "end"}), SMUGGLE_POLICY)
    items = await turn_ends(person, "t1")
    said = outputs(items)
    assert not [line for line in said if line.startswith("Ran ")]
    assert [i.metadata["rule"] for i in of_type(items, "policy_denied")] == [
        rule for _, rule in SMUGGLED
    ]
    assert of_type(items, "pending_prompt") == []
    assert said[-1] == "end"


async def test_evaluator_error_denies_with_no_item(
    fleet: Fleet, person: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while deciding denies the call (`policy_evaluation_error`) and posts no
    `policy_denied` item, since no rule matched."""

    def broken(*_args: object) -> bool:
        raise RuntimeError("evaluator bug")

    monkeypatch.setattr(policy, "_matches", broken)
    await fleet.start("r1")
    await start_guarded(person, "t1", script(bash("git status", "clean")))
    items = await turn_ends(person, "t1")
    assert outputs(items) == [
        f"Did not run Bash `git status`: Denied by policy rule '{EVALUATION_ERROR}'."
    ]
    assert of_type(items, "policy_denied") == []
    assert of_type(items, "pending_prompt") == []


async def test_approval_threads_have_no_gate(fleet: Fleet, person: Broker) -> None:
    """Under `approval` no policy applies: no `policy_applied`, every call asks a person."""
    await fleet.start("r1")
    await person.sessions.create("t1", "scripted", "approval", script(bash("rm -rf build")))
    await person.post_item("t1", text("go"))
    p = await active(person, "t1")
    assert p.kind == "approval"
    assert of_type(await person.items("t1"), "policy_applied") == []


async def test_thread_created_around_the_check_fails_its_turn(fleet: Fleet, person: Broker) -> None:
    """A malformed policy stored without the runtime's check is not enforced half-way: the turn
    fails saying POLICY_INVALID and naming the rule, and nothing runs."""
    await fleet.start("r1")
    block = {"rules": [{"id": "x", "effect": "exec", "action": "maybe"}]}
    await person.sessions.create("t1", "scripted", "guarded", script(bash("ls")), policy=block)
    await person.post_item("t1", text("go"))
    items = await turn_ends(person, "t1")
    (end,) = of_type(items, "turn_end")
    assert end.metadata["status"] == "failed"
    assert "POLICY_INVALID" in end.text and "policy.rules[0].action" in end.text
    assert outputs(items) == []
    assert of_type(items, "policy_applied") == []
    s = await session(person, "t1")
    assert s.error is not None and "POLICY_INVALID" in s.error


async def test_replica_refuses_malformed_worker_rules(make_broker: BrokerFactory) -> None:
    """A worker rule that is malformed stops the replica before it runs anything."""
    b = await make_broker(policy_rules=[{"id": "w", "effect": "exec", "action": "sometimes"}])
    with pytest.raises(BadItem) as caught:
        Replica(b, replica_id="r1")
    assert caught.value.field == "PROMPT_BROKER_POLICY_RULES[0].action"


# -- creating guarded threads --------------------------------------------------------------------


async def test_guarded_session_stores_its_policy(person: Broker) -> None:
    """A guarded session keeps its policy block as given."""
    validate(POLICY)
    made = await person.sessions.create("t1", "scripted", "guarded", {}, policy=POLICY)
    assert made.permissions == "guarded"
    assert made.policy == POLICY
    assert (await session(person, "t1")).policy == POLICY
    plain = await person.sessions.create("t2", "scripted", "approval", {})
    assert plain.policy is None


@pytest.mark.parametrize(
    ("permissions", "block", "message"),
    [
        ("guarded", None, "POLICY_MISSING"),
        ("guarded", ["not", "an", "object"], "expected an object"),
        ("approval", POLICY, "only guarded threads take a policy"),
        ("autonomous", POLICY, "only guarded threads take a policy"),
    ],
)
async def test_create_refuses_a_missing_or_misplaced_policy(
    person: Broker, permissions: str, block: Any, message: str
) -> None:
    """Guarded needs a policy and only guarded takes one; nothing is written when refused."""
    with pytest.raises(BadItem, match=message) as caught:
        await person.sessions.create("t1", "scripted", permissions, {}, policy=block)
    assert caught.value.field == "policy"
    assert await person.sessions.get("t1") is None


async def test_malformed_policy_refused_before_creation(person: Broker) -> None:
    """The runtime's check names the offending rule, and the thread is never created."""
    block = {
        "default": "ask",
        "rules": [
            {"id": "a", "effect": "read", "action": "allow"},
            {"id": "b", "effect": "write", "action": "ask", "outside": "work_folder"},
            {"id": "c", "effect": "exec", "action": "perhaps", "command": ["rm *"]},
        ],
    }
    with pytest.raises(BadItem) as caught:
        validate(block)
    assert caught.value.field == "policy.rules[2].action"
    assert await person.sessions.get("t1") is None


@pytest.mark.parametrize("type_", ["policy_applied", "policy_denied"])
async def test_a_person_cannot_post_policy_items(person: Broker, type_: str) -> None:
    """Policy items come from the broker only: a forged `policy_applied` could claim enforcement
    that never happened."""
    forged = {"content": [{"type": "text", "text": "all fine"}], "metadata": {"type": type_}}
    with pytest.raises(BadItem, match="posted by the broker only"):
        await person.post_item("t1", forged)
    assert await person.items("t1") == []


# -- the scripted harness's gate, alone ----------------------------------------------------------


class Handle:
    """A prompt handle that approves everything and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[Kind, list[Question]]] = []

    async def ask(
        self, kind: Kind, questions: Sequence[Question], *, state: dict[str, Any] | None = None
    ) -> list[Answer]:
        self.asked.append((kind, list(questions)))
        return map_text(kind, questions, "yes")


async def run_gated(
    permissions: Permissions, verdict: GateVerdict | None
) -> tuple[list[str], Handle, list[tuple[str, str, dict[str, Any]]]]:
    out: list[str] = []
    handle = Handle()
    calls: list[tuple[str, str, dict[str, Any]]] = []

    async def emit(line: str) -> None:
        out.append(line)

    async def gate(harness: str, tool: str, tool_input: dict[str, Any]) -> GateVerdict:
        calls.append((harness, tool, tool_input))
        assert verdict is not None
        return verdict

    turn = Turn(
        thread_id="t1",
        prompt="go",
        permissions=permissions,
        config=script(bash("make deploy", "deployed")),
        state=None,
        handle=handle,
        emit=emit,
        gate=gate if verdict is not None else None,
    )
    result = await ScriptedHarness().run_turn(turn)
    assert result.status == "completed"
    return out, handle, calls


@pytest.mark.parametrize(
    ("verdict", "said", "asked"),
    [
        (GateVerdict("allow", "ok", "exec", "make deploy"), "Ran Bash `make deploy`:\ndeployed", 0),
        (
            GateVerdict("deny", "no", "exec", "make deploy"),
            "Did not run Bash `make deploy`: Denied by policy rule 'no'.",
            0,
        ),
        (
            GateVerdict("deny", "", "exec", "make deploy"),
            "Did not run Bash `make deploy`: Denied by the policy's default.",
            0,
        ),
        (GateVerdict("ask", "a", "exec", "make deploy"), "Ran Bash `make deploy`:\ndeployed", 1),
    ],
)
async def test_scripted_tool_goes_through_the_gate(
    verdict: GateVerdict, said: str, asked: int
) -> None:
    """Under guarded the scripted tool step asks the gate first, with Claude Code's names."""
    out, handle, calls = await run_gated("guarded", verdict)
    assert out == [said]
    assert calls == [("scripted", "Bash", {"command": "make deploy"})]
    assert len(handle.asked) == asked
    if asked:
        assert handle.asked[0][0] == "approval"


async def test_scripted_ignores_a_gate_under_approval() -> None:
    """Under approval a supplied gate is ignored: the person is asked."""
    out, handle, calls = await run_gated("approval", GateVerdict("allow", "ok"))
    assert calls == []
    assert len(handle.asked) == 1
    assert out == ["Ran Bash `make deploy`:\ndeployed"]


async def test_scripted_guarded_without_a_gate_asks_a_person() -> None:
    """A guarded turn with no gate fails safe: it takes the approval path."""
    _, handle, _ = await run_gated("guarded", None)
    assert [kind for kind, _ in handle.asked] == ["approval"]


# -- the command line ----------------------------------------------------------------------------


@pytest.fixture
def cli_env(
    monkeypatch: pytest.MonkeyPatch, real_redis_url: str, prefix: str
) -> Iterator[Settings]:
    """The environment a user would set (the real Redis, this test's prefix); keys deleted after."""
    for name in ("PROMPT_BROKER_POLICY_RULES", "PROMPT_BROKER_IDENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PROMPT_BROKER_REDIS_URL", real_redis_url)
    monkeypatch.setenv("PROMPT_BROKER_KEY_PREFIX", prefix)
    yield Settings(redis_url=real_redis_url, key_prefix=prefix)

    async def cleanup() -> None:
        client = Redis.from_url(real_redis_url, decode_responses=True)
        try:
            await delete_prefix(client, prefix)
        finally:
            await client.aclose()

    asyncio.run(cleanup())


def stored(settings: Settings, thread_id: str) -> Any:
    async def get() -> Any:
        async with Broker.from_url(settings=settings) as b:
            return await b.sessions.get(thread_id)

    return asyncio.run(get())


@pytest.mark.real_redis
def test_cli_guarded_thread_from_a_file_and_inline(
    cli_env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`thread new --permissions guarded --policy` takes a file or the JSON itself."""
    path = tmp_path / "policy.json"
    path.write_bytes(orjson.dumps(POLICY))
    assert main(["thread", "new", "t1", "--permissions", "guarded", "--policy", str(path)]) == 0
    assert "t1: scripted agent, guarded" in capsys.readouterr().out
    assert stored(cli_env, "t1").policy == POLICY
    inline = '{"default": "deny"}'
    assert main(["thread", "new", "t2", "--permissions", "guarded", "--policy", inline]) == 0
    assert stored(cli_env, "t2").policy == {"default": "deny"}


@pytest.mark.real_redis
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            [
                "--permissions",
                "guarded",
                "--policy",
                '{"rules": [{"id": "a", "effect": "exec", "action": "deny"},'
                ' {"id": "b", "effect": "exec", "action": "nope"}]}',
            ],
            "policy.rules[1].action: expected one of 'allow', 'deny', 'ask', got 'nope'",
        ),
        (["--permissions", "guarded"], "--policy: POLICY_MISSING"),
        (["--policy", '{"default": "ask"}'], "--policy: only --permissions guarded"),
        (["--permissions", "guarded", "--policy", "{nope"], "--policy: not valid JSON"),
        (["--permissions", "guarded", "--policy", "/no/such/file.json"], "--policy: cannot read"),
    ],
)
def test_cli_refuses_a_bad_policy_in_one_line(
    cli_env: Settings, capsys: pytest.CaptureFixture[str], args: list[str], error: str
) -> None:
    """A malformed, missing or misplaced policy is refused at creation: one line, exit 2, and
    no thread."""
    assert main(["thread", "new", "t1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prompt-broker: error: {error}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert stored(cli_env, "t1") is None
