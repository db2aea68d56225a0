"""The disaggregated router against real uvicorn servers on loopback.

The upstreams here are fake prefill/decode workers (test doubles of the
*upstream* servers); the router, the registry and the heartbeat helper are
the real ones. ``tests/serving/test_demo.py`` runs the whole real stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from support import serve

from aiokv.serving.lifespan import (
    WorkerRegistration,
    bind_socket,
    register_with_router,
    serve_app,
    socket_url,
)
from aiokv.serving.router import Registry, RouterConfig, create_app
from aiokv.serving.router.registry import NoInstanceError, UnknownModelError

MODEL = "fake-model"
#: what vLLM's toy proxy puts in the prefill request (NixlConnector / MooncakeConnector)
VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- fake upstream workers ------------------------------------------------------------


class FakeWorker:
    """A stand-in prefill or decode server that behaves like vLLM with NixlConnector.

    The prefill side checks it got vLLM's prefill request (max_tokens 1, no
    stream, the do_remote_decode kv_transfer_params) and answers with
    kv_transfer_params that say where its KV is; the decode side records what
    it was given. Both record the X-Request-Id header.
    """

    def __init__(self, role: str, name: str, kv_address: str = "127.0.0.1:1") -> None:
        self.role = role
        self.name = name
        self.kv_address = kv_address
        self.calls: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []
        self.fail_status: int | None = None
        self.fail_code = "boom"
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.tokens = 4
        #: a streamed answer breaks (the connection drops) after this many chunks
        self.break_after: int | None = None
        #: the decode side's x-aiokv-kv-plane header (None: none)
        self.plane: str | None = None
        self.app = self._build()

    def produced(self, request_id: str | None) -> dict[str, Any]:
        host, _, port = self.kv_address.rpartition(":")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [3, 4],
            "remote_host": host,
            "remote_port": int(port),
            "tp_size": 1,
            "remote_request_id": request_id,
            "num_tokens": 3,
            "num_blocks": 1,
            "first_token": 7,
            "transfer_seconds": 0.002,
            "transfer_bytes": 4096,
            "served_by": self.name,
        }

    def _build(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request) -> Response:
            body = await request.json()
            self.calls.append(body)
            self.request_ids.append(request.headers.get("x-request-id"))
            self.entered.set()
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_status is not None:
                return JSONResponse(
                    {"error": {"message": "boom", "code": self.fail_code}}, self.fail_status
                )
            params = body.get("kv_transfer_params") or {}
            if self.role == "prefill":
                assert params == VLLM_PREFILL_PARAMS, params
                assert body["max_tokens"] == 1 and body["stream"] is False
                return JSONResponse(
                    {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "a", "token_ids": [7]}],
                        "kv_transfer_params": self.produced(request.headers.get("x-request-id")),
                    }
                )
            assert params["do_remote_prefill"] is True
            n = int(body.get("max_tokens") or self.tokens)
            headers = {"x-aiokv-kv-plane": self.plane} if self.plane is not None else None
            if body.get("stream"):

                async def sse() -> AsyncIterator[bytes]:
                    for i in range(n):
                        if i == self.break_after:
                            raise RuntimeError("the decode broke mid-stream")
                        chunk = {
                            "choices": [{"index": 0, "text": str(i), "token_ids": [i]}],
                            "served_by": self.name,
                        }
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                        await asyncio.sleep(0)
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)
            return JSONResponse(
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "a" * n, "token_ids": list(range(n))}],
                    "served_by": self.name,
                    "kv_transfer_params": params,
                },
                headers=headers,
            )

        app.add_api_route("/v1/completions", handle, methods=["POST"])
        app.add_api_route("/v1/chat/completions", handle, methods=["POST"])
        return app


def running(app: Any) -> contextlib.AbstractAsyncContextManager[str]:
    """Serve an ASGI app with uvicorn on a free loopback port; yield its URL."""
    return serve.running(app, start_timeout=10)


@contextlib.asynccontextmanager
async def cluster(
    config: RouterConfig, workers: list[FakeWorker]
) -> AsyncIterator[tuple[str, httpx.AsyncClient, list[str]]]:
    """A router plus fake workers, each registered through the real heartbeat helper."""
    async with contextlib.AsyncExitStack() as stack:
        router_url = await stack.enter_async_context(running(create_app(config)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=router_url, timeout=10))
        urls = []
        tasks = []
        for w in workers:
            url = await stack.enter_async_context(running(w.app))
            urls.append(url)
            reg = WorkerRegistration(router_url, w.role, url, w.kv_address, MODEL, 0.2)  # type: ignore[arg-type]
            tasks.append(asyncio.create_task(register_with_router(reg)))
            await asyncio.wait_for(reg.registered.wait(), 5)
        try:
            yield router_url, client, urls
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t


async def wait_until(cond: Callable[[], bool], within: float = 5.0) -> None:
    async def acond() -> bool:
        return cond()

    await wait_until_async(acond, within)


async def wait_until_async(cond: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if await cond():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def completion(prompt: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}


# -- registry unit tests -----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(5)
def test_registry_eviction_and_cooldown() -> None:
    clock = FakeClock()
    reg = Registry(evict_after=3.0, clock=clock)
    a = reg.register("decode", "http://a", "h:1", "m")
    b = reg.register("decode", "http://b", "h:2", "m")
    again = reg.register("decode", "http://a", "h:9", "m", secret=a.secret)
    assert again is a and a.kv_address == "h:9"
    clock.now += 2
    reg.heartbeat(b.instance_id, b.secret)
    clock.now += 1.5
    assert [i.url for i in reg.evict_stale()] == ["http://a"]
    assert reg.heartbeat(a.instance_id, a.secret) is None
    reg.mark_unhealthy(b)
    with pytest.raises(NoInstanceError):
        reg.select("decode", "m")
    with pytest.raises(UnknownModelError):
        reg.select("decode", "other")
    clock.now += 1
    reg.heartbeat(b.instance_id, b.secret)
    assert not b.healthy  # still cooling down
    clock.now += 3
    reg.heartbeat(b.instance_id, b.secret)
    assert b.healthy and reg.select("decode", "m") is b


@pytest.mark.timeout(5)
def test_registry_policies() -> None:
    rr = Registry(policy="round_robin")
    ids = [rr.register("prefill", f"http://p{i}", "h:1", "m").url for i in range(3)]
    assert [rr.select("prefill", "m").url for _ in range(6)] == ids + ids
    lo = Registry(policy="least_outstanding")
    a = lo.register("decode", "http://a", "h:1", "m")
    b = lo.register("decode", "http://b", "h:2", "m")
    a.outstanding = 2
    assert {lo.select("decode", "m").url for _ in range(4)} == {"http://b"}
    b.outstanding = 2
    assert {lo.select("decode", "m").url for _ in range(4)} == {"http://a", "http://b"}
    assert lo.select("decode", "m", exclude={a.instance_id}) is b


@pytest.mark.timeout(5)
def test_config_validation() -> None:
    with pytest.raises(ValueError):
        RouterConfig(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RouterConfig(evict_after=0)


# -- end to end over loopback -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_round_robin_routing_and_kv_params() -> None:
    p = FakeWorker("prefill", "p0", "127.0.0.1:5001")
    d0 = FakeWorker("decode", "d0", "127.0.0.1:6000")
    d1 = FakeWorker("decode", "d1", "127.0.0.1:6001")
    # expose_topology: the answers name the instances that served them
    async with cluster(RouterConfig(expose_topology=True), [p, d0, d1]) as (_, client, urls):
        served = []
        for i in range(4):
            r = await client.post("/v1/completions", json=completion(f"prompt {i}"))
            assert r.status_code == 200, r.text
            served.append(r.json()["served_by"])
            assert r.headers["x-aiokv-transfer-bytes"] == "4096"
            assert r.headers["x-aiokv-prefill-url"] == urls[0]
        assert served == ["d0", "d1", "d0", "d1"]
        # vLLM's protocol: the decode gets the prefill's kv_transfer_params verbatim,
        # and both legs carry the same X-Request-Id
        assert len(p.calls) == 4
        for dcall, did in zip(d0.calls + d1.calls, d0.request_ids + d1.request_ids):
            assert did is not None
            assert dcall["kv_transfer_params"] == p.produced(did)
        assert set(p.request_ids) == set(d0.request_ids + d1.request_ids)
        assert len(set(p.request_ids)) == 4

        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200, r.text
        assert p.calls[-1]["messages"][0]["content"] == "hi"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_least_outstanding_routing() -> None:
    p = FakeWorker("prefill", "p0")
    slow = FakeWorker("decode", "slow")
    fast = FakeWorker("decode", "fast")
    slow.gate = asyncio.Event()
    async with cluster(RouterConfig(policy="least_outstanding"), [p, slow, fast]) as (
        _,
        client,
        _u,
    ):
        first = asyncio.create_task(client.post("/v1/completions", json=completion("one")))
        await asyncio.wait_for(slow.entered.wait(), 5)
        served = []
        for i in range(3):
            r = await client.post("/v1/completions", json=completion(f"p{i}"))
            assert r.status_code == 200
            served.append(r.json()["served_by"])
        assert served == ["fast", "fast", "fast"]
        inst = (await client.get("/instances")).json()["instances"]
        assert {i["url"]: i["outstanding"] for i in inst if i["role"] == "decode"}.get(
            next(i["url"] for i in inst if i["outstanding"] == 1)
        ) == 1
        slow.gate.set()
        r = await first
        assert r.json()["served_by"] == "slow"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_streaming_passthrough() -> None:
    workers = [FakeWorker("prefill", "p0"), FakeWorker("decode", "d0")]
    async with cluster(RouterConfig(), workers) as (_, client, _u):
        async with client.stream(
            "POST", "/v1/completions", json=completion(stream=True, max_tokens=5)
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-aiokv-request-id"].startswith("aiokv-")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert [json.loads(x[6:])["choices"][0]["token_ids"][0] for x in lines[:-1]] == list(
            range(5)
        )
        # the prefill leg is never streamed
        assert workers[0].calls[0]["stream"] is False
        assert workers[1].calls[0]["stream"] is True
        metrics = (await client.get("/metrics")).text
        assert 'aiokv_router_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics
        assert "aiokv_router_ttft_seconds_count 1.0" in metrics


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_decode_that_breaks_mid_stream_gives_an_error_event_then_done() -> None:
    workers = [FakeWorker("prefill", "p0"), FakeWorker("decode", "d0")]
    workers[1].break_after = 2
    async with cluster(RouterConfig(), workers) as (_, client, _u):
        async with client.stream(
            "POST", "/v1/completions", json=completion(stream=True, max_tokens=5)
        ) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines
        assert [json.loads(x[6:])["choices"][0]["token_ids"][0] for x in lines[:2]] == [0, 1]
        assert json.loads(lines[2][6:])["error"]["code"] == "upstream_stream_error"
        assert len(lines) == 4, lines


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_retry_on_5xx_marks_unhealthy() -> None:
    p_bad, p_ok = FakeWorker("prefill", "pbad"), FakeWorker("prefill", "pok")
    d_bad, d_ok = FakeWorker("decode", "dbad"), FakeWorker("decode", "dok")
    p_bad.fail_status = 500
    d_bad.fail_status = 503
    async with cluster(RouterConfig(max_attempts=4), [p_bad, p_ok, d_bad, d_ok]) as (_, client, _u):
        for stream in (False, True, False):
            r = await client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200, r.text
        inst = {i["url"]: i for i in (await client.get("/instances")).json()["instances"]}
        health = {i["url"]: i["healthy"] for i in inst.values()}
        assert sorted(health.values()) == [False, False, True, True]
        assert len(p_bad.calls) == 1 and len(d_bad.calls) == 1  # not retried on a marked one
        metrics = (await client.get("/metrics")).text
        assert 'aiokv_router_retries_total{role="prefill"} 1.0' in metrics
        assert 'aiokv_router_retries_total{role="decode"} 1.0' in metrics
        assert "aiokv_router_instance_healthy{" in metrics


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_all_attempts_fail_gives_502_and_router_stays_up() -> None:
    p, d = FakeWorker("prefill", "p"), FakeWorker("decode", "d")
    d.fail_status = 500
    async with cluster(RouterConfig(max_attempts=2), [p, d]) as (_, client, _u):
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 502
        assert "upstream failed" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 503  # the only decode is now unhealthy
        assert (await client.get("/healthz")).json()["ready"] is False


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_bad_requests() -> None:
    cfg = RouterConfig(max_prompt_length=100)
    async with cluster(cfg, [FakeWorker("prefill", "p"), FakeWorker("decode", "d")]) as (
        _,
        client,
        _u,
    ):

        async def post(path: str, content: bytes | str) -> httpx.Response:
            return await client.post(
                path, content=content, headers={"content-type": "application/json"}
            )

        cases: list[tuple[str, bytes | str, int, str]] = [
            ("/v1/completions", b"{not json", 400, "not valid JSON"),
            ("/v1/completions", b"", 400, "empty"),
            ("/v1/completions", b"[1, 2]", 400, "JSON object"),
            ("/v1/completions", json.dumps({"prompt": "x"}), 400, "'model'"),
            ("/v1/completions", json.dumps({"model": MODEL}), 400, "'prompt'"),
            ("/v1/chat/completions", json.dumps({"model": MODEL}), 400, "'messages'"),
            ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}), 400, "messages"),
            ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}), 404, "nope"),
            ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 101}), 400, "exceeds"),
            (
                "/v1/completions",
                json.dumps({"model": MODEL, "prompt": list(range(101))}),
                400,
                "exceeds",
            ),
            ("/v1/completions", json.dumps({"model": MODEL, "prompt": {"a": 1}}), 400, "'prompt'"),
            (
                "/v1/completions",
                json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}),
                400,
                "max_tokens",
            ),
            (
                "/v1/completions",
                json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}),
                400,
                "stream",
            ),
            ("/v1/completions", b"\xff\xfe", 400, "JSON"),
            (
                "/register",
                json.dumps({"role": "x", "url": "http://a", "kv_address": "h:1", "model": "m"}),
                400,
                "role",
            ),
            (
                "/register",
                json.dumps(
                    {"role": "decode", "url": "http://a", "kv_address": "nope", "model": "m"}
                ),
                400,
                "kv_address",
            ),
            (
                "/register",
                json.dumps({"role": "decode", "url": "ftp://a", "kv_address": "h:1", "model": "m"}),
                400,
                "url",
            ),
            ("/heartbeat", json.dumps({"instance_id": "unknown"}), 404, "register again"),
        ]
        for path, content, status, needle in cases:
            r = await post(path, content)
            assert r.status_code == status, (path, content, r.text)
            msg = r.json()["error"]["message"]
            assert needle in msg, (needle, msg)
        r = await client.get("/healthz")
        assert r.status_code == 200 and r.json()["ready"] is True
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'aiokv_router_errors_total{kind="bad_request"}' in metrics
        assert 'aiokv_router_errors_total{kind="unknown_model"} 1.0' in metrics


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_decodes_kv_plane_is_passed_on_and_nothing_else() -> None:
    decode = FakeWorker("decode", "d")
    async with cluster(RouterConfig(), [FakeWorker("prefill", "p"), decode]) as (_, client, _u):
        for stream in (False, True):
            decode.plane = "ipc"
            r = await client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200 and r.headers["x-aiokv-kv-plane"] == "ipc"
            decode.plane = "<script>"  # not a plane name: not passed on
            r = await client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200 and "x-aiokv-kv-plane" not in r.headers


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_metrics_healthz_instances() -> None:
    workers = [FakeWorker("prefill", "p"), FakeWorker("decode", "d")]
    async with cluster(RouterConfig(), workers) as (_, client, urls):
        r = await client.get("/healthz")
        assert r.json() == {
            "status": "ok",
            "ready": True,
            "prefill": 1,
            "decode": 1,
            "models": [MODEL],
        }
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL
        for _ in range(2):
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
        r = await client.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
        assert "aiokv_router_kv_transfer_bytes_total 8192.0" in text
        assert "aiokv_router_kv_transfer_seconds_count 2.0" in text
        assert 'aiokv_router_request_seconds_count{endpoint="/v1/completions"} 2.0' in text
        assert f'aiokv_router_instance_healthy{{role="decode",url="{urls[1]}"}} 1.0' in text
        assert 'aiokv_router_instances{role="prefill"} 1.0' in text
        inst = (await client.get("/instances")).json()["instances"]
        assert {i["role"] for i in inst} == {"prefill", "decode"}
        assert all(i["served"] == 2 for i in inst)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_heartbeat_reregisters_and_deregister() -> None:
    async with running(create_app(RouterConfig(evict_after=0.6))) as router_url:
        async with httpx.AsyncClient(base_url=router_url) as client:
            reg = WorkerRegistration(
                router_url, "decode", "http://127.0.0.1:9", "127.0.0.1:9", MODEL, 0.1
            )
            task = asyncio.create_task(register_with_router(reg))
            try:
                await asyncio.wait_for(reg.registered.wait(), 5)
                first_id = reg.instance_id
                assert first_id is not None
                # the router forgets it: the helper registers again
                await client.post(
                    "/deregister",
                    json={"instance_id": first_id, "instance_secret": reg.instance_secret},
                )
                await wait_until(lambda: reg.registrations >= 2)
                assert reg.registrations == 2 and reg.instance_id != first_id
                # heartbeats keep it alive past evict_after
                await asyncio.sleep(1.0)
                assert len((await client.get("/instances")).json()["instances"]) == 1
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            # no more heartbeats: evicted
            async def no_instances() -> bool:
                return not (await client.get("/instances")).json()["instances"]

            await wait_until_async(no_instances)
            assert (
                'aiokv_router_evictions_total{role="decode"} 1.0'
                in (await client.get("/metrics")).text
            )


# -- a worker in another process, killed ------------------------------------------------------


def _fake_worker_main(role: str, name: str, router_url: str, ready: str) -> None:
    """Run a FakeWorker in this process, registered with heartbeats (subprocess entry)."""

    async def run() -> None:
        w = FakeWorker(role, name)
        sock = bind_socket("127.0.0.1", 0)
        url = socket_url(sock)
        reg = WorkerRegistration(router_url, role, url, "127.0.0.1:7", MODEL, 0.2)  # type: ignore[arg-type]
        hb = asyncio.create_task(register_with_router(reg))
        await asyncio.wait_for(reg.registered.wait(), 10)
        await anyio.Path(ready).write_text(url)
        try:
            await serve_app(w.app, sock)
        finally:
            hb.cancel()

    asyncio.run(run())


@contextlib.asynccontextmanager
async def subprocess_worker(
    role: str, name: str, router_url: str, tmp: Path
) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    ready = anyio.Path(tmp / f"{name}.ready")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "tests"))))
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, __file__, role, name, router_url, str(ready)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not await ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"fake worker died: {proc.stderr.read().decode() if proc.stderr else ''}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("fake worker did not start")
            await asyncio.sleep(0.05)  # never block the loop: the router runs on it
        yield proc, await ready.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        await asyncio.to_thread(proc.wait, 10)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_killed_worker_is_evicted_and_request_retried(tmp_path: Path) -> None:
    p, d_live = FakeWorker("prefill", "p"), FakeWorker("decode", "live")
    async with cluster(RouterConfig(evict_after=1.0), [p, d_live]) as (router_url, client, _u):
        async with subprocess_worker("decode", "doomed", router_url, tmp_path) as (
            proc,
            doomed_url,
        ):
            inst = (await client.get("/instances")).json()["instances"]
            assert doomed_url in {i["url"] for i in inst}
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
            # both requests succeed although round-robin sends one of them to the dead worker
            for i in range(4):
                r = await client.post("/v1/completions", json=completion(f"k{i}"))
                assert r.status_code == 200, r.text
                assert r.json()["served_by"] == "live"
            r = await client.post("/v1/completions", json=completion(stream=True))
            assert r.status_code == 200 and "[DONE]" in r.text
            metrics = (await client.get("/metrics")).text
            assert 'aiokv_router_retries_total{role="decode"} 1.0' in metrics

            async def evicted() -> bool:
                inst = (await client.get("/instances")).json()["instances"]
                return doomed_url not in {i["url"] for i in inst}

            await wait_until_async(evicted, 10)
            assert (
                'aiokv_router_evictions_total{role="decode"} 1.0'
                in (await client.get("/metrics")).text
            )
            assert (await client.get("/healthz")).json()["decode"] == 1


if __name__ == "__main__":
    _fake_worker_main(*sys.argv[1:5])
