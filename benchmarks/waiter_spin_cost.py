"""What the loop's waiter costs a loop that spins (the IPC consumer's doorbell poll
while requests wait), one process, no GPU: loop passes per second with a poll that
spins -- a task of its own (``sleep(0)``) against a poll of the waiter -- beside N
waits past their spin (0.2 ms ticks, never true) and K tasks spinning too; and with
the poll spinning alone after a wait past its spin ended (the waiter's timer ticking
on, or not).

    python3 benchmarks/waiter_spin_cost.py [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiokv._runtime.waiter import waiter_for


async def _passes(mode: str, n_waits: int, k_spin: int, after_wait: bool) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    w = waiter_for()
    stop = False
    passes = 0

    def count() -> None:
        nonlocal passes
        passes += 1
        if not stop:
            loop.call_soon(count)

    async def spin_task() -> None:
        while not stop:
            await asyncio.sleep(0)

    waits = [
        asyncio.ensure_future(w.wait_until(lambda: stop, time.monotonic() + 30, interval=0.0002))
        for _ in range(n_waits)
    ]
    poll = asyncio.ensure_future(spin_task()) if mode == "task" else None
    entry = w.add(lambda now: stop, interval=0.001, spin=30.0) if mode == "waiter" else None
    spinners = [asyncio.ensure_future(spin_task()) for _ in range(k_spin)]
    if after_wait:  # a wait past its spin that ends: its timer starts, then has nothing to ask
        await w.wait_until(lambda: False, time.monotonic() + 0.001, interval=0.0002)
    await asyncio.sleep(0.02)
    loop.call_soon(count)
    t0, p0, tt0 = time.perf_counter(), passes, w.timer_ticks
    await asyncio.sleep(0.5)
    dt = time.perf_counter() - t0
    rate, ticks = (passes - p0) / dt, (w.timer_ticks - tt0) / dt
    stop = True
    await asyncio.gather(*waits, *spinners, *([poll] if poll is not None else []))
    if entry is not None:
        w.discard(entry)
    await asyncio.sleep(0.01)
    return rate, ticks


async def _main() -> None:
    for n, k in ((0, 0), (16, 0), (16, 8)):
        row = []
        for mode in ("task", "waiter"):
            rate, _ = max([await _passes(mode, n, k, False) for _ in range(3)])
            row.append(f"{mode} {1e6 / rate:5.2f} us/pass")
        print(f"N={n:2d} waits past their spin, K={k} spinning tasks: " + ", ".join(row))
    rate, ticks = max([await _passes("waiter", 0, 0, True) for _ in range(3)])
    print(
        f"waiter poll spinning alone after a wait past its spin ended: {1e6 / rate:5.2f} "
        f"us/pass, {ticks:.0f} timer ticks/s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--uvloop", action="store_true")
    if ap.parse_args().uvloop:
        import uvloop

        uvloop.run(_main())
    else:
        asyncio.run(_main())


if __name__ == "__main__":
    main()
