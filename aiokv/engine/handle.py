"""What ``send`` and ``send_nowait`` hand the caller: :class:`TransferHandle` (public),
and :class:`_XferWatch`, the deadline, give-up and failure count of one PUT_ASYNC."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from aiokv._exceptions import NegotiateTimeoutError, TransferTimeoutError
from aiokv._runtime.deadlines import _retrieve

if TYPE_CHECKING:
    from aiokv.engine.client import _ClientSession
    from aiokv.engine.interfaces import WatchOwner
    from aiokv.engine.outgoing import _OutXfer

__all__ = ["TransferHandle"]


class _XferWatch:
    """What a PUT_ASYNC handle needs besides the transfer's ``done`` future, which the
    handle hands out as its own: the deadline (one timer), the caller giving up, and
    counting a failure once, whichever way the transfer ended."""

    __slots__ = ("cs", "gave_up", "owner", "t_end", "t_neg", "timer", "to", "x")

    def __init__(
        self,
        owner: WatchOwner,
        cs: _ClientSession,
        x: _OutXfer,
        t: float,
        to: str,
        callback: bool = True,
    ) -> None:
        loop = owner._loop
        self.owner, self.cs, self.x, self.to = owner, cs, x, to
        # deadlines on the precise clock: uvloop's loop.time() and timers have millisecond
        # granularity, and a timer may fire up to a millisecond before its deadline
        now = time.monotonic()
        neg = min(t, owner.config.timeouts.negotiate)
        self.t_end = now + t
        self.t_neg = now + neg
        self.gave_up = False
        self.timer = loop.call_later(neg, self.expire)
        if callback:  # (False: the one awaiting ``done`` calls settled() itself)
            x.done.add_done_callback(self.settled)

    def settled(self, f: asyncio.Future[None]) -> None:
        self.timer.cancel()
        if not f.done() or f.cancelled():  # TransferHandle.cancel(), the awaiting task
            self.on_cancel()  # was cancelled (or its coroutine closed while it waited)
        elif f.exception() is not None:  # (reading it also marks it retrieved)
            self.owner._stats.transfers_failed += 1

    def expire(self) -> None:
        x, done = self.x, self.x.done
        if done.done():
            return
        g = x.granted
        now = time.monotonic()
        if not (g.done() and not g.cancelled() and g.exception() is None):
            if now < self.t_neg:  # (the timer fired early)
                self.timer = self.owner._loop.call_later(self.t_neg - now, self.expire)
                return
            exc: BaseException = NegotiateTimeoutError(
                f"{self.to} granted no room within the deadline"
            )
        elif now < self.t_end:  # granted in time: the rest of it
            self.timer = self.owner._loop.call_later(self.t_end - now, self.expire)
            return
        else:
            exc = TransferTimeoutError(
                f"transfer to {self.to} did not complete within the deadline"
            )
        self.gave_up = True
        done.set_exception(exc)  # first: withdrawing must not turn it into a cancel
        self.cs.abandon(x, deadline=True)

    def wanted(self) -> None:
        """The caller started waiting (awaits the handle, its release, or polls it)."""
        self.cs.want_ack(self.x)

    def on_cancel(self) -> None:
        """The caller gave up (at once: nothing waits a loop pass)."""
        if self.gave_up:
            return
        self.gave_up = True
        self.timer.cancel()
        done = self.x.done
        if not done.done() or done.cancelled():
            self.owner._stats.transfers_failed += 1
            self.cs.abandon(self.x)


class TransferHandle:
    """An in-flight PUT_ASYNC: await it, or poll :meth:`done`; :meth:`cancel` gives up.

    Awaiting the handle tells the outcome. A transfer the receiver had granted
    cannot be recalled, so after a timeout or :meth:`cancel` the engine may still
    be reading the tensor: await :meth:`released` before reusing its memory.
    """

    __slots__ = ("_on_cancel", "_on_wait", "_released", "_task")

    def __init__(
        self,
        task: asyncio.Future[None],
        released: asyncio.Future[None],
        on_cancel: Callable[[], None] | None = None,
        *,
        retrieve: bool = True,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        self._task = task
        self._released = released
        self._on_cancel = on_cancel
        self._on_wait = on_wait  # somebody waits for the outcome (see want_ack)
        if retrieve:  # (False: the caller reads the outcome itself)
            task.add_done_callback(_retrieve)

    def _waiting(self) -> None:
        if self._on_wait is not None and not self._task.done():
            self._on_wait()

    async def released(self) -> None:
        """Wait until no part of aiokv reads the sent tensor any more (never raises)."""
        self._waiting()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait({self._task})
        await asyncio.shield(self._released)

    def done(self) -> bool:
        if self._task.done():
            return True
        self._waiting()  # (a caller polling it waits for it too)
        return False

    def cancel(self) -> bool:
        ok = self._task.cancel()
        if ok and self._on_cancel is not None:
            self._on_cancel()
        return ok

    def exception(self) -> BaseException | None:
        return self._task.exception()

    def __await__(self) -> Generator[Any, None, None]:
        self._waiting()
        return self._task.__await__()
