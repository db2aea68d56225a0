"""Session 18 probe (one GPU): the copy kernel reading its block ids straight from
pinned host memory (mapped, zero-copy) against uploading them first
(cuMemcpyHtoDAsync, what the IPC plane does per request).

Prints, per pair count: the host time of the per-request driver calls after an idle
gap (upload + launch + record vs launch + record), and the kernel's GPU time both ways
(CUDA events), medians; checks both copies bit-exact.
    python3 benchmarks/ids_zero_copy.py [--gap-ms 2] [--n 200]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from aiokv.kv.ipc import _cudrv, _ipc_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    drv = _cudrv.driver()
    assert drv is not None
    lib = drv._lib
    lib.cuMemHostGetDevicePointer_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_void_p,
        ctypes.c_uint,
    ]
    L, NB, words = 32, 1024, 4096  # FA layout [2, NB, 16, 8, 128] bf16 = 32 KiB a block-part
    src = [
        torch.randint(0, 1 << 62, (2, NB, words), dtype=torch.int64, device=dev) for _ in range(L)
    ]
    dst = [torch.zeros(2, NB, words, dtype=torch.int64, device=dev) for _ in range(L)]
    st = torch.tensor([t.data_ptr() for t in src], dtype=torch.int64, device=dev)
    dt = torch.tensor([t.data_ptr() for t in dst], dtype=torch.int64, device=dev)
    abort = torch.zeros(64, dtype=torch.int32, device=dev)
    geo = dict(
        word=8,
        n_layers=L,
        parts=2,
        seg_words=words,
        src_part_stride=NB * words,
        dst_part_stride=NB * words,
        block_stride=words,
        base_align=16,
    )
    ids_dev = torch.zeros(1024, dtype=torch.int64, device=dev)
    ids_pin = torch.zeros(1024, dtype=torch.int64, pin_memory=True)
    dptr = ctypes.c_uint64()
    rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ids_pin.data_ptr(), 0)
    print("cuMemHostGetDevicePointer rc", rc, "same address", dptr.value == ids_pin.data_ptr())
    compiled = _ipc_kernel.launch_pair_copy(st, dt, ids_dev, abort, 0, n_pairs=1, **geo)
    rl = _ipc_kernel.RawLaunch(compiled, drv)
    stream = int(torch._C._cuda_getCurrentRawStream(0))
    ev = torch.cuda.Event()
    ev.record()  # (created lazily: now, so that the driver can record it)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    out = {}
    for n in (16, 256):
        for mode in ("upload", "zero-copy"):
            host, gpu = [], []
            for i in range(a.n):
                perm = torch.randperm(NB)[: 2 * n].tolist()
                ids_pin[: 2 * n] = torch.tensor(perm)
                torch.cuda.synchronize()
                time.sleep(a.gap_ms / 1000)
                t0 = time.perf_counter()
                evs[0].record()
                if mode == "upload":
                    drv.memcpy_htod_async(ids_dev.data_ptr(), ids_pin.data_ptr(), 16 * n, stream)
                    ids = ids_dev.data_ptr()
                else:
                    ids = dptr.value
                programs, args = _ipc_kernel.pair_copy_args(
                    st.data_ptr(), dt.data_ptr(), ids, abort.data_ptr(), dev, 0, n_pairs=n, **geo
                )
                rl.launch(programs, stream, args)
                drv.event_record(ev.cuda_event, stream)
                host.append(time.perf_counter() - t0)
                evs[1].record()
                torch.cuda.synchronize()
                gpu.append(evs[0].elapsed_time(evs[1]))
                if i == 0:
                    s = torch.tensor(perm[:n], device=dev)
                    d = torch.tensor(perm[n:], device=dev)
                    for ly in (0, L - 1):
                        assert torch.equal(dst[ly][:, d], src[ly][:, s]), (mode, n)
            out[f"{mode} n={n}"] = {
                "host_us_p50": round(statistics.median(host) * 1e6, 1),
                "gpu_us_p50": round(statistics.median(gpu) * 1e3, 1),
                "host_us_p90": round(sorted(host)[int(0.9 * len(host))] * 1e6, 1),
            }
            print(mode, n, out[f"{mode} n={n}"], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
