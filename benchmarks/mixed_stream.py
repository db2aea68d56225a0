"""A stream of mixed sizes: three 256 KiB tensors, then one 2 MiB, repeated; 8 in flight.

Both engines in this process on loopback; the receiver collects each tensor as soon as
its send completed. Prints GB/s per repetition (the first one warms up and is dropped)
and their median. Every tensor here goes on credit (PUT: up to 4 MiB), the 2 MiB one
as two bounded data frames reassembled as they land. Used for
docs/benchmarks.md, "TCP transport, CPU tensors, loopback":

    python benchmarks/mixed_stream.py [--n 200] [--reps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

import aiokv


async def main(n: int, reps: int) -> dict[str, object]:
    rates = []
    async with aiokv.Engine() as a, aiokv.Engine() as b:
        small = torch.randint(0, 256, (256 << 10,), dtype=torch.uint8)
        big = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
        for rep in range(reps):
            t0 = time.perf_counter()
            nbytes = 0
            inflight: list[tuple[str, aiokv.TransferHandle]] = []
            for i in range(n):
                tid = f"r{rep}.{i}"
                t = big if i % 4 == 3 else small
                nbytes += t.numel()
                inflight.append((tid, a.send_nowait(tid, t, to=b.address, timeout=60)))
                if len(inflight) >= 8:
                    done_id, h = inflight.pop(0)
                    await h
                    await b.recv(done_id, timeout=60)
            for done_id, h in inflight:
                await h
                await b.recv(done_id, timeout=60)
            if rep:
                rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {"GBps": [round(r, 3) for r in rates], "median": round(statistics.median(rates), 3)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--reps", type=int, default=4)
    ns = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(main(ns.n, ns.reps))))
