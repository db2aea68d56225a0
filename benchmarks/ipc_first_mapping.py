"""What the IPC plane's first request costs: the consumer maps and verifies the
producer's export then (once per producer export), on the request's path.

Two processes on one GPU (or cuda:0 → cuda:1 with two), one request at a time,
``--requests`` of them; per request the producer's ``send_request`` time, and on the
consumer the longest event-loop stall during it (a 1 ms ticker) and the time spent in
each mapping phase (IPC opens on the daemon thread, the mapping's set-up, the
verification's probe copies, the driver-launch check). Run it twice with the same
``TRITON_CACHE_DIR``: the first run compiles the kernel, the second finds it on disk.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/ipc_first_mapping.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import sys
import time
from typing import Any

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 32, 1024, 16, 8, 128


def _layout() -> Any:
    from aiokv.kv import FlashAttentionLayout

    return FlashAttentionLayout(LAYERS, BLOCKS, BLOCK, HEADS, DIM, "bfloat16")


def _timed(phases: list[tuple[str, float]], cls: Any, name: str) -> None:
    """Wrap ``cls.name`` (sync or async) so each call appends ``(name, seconds)``."""
    fn = getattr(cls, name)
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrap(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                phases.append((name, time.perf_counter() - t0))

        setattr(cls, name, awrap)
    else:

        @functools.wraps(fn)
        def wrap(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.append((name, time.perf_counter() - t0))

        setattr(cls, name, wrap)


async def _consumer(conn: Any, device: str, n: int) -> dict[str, Any]:
    import torch

    import aiokv
    from aiokv.kv import IpcOptions, KVConnector
    from aiokv.kv.ipc._consumer import Consumer

    phases: list[tuple[str, float]] = []
    from aiokv.kv.ipc import _mapping as _ipc_map

    for cls, name in (
        (_ipc_map.AbortWords, "prepare"),
        (_ipc_map.Mapper, "map_verified"),
        (_ipc_map.Mapper, "_open"),
        (_ipc_map.Mapper, "_verify"),
        (_ipc_map.Mapper, "_probe_copies"),
        (_ipc_map.Mapper, "_try_raw"),
        (Consumer, "_open_export"),
    ):
        _timed(phases, cls, name)
    torch.cuda.set_device(device)
    lay = _layout()
    caches = lay.allocate(device)
    out: dict[str, Any] = {"requests": []}
    async with aiokv.Engine(aiokv.EngineConfig(device=device, layout=lay.to_wire())) as eng:
        con = KVConnector(eng, lay, caches, ipc=IpcOptions(trust_unauthenticated=True))
        conn.send(eng.address)
        gap = [0.0]

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gap[0] = max(gap[0], now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        for r in range(n):
            gap[0] = 0.0
            del phases[:]
            t0 = time.perf_counter()
            plane = await con.recv_request(f"r{r}", list(range(r * 16, r * 16 + 16)), timeout=60)
            out["requests"].append(
                {
                    "plane": plane,
                    "recv_s": round(time.perf_counter() - t0, 6),
                    "max_loop_gap_s": round(gap[0], 6),
                    "phases": [(k, round(v, 6)) for k, v in phases],
                }
            )
            conn.send("next")
        tick.cancel()
        await con.aclose()
    return out


async def _producer(conn: Any, device: str, n: int) -> dict[str, Any]:
    import torch

    import aiokv
    from aiokv.kv import IpcOptions, KVConnector

    torch.cuda.set_device(device)
    lay = _layout()
    caches = lay.allocate(device)
    out: dict[str, Any] = {"send_s": []}
    async with aiokv.Engine(aiokv.EngineConfig(device=device, layout=lay.to_wire())) as eng:
        con = KVConnector(eng, lay, caches, ipc=IpcOptions(trust_unauthenticated=True))
        to = await asyncio.to_thread(conn.recv)
        for r in range(n):
            await asyncio.sleep(0.2)  # the consumer waits already
            t0 = time.perf_counter()
            await con.send_request(f"r{r}", list(range(16)), to=to, timeout=60)
            out["send_s"].append(round(time.perf_counter() - t0, 6))
            await asyncio.to_thread(conn.recv)
        await con.aclose()
    return out


def _main(role: str, conn: Any, device: str, n: int) -> None:
    fn = _producer if role == "producer" else _consumer
    res = asyncio.run(fn(conn, device, n))
    conn.send(("result", res))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    pc, pp = ctx.Pipe()
    t0 = time.perf_counter()
    cons = ctx.Process(
        target=_main, args=("consumer", b, "cuda:1" if gpus > 1 else "cuda:0", args.requests)
    )
    cons.start()
    addr = a.recv()
    prod = ctx.Process(target=_main, args=("producer", pp, "cuda:0", args.requests))
    prod.start()
    pc.send(addr)
    for _ in range(args.requests):
        msg = a.recv()
        pc.send(msg)
    res_c = a.recv()[1]
    res_p = pc.recv()[1]
    cons.join(30)
    prod.join(30)
    out = {"gpus": gpus, "wall_s": round(time.perf_counter() - t0, 3), **res_p, **res_c}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
