"""The IPC plane's copy kernel alone, on one GPU: GPU time per request, vs a memcpy.

    python3 benchmarks/ipc_kernel.py            # JSON lines: short, long, one 256-token

Two paged caches in the FlashAttention layout of docs/benchmarks.md (32 layers, 8
KV heads, head dim 128, block 16, bf16) on ``cuda:0``, random block tables on each
side (as in ``aiokv.cli.bench.kv``); each request is ONE launch of
:func:`aiokv.kv.ipc._kernel.launch_pair_copy` (what the consumer enqueues), timed
with CUDA events over all requests of the workload, median of 5 runs. The
reference moves the same bytes as one contiguous ``copy_`` per request. On one
GPU both read and write HBM, so this is the kernel's own ceiling and overhead,
not the two-GPU NVLink figure (that needs two GPUs).
"""

from __future__ import annotations

import json
import statistics

import torch

from aiokv.kv import FlashAttentionLayout
from aiokv.kv.ipc import _kernel as k


def run(name: str, requests: int, blocks: int, reps: int = 5) -> dict[str, object]:
    dev = torch.device("cuda:0")
    nb = requests * blocks * 5 // 4 + 1
    lay = FlashAttentionLayout(32, nb, 16, 8, 128, "bfloat16")
    src = torch.empty((32, *lay.layer_shape()), dtype=torch.bfloat16, device=dev)
    dst = torch.zeros_like(src)
    src.view(torch.uint8).random_(0, 256)
    g = torch.Generator().manual_seed(1)
    ps = torch.randperm(nb, generator=g)
    pd = torch.randperm(nb, generator=g)
    ids = [
        torch.stack([ps[r * blocks : (r + 1) * blocks], pd[r * blocks : (r + 1) * blocks]]).to(dev)
        for r in range(requests)
    ]
    seg = lay.segment_numel() * lay.itemsize
    w = 8
    st = torch.tensor([src[i].data_ptr() for i in range(32)], dtype=torch.int64, device=dev)
    dt = torch.tensor([dst[i].data_ptr() for i in range(32)], dtype=torch.int64, device=dev)
    abort = torch.zeros(16, dtype=torch.int32, device=dev)
    req_bytes = lay.request_nbytes(blocks)
    a = torch.empty(req_bytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)

    cta = 32768

    def kernel() -> None:
        for x in ids:
            k.launch_pair_copy(
                st,
                dt,
                x,
                abort,
                0,
                word=w,
                n_layers=32,
                parts=2,
                seg_words=seg // w,
                src_part_stride=nb * seg // w,
                dst_part_stride=nb * seg // w,
                block_stride=seg // w,
                base_align=16,
                program_bytes=cta,
            )

    def memcpy() -> None:
        for _ in ids:
            b.copy_(a)

    out: dict[str, object] = {
        "workload": name,
        "requests": requests,
        "blocks": blocks,
        "bytes": requests * req_bytes,
    }
    for label, fn, size in (
        ("kernel", kernel, 32768),
        ("kernel16k", kernel, 16384),
        ("kernel64k", kernel, 65536),
        ("memcpy", memcpy, 0),
    ):
        cta = size
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        t = statistics.median(times)
        out[label + "_ms_per_request"] = round(t / requests * 1e3, 4)
        out[label + "_gbps"] = round(requests * req_bytes / t / 1e9, 1)
    cta = 32768
    dst.zero_()
    kernel()
    torch.cuda.synchronize()
    # bit-exact check (32 KiB programs, as the plane runs them)
    ok = True
    for x in ids:
        for li in (0, 31):
            ok = ok and torch.equal(
                src[li].view(torch.uint8).index_select(1, x[0]),
                dst[li].view(torch.uint8).index_select(1, x[1]),
            )
    out["ok"] = ok
    return out


def main() -> None:
    for name, r, blk in (("short", 64, 16), ("long", 16, 256), ("one-256-token", 1, 16)):
        print(json.dumps(run(name, r, blk)), flush=True)


if __name__ == "__main__":
    main()
