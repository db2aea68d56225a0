"""Measure what one 2-rank NCCL communicator costs, by channel (CTA) cap.

Two processes (cuda:0, cuda:1). For each ``max_ctas`` value: device memory
(``torch.cuda.mem_get_info``, which sees NCCL's own cudaMalloc) and host RSS
before init, after init, and after the first send/recv (NCCL connects p2p
lazily, so the buffers appear then). Prints one JSON line per setting (rank 0).

    python benchmarks/comm_memory.py [--ctas 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(rank: int, ctas: list[int], q_in: mp.Queue, q_out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch

    from aiokv.gpu.nccl.comm import Communicator, get_unique_id

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    torch.ones(1, device=dev)  # CUDA context first, so it is not counted

    async def one(c: int) -> dict[str, float]:
        if rank == 0:
            uid = get_unique_id()
            q_out.put(uid)
        else:
            uid = q_in.get()
        free0, _ = torch.cuda.mem_get_info(dev)
        rss0 = rss_mib()
        t0 = time.perf_counter()
        comm = await Communicator.create(uid, rank, 2, dev, timeout=60, max_ctas=c)
        init_s = time.perf_counter() - t0
        free1, _ = torch.cuda.mem_get_info(dev)
        rss1 = rss_mib()
        s = torch.cuda.Stream(device=dev)
        t = torch.ones(1 << 20, device=dev)
        with comm.group():
            if rank == 0:
                comm.send(t, 1, s)
            else:
                comm.recv(t, 0, s)
        await comm.wait_ready()
        while not s.query():
            await asyncio.sleep(0.001)
        free2, _ = torch.cuda.mem_get_info(dev)
        rss2 = rss_mib()
        await comm.aclose()
        return {
            "max_ctas": c,
            "init_s": round(init_s, 3),
            "device_mib_after_init": round((free0 - free1) / 2**20, 1),
            "device_mib_after_connect": round((free0 - free2) / 2**20, 1),
            "host_rss_mib_after_init": round(rss1 - rss0, 1),
            "host_rss_mib_after_connect": round(rss2 - rss0, 1),
        }

    async def main() -> None:
        for c in ctas:
            r = await one(c)
            if rank == 0:
                print(json.dumps(r), flush=True)
            await asyncio.sleep(0.5)

    asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctas", default="1,2,4,8,16,32")
    args = ap.parse_args()
    ctas = [int(x) for x in args.ctas.split(",")]
    ctx = mp.get_context("spawn")
    q01: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    q10: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    p0 = ctx.Process(target=worker, args=(0, ctas, q10, q01))
    p1 = ctx.Process(target=worker, args=(1, ctas, q01, q10))
    p0.start()
    p1.start()
    p0.join(600)
    p1.join(60)
    return 0 if p0.exitcode == 0 and p1.exitcode == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
