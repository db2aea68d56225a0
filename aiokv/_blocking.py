"""Blocking work off the event loop: the one helper every part of aiokv uses.

Two kinds of blocking work, two places for it (docs/design.md, "Blocking work"):

* **Calls that may not come back** -- ``ncclCommAbort`` (~0.5 s, longer on a wedged
  GPU), ``ncclCommInitRankConfig`` and the NCCL warm-up exchange (they wait for the
  peer rank, forever if it never comes), zmq's ``Context.term`` (waits for lingering
  sockets): :func:`start_daemon` / :func:`in_daemon`. Each call gets a thread of its
  own, a daemon: a stuck call never holds a pool slot that other work waits for, and
  never keeps the process from exiting (a pool's threads are joined at exit).
* **Short CPU work** -- copying a KV cache slice on the CPU: :func:`in_pool`, a
  small bounded pool shared by the process (``POOL_WORKERS`` threads, made on first
  use), so copies run in parallel with the loop without a thread per call.

Both hand the result (or the exception) back as an awaitable; a caller that gives up
(timeout, cancellation) leaves the call running to its end -- a blocking C call
cannot be interrupted -- and the result is dropped, also when the loop is gone by then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["POOL_WORKERS", "in_daemon", "in_pool", "start_daemon"]

T = TypeVar("T")

#: threads of the shared pool for short CPU work
POOL_WORKERS = max(2, min(4, os.cpu_count() or 2))

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def start_daemon(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``fn`` on a new daemon thread called ``name``; a future of its result.

    Needs no event loop (``Communicator.abort`` is synchronous), returns at once.
    Callbacks added to the future run on that thread when ``fn`` returns.
    """
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to whoever waits on the future
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def in_daemon(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """:func:`start_daemon`, awaitable on the running loop.

    Cancelling (or a ``wait_for`` timing out on) the returned future does not stop
    ``fn``; shield it when the call's own future is still wanted afterwards.
    """
    return asyncio.wrap_future(start_daemon(fn, name))


def _get_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=POOL_WORKERS, thread_name_prefix="aiokv-cpu"
            )
        return _pool


def in_pool(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run short CPU work ``fn`` on the shared bounded pool; awaitable on the running loop."""
    return asyncio.get_running_loop().run_in_executor(_get_pool(), fn)
