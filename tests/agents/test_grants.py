"""One-shot grant matching (`covers`) and resume texts (`resume_text`): pure, no Redis."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from broker import Answer, Option, Prompt, Question
from broker.answers import NEGATIVE
from workers.agents.grants import covers, resume_text
from workers.agents.harness import approval_question

WORK = "/work/proj"
GRANTED = "Bash:make deploy"


# -- covers: exact, keyless, keyed -----------------------------------------------------------


def test_exact_key_is_covered() -> None:
    """A grant covers a call with exactly its key."""
    assert covers(GRANTED, GRANTED, WORK)
    assert covers(GRANTED, GRANTED, "")  # exact equality needs no work folder


def test_exact_key_only() -> None:
    """A keyed grant does not cover a different command of the same tool."""
    assert not covers(GRANTED, "Bash:make clean", WORK)
    assert not covers(GRANTED, "Bash:make deploy --force", WORK)
    assert not covers(GRANTED, "Bash:make  deploy", WORK)


@pytest.mark.parametrize("requested", ["Bash:make deploy", "Bash:rm -rf /", "Bash", None])
def test_keyless_grant_covers_any_call(requested: str | None) -> None:
    """A keyless grant covers any call to its subject, keyed or not."""
    assert covers(None, requested, WORK)
    assert covers(None, requested, "")


def test_keyed_grant_never_covers_keyless_call() -> None:
    """A keyed grant never covers a call that carries no key."""
    assert not covers(GRANTED, None, WORK)
    assert not covers("Bash", None, WORK)


def test_grant_keys_from_approval_question() -> None:
    """The keys `approval_question` builds are matched exactly."""
    q = approval_question("Bash", {"command": "make deploy"})
    assert q.grant_key == GRANTED
    assert covers(q.grant_key, approval_question("Bash", {"command": "make deploy"}).grant_key, "")
    assert not covers(q.grant_key, approval_question("Bash", {"command": "ls"}).grant_key, WORK)


# -- covers: the `cd <dir> && <cmd>` widening ------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        "cd sub && make deploy",
        "cd sub/dir && make deploy",
        "cd ./sub && make deploy",
        "cd . && make deploy",
        "cd sub/.. && make deploy",  # resolves to the work folder itself
        "cd sub/../other && make deploy",
        f"cd {WORK} && make deploy",
        f"cd {WORK}/sub && make deploy",
        "cd my-dir_2.0 && make deploy",
        "cd 'sub' && make deploy",
        "cd 'my dir' && make deploy",
        'cd "sub" && make deploy',
        'cd "my dir/x" && make deploy',
    ],
)
def test_cd_widening_inside_work_folder(command: str) -> None:
    """`cd <dir> && <granted command>` is covered for a plain or quoted dir in the work folder."""
    assert covers(GRANTED, f"Bash:{command}", WORK)
    assert covers(GRANTED, f"Bash:{command}", WORK + "/")


@pytest.mark.parametrize(
    "command",
    [
        # other separators
        "cd sub; make deploy",
        "cd sub ; make deploy",
        "cd sub || make deploy",
        "cd sub | make deploy",
        "cd sub & make deploy",
        "cd sub&&make deploy",
        "cd sub &&make deploy",
        "cd sub\nmake deploy",
        # extra clauses, before or after
        "echo hi && cd sub && make deploy",
        "cd sub && cd other && make deploy",
        "cd sub && make deploy && rm -rf /",
        "cd sub && make deploy; rm -rf /",
        "cd sub && make deploy | tee log",
        "cd sub && make clean",
        # prefix commands
        "sudo cd sub && make deploy",
        "env X=1 cd sub && make deploy",
        " cd sub && make deploy",
        "builtin cd sub && make deploy",
        # ~, $, backticks, backslash, parentheses, leading -
        "cd ~ && make deploy",
        "cd ~/proj && make deploy",
        "cd $HOME && make deploy",
        "cd ${WORK} && make deploy",
        '"cd "$HOME"" && make deploy',
        'cd "$HOME" && make deploy',
        "cd `pwd` && make deploy",
        "cd '`pwd`' && make deploy",
        "cd sub\\dir && make deploy",
        "cd $(pwd) && make deploy",
        "cd (sub) && make deploy",
        "cd -P && make deploy",
        "cd - && make deploy",
        "cd '-P' && make deploy",
        "cd -- sub && make deploy",
        # .. escaping the work folder, absolute paths outside it
        "cd .. && make deploy",
        "cd ../other && make deploy",
        "cd sub/../.. && make deploy",
        "cd sub/../../proj2 && make deploy",
        "cd / && make deploy",
        "cd /etc && make deploy",
        "cd /work && make deploy",
        "cd /work/proj2 && make deploy",
        "cd /work/proj-other && make deploy",
        "cd '/etc' && make deploy",
        # quoting that is not a matched pair, or empty, or dangerous inside
        "cd 'sub && make deploy",
        "cd 'sub\" && make deploy",
        "cd '' && make deploy",
        'cd "" && make deploy',
        "cd 'a;b' && make deploy",
        "cd 'a|b' && make deploy",
        "cd my dir && make deploy",
        "cd  sub && make deploy",
        "cd\tsub && make deploy",
    ],
)
def test_cd_widening_refused(command: str) -> None:
    """Anything but a plain `cd <dir inside the work folder> && <the command>` is not covered."""
    assert not covers(GRANTED, f"Bash:{command}", WORK)


def test_cd_widening_needs_a_work_folder() -> None:
    """With an empty work folder the widening is refused, even for a plain relative dir."""
    assert not covers(GRANTED, "Bash:cd sub && make deploy", "")
    assert not covers(GRANTED, "Bash:cd . && make deploy", "")


@pytest.mark.parametrize(
    "requested",
    ["Shell:cd sub && make deploy", "bash:cd sub && make deploy", "Bash2:cd sub && make deploy"],
)
def test_cd_widening_needs_the_same_tool(requested: str) -> None:
    """The widening keeps the tool prefix: another tool's `cd ... && cmd` is not covered."""
    assert not covers(GRANTED, requested, WORK)


def test_cd_widening_needs_a_keyed_grant_with_a_command() -> None:
    """A grant keyed by the bare tool name (no command) is matched exactly, never widened."""
    assert covers("Bash", "Bash", WORK)
    assert not covers("Bash", "Bash:cd sub && make deploy", WORK)
    assert not covers("Bash", "Bash:ls", WORK)


def test_cd_widening_keeps_colons_in_the_command() -> None:
    """The tool prefix is the text before the first `:`; the command may hold more colons."""
    granted = "Bash:echo a:b"
    assert covers(granted, "Bash:cd sub && echo a:b", WORK)
    assert not covers(granted, "Bash:cd sub && echo a:c", WORK)


# -- resume_text -----------------------------------------------------------------------------

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def _prompt(
    kind: str,
    questions: list[Question],
    answers: list[list[str]],
    text: str | None = None,
    **extra: Any,
) -> Prompt:
    return Prompt(
        prompt_id="prm_01HZZZZZZZZZZZZZZZZZZZZZZZ",
        thread_id="t1",
        kind=kind,
        questions=questions,
        state="answered",
        item_id="itm_01HZZZZZZZZZZZZZZZZZZZZZZZ",
        created_at=T0,
        answers=[
            Answer(question=q.question, answer=a) for q, a in zip(questions, answers, strict=True)
        ],
        source="text" if text is not None else "structured",
        answer_text=text,
        **extra,
    )


def _approval(label: str, text: str | None = None, tool: str = "Bash") -> Prompt:
    q = approval_question(tool, {"command": "make deploy"})
    return _prompt("approval", [q], [[label]], text)


def test_resume_approve_says_retry_now() -> None:
    """An approved approval tells the agent it was APPROVED, names the subject, and to retry now."""
    text = resume_text(_approval("Approve", "yes"))
    assert "APPROVED" in text
    assert "`Bash`" in text
    assert "Retry it now" in text
    assert "DENIED" not in text
    assert "work folder" not in text  # no work folder given: no shell-reset note


def test_resume_approve_structured_lowercase() -> None:
    """A structured lowercase `approve` approves (the shared verdict decides)."""
    assert "APPROVED" in resume_text(_approval("approve"), WORK)


def test_resume_approve_mentions_work_folder() -> None:
    """With a work folder, the approval says the shell was reset there and `cd` re-runs count."""
    text = resume_text(_approval("Approve", "ok", tool="Shell"), WORK)
    assert "APPROVED" in text
    assert "`Shell`" in text
    assert WORK in text
    assert "cd <dir inside the work folder> && <the exact command>" in text


@pytest.mark.parametrize("words", ["no", "N", "deny", " Deny ", "DENIED", "nope", "0", "rejected"])
def test_resume_deny_bare_negative_has_no_quote(words: str) -> None:
    """A denial says DENIED and not to retry; a bare negative adds no quoted reason."""
    text = resume_text(_approval("Deny", words), WORK)
    assert "DENIED" in text
    assert "`Bash`" in text
    assert "Do not retry" in text
    assert "APPROVED" not in text
    assert "Their words" not in text
    assert '"' not in text


def test_bare_negatives_are_the_spec_set() -> None:
    """The bare negatives are exactly the protocol's list (docs/protocol.md)."""
    assert {"deny", "denied", "no", "n", "nope", "reject", "rejected", "0"} == NEGATIVE


@pytest.mark.parametrize(
    ("words", "quoted"),
    [
        ("no, use staging instead", "no, use staging instead"),
        ("  not on main  ", "not on main"),
        ("yes, but not on main", "yes, but not on main"),  # prose is a denial, quoted
    ],
)
def test_resume_deny_quotes_the_persons_words(words: str, quoted: str) -> None:
    """A denial with more than a bare negative quotes the person's trimmed words."""
    text = resume_text(_approval("Deny", words), WORK)
    assert "DENIED" in text
    assert "Do not retry" in text
    assert f'"{quoted}"' in text
    assert "Retry it now" not in text


def test_resume_deny_structured_has_no_words() -> None:
    """A structured denial (no typed words) says DENIED with no quote."""
    text = resume_text(_approval("Deny"))
    assert "DENIED" in text
    assert "Their words" not in text


def test_resume_questions_render_structured_answers() -> None:
    """A question's resume lists each question with its answer's labels."""
    qs = [
        Question(
            question="Which cards?",
            options=[Option(label="KPI cards"), Option(label="Table"), Option(label="Chart")],
            multiSelect=True,
        ),
        Question(question="Target", options=[Option(label="staging"), Option(label="prod")]),
    ]
    prompt = _prompt("ask_user_question", qs, [["KPI cards", "Chart"], ["prod"]])
    text = resume_text(prompt, WORK)
    assert "Which cards?" in text
    assert "KPI cards, Chart" in text
    assert "Target" in text
    assert "prod" in text
    assert text.index("Which cards?") < text.index("KPI cards, Chart") < text.index("Target")
    lines = text.splitlines()
    assert any("Which cards?" in line and "KPI cards, Chart" in line for line in lines)
    assert any("Target" in line and "prod" in line for line in lines)
    assert "APPROVED" not in text
    assert "DENIED" not in text


def test_resume_questions_never_the_raw_text() -> None:
    """When structured answers exist, the person's raw text is not what the agent gets."""
    q = Question(question="Pick one", options=[Option(label="A"), Option(label="B")])
    prompt = _prompt("ask_user_question", [q], [["B"]], text="the second one please")
    text = resume_text(prompt, WORK)
    assert "Pick one" in text
    assert "B" in text
    assert "the second one please" not in text


def test_resume_text_prompt_gives_the_typed_answer() -> None:
    """A parked free-text prompt resumes with the question and the person's answer."""
    q = Question(question="Branch name?")
    prompt = _prompt("text", [q], [["feature/x"]], text="feature/x")
    text = resume_text(prompt, WORK)
    assert "Branch name?" in text
    assert "feature/x" in text


def test_session_wide_approval_counts_as_approval() -> None:
    """A structured `Approve for this session` approves a parked approval (the original worker
    counted it a denial)."""
    from workers.agents.grants import approves

    assert approves([Answer(question="q", answer=["Approve for this session"])])
    assert approves([Answer(question="q", answer=["approve"])])
    assert not approves([Answer(question="q", answer=["Approve & remember"])])
    assert not approves([Answer(question="q", answer=["Deny"])])
    assert not approves([])
