"""A local fleet: N replica processes and the audit worker on one Redis, supervised.

With no Redis URL given, the fleet brings its own: a private `redis-server` (AOF on) when one is
on PATH, else an embedded fakeredis server in this process that keeps nothing; it says which.
`prompt-broker up` gives it a data folder, so its threads and open prompts outlive a restart at
the same address; the demo gives it none (a throwaway folder). Replicas are real processes, so
one can be killed (`kill -9`) and its threads are adopted by the others, as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
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
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import orjson
import redis
import redis.asyncio

from broker import Settings
from broker._cluster import cluster_client
from broker.cli import CliError, fleet_record, read_local_fleet
from workers.runtime.redis_server import RedisServer, free_port

logger = logging.getLogger("workers.runtime.fleet")

__all__ = ["FIRST_PORT", "EmbeddedRedis", "Fleet", "FleetError"]


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


class FleetError(CliError):
    """The fleet could not start: one line for the person, no traceback."""


#: The port a local fleet's own Redis takes the first time, when free; it is recorded in the
#: data folder and reused by every later start, so the fleet's address stays the same.
FIRST_PORT = 6390


def _port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:port (SO_REUSEADDR, as redis-server binds)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _serves_dir(url: str, folder: Path) -> bool:
    """Whether the redis-server at `url` keeps its data in `folder`: a server of ours that
    outlived its fleet (kill -9 of `up`). A second server on the same AOF would corrupt it."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        try:
            reply: dict[Any, Any] = client.config_get("dir")  # type: ignore[assignment]
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False
    served = reply.get("dir") or reply.get(b"dir")
    if isinstance(served, bytes):
        served = served.decode(errors="replace")
    return isinstance(served, str) and Path(served).resolve() == folder.resolve()


class EmbeddedRedis:
    """A Redis for a local fleet: a private redis-server if there is one, else fakeredis.

    With a `data_dir` (what `prompt-broker up` uses) the redis-server keeps its data there (AOF
    on) and comes back at the address recorded in `data_dir/fleet.json`, which the CLI reads
    to find the fleet; a lock file keeps a second fleet off the same folder. Without one
    (the demo) the server lives in a temporary folder deleted on exit. The fakeredis fallback
    keeps nothing, whatever the folder, and says so.
    """

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir = data_dir
        self.url = ""
        self.kind = ""
        self.keeps_data = False
        self._server: RedisServer | None = None
        self._adopted = False
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._lock: IO[bytes] | None = None
        self._fake: Any = None
        self._thread: threading.Thread | None = None

    # -- the data folder ------------------------------------------------------------------

    def _take_folder(self) -> int:
        """Create and lock the data folder; the port to use (the recorded one if any)."""
        assert self.data_dir is not None
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            (self.data_dir / "redis").mkdir(exist_ok=True)
            self._lock = (self.data_dir / "fleet.lock").open("a+b")
        except OSError as e:
            raise FleetError(
                f"cannot use the data folder {self.data_dir}: {e.strerror or e} "
                "(choose another with --data-dir)"
            ) from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            self._lock = None
            raise FleetError(
                f"another `prompt-broker up` is running on the data folder {self.data_dir}: "
                "stop it first, or give this one another --data-dir"
            ) from None
        record = read_local_fleet(self.data_dir)
        return record.port if record is not None else 0

    def _record(self, server: str) -> None:
        if self.data_dir is None:
            return
        document = {
            "url": self.url,
            "server": server,
            "keeps_data": self.keeps_data,
            "data_dir": str(self.data_dir),
            "pid": os.getpid(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        path = fleet_record(self.data_dir)
        tmp = path.with_suffix(".tmp")
        # Written whole, then renamed: a CLI reading it never sees half a record.
        tmp.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
        tmp.replace(path)

    def _choose_port(self, recorded: int) -> int:
        if recorded and _port_free(recorded):
            return recorded
        if recorded and self.data_dir is not None:
            url = f"redis://127.0.0.1:{recorded}/0"
            if shutil.which("redis-server") and _serves_dir(url, self.data_dir / "redis"):
                self._adopted = True  # ours, left running by a fleet that was killed
                return recorded
            logger.warning("fleet.port_taken", extra={"port": recorded})
            print(
                f"port {recorded}, where this fleet's Redis was, is taken by another program: "
                "moving it (the CLI finds the new address in "
                f"{fleet_record(self.data_dir)})",
                file=sys.stderr,
                flush=True,
            )
        if self.data_dir is not None and not recorded and _port_free(FIRST_PORT):
            return FIRST_PORT
        return free_port()

    # -- starting and stopping ------------------------------------------------------------

    def start(self) -> str:
        recorded = self._take_folder() if self.data_dir is not None else 0
        port = self._choose_port(recorded)
        self.url = f"redis://127.0.0.1:{port}/0"
        exe = shutil.which("redis-server")
        if self._adopted:
            self.keeps_data = True
            self.kind = (
                f"a private redis-server (AOF on, data in {self.data_dir}) at {self.url}, "
                "left running by an earlier fleet"
            )
            server = "redis-server"
        elif exe is not None:
            self._start_server(exe, port)
            server = "redis-server"
        else:
            self._start_fake(port)
            server = "fakeredis"
        self._wait_up()
        self._record(server)
        return self.url

    def _start_server(self, exe: str, port: int) -> None:
        if self.data_dir is not None:
            folder = self.data_dir / "redis"
            log = str(self.data_dir / "redis.log")
            self.keeps_data = True
            self.kind = f"a private redis-server (AOF on, data in {self.data_dir}) at {self.url}"
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="prompt-broker-redis-")
            folder = Path(self._dir.name)
            log = ""
            self.kind = f"a private redis-server (AOF on, a throwaway folder) at {self.url}"
        # AOF fsynced every second; its own session: a Ctrl-C at the terminal reaches `up` only,
        # which stops the replicas first (they park and release their threads) and Redis last.
        self._server = RedisServer(
            port, folder, appendfsync="everysec", logfile=log, loglevel=None, exe=exe,
            new_session=True,
        )  # fmt: skip
        self._server.spawn()

    def _start_fake(self, port: int) -> None:
        try:
            from fakeredis import TcpFakeServer
        except ImportError:
            raise FleetError(
                "no Redis given, no redis-server on PATH and no fakeredis installed: pass "
                "--redis-url, install redis-server, or pip install 'prompt-broker[embedded]'"
            ) from None
        self._fake = TcpFakeServer(("127.0.0.1", port), server_type="redis", server_version=(7, 0))
        self._thread = threading.Thread(target=self._fake.serve_forever, daemon=True)
        self._thread.start()
        self.kind = (
            f"an embedded fakeredis server at {self.url} (no redis-server on PATH). It keeps "
            "NOTHING: every thread and open prompt is lost when the fleet stops; install "
            "redis-server to keep them"
        )

    def _wait_up(self, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while not _answers(self.url):
            proc = self._server.proc if self._server is not None else None
            if proc is not None and proc.poll() is not None:
                where = f" (its log: {self.data_dir / 'redis.log'})" if self.data_dir else ""
                raise FleetError(
                    f"the fleet's redis-server at {self.url} exited with status "
                    f"{proc.returncode} as it started{where}"
                )
            if time.monotonic() > deadline:
                raise FleetError(f"the fleet's Redis at {self.url} did not start in {within:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # redis-server writes its AOF out and exits
            self._server = None
        if self._adopted:
            with contextlib.suppress(redis.RedisError, OSError):
                redis.Redis.from_url(self.url, socket_timeout=5).shutdown()
            self._adopted = False
        if self._fake is not None:
            self._fake.shutdown()
            self._fake.server_close()
            self._fake = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        if self._lock is not None:
            self._lock.close()  # and with it the lock
            self._lock = None


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

    async def start(self, *, embedded: bool = False, data_dir: Path | None = None) -> None:
        """Start Redis (`embedded`: one of our own, keeping its data in `data_dir` if given),
        then the processes. On failure, `stop()` still undoes whatever was started."""
        if embedded:
            self.embedded = EmbeddedRedis(data_dir)
            self.url = await asyncio.to_thread(self.embedded.start)
            logger.info("fleet.redis", extra={"using": self.embedded.kind})
        py = sys.executable
        parent = ["--parent", str(os.getpid())]  # they stop when this process dies
        for i in range(1, self.workers + 1):
            name = f"replica-{i}"
            argv = [py, "-m", "workers.runtime.cli", "worker", "--id", name, *parent]
            self.processes.append(Process(name, argv))
        self.processes.append(Process("audit", [py, "-m", "workers.runtime.cli", "audit", *parent]))
        for p in self.processes:
            self._spawn(p)
        self._watch = asyncio.create_task(self._supervise())

    async def ready(self, within: float = 30.0) -> None:
        """Wait until every replica has said it is alive (so work spreads over all of them)."""
        from broker import Keys

        cluster = self.settings.redis_cluster
        # On a cluster the replicas' key lives on the primary owning its slot: the cluster
        # client finds it, a plain one on the node the URL names would get MOVED.
        client: Any = (
            cluster_client(self.url) if cluster else redis.asyncio.Redis.from_url(self.url)
        )
        key = Keys(self.settings.key_prefix, cluster=cluster).replicas
        deadline = time.monotonic() + within
        try:
            while await client.zcard(key) < self.workers:
                if time.monotonic() > deadline:
                    raise FleetError(
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
        p.proc = subprocess.Popen(
            p.argv,
            env=self._env(),
            stdout=out,
            stderr=out,
            # A session of its own: a Ctrl-C at the terminal reaches the fleet, which stops its
            # processes in order, not every process at once (a replica takes a second signal
            # as "stop now", and Redis must outlive the replicas' parking).
            start_new_session=True,
        )
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
