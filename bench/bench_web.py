"""The HTTP API's figures, each beside its floor in the same run, on a private redis-server.

1. An answer over HTTP: the POST to `prompt-broker serve` sent -> the agent's `wait` returning,
   p50/p99, beside the library's own `post_item` -> `wait` (the floor); the target is at
   most 1.5 ms added at p50.
2. SSE fan-out: N clients on one `serve` process; a prompt asked -> all N having its
   `prompt.opened` event, p50/p99 over rounds; the server's memory per connection (RSS delta).
3. `GET /v1/prompts` requests per second with M open prompts (the first page, 50 prompts).

    .venv/bin/python bench/bench_web.py [--rounds 300] [--clients 1000] [--open 10000]
    .venv/bin/python bench/bench_web.py --clients 0 --buckets 16   # the indexes in 16 buckets

`serve` runs as its own process (uvicorn, one worker) so the client side and the server do not
share an event loop; the agent and the clients run in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import orjson
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.private_redis import free_port, private_redis
from broker import Broker, Settings
from web.settings import hash_token

TOKEN = "bench-token-0123456789"
APPROVAL = {"question": "Run `make deploy`?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
ANSWER = {"content": [{"type": "text", "text": "approve"}]}


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


@contextlib.asynccontextmanager
async def serve(
    url: str, prefix: str, folder: Path, buckets: int = 0
) -> AsyncIterator[tuple[str, int]]:
    """A `prompt-broker serve` process; yields its base URL and pid."""
    tokens = folder / "tokens.json"
    tokens.write_bytes(
        orjson.dumps([{"name": "bench", "token_sha256": hash_token(TOKEN), "scopes": ["admin"]}])
    )
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")},
        "PROMPT_BROKER_REDIS_URL": url,
        "PROMPT_BROKER_KEY_PREFIX": prefix,
        "PROMPT_BROKER_API_HEARTBEAT": "30",
        "PROMPT_BROKER_INDEX_BUCKETS": str(buckets),
    }
    argv = ["-m", "workers.runtime.cli", "serve", "--port", str(port), "--tokens", str(tokens)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=env, stderr=asyncio.subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base) as c:
            for _ in range(400):
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        yield base, proc.pid
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class RawHttp:
    """One keep-alive HTTP/1.1 connection written by hand, so that "sent" means the bytes went
    out: a client library's own request building is not counted against the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, base: str) -> RawHttp:
        url = httpx.URL(base)
        return cls(*await asyncio.open_connection(url.host, url.port))

    @staticmethod
    def request(path: str, body: bytes) -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def response(self) -> int:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(
            int(v)
            for k, _, v in (x.partition(": ") for x in lines)
            if k.lower() == "content-length"
        )
        await self.reader.readexactly(length)
        return int(lines[0].split()[1])

    async def aclose(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def _round(b: Broker, thread: str, post: Callable[[], Awaitable[None]]) -> float:
    """One prompt answered by `post`: seconds from the post starting to the wait returning."""
    p = await b.ask(thread, "approval", [APPROVAL])

    async def wait() -> float:
        await b.wait(thread, p.prompt_id, timeout=10)
        return time.perf_counter()  # the moment it returns, whatever else the loop does next

    waiting = asyncio.create_task(wait())
    await asyncio.sleep(0)  # the wait is subscribed (ask already subscribed)
    t0 = time.perf_counter()
    await post()
    return await waiting - t0


async def answers(b: Broker, base: str, rounds: int) -> None:
    """POST -> wait returning (raw socket, and an httpx client), beside post_item -> wait,
    interleaved round by round."""
    samples: dict[str, list[float]] = {"raw": [], "httpx": [], "lib": []}
    raw = await RawHttp.open(base)
    body = orjson.dumps(ANSWER)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base, headers=headers) as c:
        for i in range(rounds + 20):  # the first 20 warm up every path
            for how, kept in samples.items():
                thread = f"{how}-{i}"
                request = raw.request(f"/v1/threads/{thread}/items", body)

                async def post(
                    how: str = how, thread: str = thread, request: bytes = request
                ) -> None:
                    if how == "raw":
                        raw.writer.write(request)
                        await raw.writer.drain()
                    elif how == "httpx":
                        r = await c.post(f"/v1/threads/{thread}/items", json=ANSWER)
                        assert r.status_code == 200, r.text
                    else:
                        await b.post_item(thread, ANSWER)

                took = await _round(b, thread, post)
                if how == "raw":
                    assert await raw.response() == 200
                if i >= 20:
                    kept.append(took)
    await raw.aclose()
    floor = pct(samples["lib"], 50)
    print(f"answer -> the agent's wait returns ({rounds} rounds each, interleaved)")
    for how, label in (
        ("raw", "POST over HTTP (bytes sent)"),
        ("httpx", "POST with an httpx client"),
        ("lib", "library post_item (floor)"),
    ):
        s = samples[how]
        added = "" if how == "lib" else f"  added at p50 {ms(pct(s, 50) - floor)}"
        print(f"  {label:29} p50 {ms(pct(s, 50))}  p99 {ms(pct(s, 99))}{added}")
    added = pct(samples["raw"], 50) - floor
    print(f"  bound: at most 1.50 ms added at p50: {'met' if added <= 0.0015 else 'NOT met'}")


async def _client(base: str, got: list[asyncio.Queue[float]], ready: asyncio.Event) -> None:
    queue: asyncio.Queue[float] = asyncio.Queue()
    got.append(queue)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        httpx.AsyncClient(base_url=base, headers=headers, timeout=None) as c,
        c.stream("GET", "/v1/events") as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("event: ready"):
                ready.set()
            elif line.startswith("event: prompt.opened"):
                queue.put_nowait(time.perf_counter())


async def fanout(b: Broker, base: str, pid: int, clients: int, rounds: int) -> None:
    before = rss_kb(pid)
    got: list[asyncio.Queue[float]] = []
    readies = [asyncio.Event() for _ in range(clients)]
    tasks = [asyncio.create_task(_client(base, got, readies[i])) for i in range(clients)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 120)
    after = rss_kb(pid)
    spans: list[float] = []
    for i in range(rounds):
        t0 = time.perf_counter()
        await b.ask(f"fan-{i}", "approval", [APPROVAL])
        last = max([await asyncio.wait_for(q.get(), 30) for q in got])
        spans.append(last - t0)
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"SSE fan-out to {clients} clients ({rounds} prompts): asked -> all {clients} have it")
    print(f"  p50 {ms(pct(spans, 50))}  p99 {ms(pct(spans, 99))}")
    print(
        f"  server RSS {before} KB -> {after} KB with {clients} streams open: "
        f"{(after - before) / clients:.1f} KB per connection"
    )


async def listing(b: Broker, base: str, open_prompts: int, seconds: float) -> None:
    batch = 500
    for start in range(0, open_prompts, batch):
        await asyncio.gather(
            *(b.ask(f"open-{i}", "approval", [APPROVAL]) for i in range(start, start + batch))
        )
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base, headers=headers) as c:
        first = (await c.get("/v1/prompts")).json()
        assert len(first["prompts"]) == 50 and first["next_cursor"]
        done = 0
        t0 = time.perf_counter()

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() - t0 < seconds:
                r = await c.get("/v1/prompts")
                assert r.status_code == 200
                done += 1

        await asyncio.gather(*(loop() for _ in range(8)))
        took = time.perf_counter() - t0
    print(f"GET /v1/prompts (first page of 50) with {open_prompts} open prompts, 8 concurrent:")
    print(f"  {done / took:.0f} requests/s over {took:.1f} s")


async def main(args: argparse.Namespace) -> None:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    with private_redis(exe, free_port()) as url, tempfile.TemporaryDirectory() as tmp:
        prefix = "bw" + uuid.uuid4().hex[:6]
        settings = Settings(key_prefix=prefix, index_buckets=args.buckets)
        async with (
            Broker(Redis.from_url(url, decode_responses=True), settings, owns_client=True) as b,
            serve(url, prefix, Path(tmp), args.buckets) as (base, pid),
        ):
            print(f"discovery index buckets: {b.keys.buckets}")
            await answers(b, base, args.rounds)
            if args.clients:
                await fanout(b, base, pid, args.clients, args.fan_rounds)
            if args.open:
                await listing(b, base, args.open, args.seconds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--fan-rounds", type=int, default=20)
    parser.add_argument("--open", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--buckets", type=int, default=0, help="PROMPT_BROKER_INDEX_BUCKETS (0: auto, 1 here)"
    )
    asyncio.run(main(parser.parse_args()))
