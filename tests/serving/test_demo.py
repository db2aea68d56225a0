"""The real stack: router + prefill and decode workers (model, Engine, KVConnector) over loopback.

``test_demo_cli`` runs ``aiokv.serving.demo.run.main`` in a subprocess (which starts
router and workers as processes of its own) and needs exit status 0: every
disaggregated output equals single-process generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import torch
from support.serve import running

import aiokv.kv
from aiokv.serving.demo.model import TinyTransformer, chat_prompt, tokenize
from aiokv.serving.demo.worker import DEFAULT_MODEL_NAME, WorkerConfig
from aiokv.serving.demo.worker import create_app as create_worker_app
from aiokv.serving.lifespan import bind_socket, socket_url
from aiokv.serving.router import RouterConfig
from aiokv.serving.router import create_app as create_router_app

ROOT = Path(__file__).resolve().parents[2]

needs_connector = pytest.mark.skipif(
    not hasattr(aiokv.kv, "KVConnector"), reason="aiokv.kv.KVConnector not available yet"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@needs_connector
@pytest.mark.timeout(120)
def test_demo_cli() -> None:
    code = "import sys; from aiokv.serving.demo.run import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--prompts", "2", "--max-tokens", "4", "--device", "cpu"],
        cwd=ROOT,
        env=dict(os.environ, COLUMNS="120"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            # the demo tears its children down on SIGTERM/SIGINT; they also exit when it dies
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "2/2 outputs equal single-process generate" in text, text




@contextlib.asynccontextmanager
async def demo_cluster() -> AsyncIterator[httpx.AsyncClient]:
    """Router + registered prefill and decode demo workers, in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with contextlib.AsyncExitStack() as stack:
            # expose_topology: the tests read where the KV came from in the answers
            router_cfg = RouterConfig(expose_topology=True)
            router_url = await stack.enter_async_context(running(create_router_app(router_cfg)))
            roles: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
            for role in roles:
                sock = bind_socket("127.0.0.1", 0)
                cfg = WorkerConfig(role=role, router_url=router_url, heartbeat_interval=0.2)
                await stack.enter_async_context(
                    running(create_worker_app(cfg, socket_url(sock)), sock)
                )
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=router_url, timeout=30)
            )
            for _ in range(100):
                if (await client.get("/healthz")).json()["ready"]:
                    break
                await asyncio.sleep(0.1)
            yield client
    finally:
        torch.set_num_threads(threads)


@needs_connector
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_chat_stream_role_and_context_limit() -> None:
    async with demo_cluster() as client:
        # a streamed chat answer names the speaker in its first delta, as OpenAI's does
        chat = {
            "model": DEFAULT_MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=chat) as rs:
            assert rs.status_code == 200
            deltas = [
                json.loads(x[6:])["choices"][0]["delta"]
                async for x in rs.aiter_lines()
                if x.startswith("data: {")
            ]
        assert len(deltas) == 3
        assert deltas[0]["role"] == "assistant"
        assert all("role" not in d and isinstance(d["content"], str) for d in deltas[1:])

        # max_tokens beyond the model's context is refused, stating the limit
        context = TinyTransformer().config.max_positions
        r = await client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": "x", "max_tokens": context + 1},
        )
        assert r.status_code == 400, r.text
        assert f"{context} tokens" in r.json()["error"]["message"]
        # ... also when it is the prompt that leaves too little room (the worker checks that)
        r = await client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": "x" * 100, "max_tokens": context - 50},
        )
        assert r.status_code == 400, r.text
        assert f"context of {context} tokens" in r.json()["error"]["message"]


@needs_connector
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_workers_in_process_chat_and_completions() -> None:
    async with demo_cluster() as client:
        model = TinyTransformer()

        prompt = "Disaggregated serving, in process."
        r = await client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 6},
        )
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["choices"][0]["token_ids"] == model.generate(tokenize(prompt), 6)
        kv = data["kv_transfer_params"]
        assert kv["num_tokens"] == len(tokenize(prompt)) and kv["transfer_bytes"] > 0
        assert int(r.headers["x-aiokv-transfer-bytes"]) == kv["transfer_bytes"]
        assert r.headers["x-aiokv-kv-plane"] == "engine"  # CPU: no IPC plane
        # vLLM's contract: the prefill said where its KV is (the engine's address, block ids)
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert f"{kv['remote_host']}:{kv['remote_port']}" == kv["remote_engine_id"]
        assert len(kv["remote_block_ids"]) == kv["num_blocks"] >= 1
        assert r.headers["x-request-id"] == kv["remote_request_id"]

        messages = [{"role": "user", "content": "hello there"}]
        r = await client.post(
            "/v1/chat/completions",
            json={"model": DEFAULT_MODEL_NAME, "messages": messages, "max_tokens": 5},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == model.generate(tokenize(chat_prompt(messages)), 5)
        assert isinstance(choice["message"]["content"], str)

        # a request the worker rejects is passed through as a 4xx, not retried
        r = await client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": [99999], "max_tokens": 2},
        )
        assert r.status_code == 400, r.text

        metrics = (await client.get("/metrics")).text
        assert "aiokv_router_kv_transfer_seconds_count 2.0" in metrics


@needs_connector
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_demo_workers_behind_static_lists() -> None:
    """The demo's workers without registration, named on the router's command line the
    way vLLM instances are: the same protocol serves both."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with contextlib.AsyncExitStack() as stack:
            urls: dict[str, str] = {}
            roles: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
            for role in roles:
                sock = bind_socket("127.0.0.1", 0)
                app = create_worker_app(WorkerConfig(role=role), socket_url(sock))
                urls[role] = await stack.enter_async_context(running(app, sock))
            cfg = RouterConfig(prefill=(urls["prefill"],), decode=(urls["decode"],))
            router_url = await stack.enter_async_context(running(create_router_app(cfg)))
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=router_url, timeout=30)
            )
            for _ in range(200):
                if (await client.get("/healthz")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            models = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in models] == [DEFAULT_MODEL_NAME]
            model = TinyTransformer()
            for prompt, stream in (("static one", False), ("static two", True)):
                body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 5}
                if not stream:
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    toks = r.json()["choices"][0]["token_ids"]
                else:
                    toks = []
                    async with client.stream(
                        "POST", "/v1/completions", json=body | {"stream": True}
                    ) as rs:
                        assert rs.status_code == 200
                        assert float(rs.headers["x-aiokv-transfer-seconds"]) > 0
                        async for line in rs.aiter_lines():
                            if line.startswith("data: {"):
                                toks += json.loads(line[6:])["choices"][0]["token_ids"]
                assert toks == model.generate(tokenize(prompt), 5)
    finally:
        torch.set_num_threads(threads)


@needs_connector
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_worker_logs_heartbeats_only_at_debug(tmp_path: Path) -> None:
    """At ``--log-level info`` a registered worker's log stays quiet between requests."""
    async with running(create_router_app(RouterConfig())) as router_url:
        async with httpx.AsyncClient(base_url=router_url, timeout=10) as client:
            argv = [sys.executable, "-m", "aiokv.serving.demo.worker", "--role", "decode"]
            argv += ["--router", router_url, "--heartbeat-interval", "0.05"]
            argv += ["--log-level", "info"]
            proc = await asyncio.to_thread(
                subprocess.Popen,
                argv,
                cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                for _ in range(600):
                    if (await client.get("/instances")).json()["instances"]:
                        break
                    assert proc.poll() is None
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the worker never registered")
                await asyncio.sleep(1.0)  # ~20 heartbeats
            finally:
                proc.terminate()
                _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    lines = err.decode(errors="replace").splitlines()
    assert any("registered with" in x for x in lines), lines[-20:]
    noisy = [x for x in lines if "heartbeat" in x.lower()]
    assert not noisy, noisy[:5]


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_prefill_holds_the_blocks_until_fetched_or_kv_timeout() -> None:
    """Pull mode: the prefill keeps a request's blocks until the decode side fetched
    them (then frees them), or frees them after ``kv_timeout`` if nobody comes -- and a
    decode that comes too late is refused at once, not after its own timeout."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with contextlib.AsyncExitStack() as stack:
            urls = {}
            for role in ("prefill", "decode"):
                sock = bind_socket("127.0.0.1", 0)
                cfg = WorkerConfig(role=role, kv_timeout=1.0)
                urls[role] = await stack.enter_async_context(
                    running(create_worker_app(cfg, socket_url(sock)), sock)
                )
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))

            async def free(role: str) -> int:
                return int((await client.get(urls[role] + "/healthz")).json()["free_blocks"])

            full = await free("prefill")
            prompt = "held until fetched"
            body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 1}
            prefill_kv = {"do_remote_decode": True}

            async def prefill(rid: str) -> dict[str, Any]:
                r = await client.post(
                    urls["prefill"] + "/v1/completions",
                    json={**body, "kv_transfer_params": prefill_kv},
                    headers={"x-request-id": rid},
                )
                assert r.status_code == 200, r.text
                kv: dict[str, Any] = r.json()["kv_transfer_params"]
                return kv

            kv = await prefill("held-1")
            assert await free("prefill") == full - kv["num_blocks"]  # held for the decode
            r = await client.post(
                urls["decode"] + "/v1/completions",
                json={**body, "max_tokens": 4, "kv_transfer_params": kv},
            )
            assert r.status_code == 200, r.text
            want = TinyTransformer().generate(tokenize(prompt), 4)
            assert r.json()["choices"][0]["token_ids"] == want
            for _ in range(100):  # freed once fetched (on the model thread, soon after)
                if await free("prefill") == full:
                    break
                await asyncio.sleep(0.01)
            assert await free("prefill") == full

            kv = await prefill("held-2")  # nobody fetches this one
            assert await free("prefill") == full - kv["num_blocks"]
            await asyncio.sleep(1.3)
            assert await free("prefill") == full
            t0 = time.monotonic()
            r = await client.post(
                urls["decode"] + "/v1/completions",
                json={**body, "max_tokens": 4, "kv_transfer_params": kv},
            )
            assert r.status_code == 502 and r.json()["error"]["code"] == "kv_fetch_failed"
            assert "NotPublishedError" in r.text and time.monotonic() - t0 < 1.0
    finally:
        torch.set_num_threads(threads)
