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
from test_router import FakeWorker, cluster, completion, running, wait_until, wait_until_async

from aiokv.serving.router import RouterConfig, create_app, serve_async


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
        for name in ("uvicorn.error", "aiokv.serving.router", "uvicorn"):
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
            for name in ("uvicorn.error", "aiokv.serving.router", "uvicorn"):
                logging.getLogger(name).removeHandler(records)
    loud = [r for r in records.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]
    assert not any(r.exc_info for r in records.records)


# -- what the router says, and to whom -------------------------------------------------------

TOKEN = "deployment-token-0123456789abcdef"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_an_unreachable_static_worker_is_logged_with_its_reason_and_shown_in_healthz(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "aiokv.serving.router")
    cfg = RouterConfig(
        prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:1",), probe_interval=0.2
    )
    async with running(create_app(cfg)) as url, httpx.AsyncClient(base_url=url) as client:
        await wait_until(lambda: "unreachable" in caplog.text)
        lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert any("http://127.0.0.1:1" in m and "ConnectError" in m for m in lines), lines
        await asyncio.sleep(0.6)  # more failed probes: the same reason is not logged again
        again = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(again) == 2, [r.getMessage() for r in again]  # one per role
        r = await client.get("/healthz")
        assert r.status_code == 503
        down = r.json()["unreachable"]
        assert {d["role"] for d in down} == {"prefill", "decode"}
        assert all(d["url"] == "http://127.0.0.1:1" and "ConnectError" in d["error"] for d in down)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_metrics_and_healthz_name_workers_only_to_the_token_holder() -> None:
    workers = [FakeWorker("prefill", "p"), FakeWorker("decode", "d")]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(w.app)) for w in workers]
        cfg = RouterConfig(
            token=TOKEN,
            prefill=(urls[0], "http://127.0.0.1:1"),
            decode=(urls[1],),
            probe_interval=0.2,
        )
        router_url = await stack.enter_async_context(running(create_app(cfg)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=router_url))
        auth = {"authorization": f"Bearer {TOKEN}"}
        await wait_until_async(lambda: _has(client, "/healthz", auth, "ConnectError"), within=10)
        for path in ("/metrics", "/healthz"):
            public = (await client.get(path)).text
            assert all(u not in public for u in (*urls, "127.0.0.1:1")), (path, public)
            admin = (await client.get(path, headers=auth)).text
            assert "127.0.0.1:1" in admin, (path, admin)
        assert urls[1] in (await client.get("/metrics", headers=auth)).text
        public = (await client.get("/metrics")).text
        assert 'aiokv_router_instances{role="prefill"} 2.0' in public
        assert "ConnectError" in (await client.get("/healthz")).text


async def _has(client: httpx.AsyncClient, path: str, headers: dict[str, str], text: str) -> bool:
    return text in (await client.get(path, headers=headers)).text


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_answers_hide_the_topology_unless_asked_for() -> None:
    workers = [FakeWorker("prefill", "p"), FakeWorker("decode", "d")]
    async with cluster(RouterConfig(), workers) as (_, client, urls):
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 200, r.text
        assert "x-aiokv-prefill-url" not in r.headers and "x-aiokv-decode-url" not in r.headers
        assert "kv_transfer_params" not in r.json()
        assert all(u not in r.text for u in urls)
        assert r.json()["served_by"] == "d"  # the rest of the answer is the worker's
        r = await client.post("/v1/completions", json=completion(stream=True))
        assert r.status_code == 200 and "x-aiokv-decode-url" not in r.headers
        workers[1].fail_status = 500
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 502
        assert all(u not in r.text for u in urls), r.text
    async with cluster(
        RouterConfig(expose_topology=True), [FakeWorker("prefill", "p"), FakeWorker("decode", "e")]
    ) as (
        _,
        client,
        urls,
    ):
        r = await client.post("/v1/completions", json=completion())
        assert r.headers["x-aiokv-decode-url"] == urls[1]
        assert r.json()["kv_transfer_params"]["remote_engine_id"] == "engine-p"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_upstream_error_bodies_are_summed_up_never_cut_mid_json() -> None:
    for failing in ("prefill", "decode"):
        for stream in (False, True):
            workers = [FakeWorker("prefill", "p"), FakeWorker("decode", "d")]
            w = workers[failing == "decode"]
            w.fail_status = 500
            w.fail_code = "x" * 40
            async with cluster(RouterConfig(max_attempts=1), workers) as (_, client, _urls):
                r = await client.post("/v1/completions", json=completion(stream=stream))
                assert r.status_code == 502, r.text
                message = r.json()["error"]["message"]
                assert "{" not in message and '"' not in message, message
                assert "HTTP 500" in message and "boom" in message, message


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_unknown_routes_and_wrong_methods_get_openai_errors() -> None:
    async with running(create_app(RouterConfig())) as url, httpx.AsyncClient(base_url=url) as c:
        for method, path, status in (
            ("GET", "/v1/nothing", 404),
            ("POST", "/v1/embeddings", 404),
            ("GET", "/v1/completions", 405),
            ("DELETE", "/v1/chat/completions", 405),
            ("POST", "/healthz", 405),
        ):
            r = await c.request(method, path)
            assert r.status_code == status, (method, path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "code"} and "detail" not in r.json()
            assert err["code"] == ("not_found" if status == 404 else "method_not_allowed")
        assert (await c.get("/v1/completions")).headers["allow"] == "POST"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_listening_log_names_the_real_bind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "aiokv.serving.router")
    async with served(tmp_path, RouterConfig(), host="0.0.0.0") as url:
        port = url.rsplit(":", 1)[1]
        await wait_until(lambda: "listening" in caplog.text)
        line = next(r.getMessage() for r in caplog.records if "listening" in r.getMessage())
        assert line.startswith(f"router listening on http://0.0.0.0:{port} "), line
        assert url == f"http://127.0.0.1:{port}"  # the ready file: a URL one can connect to
