"""Benchmark the guarded policy's decisions against parsing alone, in the same run.

For each command: the time of `Guard.decide` under the policy the adversarial tests use (default
ask, an allow for `git status*`, denies for `rm *` and `touch *`, writes and reads outside the
work folder denied), beside the time tree-sitter-bash takes to parse the same string alone (a
fresh parse, no walk). Two sets:

1. the adversarial corpus of tests/agents/test_policy_adversarial.py (about 100 short commands, each
   decided `--repeat` times; the figure is per decision);
2. 64 KB of each pathological shape there (20 shapes, each decided `--repeat` times).

Printed: p50 and max of each set, decision and parse side by side, and the slowest shape.

    .venv/bin/python bench/bench_policy.py              # 20 repeats
    .venv/bin/python bench/bench_policy.py --repeat 5   # quicker
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tree_sitter_bash
from tree_sitter import Language, Parser

from tests.agents.test_policy_adversarial import ALLOW_LIST, CORPUS, PATHOLOGICAL, guard

PARSER = Parser(Language(tree_sitter_bash.language()))


def timed(action: Callable[[], object], repeat: int) -> list[float]:
    """Seconds each of `repeat` runs of `action` took."""
    took = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        took.append(time.perf_counter() - started)
    return took


def measure(commands: dict[str, str], repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """The median decision time and the median parse time of each command (seconds)."""
    g = guard(ALLOW_LIST)
    decide: dict[str, float] = {}
    parse: dict[str, float] = {}
    for name, command in commands.items():
        data = command.encode("utf-8", "surrogatepass")
        decide[name] = statistics.median(
            timed(lambda c=command: g.decide("claude_code", "Bash", {"command": c}), repeat)
        )
        parse[name] = statistics.median(timed(lambda d=data: PARSER.parse(d), repeat))
    return decide, parse


def report(title: str, decide: dict[str, float], parse: dict[str, float]) -> None:
    def ms(seconds: float) -> str:
        return f"{seconds * 1000:8.3f} ms"

    slowest = max(decide, key=lambda name: decide[name])
    print(f"{title} ({len(decide)} commands)")
    print(f"  decide  p50 {ms(statistics.median(decide.values()))}  max {ms(max(decide.values()))}")
    print(f"  parse   p50 {ms(statistics.median(parse.values()))}  max {ms(max(parse.values()))}")
    print(f"  slowest decision: {slowest!r} {ms(decide[slowest])} (parse {ms(parse[slowest])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="decisions per command")
    args = parser.parse_args()
    corpus = {command: command for command, _, _ in CORPUS}
    report("adversarial corpus", *measure(corpus, args.repeat))
    large = measure(PATHOLOGICAL, args.repeat)
    report("64 KB pathological shapes", *large)
    print("  per shape (decide / parse):")
    for name in PATHOLOGICAL:
        print(f"    {name:24} {large[0][name] * 1000:8.2f} ms / {large[1][name] * 1000:7.2f} ms")


if __name__ == "__main__":
    main()
