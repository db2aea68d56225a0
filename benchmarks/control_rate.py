"""Transfers per second through two engines in one process (TCP, 1 KiB tensors, 32 in flight).

    python benchmarks/control_rate.py [N] [prof]   # "prof" adds a cProfile table

Measures the per-transfer control-path cost (RESERVE / GRANT / DATA / DONE)
on the CPU: both engines share one event loop, so the figure is the whole
cost of a transfer on both sides.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import sys
import time
from collections import deque

import torch
import uvloop

from aiokv import Engine, TransferHandle


async def run(n: int) -> None:
    async with Engine() as a, Engine() as b:
        t = torch.ones(256)
        await a.send("warm", t, to=b.address)
        await b.recv("warm")

        async def consume() -> None:
            for i in range(n):
                await b.recv(f"x{i}")

        consumer = asyncio.create_task(consume())
        t0 = time.perf_counter()
        inflight: deque[TransferHandle] = deque()
        for i in range(n):
            if len(inflight) >= 32:
                await inflight.popleft()
            inflight.append(a.send_nowait(f"x{i}", t, to=b.address))
        while inflight:
            await inflight.popleft()
        await consumer
        dt = time.perf_counter() - t0
        print(f"{n / dt:.0f} transfers/s, {dt / n * 1e6:.0f} us each")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    if len(sys.argv) > 2 and sys.argv[2] == "prof":
        prof = cProfile.Profile()
        prof.runcall(uvloop.run, run(n))
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    else:
        uvloop.run(run(n))


if __name__ == "__main__":
    main()
