"""The loop watchdog: a loop stuck while NCCL work is queued is reported, with where it is.

The stuck loop is simulated with ``time.sleep`` on the loop thread (on a GPU it
is a first kernel launch waiting for queued NCCL work); the queued work is a
fake event that never fires.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import aiokv
from aiokv._runtime.watchdog import LoopWatchdog

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def _stuck_in_a_cuda_call(seconds: float) -> None:
    time.sleep(seconds)  # stands for the loop thread blocked inside a C call


async def test_fires_once_per_stall_with_work_queued_and_rearms() -> None:
    calls: list[str] = []
    queued = [1]
    wd = LoopWatchdog(
        asyncio.get_running_loop(),
        limit=0.3,
        pending=lambda: queued[0],
        report=calls.append,
        beat_s=0.05,
    )
    try:
        await asyncio.sleep(0.5)  # a live loop: nothing happens
        assert calls == []
        _stuck_in_a_cuda_call(1.0)
        assert len(calls) == 1  # once, though stuck for three limits
        assert "stuck for" in calls[0] and "1 NCCL operation" in calls[0]
        assert "_stuck_in_a_cuda_call" in calls[0]  # where the loop thread is
        await asyncio.sleep(0.3)  # the loop ran again: armed again
        _stuck_in_a_cuda_call(0.6)
        assert len(calls) == 2 and wd.fired == 2
        await asyncio.sleep(0.2)
        queued[0] = 0  # nothing queued: a slow callback is not the watchdog's business
        _stuck_in_a_cuda_call(0.6)
        assert len(calls) == 2
    finally:
        wd.stop()


async def test_stopped_watchdog_does_nothing() -> None:
    calls: list[str] = []
    wd = LoopWatchdog(
        asyncio.get_running_loop(), limit=0.2, pending=lambda: 1, report=calls.append, beat_s=0.05
    )
    wd.stop()
    _stuck_in_a_cuda_call(0.5)
    assert calls == []


class _NeverFires:
    def query(self) -> bool:
        return False


async def test_engine_logs_where_its_loop_is_stuck_with_nccl_work_queued(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = aiokv.EngineConfig(listen="127.0.0.1:0", timeouts=aiokv.Timeouts(nccl_watchdog=0.3))
    async with aiokv.Engine(cfg) as eng:
        poller = eng._get_poller()  # what the first NCCL session does; starts the watchdog
        fut = poller.wait(_NeverFires())  # a receive whose data never comes
        with caplog.at_level(logging.ERROR, logger="aiokv"):
            _stuck_in_a_cuda_call(1.0)
        msgs = [r.getMessage() for r in caplog.records if r.name == "aiokv"]
        assert len(msgs) == 1
        assert "stuck for" in msgs[0] and "_stuck_in_a_cuda_call" in msgs[0]
        assert "CUDA_MODULE_LOADING=EAGER" in msgs[0]
        assert eng.statistics().nccl["watchdog_fired"] == 1
        fut.cancel()
    # closing stopped it: a stuck loop now goes unreported
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="aiokv"):
        _stuck_in_a_cuda_call(0.6)
    assert not [r for r in caplog.records if "stuck for" in r.getMessage()]


def test_timeouts_validate_the_watchdog_limit() -> None:
    with pytest.raises(aiokv.ConfigError, match="nccl_watchdog"):
        aiokv.Timeouts(nccl_watchdog=0)


def test_thread_ends_with_its_loop_even_if_never_stopped() -> None:
    loop = asyncio.new_event_loop()
    wd = LoopWatchdog(loop, limit=0.1, pending=lambda: 1, report=lambda _w: None, beat_s=0.02)
    loop.close()
    wd._thread.join(2.0)
    assert not wd._thread.is_alive() and wd.fired == 0
