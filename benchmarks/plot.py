"""Plot the recorded GPU benchmark figures (docs/gpu-runs/) to docs/img/*.png.

    pip install matplotlib && python benchmarks/plot.py

Reads only recorded output; nothing is re-measured here. Sources: device run 5
of session 9 (s9r5: the receive-batch caps of session 9, default enqueues),
runs 3 and 4 of session 8 (s8r3: default non-blocking NCCL enqueues, s8r4:
blocking enqueues and the traced 256-token latency) and run 10 of the session
before, all on 2x H200.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "gpu-runs"
OUT = ROOT / "docs" / "img"


def lines(name: str) -> list[dict[str, object]]:
    out = []
    for line in (RUNS / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def nccl_plot() -> None:
    s8r3 = [
        r for r in lines("s8r3-bench-nccl.jsonl") if r["transport"] == "nccl" and r["window"] == 16
    ]
    s8r4 = [
        r for r in lines("s8r4-bench-nccl.jsonl") if r["blocking_ops"] == 1 and r["window"] == 16
    ]
    s9r5 = [
        r for r in lines("s9r5-bench-nccl.jsonl") if r["blocking_ops"] == 0 and r["window"] == 16
    ]
    old = lines("run10-bench-nccl.jsonl")
    fig, ax = plt.subplots(figsize=(6.8, 4.2))

    def series(rows: list[dict[str, object]], key: str, style: str, label: str) -> None:
        ax.plot([float(r["size_mib"]) for r in rows], [r[key] for r in rows], style, label=label)  # type: ignore[arg-type]

    series(s8r3, "raw_gbps", "o-", "raw NCCL send/recv (s8r3)")
    series(s9r5, "aiokv_gbps", "D-", "aiokv, session 9 receive batches (s9r5)")
    series(s8r3, "aiokv_gbps", "s--", "aiokv, session 8 (s8r3)")
    series(s8r4, "aiokv_gbps", "^:", "aiokv, session 8, blocking enqueues (s8r4)")
    series(old, "aiokv_gbps", "x:", "aiokv, session 7 (run 10)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB), 16 sends in flight")
    ax.set_ylabel("GB/s")
    ax.set_title("NCCL transport, cuda:0 → cuda:1 (2x H200, NVLink)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "nccl_by_size.png", dpi=110)


def kv_plot() -> None:
    rows = [("short", lines("s8r3-kv.jsonl")[0]), ("long", lines("s8r3-kv.jsonl")[1])]
    blk = {str(r["workload"]): r for r in lines("s8r4-kv.jsonl") if r["blocking_ops"] == 1}
    x = range(len(rows))
    w = 0.27
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    ax.bar(
        [i - w for i in x],
        [r["raw_gbps"] for _, r in rows],
        w,
        label="raw NCCL, one message per request",
    )
    ax.bar(
        [i for i in x],
        [r["aiokv_gbps"] for _, r in rows],
        w,
        label="aiokv KVConnector, non-blocking enqueues",
    )
    ax.bar(
        [i + w for i in x],
        [blk[n]["aiokv_gbps"] for n, _ in rows],
        w,
        label="aiokv KVConnector, blocking enqueues",
    )
    ax.set_xticks(
        list(x), [f"{n}\n(ratio {r['ratio']:.2f} / {blk[n]['ratio']:.2f})" for n, r in rows]
    )
    ax.set_ylabel("GB/s landed in the consumer's paged cache")
    ax.set_title("KV workloads (Llama-3-8B geometry), 2x H200")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "kv_by_workload.png", dpi=110)


def latency_plot() -> None:
    """Where one 256-token KV request's transfer spends its time (AIOKV_TRACE medians)."""
    text = (RUNS / "s8r4-traces.txt").read_text()
    modes: dict[str, dict[str, float]] = {}
    current = ""
    for line in text.splitlines():
        m = re.match(r"== .*blocking_ops=(\d)", line)
        if m:
            current = "blocking" if m.group(1) == "1" else "non-blocking (default)"
            modes[current] = {}
            continue
        m = re.match(r"(\S+->\S+)\s+median\s+([\d.]+)", line)
        if m and current:
            modes[current][m.group(1)] = float(m.group(2))
    hops = [
        ("start->reserve", "RESERVE hop"),
        ("reserve->granted", "server grants"),
        ("granted->grant", "GRANT hop"),
        ("grant->posted", "client posts (NCCL enqueue)"),
        ("posted->landed", "data + completion"),
        ("landed->done", "DONE hop"),
    ]
    fig, ax = plt.subplots(figsize=(6.8, 3.4))
    names = list(modes)
    left = [0.0] * len(names)
    for key, label in hops:
        vals = [modes[n].get(key, 0.0) for n in names]
        ax.barh(names, vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("µs (medians of 50 one-at-a-time 256-token requests)")
    ax.set_title("One KV transfer, step by step (AIOKV_TRACE, 2x H200)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.28))
    fig.tight_layout()
    fig.savefig(OUT / "kv_latency_steps.png", dpi=110)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    nccl_plot()
    kv_plot()
    latency_plot()


if __name__ == "__main__":
    main()
