"""The event waker (aiokv.kv._gpuwake) on CPU, with a stand-in driver.

The stand-in keeps each stream's queue (a wait on an event, then a host function) and,
when a test fires an event, runs the host functions behind it on a thread of its own
-- through ``ctypes`` as ``CUhostFn`` with libc's ``close``, the waker's real host
function -- as the CUDA driver's callback thread would. What is checked: a wait ends
when the host function ran (not at its periodic query); it times out, is cancelled or
fails to arm without leaking a descriptor; a stream serves again only after its host
function ran, so a wait behind an event that never fires holds up no other; close()
leaves nothing registered.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from typing import Any

import pytest

from aiokv.kv._cudrv import CudaDriverError
from aiokv.kv._gpuwake import EventWaker

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeDriver:
    """Streams as queues of (event, host function, argument)."""

    has_host_func = True

    def __init__(self) -> None:
        self.queues: dict[int, list[list[Any]]] = {}
        self.destroyed: list[int] = []
        self.fired: set[int] = set()
        self.fail_launch = False
        self.lock = threading.Lock()

    def stream_create(self) -> int:
        s = 1000 + len(self.queues)
        self.queues[s] = []
        return s

    def stream_destroy(self, stream: int) -> None:
        self.destroyed.append(stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        with self.lock:
            self.queues[stream].append([event, None, None])

    def launch_host_func(self, stream: int, fn: int, arg: int) -> None:
        if self.fail_launch:
            raise CudaDriverError("cuLaunchHostFunc: CUDA_ERROR_INVALID_VALUE")
        with self.lock:
            self.queues[stream][-1][1:] = [fn, arg]

    def fire(self, event: int) -> threading.Thread:
        """The event fired: run, on another thread, every host function whose stream
        is no longer held up (in stream order)."""
        self.fired.add(event)

        def run() -> None:
            with self.lock:
                todo = []
                for q in self.queues.values():
                    while q and q[0][0] in self.fired:
                        todo.append(q.pop(0))
            for _, fn, arg in todo:
                HOST_FN(fn)(arg)

        t = threading.Thread(target=run)
        t.start()
        return t


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _waker(backstop_s: float = 30.0) -> tuple[EventWaker, FakeDriver]:
    drv = FakeDriver()
    w = EventWaker.create(drv)  # type: ignore[arg-type]
    assert w is not None, "libc's close not found"
    w.backstop_s = backstop_s
    return w, drv


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_wait_ends_when_the_host_function_closes_the_pipe() -> None:
    w, drv = _waker()
    fds = _fds()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, drv.fire, 7)
    t0 = time.monotonic()
    assert await w.wait(7, lambda: False, 10.0) is True  # (the query never says so)
    assert time.monotonic() - t0 < 5.0  # the wake, not the 30 s periodic query
    s = w.statistics()
    assert (s.armed, s.woken, s.backstop, s.pending, s.streams) == (1, 1, 0, 0, 1)
    # the stream serves the next wait; nothing is left open
    loop.call_later(0.01, drv.fire, 8)
    assert await w.wait(8, lambda: False, 10.0) is True
    assert w.statistics().streams == 1
    assert _fds() == fds
    w.close()
    assert drv.destroyed == [1000]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_wait_behind_an_event_that_never_fires_holds_up_no_other() -> None:
    w, drv = _waker()
    fds = _fds()
    assert await w.wait(1, lambda: False, 0.05) is False  # a dead producer's event
    s = w.statistics()
    assert (s.timed_out, s.pending) == (1, 1)
    # the stuck stream is not reused: the next wait gets its own, and ends
    asyncio.get_running_loop().call_later(0.01, drv.fire, 2)
    assert await w.wait(2, lambda: False, 10.0) is True
    assert w.statistics().streams == 2
    # once the old event fires after all, its stream and pipe come back
    drv.fire(1).join()
    for _ in range(200):
        if w.statistics().pending == 0:
            break
        await asyncio.sleep(0.005)
    assert w.statistics().pending == 0
    assert _fds() == fds
    w.close()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_periodic_query_ends_a_wait_whose_wake_never_comes() -> None:
    w, drv = _waker(backstop_s=0.02)
    fired = asyncio.get_running_loop().time() + 0.05
    assert await w.wait(3, lambda: asyncio.get_running_loop().time() >= fired, 10.0)
    assert w.statistics().backstop == 1
    w.close()  # (its host function never ran: the reader and the pipe go)
    assert w.statistics().pending == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_cancelled_wait_keeps_its_stream_until_the_host_function_ran() -> None:
    w, drv = _waker()
    fds = _fds()
    task = asyncio.ensure_future(w.wait(4, lambda: False, 10.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert w.statistics().pending == 1
    drv.fire(4).join()
    for _ in range(200):
        if w.statistics().pending == 0:
            break
        await asyncio.sleep(0.005)
    assert w.statistics().pending == 0
    assert _fds() == fds
    w.close()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_host_function_that_cannot_be_queued_leaks_nothing() -> None:
    w, drv = _waker()
    fds = _fds()
    drv.fail_launch = True
    with pytest.raises(CudaDriverError):
        await w.wait(5, lambda: False, 1.0)
    assert _fds() == fds
    assert drv.destroyed == [1000]  # (a wait may be queued on it: not reused)
    assert w.statistics().pending == 0
    drv.fail_launch = False
    w.close()
    with pytest.raises(CudaDriverError):
        await w.wait(6, lambda: False, 1.0)


def test_no_driver_no_waker() -> None:
    assert EventWaker.create(None) is None

    class Old(FakeDriver):
        has_host_func = False

    assert EventWaker.create(Old()) is None  # type: ignore[arg-type]
