"""Print the JSON lines of the device scripts' benchmark runs, one summary per run.

    ... | tee "$OUT/$TAG-ipc.jsonl" | python3 benchmarks/show_runs.py kv
    ... | tee "$OUT/$TAG-control.jsonl" | python3 benchmarks/show_runs.py control

``kv``: ``aiokv.kv.bench --json`` lines (with the labels the scripts add: ``tree``,
``gap``, ``loop``, ``spin_ms``), their stage trace when there is one. ``control``:
``aiokv bench control --json`` lines. A line that is not JSON is echoed (an error).
"""

from __future__ import annotations

import json
import sys
from typing import Any

LABELS = ("tree", "loop", "spin_ms")


def kv(r: dict[str, Any]) -> str:
    out = [str(r[k]) for k in LABELS if k in r]
    out += [str(r.get("workload")), "gap" if r.get("gap") else ""]
    out += ["GB/s", str(r.get("aiokv_gbps"))]
    if "raw_gbps" in r:
        out += ["raw", str(r["raw_gbps"])]
    out += ["p50", str(r.get("p50_ms")), "p99", str(r.get("p99_ms")), "ok", str(r.get("ok"))]
    out.append(str(r.get("error", "")))
    line = " ".join(x for x in out if x)
    if r.get("trace_ms"):
        line += f"\n    {r['trace_ms']}"
    return line


def control(r: dict[str, Any]) -> str:
    return " ".join(
        str(x)
        for x in (
            r.get("tree"), r.get("workload"), "raw", r.get("raw"), "engine", r.get("engine"),
            "ratio", r.get("ratio"),
        )
    )  # fmt: skip


def main() -> int:
    fmt = {"kv": kv, "control": control}[sys.argv[1]]
    for line in sys.stdin:
        try:
            r = json.loads(line)
        except ValueError:
            print(line[:300].rstrip())
            continue
        print(fmt(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
