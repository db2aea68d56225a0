"""Threads of aiokv: every thread it starts, and what each may do.

The event loop never blocks; work that would runs on a thread of this module (the
one way aiokv starts threads for work, checked by ``tests/test_blocking.py``),
and its result comes back as an awaitable. Three kinds, three places
(docs/design.md, "Blocking work"):

* **Calls that may not come back** -- ``ncclCommAbort`` (~0.5 s, longer on a wedged
  GPU), ``ncclCommInitRankConfig`` and the NCCL warm-up exchange (they wait for the
  peer rank, forever if it never comes), zmq's ``Context.term`` (waits for lingering
  sockets), the IPC plane's first CUDA set-up: :func:`start_daemon` /
  :func:`in_daemon`. Each call gets a **daemon thread of its own**: a stuck call
  never holds a slot other work waits for, and never keeps the process from
  exiting. One thread per call in flight: their number is that of such calls,
  which the engine starts once per communicator or engine, never per transfer.
* **Short CPU work** -- copying a KV cache slice on the CPU: :func:`in_pool`, a
  bounded pool shared by the process (:data:`POOL_WORKERS` threads, 2 to 4, made on
  first use), so copies run in parallel with the loop without a thread per call.
* **Ordered copies** -- reassembling a large TCP data message from its frames:
  :func:`in_order`, ONE thread shared by the process (made on first use): copying
  is memory-bound, so more threads would not finish sooner, and one keeps the
  landings in arrival order.

At most ``POOL_WORKERS + 1`` pool threads, plus one daemon thread per call in
flight. Pool threads (the short and the ordered work) are joined at interpreter
exit: work queued there ends first, which is why nothing that may hang goes
there. Daemon threads are not joined: a call still stuck at exit is abandoned.
A forked child starts with no pool thread and makes its own on first use.

Every call hands its result (or exception) back as an awaitable; a caller that
gives up (timeout, cancellation) leaves the call running to its end -- a blocking C
call cannot be interrupted -- and the result is dropped, also when the loop is gone
by then.

The one other thread is a monitor, not work: the engine's loop watchdog
(:mod:`aiokv._runtime.watchdog`), one daemon thread per engine with NCCL sessions, which
wakes every ``beat_s`` to read the loop's heartbeat and ends with the engine or its
loop. (Waits for a condition -- a CUDA event, an NCCL state, a call's end -- are
not threads: :mod:`aiokv._runtime.waiter` asks them from the loop.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["POOL_WORKERS", "in_daemon", "in_order", "in_pool", "start_daemon"]

T = TypeVar("T")

#: threads of the shared pool for short CPU work
POOL_WORKERS = max(2, min(4, os.cpu_count() or 2))

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_order: concurrent.futures.ThreadPoolExecutor | None = None
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


def _get_order() -> concurrent.futures.ThreadPoolExecutor:
    global _order
    with _pool_lock:
        if _order is None:
            _order = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="aiokv-assemble"
            )
        return _order


def in_pool(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run short CPU work ``fn`` on the shared bounded pool; awaitable on the running loop."""
    return asyncio.get_running_loop().run_in_executor(_get_pool(), fn)


def in_order(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run memory-bound copy ``fn`` on the one ordered thread, after every copy queued
    before it; awaitable on the running loop."""
    return asyncio.get_running_loop().run_in_executor(_get_order(), fn)


def _forget_pools() -> None:
    """A forked child has no pool thread: it makes its own when it needs one."""
    global _pool, _order, _pool_lock
    _pool = _order = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)
