"""No cold start: workers open their engine sessions to their peers before the first request.

``aiokv.serving.PeerWarmer`` (run by ``worker_lifespan``) connects in the background as
soon as the router lists a peer; these tests check that it does, that it never blocks
the caller, that failures are retried when the peer is named again, and that it stays
bounded when peers churn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the annotations here
from fastapi.responses import JSONResponse
from test_demo import demo_cluster, needs_connector

import aiokv
from aiokv.serving.lifespan import PeerWarmer, WorkerRegistration, _peer_addresses


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(cond: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@needs_connector
@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_workers_warm_their_sessions_before_the_first_request() -> None:
    async with demo_cluster() as client:
        listing = (await client.get("/instances")).json()["instances"]
        assert {i["role"] for i in listing} == {"prefill", "decode"}
        async with httpx.AsyncClient(timeout=5) as c:

            async def opened(url: str) -> int:
                return int((await c.get(url + "/stats")).json()["engine"]["sessions_opened"])

            # no request has been sent: any session open now was opened by the warm-up
            deadline = time.monotonic() + 10
            while True:
                counts = [await opened(i["url"]) for i in listing]
                if all(n >= 1 for n in counts) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert all(n >= 1 for n in counts), counts
            for inst in listing:
                other = next(i for i in listing if i["role"] != inst["role"])
                health = (await c.get(inst["url"] + "/healthz")).json()
                assert health["warm_peers"] == [other["kv_address"]]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_warm_opens_the_session_in_the_background() -> None:
    async with aiokv.Engine() as a, aiokv.Engine() as b:
        warmer = PeerWarmer(a)
        t0 = time.thread_time()  # (CPU time: the OS may give the core away meanwhile)
        warmer.warm([b.address])
        assert time.thread_time() - t0 < 0.05  # returns at once: nothing awaited
        assert not warmer.is_warm(b.address)
        await _until(lambda: warmer.is_warm(b.address))
        assert a.statistics().sessions_opened == 1
        # named again (the next request, the next listing): nothing new is opened
        warmer.warm([b.address, b.address])
        assert warmer.pending == 0
        await a.send("t", aiokv_tensor(), to=b.address)
        assert a.statistics().sessions_opened == 1
        await warmer.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_after_connect_runs_before_the_peer_counts_as_warm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with aiokv.Engine() as a, aiokv.Engine() as b, aiokv.Engine() as c:
        called: list[str] = []
        gate = asyncio.Event()

        async def after(peer: str) -> None:
            called.append(peer)
            await gate.wait()
            if peer == c.address:
                raise RuntimeError("mapping failed")

        warmer = PeerWarmer(a, after_connect=after)
        warmer.warm([b.address, c.address])
        await _until(lambda: len(called) == 2)
        assert not warmer.is_warm(b.address)  # not before after_connect finished
        with caplog.at_level(logging.WARNING, logger="aiokv.serving"):
            gate.set()
            await _until(lambda: warmer.pending == 0)
        assert warmer.is_warm(b.address) and warmer.is_warm(c.address)  # sessions are open
        assert any("mapping failed" in r.getMessage() for r in caplog.records)
        await warmer.aclose()


def aiokv_tensor() -> object:
    import torch

    return torch.arange(4, dtype=torch.float32)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_failed_warm_up_is_logged_and_retried_when_named_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with aiokv.Engine(timeouts=aiokv.Timeouts(connect=0.2)) as a:
        warmer = PeerWarmer(a, timeout=0.3)
        dead = "127.0.0.1:1"  # nothing listens on port 1
        with caplog.at_level(logging.WARNING, logger="aiokv.serving"):
            warmer.warm([dead])
            await _until(lambda: warmer.failures == 1 and warmer.pending == 0)
        assert not warmer.is_warm(dead)
        assert any(dead in r.getMessage() for r in caplog.records)
        warmer.warm([dead])  # the next request naming it tries again
        await _until(lambda: warmer.failures == 2 and warmer.pending == 0)
        await warmer.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_warming_stays_bounded_when_peers_churn() -> None:
    async with aiokv.Engine(timeouts=aiokv.Timeouts(connect=0.5)) as a:
        warmer = PeerWarmer(a, concurrency=2, max_peers=8, timeout=0.5)

        def warming() -> int:
            return sum(t.get_name().startswith("aiokv-warm-") for t in asyncio.all_tasks())

        for round_ in range(20):
            warmer.warm(f"127.0.0.1:{10 + round_ * 50 + i}" for i in range(50))
            assert warmer.pending <= 2 + 8  # two running, eight waiting: the rest dropped
            await asyncio.sleep(0.01)
            assert warming() <= 2
        await warmer.aclose()
        assert warmer.pending == 0
        assert warming() == 0
        warmer.warm(["127.0.0.1:9"])  # closed: ignored
        assert warmer.pending == 0


def test_peer_addresses_pick_the_other_role_of_the_same_model() -> None:
    reg = WorkerRegistration("http://r", "decode", "http://me", "10.0.0.2:5000", "m")
    listing = {
        "instances": [
            {"role": "prefill", "kv_address": "10.0.0.1:5000", "model": "m", "healthy": True},
            {"role": "prefill", "kv_address": "10.0.0.3:5000", "model": "*", "healthy": True},
            {"role": "prefill", "kv_address": "10.0.0.4:5000", "model": "other"},
            {"role": "prefill", "kv_address": "10.0.0.5:5000", "model": "m", "healthy": False},
            {"role": "decode", "kv_address": "10.0.0.6:5000", "model": "m"},
            {"role": "prefill", "kv_address": 5, "model": "m"},
            "junk",
        ]
    }
    assert _peer_addresses(reg, listing) == ["10.0.0.1:5000", "10.0.0.3:5000"]
    assert _peer_addresses(reg, {"instances": "nope"}) == []
    assert _peer_addresses(reg, []) == []


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_router_connects_to_a_newly_registered_worker_before_routing_to_it() -> None:
    from test_router import running

    from aiokv.serving.lifespan import register_with_router
    from aiokv.serving.router import RouterConfig
    from aiokv.serving.router import create_app as create_router_app

    peers: list[tuple[str, int]] = []
    worker = FastAPI()

    @worker.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        assert request.client is not None
        peers.append((request.client.host, request.client.port))
        return JSONResponse({"object": "list", "data": []})

    async with (
        running(create_router_app(RouterConfig())) as router_url,
        running(worker) as worker_url,
    ):
        reg = WorkerRegistration(router_url, "decode", worker_url, "127.0.0.1:9", "m", 5.0)
        task = asyncio.create_task(register_with_router(reg))
        try:
            await asyncio.wait_for(reg.registered.wait(), 5)
            # no request was routed, yet the router already holds a connection to it
            await _until(lambda: len(peers) == 1)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_failing_on_peers_callback_does_not_stop_the_heartbeat() -> None:
    from test_router import running

    from aiokv.serving.lifespan import register_with_router
    from aiokv.serving.router import RouterConfig
    from aiokv.serving.router import create_app as create_router_app

    calls = 0

    def broken(peers: list[str]) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("bug in the callback")

    async with running(create_router_app(RouterConfig())) as router_url:
        peer = WorkerRegistration(router_url, "prefill", "http://127.0.0.1:7", "127.0.0.1:7", "m")
        me = WorkerRegistration(router_url, "decode", "http://127.0.0.1:9", "127.0.0.1:9", "m", 0.1)
        me.on_peers, me.peers_interval = broken, 0.1
        tasks = [asyncio.create_task(register_with_router(r)) for r in (peer, me)]
        try:
            await _until(lambda: calls >= 2 and me.heartbeats >= 3)
            assert not any(t.done() for t in tasks)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
