"""Waking the event loop when a CUDA event fires, with no polling and no thread of ours.

The IPC plane waits for CUDA events from the loop: the producer's ready event (pull),
the producer's push completion (push mode), its own copy's completion. It queries
them on every loop pass for a short spin (a copy or a forward that ends within it is
noticed within µs), and before this module it then slept 1 ms between queries: the
loop's timers have millisecond resolution, so a finer sleep was not finer. Where the
producer calls ``send_request``/``save_layer`` as soon as its forward is *queued* --
the way a serving engine calls them -- the descriptor arrives milliseconds before the
GPU is ready, the spin runs out, and each request was noticed up to 1 ms late (0.5 ms
on average: measured 0.84 ms in run s19b, docs/benchmarks.md "Session 19").

:class:`EventWaker` turns the event into a file descriptor the loop watches instead.
Per wait: a pipe; on a stream of its own, ``cuStreamWaitEvent`` on the event and then
``cuLaunchHostFunc`` with libc's ``close`` as the host function and the pipe's write
end as its argument. When the event fires the driver's own callback thread closes the
write end; the read end turns readable (end of file) and ``loop.add_reader`` resolves
the wait. No Python runs on the driver's thread (no GIL to take, nothing that could
deadlock with a CUDA call holding it), and nothing of ours blocks.

``close`` is called through ``CUhostFn`` (``void (*)(void *)``): the fd travels in the
pointer argument, whose low 32 bits are the ``int`` on every 64-bit Linux ABI
(System V x86-64, AArch64), and the ``int`` it returns is ignored.

A stream serves again only once its host function ran (its read end saw the end of
file), so a wait behind an event that never fires -- a dead producer's -- keeps its
stream and pipe end for the life of the process and holds up no other wait. The
caller keeps querying the event every ``backstop_s`` while it waits (a wake that went
missing -- a forked child holding the write end open -- costs that, not the whole
deadline).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._common import _await_shielded
from ._cudrv import CudaDriverError, Driver

__all__ = ["EventWaker", "WakerStats"]


#: how often a wait queries the event anyway (a wake that never comes)
BACKSTOP_S = 0.05


@dataclass(slots=True)
class WakerStats:
    """Counters of an :class:`EventWaker`."""

    armed: int = 0  # waits that armed a host function
    woken: int = 0  # ... that the host function ended
    backstop: int = 0  # ... that the periodic query ended instead (the wake was late)
    timed_out: int = 0  # ... that ran out of time
    pending: int = 0  # host functions that have not run yet
    streams: int = 0  # streams created (a pool: they serve again once their host function ran)


class EventWaker:
    """Waits for CUDA events (raw ``CUevent`` handles) through host functions; see the
    module docstring. ``drv``: the driver calls (:class:`~aiokv.kv._cudrv.Driver`);
    ``close_fn``: the address of the host function that closes the fd it is given
    (libc's ``close``; tests give their own)."""

    def __init__(self, drv: Driver, close_fn: int, *, backstop_s: float = BACKSTOP_S) -> None:
        self._drv = drv
        self._close_fn = close_fn
        self.backstop_s = backstop_s
        self._free: list[int] = []  # streams whose host functions all ran
        self._armed: dict[int, tuple[int, asyncio.AbstractEventLoop]] = {}  # read fd -> stream
        self._stats = WakerStats()
        self._closed = False

    @classmethod
    def create(cls, drv: Driver | None) -> EventWaker | None:
        """A waker on ``drv`` with libc's ``close``, or None where there is none."""
        if drv is None or not drv.has_host_func:
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            close_fn = ctypes.cast(libc.close, ctypes.c_void_p).value
        except (OSError, AttributeError):
            return None
        return cls(drv, int(close_fn)) if close_fn else None

    def statistics(self) -> WakerStats:
        s = self._stats
        return WakerStats(s.armed, s.woken, s.backstop, s.timed_out, len(self._armed), s.streams)

    async def wait(self, event: int, query: Callable[[], Any], timeout: float) -> bool:
        """Wait until ``event`` fired (True) or ``timeout`` seconds passed (False).
        ``query``: the event's own query, asked every ``backstop_s`` while waiting and
        before returning False. Raises :class:`~aiokv.kv._cudrv.CudaDriverError` when the
        host function cannot be queued (nothing stays armed then)."""
        if self._closed:
            raise CudaDriverError("the event waker is closed")
        loop = asyncio.get_running_loop()
        fut = self._arm(event, loop)
        end = loop.time() + max(0.0, timeout)
        try:
            while True:
                left = end - loop.time()
                if left <= 0:
                    if bool(query()):
                        return True
                    self._stats.timed_out += 1
                    return False
                try:
                    await _await_shielded(fut, min(left, self.backstop_s))
                    self._stats.woken += 1
                    return True
                except TimeoutError:
                    if bool(query()):
                        self._stats.backstop += 1
                        return True
        finally:
            if not fut.done():
                fut.cancel()  # (the reader stays until the host function ran: see _arm)

    def _arm(self, event: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        stream = self._free.pop() if self._free else None
        if stream is None:
            stream = self._drv.stream_create()
            self._stats.streams += 1
        r, w = os.pipe()
        try:
            self._drv.stream_wait_event(stream, event)
            self._drv.launch_host_func(stream, self._close_fn, w)
        except BaseException:
            os.close(r)
            os.close(w)
            # (a wait queued before the launch failed may still be pending on it)
            self._drv.stream_destroy(stream)
            raise
        fut: asyncio.Future[None] = loop.create_future()

        def ended() -> None:  # the host function closed the write end
            loop.remove_reader(r)
            os.close(r)
            self._armed.pop(r, None)
            if not self._closed:
                self._free.append(stream)
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(r, ended)
        self._armed[r] = (stream, loop)
        self._stats.armed += 1
        return fut

    def close(self) -> None:
        """Stop watching (the loop's readers go; streams whose host function has not run
        stay with the driver, which releases them when their work ends)."""
        self._closed = True
        for r, (stream, loop) in list(self._armed.items()):
            if not loop.is_closed():
                loop.remove_reader(r)
            os.close(r)
            self._drv.stream_destroy(stream)
        self._armed.clear()
        for stream in self._free:
            self._drv.stream_destroy(stream)
        self._free.clear()
