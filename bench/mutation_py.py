"""Generated mutants for the Python modules: cosmic-ray's operators, each mutant tested alone.

bench/mutation.py is the hand-written catalogue (the Lua guards and chosen Python guards). This
is the generated half: cosmic-ray enumerates every mutant its operators can make in the chosen
functions of each module (comparisons flipped, `and`/`or` swapped, `not` added, booleans and
numbers changed, loops run zero times, break/continue swapped, exception types replaced), and
each one is applied alone to a scratch copy of the tree (`git archive HEAD`, never this working
tree) while only that module's own tests run there (`-x`, fakeredis only, a per-mutant timeout).
A mutant is killed when those tests fail or time out, survives when they pass.

Why cosmic-ray and not mutmut (mutmut was not tried here, for want of time): cosmic-ray edits
one file in place and runs an ordinary pytest command in a fresh subprocess per mutant, with a
timeout, so every test runs as it does in CI; its mutation positions carry line numbers, which is
how this run keeps to the functions named in TARGETS. mutmut 3 rewrites every function of a
module into a trampoline that dispatches to its mutants, and runs the tests in children forked
from one long-lived pytest process; with this suite's asyncio loops, Redis connection pools and
real-server fixtures, a fork per mutant was a risk not worth taking.

Some survivors are equivalent: no caller can observe them (`zip(strict=True)` made False over
lists equal by construction, a SCAN COUNT hint or a batch size moved, MULTI around plain reads,
whether a log line is written). Each is named in EQUIVALENT with why; run, listed, not scored.

    .venv/bin/python bench/mutation_py.py                   # every target, two jobs
    .venv/bin/python bench/mutation_py.py --only grants,audit
    .venv/bin/python bench/mutation_py.py --list            # the mutants, nothing run
    .venv/bin/python bench/mutation_py.py --jobs 1          # one scratch tree: half the CPU

391 mutants in all (answers 107, grants 61, audit 76, policy 147). With two jobs on two cores
shared with other work a run took 7.2 min with no survivor left (answers 2.8, grants 0.5, audit
1.2, policy 2.3), 12.1 min with 3 survivors, 15.9 min with 76: a survivor or an equivalent
mutant runs its module's every test, a killed one stops at the first failure.
    .venv/bin/python bench/mutation_py.py --no-guards       # without tests/test_guards_*.py

The scratch tree is `git archive HEAD` with this working tree's tests/test_guards_*.py laid over
it (so uncommitted guard tests count; `--no-guards` leaves them out). Tests that need a real
server are deselected (`-m "not real_redis"`): the Redis tests that run on both run on fakeredis.
TEST_REDIS_URL is passed on as the suite uses it; set it to your own database.
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    path: str  # the module, relative to the checkout
    tests: tuple[str, ...]  # pytest arguments: only the tests that matter for it
    functions: tuple[str, ...] = ()  # qualified names (Class.method) to mutate; () = all
    timeout: float = 60.0  # seconds per mutant; a timeout counts as killed


_GEN = "tests/test_guards_generated.py"

#: What is mutated, and by which tests. A restructuring of workers/ changes this table only.
TARGETS: dict[str, Target] = {
    "answers": Target(
        "broker/answers.py",
        (_GEN, "tests/broker/test_answers.py", "tests/broker/test_mapping_parity.py"),
        timeout=60,
    ),
    "grants": Target(
        "workers/agents/grants.py",
        (_GEN, "tests/agents/test_grants.py", "tests/test_guards_python.py"),
    ),
    "audit": Target(
        "workers/runtime/audit.py",
        (_GEN, "tests/runtime/test_audit.py", "tests/test_guards_python.py"),
        # The reconciler's decisions; startup, serve and the arq wiring are plumbing that
        # test_audit.py starts as a whole and a mutant there is a crash, not a wrong decision.
        functions=(
            "post_resolution",
            "reconcile",
            "rebuild_indexes",
            "_drop_orphans",
            "_drop_unrecorded",
            "_classify",
            "_prompt_batches",
        ),
        timeout=60,
    ),
    "policy": Target(
        "workers/agents/policy.py",
        (
            _GEN,
            "tests/agents/test_policy.py",
            "tests/agents/test_guarded.py",
            "tests/agents/test_policy_adversarial.py",
        ),
        # The decision functions: which rule applies and what the verdict is. The shell
        # analysis above them (analyse and its helpers) is its own large body, out of scope.
        functions=(
            "_globs_hit",
            "classify",
            "_within",
            "_outside",
            "_pattern_outside",
            "_call_outside",
            "_Context.folder",
            "_exec_match",
            "_matches",
            "_side_hits",
            "_stricter",
            "Guard.evaluate",
            "Guard._first_match",
            "Guard._side_effects",
            "Guard._watched",
            "Guard.decide",
            "_size",
            "refusal",
            "denied_item",
        ),
        timeout=90,
    ),
}

#: The operators run: the ones that make a plausible bug. Left out: every binary operator but
#: + and - (x * y -> x ** y is rarely a bug anyone writes), VariableReplacer/VariableInserter
#: (random, thousands of mutants), RemoveDecorator (drops @dataclass: the module does not load).
OPERATORS: tuple[str, ...] = (
    "core/ReplaceComparisonOperator_Eq_NotEq",
    "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceComparisonOperator_Lt_LtE",
    "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE",
    "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Lt_Gt",
    "core/ReplaceComparisonOperator_Gt_Lt",
    "core/ReplaceComparisonOperator_Is_IsNot",
    "core/ReplaceComparisonOperator_IsNot_Is",
    "core/ReplaceBinaryOperator_Add_Sub",
    "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceUnaryOperator_Delete_Not",
    "core/AddNot",
    "core/ReplaceTrueWithFalse",
    "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr",
    "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue",
    "core/ReplaceContinueWithBreak",
    "core/NumberReplacer",
    "core/ZeroIterationForLoop",
    "core/ExceptionReplacer",
)

_SAME_LENGTH = (
    "both sides are built from one list (one entry per option or question): never unequal"
)
_MULTI = (
    "reads (HMGET, EXISTS) give the same replies inside MULTI/EXEC on one server; the sweep"
    " needs no atomicity (the records decide, and the next sweep repairs a race)"
)
_COUNT = "SCAN's COUNT is a hint to the server: the members returned are the same"
_BATCH = "a batch boundary moved: every member is still handled once, only round trips change"
_STRICT, _TRUE, _NUM, _NOT, _GT = (
    "ReplaceTrueWithFalse",
    "ReplaceFalseWithTrue",
    "NumberReplacer",
    "AddNot",
    "ReplaceComparisonOperator_GtE_Gt",
)
_SCAN_KEYS = "async for key in broker.redis.scan_iter(match=broker.keys.prompt_pattern, count= {}):"
_SCAN_ZSET = "async for member, _ in broker.redis.zscan_iter(index, count= {}):"

#: Survivors no caller can observe: (target, function, operator, the mutated line as it reads
#: after the mutation, stripped, as the run prints it) and why. Run and listed, not scored.
_EQUIVALENT: list[tuple[str, str, str, str, str]] = [
    (
        "answers",
        "_by_label",
        _STRICT,
        'for label, label_fold in zip(m["labels"], m["folds"], strict=False):',
        "labels and folds: " + _SAME_LENGTH + " (matchers() makes both from q.options)",
    ),
    (
        "answers",
        "map_text",
        _STRICT,
        "return [Answer(question=q.question, answer=a) for q, a in zip(questions, mapped, "
        "strict=False)]",
        "map_prepared answers each matcher, matchers() makes one per question: " + _SAME_LENGTH,
    ),
    (
        "answers",
        "accept_structured",
        _STRICT,
        "for i, (entry, m) in enumerate(zip(entries, ms, strict=False)):",
        "the lengths were compared just above and an unequal set already returned",
    ),
    (
        "answers",
        "accept_structured",
        _STRICT,
        "for e, m in zip(entries, ms, strict=False)",
        "the lengths were compared above and an unequal set already returned",
    ),
    (
        "audit",
        "reconcile",
        _NOT,
        'if not counts["requeued"]:',
        "only chooses whether the audit.requeued log line is written; the counts are returned",
    ),
    ("audit", "rebuild_indexes", _TRUE, "pipe = broker.redis.pipeline(transaction=True)", _MULTI),
    (
        "audit",
        "rebuild_indexes",
        _STRICT,
        "for (_, thread_id, prompt_id), row in zip(batch, await pipe.execute(), strict=False):",
        "one HMGET is queued per batch entry: " + _SAME_LENGTH,
    ),
    ("audit", "_drop_unrecorded", _TRUE, "pipe = broker.redis.pipeline(transaction=True)", _MULTI),
    (
        "audit",
        "_drop_unrecorded",
        _STRICT,
        "gone = [m for m, found in zip(members, await pipe.execute(), strict=False) if not found]",
        "one EXISTS is queued per member: " + _SAME_LENGTH,
    ),
    ("audit", "_drop_orphans", _NUM, _SCAN_ZSET.format(1001), _COUNT),
    ("audit", "_drop_orphans", _NUM, _SCAN_ZSET.format(999), _COUNT),
    ("audit", "_drop_orphans", _NOT, "if not len(members) >= 500:", _BATCH + " (one per member)"),
    ("audit", "_drop_orphans", _NUM, "if len(members) >= 501:", _BATCH),
    ("audit", "_drop_orphans", _NUM, "if len(members) >= 499:", _BATCH),
    ("audit", "_drop_orphans", _GT, "if len(members) > 500:", _BATCH),
    ("audit", "_prompt_batches", _NUM, _SCAN_KEYS.format(1001), _COUNT),
    ("audit", "_prompt_batches", _NUM, _SCAN_KEYS.format(999), _COUNT),
    ("audit", "_prompt_batches", _NOT, "if not len(batch) >= 500:", _BATCH + " (one per key)"),
    ("audit", "_prompt_batches", _NUM, "if len(batch) >= 501:", _BATCH),
    ("audit", "_prompt_batches", _NUM, "if len(batch) >= 499:", _BATCH),
    ("audit", "_prompt_batches", _GT, "if len(batch) > 500:", _BATCH),
    (
        "policy",
        "Guard._first_match",
        _NUM,
        "for later in rules[i + 0 :]:",
        "the scan then starts at the allow rule itself, which is no deny: skipped as before",
    ),
]
EQUIVALENT: dict[tuple[str, str, str, str], str] = {e[:4]: e[4] for e in _EQUIVALENT}


@dataclass
class Mutant:
    target: str
    function: str
    operator: str
    occurrence: int
    line: int
    before: str = ""
    after: str = ""
    outcome: str = ""  # killed, survived, equivalent, incompetent, no-test
    seconds: float = 0.0
    output: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.target, self.function, self.operator.removeprefix("core/"), self.after)

    @property
    def name(self) -> str:
        return f"{self.target}:{self.line} {self.function} {self.operator.removeprefix('core/')}"


def _spans(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, innermost last."""
    spans: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    spans.append((first, child.end_lineno or child.lineno, name))
                walk(child, f"{name}.")

    walk(ast.parse(source), "")
    return spans


def _owner(spans: list[tuple[int, int, str]], line: int, wanted: tuple[str, ...]) -> str | None:
    """The innermost function holding `line` that is in `wanted` or nested in one (any, when
    `wanted` is empty)."""
    best: tuple[int, str] | None = None
    for first, last, name in spans:
        chosen = not wanted or any(name == w or name.startswith(w + ".") for w in wanted)
        if chosen and first <= line <= last and (best is None or first >= best[0]):
            best = (first, name)
    return None if best is None else best[1]


def enumerate_mutants(name: str, target: Target, tree: Path) -> list[Mutant]:
    """Every mutant of the chosen operators inside the chosen functions, in file order."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path  # type: ignore[import-untyped]
    from cosmic_ray.plugins import get_operator  # type: ignore[import-untyped]

    path = tree / target.path
    source = path.read_text()
    lines = source.splitlines()
    spans = _spans(source)
    module_ast = get_ast_from_path(path)
    nodes = list(ast_nodes(module_ast))
    found: list[Mutant] = []
    for op_name in OPERATORS:
        operator = get_operator(op_name)()
        # The occurrence is counted over the whole module, as cosmic-ray applies it.
        positions = (p for node in nodes for p in operator.mutation_positions(node))
        for occurrence, (start, _end) in enumerate(positions):
            function = _owner(spans, start[0], target.functions)
            if function is None:
                continue
            found.append(
                Mutant(name, function, op_name, occurrence, start[0], lines[start[0] - 1].strip())
            )
    found.sort(key=lambda m: (m.line, m.operator, m.occurrence))
    return found


def _mutated_line(mutant: Mutant, path: Path) -> str:
    from cosmic_ray.mutating import mutate_code  # type: ignore[import-untyped]
    from cosmic_ray.plugins import get_operator

    code = path.read_text()
    mutated = mutate_code(code, get_operator(mutant.operator)(), mutant.occurrence)
    if mutated is None:
        return ""
    old, new = code.splitlines(), str(mutated).splitlines()
    for a, b in zip(old, new, strict=False):
        if a != b:
            return str(b.strip())
    return ""


def make_tree(guards: bool) -> Path:
    """A scratch copy of HEAD (plus this tree's tests/test_guards_*.py when `guards`)."""
    tree = Path(tempfile.mkdtemp(prefix="mutpy-"))
    archive = subprocess.run(
        ["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    if guards:
        for test in (ROOT / "tests").glob("test_guards_*.py"):
            shutil.copy2(test, tree / "tests" / test.name)
    return tree


def _command(tree: Path, target: Target) -> str:
    tests = [t for t in target.tests if (tree / t).exists()]
    pytest = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not real_redis",
        *tests,
    ]
    # cosmic-ray runs the command without a shell and in our cwd: the cd makes the scratch tree
    # the rootdir (and first on sys.path), so the mutated module is the one imported.
    inner = f"cd {shlex.quote(str(tree))} && exec {shlex.join(pytest)}"
    return shlex.join(["sh", "-c", inner])


def run_one(mutant: Mutant, target: Target, tree: Path) -> None:
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_item import (  # type: ignore[import-untyped]
        MutationSpec,
        TestOutcome,
        WorkerOutcome,
    )

    path = tree / target.path
    mutant.after = _mutated_line(mutant, path)
    spec = MutationSpec(
        module_path=path,
        operator_name=mutant.operator,
        occurrence=mutant.occurrence,
        start_pos=(mutant.line, 0),
        end_pos=(mutant.line, 1),
        operator_args={},
    )
    started = time.monotonic()
    result = mutate_and_test([spec], _command(tree, target), target.timeout)
    mutant.seconds = time.monotonic() - started
    if result.worker_outcome == WorkerOutcome.NO_TEST:
        mutant.outcome = "no-test"
    elif result.test_outcome == TestOutcome.KILLED:
        mutant.outcome = "killed"
    elif result.test_outcome == TestOutcome.SURVIVED:
        mutant.outcome = "equivalent" if mutant.key in EQUIVALENT else "survived"
    else:
        mutant.outcome = "incompetent"
        mutant.output = (result.output or "")[-400:]


def baseline(name: str, target: Target, tree: Path) -> float:
    """The target's tests on the unmutated tree: they must pass, or no score means anything."""
    started = time.monotonic()
    done = subprocess.run(
        shlex.split(_command(tree, target)), check=False, capture_output=True, text=True
    )
    took = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{name}: the tests fail on the unmutated tree:\n{done.stdout[-2000:]}")
    return took


def _chunks(items: list[Mutant], jobs: int) -> Iterator[list[Mutant]]:
    for j in range(jobs):
        yield items[j::jobs]


def run_target(name: str, trees: list[Path], quiet: bool) -> list[Mutant]:
    target = TARGETS[name]
    mutants = enumerate_mutants(name, target, trees[0])
    took = baseline(name, target, trees[0])
    print(f"== {name} ({target.path}): {len(mutants)} mutants, tests {took:.1f} s unmutated")
    started = time.monotonic()

    def work(chunk: list[Mutant], tree: Path) -> None:
        for mutant in chunk:
            run_one(mutant, target, tree)
            if not quiet and mutant.outcome != "killed":
                print(f"   {mutant.outcome:11} {mutant.name}: {mutant.after}", flush=True)

    with ThreadPoolExecutor(len(trees)) as pool:
        for future in [
            pool.submit(work, chunk, tree)
            for chunk, tree in zip(_chunks(mutants, len(trees)), trees, strict=True)
        ]:
            future.result()
    print(f"   {name}: {len(mutants)} mutants in {(time.monotonic() - started) / 60:.1f} min")
    return mutants


def report(results: dict[str, list[Mutant]], seconds: float) -> int:
    print()
    print(f"{'module':10} {'mutants':>7} {'killed':>6} {'survived':>8} {'equiv':>5} {'score':>6}")
    total_k = total_s = 0
    for name, mutants in results.items():
        killed = sum(m.outcome == "killed" for m in mutants)
        survived = sum(m.outcome == "survived" for m in mutants)
        equivalent = sum(m.outcome == "equivalent" for m in mutants)
        scored = killed + survived
        score = f"{100 * killed / scored:.1f}%" if scored else "-"
        print(f"{name:10} {len(mutants):7} {killed:6} {survived:8} {equivalent:5} {score:>6}")
        total_k += killed
        total_s += survived
    if total_k + total_s:
        print(
            f"{'all':10} {'':7} {total_k:6} {total_s:8} {'':5} "
            f"{100 * total_k / (total_k + total_s):5.1f}%"
        )
    print(f"wall time {seconds / 60:.1f} min")
    for name, mutants in results.items():
        odd = [m for m in mutants if m.outcome in ("survived", "incompetent", "no-test")]
        equiv = [m for m in mutants if m.outcome == "equivalent"]
        if odd:
            print(f"\nsurvivors in {name}:")
            for m in odd:
                print(f"  {m.outcome:11} {m.name}\n      {m.before}\n   -> {m.after}")
                if m.output:
                    print(f"      {m.output.strip().splitlines()[-1]}")
        if equiv:
            print(f"\nequivalent in {name} (not scored):")
            for m in equiv:
                print(f"  {m.name}: {m.after}\n      why: {EQUIVALENT[m.key]}")
    return 0 if total_s == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated targets: " + ",".join(TARGETS))
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--jobs", type=int, default=2, help="scratch trees run side by side")
    parser.add_argument("--no-guards", action="store_true", help="leave out test_guards_*.py")
    parser.add_argument("--quiet", action="store_true", help="no line per survivor as it runs")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    trees = [make_tree(not args.no_guards) for _ in range(max(1, args.jobs))]
    try:
        if args.list:
            for name in names:
                for m in enumerate_mutants(name, TARGETS[name], trees[0]):
                    print(f"{m.name}: {m.before}")
            return 0
        started = time.monotonic()
        results = {name: run_target(name, trees, args.quiet) for name in names}
        return report(results, time.monotonic() - started)
    finally:
        for tree in trees:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
    sys.exit(main())
