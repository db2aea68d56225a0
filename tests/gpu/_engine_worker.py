"""Worker process for the two-GPU engine tests (run by test_engine_nccl_gpu.py).

Roles talk to the test through stdout lines ``KEY value`` and stdin commands.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
import time
import types

import torch

import aiokv
from aiokv.envs import engine_overrides

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
]
SIZES = [1 << 10, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def say(key: str, value: object) -> None:
    print(f"{key} {json.dumps(value)}", flush=True)


def make(i: int, seed: int, device: torch.device) -> torch.Tensor:
    """Tensor number i of a deterministic mixed set (size, dtype, shape, contiguity)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 100_003 + i)
    # mostly small, a few large
    size = SIZES[i % 5] if i % 50 else SIZES[5 + (i // 50) % 2]
    dt = DTYPES[i % len(DTYPES)]
    n = size // torch.empty(0, dtype=dt).element_size()
    raw = (
        torch.randint(0, 255, (n,), generator=g, device=device, dtype=torch.uint8)
        if dt.itemsize == 1
        else None
    )
    if raw is not None:
        t = raw.view(dt)
    else:
        t = torch.randn(n, generator=g, device=device, dtype=torch.float32).to(dt)
    if i % 7 == 0 and n >= 64:
        t = t.view(-1, 8).t()  # non-contiguous
    return t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _big_tensor_owners(min_bytes: int = 1 << 28) -> list[list[str]]:
    """Diagnostics: for each live CUDA tensor of at least ``min_bytes``, who holds it
    (two levels of referrers, by type and, for frames, by function)."""
    import gc

    def name(o: object) -> str:
        if isinstance(o, types.FrameType):
            return f"frame:{o.f_code.co_name}"
        if isinstance(o, types.CoroutineType):
            return f"coro:{o.__qualname__}"
        return type(o).__qualname__

    out: list[list[str]] = []
    for obj in gc.get_objects():
        if (
            isinstance(obj, torch.Tensor)
            and obj.is_cuda
            and obj.numel() * obj.element_size() >= min_bytes
        ):
            rows = []
            for r in gc.get_referrers(obj)[:6]:
                ups = [name(u) for u in gc.get_referrers(r)[:6] if u is not out]
                rows.append(f"{name(r)} <- {ups}")
            out.append(rows)
    return out


def warm_kernels(count: int, dev: torch.device) -> None:
    """Launch, before any NCCL traffic, every kernel :func:`bidir` runs while it moves data.

    Under CUDA's lazy module loading a kernel's first launch waits until the GPU is
    idle, holding the context lock; both workers doing so while NCCL kernels of both
    directions wait for the other side is a deadlock (docs/reliability.md, "First
    launches and NCCL"). Users must do the same; ``AIOKV_TEST_COLD=1`` skips it
    (to show the hazard on a GPU).
    """
    if os.environ.get("AIOKV_TEST_COLD") == "1":
        return
    for i in range(count):
        for seed in (0, 1):
            t = make(i, seed, dev)
            same(t.contiguous(), t.contiguous())
    torch.cuda.synchronize(dev)  # before any transfer: nothing of NCCL's is queued


async def bidir(eng: aiokv.Engine, me: int, peer: str, count: int, dev: torch.device) -> None:
    """Send ``count`` tensors to the peer while receiving ``count`` from it; verify bytes."""
    warm_kernels(count, dev)
    t0 = time.perf_counter()
    other = 1 - me
    bad = 0
    try:
        handles = [eng.send_nowait(f"b{me}-{i}", make(i, me, dev), to=peer) for i in range(count)]
        for i in range(count):
            got = await eng.recv(f"b{other}-{i}", timeout=120)
            if got.device != dev or not same(got, make(i, other, dev).contiguous()):
                bad += 1
        for h in handles:
            await h
    except aiokv.AiokvError as exc:  # e.g. the loop watchdog aborted a deadlocked link
        say(
            "BIDIR",
            {
                "error": type(exc).__name__,
                "after_s": time.perf_counter() - t0,
                "watchdog_fired": (eng.statistics().nccl or {}).get("watchdog_fired"),
            },
        )
        return
    say("BIDIR", {"bad": bad, "count": count, "seconds": time.perf_counter() - t0})


def dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


async def main() -> None:
    _role = sys.argv[1]  # kept for the command line shape
    dev = torch.device(sys.argv[2])
    torch.cuda.set_device(dev)
    cfg = aiokv.EngineConfig(
        listen="127.0.0.1:0",
        device=str(dev),
        limits=aiokv.Limits(store_bytes=8 << 30),
        timeouts=aiokv.Timeouts(
            transfer=120.0,
            connect=60.0,
            nccl_watchdog=float(os.environ.get("AIOKV_TEST_WATCHDOG", "30")),
        ),
        **engine_overrides(),  # AIOKV_NCCL_BLOCKING_OPS, as benchmarks/gpu_run.sh sets it
    )
    async with aiokv.Engine(cfg) as eng:
        loop = asyncio.get_running_loop()
        # SIGUSR2 (after SIGUSR1 on a timeout): if the loop still runs, its tasks' stacks
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
        say("ADDR", eng.address)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = (await reader.readline()).decode().strip()
            if not line or line == "quit":
                break
            cmd, *args = line.split()
            if cmd == "bidir":
                await bidir(eng, int(args[0]), args[1], int(args[2]), dev)
            elif cmd == "modes":  # PUT, PUT_ASYNC, GET towards args[0]
                peer = args[0]
                a = torch.arange(1000, device=dev, dtype=torch.float32)
                await eng.send("put", a, to=peer)
                h = eng.send_nowait("putasync", a * 2, to=peer)
                await h
                eng.publish("pub", a * 3)
                say("MODES", "sent")
            elif cmd == "check_modes":
                peer = args[0]
                ok = same(
                    await eng.recv("put", timeout=60),
                    torch.arange(1000, device=dev, dtype=torch.float32),
                )
                ok &= same(
                    await eng.recv("putasync", timeout=60),
                    torch.arange(1000, device=dev, dtype=torch.float32) * 2,
                )
                got = await eng.get("pub", frm=peer, timeout=60)
                ok &= same(got, torch.arange(1000, device=dev, dtype=torch.float32) * 3)
                say("MODES_OK", ok)
            elif cmd == "ordering":  # a kernel still writing the tensor when send is called
                peer = args[0]
                t = torch.zeros(64 << 20, device=dev, dtype=torch.uint8)
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
                t.fill_(7)
                t0 = time.perf_counter()
                await eng.send("ordered", t, to=peer)
                say("ORDERING_SENT", time.perf_counter() - t0)
            elif cmd == "check_ordering":
                got = await eng.recv("ordered", timeout=60)
                say("ORDERING_OK", bool((got == 7).all().item()))
            elif (
                cmd == "victim"
            ):  # start a big transfer whose data never gets posted, then wait to be killed
                peer = args[0]
                await eng.send("warm", torch.ones(16, device=dev), to=peer)  # communicator up
                t = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
                # the producer kernel outlasts the test (~30 s at ~2 GHz), but not by much:
                # a kernel left running after its process is stopped or killed must not
                # keep the GPU busy for the tests that follow
                torch.cuda._sleep(60_000_000_000)
                t.fill_(1)
                eng.send_nowait("doomed", t, to=peer)
                say("VICTIM_SENDING", time.time())
            elif cmd == "wait_doomed":
                t0 = time.time()
                try:
                    # the victim's warm-up tensor first: only the doomed transfer is left in flight
                    await eng.recv("warm", timeout=60)
                    await eng.recv("doomed", timeout=60)
                    say("DOOMED", {"error": None})
                except aiokv.AiokvError as exc:
                    t1 = time.time()
                    # a new kernel on this device completes promptly
                    k0 = time.perf_counter()
                    x = torch.ones(1 << 20, device=dev).sum()
                    ev = torch.cuda.Event()
                    ev.record()
                    while not ev.query():
                        await asyncio.sleep(0.001)
                    kernel_s = time.perf_counter() - k0
                    kernel_ok = float(x.item()) == float(1 << 20)
                    del x  # this check's own tensor must not count in the memory test
                    say(
                        "DOOMED",
                        {
                            "error": type(exc).__name__,
                            "raised_at": t1,
                            "waited": t1 - t0,
                            "kernel_s": kernel_s,
                            "kernel_ok": kernel_ok,
                        },
                    )
            elif cmd == "mem":  # device memory as torch and the driver see it (no device sync:
                # a receive stuck on a dead peer must not block this process)
                free, _total = torch.cuda.mem_get_info(dev)
                pend = eng._poller.statistics().pending if eng._poller is not None else 0
                say(
                    "MEM",
                    {
                        "allocated": torch.cuda.memory_allocated(dev),
                        "free": free,
                        "poller_pending": pend,
                        "big_tensors": _big_tensor_owners(),
                    },
                )
            elif cmd == "burst":  # args: peer, count — PUT count small tensors, report failures
                peer, count = args[0], int(args[1])
                ok = 0
                errors: list[str] = []
                for i in range(count):
                    try:
                        await eng.send(
                            f"burst-{time.time_ns()}-{i}",
                            torch.full((4096,), float(i), device=dev),
                            to=peer,
                            timeout=30,
                        )
                        ok += 1
                    except aiokv.AiokvError as exc:
                        errors.append(type(exc).__name__)
                say("BURST", {"ok": ok, "errors": errors})
            elif cmd == "stats":
                st = eng.statistics()
                say("STATS", {"peers_lost": st.peers_lost, "errors": st.protocol_errors})
    say("BYE", True)


if __name__ == "__main__":
    # SIGUSR1 (sent by the tests on a timeout): every thread's Python stack to stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    asyncio.run(main())
