"""What PROMPT_BROKER_WAIT_REPLICAS costs: an answer's post latency (`post_item` on an open
prompt, the route script's commit, plus `WAIT n timeout` when on), with it off and with
`WAIT 1`, interleaved in one run on a private six-node Redis Cluster (three primaries, a replica
each, on loopback: the same one tests/conftest.py starts). The prompts are asked beforehand and
not timed. Loopback replicas are the floor: a replica across a network adds its round trip.

    .venv/bin/python bench/bench_cluster_wait.py             # 300 answers each way
    .venv/bin/python bench/bench_cluster_wait.py --answers 50
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker import Broker, Settings
from broker.models import Question
from tests.conftest import start_cluster


def _answer(words: str) -> dict[str, object]:
    return {"content": [{"type": "text", "text": words}]}


async def _latencies(url: str, answers: int) -> dict[str, list[float]]:
    prefix = "bw" + uuid.uuid4().hex[:6]
    off = Settings(key_prefix=prefix)
    on = Settings(key_prefix=prefix, wait_replicas=1, wait_timeout=1.0)
    out: dict[str, list[float]] = {"off": [], "WAIT 1": []}
    async with (
        Broker.from_url(url, off, cluster=True) as b_off,
        Broker.from_url(url, on, cluster=True) as b_on,
    ):
        for i in range(answers):
            for name, b in (("off", b_off), ("WAIT 1", b_on)):  # interleaved: same conditions
                thread = f"{name[0]}{i}"
                await b.ask(thread, "text", [Question(question="Name?")])
                started = time.perf_counter()
                routed = await b.post_item(thread, _answer("Ann"))
                out[name].append((time.perf_counter() - started) * 1000)
                assert routed.outcome == "answered"
    return out


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=300, help="answers timed each way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cluster = start_cluster(Path(d))
        try:
            got = asyncio.run(_latencies(cluster.url, args.answers))
        finally:
            cluster.stop()
    print(f"answer latency on a local 3x2 Redis Cluster, {args.answers} answers each (ms):")
    for name, values in got.items():
        print(
            f"  {name:7} p50 {statistics.median(values):6.3f}  p90 {_pct(values, 0.9):6.3f}"
            f"  p99 {_pct(values, 0.99):6.3f}"
        )
    extra = statistics.median(got["WAIT 1"]) - statistics.median(got["off"])
    print(f"  WAIT 1 adds {extra:.3f} ms at the median")


if __name__ == "__main__":
    main()
