"""Host time of AiokvConnector's worker side per scheduler step (docs/vllm.md).

A prefill worker and a decode worker in this process (``_workers.py``: real CPU caches
in vLLM's CPU attention layout, no vLLM engine). One prefill step hands N requests
on (``wait_for_save`` -> ``start_sends``: whole pushes to the decode), one decode step
loads them (``start_loads``); each step is timed from the worker-side call to the
last request reported (``get_finished``), with the CPU time of the worker's loop
thread over that time. Run it from the repository root::

    PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu python tests/vllm/bench_step.py --batch on
    PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu python tests/vllm/bench_step.py --batch off

``--batch off`` sends every request on its own (``send_request`` / ``recv_request``);
with a tree whose connector does not batch, ``--batch on`` is refused.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

with warnings.catch_warnings():  # vLLM's imports warn (deprecations in torch)
    warnings.simplefilter("ignore")
    from _workers import drain, load_of, make_worker, step_loads, step_sends

    from aiokv.vllm._protocol import SendSpec, transfer_key
    from aiokv.vllm._worker import _WorkerSide


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loop_cpu(w: _WorkerSide) -> float:
    assert w.loop is not None
    ident = w.loop._thread.ident
    assert ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def one_step(
    p: _WorkerSide, d: _WorkerSide, n: int, per_req: int, batch: bool, tag: str
) -> dict[str, float]:
    assert d.address is not None and p.address is not None
    sends = []
    for i in range(n):
        rid = f"{tag}-{i}"
        ids = list(range(i * per_req, (i + 1) * per_req))
        sends.append(SendSpec(rid, transfer_key(rid, [i]), ids, d.address))
    if batch:
        from _workers import batch_sends

        batch_sends(sends)
    out: dict[str, float] = {}
    for side, w, go in (
        ("prefill", p, lambda: step_sends(p, sends)),
        (
            "decode",
            d,
            lambda: step_loads(
                d,
                [
                    load_of(s, p.address or "", range(i * per_req, (i + 1) * per_req))
                    for i, s in enumerate(sends)
                ],
            ),
        ),
    ):
        c0, t0 = loop_cpu(w), time.perf_counter()
        go()
        t1 = time.perf_counter()
        failed = drain(w, {s.req_id for s in sends}, sending=side == "prefill")
        t2 = time.perf_counter()
        c1 = loop_cpu(w)
        assert not failed, failed
        out[f"{side}_call_ms"] = (t1 - t0) * 1e3
        out[f"{side}_step_ms"] = (t2 - t0) * 1e3
        out[f"{side}_loop_cpu_ms"] = (c1 - c0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", choices=["on", "off"], required=True)
    ap.add_argument("--requests", default="1,16,64")
    ap.add_argument("--blocks-per-request", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args()
    sizes = [int(x) for x in a.requests.split(",")]
    blocks = max(sizes) * a.blocks_per_request
    p = make_worker(layers=a.layers, blocks=blocks)
    d = make_worker(layers=a.layers, blocks=blocks, listen=f"127.0.0.1:{free_port()}")
    try:
        one_step(p, d, 2, a.blocks_per_request, a.batch == "on", "warm")  # connections up
        print(
            f"batch {a.batch}: {a.layers} layers x 4 KV heads x 64 x 32 tokens, float32; "
            f"{a.blocks_per_request} blocks per request; median of {a.repeat} steps"
        )
        print("requests | side    | call ms | step ms | loop-thread CPU ms")
        for n in sizes:
            runs = [
                one_step(p, d, n, a.blocks_per_request, a.batch == "on", f"s{n}-{r}")
                for r in range(a.repeat)
            ]
            for side in ("prefill", "decode"):
                m = {
                    k: statistics.median(r[f"{side}_{k}"] for r in runs)
                    for k in ("call_ms", "step_ms", "loop_cpu_ms")
                }
                print(
                    f"{n:8d} | {side:7s} | {m['call_ms']:7.3f} | {m['step_ms']:7.2f} | "
                    f"{m['loop_cpu_ms']:7.2f}"
                )
    finally:
        p.close()
        d.close()


if __name__ == "__main__":
    main()
