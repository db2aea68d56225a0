"""Join the AIOKV_TRACE files of a sender and a receiver and report where time goes.

    AIOKV_TRACE=/tmp/t python -m aiokv bench transport ...   # or any two-process run
    python benchmarks/trace_report.py /tmp/t.*.json [--json]

For every transfer seen by both ends it takes the steps (see aiokv/_runtime/trace.py)
and prints, per hop, the median and p90 in microseconds, plus how many
transfers each end had in flight on average. Both processes must have run on
one host (perf_counter is CLOCK_MONOTONIC there, shared by processes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

HOPS = [
    ("start", "reserve", "RESERVE: client queued -> server got it"),
    ("reserve", "granted", "server: RESERVE -> GRANT queued (budget, posting the receive)"),
    ("granted", "grant", "GRANT: server queued -> client got it"),
    ("grant", "posted", "client: GRANT -> data posted"),
    ("start", "posted", "client: transfer started -> data posted (v2: credit spent)"),
    ("posted", "landed", "data: posted -> complete at the server (wire + completion seen)"),
    ("landed", "done", "DONE: server landed -> client got it"),
    ("start", "done", "whole transfer, client's view"),
]


def load(paths: list[str]) -> dict[tuple[str, int], dict[str, float]]:
    steps: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for p in paths:
        with open(p) as fh:
            for step, session, xfer, t in json.load(fh)["events"]:
                steps[(session, xfer)].setdefault(step, t)
    return steps


def report(steps: dict[tuple[str, int], dict[str, float]]) -> list[dict[str, object]]:
    rows = []
    for a, b, what in HOPS:
        d = [(s[b] - s[a]) * 1e6 for s in steps.values() if a in s and b in s]
        if not d:
            continue
        d.sort()
        rows.append(
            {
                "hop": f"{a}->{b}",
                "what": what,
                "n": len(d),
                "median_us": round(statistics.median(d), 1),
                "p90_us": round(d[int(0.9 * (len(d) - 1))], 1),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--last", type=int, default=0, help="only the last N transfers (by start time)")
    ap.add_argument(
        "--first", type=int, default=0, help="only the first N transfers (by start time)"
    )
    args = ap.parse_args(argv)
    steps = load(args.files)
    order = sorted((k for k in steps if "start" in steps[k]), key=lambda k: steps[k]["start"])
    if args.last:
        order = order[-args.last :]
    if args.first:
        order = order[: args.first]
    if args.last or args.first:
        steps = {k: steps[k] for k in order}
    rows = report(steps)
    spans = [(v["start"], v["done"]) for v in steps.values() if "start" in v and "done" in v]
    if spans:
        busy = sum(b - a for a, b in spans)
        span = max(b for _, b in spans) - min(a for a, _ in spans)
        rows.append(
            {
                "hop": "overlap",
                "what": "transfers in flight on average (sum of transfer times / span of the trace)",
                "n": len(spans),
                "median_us": round(busy / span, 2) if span > 0 else 0.0,
                "p90_us": round(span * 1e6, 1),
            }
        )
    for r in rows:
        if args.json:
            print(json.dumps(r))
        elif r["hop"] == "overlap":
            print(
                f"{'overlap':<18} {r['median_us']} transfers in flight on average over {r['p90_us']} us, n={r['n']}"
            )
        else:
            print(
                f"{r['hop']:<18} median {r['median_us']:>9} us  p90 {r['p90_us']:>9} us  n={r['n']:<6} {r['what']}"
            )
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
