"""First-request TTFT of the demo against its steady TTFT (no-cold-start check).

    python benchmarks/demo_ttft.py --runs 8            # CPU demo, 16 prompts, one at a time

Runs ``python -m aiokv.serving.demo.run --prompts 16 --max-tokens 4 --device cpu
--concurrency 1`` (each run starts router and workers afresh), reads the TTFT
column of its table and prints, per run, the first request's TTFT, the steady
TTFT (median of requests 2..16) and their ratio, then the medians over runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

_ROW = re.compile(r"│\s+\d+\s+│\s+\d+\s+│.*?│\s+([\d.]+)\s+│")


def one_run(device: str, prompts: int) -> tuple[float, float]:
    argv = ["--prompts", str(prompts), "--max-tokens", "4", "--device", device]
    out = subprocess.run(
        [sys.executable, "-m", "aiokv.serving.demo.run", *argv, "--concurrency", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    ttfts = [float(m.group(1)) for line in out.splitlines() if (m := _ROW.match(line))]
    if len(ttfts) != prompts:
        raise SystemExit(f"could not read {prompts} TTFTs from the demo's output:\n{out}")
    return ttfts[0], statistics.median(ttfts[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    ratios, firsts, steadies = [], [], []
    for i in range(a.runs):
        first, steady = one_run(a.device, a.prompts)
        firsts.append(first)
        steadies.append(steady)
        ratios.append(first / steady)
        print(
            f"run {i + 1}: first {first:.1f} ms, steady {steady:.1f} ms, ratio {first / steady:.2f}"
        )
    print(
        f"median over {a.runs} runs: first {statistics.median(firsts):.1f} ms, steady "
        f"{statistics.median(steadies):.1f} ms, ratio {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}; {sum(r <= 2 for r in ratios)}/{a.runs} "
        "within 2x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
