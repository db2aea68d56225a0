"""``aiokv._runtime.waiter``: the one waiter per event loop, and the guarantees its docstring
states (deadline honoured and never early, spin while due soon, one timer and one fd
per loop, nothing left when idle or after the loop closed, cancellation), on asyncio
and on uvloop."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

import pytest

from aiokv._runtime import finesleep as _finesleep
from aiokv._runtime.waiter import Waiter, waiter_for


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """asyncio without its debug mode (it would slow every callback it times)."""
    return request.param


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _timerfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "timerfd" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_one_waiter_per_loop() -> None:
    w = waiter_for()
    assert waiter_for() is w and waiter_for(asyncio.get_running_loop()) is w
    other = asyncio.new_event_loop()
    try:
        assert waiter_for(other) is not w
    finally:
        other.close()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_deadline_is_honoured_and_never_early() -> None:
    w = waiter_for()
    asked_after: list[float] = []
    for timeout in (0.001, 0.004, 0.02):
        deadline = time.monotonic() + timeout

        def never(deadline: float = deadline) -> bool:
            asked_after.append(time.monotonic() - deadline)
            return False

        assert await w.wait_until(never, deadline, interval=0.0002) is False
        end = time.monotonic()
        assert end >= deadline  # never early
        assert end - deadline < 0.25  # (a loaded machine delays some wake-ups)
    # the last query of each wait is the one at or past its deadline
    assert max(asked_after) >= 0
    # a deadline already passed: asked once, not registered
    assert await w.wait_until(lambda: False, time.monotonic() - 1) is False
    assert await w.wait_until(lambda: True, time.monotonic() - 1) is True
    assert w.waiting == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_condition_is_noticed_within_a_fraction_of_a_ms_past_the_spin() -> None:
    w = waiter_for()
    late = []
    for _ in range(12):
        at = time.monotonic() + 0.003
        assert await w.wait_until(lambda at=at: time.monotonic() >= at, at + 5, interval=0.0002)
        late.append(time.monotonic() - at)
    # the loop's own 1 ms timers notice ~1 ms late; the lower quartile (loaded machine)
    assert sorted(late)[len(late) // 4] < 0.0006, sorted(late)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_it_spins_while_the_wait_is_due_soon_then_ticks() -> None:
    """During ``spin`` the query is asked on every loop pass (many per ms, no timer);
    past it, at the timer's ticks only."""
    w = waiter_for()
    asks: list[float] = []

    def never() -> bool:
        asks.append(time.monotonic())
        return False

    t0 = time.monotonic()
    task = asyncio.ensure_future(w.wait_until(never, t0 + 0.06, spin=0.02, interval=0.005))
    await asyncio.sleep(0.005)
    assert w.spinning and not w.ticking  # spinning: the loop passes ask, no timer yet
    assert await task is False
    during = [a for a in asks if a < t0 + 0.02]
    after = [a for a in asks if a >= t0 + 0.021]
    assert len(during) > 20  # every pass (a 1 ms sleep would give 20 at most)
    # 5 ms ticks for the 39 ms left: about 8 asks (slack for late wake-ups)
    assert 1 <= len(after) <= 12, len(after)
    assert not w.spinning and not w.ticking and w.waiting == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_spin_that_finds_it_resumes_the_waiter_without_a_timer() -> None:
    w = waiter_for()
    at = time.monotonic() + 0.002
    ticks = w.timer_ticks
    assert await w.wait_until(lambda: time.monotonic() >= at, at + 5, spin=0.5)
    assert time.monotonic() - at < 0.1
    assert w.timer_ticks == ticks  # found while spinning: no timer tick was needed


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_one_timer_and_one_fd_for_every_wait_of_the_loop() -> None:
    gc.collect()
    base = _timerfds()
    w = waiter_for()
    t0 = time.monotonic()
    ats = [t0 + 0.02 + 0.001 * i for i in range(16)]
    waits = [
        asyncio.ensure_future(
            w.wait_until(lambda at=at: time.monotonic() >= at, at + 5, interval=0.0005)
        )
        for at in ats
    ]
    # a backing-off wait and a fixed one with other intervals share the same timer
    waits.append(asyncio.ensure_future(w.wait_until(lambda: False, t0 + 0.03, interval=0.001)))
    waits.append(
        asyncio.ensure_future(
            w.wait_until(lambda: False, t0 + 0.03, interval=0.0002, max_interval=0.004)
        )
    )
    await asyncio.sleep(0.01)
    assert w.waiting == 18 and w.ticking
    if _finesleep.TimerFd.available():
        assert _timerfds() == base + 1
    ticks = w.timer_ticks
    got = await asyncio.gather(*waits)
    took = time.monotonic() - t0
    assert got == [True] * 16 + [False, False]
    # one wake-up per tick for all the waits, not one per wait: the smallest interval
    # is 0.2 ms only until that wait backs off
    assert w.timer_ticks - ticks <= took / 0.0002 + 2
    assert not w.ticking and w.waiting == 0 and _timerfds() == base


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_nothing_is_left_when_no_wait_is_registered() -> None:
    gc.collect()
    fds = _fds()
    w = waiter_for()
    for spin in (0.0, 0.002):
        at = time.monotonic() + 0.004
        assert await w.wait_until(lambda at=at: time.monotonic() >= at, at + 5, spin=spin)
        assert not w.ticking and not w.spinning and w.waiting == 0
        assert _fds() == fds


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_cancellation_unregisters_at_once() -> None:
    w = waiter_for()
    asked = 0

    def never() -> bool:
        nonlocal asked
        asked += 1
        return False

    for spin in (0.0, 1.0):
        t = asyncio.ensure_future(w.wait_until(never, time.monotonic() + 10, spin=spin))
        await asyncio.sleep(0.005)
        assert w.waiting == 1
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        n = asked
        assert w.waiting == 0 and not w.ticking and not w.spinning
        await asyncio.sleep(0.01)
        assert asked == n  # never asked again


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_query_error_is_raised_in_the_wait_and_unregisters_it() -> None:
    w = waiter_for()
    n = 0

    def broken() -> bool:
        nonlocal n
        n += 1
        if n > 2:
            raise RuntimeError("CUDA error: an illegal memory access")
        return False

    with pytest.raises(RuntimeError, match="illegal"):
        await w.wait_until(broken, time.monotonic() + 5)
    assert w.waiting == 0 and not w.ticking


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_intervals_back_off_to_their_maximum() -> None:
    w = waiter_for()
    asks: list[float] = []

    def never() -> bool:
        asks.append(time.monotonic())
        return False

    assert not await w.wait_until(
        never, time.monotonic() + 0.2, interval=0.0005, max_interval=0.02
    )
    # 0.5, 1, 2, 4, 8, 16, 20, 20 ... ms: about 15 asks in 0.2 s, not 400
    assert 6 <= len(asks) <= 25, len(asks)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_without_timerfd_the_ticks_are_the_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_finesleep, "_LIBC", None)
    w = Waiter(asyncio.get_running_loop())  # (not the loop's: its timer may be running)
    at = time.monotonic() + 0.01
    t0 = time.monotonic()
    assert await w.wait_until(lambda: time.monotonic() >= at, at + 5, interval=0.0002)
    assert w.timer_ticks >= 1 and time.monotonic() - t0 < 1
    assert await w.wait_until(lambda: False, time.monotonic() + 0.005) is False
    assert not w.ticking


@pytest.mark.timeout(30)
@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_a_loop_closed_with_waits_registered_leaves_no_fd(uvloop: bool) -> None:
    gc.collect()
    fds = _fds()

    def make() -> asyncio.AbstractEventLoop:
        if uvloop:
            import uvloop as uv

            return uv.new_event_loop()
        return asyncio.new_event_loop()

    left: list[asyncio.Future[bool]] = []

    async def main() -> None:
        w = waiter_for()
        left.append(asyncio.ensure_future(w.wait_until(lambda: False, time.monotonic() + 60)))
        await asyncio.sleep(0.01)
        assert w.ticking

    loop = make()
    loop.run_until_complete(main())  # returns with the wait still registered
    loop.close()
    assert not left[0].done()
    del loop
    left.clear()
    for _ in range(3):
        gc.collect()
    assert _fds() == fds
    closed = asyncio.new_event_loop()
    closed.close()
    assert waiter_for(closed) is not waiter_for(closed)  # a closed loop's is never kept


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_no_timer_ticks_while_every_wait_spins() -> None:
    """A wait past its spin starts the timer; once it ended, a wait that still spins
    (the IPC consumer's doorbell poll while requests wait) must not keep the timer
    ticking: each tick woke the spinning loop for nothing and cost it a quarter of its
    passes. The timer comes back for the next wait past its spin."""
    w = waiter_for()
    done = False
    entry = w.add(lambda now: done, interval=0.001, spin=10.0)
    try:
        assert not await w.wait_until(lambda: False, time.monotonic() + 0.003, interval=0.0002)
        assert w.spinning and not w.ticking
        ticks = w.timer_ticks
        await asyncio.sleep(0.02)
        assert w.timer_ticks - ticks <= 1, w.timer_ticks - ticks  # (one expiry in flight)
        # the next wait past its spin is asked at the timer's ticks again
        asks: list[float] = []

        def never() -> bool:
            asks.append(time.monotonic())
            return False

        ticks = w.timer_ticks
        assert not await w.wait_until(never, time.monotonic() + 0.01, interval=0.001)
        assert w.timer_ticks - ticks >= 5 and len(asks) >= 5
    finally:
        done = True
        w.discard(entry)
    assert not w.ticking and not w.spinning and w.waiting == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_spin_pass_costs_the_same_with_many_waits_past_their_spin() -> None:
    """A spin pass asks the spinning waits only: with 400 waits past their spin (not
    due) it walked all of them twice, ~40 us a pass on a 2-core VM against ~1 us.
    Loop passes are counted with and without them (best of 3 each, interleaved)."""
    loop = asyncio.get_running_loop()
    w = waiter_for()
    stop = False
    entry = w.add(lambda now: stop, interval=0.001, spin=30.0)

    async def passes_per_s() -> float:
        n = 0
        on = True

        def count() -> None:
            nonlocal n
            n += 1
            if on:
                loop.call_soon(count)

        loop.call_soon(count)
        t0 = time.perf_counter()
        await asyncio.sleep(0.03)
        on = False
        return n / (time.perf_counter() - t0)

    bare: list[float] = []
    crowded: list[float] = []
    try:
        for _ in range(3):
            bare.append(await passes_per_s())
            waits = [
                asyncio.ensure_future(
                    w.wait_until(lambda: stop, time.monotonic() + 30, interval=5.0)
                )
                for _ in range(400)
            ]
            await asyncio.sleep(0.005)
            crowded.append(await passes_per_s())
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
    finally:
        stop = True
        w.discard(entry)
    assert max(crowded) > max(bare) / 4, (bare, crowded)
