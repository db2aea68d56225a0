"""Sleeps shorter than a millisecond, for the loop: a ``timerfd`` it watches.

asyncio's timers end in ``epoll_wait``, whose timeout CPython rounds *up* to whole
milliseconds (uvloop's libuv timers have millisecond resolution too), so on an idle
loop ``asyncio.sleep(0.0002)`` takes a millisecond. A wait that polls a CUDA event
past its spin therefore noticed the event 0.5 ms late on average (0.63 ms median
measured in run s19c, docs/benchmarks.md "Session 19") -- for every request whose
producer's GPU work ends more than the spin after the consumer began to wait: every
pushed request of a producer that sends as soon as its forward is queued (the
consumer grants, so waits, before the producer sends).

:class:`TimerFd` arms a ``timerfd`` (``CLOCK_MONOTONIC``, nanosecond resolution, the
kernel's timer slack aside) and waits for it to turn readable through
``loop.add_reader``: the loop sleeps in ``epoll_wait`` as before and wakes within tens
of µs of the delay. :class:`FinePoll` asks every waiting condition at each tick of one
such timer, from one task. Where ``timerfd`` is missing (not Linux) the tick is
``asyncio.sleep``'s.

Why not a CUDA host function that wakes the loop through a pipe (tried in session 19,
reverted): its stream must wait on the event -- for the IPC plane, a peer's event
that never fires when the peer dies, which then blocks every device-wide synchronize
of the consumer -- and the driver ran it only ~0.4 ms after the event anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Callable
from typing import Any

from ._common import _await_shielded

__all__ = ["FinePoll", "TimerFd"]

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Itimerspec(ctypes.Structure):
    _fields_ = [
        ("it_interval_sec", ctypes.c_long),
        ("it_interval_nsec", ctypes.c_long),
        ("it_value_sec", ctypes.c_long),
        ("it_value_nsec", ctypes.c_long),
    ]


def _libc() -> Any:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.timerfd_create.restype = ctypes.c_int
        lib.timerfd_settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        lib.timerfd_settime.restype = ctypes.c_int
        return lib
    except Exception:  # (no libc by that name, no timerfd: not Linux)
        return None


_LIBC = _libc()


class TimerFd:
    """One ``timerfd`` the loop watches: :meth:`sleep` with µs resolution, one sleep at
    a time (see the module docstring). :meth:`open` gives None where there is no
    ``timerfd``; :meth:`close` when done."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = fd
        self._loop = loop
        self._fut: asyncio.Future[None] | None = None
        loop.add_reader(fd, self._fired)

    @staticmethod
    def available() -> bool:
        """Whether this platform has ``timerfd`` (Linux)."""
        return _LIBC is not None

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop) -> TimerFd | None:
        if _LIBC is None:
            return None
        fd = int(_LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC))
        return cls(fd, loop) if fd >= 0 else None

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)  # (the expiry count)
        except BlockingIOError:
            return
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _set(self, ns: int) -> None:
        spec = _Itimerspec(0, 0, ns // 1_000_000_000, ns % 1_000_000_000)
        if int(_LIBC.timerfd_settime(self._fd, 0, ctypes.byref(spec), None)) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    async def sleep(self, delay: float) -> None:
        """Sleep ``delay`` seconds (> 0); cancellable."""
        self._set(max(1000, int(delay * 1e9)))  # (zero would disarm it)
        fut = self._fut = self._loop.create_future()
        try:
            await fut
        finally:
            self._fut = None
            if not fut.done():  # cancelled: disarm, and drop an expiry not read yet
                self._set(0)
                with contextlib.suppress(BlockingIOError):
                    os.read(self._fd, 8)

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)


class FinePoll:
    """Waits for conditions (a CUDA event's ``query``) by asking them every
    ``interval_s`` from ONE task, whatever the number of waits: each tick is one
    :class:`TimerFd` sleep and one query per wait, so N requests waiting cost one loop
    wake-up per tick, not N. A wait that gives up (timeout, cancellation) leaves
    nothing registered -- an event that never fires (a dead peer's) is not queried
    after its wait ended -- and the task ends when no wait is left."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._waits: dict[asyncio.Future[None], Callable[[], Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0

    @property
    def waiting(self) -> int:
        return len(self._waits)

    async def wait(self, query: Callable[[], Any], timeout: float) -> bool:
        """True once ``query()`` was true at a tick, False after ``timeout`` seconds;
        an exception ``query`` raises is raised here."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waits[fut] = query
        if self._task is None:
            self._task = loop.create_task(self._run(), name="aiokv-fine-poll")
        try:
            await _await_shielded(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._waits.pop(fut, None)
            if not fut.done():
                fut.cancel()

    async def _run(self) -> None:
        timer = TimerFd.open(asyncio.get_running_loop())
        try:
            while self._waits:
                if timer is not None:
                    try:
                        await timer.sleep(self.interval_s)
                    except OSError:  # (the timer failed: the loop's own from now on)
                        timer.close()
                        timer = None
                else:  # (no timerfd: the loop's own timer, whole milliseconds)
                    await asyncio.sleep(self.interval_s)
                self.ticks += 1
                for fut, query in list(self._waits.items()):
                    if fut.done():
                        continue
                    try:
                        fired = bool(query())
                    except Exception as exc:  # (a sticky CUDA error)
                        fut.set_exception(exc)
                        continue
                    if fired:
                        fut.set_result(None)
        finally:
            if timer is not None:
                timer.close()
            if self._task is asyncio.current_task():
                self._task = None

    async def aclose(self, error: BaseException | None = None) -> None:
        """Stop the task; waits still registered fail with ``error`` (None: they end
        at their own timeouts). A later wait starts the task again."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if error is not None:
            for fut in self._waits:
                if not fut.done():
                    fut.set_exception(error)
