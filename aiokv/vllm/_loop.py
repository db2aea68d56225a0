"""An asyncio event loop on a thread of its own, for a caller that is synchronous.

vLLM calls its connector synchronously from the model runner; the aiokv
:class:`~aiokv.Engine` lives on this loop, and the connector hands it work with
:meth:`LoopThread.spawn` (fire and forget: the coroutine reports its own outcome)
or :meth:`LoopThread.call` (set-up and shut-down only: waits, bounded). Pure
asyncio (no vLLM import).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._exceptions import AiokvTimeoutError, EngineClosedError

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """One event loop running on one daemon thread until :meth:`stop`."""

    def __init__(self, name: str = "aiokv-vllm") -> None:
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` s)."""
        if not self.running:
            coro.close()
            raise EngineClosedError("the aiokv loop thread is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise AiokvTimeoutError(f"the aiokv loop did not answer within {timeout} s") from None

    def spawn(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start ``make()`` as a task on the loop (from any thread); the task is kept
        referenced until it ends. It must report its own outcome."""
        if not self.running:
            raise EngineClosedError("the aiokv loop thread is not running")

        def start() -> None:
            task = self.loop.create_task(make())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self.loop.call_soon_threadsafe(start)

    def soon(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` on the loop's thread (from any thread)."""
        if self.running:
            self.loop.call_soon_threadsafe(fn)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what still runs, stop the loop and join the thread (bounded)."""
        if not self.running:
            return

        async def cancel_all() -> None:
            tasks = [t for t in self._tasks if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            self.call(cancel_all(), timeout + 1.0)
        except (AiokvTimeoutError, EngineClosedError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
