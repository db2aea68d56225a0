"""Small responses must not wait for Nagle's algorithm.

A server socket made with ``proto=0`` never gets ``TCP_NODELAY`` from asyncio,
and a small response then waits for the client's delayed ACK: ~40 ms per hop.
``test_tiny_completion_latency`` sends 50 tiny completions through router →
prefill → decode (the demo's CPU workers, real uvicorn servers on loopback)
and needs a median under 20 ms, half of one such stall. The machine may
be shared with other test runs, so up to three rounds of 50 are measured and
the best round counts: with a Nagle stall on any hop every round would be
above 40 ms. (A 10 ms bound would measure the machine's speed, not the defect:
the same 2-core machine measures 8.4-11.4 ms from one run to the next.)
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

import pytest
from test_demo import demo_cluster

from aiokv.serving.demo.worker import DEFAULT_MODEL_NAME
from aiokv.serving.lifespan import bind_socket

P50_BOUND_S = 0.020


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.timeout(10)
async def test_served_sockets_have_tcp_nodelay() -> None:
    listener = bind_socket("127.0.0.1", 0)
    accepted: list[socket.socket] = []

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.append(transport.get_extra_info("socket"))

    try:
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        server = await asyncio.get_running_loop().create_server(Proto, sock=listener)
        async with server:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if accepted:
                    break
                await asyncio.sleep(0.01)
            assert accepted, "no connection accepted"
            assert accepted[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            writer.close()
    finally:
        listener.close()


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_tiny_completion_latency() -> None:
    async with demo_cluster() as client:  # router + prefill + decode, ready
        body = {"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 1}
        for _ in range(5):  # warm-up: connections, first allocations
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        p50s: list[float] = []
        for _round in range(3):
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            p50s.append(statistics.median(times))
            if p50s[-1] < P50_BOUND_S:
                break
        shown = ", ".join(f"{p * 1e3:.2f}" for p in p50s)
        print(f"tiny completion, router -> prefill -> decode, p50 of 50 per round: {shown} ms")
        assert min(p50s) < P50_BOUND_S, f"p50 {shown} ms (a Nagle stall is ~40 ms)"
