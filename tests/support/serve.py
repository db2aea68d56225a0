"""Serve an ASGI app with uvicorn on a loopback socket for the length of a test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokv.serving.lifespan import bind_socket, serve_app, socket_url


@contextlib.asynccontextmanager
async def running(app: Any, sock: Any = None, *, start_timeout: float = 30.0) -> AsyncIterator[str]:
    """Serve ``app`` on ``sock`` (a free loopback port unless given); yield its URL.

    Raises RuntimeError when the server has not started within ``start_timeout``."""
    sock = sock or bind_socket("127.0.0.1", 0)
    started = asyncio.Event()
    task = asyncio.create_task(serve_app(app, sock, on_started=started.set))
    try:
        waiter = asyncio.create_task(started.wait())
        done, _ = await asyncio.wait(
            {waiter, task}, timeout=start_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if waiter not in done:
            waiter.cancel()
            if task.done():
                task.result()
            raise RuntimeError("server did not start")
        yield socket_url(sock)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
