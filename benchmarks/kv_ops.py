"""Time gather + scatter of KV blocks on the standard workloads (docs/benchmarks.md).

Llama-3-8B geometry (32 layers, 8 KV heads, head dim 128, block 16 tokens, bf16,
FlashAttention layout); block ids are random permutations, different on the
producer and the consumer. Each request: gather its blocks from the producer's
cache into a staging lease, scatter them into the consumer's cache at other ids.

    python benchmarks/kv_ops.py --device cuda:0 [--workloads short,long] [--impls ...]

Prints one JSON object per line: per workload and implementation the effective
rate (bytes landed in the consumer's cache / wall time incl. a final device sync)
for gather+scatter, gather alone and scatter alone, plus a single-request p50
latency, and a device-to-device copy of the same bytes as the reference.
Correctness is checked (consumer blocks == producer blocks) for every impl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokv.kv import (
    BoundCaches,
    FlashAttentionLayout,
    StagingPool,
    gather_blocks,
    scatter_blocks,
)
from aiokv.kv import _triton as kv_triton

WORKLOADS = {"short": (64, 256), "long": (16, 4096)}  # requests, tokens each
BLOCK = 16


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn: Callable[[], None], repeat: int) -> float:
    """Best-of-``repeat`` wall time of ``fn`` incl. a device sync (these machines are noisy)."""
    best = float("inf")
    for _ in range(repeat):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def run_workload(
    name: str, dev: torch.device, impls: list[str], repeat: int, layers: int = 32
) -> list[dict[str, Any]]:
    n_req, tokens = WORKLOADS[name]
    n = tokens // BLOCK
    total_blocks = n_req * n
    num_blocks = total_blocks + total_blocks // 4
    lay = FlashAttentionLayout(layers, num_blocks, BLOCK, 8, 128, "bfloat16")
    g = torch.Generator().manual_seed(0)
    prod = lay.allocate(dev, stacked=True)
    for t in prod:
        t.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, generator=g).to(dev)
            if dev.type == "cpu"
            else torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, device=dev)
        )
    cons = lay.allocate(dev, stacked=True, zero=True)
    p, c = BoundCaches(lay, prod), BoundCaches(lay, cons)
    sp = torch.randperm(num_blocks, generator=g)[:total_blocks]
    dp = torch.randperm(num_blocks, generator=g)[:total_blocks]
    src = [sp[r * n : (r + 1) * n].tolist() for r in range(n_req)]
    dst = [dp[r * n : (r + 1) * n].tolist() for r in range(n_req)]
    req_bytes = lay.request_nbytes(n)
    total = req_bytes * n_req
    pool = StagingPool(2 * req_bytes + 1024, dev)
    leases = [pool.try_alloc(req_bytes) for _ in range(2)]
    stages = [lease.tensor for lease in leases if lease is not None]
    out: list[dict[str, Any]] = []
    base = {
        "bench": "kv_ops",
        "workload": name,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "requests": n_req,
        "tokens": tokens,
        "bytes_per_request": req_bytes,
        "total_bytes": total,
    }

    # reference: one device-to-device copy of the same bytes, request by request
    ref_src = torch.empty(req_bytes, dtype=torch.uint8, device=dev)

    def memcpy() -> None:
        for r in range(n_req):
            stages[r % 2].copy_(ref_src)

    dt = timed(dev, memcpy, repeat)
    out.append({**base, "impl": "memcpy_reference", "gbps": total / dt / 1e9, "seconds": dt})

    for impl in impls:
        if impl == "triton" and not (dev.type == "cuda" and kv_triton.available()):
            continue
        c.tensors[0].zero_()

        def both(impl: Any = impl) -> None:
            for r in range(n_req):
                s = gather_blocks(p, lay, src[r], out=stages[r % 2], impl=impl)
                scatter_blocks(s, c, lay, dst[r], impl=impl)

        def gather_only(impl: Any = impl) -> None:
            for r in range(n_req):
                gather_blocks(p, lay, src[r], out=stages[r % 2], impl=impl)

        def scatter_only(impl: Any = impl) -> None:
            for r in range(n_req):
                scatter_blocks(stages[r % 2], c, lay, dst[r], impl=impl)

        t_both = timed(dev, both, repeat)
        # correctness: every request's blocks landed
        ok = True
        for r in range(0, n_req, max(1, n_req // 8)):
            a = gather_blocks(p, lay, src[r], impl="per_layer")
            b = gather_blocks(c, lay, dst[r], impl="per_layer")
            ok = ok and bool(torch.equal(a, b))
        t_g = timed(dev, gather_only, repeat)
        t_s = timed(dev, scatter_only, repeat)
        lat = []
        for r in range(min(n_req, 16)):
            sync(dev)
            t0 = time.perf_counter()
            s = gather_blocks(p, lay, src[r], out=stages[0], impl=impl)  # type: ignore[arg-type]
            scatter_blocks(s, c, lay, dst[r], impl=impl)  # type: ignore[arg-type]
            sync(dev)
            lat.append(time.perf_counter() - t0)
        out.append(
            {
                **base,
                "impl": impl,
                "gbps": total / t_both / 1e9,
                "gather_gbps": total / t_g / 1e9,
                "scatter_gbps": total / t_s / 1e9,
                "seconds": t_both,
                "request_p50_us": statistics.median(lat) * 1e6,
                "correct": ok,
            }
        )
    for lease in leases:
        if lease is not None:
            lease.release()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default="short,long")
    ap.add_argument("--impls", default="triton,stacked,per_layer")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick CPU check")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    impls = [i for i in args.impls.split(",") if i]
    for name in [w for w in args.workloads.split(",") if w]:
        for rec in run_workload(name, dev, impls, args.repeat, args.layers):
            print(json.dumps(rec), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
