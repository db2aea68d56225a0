"""Small helpers the engine and both of its peer sides share (no state of their own).

They live apart from :mod:`aiokv.engine` because the client side
(:mod:`aiokv.engine.client`) and the server side (:mod:`aiokv.engine.server`) need them and
the engine imports both sides.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

#: Control messages queued in one loop pass leave as one zmq message of at most this
#: many frames (a peer refuses more than 4x this; the sender splits, never the peer).
MAX_FRAMES_PER_MESSAGE = 1024
#: the capability in WELCOME naming the data port ("data:<port>")
_DATA_CAP = "data:"
#: PLAIN user name of data connections (the password is the session token, in hex)
_PLAIN_USER = b"aiokv"


def _time_left(deadline: float, clock: Callable[[], float] = time.monotonic) -> float:
    """The seconds before ``deadline`` (on ``clock``) for an engine call, which
    refuses a zero timeout; :class:`~aiokv.TransferTimeoutError` when none are left
    (a caller's ``timeout=0``, or a deadline that ran out between two steps)."""
    left = deadline - clock()
    if left <= 0:
        from aiokv._exceptions import TransferTimeoutError

        raise TransferTimeoutError("the request's deadline is over")
    return left


class _Deadline:
    """One time budget for all phases of an operation."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        r = max(0.0, self.at - time.monotonic())
        return r if cap is None else min(r, cap)


async def _await_shielded(fut: asyncio.Future[Any], timeout: float) -> Any:
    """Wait for ``fut`` at most ``timeout`` s without cancelling it on timeout/cancel.

    Raises TimeoutError on timeout; cancelling the caller leaves ``fut`` alone.
    (A waiter future and a timer: cheaper than ``wait_for(shield(...))``, which
    creates a task per wait, on the hot path of every transfer.)
    """
    if fut.done():
        return fut.result()
    loop = fut.get_loop()  # (asyncio.get_running_loop costs a getpid syscall on 3.11)
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    fut.add_done_callback(wake)
    # the deadline on the precise clock: uvloop's timers have millisecond granularity
    # and may fire up to a millisecond early; such a wake-up waits out the rest
    at = time.monotonic() + timeout
    timer = loop.call_later(timeout, wake)
    try:
        while True:
            await waiter
            left = at - time.monotonic()
            if fut.done() or left <= 0:
                break
            waiter = loop.create_future()
            timer = loop.call_later(left, wake)
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    if fut.done():
        return fut.result()
    raise TimeoutError


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
