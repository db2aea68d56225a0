"""The two roles of ``aiokv bench kv`` (producer and consumer, one process each), the
workloads they run, and the raw baselines they are measured against (NCCL send/recv,
raw pyzmq PUSH -> PULL).
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from aiokv.envs import engine_overrides

MiB = 1 << 20


GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Workload:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    requests: int
    tokens: int

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.requests * self.blocks_per_request * 5 // 4 + 1


WORKLOADS: dict[str, Workload] = {
    "short": Workload(32, 8, 128, 16, "bfloat16", 64, 256),
    "long": Workload(32, 8, 128, 16, "bfloat16", 16, 4096),
    "tiny": Workload(4, 8, 128, 16, "float32", 8, 64),
    "steps": Workload(4, 2, 64, 16, "float16", 64, 32),
}


def _steps(requests: int, batch: int) -> list[range]:
    """The requests of each scheduler step (``--batch``), in order."""
    return [range(s, min(s + batch, requests)) for s in range(0, requests, batch)]


def _raise_first(results: dict[str, Exception | None]) -> None:
    """A batch call's first failure, raised (the benchmark moves only good requests)."""
    for exc in results.values():
        if exc is not None:
            raise exc


# --------------------------------------------------------------------------- shared helpers


def _layout(w: Workload) -> Any:
    from aiokv.kv.layouts import FlashAttentionLayout

    return FlashAttentionLayout(
        num_layers=w.num_layers,
        num_blocks=w.num_blocks,
        block_size=w.block_size,
        num_kv_heads=w.num_kv_heads,
        head_dim=w.head_dim,
        dtype=w.dtype,
    )


def _tables(w: Workload, seed: int, side: int) -> list[list[int]]:
    """Random, non-contiguous block tables (one per request) of one side."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + side)
    perm = torch.randperm(w.num_blocks, generator=g).tolist()
    k = w.blocks_per_request
    return [perm[r * k : (r + 1) * k] for r in range(w.requests)]


def _alloc(layout: Any, device: Any, seed: int | None) -> tuple[Any, list[Any]]:
    """One stacked allocation; filled with seeded random bytes when ``seed`` is given."""
    import torch

    big = torch.empty(
        (layout.num_layers, *layout.layer_shape()), dtype=layout.torch_dtype, device=device
    )
    raw = big.view(torch.uint8)
    if seed is None:
        raw.zero_()
    else:
        g = torch.Generator(device=device).manual_seed(seed)
        raw.random_(0, 256, generator=g)
    return big, list(big.unbind(0))


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Chan:
    """The producer<->consumer control pipe (blocking reads happen on a thread)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    async def recv(self, expect: str, timeout: float = 600.0) -> tuple[Any, ...]:
        def get() -> tuple[Any, ...]:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"no {expect!r} from the other process in {timeout}s")
            m: tuple[Any, ...] = self.conn.recv()
            return m

        msg = await asyncio.to_thread(get)
        if msg[0] == "error":
            raise RuntimeError(f"the other process failed: {msg[1]}")
        if msg[0] != expect:
            raise RuntimeError(f"expected {expect!r}, got {msg[0]!r}")
        return msg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --------------------------------------------------------------------------- the two roles


async def _producer(a: dict[str, Any], chan: _Chan) -> dict[str, Any]:
    import torch

    import aiokv
    from aiokv.kv.connector import KVConnector
    from aiokv.kv.ipc import IpcPlane

    w = WORKLOADS[a["workload"]]
    device = torch.device("cuda:0" if a["transport"] in ("nccl", "ipc") else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = _layout(w)
    _big, caches = _alloc(layout, device, a["seed"])
    tables = _tables(w, a["seed"], 0)
    req_bytes = layout.request_nbytes(w.blocks_per_request)
    cfg = aiokv.EngineConfig(
        device=str(device),
        transport=_engine_transport(a),
        layout=layout.to_wire(),
        timeouts=aiokv.Timeouts(transfer=a["timeout"], negotiate=a["timeout"]),
        limits=aiokv.Limits(store_bytes=4 * GiB),
        **engine_overrides(),
    )
    pg = _raw_setup(a, rank=0)
    out: dict[str, Any] = {}
    async with aiokv.Engine(cfg) as eng:
        (_, to, raw_ep) = await chan.recv("addr")
        con = KVConnector(
            eng,
            layout,
            caches,
            chunk_bytes=a["chunk_bytes"],
            staging_bytes=a["staging_bytes"],
            ipc=_ipc_options(a),
        )
        sem = asyncio.Semaphore(a["concurrency"])
        host_s: list[float] = []  # CPU time of this (the loop's) thread per iteration
        lead = lead_cycles = None
        if a["gpu_lead_us"]:
            lead = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))  # type: ignore[no-untyped-call]
            lead_cycles = int(a["gpu_lead_us"] * _cycles_per_us(torch))

        async def one(rid: str, ids: list[int]) -> None:
            async with sem:
                if a["layerwise"]:  # all layers saved in one pass, as a forward does
                    await _save_layers(con, rid, ids, to, None, None)
                else:
                    await con.send_request(rid, ids, to=to)

        raw_src = torch.empty(req_bytes, dtype=torch.uint8, device=device).random_(0, 256)
        push = _zmq_push(raw_ep) if a["raw"] == "zmq" else None
        try:
            while True:
                msg = await chan.recv("cmd")
                cmd = msg[1]
                if cmd == "stop":
                    break
                if cmd == "aiokv":
                    it = msg[2]
                    c0 = time.thread_time()
                    if a["batch"]:  # scheduler steps, one after the other
                        for step in _steps(w.requests, a["batch"]):
                            reqs = [(f"i{it}r{r}", tables[r]) for r in step]
                            if a["one_by_one"]:
                                await asyncio.gather(
                                    *(con.send_request(rid, ids, to=to) for rid, ids in reqs)
                                )
                            else:
                                _raise_first(await con.send_requests(reqs, to=to))
                    else:
                        await asyncio.gather(
                            *(one(f"i{it}r{r}", tables[r]) for r in range(w.requests))
                        )
                    if it >= 0:
                        host_s.append(time.thread_time() - c0)
                    plane = con._ipc
                    if it == -1 and a["push"] and isinstance(plane, IpcPlane):
                        # the warm-up's releases carried the consumer's export: wait for
                        # its mapping (off the loop, seconds), so that the timed
                        # iterations after the next one find the consumer granting
                        for _ in range(600):
                            if plane.pusher.maps or plane.pusher.failed:
                                break
                            await asyncio.sleep(0.05)
                elif cmd == "raw":
                    if a["raw"] == "nccl":
                        await asyncio.to_thread(_nccl_raw, pg, raw_src, w.requests, 0)
                    elif a["raw"] == "zmq":
                        await asyncio.to_thread(_zmq_raw_push, push, raw_src, w.requests)
                elif cmd == "lat":
                    n_blocks = msg[3]
                    if a["latency_gap_s"]:
                        await asyncio.sleep(a["latency_gap_s"])
                    t = time.perf_counter()
                    rid, ids = f"lat{msg[2]}", tables[0][:n_blocks]
                    if a["layerwise"]:  # each layer saved after its share of the lead
                        await _save_layers(con, rid, ids, to, lead, lead_cycles)
                    else:
                        if lead is not None:
                            lead[0].record()
                            torch.cuda._sleep(lead_cycles)  # type: ignore[no-untyped-call]
                            lead[1].record()
                        await con.send_request(rid, ids, to=to)
                    t_ready = None
                    if lead is not None:
                        # (it fired before the copy could end: a pass or none)
                        while not lead[1].query():  # type: ignore[no-untyped-call]
                            await asyncio.sleep(0)
                        t_ready = t + lead[0].elapsed_time(lead[1]) / 1e3
                    chan.send("t", t, t_ready)
                    continue
                chan.send("ack")
        finally:
            if push is not None:
                push.close(linger=0)
        out["connector"] = asdict(con.statistics())
        out["host_s"] = host_s
        out["trace"] = _take_trace(a)
        await con.aclose()
    _raw_teardown(pg)
    return out


async def _save_layers(
    con: Any, rid: str, ids: list[int], to: str, lead: Any, lead_cycles: int | None
) -> None:
    """A request saved layer by layer, as a forward would: all layers in one loop pass
    (a latency request with ``--gpu-lead-us``: each after its share of the lead, spread
    over the layers, the ready event after the last share), then ``wait_saved``."""
    import torch

    from aiokv.kv.ipc._common import _mark

    L = con.layout.num_layers
    if lead is not None:
        lead[0].record()
    for li in range(L):
        if lead is not None:
            torch.cuda._sleep(max(1, (lead_cycles or 0) // L))  # type: ignore[no-untyped-call]
            if li == L - 1:
                lead[1].record()
        con.save_layer(rid, li, ids, to=to)
    _mark(rid, "queued")  # (--trace: every layer's save made, host side)
    await con.wait_saved(rid)


def _cycles_per_us(torch: Any) -> float:
    """GPU clock cycles per µs of ``torch.cuda._sleep`` (its busy-wait), measured."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda._sleep(1000)  # (loaded and launched once before it is timed)
    cycles = 20_000_000
    ev[0].record()
    torch.cuda._sleep(cycles)
    ev[1].record()
    ev[1].synchronize()  # (once, before any request: nothing else waits on this loop)
    return float(cycles / (ev[0].elapsed_time(ev[1]) * 1e3))


async def _consumer(a: dict[str, Any], chan: _Chan) -> dict[str, Any]:
    import torch

    import aiokv
    from aiokv.kv.connector import KVConnector

    w = WORKLOADS[a["workload"]]
    if a["transport"] == "nccl":
        device = torch.device("cuda:1")
    elif a["transport"] == "ipc":
        device = torch.device("cuda:1" if a["gpus"] >= 2 else "cuda:0")
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = _layout(w)
    big, caches = _alloc(layout, device, None)
    expected, _ = _alloc(layout, device, a["seed"])  # the producer's cache, regenerated
    src_tables = _tables(w, a["seed"], 0)
    tables = _tables(w, a["seed"], 1)
    req_bytes = layout.request_nbytes(w.blocks_per_request)
    total = w.requests * req_bytes
    cfg = aiokv.EngineConfig(
        device=str(device),
        transport=_engine_transport(a),
        layout=layout.to_wire(),
        timeouts=aiokv.Timeouts(transfer=a["timeout"], negotiate=a["timeout"]),
        limits=aiokv.Limits(store_bytes=4 * GiB),
        **engine_overrides(),
    )
    bd = layout.block_dim + 1  # in the stacked [L, ...] view

    def check(reqs: Sequence[int], n_blocks: int | None = None) -> bool:
        ok = True
        for r in reqs:
            s = torch.tensor(src_tables[r][:n_blocks], device=device)
            d = torch.tensor(tables[r][:n_blocks], device=device)
            want = expected.view(torch.uint8).index_select(bd, s)
            got = big.view(torch.uint8).index_select(bd, d)
            ok = ok and bool(torch.equal(want, got))
        return ok

    pg = _raw_setup(a, rank=1)
    pull, raw_ep = _zmq_pull() if a["raw"] == "zmq" else (None, "")
    raw_dst = torch.empty(req_bytes, dtype=torch.uint8, device=device)
    raw_local = torch.empty(req_bytes, dtype=torch.uint8, device=device).random_(0, 256)
    res: dict[str, Any] = {
        "aiokv_s": [],
        "raw_s": [],
        "ok": True,
        "lat_end": [],
        "lat_ret": [],
        "host_s": [],  # CPU time of this (the loop's) thread per iteration
    }
    async with aiokv.Engine(cfg) as eng:
        chan.send("addr", eng.address, raw_ep)
        con = KVConnector(eng, layout, caches, chunk_bytes=a["chunk_bytes"], ipc=_ipc_options(a))
        try:
            for it in range(-1, a["iters"]):  # iteration -1 warms up (sessions, NCCL, kernels)
                if it == 0:
                    res["plane_requests"] = -_plane_requests(con)
                big.zero_()
                _sync(device)
                c0 = time.thread_time()
                tasks: list[asyncio.Future[Any]]
                if a["batch"] and not a["one_by_one"]:
                    tasks = [
                        asyncio.ensure_future(
                            con.recv_requests([(f"i{it}r{r}", tables[r]) for r in step])
                        )
                        for step in _steps(w.requests, a["batch"])
                    ]
                else:
                    tasks = [
                        asyncio.ensure_future(
                            con.recv_request(f"i{it}r{r}", tables[r], layerwise=a["layerwise"])
                        )
                        for r in range(w.requests)
                    ]
                await asyncio.sleep(0.005 if a["push"] else 0)  # (push: grants land first)
                t0 = time.perf_counter()
                chan.send("cmd", "aiokv", it)
                for got in await asyncio.gather(*tasks):
                    if isinstance(got, dict):
                        _raise_first(got)
                _sync(device)
                t1 = time.perf_counter()
                if it >= 0:
                    res["host_s"].append(time.thread_time() - c0)
                await chan.recv("ack")
                ok = check(range(w.requests))
                res["ok"] = res["ok"] and ok
                if it >= 0:
                    res["aiokv_s"].append(t1 - t0)
                # the raw reference, interleaved so both see the same machine state
                t0 = time.perf_counter()
                chan.send("cmd", "raw")
                if a["raw"] == "nccl":
                    await asyncio.to_thread(_nccl_raw, pg, raw_dst, w.requests, 1)
                elif a["raw"] == "zmq":
                    await asyncio.to_thread(_zmq_raw_pull, pull, w.requests, req_bytes)
                else:  # one GPU: a device-to-device copy of the same bytes per request
                    for _ in range(w.requests):
                        raw_dst.copy_(raw_local)
                _sync(device)
                t1 = time.perf_counter()
                await chan.recv("ack")
                if it >= 0:
                    res["raw_s"].append(t1 - t0)
            res["plane_requests"] = res.get("plane_requests", 0) + _plane_requests(con)
            # latency: one request at a time
            n_blocks = min(w.blocks_per_request, max(1, 256 // w.block_size))
            res["latency_tokens"] = n_blocks * w.block_size
            starts: list[float] = []
            readies: list[float] = []
            marks: list[tuple[str, str, float]] = []  # (--gpu-lead-us: for the trace)
            for i in range(a["latency_warmup"] + a["latency_n"]):
                task = asyncio.ensure_future(
                    con.recv_request(f"lat{i}", tables[0][:n_blocks], layerwise=a["layerwise"])
                )
                await asyncio.sleep(0)
                chan.send("cmd", "lat", i, n_blocks)
                await task
                t_ret = time.perf_counter()
                _sync(device)
                t_end = time.perf_counter()
                (_, t_start, t_ready) = await chan.recv("t")
                if i >= a["latency_warmup"]:
                    starts.append(t_start)
                    if t_ready is not None:
                        readies.append(t_ready)
                        marks.extend(
                            [(f"lat{i}", "call", t_start), (f"lat{i}", "gpu-ready", t_ready)]
                        )
                    res["lat_end"].append(t_end)
                    res["lat_ret"].append(t_ret)
            big.zero_()
            res["ok"] = res["ok"] and not check([0], n_blocks)  # sanity: the check can fail
            res["lat_start"] = starts
            res["lat_ready"] = readies
            chan.send("cmd", "stop")
        finally:
            if pull is not None:
                pull.close(linger=0)
        res["connector"] = asdict(con.statistics())
        res["trace"] = _take_trace(a) + (marks if a.get("trace") else [])
        await con.aclose()
    _raw_teardown(pg)
    res["bytes"] = total
    return res


def _plane_requests(con: Any) -> int:
    """The requests the consumer's IPC plane received so far (0 without the plane)."""
    st = con.statistics().ipc
    return st.requests_received if st is not None else 0


# --------------------------------------------------------------------------- raw baselines


def _engine_transport(a: dict[str, Any]) -> str:
    # the IPC plane's control messages are CPU tensors (TCP); its fallback takes NCCL
    return "auto" if a["transport"] == "ipc" else str(a["transport"])


def _take_trace(a: dict[str, Any]) -> list[tuple[str, str, float]]:
    """The IPC plane's stamps of the latency requests (``--trace``)."""
    if a["transport"] != "ipc" or not a.get("trace"):
        return []
    from aiokv.kv import ipc

    return [x for x in ipc.take_trace() if x[0].startswith("lat")]


def _by_request(prod: list[Any], cons: list[Any]) -> dict[str, dict[str, float]]:
    by: dict[str, dict[str, float]] = {}
    for rid, stage, t in [*prod, *cons]:
        if str(rid).startswith("lat"):
            by.setdefault(rid, {}).setdefault(stage, t)
    return by


def _trace_counts(prod: list[Any], cons: list[Any]) -> dict[str, int]:
    """How many latency requests have each stage (the path they took)."""
    out: dict[str, int] = {}
    for st in _by_request(prod, cons).values():
        for stage in st:
            out[stage] = out.get(stage, 0) + 1
    return out


def _trace_summary(
    prod: list[Any], cons: list[Any], starts: list[float], ends: list[float]
) -> dict[str, float]:
    """Median time of each stamped stage after the producer's call (ms), both processes,
    over the latency requests (``lat<i>``; a stage some requests skip is the median of
    those that have it: :func:`_trace_counts`); ``end`` is the consumer's clock stop
    (blocks in place, device synchronised) after the producer's call as the bench
    clocks it (with ``--gpu-lead-us``: ``call`` is that clock's start and ``gpu-ready``
    the GPU's ready as estimated, both after the plane's ``send`` stamp)."""
    by = _by_request(prod, cons)
    rows: dict[str, list[float]] = {}
    for st in by.values():
        t0 = st.get("send")
        if t0 is None:
            continue
        for stage, t in st.items():
            rows.setdefault(stage, []).append((t - t0) * 1e3)
    out = {k: round(statistics.median(v), 4) for k, v in rows.items()}
    if starts and ends:
        out["end"] = round(statistics.median([(e - s) * 1e3 for s, e in zip(starts, ends)]), 4)
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def _ipc_options(a: dict[str, Any]) -> Any:
    if a["transport"] != "ipc":
        return None
    from aiokv.kv.ipc import IpcOptions

    # both processes are this benchmark's own children on one host
    return IpcOptions(trust_unauthenticated=True, push=a["push"])


def _raw_setup(a: dict[str, Any], rank: int) -> Any:
    if a["raw"] != "nccl":
        return None
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{a['dist_port']}",
        rank=rank,
        world_size=2,
    )
    # warm the P2P connection up with one request-sized message
    buf = torch.zeros(1 * MiB, dtype=torch.uint8, device=f"cuda:{rank}")
    if rank == 0:
        dist.send(buf, dst=1)
    else:
        dist.recv(buf, src=0)
    torch.cuda.synchronize()
    return dist.group.WORLD


def _raw_teardown(pg: Any) -> None:
    if pg is None:
        return
    import torch.distributed as dist

    dist.destroy_process_group()


def _nccl_raw(pg: Any, buf: Any, n: int, rank: int) -> None:
    import torch
    import torch.distributed as dist

    works: list[Any] = (
        [dist.isend(buf, dst=1) for _ in range(n)]
        if rank == 0
        else [dist.irecv(buf, src=0) for _ in range(n)]
    )
    for wk in works:
        if wk is not None:
            wk.wait()
    torch.cuda.synchronize()


def _zmq_pull() -> tuple[Any, str]:
    import zmq

    ctx: Any = zmq.Context.instance()
    s: Any = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 0)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    return s, f"tcp://127.0.0.1:{port}"


def _zmq_push(ep: str) -> Any:
    import zmq

    s: Any = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(ep)
    return s


def _zmq_raw_push(sock: Any, buf: Any, n: int) -> None:
    from aiokv.transport.tcp import tensor_buffer

    mv = tensor_buffer(buf)
    for _ in range(n):
        sock.send(mv, copy=False)


def _zmq_raw_pull(sock: Any, n: int, nbytes: int) -> None:
    for _ in range(n):
        f = sock.recv(copy=False)
        if len(f.buffer) != nbytes:
            raise RuntimeError(f"raw pull got {len(f.buffer)} bytes, expected {nbytes}")
