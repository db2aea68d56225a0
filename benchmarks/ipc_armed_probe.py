"""Device probe (session 15): can the consumer's copy be queued *before* the producer is
ready, released by the producer's own stream, with no host on the critical path?

Two processes on one GPU share a page of ``/dev/shm`` that both register with
``cuMemHostRegister``. Per iteration the consumer enqueues on a stream of its own
``cuStreamWaitValue64(flag >= gen)`` -> the ids' upload from the shared page -> a copy
of ``--mib`` MiB -> an event, then says "armed" in the page; the producer writes the
ids into the page and enqueues ``cuStreamWriteValue64(flag = gen)`` on its stream. The
consumer spins on its event. Latency = the producer's call -> the consumer saw the event
(``perf_counter`` is CLOCK_MONOTONIC, shared by both processes).

Compared in the same run with the host hop (the producer writes ``gen`` from the host,
the consumer's host spins on it, then launches the same upload + copy + event), and the
consumer releasing its own armed wait from the host (the abort path). And two
ready signals alone, no copy: ``event_hop`` -- the producer records an interprocess
event on its idle stream, the consumer's host spins on ``query()`` (what the IPC plane's
consumer does with a descriptor's ready event); ``write_hop`` -- the producer's stream
writes the shared page (``cuStreamWriteValue64``), the consumer's host spins on it.

``python3 benchmarks/ipc_armed_probe.py [--iters 300] [--mib 4] [--gap-ms 0.5]``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import secrets
import statistics
import struct
import time

FLAG, ARMED, T0, DONE, IDS, FLAG2, EVH = 0, 64, 128, 192, 256, 512, 1024
MODES = (
    "armed", "host_hop", "self_release", "event_hop", "write_hop",
    "event_hop_default", "event_hop_after_copy",
)  # fmt: skip
SIZE = 4096


def _drv():  # type: ignore[no-untyped-def]
    lib = ctypes.CDLL("libcuda.so.1")
    c = ctypes
    lib.cuMemHostRegister_v2.argtypes = [c.c_void_p, c.c_size_t, c.c_uint]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [c.POINTER(c.c_uint64), c.c_void_p, c.c_uint]
    for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
        f = getattr(lib, name)
        f.argtypes = [c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint]
        f.restype = c.c_int
    lib.cuMemcpyHtoDAsync_v2.argtypes = [c.c_uint64, c.c_void_p, c.c_size_t, c.c_void_p]
    lib.cuDeviceGetAttribute.argtypes = [c.POINTER(c.c_int), c.c_int, c.c_int]
    return lib


def _map(path: str):  # type: ignore[no-untyped-def]
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    lib = _drv()
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, SIZE)
    os.close(fd)
    buf = (ctypes.c_char * SIZE).from_buffer(mm)
    host = ctypes.addressof(buf)
    rc = lib.cuMemHostRegister_v2(host, SIZE, 0x1 | 0x2)  # PORTABLE | DEVICEMAP
    dptr = ctypes.c_uint64()
    rc2 = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, 0)
    return torch, lib, mm, buf, host, dptr.value, (rc, rc2)


def _spin(mm: mmap.mmap, off: int, want: int, until: float) -> bool:
    while struct.unpack_from("<Q", mm, off)[0] < want:
        if time.perf_counter() > until:
            return False
    return True


def consumer(path: str, args: argparse.Namespace, q: mp.Queue) -> None:  # type: ignore[type-arg]
    torch, lib, mm, _buf, host, dptr, rcs = _map(path)
    attrs = {}
    for a in (92, 93, 94):
        v = ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(v), a, 0)
        attrs[a] = v.value
    n = args.mib * (1 << 20)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    ids = torch.zeros(32, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    rs = s.cuda_stream
    ev = torch.cuda.Event()
    out: dict[str, list[float]] = {m: [] for m in (*MODES, "enqueue_us")}
    assert _spin(mm, EVH, 1, time.perf_counter() + 60)  # the producer's event handle
    (hlen,) = struct.unpack_from("<Q", mm, EVH)
    handle = bytes(mm[EVH + 8 : EVH + 8 + hlen])
    pev = torch.cuda.Event.from_ipc_handle(torch.device("cuda:0"), handle)
    gen = 0
    for mode in MODES:
        for it in range(args.iters + 20):
            gen += 1
            if mode in ("armed", "self_release"):
                t = time.perf_counter()
                rc = lib.cuStreamWaitValue64_v2(rs, dptr + FLAG, gen, 0)  # GEQ
                assert rc == 0, rc
                rc = lib.cuMemcpyHtoDAsync_v2(ids.data_ptr(), host + IDS, 256, rs)
                assert rc == 0, rc
                with torch.cuda.stream(s):
                    dst.copy_(src)
                    ev.record(s)
                out["enqueue_us"].append((time.perf_counter() - t) * 1e6)
                struct.pack_into("<Q", mm, ARMED, gen)
                if mode == "self_release":
                    time.sleep(0.001)
                    t0 = time.perf_counter()
                    struct.pack_into("<Q", mm, FLAG, gen)
                else:
                    t0 = None
                while not ev.query():
                    pass
                t1 = time.perf_counter()
                if t0 is None:
                    t0 = struct.unpack_from("<d", mm, T0)[0]
            elif mode.startswith("event_hop"):  # the producer records an IPC event
                if mode == "event_hop_after_copy":  # as the bench: our copy, synchronised
                    with torch.cuda.stream(s):
                        dst.copy_(src)
                    torch.cuda.synchronize()
                struct.pack_into("<Q", mm, ARMED, gen)
                assert _spin(mm, DONE, gen, time.perf_counter() + 10)
                while not pev.query():
                    pass
                t1 = time.perf_counter()
                t0 = struct.unpack_from("<d", mm, T0)[0]
            elif mode == "write_hop":  # the producer's stream writes the page; we read it
                struct.pack_into("<Q", mm, ARMED, gen)
                assert _spin(mm, FLAG2, gen, time.perf_counter() + 10)
                t1 = time.perf_counter()
                t0 = struct.unpack_from("<d", mm, T0)[0]
            else:
                struct.pack_into("<Q", mm, ARMED, gen)
                assert _spin(mm, DONE, gen, time.perf_counter() + 10)
                t0 = struct.unpack_from("<d", mm, T0)[0]
                with torch.cuda.stream(s):
                    lib.cuMemcpyHtoDAsync_v2(ids.data_ptr(), host + IDS, 256, rs)
                    dst.copy_(src)
                    ev.record(s)
                while not ev.query():
                    pass
                t1 = time.perf_counter()
            if it >= 20:
                out[mode].append((t1 - t0) * 1e6)
        torch.cuda.synchronize()
    ok = bool(torch.equal(dst, src))
    struct.pack_into("<Q", mm, ARMED, 1 << 62)  # stop
    q.put({"regs": rcs, "attrs": attrs, "bit_exact": ok, "samples": out})


def producer(path: str, args: argparse.Namespace) -> None:
    torch, lib, mm, _buf, _host, dptr, _rcs = _map(path)
    s = torch.cuda.Stream()
    rs = s.cuda_stream
    ev = torch.cuda.Event(interprocess=True, blocking=False)
    ev.record(s)
    h = ev.ipc_handle()
    mm[EVH + 8 : EVH + 8 + len(h)] = h
    struct.pack_into("<Q", mm, EVH, len(h))
    gen = 0
    for mode in MODES:
        for _ in range(args.iters + 20):
            gen += 1
            if not _spin(mm, ARMED, gen, time.perf_counter() + 30):
                return
            if mode == "self_release":
                continue
            t = time.perf_counter() + args.gap_ms / 1000
            if args.gap_ms >= 1:
                time.sleep(args.gap_ms / 1000)
            while time.perf_counter() < t:
                pass
            struct.pack_into("<16q", mm, IDS, *range(16))
            t0 = time.perf_counter()
            struct.pack_into("<d", mm, T0, t0)
            if mode == "armed":
                rc = lib.cuStreamWriteValue64_v2(rs, dptr + FLAG, gen, 0)
                assert rc == 0, rc
            elif mode.startswith("event_hop"):
                # _default: on the legacy default stream (the bench producer's current one)
                ev.record(torch.cuda.current_stream() if mode == "event_hop_default" else s)
                struct.pack_into("<Q", mm, DONE, gen)
            elif mode == "write_hop":
                rc = lib.cuStreamWriteValue64_v2(rs, dptr + FLAG2, gen, 0)
                assert rc == 0, rc
            else:
                struct.pack_into("<Q", mm, DONE, gen)
        s.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=0.5)
    args = ap.parse_args()
    path = f"/dev/shm/aiokv-armed-probe-{secrets.token_hex(8)}"
    with open(path, "wb") as f:
        f.write(b"\0" * SIZE)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    c = ctx.Process(target=consumer, args=(path, args, q))
    p = ctx.Process(target=producer, args=(path, args))
    c.start()
    p.start()
    try:
        res = q.get(timeout=240)
    finally:
        c.join(10)
        p.join(10)
        os.unlink(path)
    summ = {
        k: {
            "p50_us": round(statistics.median(v), 1),
            "p99_us": round(sorted(v)[int(0.99 * (len(v) - 1))], 1),
            "n": len(v),
        }
        for k, v in res["samples"].items()
        if v
    }
    print(
        json.dumps(
            {
                "args": vars(args),
                "regs": res["regs"],
                "attrs": res["attrs"],
                "bit_exact": res["bit_exact"],
                "summary": summ,
            }
        )
    )


if __name__ == "__main__":
    main()
