"""A thread that notices when the event loop is stuck while NCCL work is queued.

aiokv's loop never waits on the GPU, but code sharing the loop thread can:
under CUDA's lazy module loading, the first launch of a kernel waits until
the GPU has no queued work, holding the context lock, and with NCCL work
queued that wait can last for ever (docs/reliability.md, "First launches and
NCCL"). From the outside such a process just stops.

:class:`LoopWatchdog` makes the hang say what it is. The loop stamps a
heartbeat every ``beat_s``; a daemon thread checks it. When the loop has not
stamped it for ``limit`` seconds while ``pending()`` reports queued NCCL work,
the thread calls ``report(why)`` once, with where the loop thread is stuck; it
reports again only after the loop has run again.

It does not try to break the hang. Aborting the communicators from this
thread was tried on 2x H200: ``ncclCommAbort`` did not free
a loop stuck in a first kernel launch, so the engine only reports.

The thread only reads two numbers and calls ``report``. It is the one thread
aiokv starts outside :mod:`aiokv._runtime.threads` (a monitor, not work; that module's
docstring lists it): one per engine with NCCL sessions, a daemon that ends with
:meth:`LoopWatchdog.stop` or when it sees its loop closed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

__all__ = ["LoopWatchdog"]

log = logging.getLogger("aiokv")


class LoopWatchdog:
    """Watch ``loop`` from a daemon thread; see the module docstring."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        limit: float,
        pending: Callable[[], int],
        report: Callable[[str], None],
        beat_s: float | None = None,
    ) -> None:
        self.limit = limit
        self.beat_s = beat_s if beat_s is not None else min(0.5, limit / 4)
        self.fired = 0
        self.last_beat = time.monotonic()
        self._loop = loop
        self._pending = pending
        self._report = report
        self._loop_thread = threading.get_ident()  # constructed on the loop's thread
        self._stop = threading.Event()
        self._timer = loop.call_later(self.beat_s, self._beat)
        self._thread = threading.Thread(target=self._watch, name="aiokv-loop-watchdog", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.last_beat = time.monotonic()
        if not self._stop.is_set():
            self._timer = self._loop.call_later(self.beat_s, self._beat)

    def _watch(self) -> None:
        armed = True
        while not self._stop.wait(self.beat_s):
            if self._loop.is_closed():  # its engine was never closed: nothing left to watch
                return
            stuck = time.monotonic() - self.last_beat
            if stuck < self.limit:
                armed = True
                continue
            if not armed:
                continue
            try:
                queued = self._pending()
            except Exception:  # racing the loop's own changes: look again next beat
                continue
            if queued <= 0:
                continue
            armed = False
            self.fired += 1
            why = (
                f"the event loop has been stuck for {stuck:.1f} s with {queued} NCCL "
                f"operation(s) queued. The loop thread is at:\n{self._where()}"
                "A first launch of a kernel under CUDA's lazy module loading can wait "
                "for queued NCCL work for ever: launch your kernels before NCCL traffic "
                "or set CUDA_MODULE_LOADING=EAGER (docs/reliability.md, 'First launches "
                "and NCCL')."
            )
            try:
                self._report(why)
            except Exception:
                log.exception("aiokv: the loop watchdog's report failed")

    def _where(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (unknown)\n"
        return "".join(traceback.format_stack(frame, limit=8))

    def stop(self) -> None:
        """Stop watching (idempotent). Call on the loop's thread."""
        self._stop.set()
        self._timer.cancel()
