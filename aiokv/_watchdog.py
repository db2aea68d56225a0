"""A thread that notices when the event loop is stuck while NCCL work is queued.

aiokv's loop never waits on the GPU, but code sharing the loop thread can:
under CUDA's lazy module loading, the first launch of a kernel waits until the
GPU has no queued work, holding the context lock. If NCCL kernels are queued
that wait for a peer in the same state, nothing ever drains — both processes
hang for good (docs/reliability.md, "First launches and NCCL").

:class:`LoopWatchdog` turns that hang into errors. The loop stamps a heartbeat
every ``beat_s``; a daemon thread checks it. When the loop has not stamped it
for ``limit`` seconds while ``pending()`` reports queued NCCL work, the thread
calls ``abort(why)`` once (the engine aborts every communicator: NCCL's abort
flag makes the spinning kernels exit, the GPU drains, the stuck call returns,
and the queued transfers fail with :class:`~aiokv.TransferAbortedError`). It
fires again only after the loop has run again.

The thread only reads two numbers and calls ``abort``; it never touches the
loop's objects otherwise.
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
        abort: Callable[[str], None],
        beat_s: float | None = None,
    ) -> None:
        self.limit = limit
        self.beat_s = beat_s if beat_s is not None else min(0.5, limit / 4)
        self.fired = 0
        self.last_beat = time.monotonic()
        self._loop = loop
        self._pending = pending
        self._abort = abort
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
                f"operation(s) queued; aborting this engine's communicators. The loop "
                f"thread is at:\n{self._where()}"
                "A first launch of a kernel under CUDA's lazy module loading waits for "
                "queued NCCL kernels (docs/reliability.md, 'First launches and NCCL')."
            )
            try:
                self._abort(why)
            except Exception:
                log.exception("aiokv: the loop watchdog's abort failed")

    def _where(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (unknown)\n"
        return "".join(traceback.format_stack(frame, limit=8))

    def stop(self) -> None:
        """Stop watching (idempotent). Call on the loop's thread."""
        self._stop.set()
        self._timer.cancel()
