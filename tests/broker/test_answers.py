"""Answer mapping, structured answers, the approval verdict and content rendering (pure, no Redis).

The rules: text is mapped per kind (approval by affirmative words, questions by number or label,
free text as it stands), structured sets are checked against the prompt, and the verdict and the
item texts have fixed shapes. The edge cases covered are the awkward ones: numbers out of range,
non-ASCII digits, case and whitespace, commas, empty sets, malformed sets. Our improvement over
the earlier implementation: multi-select labels containing spaces can be picked by name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from broker.answers import (
    AFFIRMATIVE,
    accept_structured,
    answered_content,
    cancelled_content,
    check_structured,
    is_affirmative,
    map_text,
    matchers,
    prepare,
    render_content,
    verdict,
)
from broker.models import Answer, Option, Question

# -- helpers -------------------------------------------------------------------------------------


def q(text: str, *labels: str, multi: bool = False) -> Question:
    """A question with the given option labels (no descriptions)."""
    return Question(question=text, options=[Option(label=lb) for lb in labels], multiSelect=multi)


TARGET = q("Target?", "staging", "production")
SECTIONS = q("Which sections?", "CSV import", "KPI cards", "Table", "Chart", multi=True)
APPROVAL = q("Run `rm -rf build`?", "Approve", "Deny")
CODEX_PERMISSIONS = q("Grant permissions?", "Approve", "Deny", "Approve & remember")
FREE = Question(question="Anything else?")


def one(kind: Any, question: Question, text: str) -> list[str]:
    """The mapped answer list for a one-question prompt."""
    answers = map_text(kind, [question], text)
    assert len(answers) == 1
    assert answers[0].question == question.question
    return answers[0].answer


def single(text: str, *labels: str) -> list[str]:
    return one("ask_user_question", q("Q?", *labels), text)


def multi(text: str, *labels: str) -> list[str]:
    return one("ask_user_question", q("Q?", *labels, multi=True), text)


# -- kind `text` ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["  Bob \n", "1", "yes", "staging", "", "²"])
def test_text_kind_answers_the_raw_untrimmed_text(text: str) -> None:
    """Kind `text` answers `[raw text]` as typed, with no trimming, numbers or affirmatives."""
    assert map_text("text", [Question(question="Name?")], text) == [
        Answer(question="Name?", answer=[text])
    ]


# -- kind `approval` -----------------------------------------------------------------------------


def test_affirmative_set_is_exactly_the_spec_set() -> None:
    """The affirmative set is exactly approve, approved, yes, y, ok, allow, 1."""
    assert frozenset({"approve", "approved", "yes", "y", "ok", "allow", "1"}) == AFFIRMATIVE


@pytest.mark.parametrize("token", sorted(AFFIRMATIVE))
def test_approval_every_affirmative_token_approves(token: str) -> None:
    """Every affirmative token, as typed, maps an approval to `["Approve"]`."""
    assert one("approval", APPROVAL, token) == ["Approve"]


@pytest.mark.parametrize("token", sorted(AFFIRMATIVE))
@pytest.mark.parametrize("shape", ["{}", "{} ", " {}", "\t{}\n", "  {}  "])
def test_approval_affirmative_is_trimmed(token: str, shape: str) -> None:
    """Surrounding whitespace is trimmed before the affirmative check."""
    assert one("approval", APPROVAL, shape.format(token)) == ["Approve"]


@pytest.mark.parametrize("text", ["YES", "Yes", "Approve", "APPROVED", "OK", "Ok", "Y", "ALLOW"])
def test_approval_affirmative_is_case_insensitive(text: str) -> None:
    """The affirmative check ignores case."""
    assert one("approval", APPROVAL, text) == ["Approve"]


@pytest.mark.parametrize(
    "text",
    [
        "yes please",
        "approve!",
        "sure",
        "0",
        "2",
        "3",
        "01",
        "1.",
        "+1",
        "no",
        "Deny",
        "",
        " ",
        "yep",
        "okay",
        "allowed",
        "y e s",
        "yes, but not on main",
        "Approve & remember",
        "\uff11",  # fullwidth digit one
        "\u0661",  # arabic-indic digit one
        "\u00b9",  # superscript one
    ],
)
def test_approval_everything_else_denies(text: str) -> None:
    """Anything that is not exactly an affirmative token maps to `["Deny"]` (deny on doubt)."""
    assert one("approval", APPROVAL, text) == ["Deny"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", "Approve"), ("2", "Deny"), ("3", "Deny"), ("Approve & remember", "Deny")],
)
def test_approval_text_is_not_resolved_by_option_index(text: str, expected: str) -> None:
    """On Codex's three-option question, `2`, `3` and the `Approve & remember` label deny."""
    assert one("approval", CODEX_PERMISSIONS, text) == [expected]


def test_approval_answer_is_keyed_to_the_question_text() -> None:
    """The approval answer carries the approval question's text."""
    assert map_text("approval", [APPROVAL], "yes") == [
        Answer(question=APPROVAL.question, answer=["Approve"])
    ]


# -- single-select -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "label"), [("1", "staging"), ("2", "production")])
def test_single_select_number_in_range_picks_that_label(text: str, label: str) -> None:
    """A bare number N within 1..len answers the Nth option's label."""
    assert one("ask_user_question", TARGET, text) == [label]


@pytest.mark.parametrize("text", [" 2", "2 ", "\t2\n", "02", "0002"])
def test_single_select_number_is_trimmed_and_read_as_an_integer(text: str) -> None:
    """The number is trimmed and read as an integer, so leading zeros still pick the option."""
    assert one("ask_user_question", TARGET, text) == ["production"]


@pytest.mark.parametrize("text", ["0", "3", "99", " 3 ", "1" * 40, "-1", "1.0", "1 2"])
def test_single_select_number_out_of_range_is_raw_text(text: str) -> None:
    """A number outside 1..len (or not a bare number) is returned as the raw, untrimmed text."""
    assert one("ask_user_question", TARGET, text) == [text]


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("production", "production"),
        ("PRODUCTION", "production"),
        ("Production", "production"),
        ("  staging \n", "staging"),
    ],
)
def test_single_select_label_match_is_case_insensitive(text: str, label: str) -> None:
    """A trimmed, case-insensitive match to a label answers that label."""
    assert one("ask_user_question", TARGET, text) == [label]


def test_single_select_label_match_returns_the_canonical_label() -> None:
    """A label match answers the option's label as written, not as typed."""
    assert single("dark THEME", "Light theme", "Dark Theme") == ["Dark Theme"]


def test_single_select_label_match_uses_case_folding() -> None:
    """Case-insensitivity is full case folding: `STRASSE` matches the label `Straße`."""
    assert single("STRASSE", "Weg", "Straße") == ["Straße"]


def test_single_select_label_with_spaces_matches_by_name() -> None:
    """Single-select resolves the whole text as one token, so a label with spaces matches."""
    assert single("kpi cards", "CSV import", "KPI cards") == ["KPI cards"]


@pytest.mark.parametrize("text", ["prod", "stag", "production please", " prod ", "staging!"])
def test_single_select_partial_label_is_raw_untrimmed_text(text: str) -> None:
    """A partial or decorated label is the "Other" path: the raw text, untrimmed."""
    assert one("ask_user_question", TARGET, text) == [text]


def test_single_select_first_matching_label_wins() -> None:
    """When two labels match case-insensitively, the first option's label is answered."""
    assert single("yes", "Yes", "YES") == ["Yes"]


def test_single_select_number_beats_a_label_that_looks_like_a_number() -> None:
    """An in-range number picks by position even when another option's label is that number."""
    assert single("1", "2", "1") == ["2"]


def test_single_select_out_of_range_number_can_match_a_label_by_name() -> None:
    """An out-of-range number falls through to the label match."""
    assert single("7", "a", "7") == ["7"]
    assert single("0", "0", "x") == ["0"]


# -- multi-select --------------------------------------------------------------------------------

LETTERS = ("alpha", "beta", "gamma", "delta")


@pytest.mark.parametrize(
    "text", ["1,3", "1, 3", "1 3", "1   3", " 1 ,, 3 ", "1\t3", "1\n3", ",1,3,", "1\u00a03"]
)
def test_multi_select_numbers_separated_by_commas_or_whitespace(text: str) -> None:
    """Numbers separated by runs of commas and/or whitespace select several options."""
    assert multi(text, *LETTERS) == ["alpha", "gamma"]


def test_multi_select_keeps_typed_order_and_duplicates() -> None:
    """Selections keep the typed order and duplicates."""
    assert multi("3 1 3, 1", *LETTERS) == ["gamma", "alpha", "gamma", "alpha"]


def test_multi_select_mixes_numbers_and_case_insensitive_names() -> None:
    """Names (case-insensitive, canonical label answered) and numbers can be mixed."""
    assert multi("DELTA, 2 Alpha", *LETTERS) == ["delta", "beta", "alpha"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1, banana, 3", ["alpha", "gamma"]),
        ("9 2 0", ["beta"]),
        ("alph beta", ["beta"]),
        ("² 4 ٣", ["delta"]),
    ],
)
def test_multi_select_drops_unknown_tokens_when_one_resolves(
    text: str, expected: list[str]
) -> None:
    """Unresolved tokens are dropped silently when at least one token resolves."""
    assert multi(text, *LETTERS) == expected


@pytest.mark.parametrize("text", ["banana split", "  9, 0  ", "alph", " , ", "5", "\u00a0"])
def test_multi_select_nothing_resolves_gives_the_raw_text(text: str) -> None:
    """When no token resolves, the whole raw (untrimmed) text is the single answer."""
    assert multi(text, *LETTERS) == [text]


def test_multi_select_label_with_spaces_picked_by_name() -> None:
    """Our improvement: `KPI cards, Table` picks both labels (the reference gave only `Table`)."""
    assert one("ask_user_question", SECTIONS, "KPI cards, Table") == ["KPI cards", "Table"]


@pytest.mark.parametrize(
    "text",
    ["kpi   CARDS, table", "KPI cards Table", "KPI\tcards,Table", " KPI  cards  table "],
)
def test_multi_select_label_with_spaces_ignores_case_and_spacing(text: str) -> None:
    """A multi-word label matches whatever the case and the whitespace between its words."""
    assert one("ask_user_question", SECTIONS, text) == ["KPI cards", "Table"]


def test_multi_select_multi_word_label_mixes_with_numbers() -> None:
    """Multi-word names, single-word names and numbers combine in typed order."""
    assert one("ask_user_question", SECTIONS, "4, csv import 2") == [
        "Chart",
        "CSV import",
        "KPI cards",
    ]


def test_multi_select_longest_run_wins() -> None:
    """Within a segment the longest run of words naming a label wins, greedily from the left."""
    assert multi("a b c", "a b", "a b c", "c") == ["a b c"]
    assert multi("a b c d", "a b", "b c d", "c", "d") == ["a b", "c", "d"]


def test_multi_select_runs_never_cross_a_comma() -> None:
    """A run of words is looked for inside one comma segment only."""
    assert one("ask_user_question", SECTIONS, "KPI, cards") == ["KPI, cards"]
    assert multi("a, b c", "a b", "c") == ["c"]


def test_multi_select_without_multi_word_match_is_the_reference() -> None:
    """Where no multi-word label matches, the result is the reference's token-by-token one."""
    assert one("ask_user_question", SECTIONS, "cards, 3") == ["Table"]
    assert one("ask_user_question", SECTIONS, "KPI Table") == ["Table"]
    assert one("ask_user_question", SECTIONS, "import csv") == ["import csv"]


# -- free text, several questions, kinds -------------------------------------------------------


@pytest.mark.parametrize("text", ["1", " dark theme ", "yes", "KPI cards"])
def test_free_text_question_gets_the_raw_text(text: str) -> None:
    """A question without options answers the raw, untrimmed text, even a number."""
    assert one("ask_user_question", FREE, text) == [text]


def test_several_questions_get_the_same_mapped_answer() -> None:
    """A text answer is mapped against every question, so each gets the same answer."""
    questions = [q(f"Q{i}?", "staging", "production") for i in range(3)]
    answers = map_text("ask_user_question", questions, "2")
    assert answers == [Answer(question=f"Q{i}?", answer=["production"]) for i in range(3)]


def test_several_questions_are_each_mapped_independently() -> None:
    """The same text is mapped against each question's own options and variant."""
    questions = [TARGET, q("Sections?", "x", "y", "z", multi=True), FREE, q("Two?", "a")]
    answers = map_text("ask_user_question", questions, "2")
    assert [a.question for a in answers] == ["Target?", "Sections?", FREE.question, "Two?"]
    assert [a.answer for a in answers] == [["production"], ["y"], ["2"], ["2"]]


def test_unknown_kind_maps_like_ask_user_question() -> None:
    """A kind the mapper does not know maps per question, like `ask_user_question`."""
    assert map_text("mystery", [TARGET, FREE], "2") == [  # type: ignore[arg-type]
        Answer(question="Target?", answer=["production"]),
        Answer(question=FREE.question, answer=["2"]),
    ]


# -- empty labels and non-ASCII digits -----------------------------------------------------------


@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("text", ["", " ", "  ", "\t"])
def test_empty_label_never_matches_by_name(variant: bool, text: str) -> None:
    """Options with an empty (or blank) label never match by name: the raw text comes back."""
    assert one("ask_user_question", q("Q?", "", "   ", "x", multi=variant), text) == [text]


@pytest.mark.parametrize("variant", [False, True])
def test_empty_label_can_still_be_picked_by_number(variant: bool) -> None:
    """The Nth label is answered even when it is empty (labels default to "")."""
    assert one("ask_user_question", q("Q?", "", "x", multi=variant), "1") == [""]


# superscript 2, arabic-indic 3 and 1, fullwidth 3, extended arabic-indic 2, subscript 2, NKo 2
NON_ASCII_DIGITS = ["\u00b2", "\u0663", "\u0661", "\uff13", "\u06f2", "\u2082", "\u07c2"]


@pytest.mark.parametrize("digit", NON_ASCII_DIGITS)
@pytest.mark.parametrize("variant", [False, True])
def test_non_ascii_digits_are_text(digit: str, variant: bool) -> None:
    """Non-ASCII digit characters are never option numbers: they map as text and never raise."""
    assert one("ask_user_question", q("Q?", "a", "b", "c", multi=variant), digit) == [digit]
    assert one("approval", APPROVAL, digit) == ["Deny"]


@pytest.mark.parametrize("variant", [False, True])
def test_non_ascii_digit_label_matches_by_name(variant: bool) -> None:
    """A label made of non-ASCII digits is matched by name like any other text."""
    assert one("ask_user_question", q("Q?", "a", "²", multi=variant), "²") == ["²"]


def test_non_ascii_digits_among_numbers_in_multi_select() -> None:
    """In multi-select a non-ASCII digit token is dropped while ASCII numbers select."""
    assert multi("1 ² 2", "a", "b", "c") == ["a", "b"]


# -- structured answers (check_structured) ----------------------------------------------------


def test_structured_absent_is_absent() -> None:
    assert check_structured(None) == (None, None)


def test_structured_empty_list_is_refused() -> None:
    """An empty set answers nothing: it is refused (and so reported), never silently dropped."""
    assert check_structured([]) == (None, "metadata.answers: an empty list answers no question")


def test_structured_set_is_used_verbatim() -> None:
    """A well-shaped set comes back as sent: labels not validated, case kept, empty list allowed."""
    raw = [
        {"question": "Where from?", "answer": ["csv IMPORT"]},
        {"question": "Which  SECTIONS? ", "answer": []},
        {"answer": ["not an option", "Table"]},
    ]
    assert check_structured(raw) == (
        [
            {"question": "Where from?", "qfold": "where from?", "answer": ["csv IMPORT"]},
            {"question": "Which  SECTIONS? ", "qfold": "which sections?", "answer": []},
            {"answer": ["not an option", "Table"]},
        ],
        None,
    )


def test_structured_question_kept_only_when_sent() -> None:
    """Entries keep `question` only when the surface sent a non-empty one; extra keys drop."""
    raw = [{"question": "", "answer": ["a"]}, {"answer": ["b"], "extra": 1}]
    assert check_structured(raw) == ([{"answer": ["a"]}, {"answer": ["b"]}], None)


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"answer": ["a"]}, "metadata.answers:"),
        ("Approve", "metadata.answers:"),
        (7, "metadata.answers:"),
        (False, "metadata.answers:"),
        (("a",), "metadata.answers:"),
        ([{"answer": ["a"]}, "b"], "metadata.answers[1]:"),
        ([["a"]], "metadata.answers[0]:"),
        ([None], "metadata.answers[0]:"),
        ([{"answer": "a"}], "metadata.answers[0].answer:"),
        ([{"question": "q"}], "metadata.answers[0].answer:"),
        ([{"answer": None}], "metadata.answers[0].answer:"),
        ([{"answer": ("a",)}], "metadata.answers[0].answer:"),
        ([{"answer": ["a"]}, {"answer": ["b", 2]}], "metadata.answers[1].answer:"),
        ([{"answer": [None]}], "metadata.answers[0].answer:"),
        ([{"answer": [["a"]]}], "metadata.answers[0].answer:"),
        ([{"answer": ["a"], "question": 3}], "metadata.answers[0].question:"),
    ],
)
def test_structured_malformed_is_refused_naming_the_field(raw: Any, where: str) -> None:
    """A malformed set is refused (the text is mapped instead) with a message naming the field."""
    entries, why = check_structured(raw)
    assert entries is None
    assert why is not None
    assert why.startswith(where)


def test_structured_non_list_refusal_names_the_type() -> None:
    """The refusal of a non-list set says what was sent instead."""
    assert check_structured({"answer": []}) == (None, "metadata.answers: expected a list, got dict")


# -- structured answers against the prompt (accept_structured) --------------------------------

TWO = [
    Question(question="Where should the data come from?", options=[]),
    Question(question="Which sections?", options=[], multiSelect=True),
]


def _accept(raw: list[dict[str, Any]]) -> tuple[list[Answer] | None, str | None]:
    entries, why = check_structured(raw)
    assert entries is not None, why
    return accept_structured(matchers(TWO), entries)


def test_structured_question_must_name_the_prompts_question() -> None:
    """An entry naming another question refuses the whole set, saying which and why."""
    answers, why = _accept([{"question": "Wrong q", "answer": ["B"]}, {"answer": ["Table"]}])
    assert answers is None
    assert why == (
        'metadata.answers[0].question: "Wrong q" is not question 1 of the prompt '
        '("Where should the data come from?")'
    )


def test_structured_questions_in_the_wrong_order_are_refused() -> None:
    answers, why = _accept(
        [
            {"question": "Which sections?", "answer": ["Table"]},
            {"question": "Where should the data come from?", "answer": ["CSV"]},
        ]
    )
    assert answers is None and why is not None and why.startswith("metadata.answers[0].question")


def test_structured_question_may_differ_in_case_and_whitespace() -> None:
    """Case and whitespace may differ; the answers carry the prompt's own wording."""
    answers, why = _accept(
        [
            {"question": "  where SHOULD the\tdata come from? ", "answer": ["CSV"]},
            {"question": "WHICH sections?", "answer": ["Table"]},
        ]
    )
    assert why is None
    assert answers == [
        Answer(question="Where should the data come from?", answer=["CSV"]),
        Answer(question="Which sections?", answer=["Table"]),
    ]


def test_structured_entries_without_question_go_by_position() -> None:
    answers, why = _accept([{"answer": ["CSV"]}, {"answer": []}])
    assert why is None and answers is not None
    assert [a.question for a in answers] == [q.question for q in TWO]


def test_structured_wrong_arity_is_refused_before_questions() -> None:
    answers, why = _accept([{"question": "Wrong q", "answer": ["B"]}])
    assert answers is None
    assert why == "metadata.answers: the prompt has 2 question(s), the item answers 1"


# -- the approval verdict ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "label", ["Approve", "approve", "APPROVE", "approved", "yes", "y", "ok", "allow", "1", " ok "]
)
def test_verdict_structured_affirmative_labels_approve(label: str) -> None:
    """Structured labels go through the affirmative set: lowercase `approve`, `yes`, `ok`, `1`."""
    assert verdict([{"question": "Run?", "answer": [label]}]) == "approve"
    assert verdict([Answer(question="Run?", answer=[label])]) == "approve"


@pytest.mark.parametrize(
    "label", ["Deny", "no", "Approve & remember", "yes, but not on main", "sure", "2", "", "0"]
)
def test_verdict_other_labels_deny(label: str) -> None:
    """Every other label denies, `Approve & remember` included."""
    assert verdict([{"question": "Run?", "answer": [label]}]) == "deny"
    assert verdict([Answer(question="Run?", answer=[label])]) == "deny"


@pytest.mark.parametrize(
    "answers",
    [
        None,
        "approve",
        1,
        {"answer": ["approve"]},
        [],
        [None],
        ["approve"],
        [["approve"]],
        [{}],
        [{"answer": "approve"}],
        [{"answer": ("approve",)}],
        [{"answer": []}],
        [{"answer": [None]}],
        [{"answer": [1]}],
        [{"answer": [True]}],
        [{"answer": [["approve"]]}],
        [{"answer": [b"approve"]}],
        [Answer(question="q", answer=[])],
    ],
)
def test_verdict_malformed_denies_and_never_raises(answers: Any) -> None:
    """Malformed answers (non-list, empty, non-dict, non-list answer, non-string label) deny."""
    assert verdict(answers) == "deny"


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ([{"answer": ["Deny", "Approve"]}], "deny"),
        ([{"answer": ["approve", "no"]}], "approve"),
        ([{"answer": ["no"]}, {"answer": ["approve"]}], "deny"),
        ([{"answer": []}, {"answer": ["approve"]}], "deny"),
        ([{"answer": ["yes"]}, {"answer": ["no"]}], "approve"),
        ([{"answer": ["yes"]}, "garbage"], "approve"),
    ],
)
def test_verdict_reads_only_the_first_label_of_the_first_answer(
    answers: list[Any], expected: str
) -> None:
    """Only the first label of the first answer counts."""
    assert verdict(answers) == expected


def test_verdict_agrees_with_text_mapping() -> None:
    """A typed approval and its mapped answer give the same verdict."""
    for text in ["yes", " OK ", "1", "2", "sure", "Approve & remember"]:
        mapped = map_text("approval", [CODEX_PERMISSIONS], text)
        assert verdict(mapped) == ("approve" if is_affirmative(text) else "deny")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["answer", "question", "x"]), children, max_size=3)
    ),
    max_leaves=12,
)


@given(json_values)
def test_verdict_never_raises(answers: Any) -> None:
    """verdict() returns approve or deny for any JSON-like value, and never raises."""
    assert verdict(answers) in ("approve", "deny")


@given(json_values)
def test_check_structured_never_raises(raw: Any) -> None:
    """check_structured() never raises: a set is usable, absent, or refused with a reason."""
    entries, why = check_structured(raw)
    assert entries is None or why is None
    if entries is not None:
        assert all(isinstance(a, str) for e in entries for a in e["answer"])


# -- rendering -------------------------------------------------------------------------------------


def test_render_content_matches_the_spec_example() -> None:
    """The pending_prompt text is the question and its numbered options, exactly as the spec."""
    question = Question(
        question="What's the deployment target?",
        options=[
            Option(label="staging", description="push to staging.example.com"),
            Option(label="production", description="push to www.example.com"),
        ],
    )
    assert render_content([question]) == (
        "What's the deployment target?\n"
        "  1. staging \u2014 push to staging.example.com\n"
        "  2. production \u2014 push to www.example.com"
    )


def test_render_content_omits_empty_descriptions() -> None:
    """An option without a description is just its number and label."""
    assert render_content([q("Pick?", "a", "b")]) == "Pick?\n  1. a\n  2. b"


def test_render_content_several_questions_without_blank_lines_or_header() -> None:
    """Questions follow line by line: no header line, no blank lines, no header or multiSelect."""
    questions = [
        Question(
            question="Where should the data come from?",
            header="Source",
            options=[Option(label="CSV import", description="a file")],
        ),
        Question(
            question="Which sections?",
            header="Sections",
            multiSelect=True,
            options=[Option(label="KPI cards"), Option(label="Table")],
        ),
        Question(question="Any preference for visual style?", header="Style"),
    ]
    assert render_content(questions) == (
        "Where should the data come from?\n"
        "  1. CSV import \u2014 a file\n"
        "Which sections?\n"
        "  1. KPI cards\n"
        "  2. Table\n"
        "Any preference for visual style?"
    )


def test_render_content_free_text_question_is_just_the_question() -> None:
    """A question without options renders as its text alone."""
    assert render_content([FREE]) == FREE.question


def test_answered_content_single_label() -> None:
    """An answered resolution reads `✓ Answered: <label>`."""
    assert answered_content([Answer(question="Target?", answer=["staging"])]) == (
        "\u2713 Answered: staging"
    )


def test_answered_content_joins_labels_and_answers() -> None:
    """Labels are joined by `, ` within an answer and answers by `; `."""
    answers = [
        Answer(question="Where?", answer=["CSV import"]),
        Answer(question="Which?", answer=["KPI cards", "Table"]),
        Answer(question="Style?", answer=["dark theme"]),
    ]
    assert answered_content(answers) == "\u2713 Answered: CSV import; KPI cards, Table; dark theme"


def test_cancelled_content_with_reason() -> None:
    """A cancelled resolution reads `✗ Cancelled: <reason>`."""
    assert cancelled_content("the run ended") == "\u2717 Cancelled: the run ended"


def test_cancelled_content_without_reason() -> None:
    """With an empty reason there is no colon: just `✗ Cancelled`."""
    assert cancelled_content("") == "\u2717 Cancelled"


# -- properties ----------------------------------------------------------------------------------

WORDS = ["staging", "KPI", "cards", "Table", "straße", "STRASSE", "yes", "Approve", "1", "2", "10"]
label_text = st.one_of(
    st.sampled_from([*WORDS, "", " ", "KPI cards", "²", "٣", "a b c"]),
    st.text(max_size=12),
)
options = st.lists(st.builds(Option, label=label_text, description=st.text(max_size=5)), max_size=6)
questions = st.builds(
    Question, question=st.text(max_size=10), options=options, multiSelect=st.booleans()
)


@st.composite
def replies(draw: st.DrawFn, labels: Sequence[str] = ()) -> str:
    """Reply text: labels, their case variants, numbers and separators, or anything at all."""
    pool = [*labels, *WORDS, "0", "99", "²", "٣"]
    token = st.sampled_from(pool) | st.sampled_from(pool).map(str.upper)
    sep = st.sampled_from([",", " ", ", ", " ,", ",,", "\t", "\u00a0", "\u3000", "\n"])
    parts = draw(st.lists(st.tuples(token, sep), max_size=5))
    built = "".join(t + s for t, s in parts)
    return draw(st.sampled_from([built, built.strip()]) | st.text())


@st.composite
def prompts_and_replies(draw: st.DrawFn) -> tuple[str, list[Question], str]:
    kind = draw(st.sampled_from(["ask_user_question", "approval", "text"]))
    if kind == "ask_user_question":
        qs = draw(st.lists(questions, min_size=1, max_size=4))
    elif kind == "approval":
        qs = [draw(st.sampled_from([APPROVAL, CODEX_PERMISSIONS]))]
    else:
        qs = [Question(question=draw(st.text(max_size=10)))]
    labels = [o.label for question in qs for o in question.options]
    return kind, qs, draw(replies(labels))


@given(prompts_and_replies())
def test_map_text_is_total_and_well_formed(case: tuple[str, list[Question], str]) -> None:
    """map_text never raises, answers each question once with its text, labels or the raw text."""
    kind, qs, text = case
    answers = map_text(kind, qs, text)  # type: ignore[arg-type]
    assert [a.question for a in answers] == [question.question for question in qs]
    for question, answer in zip(qs, answers, strict=True):
        assert answer.answer, "an answer is never an empty list"
        if kind == "approval":
            assert answer.answer == (["Approve"] if is_affirmative(text) else ["Deny"])
        elif kind == "text":
            assert answer.answer == [text]
        else:
            labels = {o.label for o in question.options}
            assert all(a in labels or a == text for a in answer.answer)
            if not question.multiSelect or not question.options:
                assert len(answer.answer) == 1


@given(st.text(alphabet=st.characters(exclude_categories=())))
def test_prepare_never_raises(text: str) -> None:
    """prepare() never raises on any string, lone surrogates included."""
    prepared = prepare(text)
    assert prepared["raw"] == text


@given(st.text())
def test_prepare_is_json_serialisable(text: str) -> None:
    """What prepare() makes goes to Redis as JSON: every field serialises."""
    assert orjson.loads(orjson.dumps(prepare(text)))["raw"] == text


# -- the reference, for the properties below ------------------------------------------------------


def _reference_resolve(token: str, labels: Sequence[str]) -> str | None:
    """The earlier implementation's token resolution, with non-ASCII digits taken as text."""
    token = token.strip()
    if token.isascii() and token.isdigit():
        digits = token.lstrip("0")
        n = int(digits) if digits and len(digits) < 18 else (0 if not digits else 10**18)
        if 1 <= n <= len(labels):
            return labels[n - 1]
    for label in labels:
        if label and label.casefold() == token.casefold():
            return label
    return None


def reference_answer(question: Question, text: str) -> list[str]:
    """Spec 1.10 for one `ask_user_question` question, written as literally as possible."""
    labels = [o.label for o in question.options]
    if not labels:
        return [text]
    if not question.multiSelect:
        label = _reference_resolve(text, labels)
        return [text] if label is None else [label]
    tokens = re.split(r"[,\s]+", text.strip())
    picked = [lb for t in tokens if (lb := _reference_resolve(t, labels)) is not None]
    return picked or [text]


plain_label = st.one_of(
    st.sampled_from(["staging", "KPI", "Table", "straße", "yes", "1", "2", "²", "", "İ", "ǅ"]),
    st.text(max_size=8),
).filter(lambda s: not any(c.isspace() or c == "," for c in s))


@given(
    st.lists(plain_label, min_size=1, max_size=6),
    st.booleans(),
    st.data(),
)
def test_map_text_equals_the_reference_without_spaced_labels(
    labels: list[str], is_multi: bool, data: st.DataObject
) -> None:
    """With no whitespace in any label, the mapping is exactly the spec's rule."""
    question = q("Q?", *labels, multi=is_multi)
    text = data.draw(replies(labels))
    assert one("ask_user_question", question, text) == reference_answer(question, text)


spaced_label = st.lists(plain_label.filter(bool), min_size=1, max_size=3).map(" ".join)


@given(st.lists(spaced_label, min_size=1, max_size=6), st.data())
def test_multi_select_without_a_run_match_equals_the_reference(
    labels: list[str], data: st.DataObject
) -> None:
    """Multi-select with multi-word labels is the reference's whenever no run of words matches."""
    question = q("Q?", *labels, multi=True)
    words = [w for lb in labels for w in lb.split()]
    text = data.draw(replies(words))
    folds = {lb.casefold() for lb in labels if " " in lb}
    for segment in re.split(r",+", text.strip()):
        ws = [w.casefold() for w in segment.split()]
        runs = {" ".join(ws[i:j]) for i in range(len(ws)) for j in range(i + 2, len(ws) + 1)}
        assume(not runs & folds)
    assert one("ask_user_question", question, text) == reference_answer(question, text)
