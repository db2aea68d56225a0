"""One awaited ``send`` + ``recv`` at a time, by tensor size: median milliseconds.

Both engines run in this process on loopback (one event loop), so the figure is the
whole cost of one transfer on both ends: the admission path (a PUT on credit, or
RESERVE/GRANT for a tensor larger than one data frame), the wire and the landing
(zero-copy for one frame, one copy for more). Used for docs/benchmarks.md,
"TCP transport, CPU tensors, loopback":

    python benchmarks/send_latency.py [--iters 60] [--sizes 0.5,1,2,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

import aiokv


async def main(sizes: list[float], iters: int) -> dict[str, float]:
    out = {}
    async with aiokv.Engine() as a, aiokv.Engine() as b:
        for mib in sizes:
            t = torch.randint(0, 256, (int(mib * (1 << 20)),), dtype=torch.uint8)
            took = []
            for i in range(iters):
                t0 = time.perf_counter()
                await a.send(f"t{i}", t, to=b.address, timeout=30)
                await b.recv(f"t{i}", timeout=30)
                took.append(time.perf_counter() - t0)
            out[f"{mib:g}"] = round(statistics.median(took[iters // 6 :]) * 1e3, 3)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--sizes", default="0.5,1,2,4,16", help="MiB, comma-separated")
    ns = p.parse_args()
    torch.set_num_threads(1)  # the landing copies with ctypes.memmove, not torch threads
    print(json.dumps(asyncio.run(main([float(x) for x in ns.sizes.split(",")], ns.iters))))
