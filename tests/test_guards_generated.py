"""Tests that kill the survivors of the generated mutation run (bench/mutation_py.py).

Each test calls the function itself and pins one behaviour that a cosmic-ray mutant changed while
every other test still passed. The mutant each one kills is named in its docstring.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from ulid import ULID

from broker import Broker
from broker.answers import MAX_DIGITS, map_text, prepare
from broker.models import Answer, Kind, Option, Prompt, Question
from tests.conftest import BrokerFactory
from tests.helpers import drop_indexes, index_add, index_entries, index_score
from workers.agents import grants, policy
from workers.agents.harness import GateVerdict
from workers.runtime import audit


def _q(text: str, *labels: str, multi: bool = False) -> Question:
    return Question(question=text, options=[Option(label=lb) for lb in labels], multiSelect=multi)


# -- broker/answers.py -----------------------------------------------------------------------


def test_a_word_that_is_no_number_has_number_zero() -> None:
    """`Token.n` is 0 when the word is no number (mutants: the default 0 made -1, either place).

    route.lua reads the prepared tokens, so `n` is a contract, not an internal: 0 for none.
    """
    assert prepare("Table")["whole"]["n"] == 0
    assert prepare("0000")["whole"]["n"] == 0  # all zeros: no digits left, no number
    assert prepare("1" * (MAX_DIGITS + 1))["whole"]["n"] == 0  # too long to be an index


def test_a_number_of_max_digits_is_still_a_number() -> None:
    """Exactly MAX_DIGITS digits parse (mutant: `<= MAX_DIGITS` made `<`)."""
    digits = "9" * MAX_DIGITS
    assert prepare(digits)["whole"]["n"] == int(digits)
    assert prepare("0" + digits)["whole"]["n"] == int(digits)  # leading zeros do not count


def test_multi_select_number_beats_a_label_spelled_as_that_number() -> None:
    """In a multi-select, one word is resolved as a number first, a label second.

    Mutant: the run loop of `_resolve_segment` also tried one-word runs (`i - 1` for `i + 1`),
    so a single word matched a label by name before its number was read.
    """
    question = _q("Which?", "2", "1", multi=True)
    assert map_text("ask_user_question", [question], "1")[0].answer == ["2"]
    assert map_text("ask_user_question", [question], "2, 1")[0].answer == ["1", "2"]


# -- workers/agents/grants.py ----------------------------------------------------------------------

SESSION = "Approve for this session"


def test_approves_reads_the_first_answer_and_its_first_label_only() -> None:
    """The verdict is the first label of the first answer (mutants: `[0]` made `[-1]`, each)."""
    assert not grants.approves(
        [Answer(question="a", answer=["Deny"]), Answer(question="b", answer=[SESSION])]
    )
    assert not grants.approves([Answer(question="a", answer=["Deny", SESSION])])
    assert grants.approves([Answer(question="a", answer=[SESSION, "Deny"])])


def test_approves_an_empty_label_list_denies_without_raising() -> None:
    """No label is a denial, never an IndexError (mutant: `... and labels` made `or labels`)."""
    assert not grants.approves([Answer(question="a", answer=[])])
    assert not grants.approves([SimpleNamespace(answer=[])])


def test_inside_refuses_a_path_that_only_ends_in_a_quote() -> None:
    """Only a path that starts with a quote is unquoted (mutant: `path[0]` made `path[-1]`).

    covers() hands _inside only what its regex matched, which never ends in a lone quote; this
    is the second line of that check, so it is tested on its own.
    """
    assert not grants._inside("sub'", "/work")
    assert not grants._inside('sub"', "/work")
    assert grants._inside("'sub'", "/work")


def test_a_quoted_dotdot_is_outside_the_work_folder() -> None:
    """Quotes are stripped one a side (mutant: `path[1:-1]` made `path[1:-2]`, `'..'` -> `.`)."""
    assert not grants.covers("Bash:ls", "Bash:cd '..' && ls", "/work")
    assert grants.covers("Bash:ls", "Bash:cd 'sub' && ls", "/work")


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _prompt(kind: Kind, questions: list[Question], answers: list[list[str]]) -> Prompt:
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
        source="structured",
    )


def test_resume_text_names_the_first_questions_subject() -> None:
    """The subject is the first question's (mutant: `questions[0]` made `questions[-1]`)."""
    first = Question(question="Run ls?", subject="Bash", options=[Option(label="Approve")])
    second = Question(question="Note?")
    text = grants.resume_text(_prompt("approval", [first, second], [["Approve"], ["x"]]))
    assert "`Bash` was APPROVED" in text


def test_resume_text_of_a_question_with_a_subject_is_not_an_approval() -> None:
    """Only an approval prompt gets the approval wording (mutant: `and subject` made `or`)."""
    question = Question(question="Pick?", subject="Bash", options=[Option(label="Approve")])
    text = grants.resume_text(_prompt("ask_user_question", [question], [["Approve"]]))
    assert text == "The person answered:\n- Pick?: Approve"
    plain = Question(question="Pick?", options=[Option(label="Approve")])
    text = grants.resume_text(_prompt("approval", [plain], [["Approve"]]))
    assert text == "The person answered:\n- Pick?: Approve"


# -- workers/runtime/audit.py ----------------------------------------------------------------------


async def test_reconcile_rebuilds_on_the_first_run_then_every_full_sweep(broker: Broker) -> None:
    """The index rebuild runs on run 1, 1 + N, 1 + 2N (mutants: the run counter's start or
    step changed, each moving or removing the sweeps); a rebuild's counts carry `scanned`."""
    every = audit.FULL_SWEEP_EVERY
    ctx: dict[str, Any] = {"broker": broker}
    runs = [await audit.reconcile(ctx) for _ in range(2 * every + 1)]
    swept = ["scanned" in counts for counts in runs]
    assert [i for i, s in enumerate(swept) if s] == [0, every, 2 * every]
    assert ctx["runs"] == 2 * every + 1
    assert all(counts["requeued"] == 0 for counts in runs)  # nothing to requeue: 0, not 1 or -1


async def test_reconcile_requeues_only_members_past_the_grace(make_broker: BrokerFactory) -> None:
    """A member older than `audit_grace` seconds is requeued, a younger one is not (mutants:
    the seconds-to-ms factor 1000 made 1001 or 999, `now - grace` made `now + grace`).

    The grace is 1000 s so that 0.1% of it is 1 s: the two members sit half a second either side
    of the boundary, far beyond the few milliseconds this test takes."""
    broker = await make_broker(audit_grace=1000.0)
    now = ULID().milliseconds
    old, young = "a/prm_01M8RJEMZ5NYSK2HZD2KRBPC1M", "b/prm_01M8RJEV25K476KJ4FB2CMSEME"
    await index_add(broker, "audit", {old: now - 1_000_500, young: now - 999_500})
    counts = await audit.reconcile({"broker": broker, "runs": 1})  # run 2: no rebuild
    assert counts == {"requeued": 1}


async def test_rebuild_adds_missing_members_but_never_moves_a_present_one(broker: Broker) -> None:
    """The rebuild only adds what is missing (mutants: `nx=True` made `nx=False`, per index).

    A resolution's audit score is when it was resolved, and reconcile's grace counts from it;
    a rebuild that rewrote it to the prompt's creation time would requeue it before its grace."""
    question = {"question": "Run it?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
    pending = await broker.ask("a", "approval", [question])
    cancelled = await broker.ask("b", "approval", [question])
    await broker.cancel("b", "stop")
    kept_open = broker.keys.member("a", pending.prompt_id)
    kept_audit = broker.keys.member("b", cancelled.prompt_id)
    await index_add(broker, "open", {kept_open: 42})
    await index_add(broker, "audit", {kept_audit: 43})
    await audit.rebuild_indexes(broker)
    assert await index_score(broker, "open", kept_open) == 42
    assert await index_score(broker, "audit", kept_audit) == 43


async def test_rebuild_scores_a_member_by_its_records_creation_time(broker: Broker) -> None:
    """A re-added member's score is the record's `created` (0 when it has none, so it sorts
    first). Mutants: `created or 0` made `created and 0`, and the 0 made 1 or -1."""
    question = {"question": "Run it?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
    dated = await broker.ask("a", "approval", [question])
    undated = await broker.ask("b", "approval", [question])
    redis: Any = broker.redis  # redis-py types hget/hdel as sync-or-async
    await redis.hdel(broker.thread("b").prompt(undated.prompt_id), "created")
    created = await redis.hget(broker.thread("a").prompt(dated.prompt_id), "created")
    assert created is not None and float(created) > 0
    await drop_indexes(broker, "open")
    await audit.rebuild_indexes(broker)
    assert await index_entries(broker, "open") == [
        (broker.keys.member("b", undated.prompt_id), 0.0),
        (broker.keys.member("a", dated.prompt_id), float(created)),
    ]


async def test_rebuild_scans_only_this_prefixs_prompt_records(broker: Broker) -> None:
    """Keys the SCAN pattern matches but that are no prompt record of this prefix are skipped,
    and the scan goes on past them. Mutants: `m is None or m["prefix"] != prefix` made `and` (a
    TypeError on the first, the second scanned as a record); `continue` made `break`.

    SCAN's order is the server's: with 20 records and 20 strays mixed, the chance that all the
    records come before the first stray (the one order `break` would pass) is 1 in 10^11."""
    question = {"question": "Run it?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
    prefix = broker.keys.prefix
    redis: Any = broker.redis
    for n in range(20):
        await broker.ask(f"t{n}", "approval", [question])
        await redis.hset(f"{prefix}:{{t{n}}}:prompt:not-a-prompt-id", "state", "pending")
    nested = f"{prefix}:{{a}}:prompt:x:{{b}}:prompt:prm_01M8RJEMZ5NYSK2HZD2KRBPC1M"
    await redis.hset(nested, "state", "pending")
    counts = await audit.rebuild_indexes(broker)
    assert counts["scanned"] == 20
    assert counts["open"] == 20


# -- workers/agents/policy.py ----------------------------------------------------------------------


def test_classify_keeps_only_a_non_empty_string_command() -> None:
    """A Bash command that is no string, or empty, is no command (mutant: `isinstance(command,
    str) and command` made `or`: a list or an empty string got through as the command)."""
    assert policy.classify("claude_code", "Bash", {"command": ["rm", "-rf", "/"]}).command is None
    assert policy.classify("claude_code", "Bash", {"command": ""}).command is None
    assert policy.classify("claude_code", "Bash", {"command": "ls"}).command == "ls"


def test_classify_names_the_first_path_of_a_call() -> None:
    """The call's path (its detail) is the first path field (mutant: `[0]` made `[-1]`)."""
    call = policy.classify("claude_code", "Read", {"file_path": "a.txt", "path": "b"})
    assert call.path == "a.txt"
    assert call.paths == ("a.txt", "b")
    grep = policy.classify("claude_code", "Grep", {"pattern": "x", "glob": "*.py"})
    assert grep.path == "x"


def test_classify_any_bad_path_or_pattern_field_is_unresolved() -> None:
    """One malformed field is enough to count the call as outside (mutant: `bad or
    bad_pattern` made `and`, which needed both)."""
    assert policy.classify("claude_code", "Read", {"file_path": 7}).unresolved
    assert policy.classify("claude_code", "Glob", {"pattern": ["*"]}).unresolved
    assert not policy.classify("claude_code", "Glob", {"pattern": "*", "path": "src"}).unresolved


def test_outside_a_path_that_cannot_be_resolved_counts_as_outside() -> None:
    """A NUL byte makes realpath raise ValueError: the path is outside, nothing is raised
    (mutants: ValueError dropped from the except, its `return True` made `return False`)."""
    assert policy._outside("src/a\0b", "/work", ".")
    assert policy._outside("/work/a\0b", "/work", ".")


def test_outside_a_realpath_that_fails_counts_as_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """realpath raises OSError only when a link changes under it (between its lstat and its
    readlink); that race is stood in for by a realpath that raises. The path is outside
    (mutant: OSError dropped from the except)."""

    def racing(path: str) -> str:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os.path, "realpath", racing)
    assert policy._outside("src/a", "/work", ".")


def _guard(*rules: dict[str, Any], default: str) -> policy.Guard:
    block = {"rules": list(rules), "default": default}
    return policy.Guard((), policy.parse_policy(block), "/work")


def _bash(g: policy.Guard, command: str) -> tuple[str, str]:
    verdict = g.decide("claude_code", "Bash", {"command": command})
    return verdict.action, verdict.rule


def test_allow_glob_never_spans_a_line_inside_a_nested_script() -> None:
    """Every command of an allowed script must match one line of the glob, nested ones too.

    `bash -c $'echo "a\\nb"'` is one line, but its nested `echo` carries a newline (mutant: the
    per-command `one_line=True` made False, so the allow rule took it)."""
    g = _guard({"id": "ok", "effect": "exec", "action": "allow", "command": ["bash *", "echo *"]},
               default="deny")  # fmt: skip
    assert _bash(g, "bash -c $'echo \"a\\nb\"'") == ("deny", "")
    assert _bash(g, "bash -c 'echo a'") == ("ask", "ok")  # not plain: unproven, asks


def test_deny_glob_matches_the_whole_command_across_lines() -> None:
    """A deny glob is matched against the whole multi-line command (mutant: `one_line=False`
    made True for the whole): `ls*rm *` names no single command of `ls` then `rm -rf x`."""
    g = _guard({"id": "no", "effect": "exec", "action": "deny", "command": ["ls*rm *"]},
               default="allow")  # fmt: skip
    assert _bash(g, "ls\nrm -rf x") == ("deny", "no")


def test_deny_glob_matches_a_decoded_form_across_lines() -> None:
    """A deny glob is matched against each decoded form, newlines and all (mutant: the forms'
    `one_line=False` made True): `$'a\\nsecret'` is `a`, newline, `secret` once decoded."""
    g = _guard({"id": "no", "effect": "exec", "action": "deny", "command": ["echo a?secret"]},
               default="allow")  # fmt: skip
    assert _bash(g, "echo $'a\\nsecret'") == ("deny", "no")


def test_an_unproven_allow_yields_to_a_later_deny() -> None:
    """An allow that cannot prove the command asks, unless a later deny matches, which then
    decides (mutants: the scan of later rules run zero times, started one rule late, or at
    `i - 1`, which for the first rule is the last rule only). A later ask or allow does not
    decide it (mutant: `later.action == "deny"` negated)."""
    g = _guard(
        {"id": "ls", "effect": "exec", "action": "allow", "command": ["ls *", "cat *"]},
        {"id": "secret", "effect": "exec", "action": "deny", "command": ["*secret*"]},
        {"id": "rm", "effect": "exec", "action": "deny", "command": ["rm *"]},
        {"id": "notes", "effect": "exec", "action": "ask", "command": ["*notes*"]},
        default="allow",
    )
    assert _bash(g, "ls $(cat secret)") == ("deny", "secret")
    assert _bash(g, "ls $(cat notes)") == ("ask", "ls")


def test_a_relative_redirect_after_a_cd_meets_an_outside_rule() -> None:
    """After a `cd`, a relative redirection could land anywhere: an outside-rule meets it
    (mutant: that `return True` made False, so it was judged from the work folder)."""
    g = _guard({"id": "out", "effect": "write", "action": "deny", "outside": "work_folder"},
               default="allow")  # fmt: skip
    assert _bash(g, "cd /tmp && echo x > out.txt") == ("deny", "out")
    assert _bash(g, "echo x > out.txt") == ("allow", "")


def test_exec_match_without_an_analysed_script_is_no_match() -> None:
    """With no analysed script an exec rule does not match (mutant: `command is None or
    script is None` made `and`). evaluate() analyses every command it has, so this is the
    second line of that check, tested on its own."""
    rule = policy.Rule("ok", "exec", "allow", command=("*",))
    ctx = policy._Context(policy.Call("Bash", "exec", "ls"), "/work", None)
    assert policy._exec_match(rule, ctx) == "no"


def test_a_side_effect_is_decided_by_the_first_rule_of_its_effect() -> None:
    """For each write, read or network use the first rule of that effect that meets it decides,
    as for calls (mutant: the `break` after it made `continue`, so a later deny overrode an
    earlier allow)."""
    g = _guard(
        {"id": "w", "effect": "write", "action": "allow"},
        {"id": "out", "effect": "write", "action": "deny", "outside": "work_folder"},
        default="allow",
    )
    assert _bash(g, "echo x > /tmp/out") == ("allow", "")


def test_size_counts_the_command_and_sends_odd_input_off_the_loop() -> None:
    """No command is size 0 (mutant: 1); input that raises while being read is sized past
    ASYNC_OVER so it is decided in a thread (mutants: the except narrowed, `+ 1` made `+ 0`)."""

    class Odd(dict[str, Any]):
        def get(self, *args: Any) -> Any:
            raise RuntimeError("odd")

    assert policy._size({"command": None}) == 0
    assert policy._size({}) == 0
    assert policy._size({"command": "abc"}) == 3
    assert policy._size(Odd()) == policy.ASYNC_OVER + 1


def test_unseen_parts_ask_only_when_a_deny_or_ask_rule_could_have_met_them() -> None:
    """An allowed command with parts the analysis could not see asks (`UNCHECKED`) when a deny
    or ask rule could have met those parts; allow rules alone never make it ask. Mutants in
    `_watched`: `and` made `or` (an allow rule watched), `effect != "exec"` made `==` (a write
    rule, which an unseen redirection could meet, not watched)."""
    only_allow = _guard({"id": "ls", "effect": "exec", "action": "allow", "command": ["ls *"]},
                        default="allow")  # fmt: skip
    assert _bash(only_allow, 'eval "$CMD"') == ("allow", "")
    out = {"id": "out", "effect": "write", "action": "deny", "outside": "work_folder"}
    write_deny = _guard(out, default="allow")
    assert _bash(write_deny, 'eval "$CMD"') == ("ask", policy.UNCHECKED)


def test_denied_item_keeps_a_detail_of_exactly_max_detail() -> None:
    """A detail is cut only when longer than MAX_DETAIL (mutant: `>` made `>=`)."""
    exact = "x" * policy.MAX_DETAIL
    _, meta = policy.denied_item(GateVerdict("deny", "r", "exec", exact))
    assert meta["detail"] == exact
    _, meta = policy.denied_item(GateVerdict("deny", "r", "exec", exact + "y"))
    assert meta["detail"] == "x" * (policy.MAX_DETAIL - 1) + "…"
