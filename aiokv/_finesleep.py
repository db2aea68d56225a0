"""Sleeps shorter than a millisecond, for the loop: a ``timerfd`` it watches.

asyncio's timers end in ``epoll_wait``, whose timeout CPython rounds *up* to whole
milliseconds (uvloop's libuv timers have millisecond resolution too), so on an idle
loop ``asyncio.sleep(0.0002)`` takes a millisecond. A wait that polls a CUDA event
past its spin therefore noticed the event 0.5 ms late on average (0.63 ms median
on an H200 host, docs/benchmarks.md "Waiting for CUDA events") -- for every request whose
producer's GPU work ends more than the spin after the consumer began to wait: every
pushed request of a producer that sends as soon as its forward is queued (the
consumer grants, so waits, before the producer sends).

:class:`TimerFd` arms a periodic ``timerfd`` (``CLOCK_MONOTONIC``, nanosecond
resolution, the kernel's timer slack aside) and calls back when it turns readable
through ``loop.add_reader``: the loop sleeps in ``epoll_wait`` as before and wakes
within tens of µs of each tick. :class:`FinePoll` asks every waiting condition at each
tick of one such timer, in that callback. Where ``timerfd`` is missing (not Linux) the
ticks are the loop's own timer's (``call_later``, whole milliseconds).

Why not a CUDA host function that wakes the loop through a pipe (tried, and
rejected): its stream must wait on the event -- for the IPC plane, a peer's event
that never fires when the peer dies, which then blocks every device-wide synchronize
of the consumer -- and the driver ran it only ~0.4 ms after the event anyway.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from typing import Any

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
    """One ``timerfd`` the loop watches, ticking with µs resolution: :meth:`every`
    calls back from the loop's own wake-up (see the module docstring). :meth:`open`
    gives None where there is no ``timerfd``; :meth:`close` when done."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = fd
        self._loop = loop
        self._on_tick: Callable[[], None] | None = None
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
        if self._on_tick is not None:
            self._on_tick()

    def _set(self, ns: int, every_ns: int = 0) -> None:
        spec = _Itimerspec(
            every_ns // 1_000_000_000,
            every_ns % 1_000_000_000,
            ns // 1_000_000_000,
            ns % 1_000_000_000,
        )
        if int(_LIBC.timerfd_settime(self._fd, 0, ctypes.byref(spec), None)) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def every(self, delay: float, on_tick: Callable[[], None]) -> None:
        """Call ``on_tick()`` every ``delay`` seconds (> 0), from the loop's reader
        callback -- no task to resume in between -- until :meth:`close`. The kernel
        keeps the period whatever the callback takes; expiries the loop could not
        serve in time come as one call."""
        ns = max(1000, int(delay * 1e9))
        self._on_tick = on_tick
        self._set(ns, ns)

    def close(self) -> None:
        self._on_tick = None
        self._loop.remove_reader(self._fd)
        os.close(self._fd)


class FinePoll:
    """Waits for conditions (a CUDA event's ``query``) by asking them every
    ``interval_s``, all of them at each tick of ONE periodic timer (a
    :meth:`TimerFd.every`; the loop's own timer where there is none), whatever the
    number of waits: N requests waiting cost one loop wake-up per tick, not N. The
    queries run in the tick's callback and a wait's future is set there, so the
    waiting task resumes in the very next loop pass (resuming a poll task
    first and waking the waiter through a second future costs two more passes:
    0.28 ms late on an H200 host against 0.12 with a timer per wait).
    Deadlines are checked at the ticks too. A wait that gives up (timeout,
    cancellation) leaves nothing registered -- an event that never fires (a dead
    peer's) is not queried after its wait ended -- and the timer is closed when no
    wait is left."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._waits: dict[asyncio.Future[bool], tuple[Callable[[], Any], float]] = {}
        self._timer: TimerFd | None = None
        self._handle: asyncio.TimerHandle | None = None  # the ticks without a timerfd
        self.ticks = 0

    @property
    def waiting(self) -> int:
        return len(self._waits)

    @property
    def ticking(self) -> bool:
        """Whether a timer runs (only while some wait is registered)."""
        return self._timer is not None or self._handle is not None

    async def wait(self, query: Callable[[], Any], timeout: float) -> bool:
        """True once ``query()`` was true at a tick, False once ``timeout`` seconds
        passed (noticed at the tick after); an exception ``query`` raises is raised
        here."""
        if timeout <= 0:
            return False
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._waits[fut] = (query, time.monotonic() + timeout)
        try:
            if not self.ticking:
                self._start(loop)
            return await fut
        finally:
            self._waits.pop(fut, None)
            if not fut.done():
                fut.cancel()
            if not self._waits:
                self._stop()

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        timer = TimerFd.open(loop)
        if timer is not None:
            try:
                timer.every(self.interval_s, self._tick)
            except OSError:  # (the timer failed: the loop's own from now on)
                timer.close()
                timer = None
        self._timer = timer
        if timer is None:  # (no timerfd: the loop's own timer, whole milliseconds)
            self._handle = loop.call_later(self.interval_s, self._loop_tick)

    def _stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.close()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()

    def _loop_tick(self) -> None:
        if self._handle is not None:
            self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._loop_tick)
        self._tick()

    def _tick(self) -> None:
        self.ticks += 1
        now = time.monotonic()
        for fut, (query, until) in list(self._waits.items()):
            if fut.done():
                continue
            try:
                fired = bool(query())
            except Exception as exc:  # (a sticky CUDA error)
                fut.set_exception(exc)
                continue
            if fired:
                fut.set_result(True)
            elif now >= until:
                fut.set_result(False)

    async def aclose(self, error: BaseException | None = None) -> None:
        """Waits still registered fail with ``error`` (None: they go on to their own
        ends); the timer stops once none is left. A later wait starts it again."""
        if error is not None:
            for fut in self._waits:
                if not fut.done():
                    fut.set_exception(error)
        if all(f.done() for f in self._waits):
            self._stop()
