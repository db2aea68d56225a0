"""Raw NCCL send/recv between two GPUs: the reference every aiokv figure is a ratio of.

Two processes (this script starts them), one GPU each, a *blocking* NCCL
communicator made with plain ``ncclCommInitRank`` through aiokv's ctypes
binding — no asyncio, no poller, no events in the loop: rank 0 posts
``ncclSend`` back to back on one stream, rank 1 ``ncclRecv``; rank 1 times the
batch with CUDA events. Prints one JSON line per message size::

    {"size_bytes": 1048576, "gbps": 28.1, "us_per_msg": 37.3, "iters": 2000, ...}

GB/s are 1e9 bytes per second (as in docs/benchmarks.md). Usage::

    python benchmarks/raw_nccl.py [--sizes-mib 1,4,16,32,128,512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _worker(
    rank: int, uid_hex: str, sizes: list[int], repeats: int, min_bytes: int, variant: str
) -> None:
    import torch

    from aiokv.gpu.nccl.library import NcclLibrary, load_library

    lib = load_library()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm = ctypes.c_void_p()
    uid = NcclLibrary.unique_id_from_bytes(bytes.fromhex(uid_hex))
    lib.check(lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank), "ncclCommInitRank")
    h = comm.value
    stream = torch.cuda.Stream(dev)
    s = stream.cuda_stream
    peer = 1 - rank
    u8 = lib.dtype(torch.uint8)
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
    tiny = torch.zeros(1, dtype=torch.uint8, device=dev)
    tiny2 = torch.zeros(1, dtype=torch.uint8, device=dev)

    def barrier() -> None:
        lib.check(lib.ncclGroupStart(), "ncclGroupStart")
        lib.check(lib.ncclSend(tiny.data_ptr(), 1, u8, peer, h, s), "ncclSend")
        lib.check(lib.ncclRecv(tiny2.data_ptr(), 1, u8, peer, h, s), "ncclRecv")
        lib.check(lib.ncclGroupEnd(), "ncclGroupEnd")
        stream.synchronize()

    fn = lib.ncclSend if rank == 0 else lib.ncclRecv
    name = "ncclSend" if rank == 0 else "ncclRecv"
    # buffers a receiver rotates through, as aiokv's receive side does (one per message in flight)
    ring = [buf] + [torch.empty_like(buf) for _ in range(3)] if "rotate" in variant else [buf]
    side = torch.cuda.Stream(dev)

    def batch(size: int, n: int) -> None:
        inflight: list[torch.cuda.Event] = []
        for i in range(n):
            ptr = ring[i % len(ring)].data_ptr()
            if "event" in variant:  # order after another stream, as aiokv's posting does
                stream.wait_event(side.record_event())
            if "group" in variant:
                lib.check(lib.ncclGroupStart(), "ncclGroupStart")
            rc = fn(ptr, size, u8, peer, h, s)
            if rc:
                lib.check(rc, name, h)
            if "group" in variant:
                lib.check(lib.ncclGroupEnd(), "ncclGroupEnd")
            if "depth" in variant:  # at most 3 messages posted ahead, as grants allow
                inflight.append(stream.record_event())
                while len(inflight) > 3:
                    while not inflight[0].query():
                        pass
                    inflight.pop(0)

    for size in sizes:
        iters = max(20, min(2000, min_bytes // size))
        batch(size, 3)  # warm-up (connections, first-touch)
        stream.synchronize()
        rates: list[float] = []
        for _ in range(repeats):
            barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            batch(size, iters)
            end.record(stream)
            end.synchronize()
            secs = start.elapsed_time(end) / 1e3
            rates.append(size * iters / secs / 1e9)
        if rank == 1:
            gbps = statistics.median(rates)
            print(
                json.dumps(
                    {
                        "size_bytes": size,
                        "variant": variant,
                        "gbps": round(gbps, 2),
                        "us_per_msg": round(size / (gbps * 1e9) * 1e6, 2),
                        "iters": iters,
                        "repeats": repeats,
                        "best_gbps": round(max(rates), 2),
                        "nccl": lib.version_string,
                        "device": torch.cuda.get_device_name(dev),
                    }
                ),
                flush=True,
            )
    stream.synchronize()
    lib.ncclCommDestroy(h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,32,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-bytes-per-repeat", type=int, default=4 << 30)
    ap.add_argument(
        "--variant",
        default="plain",
        help="posting pattern: plain, or a '+'-joined mix of group (each op in its own NCCL group), "
        "rotate (receiver cycles 4 buffers), event (stream waits on an event per op), depth (<=3 ahead)",
    )
    ap.add_argument("--worker", nargs=2, metavar=("RANK", "UID"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(float(x) * MiB) for x in args.sizes_mib.split(",") if x]
    if args.worker:
        _worker(
            int(args.worker[0]),
            args.worker[1],
            sizes,
            args.repeats,
            args.min_bytes_per_repeat,
            args.variant,
        )
        return 0

    import torch

    if torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}))
        return 0
    from aiokv.gpu.nccl import get_unique_id

    uid = get_unique_id().hex()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH", "")]))
    common = [
        "--sizes-mib",
        args.sizes_mib,
        "--repeats",
        str(args.repeats),
        "--min-bytes-per-repeat",
        str(args.min_bytes_per_repeat),
        "--variant",
        args.variant,
    ]
    procs = [
        subprocess.Popen([sys.executable, __file__, *common, "--worker", str(r), uid], env=env)
        for r in (0, 1)
    ]
    rc = 0
    for p in procs:
        try:
            rc |= p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
