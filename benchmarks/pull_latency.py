"""Pull mode's latency on CPU: two engines and connectors in one process (loopback TCP),
a producer's ``serve_request`` answered by a consumer's ``fetch_request`` of 3 blocks,
one request at a time; prints the median and p90 of the consumer's fetch.

    python benchmarks/pull_latency.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _kvutil import filled, make_layout  # noqa: E402

from aiokv import Engine, EngineConfig  # noqa: E402
from aiokv.kv import KVConnector  # noqa: E402


async def run(n: int) -> list[float]:
    lay = make_layout("fa", "float16", num_blocks=64)
    p, c = filled(lay, 1), filled(lay, 2)
    async with Engine(EngineConfig()) as a, Engine(EngineConfig()) as b:
        prod, cons = KVConnector(a, lay, p), KVConnector(b, lay, c)
        await b.connect(a.address)
        await a.connect(b.address)
        out = []
        for i in range(n):
            serving = asyncio.ensure_future(prod.serve_request(f"r{i}", [1, 2, 3], timeout=10))
            await asyncio.sleep(0.001)  # the producer answered; the consumer comes later
            t0 = time.perf_counter()
            await cons.fetch_request(f"r{i}", [4, 5, 6], frm=a.address, timeout=10)
            out.append(time.perf_counter() - t0)
            await serving
    return out[n // 6 :]  # the first ones warm up


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    s = sorted(asyncio.run(run(args.requests)))
    print(f"fetch p50 {statistics.median(s) * 1e3:.3f} ms  p90 {s[int(0.9 * len(s))] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
