"""The router fronting vLLM-style workers: static ``--prefill`` / ``--decode``
lists, the exact requests of vLLM's disaggregation protocol, health a load
balancer can use, and vLLM-style ZMQ discovery.

The workers are stand-ins implementing vLLM's OpenAI endpoints and its
``kv_transfer_params`` behaviour (``test_router.FakeWorker``, plus
``/v1/models`` with ``max_model_len``); the router runs under real uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
from fastapi.responses import JSONResponse
from test_router import MODEL, VLLM_PREFILL_PARAMS, FakeWorker, running

from aiokv.serving.router import RouterConfig, create_app

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def vllm_worker(role: str, name: str, max_model_len: int = 128) -> FakeWorker:
    w = FakeWorker(role, name, "10.0.0.5:5600")

    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "max_model_len": max_model_len}],
            }
        )

    w.app.add_api_route("/v1/models", models, methods=["GET"])
    return w


async def wait_ready(client: httpx.AsyncClient, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while (await client.get("/healthz")).status_code != 200:
        assert time.monotonic() < deadline, "router never became ready"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def static_router(
    prefill: list[FakeWorker], decode: list[FakeWorker], **kw: Any
) -> AsyncIterator[httpx.AsyncClient]:
    async with contextlib.AsyncExitStack() as stack:
        p_urls = [await stack.enter_async_context(running(w.app)) for w in prefill]
        d_urls = [await stack.enter_async_context(running(w.app)) for w in decode]
        cfg = RouterConfig(prefill=tuple(p_urls), decode=tuple(d_urls), probe_interval=0.2, **kw)
        url = await stack.enter_async_context(running(create_app(cfg)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10))
        yield client


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_health_is_503_until_both_roles_are_up() -> None:
    async with running(create_app(RouterConfig())) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/healthz")
            assert r.status_code == 503
            assert r.json()["ready"] is False
    # static workers count once a probe reached them
    async with static_router([vllm_worker("prefill", "p")], [vllm_worker("decode", "d")]) as c:
        await wait_ready(c)
        assert (await c.get("/healthz")).json() == {
            "status": "ok",
            "ready": True,
            "prefill": 1,
            "decode": 1,
            "models": [MODEL],
        }


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_static_workers_get_vllms_exact_requests() -> None:
    p, d = vllm_worker("prefill", "p"), vllm_worker("decode", "d")
    async with static_router([p], [d]) as client:
        await wait_ready(client)
        original = {
            "model": MODEL,
            "prompt": "hello",
            "max_tokens": 5,
            "max_completion_tokens": 5,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": {"remote_host": "evil.example", "do_remote_prefill": True},
        }
        async with client.stream("POST", "/v1/completions", json=original) as r:
            assert r.status_code == 200
            lines = [x async for x in r.aiter_lines() if x.startswith("data: ")]
            rid = r.headers["x-request-id"]
        assert lines[-1] == "data: [DONE]" and len(lines) == 6
        # the prefill leg: max_tokens 1, no stream, no stream_options, vLLM's params
        expected_prefill = {k: v for k, v in original.items() if k != "stream_options"}
        expected_prefill |= {
            "max_tokens": 1,
            "max_completion_tokens": 1,
            "stream": False,
            "kv_transfer_params": VLLM_PREFILL_PARAMS,
        }
        assert p.calls == [expected_prefill]
        # the decode leg: the original request with the prefill's params, verbatim
        assert d.calls == [original | {"kv_transfer_params": p.produced(rid)}]
        assert p.request_ids == d.request_ids == [rid]
        # chat goes the same way
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = await client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert p.calls[-1] == chat | {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": VLLM_PREFILL_PARAMS,
        }
        assert d.calls[-1]["kv_transfer_params"]["remote_engine_id"] == "engine-p"
        # what the probe learned: the model's name and context length
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 129}
        )
        assert r.status_code == 400
        assert "context length of 128 tokens" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404
        models = (await client.get("/v1/models")).json()["data"]
        assert models == [
            {"id": MODEL, "object": "model", "owned_by": "aiokv", "max_model_len": 128}
        ]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_static_worker_down_then_back() -> None:
    p, d0, d1 = (
        vllm_worker("prefill", "p"),
        vllm_worker("decode", "d0"),
        vllm_worker("decode", "d1"),
    )
    d0.fail_status = 500
    async with static_router([p], [d0, d1], unhealthy_cooldown=0.3) as client:
        await wait_ready(client)
        while (
            len([i for i in (await client.get("/instances")).json()["instances"] if i["healthy"]])
            < 3
        ):
            await asyncio.sleep(0.05)
        served = [
            (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).json()[
                "served_by"
            ]
            for _ in range(3)
        ]
        assert served == ["d1", "d1", "d1"]
        d0.fail_status = None
        # the probe brings it back after the cool-down

        async def both() -> bool:
            inst = (await client.get("/instances")).json()["instances"]
            return all(i["healthy"] for i in inst)

        deadline = time.monotonic() + 5
        while not await both():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cli_with_static_workers(tmp_path: Path) -> None:
    p, d = vllm_worker("prefill", "p"), vllm_worker("decode", "d")
    async with running(p.app) as p_url, running(d.app) as d_url:
        ready = anyio.Path(tmp_path / "router.url")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("AIOKV_ROUTER_TOKEN", None)
        argv = [sys.executable, "-m", "aiokv", "router", "--port", "0", "--ready-file", str(ready)]
        argv += ["--prefill", p_url, "--decode", d_url, "--log-level", "warning"]
        proc = await asyncio.to_thread(
            subprocess.Popen, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            deadline = time.monotonic() + 30
            while not await ready.exists():
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(base_url=await ready.read_text(), timeout=10) as c:
                await wait_ready(c)
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
                assert r.status_code == 200, r.text
                assert r.json()["served_by"] == "d"
                assert p.request_ids == d.request_ids
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 10)
        err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.stderr:
            proc.stderr.close()
        assert "loopback clients only" in err  # the start-up says who may register


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_zmq_discovery() -> None:
    p, d = FakeWorker("prefill", "p"), FakeWorker("decode", "d")
    disc = f"127.0.0.1:{_free_port()}"
    cfg = RouterConfig(discovery=disc, discovery_ttl=0.6, evict_after=3.0, eviction_interval=0.1)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        async with running(p.app) as p_url, running(d.app) as d_url:
            async with running(create_app(cfg)) as url:
                dealer.connect(f"tcp://{disc}")
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    hosts = {"P": p_url.removeprefix("http://"), "D": d_url.removeprefix("http://")}
                    zmq_addr = {"P": "127.0.0.1:21001", "D": "127.0.0.1:22001"}

                    async def ping() -> None:
                        for kind in ("P", "D"):
                            msg = {
                                "type": kind,
                                "http_address": hosts[kind],
                                "zmq_address": zmq_addr[kind],
                            }
                            await dealer.send(msgpack.packb(msg))

                    # junk first: none of it may register anything or stop discovery
                    await dealer.send(b"\xc1 not msgpack")
                    await dealer.send(msgpack.packb([1, 2, 3]))
                    await dealer.send(
                        msgpack.packb(
                            {
                                "type": "P",
                                "http_address": "169.254.169.254:80",
                                "zmq_address": "127.0.0.1:1",
                            }
                        )
                    )
                    await dealer.send(
                        msgpack.packb(
                            {"type": "X", "http_address": hosts["P"], "zmq_address": "a:1"}
                        )
                    )
                    await dealer.send_multipart([b"a", b"b"])
                    deadline = time.monotonic() + 5
                    while (await client.get("/healthz")).status_code != 200:
                        await ping()
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.05)
                    inst = (await client.get("/instances")).json()["instances"]
                    assert sorted(
                        (i["role"], i["url"], i["kv_address"], i["source"]) for i in inst
                    ) == [
                        ("decode", d_url, zmq_addr["D"], "zmq"),
                        ("prefill", p_url, zmq_addr["P"], "zmq"),
                    ]
                    r = await client.post(
                        "/v1/completions", json={"model": "any-model", "prompt": "x"}
                    )
                    assert r.status_code == 200, r.text
                    # the request id tells vLLM's P2P NCCL connector both ZMQ addresses
                    rid = r.headers["x-request-id"]
                    assert rid.startswith(
                        "___prefill_addr_127.0.0.1:21001___decode_addr_127.0.0.1:22001_"
                    )
                    assert p.request_ids == d.request_ids == [rid]
                    # silent for longer than the ttl: dropped
                    deadline = time.monotonic() + 5
                    while (await client.get("/healthz")).status_code != 503:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.05)
                    assert (await client.get("/instances")).json()["instances"] == []
    finally:
        dealer.close(0)
        ctx.term()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_zmq_discovery_refuses_remote_peers_and_registered_urls() -> None:
    from aiokv.serving.router.discovery import Discovery

    app = create_app(RouterConfig(token="t" * 20))
    state = app.state.router
    disc = Discovery(state, "127.0.0.1:1")

    class Frame:
        def __init__(self, data: bytes, peer: str) -> None:
            self.bytes, self.peer = data, peer

        def get(self, name: str) -> str:
            assert name == "Peer-Address"
            return self.peer

    def msg(url: str, **kw: Any) -> bytes:
        return msgpack.packb({"type": "D", "http_address": url, "zmq_address": "10.0.0.2:5", **kw})

    disc.handle([b"id", Frame(msg("10.0.0.2:8000"), "10.0.0.2")])
    assert len(state.registry) == 0  # a remote peer without the token
    disc.handle([b"id", Frame(msg("10.0.0.2:8000", token="wrong"), "10.0.0.2")])
    assert len(state.registry) == 0
    disc.handle([b"id", Frame(msg("10.0.0.2:8000", token="t" * 20), "10.0.0.2")])
    assert [i.url for i in state.registry] == ["http://10.0.0.2:8000"]
    # a URL held by an HTTP registration is not taken over by discovery
    inst = state.registry.register("decode", "http://10.0.0.3:8000", "10.0.0.3:1", MODEL)
    disc.handle([b"id", Frame(msg("10.0.0.3:8000"), "127.0.0.1")])
    assert inst.kv_address == "10.0.0.3:1" and inst.source == "register"
    assert disc.dropped == 3
