"""The `codex app-server` process of one turn and its JSON-RPC connection: one JSON object per
line over stdio, no `"jsonrpc"` field. `Rpc` frames and matches our requests, notifications and
replies, and hands the server's own requests and notifications to callbacks; `AppServer` starts
the process (its `config.toml`, its environment, its own process group) and stops it as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workers.agents.codex_config import KEY_ENV, CodexConfig, config_toml

__all__ = ["AppServer", "CodexError", "Rpc", "Trace"]

logger = logging.getLogger("workers.agents.codex")  # one logger for all the harness's modules

STDOUT_LIMIT = 64 * 1024 * 1024  # one JSON-RPC line (a resumed thread's history can be large)
EXIT_GRACE = 5.0  # seconds for the app-server to exit once its stdin is closed

#: A hook for tests and benchmarks: `trace(event, data)` with events `spawn` `{pid, thread_id}`,
#: `recv` / `send` `{pid, msg}` (every JSON-RPC message) and `exit` `{pid, rc}`.
Trace = Callable[[str, dict[str, Any]], None]


class CodexError(Exception):
    """The app-server failed, or answered one of our requests with an error."""


class Rpc:
    """JSON-RPC over the app-server's stdio."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        on_request: Callable[[dict[str, Any]], None],
        on_notification: Callable[[dict[str, Any]], None],
        trace: Trace | None,
    ) -> None:
        self.proc = proc
        self.on_request = on_request
        self.on_notification = on_notification
        self.trace = trace
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ids = 0
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.reader = asyncio.create_task(self._read(), name="codex stdout")

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except ValueError:
                    logger.warning("codex.bad_line", extra={"line": line[:200]})
                    continue
                if not isinstance(msg, dict):
                    continue
                if self.trace is not None:
                    self.trace("recv", {"pid": self.proc.pid, "msg": msg})
                self._dispatch(msg)
        except (OSError, ValueError) as e:  # ValueError: a line past the stream limit
            logger.warning("codex.read_failed", extra={"error": repr(e)})
        finally:
            error = CodexError("the codex app-server closed its output")
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(error)
            if not self.closed.done():
                self.closed.set_result(None)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "method" in msg and "id" in msg:
            self.on_request(msg)
        elif "method" in msg:
            self.on_notification(msg)
        elif isinstance(msg.get("id"), int) and msg["id"] in self.pending:
            fut = self.pending.pop(msg["id"])
            if fut.done():
                return
            if "error" in msg:
                fut.set_exception(CodexError(str(msg["error"].get("message", msg["error"]))))
            else:
                fut.set_result(msg.get("result"))
        elif "error" in msg:  # an error with no id (an unparseable request of ours)
            logger.warning("codex.error", extra={"error": msg["error"]})

    async def _write(self, msg: dict[str, Any]) -> None:
        if self.trace is not None:
            self.trace("send", {"pid": self.proc.pid, "msg": msg})
        stdin = self.proc.stdin
        if stdin is None or stdin.is_closing():
            raise CodexError("the codex app-server's input is closed")
        stdin.write(json.dumps(msg).encode() + b"\n")
        try:
            await stdin.drain()
        except (ConnectionError, OSError) as e:
            raise CodexError(f"cannot write to the codex app-server: {e}") from e

    async def call(self, method: str, params: dict[str, Any], within: float | None = None) -> Any:
        """Send a request and return its result; `CodexError` for an error or no answer."""
        self.ids += 1
        request_id = self.ids
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = fut
        await self._write({"id": request_id, "method": method, "params": params})
        try:
            return await asyncio.wait_for(fut, within)
        except TimeoutError:
            raise CodexError(f"{method}: no answer from the codex app-server") from None
        finally:
            self.pending.pop(request_id, None)

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        msg: dict[str, Any] = {"method": method}
        if params is not None:
            msg["params"] = params
        await self._write(msg)

    async def reply(self, request_id: Any, result: dict[str, Any]) -> None:
        await self._write({"id": request_id, "result": result})

    async def reply_error(self, request_id: Any, error: dict[str, Any]) -> None:
        await self._write({"id": request_id, "error": error})


class AppServer:
    """One turn's `codex app-server` process, in its own process group, and its connection."""

    def __init__(self, binary: str, home: Path, trace: Trace | None) -> None:
        self.binary = binary
        self.home = home
        self.trace = trace
        self.proc: asyncio.subprocess.Process | None = None
        self.rpc: Rpc | None = None
        self.stderr = home / "stderr.log"

    async def spawn(
        self,
        cfg: CodexConfig,
        features: Sequence[str],
        cwd: str,
        *,
        thread_id: str,
        on_request: Callable[[dict[str, Any]], None],
        on_notification: Callable[[dict[str, Any]], None],
    ) -> Rpc:
        """Write the turn's `config.toml` and start the app-server (the provider's key only in
        its environment); returns its connection."""
        key = cfg.api_key
        if key is None and cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
        toml = config_toml(cfg, features, has_key=key is not None)
        (self.home / "config.toml").write_text(toml)
        env = dict(os.environ)
        env["CODEX_HOME"] = str(self.home)
        env.pop(KEY_ENV, None)
        if key is not None:
            env[KEY_ENV] = key
        with self.stderr.open("wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                "app-server",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                cwd=cwd,
                env=env,
                limit=STDOUT_LIMIT,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        if self.trace is not None:
            self.trace("spawn", {"pid": self.proc.pid, "thread_id": thread_id})
        self.rpc = Rpc(self.proc, on_request, on_notification, self.trace)
        return self.rpc

    async def stop(self, graceful: bool = True) -> None:
        """Close its input and (when `graceful`) let it exit, then kill its process group:
        whatever its commands left behind goes with it."""
        proc = self.proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        if graceful and proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), EXIT_GRACE)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), EXIT_GRACE)
        else:  # the app-server is gone; end whatever its commands left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.rpc is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self.rpc.reader), 1)
        if self.trace is not None:
            self.trace("exit", {"pid": proc.pid, "rc": proc.returncode})

    async def close(self) -> None:
        """Kill the process group at once, and stop reading."""
        await self.stop(graceful=False)
        if self.rpc is not None:
            self.rpc.reader.cancel()

    def stderr_tail(self) -> str:
        try:
            lines = self.stderr.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line for line in lines[-5:] if line.strip())[-800:]
