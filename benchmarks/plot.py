"""Plot the recorded GPU benchmark figures (docs/gpu-runs/*.jsonl) to docs/img/*.png.

    pip install matplotlib && python benchmarks/plot.py

Reads only recorded JSON lines; nothing is re-measured here.
"""

from __future__ import annotations

import json
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


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    nccl = lines("run10-bench-nccl.jsonl")
    sizes = [float(r["size_mib"]) for r in nccl]  # type: ignore[arg-type]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(sizes, [r["raw_gbps"] for r in nccl], "o-", label="raw NCCL send/recv (same run)")
    ax.plot(
        sizes, [r["aiokv_gbps"] for r in nccl], "s-", label="aiokv Engine.send_nowait, window 16"
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("NCCL transport, cuda:0 → cuda:1 (2x H200, NVLink), 2026-11-30")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "nccl_by_size.png", dpi=110)

    kv = lines("run10-kv-short.jsonl") + lines("run10-kv-long.jsonl")
    names = [str(r["workload"]) for r in kv]
    x = range(len(kv))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    w = 0.38
    ax.bar(
        [i - w / 2 for i in x],
        [r["raw_gbps"] for r in kv],
        w,
        label="raw NCCL, one message per request",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r["aiokv_gbps"] for r in kv],
        w,
        label="aiokv KVConnector (gather → send → scatter)",
    )
    ax.set_xticks(list(x), [f"{n}\n(ratio {r['ratio']:.2f})" for n, r in zip(names, kv)])
    ax.set_ylabel("GB/s landed in the consumer's paged cache")
    ax.set_title("KV workloads (Llama-3-8B geometry), 2x H200, 2026-11-30")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "kv_by_workload.png", dpi=110)


if __name__ == "__main__":
    main()
