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
within tens of µs of each tick. The loop's one :class:`aiokv._runtime.waiter.Waiter` runs
its ticks on one such timer (and on the loop's own ``call_later``, whole
milliseconds, where ``timerfd`` is missing: not Linux); :class:`FinePoll` is a name
for its fixed-interval waits.

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
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["TimerFd"]

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
        # (a box that whoever closes the fd first empties: see fd_box)
        self._box = [fd]
        # (weak: a timer left open on a closed loop must not keep it alive; see close_fd)
        self._loop = weakref.ref(loop)
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

    def pause(self) -> None:
        """Disarm the timer: no tick (and no wake-up of the loop) until the next
        :meth:`every`; the fd stays open and watched."""
        self._set(0)

    def close(self) -> None:
        """Stop watching and close the fd (idempotent; also on a closed loop)."""
        self._on_tick = None
        loop = self._loop()
        if self._fd >= 0 and loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
        self.close_fd()

    @property
    def _fd(self) -> int:
        return self._box[0]

    def fd_box(self) -> list[int]:
        """The one-item list holding the fd (-1 once closed): a finalizer that must
        close the fd without holding this timer closes it through the box
        (:func:`close_box`), and neither closes it twice."""
        return self._box

    def close_fd(self) -> None:
        """Close the fd only (its loop is gone or closed)."""
        close_box(self._box)


def close_box(box: list[int]) -> None:
    """Close the fd in ``box`` unless closed already (see :meth:`TimerFd.fd_box`)."""
    fd, box[0] = box[0], -1
    if fd >= 0:
        os.close(fd)
