"""The loop watchdog: a loop stuck while NCCL work is queued gets its communicators aborted.

The stuck loop is simulated with ``time.sleep`` on the loop thread (on a GPU it
is a CUDA call waiting for queued NCCL kernels); the communicators are fakes
that record ``abort()``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import aiokv
from aiokv._watchdog import LoopWatchdog

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
        abort=calls.append,
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
        asyncio.get_running_loop(), limit=0.2, pending=lambda: 1, abort=calls.append, beat_s=0.05
    )
    wd.stop()
    _stuck_in_a_cuda_call(0.5)
    assert calls == []


class _NeverFires:
    def query(self) -> bool:
        return False


class _FakeComm:
    settles = 0
    settle_s = 0.0
    settle_max_s = 0.0

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def async_error(self) -> int:
        return 5 if self.aborted else 0


async def test_engine_aborts_its_communicators_when_its_loop_is_stuck(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = aiokv.EngineConfig(listen="127.0.0.1:0", timeouts=aiokv.Timeouts(nccl_watchdog=0.3))
    async with aiokv.Engine(cfg) as eng:
        comm = _FakeComm()
        monkeypatch.setattr(eng, "_all_comms", lambda: [comm])
        poller = eng._get_poller()  # what the first NCCL session does; starts the watchdog
        fut = poller.wait(_NeverFires(), comm)  # a receive whose data never comes
        with caplog.at_level(logging.ERROR, logger="aiokv"):
            _stuck_in_a_cuda_call(1.0)
            assert comm.aborted
            assert any("aborting this engine's communicators" in r.message for r in caplog.records)
        # the loop runs again: the poller fails the waiter of the aborted link
        with pytest.raises(aiokv.AiokvError):
            await asyncio.wait_for(fut, 5)
        assert eng.statistics().nccl["watchdog_fired"] == 1


def test_timeouts_validate_the_watchdog_limit() -> None:
    with pytest.raises(aiokv.ConfigError, match="nccl_watchdog"):
        aiokv.Timeouts(nccl_watchdog=0)
