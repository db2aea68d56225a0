"""The router as deployed: slow clients, logging, what responses and endpoints reveal,
unreachable static workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aiokv.router import RouterConfig, serve_async


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path, config: RouterConfig, host: str = "127.0.0.1"
) -> AsyncIterator[str]:
    """The router as ``aiokv router`` runs it (serve_async); yields its URL."""
    ready = tmp_path / "router.url"
    task = asyncio.create_task(
        serve_async(host, 0, config, ready_file=str(ready), log_level="info")
    )
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():
            if task.done():
                task.result()
            assert time.monotonic() < deadline, "router did not start"
            await asyncio.sleep(0.02)
        yield ready.read_text()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _held_for(port: int, head: bytes, within: float) -> float | None:
    """Send ``head``, then one byte every 0.1 s; return the seconds until the router
    closed the connection, or None when it was still open after ``within`` seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        writer.write(head)
        await writer.drain()
        while time.monotonic() - start < within:
            try:
                data = await asyncio.wait_for(reader.read(4096), 0.1)
            except asyncio.TimeoutError:
                try:
                    writer.write(b"x")
                    await writer.drain()
                except (ConnectionError, OSError):
                    return time.monotonic() - start
                continue
            except (ConnectionError, OSError):
                return time.monotonic() - start
            if not data:
                return time.monotonic() - start
        return None
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_slow_clients_are_closed_at_their_deadlines_and_logged_quietly(
    tmp_path: Path,
) -> None:
    cfg = RouterConfig(header_timeout=1.0, body_timeout=1.0)
    records = _Records()
    async with served(tmp_path, cfg) as url:
        for name in ("uvicorn.error", "aiokv.router", "uvicorn"):
            logging.getLogger(name).addHandler(records)
        try:
            port = int(url.rsplit(":", 1)[1])
            unfinished_head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: "
            dribbled_body = (
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100000\r\n\r\n{"
            )
            idle_after_request = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\nG"
            held = await asyncio.gather(
                *[_held_for(port, unfinished_head, 6.0) for _ in range(20)],
                *[_held_for(port, dribbled_body, 6.0) for _ in range(20)],
                *[_held_for(port, idle_after_request, 6.0) for _ in range(5)],
            )
            assert all(h is not None for h in held), f"still open after 6 s: {held}"
            assert max(h for h in held if h is not None) < 4.0, held
            # the router still serves everyone else
            async with httpx.AsyncClient(base_url=url, timeout=5) as client:
                assert (await client.get("/healthz")).status_code == 503
        finally:
            for name in ("uvicorn.error", "aiokv.router", "uvicorn"):
                logging.getLogger(name).removeHandler(records)
    loud = [r for r in records.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]
    assert not any(r.exc_info for r in records.records)
