"""KV transfer benchmark: :class:`~aiokv.kv.KVConnector` vs a raw baseline, same run.

    python -m aiokv.cli.bench.kv --workload short --transport nccl --json
    python -m aiokv.cli.bench.kv --workload tiny --transport tcp --json     # CPU smoke test
    python -m aiokv.cli.bench.kv --workload short --transport ipc --json     # same-host IPC plane

Two processes (spawned), a producer and a consumer, each with an
:class:`aiokv.Engine` and a paged cache in the FlashAttention layout of
``docs/benchmarks.md`` (Llama-3-8B geometry: 32 layers, 8 KV heads, head dim 128,
block 16, bf16). Workloads: ``short`` 64 requests x 256 tokens, ``long`` 16 x
4096, ``tiny`` 4 layers, 8 x 64 tokens, float32 (CPU smoke test), ``steps`` 4
layers, 2 KV heads x 64, float16, 64 x 32 tokens (many small requests: the host
cost per request and per scheduler step). Block tables
are random permutations of a cache 25 % larger than needed, different on each
side. ``--transport nccl`` puts the producer on ``cuda:0`` and the consumer on
``cuda:1``; ``tcp`` uses CPU caches; ``ipc`` uses the same-host IPC plane
(:mod:`aiokv.kv.ipc`: the consumer pulls the blocks out of the producer's
cache in one kernel), producer on ``cuda:0`` and consumer on ``cuda:1`` -- or
both on ``cuda:0`` when only one GPU is visible (a correctness and kernel-rate
run, not the two-GPU figure).

Each iteration: the consumer zeroes its cache, posts a ``recv_request`` for every
request, signals the producer and starts the clock; the producer sends all
requests (``--concurrency`` at once); the clock stops when the last block is in
place (after a device synchronisation on GPU). Effective rate = bytes landed /
that wall time. The consumer then checks every block bit-exactly against the
producer's cache, which it regenerates from the seed. The raw reference in the
same run, same clock and same signalling: for ``nccl`` (and ``ipc`` on two
GPUs), torch.distributed (a 2-rank NCCL group over a TCP store on loopback)
sending the same bytes as one message per request; for ``tcp``, a pyzmq
PUSH/PULL of the same messages; for ``ipc`` on one GPU (NCCL cannot put two
ranks on one GPU), one device-to-device copy of the same bytes per request in
the consumer.
Latency: ``--latency-n`` one-at-a-time requests of 256 tokens (fewer for
``tiny``), from the producer's call to the last block in place on the consumer
(``time.perf_counter`` is CLOCK_MONOTONIC, shared by processes of one host),
after the consumer's ``recv_request`` returned and a device synchronisation;
``p50_return_ms`` is the median to the return alone (when the plane reports the
blocks in place and the caller's stream ordered after them; the synchronisation
checks it and costs ~0.04-0.07 ms under MPS on an H200 host).
``--latency-gap-ms``: the producer waits that long after the consumer posted its
``recv_request`` before it sends (a decode server waiting for a prefill; on IPC the
consumer is then past its doorbell spin).
``--gpu-lead-us`` (GPU): the producer calls ``send_request`` while its stream still
has that much work queued before the request's KV counts as written (a GPU
busy-wait, standing in for the end of the prefill's forward), as a serving engine
does that does not wait for its forward before handing the request over: the
plane's host work then overlaps the GPU's. ``p50_ready_ms``: from the moment the
GPU finished that work -- "the producer ready" -- to the blocks in place on the
consumer (after its synchronisation; ``p50_ready_return_ms`` to its return). That
moment is taken as the host clock just before the work was queued plus its GPU
duration (CUDA events): never later than the real one, so these figures are upper
bounds.
``--layerwise``: every request is saved layer by layer (``save_layer`` per layer,
then ``wait_saved``; the consumer waits with ``layerwise=True``): in the throughput
phase all of a request's layers in one loop pass, as a forward saves them; the latency requests each
layer after its share of the GPU lead when one is given, so that the last layer's save
comes at the ready.

``--batch N``: the producer hands the requests over in scheduler steps of ``N``, one
step after the other, each step as ONE batch (``send_requests``; the consumer waits
with one ``recv_requests`` per step); with ``--one-by-one`` the same steps, each
request of a step by its own ``send_request`` / ``recv_request``. (With ``--transport
ipc`` a step's batch is ONE plane request: one descriptor, one copy on the consumer;
``ipc_requests_per_step``: the consumer's plane requests per step in the timed
iterations, 1.0 then.) ``producer_host_ms_per_step`` / ``consumer_host_ms_per_step``:
the CPU time of each process's event-loop thread (``time.thread_time``) over the
throughput iteration, divided by the steps (without ``--batch``: by the requests),
medians.

Output (``--json``): one JSON line with ``workload, transport, aiokv_gbps,
raw_gbps, ratio, ok, p50_ms, p99_ms`` and details. GB/s are 1e9 bytes/s;
figures are medians over ``--iters``. Exit status 0 iff ok.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from aiokv.cli.bench.kv_roles import (
    WORKLOADS,
    GiB,
    MiB,
    Workload,
    _Chan,
    _consumer,
    _free_port,
    _layout,
    _producer,
    _trace_counts,
    _trace_summary,
)
from aiokv.kv._triton import apply_env as apply_process_env

__all__ = ["WORKLOADS", "Workload", "main"]

# --------------------------------------------------------------------------- process plumbing


def _child(role: str, a: dict[str, Any], conn: Connection, results: Any) -> None:
    warnings.simplefilter("ignore")
    apply_process_env()  # a spawned child: AIOKV_DISABLE_TRITON is applied here too
    fn = _producer if role == "producer" else _consumer
    chan = _Chan(conn)
    try:
        coro = fn(a, chan)
        if a["loop"] == "uvloop":
            import uvloop

            out = uvloop.run(coro)
        else:
            out = asyncio.run(coro)
        results.put((role, "ok", out))
    except BaseException as exc:
        detail = f"{type(exc).__name__}: {exc}"
        with _suppress():
            conn.send(("error", detail))
        results.put((role, "error", detail + "\n" + traceback.format_exc()))


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def main(argv: Sequence[str] | None = None, prog: str = "python -m aiokv.cli.bench.kv") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="KV transfer benchmark: aiokv's KVConnector against a raw baseline "
        "(torch.distributed NCCL, a pyzmq PUSH/PULL or a device copy) in the same run, "
        "between two processes with paged caches in the FlashAttention layout; every "
        "block is checked bit-exactly. Exit status 0 iff the check passed.",
        epilog="Workloads: short = 64 requests x 256 tokens, long = 16 x 4096 (Llama-3-8B "
        "geometry, bf16), tiny = 4 layers, 8 x 64 tokens, float32 (a CPU smoke test), "
        "steps = 4 layers, 64 x 32 tokens, float16 (small requests: the host cost per step). "
        "Method and figures: docs/benchmarks.md.",
    )
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="tiny",
        help="request mix and cache geometry (default %(default)s; see below)",
    )
    ap.add_argument(
        "--transport",
        choices=["tcp", "nccl", "ipc"],
        default="tcp",
        help="tcp: CPU caches; nccl: cuda:0 -> cuda:1; ipc: the same-host IPC plane "
        "(cuda:0 -> cuda:1, or one GPU when only one is visible) (default %(default)s)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument(
        "--iters",
        type=int,
        default=3,
        help="timed iterations; the median is reported (default %(default)s)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests the producer has in flight (default %(default)s)",
    )
    ap.add_argument(
        "--chunk-mib",
        type=float,
        default=64.0,
        help="largest single transfer the connector makes, MiB (default %(default)s)",
    )
    ap.add_argument(
        "--staging-mib",
        type=float,
        default=None,
        help="the producer's staging memory, MiB (default: room for two chunks per request "
        "in flight, at least four chunks, at most 2048)",
    )
    ap.add_argument(
        "--latency-n",
        type=int,
        default=50,
        help="one-at-a-time latency requests after the throughput phase (default %(default)s)",
    )
    ap.add_argument(
        "--latency-warmup",
        type=int,
        default=5,
        help="latency requests run first and not counted (default %(default)s)",
    )
    ap.add_argument(
        "--latency-gap-ms",
        type=float,
        default=0.0,
        help="latency requests: the producer sends this long after the consumer waits",
    )
    ap.add_argument(
        "--gpu-lead-us",
        type=float,
        default=0.0,
        help="GPU, latency requests: the producer sends with this much GPU work still "
        "queued before its KV is ready; adds p50_ready_ms (from the GPU ready)",
    )
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="every request saved layer by layer (save_layer, recv_request(layerwise="
        "True)): throughput requests all layers in one pass; latency requests with "
        "--gpu-lead-us each layer after its share of the lead",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        metavar="N",
        help="hand the requests over in scheduler steps of N requests, one step after the "
        "other, each step as one batch (send_requests / recv_requests); reports the host "
        "CPU time per step (default: every request on its own, --concurrency at once)",
    )
    ap.add_argument(
        "--one-by-one",
        action="store_true",
        help="with --batch: the same steps, each request by its own send_request",
    )
    ap.add_argument(
        "--push",
        action="store_true",
        help="ipc: push mode (the consumer grants its blocks, the producer copies); give "
        "--latency-gap-ms so that the grants land before the producer sends",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="seed of the cache contents and block tables (default %(default)s)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one iteration may take before the run fails (default %(default)s)",
    )
    ap.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default=None,
        help="event loop of both processes (default: uvloop when installed)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="ipc: stamp each latency request's stages in both processes (trace_ms)",
    )
    args = ap.parse_args(argv)
    if args.iters < 1 or args.latency_n < 1 or args.concurrency < 1:
        ap.error("--iters, --latency-n and --concurrency must be >= 1")
    if not 0 <= args.latency_gap_ms <= 10_000:
        ap.error("--latency-gap-ms must be in [0, 10000]")
    if not 0 <= args.gpu_lead_us <= 1_000_000:
        ap.error("--gpu-lead-us must be in [0, 1000000]")
    if args.batch < 0 or (args.one_by_one and not args.batch):
        ap.error("--batch must be >= 1 (--one-by-one needs --batch)")
    if args.batch and args.layerwise:
        ap.error("--batch moves whole requests; it cannot be combined with --layerwise")
    if args.gpu_lead_us and args.transport == "tcp":
        ap.error("--gpu-lead-us needs a GPU transport (ipc, nccl)")
    loop = args.loop
    if loop is None:
        try:
            import uvloop  # noqa: F401

            loop = "uvloop"
        except ImportError:
            loop = "asyncio"
    w = WORKLOADS[args.workload]
    layout = _layout(w)
    chunk = int(args.chunk_mib * MiB)
    req_bytes = layout.request_nbytes(w.blocks_per_request)
    if args.staging_mib is not None:
        staging = int(args.staging_mib * MiB)
    else:
        staging = min(2 * GiB, max(4 * chunk, 2 * args.concurrency * min(chunk, req_bytes)))
    gpus = 0
    if args.transport in ("nccl", "ipc"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = 2 if args.transport == "nccl" else 1
        if gpus < need:
            print(
                f"--transport {args.transport} needs {need} CUDA GPUs, found {gpus}",
                file=sys.stderr,
            )
            return 2
    if args.transport == "tcp":
        raw_kind = "zmq"
    elif args.transport == "nccl" or gpus >= 2:
        raw_kind = "nccl"
    else:
        raw_kind = "d2d"
    a: dict[str, Any] = {
        "workload": args.workload,
        "transport": args.transport,
        "iters": args.iters,
        "concurrency": args.concurrency,
        "chunk_bytes": chunk,
        "staging_bytes": staging,
        "latency_n": args.latency_n,
        "latency_warmup": args.latency_warmup,
        "latency_gap_s": args.latency_gap_ms / 1e3,
        "gpu_lead_us": args.gpu_lead_us,
        "layerwise": bool(args.layerwise),
        "seed": args.seed,
        "timeout": args.timeout,
        "loop": loop,
        "dist_port": _free_port(),
        "raw": raw_kind,
        "gpus": gpus,
        "trace": bool(args.trace),
        "push": bool(args.push),
        "batch": args.batch,
        "one_by_one": bool(args.one_by_one),
    }
    if args.push and args.transport != "ipc":
        ap.error("--push needs --transport ipc")
    if args.trace:
        os.environ["AIOKV_IPC_TRACE"] = "1"  # read by aiokv.kv.ipc at import, in the children
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    pc, cc = ctx.Pipe()
    procs = {
        "producer": ctx.Process(target=_child, args=("producer", a, pc, results), daemon=True),
        "consumer": ctx.Process(target=_child, args=("consumer", a, cc, results), daemon=True),
    }
    for p in procs.values():
        p.start()
    got: dict[str, tuple[str, Any]] = {}
    deadline = time.monotonic() + args.timeout * (args.iters + 3) + 120
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            role, status, out = results.get(timeout=1.0)
            got[role] = (status, out)
        except queue.Empty:
            if all(not p.is_alive() for p in procs.values()) and results.empty():
                break
    for p in procs.values():
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    rec: dict[str, Any] = {
        "workload": args.workload,
        "transport": args.transport,
        "aiokv_gbps": 0.0,
        "raw_gbps": 0.0,
        "ratio": 0.0,
        "ok": False,
        "p50_ms": None,
        "p99_ms": None,
    }
    errors = {r: out for r, (st, out) in got.items() if st != "ok"}
    missing = [r for r in procs if r not in got]
    if errors or missing:
        rec["error"] = "; ".join(
            [f"{r}: {e.splitlines()[0] if e else e}" for r, e in errors.items()]
            + [f"{r}: no result (exit code {procs[r].exitcode})" for r in missing]
        )
        for r, e in errors.items():
            print(f"--- {r} failed:\n{e}", file=sys.stderr)
    else:
        c = got["consumer"][1]
        total = c["bytes"]
        ipc_stats = (c.get("connector") or {}).get("ipc")
        if args.transport == "ipc":
            rec["ipc"] = ipc_stats
            # plane requests per scheduler step (or per request without --batch) in the
            # timed iterations: 1.0 when each step's batch is one plane request
            per_iter = -(-w.requests // args.batch) if args.batch else w.requests
            rec["ipc_requests_per_step"] = round(
                c.get("plane_requests", 0) / max(1, args.iters * per_iter), 4
            )
            if (
                not ipc_stats
                or ipc_stats.get("fallbacks")
                or not ipc_stats.get("requests_received")
            ):
                c["ok"] = False  # an IPC run that did not use IPC measured something else
        steps = -(-w.requests // args.batch) if args.batch else w.requests
        t_aiokv = statistics.median(c["aiokv_s"])
        t_raw = statistics.median(c["raw_s"])
        lat = [(e - s) * 1e3 for s, e in zip(c["lat_start"], c["lat_end"])]
        ret = [(e - s) * 1e3 for s, e in zip(c["lat_start"], c["lat_ret"])]
        if c["lat_ready"]:  # --gpu-lead-us: from the GPU's ready (an upper bound)
            ready = [(e - s) * 1e3 for s, e in zip(c["lat_ready"], c["lat_end"], strict=True)]
            ready_ret = [(e - s) * 1e3 for s, e in zip(c["lat_ready"], c["lat_ret"], strict=True)]
            rec.update(
                gpu_lead_us=args.gpu_lead_us,
                p50_ready_ms=round(_pct(ready, 50), 4),
                p99_ready_ms=round(_pct(ready, 99), 4),
                p50_ready_return_ms=round(_pct(ready_ret, 50), 4),
            )
        if args.trace:
            rec["trace_ms"] = _trace_summary(
                got["producer"][1].get("trace", []),
                c.get("trace", []),
                c["lat_start"],
                c["lat_end"],
            )
            rec["trace_n"] = _trace_counts(got["producer"][1].get("trace", []), c.get("trace", []))
        rec.update(
            aiokv_gbps=round(total / t_aiokv / 1e9, 4),
            raw_gbps=round(total / t_raw / 1e9, 4),
            ratio=round(t_raw / t_aiokv, 4),
            ok=bool(c["ok"]),
            p50_ms=round(_pct(lat, 50), 4),
            p99_ms=round(_pct(lat, 99), 4),
            p50_return_ms=round(_pct(ret, 50), 4),
            latency_tokens=c["latency_tokens"],
            latency_layerwise=bool(args.layerwise),
            throughput_layerwise=bool(args.layerwise),
            latency_n=len(lat),
            bytes=total,
            requests=w.requests,
            tokens=w.tokens,
            iters=args.iters,
            aiokv_seconds=[round(x, 6) for x in c["aiokv_s"]],
            raw_seconds=[round(x, 6) for x in c["raw_s"]],
            raw={
                "nccl": "torch.distributed NCCL send/recv, one message per request",
                "zmq": "pyzmq PUSH/PULL, one message per request",
                "d2d": "one device-to-device copy per request on the consumer's GPU (1 GPU)",
            }[raw_kind],
            gpus=gpus,
            chunk_bytes=chunk,
            staging_bytes=staging,
            concurrency=args.concurrency,
            batch=args.batch,
            one_by_one=bool(args.one_by_one),
            steps=steps,
            producer_host_ms_per_step=round(
                statistics.median(got["producer"][1]["host_s"]) / steps * 1e3, 4
            ),
            consumer_host_ms_per_step=round(statistics.median(c["host_s"]) / steps * 1e3, 4),
            loop=loop,
            pid=os.getpid(),
        )
    if args.json:
        print(json.dumps(rec), flush=True)
    else:
        for k, v in rec.items():
            print(f"{k:>16}: {v}")
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
