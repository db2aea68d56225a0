"""What the IPC plane's event waits past their spin cost the host, and how late they
notice: FinePoll (one timerfd tick per interval for all waits) against the loop's own
1 ms sleep, one process, no GPU (the events are clocks).

    python3 benchmarks/fine_poll_cost.py [--uvloop]

Prints, per variant and number of concurrent waits: the CPU time of the process while
the waits last (as % of one core), the loop wake-ups per second, and the median time
from each condition turning true to its wait's end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from aiokv._runtime.waiter import FinePoll


async def _run(kind: str, n_waits: int, interval: float, dur: float = 1.0) -> str:
    fp = FinePoll(interval)
    rng = random.Random(n_waits)
    late: list[float] = []

    async def one(i: int) -> None:
        end = time.perf_counter() + dur
        while True:
            at = time.perf_counter() + 0.003 + rng.random() * 0.001  # (any phase)
            if at > end:
                return
            if kind == "fine":
                await fp.wait(lambda at=at: time.perf_counter() >= at, 5.0)
            else:
                while time.perf_counter() < at:
                    await asyncio.sleep(0.001)
            late.append(time.perf_counter() - at)

    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n_waits)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    wakes = fp.ticks / wall if kind == "fine" else float("nan")
    return (
        f"{kind:>10} {interval * 1e3:4.1f} ms  waits {n_waits:3d}  cpu {cpu / wall * 100:5.1f}% "
        f"of a core  ticks/s {wakes:7.0f}  late p50 {statistics.median(late) * 1e3:.3f} ms"
    )


async def main() -> None:
    for n in (1, 16):
        print(await _run("fine", n, 0.0002))
        print(await _run("fine", n, 0.0005))
        print(await _run("loop-sleep", n, 0.001))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uvloop", action="store_true")
    if ap.parse_args().uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
