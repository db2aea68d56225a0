"""A deadline never fires early, whatever the event loop's timers do.

uvloop schedules timers from the loop time cached when the iteration began, in whole
milliseconds: a timer may run before its deadline on the precise clock (CI saw a send
time out 6 us early). Here every timer of the loop fires 30 ms early -- asyncio's loop
allows replacing ``call_later`` on the instance -- so an engine that trusted its timers
would raise 30 ms early.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from support.procs import engines

import aiokv
from aiokv._runtime.deadlines import _await_shielded

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
EARLY = 0.03


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # (uvloop's call_later cannot be replaced on the instance)


def _coarse(loop: asyncio.AbstractEventLoop) -> None:
    """Every timer of ``loop`` from now on fires EARLY seconds before its time."""
    real = loop.call_later

    def early(delay: float, cb: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        return real(max(0.0, delay - EARLY), cb, *args, context=context)

    loop.call_later = early  # type: ignore[method-assign]


async def test_await_shielded_waits_out_an_early_timer(anyio_backend: Any) -> None:
    loop = asyncio.get_running_loop()
    _coarse(loop)
    fut: asyncio.Future[None] = loop.create_future()
    for i in range(6):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await _await_shielded(fut, 0.12 + i * 0.013)
        assert time.monotonic() - t0 >= 0.12 + i * 0.013


async def test_send_and_handle_deadlines_are_never_early(anyio_backend: Any) -> None:
    async with engines(aiokv.EngineConfig(), aiokv.EngineConfig()) as (a, b):
        await a.connect(b.address)
        b._server.granting.send_credit = lambda ss, now=False: None  # type: ignore[method-assign]
        _coarse(asyncio.get_running_loop())
        for i in range(3):
            deadline = 0.15 + i * 0.017
            t0 = time.monotonic()
            with pytest.raises(aiokv.TransferTimeoutError):
                await a.send(f"s{i}", torch.ones(4), to=b.address, timeout=deadline)
            assert time.monotonic() - t0 >= deadline
            t0 = time.monotonic()
            h = a.send_nowait(f"h{i}", torch.ones(4), to=b.address, timeout=deadline)
            with pytest.raises(aiokv.TransferTimeoutError):
                await h
            assert time.monotonic() - t0 >= deadline
