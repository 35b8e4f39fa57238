"""`prompt-broker demo --harness claude_code|codex`: the demo's scenario on the real agent CLIs.

The rigs here build their cases once (`_AgentRig.cases`), each harness scripting only its model's
side; what every rig shares, `Case` and the `Rig` interface, is in `workers.demo.rig`, and
`workers.demo.scenario` (the scenario, and the scripted rig) imports this module, never the other
way round.

The model is a fake, served by the demo's own process on 127.0.0.1 (a free port): the Anthropic
Messages API for Claude Code (`workers.demo.fakes.anthropic`, a script per thread, found by the
thread name in its first message), the Responses API for Codex (`workers.demo.fakes.responses`,
whose script is the person's first message). Each thread's harness config points `base_url` at it,
so nothing leaves the machine. The replicas are separate processes and find the CLI themselves:
Claude Code bundled in claude-agent-sdk (the `claude` extra of this interpreter's environment),
Codex in the repository's node_modules (`npm ci`) or `$CODEX_BIN`
(`workers.agents.codex.find_codex`).

Every thread gets a work folder under one temporary folder, which is also the replicas' TMPDIR (so
the CLIs' scratch folders, and whatever the killed replica leaves behind, land there); it is
removed at the end. The threads:

- `approve`: a shell command writing a file, approved by text: it runs, the file is there.
- `deny`: a command deleting a file, denied by text: it never runs, the file is still there.
- `ask`: Claude Code's AskUserQuestion (a single- and a multi-select question) / Codex's
  `item/tool/requestUserInput` (two questions, one answered with free text), answered with
  structured answers; the agent repeats what it was told.
- `adopt1`..`adopt3`: commands approved, denied, approved. The replica holding most of them is
  SIGKILLed while their CLIs wait on the held approvals; they are answered while it is dead,
  adopted by the other replicas and resumed there in the same Claude session / Codex thread; the
  approved calls run (the one-shot grant answers the retry: nobody is asked twice), the denied
  one does not.

Every script also works when its thread happens to be on the killed replica (the retry after a
resume), so the same outcome is expected wherever a thread was held. Besides the scripted demo's
checks, `evidence` checks what the fake model saw: each conversation continued as one, and a
resumed one carried its history and the person's answer.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.agents.codex import PINNED_VERSION, find_codex
from workers.demo.fakes.anthropic import (
    Block,
    FakeAnthropic,
    Reply,
    Script,
    first_user_text,
    last_user_text,
    text,
    tool_results_in,
    tool_use,
)
from workers.demo.fakes.responses import FakeResponses
from workers.demo.rig import Case, Effect, Expected, Rig

__all__ = ["ClaudeRig", "CodexRig", "agent_rig", "missing_cli"]

#: Seconds to wait for one agent step: a real CLI takes seconds to start on a loaded machine.
PATIENCE = 120.0

TARGET = "Where should it deploy?"
SECTIONS = "Which sections?"
NAME = "What should the dashboard be called?"
CLAUDE_QUESTIONS = [
    {
        "question": TARGET,
        "header": "Target",
        "multiSelect": False,
        "options": [
            {"label": "staging", "description": "push to staging.example.com"},
            {"label": "production", "description": "push to www.example.com"},
        ],
    },
    {
        "question": SECTIONS,
        "header": "Sections",
        "multiSelect": True,
        "options": [
            {"label": "KPI cards", "description": "the headline numbers"},
            {"label": "Table", "description": "every row"},
            {"label": "Chart", "description": "the trend"},
        ],
    },
]
CODEX_QUESTIONS = [
    {
        "id": "target",
        "header": "Target",
        "question": TARGET,
        "options": [
            {"label": "staging", "description": "push to staging.example.com"},
            {"label": "production", "description": "push to www.example.com"},
        ],
    },
    {
        "id": "name",
        "header": "Name",
        "question": NAME,
        "options": [
            {"label": "Ops board", "description": "for the on-call team"},
            {"label": "Revenue wall", "description": "for the sales floor"},
        ],
    },
]


def _bundled_claude() -> str | None:
    """The Claude Code CLI the replicas' claude-agent-sdk will run (bundled, else on PATH)."""
    spec = importlib.util.find_spec("claude_agent_sdk")
    if spec is None or spec.origin is None:
        return None
    bundled = Path(spec.origin).parent / "_bundled" / "claude"
    return str(bundled) if bundled.is_file() else shutil.which("claude")


def missing_cli(harness: str) -> str | None:
    """Why the demo cannot run `harness`'s real CLI here, with how to install it; None if it can."""
    if harness == "claude_code":
        if importlib.util.find_spec("claude_agent_sdk") is None:
            return (
                "--harness claude_code: Claude Code is not installed (claude-agent-sdk bundles "
                "it): pip install -e '.[claude]'"
            )
        if _bundled_claude() is None:
            return (
                "--harness claude_code: claude-agent-sdk bundles no Claude Code CLI for this "
                "platform and there is no `claude` on PATH: pip install -e '.[claude]' on a "
                "supported platform"
            )
    if harness == "codex" and find_codex() is None:
        return (
            "--harness codex: the Codex CLI is not installed: run `npm ci` at the repository root "
            f"(package.json pins @openai/codex {PINNED_VERSION}), or set CODEX_BIN"
        )
    return None


def _say(words: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": words}]}


def _structured(words: str, *answers: tuple[str, list[str]]) -> dict[str, Any]:
    return {
        "content": [{"type": "text", "text": words}],
        "metadata": {"answers": [{"question": q, "answer": a} for q, a in answers]},
    }


def _written(path: Path, content: str) -> Effect:
    return (
        f"{path.name} was written by the approved command",
        lambda: path.is_file() and path.read_text() == content,
    )


def _never_written(path: Path) -> Effect:
    return (
        f"{path.name} was never written: the denied command did not run",
        lambda: not path.exists(),
    )


def _kept(path: Path) -> Effect:
    return (f"{path.name} is still there: the denied command did not run", path.exists)


class _AgentRig(Rig):
    """What both real-agent rigs share: the temporary folder, the work folders, the fake."""

    patience = PATIENCE

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="pb-demo-"))
        scratch = self.root / "tmp"
        scratch.mkdir()
        self.env["TMPDIR"] = str(scratch)

    def work(self, thread: str) -> Path:
        folder = self.root / "work" / thread
        folder.mkdir(parents=True)
        return folder

    def stop_fake(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop_fake()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- what a harness scripts: its model's side of each kind of thread ----------------------

    def approval(
        self, thread: str, command: str, description: str, done: str, refused: str
    ) -> tuple[str, Expected, Expected]:
        """Script `thread`'s agent to run `command` (a shell call that asks an approval): the
        person's first message, and what its output says once the command ran (`done`, in a
        script that can say it) and once it was denied (`refused`)."""
        raise NotImplementedError

    def question(self, thread: str) -> tuple[str, dict[str, Any], list[Expected]]:
        """Script `thread`'s agent to ask the person its questions: the first message, the
        person's structured answer, and what the agent's output says with it."""
        raise NotImplementedError

    def harness_config(self) -> dict[str, Any]:
        """A thread's harness config: the fake model's address and an offline key."""
        raise NotImplementedError

    # -- the cases, the same for every harness --------------------------------------------------

    def _case(
        self,
        thread: str,
        message: str,
        answers: list[dict[str, Any]],
        *,
        expect: list[Expected],
        work: Path,
        effects: list[Effect],
        victim: bool = False,
    ) -> Case:
        return Case(
            thread,
            [],
            answers,
            expect,
            victim=victim,
            message=message,
            config=self.harness_config(),
            work_folder=str(work),
            effects=effects,
        )

    def cases(self, tag: str) -> list[Case]:
        out = []
        thread = f"{tag}-approve"
        work = self.work(thread)
        command = f"echo deployed > {work}/deployed.txt"
        done = "Deployed: deployed.txt is written."
        message, ran, _ = self.approval(thread, command, "Deploy", done, "Not deployed: refused.")
        effects = [_written(work / "deployed.txt", "deployed\n")]
        out.append(
            self._case(thread, message, [_say("yes")], expect=[ran], work=work, effects=effects)
        )

        thread = f"{tag}-deny"
        work = self.work(thread)
        (work / "data.db").write_text("precious\n")
        command = f"rm -f {work}/data.db"
        message, _, refused = self.approval(
            thread, command, "Delete the data", "data.db is deleted.", "Understood: data.db stays."
        )
        answers = [_say("no, that is the only copy")]
        effects = [_kept(work / "data.db")]
        out.append(
            self._case(thread, message, answers, expect=[refused], work=work, effects=effects)
        )

        thread = f"{tag}-ask"
        work = self.work(thread)
        message, answer, expect = self.question(thread)
        out.append(self._case(thread, message, [answer], expect=expect, work=work, effects=[]))

        for i in range(1, 4):
            approve = i != 2
            thread = f"{tag}-adopt{i}"
            work = self.work(thread)
            path = work / f"migrated-{i}.txt"
            command = f"echo migrated {i} > {path}"
            done, skipped = f"Migration {i} ran.", f"Migration {i} skipped."
            message, ran, refused = self.approval(thread, command, f"Migrate {i}", done, skipped)
            answers = [_say("approve" if approve else "deny")]
            effect = _written(path, f"migrated {i}\n") if approve else _never_written(path)
            out.append(
                self._case(
                    thread,
                    message,
                    answers,
                    expect=[ran if approve else refused],
                    work=work,
                    effects=[effect],
                    victim=True,
                )
            )
        return out


# -- Claude Code ---------------------------------------------------------------------------------


def _last_result(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest tool_result of the conversation's last message (empty if it has none)."""
    results = list(tool_results_in(messages[-1:]).values())
    return results[-1] if results else {}


def _claude_approval(command: str, description: str, done: str, refused: str) -> list[Reply]:
    """The model: one Bash call, then `done` once it ran or `refused` once it was denied. Told
    APPROVED by a resume (its replica died waiting) or `Approval unavailable` (the wait parked),
    it makes the call again, and the replica's one-shot grant answers."""
    call = tool_use("Bash", {"command": command, "description": description})

    def then(messages: list[dict[str, Any]]) -> list[Block]:
        said = last_user_text(messages)
        if "APPROVED" in said:
            return [call]
        if "DENIED" in said:
            return [text(refused)]
        result = _last_result(messages)
        words = str(result.get("text", ""))
        if words.startswith("Approval unavailable"):
            return [call]
        if result.get("is_error"):
            return [text(refused if "denied" in words else f"That did not work: {words}")]
        return [text(done)]

    return [[call], then, then, then]


def _picked(question: str, told: str) -> str | None:
    """The answer to `question` in what the model was told: the tool_result's
    `"<question>"="<answer>"`, or a resume text's `- <question>: <answer>` line."""
    found = re.search(re.escape(f'"{question}"="') + r'([^"]*)"', told) or re.search(
        r"^- " + re.escape(question) + r": (.+)$", told, re.M
    )
    return found.group(1).strip() if found else None


def _claude_ask() -> list[Reply]:
    def then(messages: list[dict[str, Any]]) -> list[Block]:
        result = _last_result(messages)
        told = "" if result.get("is_error") else str(result.get("text", ""))
        told += "\n" + last_user_text(messages)
        target, sections = _picked(TARGET, told), _picked(SECTIONS, told)
        if target and sections:
            return [text(f"Deploying to {target} with {sections}.")]
        return [text(f"No answer I can use: {told.strip()[:300]}")]

    return [[tool_use("AskUserQuestion", {"questions": CLAUDE_QUESTIONS})], then, then]


class ClaudeRig(_AgentRig):
    """The real Claude Code CLI, against the fake Anthropic Messages API."""

    harness = "claude_code"
    session_key = "session_id"
    session_word = "Claude session"

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeAnthropic(Script({})).start()
        version = ""
        cli = _bundled_claude()
        if cli is not None and Path(cli + ".version").is_file():  # "2.1.332 (Claude Code)"
            version = " " + " ".join(Path(cli + ".version").read_text().split()[:1])
        self.label = f"the real Claude Code CLI{version}"
        print(f"demo: the fake model (Anthropic Messages API) at {self.fake.url}", flush=True)

    def stop_fake(self) -> None:
        self.fake.stop()

    def approval(
        self, thread: str, command: str, description: str, done: str, refused: str
    ) -> tuple[str, Expected, Expected]:
        self.fake.script.conversations[thread] = _claude_approval(
            command, description, done, refused
        )
        return f"{thread}: please go ahead.", done, refused

    def question(self, thread: str) -> tuple[str, dict[str, Any], list[Expected]]:
        self.fake.script.conversations[thread] = _claude_ask()
        answer = _structured(
            "staging; KPI cards and Chart",
            (TARGET, ["staging"]),
            (SECTIONS, ["KPI cards", "Chart"]),
        )
        said = "Deploying to staging with KPI cards, Chart."
        return f"{thread}: please go ahead.", answer, [said]

    def harness_config(self) -> dict[str, Any]:
        return {"base_url": self.fake.url, "api_key": "sk-ant-demo-offline"}

    def evidence(self, case: Case, doomed: bool) -> list[str]:
        """Each conversation went on as one (its last model call still carries its first tool
        call); a resumed one also carried the person's answer, in the resume text."""
        convo = [r for r in self.fake.main_requests() if case.thread in first_user_text(r.messages)]
        if not convo:
            return ["the model never heard from this thread"]
        first = [b["id"] for b in convo[0].reply if b.get("type") == "tool_use"]
        carried = {
            b.get("id")
            for m in convo[-1].messages
            if m.get("role") == "assistant" and isinstance(m.get("content"), list)
            for b in m["content"]
            if isinstance(b, dict) and b.get("type") == "tool_use"
        }
        problems = []
        if not first or first[0] not in carried:
            problems.append("the model's last call lost the conversation's first tool call")
        resumed = any(
            re.search(r"by the person|The person answered", last_user_text(r.messages))
            for r in convo
        )
        if doomed and not resumed:
            problems.append("the resumed Claude session never carried the person's answer")
        return problems


# -- Codex ---------------------------------------------------------------------------------------


class CodexRig(_AgentRig):
    """The real Codex CLI (`codex app-server`), against the fake Responses API."""

    harness = "codex"
    label = f"the real Codex CLI {PINNED_VERSION}"
    session_key = "codex_thread"
    session_word = "Codex thread"

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeResponses().start()
        self.config = {
            "base_url": self.fake.base_url,
            "api_key": "demo-offline",
            "model": "gpt-5.5",
        }
        print(f"demo: the fake model (Responses API) at {self.fake.base_url}", flush=True)

    def stop_fake(self) -> None:
        self.fake.stop()

    # The fake's reply after a command: `done: <its output>`; after a resume with the person's
    # denial: `understood, not retrying`; after a question: the answers, or (resumed)
    # `noted: The person answered: ...`. The message is the fake's script.

    def approval(
        self, thread: str, command: str, description: str, done: str, refused: str
    ) -> tuple[str, Expected, Expected]:
        return f"run!: {command}", ("exited with code 0",), ("rejected", "not retrying")

    def question(self, thread: str) -> tuple[str, dict[str, Any], list[Expected]]:
        answer = _structured(
            "staging, and call it Team dashboard",
            (TARGET, ["staging"]),
            (NAME, ["Team dashboard"]),  # not an option: Codex's "Other", free text
        )
        return f"ask: {json.dumps(CODEX_QUESTIONS)}", answer, ["staging", "Team dashboard"]

    def harness_config(self) -> dict[str, Any]:
        return dict(self.config)

    def evidence(self, case: Case, doomed: bool) -> list[str]:
        """The model saw the thread's message; a resumed Codex thread also carried it (its history
        came back from Redis) next to the person's answer."""
        convo = [r for r in self.fake.requests if r.history and r.history[0] == case.message]
        if not convo:
            return ["the model never saw this thread's message"]
        if doomed and not any(len(r.history) >= 2 for r in convo):
            return ["the resumed Codex thread did not carry its first message"]
        return []


def agent_rig(harness: str) -> ClaudeRig | CodexRig:
    """The rig for `claude_code` or `codex`, its fake model started."""
    rigs: dict[str, Callable[[], ClaudeRig | CodexRig]] = {
        "claude_code": ClaudeRig,
        "codex": CodexRig,
    }
    return rigs[harness]()
