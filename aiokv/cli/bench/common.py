"""What the benchmark drivers share: the sender/receiver control channel (two small zmq
sockets of their own, commands parent -> child, acknowledgements child -> parent), the
receiver child's spawning and TCP harness, the loop-stall ticker and GC meter, and the
per-size summary (:class:`SizeResult`).
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiokv
from aiokv import envs
from aiokv.envs import engine_overrides

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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


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
        "aiokv.cli.bench.receiver",
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
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(aiokv.__file__)))
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
