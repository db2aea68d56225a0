"""Benchmark drivers behind ``aiokv bench``.

``aiokv bench transport`` measures the engine's data plane against a raw
baseline *in the same run, between the same two processes*:

* this process is the sender; it spawns one receiver child
  (``python -m aiokv.cli.bench.transport _receiver ...``) on loopback;
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
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokv import envs
from aiokv.envs import engine_overrides

__all__ = [
    "SizeResult",
    "add_transport_arguments",
    "main",
    "nccl_transport",
    "tcp_transport",
    "transport_main",
]

MiB = 1 << 20
_PREFIX = "aiokv-bench"


@dataclass(slots=True)
class SizeResult:
    """The outcome for one message size."""

    transport: str
    size_bytes: int
    iters: int
    window: int
    reps: int
    aiokv_gbps: float
    raw_gbps: float
    ratio: float
    aiokv_gbps_all: list[float] = field(default_factory=list)
    raw_gbps_all: list[float] = field(default_factory=list)
    max_loop_stall_ms: float = 0.0
    raw_max_loop_stall_ms: float | None = None
    ratio_paired_median: float = float("nan")
    loop: str = "asyncio"
    sender_nccl: dict[str, float] = field(default_factory=dict)  # sender engine's NCCL counters

    def as_dict(self) -> dict[str, Any]:
        return {
            "transport": self.transport,
            "size_bytes": self.size_bytes,
            "size_mib": round(self.size_bytes / MiB, 3),
            "iters": self.iters,
            "window": self.window,
            "reps": self.reps,
            "aiokv_gbps": round(self.aiokv_gbps, 3),
            "raw_gbps": round(self.raw_gbps, 3),
            "ratio": round(self.ratio, 3),
            "ratio_paired_median": round(self.ratio_paired_median, 3),
            "aiokv_gbps_all": [round(x, 3) for x in self.aiokv_gbps_all],
            "raw_gbps_all": [round(x, 3) for x in self.raw_gbps_all],
            "max_loop_stall_ms": round(self.max_loop_stall_ms, 3),
            "raw_max_loop_stall_ms": (
                None if self.raw_max_loop_stall_ms is None else round(self.raw_max_loop_stall_ms, 3)
            ),
            "loop": self.loop,
            **({"sender_nccl": self.sender_nccl} if self.sender_nccl else {}),
        }


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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


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


def _run_loop(coro: Any, loop: str, role: str = "sender") -> Any:
    prof_dir = envs.get("AIOKV_BENCH_PROFILE")  # diagnostics: cProfile each process
    prof = None
    if prof_dir:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        if loop == "uvloop":
            import uvloop

            return uvloop.run(coro)
        return asyncio.run(coro)
    finally:
        if prof is not None and prof_dir:
            import io
            import pstats

            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(45)
            with open(os.path.join(prof_dir, f"profile-{role}.txt"), "w") as fh:
                fh.write(out.getvalue())


# --------------------------------------------------------------------------- control channel


class _Control:
    """Commands parent -> child and acknowledgements child -> parent (JSON, zmq PAIR-ish)."""

    def __init__(self, cmd: Any, ack: Any) -> None:
        self.cmd = cmd
        self.ack = ack

    async def send(self, obj: dict[str, Any]) -> None:
        await self.cmd.send(json.dumps(obj).encode())

    async def recv(self, timeout: float) -> dict[str, Any]:
        import zmq

        if not await self.ack.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"the receiver did not answer within {timeout:.0f}s")
        msg: dict[str, Any] = json.loads(await self.ack.recv())
        if "error" in msg:
            raise RuntimeError(f"receiver failed: {msg['error']}")
        return msg


class _Ticker:
    """Measures how late ``asyncio.sleep(0.001)`` wakes up: the loop's worst stall; and
    the process's CPU time (every thread: zmq's I/O thread too) since :meth:`reset`."""

    def __init__(self) -> None:
        self.max_late = 0.0
        self._cpu0 = time.process_time()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="aiokv-bench-ticker")

    def reset(self) -> None:
        self.max_late = 0.0
        self._cpu0 = time.process_time()

    @property
    def cpu_s(self) -> float:
        """CPU seconds of this process since the last :meth:`reset`."""
        return time.process_time() - self._cpu0

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - t0 - 0.001
            if late > self.max_late:
                self.max_late = late

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class _GcMeter:
    """Time spent in the cyclic garbage collector, via ``gc.callbacks`` (start/stop pairs)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self.full = 0  # collections of the oldest generation (they walk every tracked object)
        self.longest = 0.0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self.collections += 1
        self.full += info.get("generation") == 2
        self.longest = max(self.longest, dt)

    def install(self) -> None:
        import gc

        gc.callbacks.append(self._cb)

    def remove(self) -> None:
        import gc

        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._cb)

    def reset(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self.full = 0
        self.longest = 0.0


def _spawn_receiver(
    args: argparse.Namespace, cmd_port: int, ack_port: int
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "aiokv.cli.bench.transport",
        "_receiver",
        "--transport",
        args.transport,
        "--cmd-port",
        str(cmd_port),
        "--ack-port",
        str(ack_port),
        "--loop",
        args.loop,
        "--parent-pid",
        str(os.getpid()),
    ]
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    # the child imports this very checkout, wherever the CLI was started from
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)


def _stop_child(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def raw_sockets(eng: Any, *kinds: int) -> AsyncIterator[list[Any]]:
    """The raw baseline's sockets, made on the engine's own zmq context: the raw path
    and the engine's then share one zmq I/O thread. With a context each, the two paths
    had I/O threads of their own, which the scheduler may place differently on a small
    machine: a send that wakes an I/O thread on its own core costs ~4 us, one that is
    preempted by it ~22 us (measured on a 2-core VM) -- a difference between the
    paths that was the scheduler's, not the code's. Closed (linger 0) on exit, before
    the engine terminates its context."""
    socks = [eng._ctx.socket(k) for k in kinds]
    try:
        yield socks
    finally:
        for s in socks:
            s.close(0)


async def _with_receiver(
    args: argparse.Namespace, body: Callable[[_Control, dict[str, Any]], Any]
) -> Any:
    """Bind the control sockets, start the child, wait for its hello, run ``body``, tear down."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    cmd = ctx.socket(zmq.PUSH)
    ack = ctx.socket(zmq.PULL)
    for s in (cmd, ack):
        s.setsockopt(zmq.LINGER, 1000)
    cmd_port = cmd.bind_to_random_port("tcp://127.0.0.1")
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    proc = _spawn_receiver(args, cmd_port, ack_port)
    ctl = _Control(cmd, ack)
    try:
        hello = await ctl.recv(60.0)
        try:
            return await asyncio.wait_for(body(ctl, hello), args.timeout)
        finally:
            with contextlib.suppress(Exception):
                await ctl.send({"op": "quit"})
    finally:
        await asyncio.to_thread(_stop_child, proc)
        cmd.close(0)
        ack.close(0)
        ctx.term()


def _summarise(
    transport: str,
    size: int,
    iters: int,
    args: argparse.Namespace,
    ours: list[float],
    raw: list[float],
    stall: float,
) -> SizeResult:
    a = statistics.median(ours)
    r = statistics.median(raw)
    return SizeResult(
        transport=transport,
        size_bytes=size,
        iters=iters,
        window=args.window,
        reps=args.reps,
        aiokv_gbps=a,
        raw_gbps=r,
        ratio=a / r if r > 0 else float("nan"),
        aiokv_gbps_all=ours,
        raw_gbps_all=raw,
        max_loop_stall_ms=stall * 1e3,
        loop=args.loop,
        # each repetition runs aiokv then raw back to back: their ratio is the
        # least sensitive to load that drifts during the run
        ratio_paired_median=statistics.median(x / y for x, y in zip(ours, raw) if y > 0),
    )


async def _aiokv_phase(
    eng: Any,
    peer: str,
    ctl: _Control,
    tensor: Any,
    tag: str,
    iters: int,
    window: int,
    timeout: float,
) -> tuple[float, float]:
    """Send ``iters`` copies of ``tensor``; return (seconds, receiver's max stall)."""
    secs, ack = await _aiokv_stream(eng, peer, ctl, tensor, tag, iters, window, timeout)
    return secs, float(ack.get("stall", 0.0))


async def _aiokv_stream(
    eng: Any,
    peer: str,
    ctl: _Control,
    tensor: Any,
    tag: str,
    iters: int,
    window: int,
    timeout: float,
    extra: Mapping[str, Any] | None = None,
) -> tuple[float, dict[str, Any]]:
    """``iters`` PUT_ASYNCs, ``window`` in flight; return (seconds, the receiver's acknowledgement).

    The receiver collects ``f"{tag}#{i}"`` in order (``op: aiokv``, plus the
    fields of ``extra``), so its store drains as the stream goes and
    back-pressure never stalls it.
    """
    await ctl.send({"op": "aiokv", "tag": tag, "n": iters, **(extra or {})})
    inflight: deque[Any] = deque()
    t0 = time.perf_counter()
    for i in range(iters):
        if len(inflight) >= window:
            await inflight.popleft()  # a peer's transfers complete in grant order
        inflight.append(eng.send_nowait(f"{tag}#{i}", tensor, to=peer, timeout=timeout))
    while inflight:
        await inflight.popleft()
    secs = time.perf_counter() - t0
    return secs, await ctl.recv(timeout)


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


@dataclass(slots=True)
class _TcpChild:
    """The receiver process's side of a TCP benchmark, as its command handlers see it."""

    eng: Any  # the receiver's aiokv.Engine
    pull: Any  # raw zmq PULL: the raw baseline's data arrives here
    back: Any  # raw zmq PUSH: the raw baseline's acknowledgements leave here
    ack: Any  # control channel, child -> parent
    ticker: _Ticker
    gc: _GcMeter

    def reset(self) -> None:
        self.ticker.reset()
        self.gc.reset()

    async def reply(self, **fields: Any) -> None:
        """Acknowledge a command with the stall and gc time seen since :meth:`reset`."""
        out = {
            "ok": True,
            "stall": self.ticker.max_late,
            "gc_s": self.gc.seconds,
            "cpu_s": self.ticker.cpu_s,
            **fields,
        }
        await self.ack.send(json.dumps(out).encode())


_ChildOp = Callable[[_TcpChild, dict[str, Any]], Awaitable[None]]


async def _raw_collect(st: _TcpChild, msg: dict[str, Any]) -> None:
    st.reset()
    n = 0
    for _ in range(msg["n"]):
        fr = await st.pull.recv(copy=False)
        n += len(fr)
        del fr
    await st.reply(bytes=n)


async def _tcp_child(ns: argparse.Namespace, extra: Mapping[str, _ChildOp] | None = None) -> None:
    """Receiver of the TCP benchmarks: serve the parent's commands until ``quit``.

    ``aiokv`` and ``raw`` are the transport benchmark's phases; ``extra`` adds
    handlers (``aiokv bench control`` brings its own).
    """
    import zmq
    import zmq.asyncio

    import aiokv

    ops: dict[str, _ChildOp] = {
        "aiokv": lambda st, msg: _collect(st.eng, msg, st.ticker, st.ack, st.gc),
        "raw": _raw_collect,
        **(extra or {}),
    }
    ctx = zmq.asyncio.Context()
    cmd = ctx.socket(zmq.PULL)
    ack = ctx.socket(zmq.PUSH)
    for s in (cmd, ack):
        s.setsockopt(zmq.LINGER, 1000)
    cmd.connect(f"tcp://127.0.0.1:{ns.cmd_port}")
    ack.connect(f"tcp://127.0.0.1:{ns.ack_port}")
    ticker = _Ticker()
    ticker.start()
    meter = _GcMeter()
    meter.install()
    try:
        async with (
            aiokv.Engine(aiokv.EngineConfig(listen="127.0.0.1:0", **engine_overrides())) as eng,
            raw_sockets(eng, zmq.PULL, zmq.PUSH) as (pull, back),
        ):
            pull.setsockopt(zmq.RCVHWM, 0)
            raw_port = pull.bind_to_random_port("tcp://127.0.0.1")
            back_port = back.bind_to_random_port("tcp://127.0.0.1")
            st = _TcpChild(eng, pull, back, ack, ticker, meter)
            hello = {"engine": eng.address, "raw_port": raw_port, "back_port": back_port}
            await ack.send(json.dumps(hello).encode())
            while True:
                msg = json.loads(await cmd.recv())
                if msg["op"] == "quit":
                    return
                try:
                    await ops[msg["op"]](st, msg)
                except Exception as exc:  # report, so the parent fails fast instead of timing out
                    await ack.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
                    return
    finally:
        meter.remove()
        await ticker.stop()
        for s in (cmd, ack):
            s.close(linger=1000)
        ctx.term()


async def _collect(
    eng: Any, msg: dict[str, Any], ticker: _Ticker, ack: Any, meter: _GcMeter | None = None
) -> None:
    """Receiver side of an aiokv phase: collect ``n`` tensors, acknowledge with the stall seen."""
    ticker.reset()
    if meter is not None:
        meter.reset()
    n = 0
    for i in range(msg["n"]):
        x = await eng.recv(f"{msg['tag']}#{i}", timeout=120.0)
        n += x.numel()
        del x
    out = {"ok": True, "bytes": n, "stall": ticker.max_late, "cpu_s": ticker.cpu_s}
    if meter is not None:
        out["gc_s"] = meter.seconds
    await ack.send(json.dumps(out).encode())


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


async def _watch_parent(pid: int | None) -> None:
    """Exit the receiver if the process that started it is gone (never leave orphans)."""
    if pid is None:
        return
    while True:
        await asyncio.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


async def _child(ns: argparse.Namespace) -> None:
    slow = envs.get("AIOKV_BENCH_SLOW_CALLBACK_MS")
    if slow:  # diagnose loop stalls: asyncio logs every callback slower than this
        import logging

        logging.basicConfig(level=logging.WARNING)
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = float(slow) / 1e3
    watcher = asyncio.create_task(_watch_parent(ns.parent_pid))
    try:
        if ns.transport == "control":
            from aiokv.cli.bench.control import CHILD_OPS

            await _tcp_child(ns, CHILD_OPS)
        else:
            await (_tcp_child(ns) if ns.transport == "tcp" else _nccl_child(ns))
    finally:
        watcher.cancel()


def _receiver_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="aiokv.cli.bench.transport _receiver")
    p.add_argument("--transport", choices=("tcp", "nccl", "control"), required=True)
    p.add_argument("--cmd-port", type=int, required=True)
    p.add_argument("--ack-port", type=int, required=True)
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--parent-pid", type=int, default=None)
    ns = p.parse_args(argv)
    try:
        _run_loop(_child(ns), ns.loop, role="receiver")
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiokv.cli.bench.transport transport ...`` (same as ``aiokv bench transport``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "_receiver":
        return _receiver_main(args[1:])
    p = argparse.ArgumentParser(prog="python -m aiokv.cli.bench.transport")
    sub = p.add_subparsers(dest="what", required=True)
    add_transport_arguments(sub.add_parser("transport", help="engine vs raw data plane"))
    ns = p.parse_args(args)
    return transport_main(ns)


if __name__ == "__main__":
    sys.exit(main())
