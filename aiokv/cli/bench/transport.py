"""Benchmark drivers behind ``aiokv bench``.

``aiokv bench transport`` measures the engine's data plane against a raw
baseline *in the same run, between the same two processes*:

* this process is the sender; it spawns one receiver child
  (``python -m aiokv.cli.bench.receiver ...``, :mod:`aiokv.cli.bench.receiver`) on loopback;
* for every size and each of ``--reps`` repetitions it runs the aiokv phase
  (``--iters`` PUTs through :meth:`aiokv.Engine.send_nowait`, at most
  ``--window`` in flight; timed on the sender from the first send until the
  last transfer completed, i.e. until the receiver's engine held it) and the
  raw phase (the same bytes, the same count, raw pyzmq PUSH -> PULL with
  ``copy=False`` for TCP, ``torch.distributed`` send/recv for NCCL; timed on
  the sender from the first send until the receiver acknowledged the last);
* the receiver runs a ticker task (``asyncio.sleep(0.001)``, lateness
  measured) and reports the largest event-loop stall seen during the aiokv
  phases.

Output: one JSON line per size (``--json``) or a table. GB/s are 1e9 bytes
per second. The figures are medians over the repetitions; ``ratio`` is
``aiokv_gbps / raw_gbps``; ``ratio_paired_median`` is the median of the
per-repetition ratios (aiokv and raw phases of one repetition run back to
back, so drifting machine load cancels out better).

The two processes talk over two tiny zmq sockets of their own (commands
parent -> child, acknowledgements child -> parent), never over the sockets
being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokv.envs import engine_overrides

__all__ = [
    "SizeResult",
    "add_transport_arguments",
    "main",
    "nccl_transport",
    "tcp_transport",
    "transport_main",
]
from aiokv.cli.bench.common import (
    MiB,
    SizeResult,
    _aiokv_phase,
    _collect,
    _Control,
    _positive,
    _run_loop,
    _summarise,
    _Ticker,
    _with_receiver,
    raw_sockets,
)

# --------------------------------------------------------------------------- arguments


def _sizes(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"sizes are MiB numbers separated by commas, got {text!r}"
        ) from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError("sizes must be positive")
    return out


def add_transport_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``aiokv bench transport``."""
    p.add_argument(
        "--transport",
        choices=("tcp", "nccl"),
        default="tcp",
        help="tcp: CPU tensors against raw pyzmq; nccl: GPU tensors against "
        "torch.distributed send/recv (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per size")
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="message sizes in MiB, comma-separated (default: 64 for tcp; 1,32,512 for nccl)",
    )
    p.add_argument(
        "--iters",
        type=_positive,
        default=None,
        help="messages per repetition (default: tcp 16; nccl ~2 GiB worth, 20..2000)",
    )
    p.add_argument("--reps", type=_positive, default=3, help="repetitions; medians are reported")
    p.add_argument("--window", type=_positive, default=4, help="aiokv sends in flight at once")
    p.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop of both processes",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")


def _defaults(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    if args.sizes is None:
        args.sizes = [64.0] if args.transport == "tcp" else [1.0, 32.0, 512.0]
    sizes = [max(1, int(s * MiB)) for s in args.sizes]
    iters: list[int] = []
    for s in sizes:
        if args.iters is not None:
            iters.append(args.iters)
        elif args.transport == "tcp":
            iters.append(16)
        else:
            iters.append(max(20, min(2000, (2 << 30) // s)))
    return sizes, iters


# --------------------------------------------------------------------------- TCP


async def _tcp_parent(
    args: argparse.Namespace, emit: Callable[[SizeResult], None]
) -> list[SizeResult]:
    import torch
    import zmq

    import aiokv
    from aiokv.transport.tcp import tensor_buffer

    sizes, iters_l = _defaults(args)
    results: list[SizeResult] = []

    async def body(ctl: _Control, hello: dict[str, Any]) -> None:
        peer = hello["engine"]
        async with (
            aiokv.Engine(aiokv.EngineConfig(listen="127.0.0.1:0", **engine_overrides())) as eng,
            raw_sockets(eng, zmq.PUSH) as (push,),
        ):
            push.connect(f"tcp://127.0.0.1:{hello['raw_port']}")
            await eng.connect(peer)
            for size, iters in zip(sizes, iters_l):
                t = torch.empty(size, dtype=torch.uint8)
                t.fill_(0xA5)
                buf = tensor_buffer(t)
                # warm-up: session, first touch of pages, socket buffers
                await _aiokv_phase(eng, peer, ctl, t, f"warm-{size}", 1, 1, args.timeout)
                await _raw_tcp_phase(push, ctl, buf, 1, args.timeout)
                ours: list[float] = []
                raw: list[float] = []
                stall = raw_stall = 0.0
                for rep in range(args.reps):
                    secs, st = await _aiokv_phase(
                        eng, peer, ctl, t, f"s{size}-r{rep}", iters, args.window, args.timeout
                    )
                    ours.append(size * iters / secs / 1e9)
                    stall = max(stall, st)
                    rsecs, rst = await _raw_tcp_phase(push, ctl, buf, iters, args.timeout)
                    raw.append(size * iters / rsecs / 1e9)
                    raw_stall = max(raw_stall, rst)
                res = _summarise("tcp", size, iters, args, ours, raw, stall)
                res.raw_max_loop_stall_ms = raw_stall * 1e3
                results.append(res)
                emit(res)

    await _with_receiver(args, body)
    return results


async def _raw_tcp_phase(
    push: Any, ctl: _Control, buf: memoryview, iters: int, timeout: float
) -> tuple[float, float]:
    """Raw pyzmq PUSH of ``iters`` zero-copy frames; return (seconds, receiver's max stall)."""
    await ctl.send({"op": "raw", "n": iters})
    t0 = time.perf_counter()
    for _ in range(iters):
        await push.send(buf, copy=False)
    ack = await ctl.recv(timeout)
    return time.perf_counter() - t0, float(ack.get("stall", 0.0))


def tcp_transport(
    args: argparse.Namespace, emit: Callable[[SizeResult], None] | None = None
) -> list[SizeResult]:
    """``aiokv bench transport --transport tcp``: CPU tensors, two processes, loopback."""
    return _run_loop(_tcp_parent(args, emit or (lambda r: None)), args.loop)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- NCCL


def _dist_init(rank: int, port: int, device: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=2,
        rank=rank,
        timeout=datetime.timedelta(seconds=120),
        device_id=torch.device("cuda", device),
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raw_nccl_send(buf: Any, iters: int) -> None:
    import torch
    import torch.distributed as dist

    works = [dist.isend(buf, 1) for _ in range(iters)]
    for w in works:
        if w is not None:
            w.wait()
    torch.cuda.synchronize(buf.device)


def _raw_nccl_recv(buf: Any, iters: int) -> None:
    import torch
    import torch.distributed as dist

    works = [dist.irecv(buf, 0) for _ in range(iters)]
    for w in works:
        if w is not None:
            w.wait()
    torch.cuda.synchronize(buf.device)


async def _nccl_parent(
    args: argparse.Namespace, emit: Callable[[SizeResult], None]
) -> list[SizeResult]:
    import torch
    import torch.distributed as dist

    import aiokv

    if torch.cuda.device_count() < 2:
        raise RuntimeError(
            f"--transport nccl needs two CUDA GPUs, this machine has {torch.cuda.device_count()}"
        )
    sizes, iters_l = _defaults(args)
    results: list[SizeResult] = []
    dev = torch.device("cuda", 0)

    async def body(ctl: _Control, hello: dict[str, Any]) -> None:
        peer = hello["engine"]
        await ctl.send({"op": "dist_init", "port": hello["dist_port"]})
        await asyncio.to_thread(_dist_init, 0, hello["dist_port"], 0)
        await ctl.recv(args.timeout)
        try:
            cfg = aiokv.EngineConfig(
                listen="127.0.0.1:0", device="cuda:0", transport="nccl", **engine_overrides()
            )
            async with aiokv.Engine(cfg) as eng:
                await eng.connect(peer)
                for size, iters in zip(sizes, iters_l):
                    t = torch.full((size,), 0xA5, dtype=torch.uint8, device=dev)
                    torch.cuda.synchronize(dev)
                    await _aiokv_phase(eng, peer, ctl, t, f"warm-{size}", 2, 2, args.timeout)
                    await _raw_nccl_phase(t, ctl, 2, size, args.timeout)
                    ours: list[float] = []
                    raw: list[float] = []
                    stall = 0.0
                    for rep in range(args.reps):
                        secs, st = await _aiokv_phase(
                            eng, peer, ctl, t, f"s{size}-r{rep}", iters, args.window, args.timeout
                        )
                        ours.append(size * iters / secs / 1e9)
                        stall = max(stall, st)
                        rsecs = await _raw_nccl_phase(t, ctl, iters, size, args.timeout)
                        raw.append(size * iters / rsecs / 1e9)
                    res = _summarise("nccl", size, iters, args, ours, raw, stall)
                    res.sender_nccl = {k: round(v, 6) for k, v in eng.statistics().nccl.items()}
                    results.append(res)
                    emit(res)
                    del t
        finally:
            # both ranks tear the process group down at the same time, off the loop and
            # bounded: one rank destroying it alone can wait for the other forever
            with contextlib.suppress(Exception):
                await ctl.send({"op": "dist_destroy"})
                await asyncio.wait_for(asyncio.to_thread(dist.destroy_process_group), 30)
                await ctl.recv(30)

    await _with_receiver(args, body)
    return results


async def _raw_nccl_phase(t: Any, ctl: _Control, iters: int, size: int, timeout: float) -> float:
    await ctl.send({"op": "raw", "n": iters, "size": size})
    await ctl.recv(timeout)  # the receiver has its buffer and is about to post
    t0 = time.perf_counter()
    await asyncio.to_thread(_raw_nccl_send, t, iters)
    await ctl.recv(timeout)  # the receiver's stream finished the last recv
    return time.perf_counter() - t0


async def _nccl_child(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import zmq
    import zmq.asyncio

    import aiokv

    dev = torch.device("cuda", 1)
    ctx = zmq.asyncio.Context()
    cmd = ctx.socket(zmq.PULL)
    ack = ctx.socket(zmq.PUSH)
    for s in (cmd, ack):
        s.setsockopt(zmq.LINGER, 1000)
    cmd.connect(f"tcp://127.0.0.1:{ns.cmd_port}")
    ack.connect(f"tcp://127.0.0.1:{ns.ack_port}")
    ticker = _Ticker()
    ticker.start()
    dist_on = False
    try:
        cfg = aiokv.EngineConfig(
            listen="127.0.0.1:0", device="cuda:1", transport="nccl", **engine_overrides()
        )
        async with aiokv.Engine(cfg) as eng:
            hello = {"engine": eng.address, "dist_port": _free_port()}
            await ack.send(json.dumps(hello).encode())
            while True:
                msg = json.loads(await cmd.recv())
                op = msg["op"]
                try:
                    if op == "quit":
                        return
                    if op == "dist_init":
                        await asyncio.to_thread(_dist_init, 1, msg["port"], 1)
                        dist_on = True
                        await ack.send(b'{"ok": true}')
                    elif op == "dist_destroy":
                        dist_on = False
                        await asyncio.wait_for(asyncio.to_thread(dist.destroy_process_group), 30)
                        await ack.send(b'{"ok": true}')
                    elif op == "aiokv":
                        await _collect(eng, msg, ticker, ack)
                    elif op == "raw":
                        buf = torch.empty(msg["size"], dtype=torch.uint8, device=dev)
                        await ack.send(b'{"ok": true}')
                        ticker.reset()
                        await asyncio.to_thread(_raw_nccl_recv, buf, msg["n"])
                        del buf
                        await ack.send(json.dumps({"ok": True, "stall": ticker.max_late}).encode())
                except Exception as exc:
                    await ack.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
                    return
    finally:
        await ticker.stop()
        if dist_on:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(dist.destroy_process_group), 10)
        for s in (cmd, ack):
            s.close(linger=1000)
        ctx.term()


def nccl_transport(
    args: argparse.Namespace, emit: Callable[[SizeResult], None] | None = None
) -> list[SizeResult]:
    """``aiokv bench transport --transport nccl``: cuda:0 -> cuda:1, raw = torch.distributed send/recv.

    Needs two CUDA GPUs and an engine built with the NCCL transport. The raw
    reference runs in the same two processes, the same run: ``dist.isend``
    of the same tensor ``iters`` times, timed on the sender until the
    receiver's stream finished the last ``irecv``.
    """
    return _run_loop(_nccl_parent(args, emit or (lambda r: None)), args.loop)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- entry points


def _print_table(results: Sequence[SizeResult]) -> None:
    print(
        f"{'transport':9} {'size MiB':>9} {'iters':>6} {'aiokv GB/s':>11} {'raw GB/s':>9} {'ratio':>6} {'stall ms':>9}"
    )
    for r in results:
        print(
            f"{r.transport:9} {r.size_bytes / MiB:9.2f} {r.iters:6d} {r.aiokv_gbps:11.3f}"
            f" {r.raw_gbps:9.3f} {r.ratio:6.3f} {r.max_loop_stall_ms:9.2f}"
        )


def transport_main(args: argparse.Namespace) -> int:
    """Run ``aiokv bench transport`` with parsed ``args``; returns an exit status."""

    def emit(r: SizeResult) -> None:
        if args.json:
            print(json.dumps(r.as_dict()), flush=True)

    fn = tcp_transport if args.transport == "tcp" else nccl_transport
    try:
        results = fn(args, emit)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"aiokv bench transport: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if not args.json:
        _print_table(results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiokv.cli.bench.transport transport ...`` (same as ``aiokv bench transport``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m aiokv.cli.bench.transport")
    sub = p.add_subparsers(dest="what", required=True)
    add_transport_arguments(sub.add_parser("transport", help="engine vs raw data plane"))
    ns = p.parse_args(args)
    return transport_main(ns)


if __name__ == "__main__":
    sys.exit(main())
