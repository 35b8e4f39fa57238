"""Test support: serve an app on a real socket inside the running event loop.

httpx's ASGI transport waits for a whole response, so an event stream never returns through
it; a real uvicorn server on a free port, in the test's own loop (sharing its Broker), does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import uvicorn
from starlette.applications import Starlette

__all__ = ["serving", "serving_in_thread"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[str]:
    """Run `app` on 127.0.0.1 until the block ends; yields its base URL."""
    port = _free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_config=None, lifespan="on", access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()  # it failed to start: say why
                raise RuntimeError("the server stopped before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 5)
        except TimeoutError:
            # An event stream still open holds the graceful shutdown: cut it.
            server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)


@contextlib.contextmanager
def serving_in_thread(factory: Callable[[], Awaitable[Starlette]]) -> Iterator[str]:
    """Run the app `factory` makes on its own thread and event loop (for synchronous callers,
    such as a hypothesis test); yields its base URL."""
    ready = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        try:
            app = await factory()
            port = _free_port()
            config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None)
            server = uvicorn.Server(config)
            box["server"], box["url"] = server, f"http://127.0.0.1:{port}"
            task = asyncio.create_task(server.serve())
            # uvicorn sets a flag, not an event, when it listens: poll it.
            while not server.started and not task.done():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            ready.set()
            await task
        except BaseException as e:
            box["error"] = e
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in box or "url" not in box:
        raise RuntimeError(f"the server did not start: {box.get('error')!r}")
    try:
        yield str(box["url"])
    finally:
        server = box["server"]
        assert isinstance(server, uvicorn.Server)
        server.should_exit = True
        thread.join(10)
