"""The Codex harness against the REAL Codex CLI (npm `@openai/codex`, pinned in package.json),
driven offline over `codex app-server` against `workers/demo/fakes/responses.py` on 127.0.0.1.

Two layers:

- **Harness alone** (no Redis): a `Turn` with an in-memory prompt handle and store, for the
  guarded gate, refusals nobody made, and the protocol's edge cases.
- **End to end**: in-process replicas (`workers.runtime.replica.Replica`) on the real redis-server
  (`real_redis_url`, this test's own key prefix), a "person" answering through a Broker: a
  command approved / declined / cancelled, file changes, permissions, `requestUserInput` answered
  by text and by structured answers, and a replica killed or stopped while Codex waits, the
  answer given afterwards and the same Codex thread resumed on another replica.

Every message the harness sends Codex is checked against the JSON schema the installed CLI
generates (`codex app-server generate-json-schema`): replies against each server request's
response type, requests against `ClientRequest`. `jsonschema` is used when importable, else a
small validator of the schema subset the protocol uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis

from broker import (
    Answer,
    BadItem,
    Broker,
    Item,
    Prompt,
    PromptCancelled,
    PromptUnavailable,
    Question,
    Session,
    Settings,
)
from tests import helpers
from tests.conftest import RedisServer, delete_prefix
from tests.helpers import of_type, outputs, text, truthy
from workers.agents.codex import (
    APPROVAL_METHODS,
    COMMAND,
    FILE_CHANGE,
    PERMISSIONS,
    PINNED_VERSION,
    SESSION_LABEL,
    USER_INPUT,
    CodexHarness,
    answers_payload,
    approval_payload,
    approval_question,
    find_codex,
    other_reply,
    parse_config,
)
from workers.agents.codex_recorder import holds
from workers.agents.codex_transcript import (
    Call,
    calls_of,
    dangling_calls,
    describe,
    interrupted_writer,
    output_line,
    rewrite_line,
)
from workers.agents.harness import (
    AgentStore,
    GateVerdict,
    Interruption,
    PromptParked,
    Turn,
    TurnResult,
)
from workers.demo.fakes.responses import FakeResponses
from workers.runtime.fleet import Fleet
from workers.runtime.replica import Replica

CODEX = find_codex()
REPO = Path(__file__).resolve().parents[2]
if CODEX is None:
    pytest.skip(
        "the Codex CLI is not installed: `npm install` at the repository root installs the "
        f"pinned @openai/codex {PINNED_VERSION} (or set CODEX_BIN)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.real_redis, pytest.mark.slow]

#: Replica settings: short leases and fast adoption, so a crashed replica's thread moves quickly.
FAST: dict[str, Any] = {"lease_ttl": 1.0, "adopt_interval": 0.05, "sweep_interval": 0.5}

T = TypeVar("T")


# -- the installed protocol's schema --------------------------------------------------------------


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = root
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return dict(node)


def _types_ok(value: Any, types: Any) -> bool:
    names = types if isinstance(types, list) else [types]
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return any(checks[n](value) for n in names)


def mini_validate(value: Any, schema: Any, root: dict[str, Any]) -> list[str]:  # noqa: C901, PLR0911, PLR0912
    """The JSON-schema subset the Codex protocol uses (a fallback for `jsonschema`)."""
    if schema is True or schema == {}:
        return []
    if "$ref" in schema:
        return mini_validate(value, _resolve(root, schema["$ref"]), root)
    if "type" in schema and not _types_ok(value, schema["type"]):
        return [f"{value!r} is not of type {schema['type']}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{value!r} is not one of {schema['enum']}"]
    for sub in schema.get("allOf", []):
        if errs := mini_validate(value, sub, root):
            return errs
    if "anyOf" in schema and all(mini_validate(value, s, root) for s in schema["anyOf"]):
        return [f"{value!r} matches none of anyOf"]
    if "oneOf" in schema:
        matched = sum(not mini_validate(value, s, root) for s in schema["oneOf"])
        if matched != 1:
            return [f"{value!r} matches {matched} of oneOf"]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return [f"missing required {key!r}"]
        for key, item in value.items():
            if key in props:
                if errs := mini_validate(item, props[key], root):
                    return [f"{key}: {e}" for e in errs]
            elif schema.get("additionalProperties") is False:
                return [f"unexpected property {key!r}"]
            elif isinstance(schema.get("additionalProperties"), dict) and (
                errs := mini_validate(item, schema["additionalProperties"], root)
            ):
                return [f"{key}: {e}" for e in errs]
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            if errs := mini_validate(item, schema["items"], root):
                return [f"[{i}]: {e}" for e in errs]
    return []


@dataclass
class Schema:
    """The generated protocol schema of the installed CLI."""

    dir: Path
    responses: dict[str, dict[str, Any]]  # server request method -> its response schema
    client_request: dict[str, Any]
    server_methods: list[str]

    def errors(self, value: Any, schema: dict[str, Any]) -> list[str]:
        try:
            import jsonschema  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            return mini_validate(value, schema, schema)
        validator = jsonschema.Draft7Validator(schema)
        return [e.message for e in validator.iter_errors(value)]

    def check_reply(self, method: str, result: Any) -> None:
        assert method in self.responses, f"{method} is not a server request of this protocol"
        errs = self.errors(result, self.responses[method])
        assert not errs, f"reply to {method} {result!r} is outside the schema: {errs}"
        assert not mini_validate(result, self.responses[method], self.responses[method])

    def check_request(self, msg: dict[str, Any]) -> None:
        errs = self.errors(msg, self.client_request)
        assert not errs, f"request {msg.get('method')} is outside the schema: {errs[:3]}"


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> Schema:
    out = tmp_path_factory.mktemp("codex-schema")
    env = dict(os.environ, CODEX_HOME=str(tmp_path_factory.mktemp("codex-home")))
    assert CODEX is not None
    version = subprocess.run(
        [CODEX, "--version"], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert PINNED_VERSION in version, f"expected codex {PINNED_VERSION}, found {version!r}"
    subprocess.run(
        [CODEX, "app-server", "generate-json-schema", "--out", str(out)],
        capture_output=True,
        env=env,
        check=True,
        timeout=120,
    )
    server = json.loads((out / "ServerRequest.json").read_text())
    responses: dict[str, dict[str, Any]] = {}
    methods = []
    for variant in server["oneOf"]:
        method = variant["properties"]["method"]["enum"][0]
        params = variant["properties"]["params"]["$ref"].rsplit("/", 1)[-1]
        name = params.removesuffix("Params") + "Response"
        responses[method] = json.loads((out / f"{name}.json").read_text())
        methods.append(method)
    client = json.loads((out / "ClientRequest.json").read_text())
    return Schema(out, responses, client, methods)


# -- the wire: every message between the harness and Codex ----------------------------------------


@dataclass
class Wire:
    """The harness's trace: every JSON-RPC message, per app-server process."""

    events: list[tuple[str, dict[str, Any], float]] = field(default_factory=list)
    crashed: set[int] = field(default_factory=set)  # processes killed with their replica

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        self.events.append((event, data, time.time()))

    def pids(self) -> list[int]:
        return [d["pid"] for e, d, _ in self.events if e == "spawn"]

    def messages(self, direction: str, pid: int | None = None) -> list[dict[str, Any]]:
        return [
            d["msg"]
            for e, d, _ in self.events
            if e == direction and (pid is None or d["pid"] == pid)
        ]

    def server_requests(self) -> list[tuple[int, dict[str, Any]]]:
        return [
            (d["pid"], d["msg"])
            for e, d, _ in self.events
            if e == "recv" and "method" in d["msg"] and "id" in d["msg"]
        ]

    def reply_to(self, pid: int, request_id: Any) -> dict[str, Any] | None:
        for msg in self.messages("send", pid):
            if "method" not in msg and msg.get("id") == request_id:
                return msg
        return None

    def replies(self, method: str) -> list[dict[str, Any]]:
        """The results sent for every `method` request, in order."""
        out: list[dict[str, Any]] = []
        for pid, req in self.server_requests():
            if req["method"] == method:
                reply = self.reply_to(pid, req["id"])
                assert reply is not None, f"{method} #{req['id']} was never answered"
                out.append(reply["result"] if "result" in reply else reply["error"])
        return out

    def sent(self, method: str) -> list[dict[str, Any]]:
        return [m for m in self.messages("send") if m.get("method") == method]

    def resumed(self) -> str:
        """The Codex thread of the one `thread/resume` sent (there must be exactly one)."""
        (resume,) = self.sent("thread/resume")
        return str(resume["params"]["threadId"])

    def check(self, schema: Schema) -> None:
        """Every server request got exactly one reply, inside the schema; every request of
        ours is inside the schema too."""
        for pid, req in self.server_requests():
            replies = [
                m
                for m in self.messages("send", pid)
                if "method" not in m and m.get("id") == req["id"]
            ]
            if pid in self.crashed and not replies:
                continue  # it died waiting, as a SIGKILLed replica's Codex does
            assert len(replies) == 1, f"{req['method']} #{req['id']}: {len(replies)} replies"
            if "result" in replies[0]:
                schema.check_reply(req["method"], replies[0]["result"])
            else:
                assert isinstance(replies[0]["error"].get("code"), int)
        for msg in self.messages("send"):
            if "method" in msg and "id" in msg:
                schema.check_request(msg)


# -- the harness alone ----------------------------------------------------------------------------


class MemStore:
    """An in-memory `AgentStore` (JSON round-tripped, like Redis)."""

    def __init__(self) -> None:
        self.data: dict[str, list[str]] = {}

    async def append(self, key: str, entries: Sequence[Any]) -> None:
        self.data.setdefault(key, []).extend(json.dumps(e) for e in entries)

    async def load(self, key: str) -> list[Any] | None:
        raw = self.data.get(key)
        return [json.loads(r) for r in raw] if raw else None


Outcome = list[str] | BaseException | Callable[[Sequence[Question]], list[Answer]]


class Handle:
    """A prompt handle answering from a list: labels for questions[0], or an exception."""

    def __init__(self, *outcomes: Outcome) -> None:
        self.outcomes = list(outcomes)
        self.asks: list[tuple[str, list[Question], dict[str, Any] | None]] = []

    async def ask(
        self, kind: Any, questions: Sequence[Question], *, state: dict[str, Any] | None = None
    ) -> list[Answer]:
        self.asks.append((kind, list(questions), state))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        if callable(outcome):
            return outcome(questions)
        return [Answer(question=questions[0].question, answer=outcome)]


@dataclass
class Solo:
    """The harness run directly: no replica, no Redis."""

    fake: FakeResponses
    work: Path
    schema: Schema
    wire: Wire = field(default_factory=Wire)
    store: MemStore = field(default_factory=MemStore)
    emitted: list[str] = field(default_factory=list)
    gate_calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.harness = CodexHarness(trace=self.wire)

    async def emit(self, text: str) -> None:
        self.emitted.append(text)

    async def turn(
        self,
        prompt: str,
        handle: Handle,
        *,
        permissions: Any = "approval",
        state: dict[str, Any] | None = None,
        gate: GateVerdict | None = None,
        config: dict[str, Any] | None = None,
        interrupted: Interruption | None = None,
        store: AgentStore | None = None,
    ) -> TurnResult:
        async def gate_fn(harness: str, method: str, params: dict[str, Any]) -> GateVerdict:
            self.gate_calls.append((harness, method, params))
            assert gate is not None
            return gate

        turn = Turn(
            thread_id="solo",
            prompt=prompt,
            permissions=permissions,
            config=config or codex_config(self.fake),
            state=state,
            handle=handle,
            emit=self.emit,
            work_folder=str(self.work),
            gate=gate_fn if gate is not None else None,
            store=store if store is not None else self.store,
            interrupted=interrupted,
        )
        result = await asyncio.wait_for(self.harness.run_turn(turn), 60)
        self.wire.check(self.schema)
        return result


def codex_config(fake: FakeResponses) -> dict[str, Any]:
    return {"base_url": fake.base_url, "api_key": "dummy-key", "model": "gpt-5.5"}


async def codex_thread(
    person: Broker, fake: FakeResponses, work: Path, message: str, permissions: str = "approval"
) -> Path:
    """A Codex thread named after its work folder `work` (made here), against `fake`, its
    first message posted."""
    await asyncio.to_thread(work.mkdir)
    await person.sessions.create(
        work.name, "codex", permissions, codex_config(fake), work_folder=str(work)
    )
    await person.post_item(work.name, text(message))
    return work


@pytest.fixture
def fake() -> Iterator[FakeResponses]:
    with FakeResponses() as f:
        yield f


@pytest.fixture
def solo(fake: FakeResponses, tmp_path: Path, schema: Schema) -> Solo:
    work = tmp_path / "work"
    work.mkdir()
    return Solo(fake, work, schema)


# -- the rig: replicas on the real Redis ----------------------------------------------------------


@dataclass
class Running:
    replica: Replica
    broker: Broker
    stop: asyncio.Event
    task: asyncio.Task[None]
    wire: Wire

    @property
    def id(self) -> str:
        return self.replica.id


@dataclass
class Rig:
    url: str
    prefix: str
    fake: FakeResponses
    root: Path
    schema: Schema
    running: list[Running] = field(default_factory=list)
    brokers: list[Broker] = field(default_factory=list)

    async def broker(self, **overrides: Any) -> Broker:
        settings = Settings(key_prefix=self.prefix, **(FAST | overrides))
        b = Broker(Redis.from_url(self.url, decode_responses=True), settings)
        self.brokers.append(b)
        return b

    async def start(self, replica_id: str, **overrides: Any) -> Running:
        b = await self.broker(**overrides)
        wire = Wire()
        replica = Replica(b, harnesses={"codex": CodexHarness(trace=wire)}, replica_id=replica_id)
        stop = asyncio.Event()
        task = asyncio.create_task(replica.run(stop), name=f"replica {replica_id}")
        r = Running(replica, b, stop, task, wire)
        self.running.append(r)
        return r

    async def stop(self, r: Running) -> None:
        """A clean stop (SIGTERM): held waits park, leases are released."""
        r.stop.set()
        await asyncio.wait_for(r.task, 20)

    async def crash(self, r: Running) -> None:
        """As SIGKILL would: everything stops where it is, nothing is released or parked.
        (The harness's Codex process dies with the turn, as it would with its replica.)"""
        rep = r.replica
        r.wire.crashed.update(r.wire.pids())
        rep._stopping = True  # its run() then skips the clean shutdown
        tasks = [*rep._tasks, *(t.task for t in rep.threads.values() if t.task is not None)]
        for task in [*tasks, r.task]:
            task.cancel()
        await asyncio.gather(*tasks, r.task, return_exceptions=True)
        await r.broker.aclose()

    async def thread(
        self,
        thread_id: str,
        message: str,
        person: Broker,
        permissions: str = "approval",
    ) -> Path:
        return await codex_thread(person, self.fake, self.root / thread_id, message, permissions)

    async def aclose(self) -> None:
        for r in self.running:
            r.stop.set()
        for r in self.running:
            if not r.task.done():
                try:
                    await asyncio.wait_for(r.task, 20)
                except Exception:  # a test's own failure is reported by the test
                    r.task.cancel()
        if self.brokers:
            with_client = self.brokers[0]
            await delete_prefix(with_client.redis, self.prefix)
        for b in self.brokers:
            await b.aclose()
        for r in self.running:
            r.wire.check(self.schema)


@pytest.fixture
async def rig(
    real_redis_url: str, prefix: str, fake: FakeResponses, tmp_path: Path, schema: Schema
) -> AsyncIterator[Rig]:
    r = Rig(real_redis_url, prefix, fake, tmp_path, schema)
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture
async def person(rig: Rig) -> Broker:
    return await rig.broker()


# -- helpers --------------------------------------------------------------------------------------


async def until(check: Callable[[], Awaitable[T | None]], what: str, within: float = 30.0) -> T:
    """`tests.helpers.until` with the longer default a real CLI needs."""
    return await helpers.until(check, what, within)


async def held(r: Running) -> None:
    """Until replica `r` holds its thread's wait open (its Codex waits on the answer)."""
    await until(lambda: truthy(r.replica.held_count() == 1), "the held wait")


def structured(*answers: list[str]) -> dict[str, Any]:
    return {
        "content": [{"type": "text", "text": "(structured)"}],
        "metadata": {"answers": [{"answer": a} for a in answers]},
    }


async def session(b: Broker, thread_id: str) -> Session:
    s = await b.sessions.get(thread_id)
    assert s is not None
    return s


async def active(b: Broker, thread_id: str) -> Prompt:
    return await until(lambda: b.active_prompt(thread_id), f"a prompt on {thread_id}")


async def turn_ends(b: Broker, thread_id: str, n: int = 1) -> list[Item]:
    async def check() -> list[Item] | None:
        items = await b.items(thread_id)
        s = await session(b, thread_id)
        return items if len(of_type(items, "turn_end")) >= n and s.status == "idle" else None

    return await until(check, f"{n} turn_end on {thread_id}")


async def status_is(b: Broker, thread_id: str, status: str) -> Session:
    async def check() -> Session | None:
        s = await session(b, thread_id)
        return s if s.status == status else None

    return await until(check, f"{thread_id} to be {status}")


#: What Codex itself says of a call it was told `cancel` / `decline` for, and of the turn it
#: ended: that a person refused or interrupted. The model must never read these from us.
FOREIGN_REFUSALS = (
    "aborted by user",
    "rejected by user",
    "interrupted the previous turn on purpose",
    "aborted",
)


def last_out(req: Any) -> str:
    """The newest tool output the model was given (before or after the newest message)."""
    return next(reversed(req.outputs().values()), "")


def assert_no_foreign_refusal(req: Any) -> None:
    for said in req.texts():
        for words in FOREIGN_REFUSALS:
            assert words not in said, f"the model read {words!r}: {said[:300]!r}"


def bash(command: str) -> str:
    """The command string Codex reports for a shell call (and puts in the grant key)."""
    return f"/bin/bash -lc '{command}'"


QUESTIONS = [
    {
        "id": "color",
        "header": "Color",
        "question": "Which color?",
        "options": [
            {"label": "Red", "description": "warm"},
            {"label": "Blue", "description": "cool"},
        ],
    }
]
TWO_QUESTIONS = [
    *QUESTIONS,
    {
        "id": "size",
        "header": "Size",
        "question": "Which size?",
        "options": [
            {"label": "Small", "description": "cheap"},
            {"label": "Large", "description": "roomy"},
        ],
    },
]


# -- pure mapping, checked against the installed schema -------------------------------------------


def test_every_reply_we_can_send_is_in_the_schema(schema: Schema) -> None:
    """Every payload the harness can build, for every decision, validates; every other server
    request of this protocol gets a refusal in its own vocabulary or a well-formed error."""
    params: dict[str, dict[str, Any]] = {
        COMMAND: {"command": "ls", "availableDecisions": ["accept", "cancel"]},
        FILE_CHANGE: {},
        PERMISSIONS: {"permissions": {"network": {"enabled": True}, "fileSystem": None}},
    }
    for method in APPROVAL_METHODS:
        for decision in ("accept", "session", "decline", "cancel"):
            schema.check_reply(method, approval_payload(method, params[method], decision))
    assert approval_payload(COMMAND, params[COMMAND], "decline") == {"decision": "decline"}
    assert approval_payload(COMMAND, params[COMMAND], "cancel") == {"decision": "cancel"}
    # acceptForSession only where the request offers it
    assert approval_payload(COMMAND, params[COMMAND], "session") == {"decision": "accept"}
    assert approval_payload(FILE_CHANGE, {}, "session") == {"decision": "acceptForSession"}
    assert approval_payload(PERMISSIONS, params[PERMISSIONS], "session") == {
        "permissions": params[PERMISSIONS]["permissions"],
        "scope": "session",
    }
    assert approval_payload(PERMISSIONS, params[PERMISSIONS], "decline") == {
        "permissions": {},
        "scope": "turn",
    }
    ui = {"questions": TWO_QUESTIONS}
    answers = [Answer(question="Which color?", answer=["Red"]), Answer(question="x", answer=[])]
    schema.check_reply(USER_INPUT, answers_payload(ui, answers))
    schema.check_reply(USER_INPUT, answers_payload(ui, []))
    handled = {*APPROVAL_METHODS, USER_INPUT}
    for method in schema.server_methods:
        if method in handled:
            continue
        result, error = other_reply(method)
        if result is not None:
            schema.check_reply(method, result)
        else:
            assert error is not None and isinstance(error["code"], int) and error["message"]
    # the protocol has no other request this harness must put to a person
    assert set(schema.server_methods) - handled == {
        "mcpServer/elicitation/request",
        "item/tool/call",
        "account/chatgptAuthTokens/refresh",
        "attestation/generate",
        "applyPatchApproval",
        "execCommandApproval",
    }
    assert other_reply("no/such/method")[1] is not None


def test_approval_questions_follow_the_reference() -> None:
    """Subject = the method; grant key only for commands; Approve / Deny, plus the session
    option where the request offers it (after Deny, so a typed `2` still means Deny)."""
    q = approval_question(
        COMMAND,
        {"command": bash("make deploy"), "reason": "needs network", "cwd": "/w"},
    )
    assert q.subject == COMMAND
    assert q.grant_key == f"{COMMAND}:{bash('make deploy')}"
    assert q.question.startswith("needs network\n\n`/bin/bash -lc 'make deploy'`")
    assert [o.label for o in q.options] == ["Approve", "Deny", SESSION_LABEL]
    q = approval_question(COMMAND, {"command": "ls", "availableDecisions": ["accept", "cancel"]})
    assert [o.label for o in q.options] == ["Approve", "Deny"]
    assert q.question.startswith("Allow Codex to run this command?")
    q = approval_question(FILE_CHANGE, {}, [{"path": "/w/a.txt", "kind": {"type": "add"}}])
    assert q.grant_key is None and q.subject == FILE_CHANGE
    assert "`/w/a.txt` (add)" in q.question
    q = approval_question(PERMISSIONS, {"permissions": {"network": {"enabled": True}}})
    assert q.grant_key is None
    assert "network access" in q.question
    assert [o.label for o in q.options] == ["Approve", "Deny", SESSION_LABEL]


def test_config_is_checked() -> None:
    assert parse_config({}).approval_policy == "on-request"
    for bad, where in [
        ({"modle": "x"}, "config.modle"),
        ({"base_url": "ftp://x"}, "config.base_url"),
        ({"approval_policy": "never"}, "config.approval_policy"),
        ({"sandbox": "none"}, "config.sandbox"),
        ({"api_key": "a", "api_key_env": "B"}, "config"),
        ({"model": 5}, "config.model"),
    ]:
        with pytest.raises(BadItem) as e:
            parse_config(bad)
        assert e.value.field == where


def test_the_ledger_tells_what_is_known_of_a_call() -> None:
    """`describe` never says "aborted" or "failed" for a call that may have run; the cut-off
    turn is the one a mid-turn state names, else the latest that started from the state."""
    c = "/bin/bash -lc 'make x'"
    said = {
        "ran": describe(
            Call("1", c, "command", asked=True, reply="accept", status="completed", exit=0)
        ),
        "ran, failing": describe(Call("1", c, "command", reply="accept", status="failed", exit=2)),
        "approved, no result": describe(Call("1", c, "command", asked=True, reply="accept")),
        "started unasked": describe(Call("1", c, "command")),
        "no exit code": describe(Call("1", c, "command", reply="accept", status="failed")),
        "waiting": describe(Call("1", c, "command", asked=True)),
        "refused": describe(
            Call("1", c, "command", asked=True, reply="decline", status="declined")
        ),
    }
    assert said["ran"] == f"`{c}` ran, exit code 0"
    assert said["ran, failing"] == f"`{c}` ran, exit code 2"
    unsure = (
        f"`{c}` was interrupted; it may or may not have taken effect; check before running it again"
    )
    assert said["approved, no result"] == said["started unasked"] == said["no exit code"] == unsure
    assert said["waiting"].endswith(
        "did not run: it was still waiting for approval when the turn stopped"
    )
    assert said["refused"] == f"`{c}` did not run: it was refused"
    for words in said.values():
        assert "aborted" not in words and "failed" not in words

    ledger = [
        {"w": "A", "ev": "turn", "from": None},
        {"w": "A", "ev": "call", "id": "c1", "what": c, "kind": "command", "asked": True},
        {"w": "A", "ev": "reply", "id": "c1", "decision": "accept"},
        {"w": "A", "ev": "result", "id": "c1", "status": "completed", "exit": 0},
        {"w": "B", "ev": "turn", "from": "A"},
        {"w": "B", "ev": "call", "id": "c2", "what": "b", "kind": "command", "asked": True},
        "junk",
        {"w": "B", "ev": "reply", "id": "nosuch", "decision": "accept"},
    ]
    assert interrupted_writer(ledger, {"writer": "A", "open": True}) == "A"
    assert interrupted_writer(ledger, {"writer": "A"}) == "B"  # A ended; B started from it
    assert interrupted_writer(ledger, None) == "A"
    assert interrupted_writer(ledger, {"writer": "B"}) is None
    assert [x.id for x in calls_of(ledger, "B").values()] == ["c2"]
    assert calls_of(ledger)["c1"].exit == 0

    call = {"type": "response_item", "payload": {"type": "function_call", "call_id": "c9"}}
    out = {
        "type": "response_item",
        "payload": {"type": "function_call_output", "call_id": "c9", "output": "aborted by user"},
    }
    abort = {
        "type": "response_item",
        "payload": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "<turn_aborted>\nThe user interrupted"}],
        },
    }
    lines = [json.dumps(call)]
    assert dangling_calls(lines) == [("c9", "function_call")]
    added = json.loads(output_line(lines, "c9", "function_call", "ours"))
    assert added["payload"] == {"type": "function_call_output", "call_id": "c9", "output": "ours"}
    assert dangling_calls([*lines, json.dumps(added)]) == []
    assert (
        json.loads(rewrite_line(json.dumps(out), {"c9": "ours"}, None))["payload"]["output"]
        == "ours"
    )
    assert rewrite_line(json.dumps(out), {}, None) == json.dumps(out)
    said_abort = json.loads(rewrite_line(json.dumps(abort), {}, "ended by us"))
    assert said_abort["payload"]["content"] == [{"type": "input_text", "text": "ended by us"}]
    # the harness waits for a call to be written before it asks; an empty id waits for nothing
    assert holds("call_2")(b'{"call_id":"call_2"}') and not holds("call_2")(b"{}")
    assert holds("")(b"")


# -- the harness alone, real CLI ------------------------------------------------------------------


async def test_guarded_gate_decides_before_anyone_is_asked(solo: Solo) -> None:
    """Under guarded, the gate's allow approves and its deny declines, with no prompt; ask goes
    to the person."""
    target = solo.work / "gated.txt"
    cmd = f"echo gated > {target}"
    result = await solo.turn(
        f"run!: {cmd}", Handle(), permissions="guarded", gate=GateVerdict("allow")
    )
    assert result.status == "completed"
    assert target.read_text() == "gated\n"
    assert solo.wire.replies(COMMAND) == [{"decision": "accept"}]
    assert [(h, m) for h, m, _ in solo.gate_calls] == [("codex", COMMAND)]
    assert solo.gate_calls[0][2]["command"] == bash(cmd)

    target.unlink()
    before = len(solo.fake.requests)
    result = await solo.turn(
        f"run!: {cmd}", Handle(), permissions="guarded", gate=GateVerdict("deny", rule="r1")
    )
    assert result.status == "completed"
    assert not target.exists()
    # Codex offers no `decline` for commands: `cancel`, and the model's very next request says
    # who refused, in our words (never Codex's "rejected by user" / "aborted by user")
    assert solo.wire.replies(COMMAND)[-1] == {"decision": "cancel"}
    told = solo.fake.requests[before + 1]
    assert "Denied by policy rule 'r1'" in last_out(told)
    assert "Denied by policy rule 'r1'" in told.user_text and "not by a person" in told.user_text
    assert_no_foreign_refusal(told)

    handle = Handle(["Approve"])
    result = await solo.turn(
        f"run!: {cmd}", handle, permissions="guarded", gate=GateVerdict("ask", rule="r2")
    )
    assert len(handle.asks) == 1 and handle.asks[0][0] == "approval"
    assert target.read_text() == "gated\n"
    # under `approval` a gate is ignored: the person is asked
    handle = Handle(["Deny"])
    before = len(solo.fake.requests)
    await solo.turn(f"run!: {cmd}", handle, permissions="approval", gate=GateVerdict("allow"))
    assert len(handle.asks) == 1
    assert solo.wire.replies(COMMAND)[-1] == {"decision": "cancel"}
    told = solo.fake.requests[before + 1]
    assert last_out(told).startswith("The person denied approval to run")
    assert "The person denied your request" in told.user_text
    assert_no_foreign_refusal(told)


async def test_guarded_asks_for_every_command(solo: Solo) -> None:
    """Under `guarded` Codex runs `untrusted` whatever the thread's config says, so even the
    commands its sandbox would run unasked (a read, a write inside the workspace) reach the
    gate; under `approval` with `on-request` they do not (the gap the guarded mode closes)."""
    (solo.work / "f.txt").write_text("hello\n")
    steps = "run: cat f.txt\nrun: echo hi > g.txt\npatch: p.txt hello"
    config = codex_config(solo.fake) | {"approval_policy": "on-request"}
    result = await solo.turn(
        steps, Handle(), permissions="guarded", gate=GateVerdict("allow"), config=config
    )
    assert result.status == "completed"
    (start,) = solo.wire.sent("thread/start")
    assert start["params"]["approvalPolicy"] == "untrusted"
    assert [(m, p.get("command")) for _, m, p in solo.gate_calls] == [
        (COMMAND, bash("cat f.txt")),
        (COMMAND, bash("echo hi > g.txt")),
        (FILE_CHANGE, None),
    ]
    assert (solo.work / "g.txt").read_text() == "hi\n"
    assert (solo.work / "p.txt").read_text() == "hello\n"

    solo.gate_calls.clear()
    handle = Handle()
    result = await solo.turn(
        steps.replace("g.txt", "h.txt").replace("p.txt", "q.txt"), handle, config=config
    )
    assert result.status == "completed"
    assert handle.asks == [] and solo.gate_calls == []  # ran unseen under on-request
    assert (solo.work / "h.txt").exists() and (solo.work / "q.txt").exists()


async def test_autonomous_never_asks(solo: Solo) -> None:
    target = solo.work / "auto.txt"
    handle = Handle()
    result = await solo.turn(f"run: echo auto > {target}", handle, permissions="autonomous")
    assert result.status == "completed"
    assert target.read_text() == "auto\n"
    assert handle.asks == []
    assert solo.wire.server_requests() == []
    (start,) = solo.wire.sent("thread/start")
    assert start["params"]["approvalPolicy"] == "never"
    assert start["params"]["sandbox"] == "danger-full-access"


async def test_refusals_nobody_made_are_not_denials(solo: Solo) -> None:
    """An undelivered or cancelled prompt answers `cancel` (never `decline`): the command does
    not run, Codex's turn stops, and the agent is told at its next turn that nobody refused."""
    target = solo.work / "never.txt"
    cmd = f"echo x > {target}"
    result = await solo.turn(f"run!: {cmd}", Handle(PromptUnavailable("solo", "redis down")))
    assert result.status == "completed"
    assert not target.exists()
    # `cancel`: Codex offers no `decline` for commands (its availableDecisions)
    (asked,) = [m for _, m in solo.wire.server_requests() if m["method"] == COMMAND]
    assert "decline" not in asked["params"]["availableDecisions"]
    assert solo.wire.replies(COMMAND) == [{"decision": "cancel"}]
    # the model's very next request carries our words, at once: nobody has written since
    assert len(solo.fake.requests) == 2
    told = solo.fake.requests[1]
    for text_ in (last_out(told), told.user_text):
        assert text_.startswith("Approval unavailable: the request for approval to run")
        assert "could not be put to a person (redis down)" in text_
        assert "nobody refused it" in text_
    assert_no_foreign_refusal(told)
    assert result.state is not None and "notes" not in result.state  # told: not told again

    result = await solo.turn("say: ok", Handle(), state=result.state)
    assert "Approval unavailable" not in solo.fake.requests[-1].user_text
    assert_no_foreign_refusal(solo.fake.requests[-1])  # the stored transcript keeps our words

    before = len(solo.fake.requests)
    result = await solo.turn(
        f"run!: {cmd}", Handle(PromptCancelled("prm_x", "superseded")), state=result.state
    )
    assert solo.wire.replies(COMMAND)[-1] == {"decision": "cancel"}
    told = solo.fake.requests[before + 1]
    assert "cancelled (superseded) before anyone answered" in told.user_text
    assert_no_foreign_refusal(told)
    assert not target.exists()


class FailingReplies(MemStore):
    """A store that cannot record an approval (as Redis failing at that moment)."""

    async def append(self, key: str, entries: Sequence[Any]) -> None:
        if any(isinstance(e, dict) and e.get("decision") == "accept" for e in entries):
            raise ConnectionError("redis went away")
        await super().append(key, entries)


async def test_an_approval_that_cannot_be_recorded_is_not_sent(solo: Solo) -> None:
    """An approval is recorded before it is sent (else a replica taking over after a crash
    would report a call that ran as never run). When it cannot be recorded, Codex gets
    `cancel`, the command does not run, and the model is told it was unavailable."""
    solo.store = FailingReplies()
    target = solo.work / "unrecorded.txt"
    result = await solo.turn(f"run!: echo x > {target}", Handle(["Approve"]))
    assert result.status == "completed"
    assert solo.wire.replies(COMMAND) == [{"decision": "cancel"}]
    assert not target.exists()
    told = solo.fake.requests[1]
    assert "could not be put to a person (the approval could not be recorded)" in told.user_text
    assert_no_foreign_refusal(told)


async def test_guarded_never_approves_for_the_session(solo: Solo) -> None:
    """Under `guarded` a person's "Approve for this session" is a one-time `accept`: a
    session-wide approval would let later calls past the gate."""
    handle = Handle([SESSION_LABEL])
    result = await solo.turn(
        "patch: p.txt hello", handle, permissions="guarded", gate=GateVerdict("ask")
    )
    assert result.status == "completed"
    assert [o.label for o in handle.asks[0][1][0].options][-1] == SESSION_LABEL
    assert solo.wire.replies(FILE_CHANGE) == [{"decision": "accept"}]
    assert (solo.work / "p.txt").read_text() == "hello\n"


async def test_questions_nobody_answered_interrupt_the_turn(solo: Solo) -> None:
    """A requestUserInput cannot be refused in its reply: the turn is interrupted, then it is
    answered (well-formed, empty), and the model is never told an answer nobody gave."""
    handle = Handle(PromptUnavailable("solo", "redis down"))
    result = await solo.turn(f"ask: {json.dumps(QUESTIONS)}", handle)
    assert result.status == "completed"
    assert solo.wire.replies(USER_INPUT) == [{"answers": {}}]
    (interrupt,) = solo.wire.sent("turn/interrupt")
    assert interrupt["params"]["threadId"] == result.state["codex_thread"]  # type: ignore[index]
    # the next model call is the follow-up that says why: never an empty answer
    assert len(solo.fake.requests) == 2
    told = solo.fake.requests[1]
    assert last_out(told).startswith("Question unavailable:")
    assert "could not be put to a person (redis down)" in told.user_text
    assert_no_foreign_refusal(told)


async def test_parked_state_resumes_the_same_codex_thread(solo: Solo) -> None:
    """Parked: `cancel`, the turn ends `parked` with the Codex thread in its state (also given
    with the ask); the next turn resumes that thread from the stored rollout alone."""
    target = solo.work / "parked.txt"
    cmd = f"echo parked > {target}"
    parked = PromptParked("prm_1", "approval", COMMAND)
    handle = Handle(parked)
    result = await solo.turn(f"run!: {cmd}", handle)
    assert result.status == "parked" and result.parked is parked
    assert solo.wire.replies(COMMAND) == [{"decision": "cancel"}]
    assert not target.exists()
    state = result.state
    assert state is not None
    asked_state = handle.asks[0][2]
    assert asked_state is not None and asked_state["codex_thread"] == state["codex_thread"]
    assert len(solo.store.data[f"codex:{state['codex_thread']}"]) >= 5

    assert len(solo.fake.requests) == 1  # parked: the turn ends, nobody is told anything yet

    resume = "Your request to use `x` was APPROVED by the person. Retry it now."
    handle = Handle(["Approve"])
    result = await solo.turn(resume, handle, state=state)
    assert result.status == "completed"
    told = solo.fake.requests[1]
    assert next(iter(told.outputs().values()), "").startswith("Approval pending")
    assert_no_foreign_refusal(told)
    assert target.read_text() == "parked\n"
    assert solo.wire.resumed() == state["codex_thread"]
    assert result.state is not None and result.state["codex_thread"] == state["codex_thread"]
    assert handle.asks[0][1][0].grant_key == f"{COMMAND}:{bash(cmd)}"

    # and from the state the ask stored (a replica killed while Codex waited)
    target.unlink()
    result = await solo.turn(resume, Handle(["Approve"]), state=asked_state)
    assert result.status == "completed"
    assert target.read_text() == "parked\n"


# -- end to end: replicas on the real Redis -------------------------------------------------------


async def test_command_approved_runs(rig: Rig, person: Broker) -> None:
    """A command Codex asks to run outside its sandbox: the person approves, it runs."""
    r = await rig.start("r1")
    work = rig.root / "t1"
    cmd = f"echo approved > {work}/approved.txt"
    await rig.thread("t1", f"run!: {cmd}", person)
    p = await active(person, "t1")
    assert p.kind == "approval"
    (q,) = p.questions
    assert q.subject == COMMAND
    assert q.grant_key == f"{COMMAND}:{bash(cmd)}"
    assert f"`{bash(cmd)}`" in q.question
    # Codex 0.171.0 offers no acceptForSession for commands (availableDecisions), so no
    # session option
    assert [o.label for o in q.options] == ["Approve", "Deny"]
    assert not (work / "approved.txt").exists()
    await held(r)

    await person.post_item("t1", text("yes"))
    items = await turn_ends(person, "t1")
    assert (work / "approved.txt").read_text() == "approved\n"
    assert r.wire.replies(COMMAND) == [{"decision": "accept"}]
    (out,) = outputs(items)
    assert out.startswith("done:") and "exited with code 0" in out
    assert of_type(items, "turn_end")[0].metadata["status"] == "completed"


async def test_command_declined_is_not_run(rig: Rig, person: Broker) -> None:
    r = await rig.start("r1")
    work = rig.root / "t1"
    await rig.thread("t1", f"run!: echo no > {work}/declined.txt", person)
    await active(person, "t1")
    await person.post_item("t1", text("no, not now"))
    items = await turn_ends(person, "t1")
    assert not (work / "declined.txt").exists()
    # no `decline` is offered for commands: `cancel`, and the model is told at once who refused
    assert r.wire.replies(COMMAND) == [{"decision": "cancel"}]
    told = rig.fake.requests[-1]
    assert last_out(told).startswith("The person denied approval to run")
    assert told.user_text.startswith("The person denied your request")
    assert_no_foreign_refusal(told)
    assert outputs(items) == ["understood, not retrying"]


async def test_command_cancelled_when_the_run_ends(rig: Rig, person: Broker) -> None:
    """The prompt is cancelled (the run ending): `cancel`, the command never runs, Codex's turn
    is interrupted, and nobody is said to have refused."""
    r = await rig.start("r1")
    work = rig.root / "t1"
    await rig.thread("t1", f"run!: echo no > {work}/cancelled.txt", person)
    p = await active(person, "t1")
    await held(r)
    await person.cancel("t1", "run ended")
    await turn_ends(person, "t1")
    assert (await person.get_prompt("t1", p.prompt_id)).state == "cancelled"
    assert not (work / "cancelled.txt").exists()
    assert r.wire.replies(COMMAND) == [{"decision": "cancel"}]
    # the model's next request (the follow-up turn, at once) says so, in our words
    assert len(rig.fake.requests) == 2
    told = rig.fake.requests[1]
    assert "cancelled (run ended) before anyone answered" in told.user_text
    assert "nobody refused it" in last_out(told)
    assert_no_foreign_refusal(told)


async def test_file_change_approved_for_the_session(rig: Rig, person: Broker) -> None:
    """A patch into `.codex/` (read-only under workspace-write) asks a file-change approval,
    naming the file; the structured `Approve for this session` answers `acceptForSession`."""
    r = await rig.start("r1")
    work = rig.root / "t1"
    await rig.thread("t1", "patch: .codex/notes.txt hello from codex", person)
    p = await active(person, "t1")
    (q,) = p.questions
    assert q.subject == FILE_CHANGE and q.grant_key is None
    assert f"`{work}/.codex/notes.txt` (add)" in q.question
    assert [o.label for o in q.options] == ["Approve", "Deny", SESSION_LABEL]
    await person.post_item("t1", structured([SESSION_LABEL]))
    items = await turn_ends(person, "t1")
    assert (work / ".codex" / "notes.txt").read_text() == "hello from codex\n"
    assert r.wire.replies(FILE_CHANGE) == [{"decision": "acceptForSession"}]
    assert "Success" in outputs(items)[0]


async def test_file_change_declined(rig: Rig, person: Broker) -> None:
    r = await rig.start("r1")
    work = rig.root / "t1"
    await rig.thread("t1", "patch: .codex/notes.txt nope", person)
    await active(person, "t1")
    await person.post_item("t1", text("2"))  # option 2: Deny
    await turn_ends(person, "t1")
    assert not (work / ".codex" / "notes.txt").exists()
    assert r.wire.replies(FILE_CHANGE) == [{"decision": "decline"}]
    assert "rejected" in (rig.fake.requests[-1].last_output or "")


async def test_permissions_request(rig: Rig, person: Broker) -> None:
    """`request_permissions`: approved for the turn, the requested profile is granted."""
    r = await rig.start("r1")
    ask = {"permissions": {"network": {"enabled": True}}, "reason": "fetch the docs"}
    await rig.thread("t1", f"perm: {json.dumps(ask)}", person)
    p = await active(person, "t1")
    (q,) = p.questions
    assert q.subject == PERMISSIONS and q.grant_key is None
    assert q.question.startswith("fetch the docs") and "network access" in q.question
    await person.post_item("t1", text("approve"))
    await turn_ends(person, "t1")
    (reply,) = r.wire.replies(PERMISSIONS)
    assert reply["scope"] == "turn" and reply["permissions"]["network"] == {"enabled": True}


async def test_user_input_answered_by_text(rig: Rig, person: Broker) -> None:
    r = await rig.start("r1")
    await rig.thread("t1", f"ask: {json.dumps(QUESTIONS)}", person)
    p = await active(person, "t1")
    assert p.kind == "ask_user_question"
    (q,) = p.questions
    assert q.question == "Which color?" and q.header == "Color"
    assert [(o.label, o.description) for o in q.options] == [("Red", "warm"), ("Blue", "cool")]
    await person.post_item("t1", text("2"))
    items = await turn_ends(person, "t1")
    assert r.wire.replies(USER_INPUT) == [{"answers": {"color": {"answers": ["Blue"]}}}]
    assert outputs(items) == ['done: {"answers":{"color":{"answers":["Blue"]}}}']


async def test_user_input_answered_by_structured_answers(rig: Rig, person: Broker) -> None:
    """Two questions, answered with structured answers (one an "Other" free text)."""
    r = await rig.start("r1")
    await rig.thread("t1", f"ask: {json.dumps(TWO_QUESTIONS)}", person)
    p = await active(person, "t1")
    assert [q.question for q in p.questions] == ["Which color?", "Which size?"]
    routed = await person.post_item("t1", structured(["Red"], ["Medium, please"]))
    assert routed.source == "structured"
    await turn_ends(person, "t1")
    assert r.wire.replies(USER_INPUT) == [
        {"answers": {"color": {"answers": ["Red"]}, "size": {"answers": ["Medium, please"]}}}
    ]


async def test_guarded_policy_on_a_replica(rig: Rig, person: Broker) -> None:
    """Guarded, through the replica's policy gate: an allowed command runs with no prompt, a
    denied one is declined (and a `policy_denied` item names the rule), an `ask` reaches the
    person as an ordinary approval."""
    r = await rig.start("r1")
    work = rig.root / "t1"
    work.mkdir()
    policy = {
        "default": "ask",
        "rules": [
            {"id": "echo-ok", "effect": "exec", "action": "allow", "command": ["echo allowed*"]},
            {"id": "no-rm", "effect": "exec", "action": "deny", "command": ["rm *"]},
        ],
    }
    await person.sessions.create(
        "t1", "codex", "guarded", codex_config(rig.fake), str(work), policy=policy
    )
    (work / "keep.txt").write_text("kept\n")
    steps = ["run: echo allowed", f"run: rm -f {work}/keep.txt"]
    await person.post_item("t1", text("\n".join(steps)))
    items = await turn_ends(person, "t1")
    assert "allowed" in rig.fake.requests[1].last_output  # type: ignore[operator]
    (denied,) = of_type(items, "policy_denied")
    assert denied.metadata["rule"] == "no-rm"
    told = rig.fake.requests[-1]  # the rm refused: the model hears the rule at once
    assert "Denied by policy rule 'no-rm'" in told.user_text
    assert_no_foreign_refusal(told)

    await person.post_item("t1", text(f"run: touch {work}/asked.txt"))
    p = await active(person, "t1")
    assert p.kind == "approval"
    assert p.questions[0].grant_key == f"{COMMAND}:{bash(f'touch {work}/asked.txt')}"
    await person.post_item("t1", text("yes"))
    items = await turn_ends(person, "t1", 2)
    assert (work / "asked.txt").exists()
    assert (work / "keep.txt").exists()  # the rm was refused
    assert r.wire.replies(COMMAND) == [
        {"decision": "accept"},
        {"decision": "cancel"},
        {"decision": "accept"},
    ]
    assert len(of_type(items, "pending_prompt")) == 1


async def waiting_on_approval(
    rig: Rig, person: Broker, replica_id: str, **overrides: Any
) -> tuple[Running, Path, Prompt]:
    """Replica `replica_id` runs t1, whose Codex waits (held) on the approval of a command that
    writes `resumed.txt`: the replica, t1's work folder and the prompt."""
    a = await rig.start(replica_id, **overrides)
    work = rig.root / "t1"
    cmd = f"echo resumed > {work}/resumed.txt"
    await rig.thread("t1", f"run!: {cmd}", person)
    p = await active(person, "t1")
    await held(a)
    return a, work, p


async def _resumed_elsewhere(person: Broker, a: Running, b: Running, work: Path, p: Prompt) -> None:
    """The answer lands after `a` is gone: `b` resumes the same Codex thread, the agent retries,
    the one-shot grant answers the retried approval, and the command runs."""
    codex_thread = (await session(person, "t1")).state["codex_thread"]  # type: ignore[index]
    (start,) = [m for m in a.wire.messages("recv") if "thread" in (m.get("result") or {})]
    assert start["result"]["thread"]["id"] == codex_thread
    await person.post_item("t1", text("yes"))
    items = await turn_ends(person, "t1")
    assert (work / "resumed.txt").read_text() == "resumed\n"
    assert b.wire.resumed() == codex_thread
    assert b.wire.replies(COMMAND) == [{"decision": "accept"}]  # the retry, through the grant
    assert len(of_type(items, "pending_prompt")) == 1  # nobody was asked twice
    (granted,) = of_type(items, "approval_granted")
    assert granted.metadata["granted_by"] == p.prompt_id
    assert granted.metadata["subject"] == COMMAND
    assert (await person.get_prompt("t1", p.prompt_id)).state == "answered"
    s = await session(person, "t1")
    assert s.owner == b.id and s.grant is None
    assert s.state is not None and s.state["codex_thread"] == codex_thread
    assert "exited with code 0" in outputs(items)[-1]


async def test_replica_killed_while_codex_waits(rig: Rig, person: Broker) -> None:
    """Replica A dies (as SIGKILL: nothing released) while Codex waits on an approval; B adopts
    the open prompt; the answer, given afterwards, resumes the same Codex thread on B."""
    a, work, p = await waiting_on_approval(rig, person, "ra")
    (pid,) = a.wire.pids()
    await rig.crash(a)
    assert not _alive(pid), "the waiting Codex process outlived its replica"
    ((_, request),) = a.wire.server_requests()
    assert request["method"] == COMMAND
    assert a.wire.reply_to(pid, request["id"]) is None  # it died waiting: nothing was answered

    b = await rig.start("rb")

    async def adopted() -> Session | None:
        s = await session(person, "t1")
        return s if s.owner == "rb" and s.status == "parked" else None

    await until(adopted, "rb to adopt the waiting thread")
    assert (await person.get_prompt("t1", p.prompt_id)).state == "pending"
    await _resumed_elsewhere(person, a, b, work, p)


async def test_replica_stopped_while_codex_waits(rig: Rig, person: Broker) -> None:
    """A clean stop parks the held wait (`cancel` to Codex, nobody refused) and releases the
    thread; B adopts it at once and the later answer resumes the same Codex thread there."""
    a, work, p = await waiting_on_approval(rig, person, "ra", lease_ttl=5.0)
    await rig.stop(a)
    assert a.wire.replies(COMMAND) == [{"decision": "cancel"}]
    s = await session(person, "t1")
    assert s.status == "parked" and s.owner == ""
    assert of_type(await person.items("t1"), "turn_end") == []

    b = await rig.start("rb", lease_ttl=5.0)
    await until(lambda: _owner_is(person, "t1", "rb"), "rb to adopt t1", within=5)
    await _resumed_elsewhere(person, a, b, work, p)


async def test_parked_question_resumes_the_codex_thread(rig: Rig, person: Broker) -> None:
    """Parked waits: a requestUserInput parks at once (the turn is interrupted); the answer
    resumes the same Codex thread with the person's answer as its input."""
    r = await rig.start("r1", wait_mode="parked")
    await rig.thread("t1", f"ask: {json.dumps(QUESTIONS)}", person)
    await status_is(person, "t1", "parked")
    p = await active(person, "t1")
    s = await session(person, "t1")
    assert s.state is not None
    codex_thread = s.state["codex_thread"]
    assert r.wire.replies(USER_INPUT) == [{"answers": {}}]
    assert len(r.wire.sent("turn/interrupt")) == 1
    await person.post_item("t1", text("red"))
    items = await turn_ends(person, "t1")
    assert r.wire.resumed() == codex_thread
    assert outputs(items) == ["noted: The person answered:\n- Which color?: Red"]
    assert (await person.get_prompt("t1", p.prompt_id)).state == "answered"


async def test_a_later_message_continues_the_same_codex_thread(rig: Rig, person: Broker) -> None:
    r = await rig.start("r1")
    await rig.thread("t1", "say: first", person)
    items = await turn_ends(person, "t1")
    assert outputs(items) == ["first"]
    codex_thread = (await session(person, "t1")).state["codex_thread"]  # type: ignore[index]
    await person.post_item("t1", text("say: second"))
    items = await turn_ends(person, "t1", 2)
    assert outputs(items) == ["first", "second"]
    assert r.wire.resumed() == codex_thread
    # the model saw the first exchange again: the history came back from Redis
    assert rig.fake.requests[-1].history == ["say: first", "say: second"]


async def test_replica_process_sigkilled_while_codex_waits(
    redis_server_factory: Callable[..., RedisServer], fake: FakeResponses, tmp_path: Path
) -> None:
    """Real replica processes (`prompt-broker worker`, the default harnesses): the one whose
    Codex waits on an approval is SIGKILLed. Its Codex process exits with it (its stdin
    closes); the other replica adopts the prompt, and the answer given afterwards resumes the
    same Codex thread there (the model sees the first request again), the retry answered by
    the grant. The dead replica's CODEX_HOME is swept by the survivor."""
    work = tmp_path / "t1"
    cmd = f"echo resumed > {work}/resumed.txt"
    async with two_replicas(redis_server_factory(), "pp", tmp_path / "logs") as (fleet, person):
        await codex_thread(person, fake, work, f"run!: {cmd}")
        p = await active(person, "t1")
        owner, replica_pid = await holder(fleet, person)
        (codex_pid,) = await until(lambda: _children_named(replica_pid, "codex"), "codex")
        (home,) = await asyncio.to_thread(_homes_of, replica_pid)
        fleet.kill(owner)
        await until(lambda: truthy(not _alive(codex_pid)), "Codex to exit with its replica", 10)

        async def adopted() -> Session | None:
            s = await session(person, "t1")
            return s if s.owner not in ("", owner) and s.status == "parked" else None

        s = await until(adopted, "the other replica to adopt t1")
        await person.post_item("t1", text("yes"))
        items = await turn_ends(person, "t1")
        assert (work / "resumed.txt").read_text() == "resumed\n"
        assert len(of_type(items, "pending_prompt")) == 1
        assert len(of_type(items, "approval_granted")) == 1
        assert (await person.get_prompt("t1", p.prompt_id)).state == "answered"
        last = fake.requests[-1]
        assert last.history[0] == f"run!: {cmd}" and "APPROVED" in last.history[-1]
        assert (await session(person, "t1")).owner == s.owner
        assert not home.exists(), "the dead replica's CODEX_HOME was left behind"


@contextlib.asynccontextmanager
async def two_replicas(
    server: RedisServer, key_prefix: str, logs: Path
) -> AsyncIterator[tuple[Fleet, Broker]]:
    """Two real replica processes (`prompt-broker worker`, the default harnesses, lease TTL
    3 s) on `server`, and a person's broker; their logs are printed when the test fails.

    3 s, not 2: under the whole suite one run saw the adopting replica's own record expire
    (no beat got through for 2 s while it resumed the Codex turn), and it dropped the thread
    before the approved command ran."""
    settings = Settings(redis_url=server.url, key_prefix=key_prefix, **(FAST | {"lease_ttl": 3.0}))
    fleet = Fleet(settings, workers=2, restart=False, log_dir=logs)
    person = Broker(Redis.from_url(server.url, decode_responses=True), settings)
    try:
        await fleet.start()
        await fleet.ready()
        yield fleet, person
    except BaseException:
        _print_logs(logs)
        raise
    finally:
        await fleet.stop()
        await person.aclose()


def _print_logs(logs: Path) -> None:
    for log in sorted(logs.glob("*.log")):
        print(f"===== {log.name}\n{log.read_text(errors='replace')[-4000:]}")


async def holder(fleet: Fleet, person: Broker, thread_id: str = "t1") -> tuple[str, int]:
    """The replica holding `thread_id`, and its process id."""
    owner = (await session(person, thread_id)).owner
    return owner, fleet.replica(owner).proc.pid  # type: ignore[union-attr]


# -- a turn cut off by SIGKILL: the truth about the call in flight ------------------------------


@pytest.mark.parametrize("moment", ["during", "after"])
async def test_sigkilled_turn_leaves_the_truth_about_its_call(  # noqa: PLR0917 - fixtures
    moment: str,
    real_redis_url: str,
    prefix: str,
    fake: FakeResponses,
    tmp_path: Path,
    schema: Schema,
) -> None:
    """A stand-in replica process (tests/agents/codex_crash_child.py: one Codex turn, its store and
    question state in Redis) is SIGKILLed while an approved `echo RAN >> marker; sleep N` runs
    (`during`), or after it finished while the model's next reply is pending (`after`).

    Nothing it started is alive 1 s later (Codex reads EOF on its stdin, the pipe from the dead
    process, and ends its command's process group). `describe_interruption` then says what is
    known: "was interrupted; it may or may not have taken effect" / "ran, exit code 0", never
    "aborted". The next turn, given that `Interruption`, resumes a transcript in which the call
    carries that truth (not Codex's "aborted"), the model is told first, and nothing runs
    again: the marker holds one line."""
    from tests.agents.codex_crash_child import RedisStore

    work = tmp_path / "work"
    work.mkdir()
    marker = work / "marker"
    cmd = f"echo RAN >> {marker}; sleep {8 if moment == 'during' else 1}"
    if moment == "after":  # the model's reply to the command's output never comes in time
        fake.delay = lambda req: 60.0 if req.step == 1 else 0.0
    redis = Redis.from_url(real_redis_url, decode_responses=True)
    try:
        await _kill_mid_turn(real_redis_url, prefix, fake, work, f"run!: {cmd}", moment=moment)
        store = RedisStore(redis, prefix)
        state = json.loads(await redis.get(f"{prefix}:state") or "null")
        assert state is not None and state.get("open") is True
        note = await CodexHarness().describe_interruption("crash", state, store)
        assert note == expected_note(moment, cmd)
        assert "aborted" not in note and "failed" not in note

        fake.delay = None
        before = len(fake.requests)
        solo = Solo(fake, work, schema)
        result = await solo.turn(
            "say: carrying on",
            Handle(),  # asks nobody: nothing is run again
            state=state,
            store=store,
            interrupted=Interruption(note=note),
        )
        assert result.status == "completed", result.error
        check_told(fake.requests[before], note, moment)  # what the model receives next
        assert solo.emitted == ["carrying on"]
        await asyncio.sleep(0.5)  # a negative window: the command is not run a second time
        assert marker.read_text() == "RAN\n"  # ran once, never again
    finally:
        await delete_prefix(redis, prefix)
        await redis.aclose()


async def _sigkill_replica(fleet: Fleet, name: str, pid: int) -> None:
    """SIGKILL a replica process; nothing it started may be alive 1 s later."""
    started = await asyncio.to_thread(_descendants, pid)
    assert any(comm == "codex" for _, comm in started), started
    fleet.kill(name)
    await asyncio.sleep(1.0)
    alive = [(child, comm) for child, comm in started if _alive(child)]
    assert alive == [], f"still alive 1 s after the replica's SIGKILL: {alive}"


def expected_note(moment: str, cmd: str) -> str:
    """What is known of `cmd` after a crash `during` it or `after` it finished."""
    if moment == "during":
        return (
            f"`{bash(cmd)}` was interrupted; it may or may not have taken effect;"
            " check before running it again"
        )
    return f"`{bash(cmd)}` ran, exit code 0"


def check_told(told: Any, note: str, moment: str) -> None:
    """The first model request after a crash: told first, the call's truth as its output."""
    assert told.user_text.startswith("Your previous turn was cut off before it ended")
    assert note in told.user_text
    (output,) = told.outputs().values()
    if moment == "during":
        assert output == note + "."
    else:
        assert "Process exited with code 0" in output
    assert_no_foreign_refusal(told)


async def _kill_mid_turn(
    url: str, prefix: str, fake: FakeResponses, work: Path, prompt: str, *, moment: str
) -> None:
    """Start the stand-in replica, SIGKILL it at `moment`, and check that nothing it started
    is alive 1 s later."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.agents.codex_crash_child",
        url,
        prefix,
        fake.base_url,
        str(work),
        prompt,
        stdout=asyncio.subprocess.PIPE,
        cwd=str(REPO),
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line.startswith(b"spawn "), line
        if moment == "during":
            await until(lambda: truthy((work / "marker").exists()), "the command to start")
        else:
            await until(lambda: truthy(len(fake.requests) == 2), "the model call after it")
        started = await asyncio.to_thread(_descendants, child.pid)
        assert any(comm == "codex" for _, comm in started)
        if moment == "during":
            assert any(comm == "sleep" for _, comm in started), started
        child.kill()  # SIGKILL: nothing is released, nothing is said to Codex
        await child.wait()
        await asyncio.sleep(1.0)  # the window is the requirement: nothing alive 1 s after the kill
        alive = [(pid, comm) for pid, comm in started if _alive(pid)]
        assert alive == [], f"still alive 1 s after the SIGKILL: {alive}"
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


@pytest.mark.parametrize("moment", ["during", "after"])
async def test_replica_sigkilled_during_an_approved_command(
    moment: str,
    redis_server_factory: Callable[..., RedisServer],
    fake: FakeResponses,
    tmp_path: Path,
) -> None:
    """End to end: two real replica processes, lease TTL 2 s, the real CLI. A person approves
    `echo RAN >> marker; sleep 8`; the replica holding the thread is SIGKILLed while it runs
    (`during`), or after it finished while the model's next reply is pending (`after`).

    Nothing that replica started is alive 1 s later. The other replica adopts the thread and
    posts one item saying what is known of the call; the person's next message starts a turn
    whose first model request tells the same, with the call's real output (`after`) or our
    words for it (`during`), never "aborted". The command ran once."""
    work = tmp_path / "t1"
    marker = work / "marker"
    cmd = f"echo RAN >> {marker}; sleep 8"
    if moment == "after":  # the model's reply to the command's output is held back
        fake.delay = lambda req: 30.0 if req.step == 1 and req.user_text.startswith("run!") else 0
    async with two_replicas(redis_server_factory(), "pk", tmp_path / "logs") as (fleet, person):
        await codex_thread(person, fake, work, f"run!: {cmd}")
        await active(person, "t1")
        owner, replica_pid = await holder(fleet, person)
        await person.post_item("t1", text("yes"))
        if moment == "during":
            await until(lambda: truthy(marker.exists()), "the approved command to start")
        else:
            await until(lambda: truthy(any(r.step == 1 for r in fake.requests)), "its output")
        await _sigkill_replica(fleet, owner, replica_pid)

        async def told_item() -> Item | None:
            items = await person.items("t1")
            return next((i for i in items if i.metadata.get("interrupted")), None)

        item = await until(told_item, "the interruption item", within=20)
        note = item.metadata["interrupted"]["note"]
        assert note == expected_note(moment, cmd)
        assert note in item.text and "aborted" not in item.text and "failed" not in item.text
        s = await session(person, "t1")
        assert s.owner not in ("", owner)

        before = len(fake.requests)
        await person.post_item("t1", text("say: carrying on"))
        await turn_ends(person, "t1")
        told = fake.requests[before]  # what the model receives next
        check_told(told, note, moment)
        assert "the person approved" in told.user_text  # the answer it had been handed
        assert told.user_text.endswith("say: carrying on")
        await asyncio.sleep(1.0 if moment == "after" else 8.0)  # a rerun would show by now
        assert marker.read_text() == "RAN\n"


# -- small helpers --------------------------------------------------------------------------------


async def _owner_is(b: Broker, thread_id: str, owner: str) -> bool:
    return (await session(b, thread_id)).owner == owner


async def _children_named(pid: int, name: str) -> list[int]:
    return await asyncio.to_thread(_children_named_now, pid, name)


def _homes_of(pid: int) -> list[Path]:
    """The per-turn CODEX_HOMEs that process `pid` made (see `workers.agents.codex.sweep_homes`)."""
    owners = Path(tempfile.gettempdir()).glob("pb-codex-*/owner.pid")
    return [h.parent for h in owners if h.read_text() == str(pid)]


def _children_named_now(pid: int, name: str) -> list[int]:
    """The live child processes of `pid` whose command name is `name` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            try:
                comm = Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:
                continue
            if comm == name:
                found.append(int(child))
    return found


def _descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of `pid` (Linux /proc), as `(pid, command name)`."""
    found: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                children = task.read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    comm = Path(f"/proc/{child}/comm").read_text().strip()
                except OSError:
                    continue
                found.append((child, comm))
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
