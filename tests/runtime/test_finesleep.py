"""``aiokv._runtime.finesleep``: ``TimerFd`` (a timerfd the loop watches) and ``FinePoll``
(one ticking task for many waits), and the IPC plane's event waits past their spin
that use them: an event is noticed within a fraction of a millisecond, where the
loop's own sleeps (whole milliseconds) noticed it ~1 ms late."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import time
from typing import Any

import pytest
from support.fakeevents import _FiresAt

from aiokv import EngineClosedError
from aiokv._runtime import finesleep as _finesleep
from aiokv._runtime.finesleep import TimerFd
from aiokv._runtime.waiter import FinePoll
from aiokv.kv import IpcOptions


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """asyncio without its debug mode (the suite's default): debug mode records a
    traceback for every future and task, which these timings would measure."""
    return request.param


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_timerfd_ticks_are_short_and_never_early() -> None:
    timer = TimerFd.open(asyncio.get_running_loop())
    assert timer is not None
    ticks: list[float] = []
    t0 = time.perf_counter()
    timer.every(0.0003, lambda: ticks.append(time.perf_counter()))
    while len(ticks) < 40:
        await asyncio.sleep(0.001)
    timer.close()
    # the k-th call comes after the k-th expiry at the earliest (the timer's clock is
    # perf_counter's: CLOCK_MONOTONIC; expiries the loop was late for come as one call)
    assert all(t - t0 >= 0.0003 * (k + 1) for k, t in enumerate(ticks)), ticks
    # asyncio's own sleep(0.0003) takes 1 ms here (epoll's timeout in whole ms); the
    # lower quartile, as a loaded machine delays some wake-ups
    gaps = sorted(b - a for a, b in itertools.pairwise(ticks))
    assert gaps[len(gaps) // 4] < 0.0008, gaps


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_closed_timer_ticks_no_more_and_leaves_no_fd() -> None:
    gc.collect()
    fds = _fds()
    timer = TimerFd.open(asyncio.get_running_loop())
    assert timer is not None
    ticks: list[float] = []
    timer.every(0.0005, lambda: ticks.append(time.perf_counter()))
    await asyncio.sleep(0.01)
    assert ticks
    timer.close()
    n = len(ticks)
    await asyncio.sleep(0.02)
    assert len(ticks) == n and _fds() == fds


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_without_timerfd_the_ticks_are_the_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_finesleep, "_LIBC", None)
    assert TimerFd.open(asyncio.get_running_loop()) is None
    fp = FinePoll(0.0002)
    at = time.perf_counter() + 0.01
    assert await fp.wait(lambda: time.perf_counter() >= at, 5.0)
    assert fp.ticks >= 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_poll_task_closes_its_timer_when_nothing_waits() -> None:
    gc.collect()
    fds = _fds()
    fp = FinePoll(0.0002)
    for _ in range(3):
        at = time.perf_counter() + 0.003
        assert await fp.wait(lambda at=at: time.perf_counter() >= at, 5.0)
        await asyncio.sleep(0.01)
        assert not fp.ticking and _fds() == fds


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_many_waits_share_one_tick() -> None:
    fp = FinePoll(0.0005)
    t0 = time.perf_counter()
    ats = [t0 + 0.02 + 0.002 * i for i in range(20)]
    got = await asyncio.gather(*(fp.wait(_FiresAt(at).query, 5.0) for at in ats))
    took = time.perf_counter() - t0
    assert got == [True] * 20 and fp.waiting == 0
    # one tick per interval for all twenty waits (at most), not one per wait
    assert fp.ticks <= took / 0.0005 + 2, (fp.ticks, took)
    await asyncio.sleep(0.01)
    assert not fp.ticking  # nothing waits: the timer is closed


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_wait_that_gives_up_leaves_nothing_registered() -> None:
    fp = FinePoll(0.0002)
    asked = 0

    def never() -> bool:
        nonlocal asked
        asked += 1
        return False

    assert await fp.wait(never, 0.01) is False  # a dead peer's event
    n = asked
    t = asyncio.ensure_future(fp.wait(never, 10.0))
    await asyncio.sleep(0.005)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    n = asked
    await asyncio.sleep(0.01)
    assert asked == n and fp.waiting == 0  # not asked any more

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal"):
        await fp.wait(broken, 5.0)
    await fp.aclose()


@pytest.mark.parametrize("bad", [0, -1, 0.02, "0.001", None])
def test_event_poll_s_is_checked(bad: Any) -> None:
    with pytest.raises(Exception, match="event_poll_s"):
        IpcOptions(event_poll_s=bad)
    assert IpcOptions(event_poll_s=0.001).event_poll_s == 0.001


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_timer_that_fails_hands_the_ticks_to_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    real = TimerFd._set

    def flaky(self: TimerFd, ns: int, every_ns: int = 0) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # (the second wait's timer)
            raise OSError(22, "timerfd_settime failed")
        real(self, ns, every_ns)

    monkeypatch.setattr(TimerFd, "_set", flaky)
    gc.collect()
    fds = _fds()
    fp = FinePoll(0.0002)
    for _ in range(3):  # a timerfd, then the loop's timer, then a timerfd again
        at = time.perf_counter() + 0.02
        n = fp.ticks
        assert await fp.wait(lambda at=at: time.perf_counter() >= at, 5.0)
        assert fp.ticks > n
        await asyncio.sleep(0.01)
        assert not fp.ticking and _fds() == fds
    assert calls == 3


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_waiter_resumes_in_the_pass_after_the_tick() -> None:
    """The queries run in the tick's own callback and set the wait's future there, so
    the waiting task resumes in the next loop pass. (Resuming a poll
    task first and waking the waiter through a second future costs two passes:
    0.28 ms late on an H200 host, against 0.12 with a timer per wait.)"""
    loop = asyncio.get_running_loop()
    fp = FinePoll(0.0002)
    at = time.perf_counter() + 0.003
    seen: list[str] = []

    def pass_after() -> None:
        seen.append("pass 1")
        loop.call_soon(seen.append, "pass 2")

    def query() -> bool:
        if time.perf_counter() < at:
            return False
        loop.call_soon(pass_after)  # (runs in the pass after this query's)
        return True

    assert await fp.wait(query, 5.0)
    assert seen == ["pass 1"]
    await asyncio.sleep(0)
    assert seen == ["pass 1", "pass 2"]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_deadlines_end_waits_at_the_ticks() -> None:
    fp = FinePoll(0.0002)
    t0 = time.monotonic()
    got = await asyncio.gather(fp.wait(lambda: False, 0.01), fp.wait(lambda: False, 0.03))
    took = time.monotonic() - t0
    assert got == [False, False] and 0.03 <= took < 0.5
    assert await fp.wait(lambda: True, 0.0) is False  # nothing left: not even asked
    assert not fp.ticking


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_closing_fails_the_waits_left() -> None:
    fp = FinePoll(0.0002)
    t = asyncio.ensure_future(fp.wait(lambda: False, 10.0))
    await asyncio.sleep(0.005)
    await fp.aclose(EngineClosedError("closed"))
    t0 = time.monotonic()
    with pytest.raises(EngineClosedError):
        await t
    assert time.monotonic() - t0 < 1.0 and fp.waiting == 0
