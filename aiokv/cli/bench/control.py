"""``aiokv bench control``: the engine's control path against the zmq floor, on CPU.

Small transfers are bound by control, not by bytes, so this benchmark puts
the engine beside the cheapest thing that could move the same bytes between
the same two processes: raw ``zmq.asyncio`` sockets. It reuses the machinery
of ``aiokv bench transport`` (:mod:`aiokv.cli.bench.transport`): this process sends, one
receiver child on loopback receives, and a control channel of their own tells
the child what comes next. Three workloads:

* ``send4k`` -- latency of one 4 KiB transfer. Raw: PUSH 4 KiB, the receiver
  answers a 64-byte ack on a socket of its own; timed until the ack is back.
  Engine: ``await engine.send(id, 4 KiB CPU tensor)`` (PUT: it returns once
  the receiver's engine holds the tensor). p50 and p99 per block.
* ``rate4k`` -- transfers per second, ``--window`` in flight. Raw: PUSH with at
  most ``window`` messages unacknowledged; the receiver acknowledges
  cumulatively every ``window // 4`` messages (64-byte acks). Engine:
  ``send_nowait``, awaiting the oldest handle while ``window`` are in flight.
  Timed from the first send until the last is acknowledged / completed.
* ``stream1m`` -- the same with 1 MiB tensors, in bytes per second.

The receiver collects every engine transfer with ``recv`` (ids
``f"{tag}#{i}"``, in order), so its store drains as the stream goes and
back-pressure never stalls the sender.

Blocks interleave -- raw, engine, raw, engine, ... -- so load that drifts
during the run hits both sides alike; the first pair of each workload is a
warm-up and is discarded. Reported figures are medians over the ``--reps``
kept blocks of each side; ``ratio`` is engine / raw of those medians and
``ratio_paired_median`` the median of the per-pair ratios. Both processes run
a ticker (``asyncio.sleep(0.001)``, lateness = the loop's largest stall) and a
``gc.callbacks`` meter (time in the cyclic collector). ``--profile DIR``
writes a cProfile of the engine blocks, sender and receiver, per workload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokv.cli.bench.common import (
    _aiokv_stream,
    _collect,
    _Control,
    _GcMeter,
    _positive,
    _run_loop,
    _TcpChild,
    _Ticker,
    _with_receiver,
    raw_sockets,
)
from aiokv.envs import engine_overrides

__all__ = ["CHILD_OPS", "TARGETS", "WORKLOADS", "add_control_arguments", "control_main"]

KiB = 1 << 10
MiB = 1 << 20
WORKLOADS = ("send4k", "rate4k", "stream1m")
_SIZE = {"send4k": 4 * KiB, "rate4k": 4 * KiB, "stream1m": 1 * MiB}
_UNIT = {"send4k": "us", "rate4k": "transfers/s", "stream1m": "bytes/s"}
# (comparison, bound) on engine / raw; send4k compares p50 latencies (lower is better)
TARGETS: dict[str, tuple[str, float]] = {
    "send4k": ("<=", 1.3),
    "rate4k": (">=", 0.5),
    "stream1m": (">=", 0.8),
}
DESCRIPTION = (
    "The engine's control path against the zmq floor, on CPU over loopback: send4k (latency "
    "of one 4 KiB transfer), rate4k (4 KiB transfers per second) and stream1m (1 MiB "
    "transfers, bytes per second), engine and raw zmq.asyncio blocks interleaved."
)
_ACK_PAD = bytes(56)  # an ack is 64 bytes: an 8-byte cumulative count and padding
_COPY_BELOW = 64 * KiB  # pyzmq copies small frames anyway; bytes are cheaper than Frames there


# --------------------------------------------------------------------------- arguments


def _workloads(text: str) -> list[str]:
    out = [w for w in text.replace(" ", "").split(",") if w]
    bad = [w for w in out if w not in WORKLOADS]
    if not out or bad:
        raise argparse.ArgumentTypeError(
            f"workloads are a comma-separated subset of {','.join(WORKLOADS)}, got {text!r}"
        )
    return out


def add_control_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``aiokv bench control``."""
    p.set_defaults(transport="control")  # the receiver child's role (aiokv.cli.bench.common._spawn_receiver)
    p.add_argument("--json", action="store_true", help="one JSON line per workload")
    p.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="uvloop", help="event loop of both ends"
    )
    p.add_argument(
        "--workloads",
        type=_workloads,
        default=list(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    p.add_argument("--reps", type=_positive, default=5, help="kept blocks per side (+1 warm-up)")
    p.add_argument("--lat-iters", type=_positive, default=500, help="send4k transfers per block")
    p.add_argument("--rate-iters", type=_positive, default=2000, help="rate4k transfers per block")
    p.add_argument(
        "--stream-iters", type=_positive, default=200, help="stream1m transfers per block"
    )
    p.add_argument("--window", type=_positive, default=32, help="in flight in rate4k / stream1m")
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="write cProfile tables (.txt) and statistics (.prof) of the engine blocks, "
        "sender and receiver, per workload, into DIR",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 when a workload misses its target (see below); without "
        "it the run reports and exits 0",
    )


#: what the targets mean, for --help and under the table
TARGETS_TEXT = (
    "Targets compare the engine with raw zmq.asyncio moving the same bytes (ratio = "
    "engine / raw): send4k's p50 latency at most "
    f"{TARGETS['send4k'][1]}x raw's, rate4k's transfers/s at least {TARGETS['rate4k'][1]}x "
    f"raw's, stream1m's bytes/s at least {TARGETS['stream1m'][1]}x raw's. 'met no' marks a "
    "workload that missed its target on this run; --check turns a miss into exit status 1."
)


# --------------------------------------------------------------------------- profiling


# path -> cProfile.Profile, accumulated over a workload's engine blocks; written between
# workloads (``prof_dump``), never inside a measured block
_PROFILES: dict[str, Any] = {}


def _prof_start(path: str | None) -> Any:
    if not path:
        return None
    import cProfile

    prof = _PROFILES.setdefault(path, cProfile.Profile())
    prof.enable()
    return prof


def _prof_dump() -> None:
    """Write every profile: top functions by cumulative and by own time (``.txt``) and the raw
    statistics beside them (``.prof``, for pstats or snakeviz)."""
    import cProfile  # noqa: F401  (a first call, with nothing to write, imports it ahead of time)
    import io
    import pstats

    for path, prof in _PROFILES.items():
        prof.dump_stats(os.path.splitext(path)[0] + ".prof")
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("cumulative").print_stats(40)
        st.sort_stats("tottime").print_stats(40)
        with open(path, "w") as fh:
            fh.write(out.getvalue())
    _PROFILES.clear()


# --------------------------------------------------------------------------- receiver side


def _ack(i: int) -> bytes:
    return i.to_bytes(8, "little") + _ACK_PAD


async def _child_raw_lat(st: _TcpChild, msg: dict[str, Any]) -> None:
    """Raw one-way + ack: answer every message with a 64-byte ack."""
    st.reset()
    copy = bool(msg["copy"])
    for i in range(1, msg["n"] + 1):
        fr = await st.pull.recv(copy=copy)
        del fr
        await st.back.send(_ack(i))
    await st.reply()


async def _child_raw_win(st: _TcpChild, msg: dict[str, Any]) -> None:
    """Raw pipelined: acknowledge cumulatively every ``batch`` messages and at the last."""
    st.reset()
    copy = bool(msg["copy"])
    n = int(msg["n"])
    batch = int(msg["batch"])
    for i in range(1, n + 1):
        fr = await st.pull.recv(copy=copy)
        del fr
        if i % batch == 0 or i == n:
            await st.back.send(_ack(i))
    await st.reply()


async def _child_collect(st: _TcpChild, msg: dict[str, Any]) -> None:
    """Engine block: ``recv`` every id in order (profiled when the parent asks)."""
    prof = _prof_start(msg.get("prof"))
    try:
        await _collect(st.eng, msg, st.ticker, st.ack, st.gc)
    finally:
        if prof is not None:
            prof.disable()


async def _child_prof_dump(st: _TcpChild, msg: dict[str, Any]) -> None:
    _prof_dump()
    await st.ack.send(b'{"ok": true}')


CHILD_OPS = {
    "raw_lat": _child_raw_lat,
    "raw_win": _child_raw_win,
    "aiokv": _child_collect,
    "prof_dump": _child_prof_dump,
}


# --------------------------------------------------------------------------- sender side


@dataclass(slots=True)
class _Block:
    """One measured block of one side."""

    value: float  # latency: p50 seconds; rates: per second (transfers or bytes)
    p99: float  # latency only (seconds), else nan
    transfers: int
    secs: float  # wall time of the block
    gc_s: float  # sender's time in gc
    gc_n: int  # sender's collections
    gc_full: int  # sender's collections of the oldest generation
    gc_longest: float  # sender's longest collection (s)
    stall: float  # sender's largest loop stall (s)
    rx_stall: float  # receiver's largest loop stall (s)
    rx_gc_s: float  # receiver's time in gc
    cpu_s: float  # sender's CPU time (all its threads) during the block
    rx_cpu_s: float  # receiver's CPU time during the block


def _pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


@dataclass(slots=True)
class _Sender:
    """The parent's handles: engine, raw sockets, control channel, meters, options."""

    eng: Any
    peer: str
    ctl: _Control
    push: Any  # raw PUSH to the receiver
    back: Any  # raw PULL of the receiver's acks
    ticker: _Ticker
    gc: _GcMeter
    args: argparse.Namespace

    async def _raw_ack(self) -> int:
        return int.from_bytes((await self.back.recv())[:8], "little")

    async def raw_lat(self, buf: memoryview, n: int) -> list[float]:
        """``n`` one-way messages, each waiting for its 64-byte ack; the round-trip times."""
        copy = len(buf) < _COPY_BELOW
        await self.ctl.send({"op": "raw_lat", "n": n, "copy": copy})
        lats: list[float] = []
        for i in range(1, n + 1):
            t = time.perf_counter()
            await self.push.send(buf, copy=copy)
            if await self._raw_ack() != i:
                raise RuntimeError("raw ack out of order")
            lats.append(time.perf_counter() - t)
        return lats

    async def engine_lat(self, t: Any, tag: str, n: int, rx: dict[str, Any]) -> list[float]:
        """``n`` PUTs, one at a time; the time each ``await send`` took."""
        await self.ctl.send({"op": "aiokv", "tag": tag, "n": n, **rx})
        lats: list[float] = []
        for i in range(n):
            t1 = time.perf_counter()
            await self.eng.send(f"{tag}#{i}", t, to=self.peer, timeout=self.args.timeout)
            lats.append(time.perf_counter() - t1)
        return lats

    async def raw_win(self, buf: memoryview, n: int, window: int) -> None:
        """``n`` messages, at most ``window`` unacknowledged, acks batched by the receiver."""
        copy = len(buf) < _COPY_BELOW
        batch = max(1, window // 4)
        await self.ctl.send({"op": "raw_win", "n": n, "batch": batch, "copy": copy})
        sent = acked = 0
        while sent < n:
            if sent - acked >= window:
                acked = await self._raw_ack()
                continue
            await self.push.send(buf, copy=copy)
            sent += 1
        while acked < n:
            acked = await self._raw_ack()

    async def block(
        self, side: str, workload: str, tag: str, t: Any, buf: memoryview, keep: bool
    ) -> _Block:
        """One block of ``side`` ("raw" or "engine") with the sender's meters around it."""
        args = self.args
        rx: dict[str, Any] = {}
        spath = None
        if side == "engine" and keep and args.profile:
            spath = os.path.join(args.profile, f"profile-{workload}-sender.txt")
            rx["prof"] = os.path.join(args.profile, f"profile-{workload}-receiver.txt")
        n = {"send4k": args.lat_iters, "rate4k": args.rate_iters}.get(workload, args.stream_iters)
        self.ticker.reset()
        self.gc.reset()
        p99 = math.nan
        prof = _prof_start(spath)
        t0 = time.perf_counter()
        cpu = math.nan
        try:
            if workload == "send4k":
                if side == "raw":
                    lats = await self.raw_lat(buf, n)
                else:
                    lats = await self.engine_lat(t, tag, n, rx)
                secs = time.perf_counter() - t0
                cpu = self.ticker.cpu_s
                value, p99 = _pct(lats, 0.5), _pct(lats, 0.99)
                ack = await self.ctl.recv(args.timeout)
            else:
                if side == "raw":
                    await self.raw_win(buf, n, args.window)
                    secs = time.perf_counter() - t0
                    cpu = self.ticker.cpu_s
                    ack = await self.ctl.recv(args.timeout)
                else:
                    secs, ack = await _aiokv_stream(
                        self.eng, self.peer, self.ctl, t, tag, n, args.window, args.timeout, rx
                    )
                    cpu = self.ticker.cpu_s  # (after the receiver's ack: a few µs over)
                value = n / secs * (1 if workload == "rate4k" else len(buf))
        finally:
            if prof is not None:
                prof.disable()
        return _Block(
            value=value,
            p99=p99,
            transfers=n,
            secs=secs,
            gc_s=self.gc.seconds,
            gc_n=self.gc.collections,
            gc_full=self.gc.full,
            gc_longest=self.gc.longest,
            stall=self.ticker.max_late,
            rx_stall=float(ack.get("stall", 0.0)),
            rx_gc_s=float(ack.get("gc_s", 0.0)),
            cpu_s=cpu,
            rx_cpu_s=float(ack.get("cpu_s", math.nan)),
        )


# --------------------------------------------------------------------------- one workload


def _r(x: float, nd: int = 3) -> float | None:
    return round(x, nd) if math.isfinite(x) else None


def _passed(workload: str, ratio: float) -> bool:
    op, bound = TARGETS[workload]
    return ratio <= bound if op == "<=" else ratio >= bound


def _summary(
    workload: str, args: argparse.Namespace, raw: list[_Block], eng: list[_Block]
) -> dict[str, Any]:
    """The JSON line of one workload (medians over the kept blocks)."""
    lat = workload == "send4k"
    scale = 1e6 if lat else 1.0  # latencies in microseconds
    rv = statistics.median(b.value for b in raw) * scale
    ev = statistics.median(b.value for b in eng) * scale
    ratio = ev / rv if rv > 0 else math.nan
    paired = statistics.median(e.value / r.value for r, e in zip(raw, eng) if r.value > 0)
    n_eng = sum(b.transfers for b in eng)
    n_raw = sum(b.transfers for b in raw)
    op, bound = TARGETS[workload]
    out: dict[str, Any] = {
        "bench": "control",
        "workload": workload,
        "size_bytes": _SIZE[workload],
        "iters": eng[0].transfers,
        "window": 1 if lat else args.window,
        "reps": len(eng),
        "loop": args.loop,
        "metric": "p50" if lat else "rate",
        "unit": _UNIT[workload],
        "raw": _r(rv),
        "engine": _r(ev),
        "ratio": _r(ratio),
        "ratio_paired_median": _r(paired),
        "target": f"{op} {bound}",
        "pass": _passed(workload, ratio),
    }
    if lat:
        rp = statistics.median(b.p99 for b in raw) * scale
        ep = statistics.median(b.p99 for b in eng) * scale
        out |= {"raw_p99": _r(rp), "engine_p99": _r(ep), "ratio_p99": _r(ep / rp)}
    else:
        per = _SIZE[workload] if workload == "rate4k" else 1  # bytes per unit
        out |= {"raw_gbps": _r(rv * per / 1e9, 4), "engine_gbps": _r(ev * per / 1e9, 4)}
    out |= {
        "raw_all": [_r(b.value * scale) for b in raw],
        "engine_all": [_r(b.value * scale) for b in eng],
        # the sender's gc time during the engine blocks, per transfer and as a share of wall time
        "sender_gc_us_per_transfer": _r(sum(b.gc_s for b in eng) / n_eng * 1e6),
        "sender_gc_share": _r(sum(b.gc_s for b in eng) / sum(b.secs for b in eng), 4),
        "sender_gc_collections": sum(b.gc_n for b in eng),
        "sender_gc_full_collections": sum(b.gc_full for b in eng),
        "sender_gc_longest_ms": _r(max(b.gc_longest for b in eng) * 1e3),
        "raw_sender_gc_us_per_transfer": _r(sum(b.gc_s for b in raw) / n_raw * 1e6),
        "receiver_gc_us_per_transfer": _r(sum(b.rx_gc_s for b in eng) / n_eng * 1e6),
        # CPU time per transfer of each process (every thread), engine and raw: what the
        # work costs, independent of how busy the machine was
        "sender_cpu_us_per_transfer": _r(sum(b.cpu_s for b in eng) / n_eng * 1e6, 2),
        "receiver_cpu_us_per_transfer": _r(sum(b.rx_cpu_s for b in eng) / n_eng * 1e6, 2),
        "raw_sender_cpu_us_per_transfer": _r(sum(b.cpu_s for b in raw) / n_raw * 1e6, 2),
        "raw_receiver_cpu_us_per_transfer": _r(sum(b.rx_cpu_s for b in raw) / n_raw * 1e6, 2),
        # the largest event-loop stall seen in each process during the engine / raw blocks
        "sender_max_stall_ms": _r(max(b.stall for b in eng) * 1e3),
        "receiver_max_stall_ms": _r(max(b.rx_stall for b in eng) * 1e3),
        "raw_sender_max_stall_ms": _r(max(b.stall for b in raw) * 1e3),
        "raw_receiver_max_stall_ms": _r(max(b.rx_stall for b in raw) * 1e3),
    }
    return out


async def _workload(s: _Sender, workload: str) -> dict[str, Any]:
    """Warm-up pair, then ``--reps`` pairs of raw and engine blocks, interleaved."""
    import torch

    from aiokv.transport.tcp import tensor_buffer

    t = torch.full((_SIZE[workload],), 0xA5, dtype=torch.uint8)
    buf = tensor_buffer(t)
    raw: list[_Block] = []
    eng: list[_Block] = []
    for rep in range(s.args.reps + 1):  # rep 0 warms up and is discarded
        keep = rep > 0
        r = await s.block("raw", workload, f"{workload}-r{rep}", t, buf, keep)
        e = await s.block("engine", workload, f"{workload}-r{rep}", t, buf, keep)
        if keep:
            raw.append(r)
            eng.append(e)
    if s.args.profile:  # between workloads: the next one's warm-up pair absorbs the pause
        _prof_dump()
        await s.ctl.send({"op": "prof_dump"})
        await s.ctl.recv(s.args.timeout)
    return _summary(workload, s.args, raw, eng)


async def _parent(
    args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    import zmq

    import aiokv

    results: list[dict[str, Any]] = []

    async def body(ctl: _Control, hello: dict[str, Any]) -> None:
        ticker = _Ticker()
        meter = _GcMeter()
        ticker.start()
        meter.install()
        try:
            async with (
                aiokv.Engine(aiokv.EngineConfig(listen="127.0.0.1:0", **engine_overrides())) as eng,
                raw_sockets(eng, zmq.PUSH, zmq.PULL) as (push, back),
            ):
                push.connect(f"tcp://127.0.0.1:{hello['raw_port']}")
                back.connect(f"tcp://127.0.0.1:{hello['back_port']}")
                await eng.connect(hello["engine"])
                s = _Sender(eng, hello["engine"], ctl, push, back, ticker, meter, args)
                if args.profile:  # import the profilers now, not inside the first profiled block
                    _prof_dump()
                    await ctl.send({"op": "prof_dump"})
                    await ctl.recv(args.timeout)
                for w in args.workloads:
                    res = await _workload(s, w)
                    results.append(res)
                    emit(res)
        finally:
            meter.remove()
            await ticker.stop()

    await _with_receiver(args, body)
    return results


# --------------------------------------------------------------------------- entry point


def _print_table(results: Sequence[dict[str, Any]]) -> None:
    def f(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"

    print(
        f"{'workload':9} {'metric':18} {'raw':>14} {'engine':>14} {'ratio':>6} {'target':>7}"
        f" {'met':>5} {'gc us/xfer':>10} {'stall ms snd/rcv':>16}"
        f" {'cpu us/xfer snd/rcv: raw':>25} {'engine':>11}"
    )
    for r in results:
        w = r["workload"]
        metric = {"send4k": "p50 us", "rate4k": "transfers/s", "stream1m": "MB/s"}[w]
        if w == "stream1m":
            r = r | {"raw": r["raw"] / 1e6, "engine": r["engine"] / 1e6}
        stall = f"{r['sender_max_stall_ms']:.1f}/{r['receiver_max_stall_ms']:.1f}"
        rcpu = (
            f"{f(r['raw_sender_cpu_us_per_transfer'])}/{f(r['raw_receiver_cpu_us_per_transfer'])}"
        )
        ecpu = f"{f(r['sender_cpu_us_per_transfer'])}/{f(r['receiver_cpu_us_per_transfer'])}"
        print(
            f"{w:9} {metric:18} {f(r['raw']):>14} {f(r['engine']):>14} {r['ratio']:6.2f}"
            f" {r['target']:>7} {'yes' if r['pass'] else 'no':>5}"
            f" {r['sender_gc_us_per_transfer']:10.1f} {stall:>16} {rcpu:>25} {ecpu:>11}"
        )
        if w == "send4k":
            print(
                f"{'':9} {'p99 us':18} {f(r['raw_p99']):>14} {f(r['engine_p99']):>14}"
                f" {r['ratio_p99']:6.2f}"
            )
    if results:
        r0 = results[0]
        print(textwrap.fill(TARGETS_TEXT, 100))
        print(
            f"(loop {r0['loop']}, {r0['reps']} kept blocks per side, medians; ratio = engine/raw)"
        )


def control_main(args: argparse.Namespace) -> int:
    """Run ``aiokv bench control`` with parsed ``args``; returns an exit status."""

    def emit(r: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(r), flush=True)

    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        args.profile = os.path.abspath(args.profile)  # the receiver's working directory may differ
    try:
        results = _run_loop(_parent(args, emit), args.loop)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"aiokv bench control: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if not args.json:
        _print_table(results)
    missed = [r for r in results if not r["pass"]]
    if missed and args.check:
        for r in missed:
            print(
                f"aiokv bench control: {r['workload']} missed its target: ratio {r['ratio']:.2f},"
                f" target {r['target']}",
                file=sys.stderr,
            )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiokv.cli.bench.control ...`` (same as ``aiokv bench control``)."""
    p = argparse.ArgumentParser(
        prog="python -m aiokv.cli.bench.control", description=DESCRIPTION, epilog=TARGETS_TEXT
    )
    add_control_arguments(p)
    return control_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
