"""Overload is back-pressure, a bad request costs nothing: demo workers admit a request
when its KV blocks are free (bounded wait, then 503 with Retry-After), the router keeps
overloaded instances healthy and retries, a stream never ends silently, and a request
the decode refuses frees the prefill's blocks at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
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
from test_demo import running

from aiokv.serving.demo import model as model_mod
from aiokv.serving.demo.model import ModelConfig, TinyTransformer, tokenize
from aiokv.serving.demo.run import make_prompts
from aiokv.serving.demo.worker import DEFAULT_MODEL_NAME, WorkerConfig
from aiokv.serving.demo.worker import create_app as create_worker_app
from aiokv.serving.lifespan import bind_socket, socket_url
from aiokv.serving.router import RouterConfig
from aiokv.serving.router import create_app as create_router_app

ROOT = Path(__file__).resolve().parents[2]

#: a small cache: a handful of concurrent requests exhausts it
SMALL = ModelConfig(num_blocks=24, max_positions=384)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def cluster(
    router: RouterConfig | None = None, **worker: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str], dict[str, Any]]]:
    """Router + a registered prefill and decode worker in this process; the router's
    client, the workers' URLs and their state (``app.state.worker``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with contextlib.AsyncExitStack() as stack:
            router_url = await stack.enter_async_context(
                running(create_router_app(router or RouterConfig()))
            )
            urls: dict[str, str] = {}
            workers: dict[str, Any] = {}
            roles: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
            for role in roles:
                sock = bind_socket("127.0.0.1", 0)
                cfg = WorkerConfig(
                    role=role, router_url=router_url, heartbeat_interval=0.2, **worker
                )
                app = create_worker_app(cfg, socket_url(sock))
                workers[role] = app.state.worker
                urls[role] = await stack.enter_async_context(running(app, sock))
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=router_url, timeout=60)
            )
            for _ in range(100):
                if (await client.get("/healthz")).json()["ready"]:
                    break
                await asyncio.sleep(0.1)
            yield client, urls, workers
    finally:
        torch.set_num_threads(threads)


async def stream_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    """The ``data:`` events of a streamed completion, parsed (``[DONE]`` as a string)."""
    events: list[Any] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def healthy(metrics: str) -> list[float]:
    return [float(v) for v in re.findall(r"aiokv_router_instance_healthy\{[^}]*\} (\S+)", metrics)]


@pytest.mark.timeout(120)
def test_demo_command_that_exhausts_the_kv_blocks_finishes_token_exact() -> None:
    """``aiokv demo --prompts 64 --concurrency 32 --max-tokens 32``: 32 requests at once
    need more KV blocks than a worker has; every output still equals single-process
    generation."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "aiokv", "demo", "--prompts", "64"),
            *("--concurrency", "32", "--max-tokens", "32"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=110)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=10)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "64/64 outputs equal single-process generate" in text, text[-3000:]


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_more_requests_than_kv_blocks_wait_for_them() -> None:
    """16 streams at once on a 24-block cache (each needs 5-10): they queue for blocks,
    every one is token-exact, and no instance is ever taken out."""
    model = TinyTransformer(SMALL)
    prompts = [p[:100] for p in make_prompts(16)]
    want = [model.generate(tokenize(p), 24) for p in prompts]
    async with cluster(model=SMALL) as (client, urls, _):
        body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 24}
        results = await asyncio.gather(
            *(stream_tokens(client, {**body, "prompt": p}) for p in prompts)
        )
        for events, w in zip(results, want, strict=True):
            assert events[-1] == "[DONE]"
            assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == w
        stats = {r: (await client.get(u + "/stats")).json()["kv_blocks"] for r, u in urls.items()}
        # the cache ran out: requests waited for blocks rather than failing
        assert stats["decode"]["waited"] + stats["prefill"]["waited"] > 0, stats
        assert stats["decode"]["refused"] == stats["prefill"]["refused"] == 0, stats
        assert stats["decode"]["free"] == stats["prefill"]["free"] == SMALL.num_blocks
        metrics = (await client.get("/metrics")).text
        assert healthy(metrics) == [1.0, 1.0], metrics
        assert 'aiokv_router_errors_total{kind="upstream"}' not in metrics


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_overloaded_worker_answers_503_retry_after_and_stays_healthy() -> None:
    """A decode worker that cannot admit (its queue is full, or the wait ran out)
    answers 503 ``out_of_kv_blocks`` with ``Retry-After``; the router keeps it healthy,
    retries for ``overload_wait`` and then answers 503 ``overloaded`` with
    ``Retry-After``; the prefill's blocks of the refused requests are freed at once,
    and a request waiting when the room comes back is served token-exact."""
    router = RouterConfig(overload_wait=0.6)
    async with cluster(router, model=SMALL, max_waiting=1, admit_timeout=0.2) as (
        client,
        urls,
        workers,
    ):
        model = TinyTransformer(SMALL)
        dec = workers["decode"]
        held = await dec.admission.take(SMALL.num_blocks)  # the decode's whole cache
        small = {"model": DEFAULT_MODEL_NAME, "prompt": "hello", "max_tokens": 30}
        want = model.generate(tokenize("hello"), 30)
        r = await client.post(urls["decode"] + "/v1/completions", json=small)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "out_of_kv_blocks"
        assert r.headers["retry-after"] == "1"

        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=small)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"] == "1"
        assert time.monotonic() - t0 >= 0.6
        # the refused requests' prefill blocks were declined and freed
        for _ in range(200):
            st = (await client.get(urls["prefill"] + "/stats")).json()["kv_blocks"]
            if st["free"] == SMALL.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert st["free"] == SMALL.num_blocks, st
        metrics = (await client.get("/metrics")).text
        assert healthy(metrics) == [1.0, 1.0], metrics
        assert 'aiokv_router_errors_total{kind="upstream"}' not in metrics

        # room comes back while a request waits for it: served, token-exact
        task = asyncio.create_task(client.post("/v1/completions", json=small))
        await asyncio.sleep(0.05)
        dec.free_blocks(held)
        r = await task
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_failing_stream_ends_with_an_error_event_and_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    step = model_mod.DecodeSession.step

    def failing_step(self: model_mod.DecodeSession) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("decode broke")
        return step(self)

    async with cluster(model=SMALL) as (client, _, _):
        monkeypatch.setattr(model_mod.DecodeSession, "step", failing_step)
        events = await stream_tokens(
            client, {"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 5}
        )
        assert len(events) == 4 and events[-1] == "[DONE]", events
        assert events[2]["error"]["code"] == "decode_failed"
        assert "decode broke" in events[2]["error"]["message"]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_context_overflow_of_token_ids_is_refused_before_the_prefill() -> None:
    async with cluster(model=SMALL) as (client, _, _):
        body = {"model": DEFAULT_MODEL_NAME, "prompt": [65] * 300, "max_tokens": 100}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert "300" in r.json()["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert "aiokv_router_prefill_seconds_count 0.0" in metrics, metrics


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_request_the_decode_refuses_frees_the_prefill_blocks_at_once() -> None:
    """A text prompt the router cannot count: the prefill takes every block, the decode
    refuses prompt + max_tokens (400), and the prefill frees its blocks at once (not
    after ``kv_timeout``), so the next request is served."""
    async with cluster(model=SMALL, kv_timeout=30.0) as (client, urls, _):
        prompt = "y" * 370  # 371 tokens: all 24 blocks
        t0 = time.monotonic()
        r = await client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 100},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        free = -1
        for _ in range(300):
            free = (await client.get(urls["prefill"] + "/healthz")).json()["free_blocks"]
            if free == SMALL.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert free == SMALL.num_blocks
        assert time.monotonic() - t0 < 10  # kv_timeout is 30 s
        r = await client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": "next", "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        model = TinyTransformer(SMALL)
        assert r.json()["choices"][0]["token_ids"] == model.generate(tokenize("next"), 4)
