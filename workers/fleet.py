"""A local fleet: N replica processes and the audit worker on one Redis, supervised.

With no Redis URL given, the fleet brings its own: a private `redis-server` (AOF on, in a
temporary folder) when one is on PATH, else an embedded fakeredis server in this process; it
says which. Replicas are real processes, so one can be killed (`kill -9`) and its threads are
adopted by the others, as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
import redis.asyncio

from broker import Settings

logger = logging.getLogger("workers.fleet")

__all__ = ["EmbeddedRedis", "Fleet", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


class EmbeddedRedis:
    """A Redis for a local fleet: a private redis-server if there is one, else fakeredis."""

    def __init__(self) -> None:
        self.url = ""
        self.kind = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._fake: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        port = free_port()
        self.url = f"redis://127.0.0.1:{port}/0"
        exe = shutil.which("redis-server")
        if exe is not None:
            self._dir = tempfile.TemporaryDirectory(prefix="prompt-broker-redis-")
            self._proc = subprocess.Popen(
                [
                    exe,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    self._dir.name,
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--daemonize",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.kind = f"a private redis-server (AOF on) at {self.url}"
        else:
            try:
                from fakeredis import TcpFakeServer
            except ImportError:
                raise RuntimeError(
                    "no Redis given, no redis-server on PATH and no fakeredis installed: pass "
                    "--redis-url, install redis-server, or pip install 'prompt-broker[embedded]'"
                ) from None
            self._fake = TcpFakeServer(
                ("127.0.0.1", port), server_type="redis", server_version=(7, 0)
            )
            self._thread = threading.Thread(target=self._fake.serve_forever, daemon=True)
            self._thread.start()
            self.kind = f"an embedded fakeredis server at {self.url} (no redis-server on PATH)"
        deadline = time.monotonic() + 10
        while not _answers(self.url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded Redis at {self.url} did not start")
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(10)
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc = None
        if self._fake is not None:
            self._fake.shutdown()
            self._fake.server_close()
            self._fake = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


@dataclass
class Process:
    """One process of the fleet."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started: float = 0.0
    backoff: float = 0.0
    next_start: float = 0.0
    log: Path | None = None
    expected_exit: bool = False
    extra: dict[str, str] = field(default_factory=dict)


class Fleet:
    """N replicas and one audit worker, as child processes, on one Redis."""

    def __init__(
        self,
        settings: Settings,
        workers: int = 2,
        *,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        restart: bool = True,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.embedded: EmbeddedRedis | None = None
        self.url = settings.redis_url
        self.log_dir = log_dir
        self.extra_env = env or {}
        self.restart = restart
        self.processes: list[Process] = []
        self._watch: asyncio.Task[None] | None = None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPT_BROKER_")}
        for name, value in self.settings.model_dump().items():
            # Lists and objects (policy_rules) go as JSON, as Settings.from_env reads them.
            text = orjson.dumps(value).decode() if isinstance(value, list | dict) else str(value)
            env[f"PROMPT_BROKER_{name.upper()}"] = text
        env["PROMPT_BROKER_REDIS_URL"] = self.url
        env.update(self.extra_env)
        return env

    async def start(self, *, embedded: bool = False) -> None:
        if embedded:
            self.embedded = EmbeddedRedis()
            self.url = await asyncio.to_thread(self.embedded.start)
            logger.info("fleet.redis", extra={"using": self.embedded.kind})
        py = sys.executable
        for i in range(1, self.workers + 1):
            name = f"replica-{i}"
            self.processes.append(Process(name, [py, "-m", "workers.cli", "worker", "--id", name]))
        self.processes.append(Process("audit", [py, "-m", "workers.cli", "audit"]))
        for p in self.processes:
            self._spawn(p)
        self._watch = asyncio.create_task(self._supervise())

    async def ready(self, within: float = 30.0) -> None:
        """Wait until every replica has said it is alive (so work spreads over all of them)."""
        from broker import Keys

        client = redis.asyncio.Redis.from_url(self.url)
        key = Keys(self.settings.key_prefix).replicas
        deadline = time.monotonic() + within
        try:
            while await client.zcard(key) < self.workers:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"only {await client.zcard(key)} of {self.workers} "
                        f"replicas came up within {within:.0f} s"
                    )
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    def _spawn(self, p: Process) -> None:
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            p.log = self.log_dir / f"{p.name}.log"
            out = p.log.open("ab")
        p.proc = subprocess.Popen(p.argv, env=self._env(), stdout=out, stderr=out)
        p.started = time.monotonic()
        p.expected_exit = False
        logger.info("fleet.started", extra={"child": p.name, "pid": p.proc.pid})

    def replica(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL, *, restart: bool = False) -> int:
        """Send `sig` to a process; with `restart` the supervisor starts it again."""
        p = self.replica(name)
        assert p.proc is not None
        p.expected_exit = not restart
        os.kill(p.proc.pid, sig)
        logger.info("fleet.signalled", extra={"child": name, "signal": signal.Signals(sig).name})
        return p.proc.pid

    async def _supervise(self) -> None:
        """Restart what dies unasked; back off (1 s doubling to 30 s) what dies at once."""
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for p in self.processes:
                if p.proc is None:
                    if now >= p.next_start:
                        p.restarts += 1
                        self._spawn(p)
                    continue
                if p.proc.poll() is None or p.expected_exit:
                    continue
                logger.warning("fleet.exited", extra={"child": p.name, "code": p.proc.returncode})
                if not self.restart:
                    p.expected_exit = True
                    continue
                quick = now - p.started < 5
                p.backoff = min(30.0, max(1.0, p.backoff * 2)) if quick else 0.0
                p.next_start = now + p.backoff
                p.proc = None

    async def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every process (replicas park and release their threads), then stop Redis."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        live = [p.proc for p in self.processes if p.proc is not None and p.proc.poll() is None]
        for p in self.processes:
            p.expected_exit = True
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        for proc in live:
            try:
                await asyncio.to_thread(proc.wait, grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
