"""One small engine message between two processes, under the conditions of the IPC plane.

Issue 15 (session 12): on the GPU host the IPC descriptor's engine hop took ~0.26 ms
one-way (+ ~0.1 ms of ``send_nowait``), while ``aiokv bench control`` (CPU-only
processes) measured a whole send + ACK round trip at 80-100 µs. This script runs the
same ping-pong -- process A ``send_nowait`` s a 200-byte uint8 CPU tensor (the size of
a descriptor), B ``recv`` s it and answers likewise -- in pairs of processes that
differ in one condition at a time, interleaved, and prints per variant the medians of:

* ``send_us``: A's ``send_nowait`` call (encode + engine hot path);
* ``oneway_us``: A's stamp before ``send_nowait`` -> B's ``recv`` returned
  (``perf_counter`` is ``CLOCK_MONOTONIC``, shared by the processes of one host);
* ``rtt_us``: A's send -> A has B's answer.

Conditions (``--variants``, comma-separated, each ``+``-joined): ``cpu`` (no CUDA),
``cuda`` (torch CUDA initialised and 1 GiB allocated in both), ``spinB`` (B's loop
spins -- ``asyncio.sleep(0)`` -- while it waits, as a ProgressPoller does), ``spinAB``,
``gapN`` (A sleeps N ms between pings, so both loops go idle as between real
requests), ``uvloop``, ``torchops`` (each side also makes the torch calls the plane
makes per message: ``torch.frombuffer`` on send). Output: one JSON line per variant
run (``--json``), else a table.

    python benchmarks/ipc_hop.py --variants cpu,cuda,cuda+spinB --n 400 --reps 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any


def _opts(variant: str) -> dict[str, Any]:
    parts = variant.split("+")
    gap = 0.0
    for p in parts:
        if p.startswith("gap"):
            gap = float(p[3:]) / 1000
    return {
        "cuda": "cuda" in parts,
        "spinA": "spinAB" in parts,
        "spinB": "spinB" in parts or "spinAB" in parts,
        "gap": gap,
        "uvloop": "uvloop" in parts,
        "touch": "touch" in parts,
        "shm": "shm" in parts,
    }


def _spinner() -> asyncio.Task[None]:
    async def spin() -> None:
        while True:
            await asyncio.sleep(0)

    return asyncio.ensure_future(spin())


async def _role(role: str, o: dict[str, Any], conn: Any, n: int) -> dict[str, Any]:
    import torch

    import aiokv

    if o["cuda"]:
        torch.cuda.init()
        keep = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        keep.zero_()
        torch.cuda.synchronize()
    spin = _spinner() if o["spinA" if role == "A" else "spinB"] else None
    # the micro cost of a torch call in this process (the plane makes a few per message)
    tt = []
    for _ in range(300):
        t = time.perf_counter()
        torch.frombuffer(bytearray(200), dtype=torch.uint8)
        tt.append(time.perf_counter() - t)
    if o["shm"]:
        out_shm = await _shm_role(role, o, conn, n)
        if spin is not None:
            spin.cancel()
        return out_shm
    cfg = aiokv.EngineConfig(listen="127.0.0.1:0", transport="tcp")
    out: dict[str, Any] = {"frombuffer_us": statistics.median(tt) * 1e6}
    async with aiokv.Engine(cfg) as eng:
        conn.send(eng.address)
        peer = await asyncio.to_thread(conn.recv)
        payload = bytearray(200)
        if role == "A":
            await eng.connect(peer)
            send_us, oneway, rtt = [], [], []
            for i in range(n + 50):
                if o["gap"]:
                    await asyncio.sleep(o["gap"])
                t0 = time.perf_counter()
                payload[:8] = int(t0 * 1e9).to_bytes(8, "little")
                msg = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                h = eng.send_nowait(f"p{i}", msg, to=peer)
                t1 = time.perf_counter()
                back = await eng.recv(f"q{i}", timeout=10)
                t2 = time.perf_counter()
                await h
                b = bytes(back.numpy())
                if i >= 50:
                    send_us.append((t1 - t0) * 1e6)
                    rtt.append((t2 - t0) * 1e6)
                    oneway.append(int.from_bytes(b[:8], "little") / 1e3)
            out.update(send_us=send_us, rtt_us=rtt, oneway_us=oneway)
        else:
            for i in range(n + 50):
                got = await eng.recv(f"p{i}", timeout=10)
                t = time.perf_counter()
                t0 = int.from_bytes(bytes(got[:8].numpy()), "little") / 1e9
                rep = bytearray(200)
                rep[:8] = int((t - t0) * 1e9).to_bytes(8, "little")
                h = eng.send_nowait(f"q{i}", torch.frombuffer(rep, dtype=torch.uint8), to=peer)
                await h
        if spin is not None:
            spin.cancel()
    return out


async def _shm_role(role: str, o: dict[str, Any], conn: Any, n: int) -> dict[str, Any]:
    """The floor of a same-host doorbell: the same ping-pong through a shared-memory
    mailbox (a stamp, then a sequence number) that the waiting loop polls each pass."""
    from multiprocessing import shared_memory

    if role == "A":
        shm = shared_memory.SharedMemory(create=True, size=64)
        conn.send(shm.name)
    else:
        shm = shared_memory.SharedMemory(name=await asyncio.to_thread(conn.recv))
    buf = shm.buf
    assert buf is not None
    mine, theirs = (0, 32) if role == "A" else (32, 0)

    async def wait_seq(seq: int) -> int:
        while int.from_bytes(buf[theirs + 8 : theirs + 16], "little") != seq:
            await asyncio.sleep(0)
        return int.from_bytes(buf[theirs : theirs + 8], "little")

    def post(seq: int, val: int) -> None:
        buf[mine : mine + 8] = val.to_bytes(8, "little")
        buf[mine + 8 : mine + 16] = seq.to_bytes(8, "little")

    out: dict[str, Any] = {"frombuffer_us": 0.0}
    send_us, oneway, rtt = [], [], []
    try:
        for i in range(1, n + 51):
            if role == "A":
                if o["gap"]:
                    await asyncio.sleep(o["gap"])
                t0 = time.perf_counter()
                post(i, int(t0 * 1e9))
                t1 = time.perf_counter()
                ow = await wait_seq(i)
                t2 = time.perf_counter()
                if i > 50:
                    send_us.append((t1 - t0) * 1e6)
                    rtt.append((t2 - t0) * 1e6)
                    oneway.append(ow / 1e3)
            else:
                t0n = await wait_seq(i)
                t = time.perf_counter()
                post(i, int((t - t0n / 1e9) * 1e9))
        out.update(send_us=send_us, rtt_us=rtt, oneway_us=oneway)
        await asyncio.sleep(0.05)
    finally:
        buf.release()
        shm.close()
        if role == "A":
            shm.unlink()
    return out


def _child(role: str, o: dict[str, Any], conn: Any, q: Any, n: int) -> None:
    try:
        coro = _role(role, o, conn, n)
        if o["uvloop"]:
            import uvloop

            res = uvloop.run(coro)
        else:
            res = asyncio.run(coro)
        q.put((role, res))
    except BaseException as exc:
        q.put((role, {"error": f"{type(exc).__name__}: {exc}"}))


def run_variant(variant: str, n: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    o = _opts(variant)
    a, b = ctx.Pipe()
    q = ctx.Queue()
    pa = ctx.Process(target=_child, args=("A", o, a, q, n))
    pb = ctx.Process(target=_child, args=("B", o, b, q, n))
    pa.start()
    pb.start()
    got = dict(q.get(timeout=300) for _ in range(2))
    pa.join(30)
    pb.join(30)
    ra, rb = got["A"], got["B"]
    if "error" in ra or "error" in rb:
        return {"variant": variant, "error": ra.get("error") or rb.get("error")}

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 1)

    def p99(xs: list[float]) -> float:
        s = sorted(xs)
        return round(s[min(len(s) - 1, int(0.99 * len(s)))], 1)

    return {
        "variant": variant,
        "n": n,
        "send_us": med(ra["send_us"]),
        "oneway_us": med(ra["oneway_us"]),
        "oneway_p99_us": p99(ra["oneway_us"]),
        "rtt_us": med(ra["rtt_us"]),
        "frombuffer_us": [round(ra["frombuffer_us"], 2), round(rb["frombuffer_us"], 2)],
    }


def _triton_launch(dev: Any) -> dict[str, Any]:
    """The IPC kernel's launch (16 pairs, 32 layers, the bench's FlashAttention geometry)
    through Triton's JIT, hot. (Session 12 also timed the compiled kernel's own launcher
    with a specialisation key computed in Python, commit 7785483: slower, 34.7 µs against
    25.1, run s12-ipc-r2, so it was not kept.)"""
    import torch

    from aiokv.kv.ipc import _kernel as k

    if not k.available():
        return {}
    L, nb, seg = 32, 400, 16 * 8 * 128 * 2  # bytes per K or V segment of a block
    word = 8
    src = torch.randint(0, 1 << 30, (L, 2, nb, seg // word), dtype=torch.int64, device=dev)
    d = torch.zeros_like(src)
    st = torch.tensor([src[i].data_ptr() for i in range(L)], dtype=torch.int64, device=dev)
    dt = torch.tensor([d[i].data_ptr() for i in range(L)], dtype=torch.int64, device=dev)
    ids = torch.tensor(list(range(0, 32, 2)) + list(range(100, 116)), device=dev)
    ab = torch.zeros(16, dtype=torch.int32, device=dev)

    def go() -> None:
        k.launch_pair_copy(
            st, dt, ids, ab, 3, n_pairs=16, word=word, n_layers=L, parts=2,
            seg_words=seg // word, src_part_stride=nb * seg // word,
            dst_part_stride=nb * seg // word, block_stride=seg // word, base_align=16,
        )  # fmt: skip

    go()
    torch.cuda.synchronize()
    xs = []
    for _ in range(300):
        a = time.perf_counter()
        go()
        xs.append(time.perf_counter() - a)
        if len(xs) % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    ok = bool(torch.equal(d[:, :, 100:116], src[:, :, 0:32:2]))
    return {"triton_launch_jit": round(statistics.median(xs) * 1e6, 2), "triton_copy_ok": ok}


def micro() -> dict[str, Any]:
    """Median µs of the per-message calls the plane makes, in one CUDA process."""
    import torch

    out: dict[str, Any] = {}

    def t(name: str, fn: Any, n: int = 2000) -> None:
        fn()
        xs = []
        for _ in range(n):
            a = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - a)
        out[name] = round(statistics.median(xs) * 1e6, 2)

    t("perf_counter", time.perf_counter)
    t("frombuffer", lambda: torch.frombuffer(bytearray(200), dtype=torch.uint8))
    t("cpu_empty", lambda: torch.empty(8, dtype=torch.uint8))
    if torch.cuda.is_available():
        torch.cuda.init()
        dev = torch.device("cuda:0")
        torch.cuda.set_device(dev)
        s = torch.cuda.current_stream()
        ev = torch.cuda.Event()
        iev = torch.cuda.Event(interprocess=True)
        iev.record()
        pin = torch.empty(64, dtype=torch.int64, pin_memory=True)
        d = torch.empty(64, dtype=torch.int64, device=dev)
        t("current_stream", torch.cuda.current_stream)
        t("event_record", ev.record)
        t("event_record_stream", lambda: ev.record(s))
        t("ipc_event_record", iev.record)
        t("event_query", ev.query)
        t("upload_64B", lambda: d.copy_(pin, non_blocking=True))
        t("cuda_empty", lambda: torch.empty(8, device=dev))
        t("fill_", lambda: d.fill_(1))
        torch.cuda.synchronize()
        out.update(_triton_launch(dev))

    async def passes() -> float:
        n = 5000
        a = time.perf_counter()
        for _ in range(n):
            await asyncio.sleep(0)
        return (time.perf_counter() - a) / n * 1e6

    out["loop_pass_asyncio"] = round(asyncio.run(passes()), 2)
    try:
        import uvloop

        out["loop_pass_uvloop"] = round(uvloop.run(passes()), 2)
    except ImportError:
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="cpu,cuda,cuda+spinB,cuda+spinAB")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--micro", action="store_true", help="only the per-call costs (one process)")
    args = ap.parse_args()
    if args.micro:
        print(json.dumps({"micro": micro()}), flush=True)
        return 0
    for _ in range(args.reps):
        for v in args.variants.split(","):
            r = run_variant(v, args.n)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(r, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
