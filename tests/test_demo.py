"""The real stack: router + prefill and decode workers (model, Engine, KVConnector) over loopback.

``test_demo_cli`` runs ``aiokv.demo.run.main`` in a subprocess (which starts
router and workers as processes of its own) and needs exit status 0: every
disaggregated output equals single-process generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import torch

import aiokv.kv
from aiokv.demo.model import TinyTransformer, chat_prompt, tokenize
from aiokv.demo.worker import DEFAULT_MODEL_NAME, WorkerConfig
from aiokv.demo.worker import create_app as create_worker_app
from aiokv.router import RouterConfig
from aiokv.router import create_app as create_router_app
from aiokv.serving import bind_socket, serve_app, socket_url

ROOT = Path(__file__).resolve().parents[1]

needs_connector = pytest.mark.skipif(
    not hasattr(aiokv.kv, "KVConnector"), reason="aiokv.kv.KVConnector not available yet"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@needs_connector
@pytest.mark.timeout(120)
def test_demo_cli() -> None:
    code = "import sys; from aiokv.demo.run import main; sys.exit(main(sys.argv[1:]))"
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
async def running(app: Any, sock: Any = None) -> AsyncIterator[str]:
    sock = sock or bind_socket("127.0.0.1", 0)
    started = asyncio.Event()
    task = asyncio.create_task(serve_app(app, sock, on_started=started.set))
    try:
        waiter = asyncio.create_task(started.wait())
        done, _ = await asyncio.wait(
            {waiter, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED
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


@needs_connector
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_workers_in_process_chat_and_completions() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with contextlib.AsyncExitStack() as stack:
            router_url = await stack.enter_async_context(running(create_router_app(RouterConfig())))
            roles: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
            for role in roles:
                sock = bind_socket("127.0.0.1", 0)
                cfg = WorkerConfig(role=role, router_url=router_url, heartbeat_interval=0.2)
                app = create_worker_app(cfg, socket_url(sock))
                await stack.enter_async_context(running(app, sock))
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=router_url, timeout=30)
            )
            for _ in range(100):
                if (await client.get("/healthz")).json()["ready"]:
                    break
                await asyncio.sleep(0.1)
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
    finally:
        torch.set_num_threads(threads)
