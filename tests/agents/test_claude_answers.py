"""The Claude harness's questions and answers as data (`workers.agents.claude_answers`): pure, so
no SDK and no CLI. `DB`, `SIGNALS` and `HOST` are the questions the harness's end-to-end tests
(test_claude.py) ask too."""

from __future__ import annotations

import pytest

from broker import Answer, BadItem
from workers.agents.claude_answers import ask_questions, updated_input

DB = {
    "question": "Which database?",
    "header": "Database",
    "options": [
        {"label": "SQLite", "description": "one file", "preview": "db = sqlite3.connect(...)"},
        {"label": "Postgres", "description": "a server"},
    ],
    "multiSelect": False,
}
SIGNALS = {
    "question": "Which signals should we collect?",
    "header": "Signals",
    "options": [
        {"label": "Metrics", "description": "counters"},
        {"label": "Logs", "description": "lines"},
        {"label": "Traces", "description": "spans"},
    ],
    "multiSelect": True,
}
HOST = {
    "question": "Where should it run?",
    "header": "Host",
    "options": [
        {"label": "Laptop", "description": "local"},
        {"label": "Cloud", "description": "remote"},
    ],
    "multiSelect": False,
}


def test_updated_input_keeps_questions_and_keys_answers_by_exact_text() -> None:
    tool_input = {"questions": [DB, SIGNALS, HOST]}
    out = updated_input(
        tool_input,
        [
            Answer(question="x", answer=["sqlite", "tiny"]),  # a label in another case, a note
            Answer(question="y", answer=["Logs", "Metrics"]),
            Answer(question="z", answer=[]),  # unanswered: left out
        ],
    )
    assert out["questions"] == tool_input["questions"]
    assert out["answers"] == {
        "Which database?": "SQLite",
        "Which signals should we collect?": "Logs, Metrics",
    }
    assert out["annotations"] == {
        "Which database?": {"notes": "tiny", "preview": "db = sqlite3.connect(...)"}
    }


def test_updated_input_free_text_and_duplicates() -> None:
    twin = {**HOST, "options": [{"label": "Here", "description": ""}]}
    tool_input = {
        "questions": [HOST, twin],
        "annotations": {"Where should it run?": {"preview": "p"}},
    }
    out = updated_input(
        tool_input,
        [Answer(question="a", answer=["somewhere cheap"]), Answer(question="b", answer=["Here"])],
    )
    assert out["answers"] == {"Where should it run?": "somewhere cheap; Here"}
    note = out["annotations"]["Where should it run?"]
    assert note["preview"] == "p" and "asked 2 times" in note["notes"]
    assert [q.question for q in ask_questions(tool_input)] == [
        "Where should it run? [1/2]",
        "Where should it run? [2/2]",
    ]


def test_ask_questions_refuses_a_malformed_input() -> None:
    with pytest.raises(BadItem):
        ask_questions({"questions": []})
    with pytest.raises(BadItem):
        ask_questions({"questions": [{"header": "no text"}]})
