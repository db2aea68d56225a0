"""The event waker (aiokv.kv._gpuwake) on a real GPU: a CUDA event that fires
milliseconds after the wait began (past the IPC plane's spin) is noticed within a
fraction of a millisecond -- against up to 1 ms (0.5 on average) with a query per
millisecond, the way the plane waited before -- and an event that never fires within
the wait leaves the waker working for the next one."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

from aiokv.kv._cudrv import driver
from aiokv.kv._gpuwake import EventWaker
from aiokv.kv.bench import _cycles_per_us

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


async def _lateness(wait: object, n: int, gpu_ms: float) -> list[float]:
    """ms from each event's firing (estimated: host clock before queuing + its GPU
    duration, never after the real firing) to the wait's end."""
    cycles = int(gpu_ms * 1e3 * _cycles_per_us(torch))
    out = []
    for _ in range(n):
        e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        assert await wait(e1)  # type: ignore[operator]
        t1 = time.perf_counter()
        assert e1.query()
        out.append((t1 - t0) * 1e3 - e0.elapsed_time(e1))
        await asyncio.sleep(0.003)
    return out


def test_a_late_event_is_noticed_within_a_fraction_of_a_millisecond() -> None:
    torch.cuda.init()
    w = EventWaker.create(driver())
    assert w is not None

    async def by_waker(ev: torch.cuda.Event) -> bool:
        return await w.wait(int(ev.cuda_event), ev.query, 5.0)

    async def by_polling(ev: torch.cuda.Event) -> bool:  # the plane before the waker
        while not ev.query():
            await asyncio.sleep(0.001)
        return True

    async def main() -> tuple[list[float], list[float]]:
        torch.cuda.synchronize()
        woke = await _lateness(by_waker, 25, 4.0)
        polled = await _lateness(by_polling, 25, 4.0)
        return woke, polled

    woke, polled = asyncio.run(main())
    med_w, med_p = statistics.median(woke), statistics.median(polled)
    print(f"late by (ms, median of 25): waker {med_w:.3f}, polling each ms {med_p:.3f}")
    s = w.statistics()
    assert s.woken >= 20 and s.pending == 0, s
    assert s.streams <= 2, s  # one stream, serving again and again
    assert med_w < 0.3, (woke, polled)
    w.close()


def test_an_event_that_does_not_fire_in_time_leaves_the_waker_working() -> None:
    torch.cuda.init()
    w = EventWaker.create(driver())
    assert w is not None
    cycles = int(200e3 * _cycles_per_us(torch))  # 200 ms

    async def main() -> None:
        ev = torch.cuda.Event()
        torch.cuda._sleep(cycles)
        ev.record()
        assert not await w.wait(int(ev.cuda_event), ev.query, 0.02)
        assert w.statistics().pending == 1  # its stream waits on: not reused
        ev2 = torch.cuda.Event()
        ev2.record()  # (behind the 200 ms on this stream; the waker's own is free)
        assert await w.wait(int(ev2.cuda_event), ev2.query, 5.0)
        for _ in range(500):
            if w.statistics().pending == 0:
                break
            await asyncio.sleep(0.002)
        s = w.statistics()
        assert s.pending == 0 and s.streams == 2, s
        w.close()

    asyncio.run(main())
