"""The one way aiokv waits for something it can only ask about: one waiter per loop.

Every wait of aiokv that is not a socket or a future -- a CUDA event's ``query()``,
an NCCL communicator leaving ``ncclInProgress``, an ``ncclCommAbort`` on its thread
returning -- is "ask a non-blocking query until it is true or a deadline passes".
:class:`Waiter` does that for every such wait of one event loop
(:func:`waiter_for` gives the loop's own, made on first use):

* :meth:`Waiter.wait_until` -- ``await w.wait_until(query, deadline, spin=...,
  interval=..., max_interval=...)``: True once ``query()`` was true, False once
  ``time.monotonic()`` reached ``deadline``; an exception ``query`` raises is
  raised there.
* :meth:`Waiter.add` -- the same, as a callback the waiter calls at its ticks (what
  :class:`aiokv.gpu.cuda.ProgressPoller` uses to ask all its CUDA events and NCCL
  error states in one pass, and to keep a buffer alive past a cancelled wait).

How a wait is asked, cheapest first:

1. once, at once (a condition that already holds costs no registration);
2. **spinning**: while the wait is due soon (for ``spin`` seconds, the time its
   work is expected to take) it is asked in a callback on every pass of the loop
   (``call_soon``: the loop polls its sockets without sleeping, other tasks run
   in between). One callback serves every spinning wait, and a pass asks only
   those: its cost does not grow with the waits past their spin;
3. **ticking**: past its spin, every ``interval`` seconds, doubling per unanswered
   query up to ``max_interval`` (default: ``interval``, fixed).
   All waits share ONE periodic timer whose period is the smallest interval
   of the waits registered: a ``timerfd`` the loop watches
   (:class:`aiokv._runtime.finesleep.TimerFd`; µs resolution, since the loop's own timers
   end on whole milliseconds) or, where there is none, the loop's ``call_later``.
   A wait whose interval is longer than the period is asked at the first tick at
   least half a period after its last query. While every wait registered spins,
   the timer is disarmed (its fd kept for the next wait past its spin): its ticks
   would wake the spinning loop for nothing.

Guarantees:

* **Never early**: a wait ends False only when ``time.monotonic() >= deadline``,
  read at the tick that ends it; ``query`` is never asked after its wait ended.
* **Latency**: a condition turning true is seen at the next loop pass while the wait
  spins, else at the wait's next query: within its current interval plus the
  loop's wake-up (tens of µs with a timerfd; with the loop's timers the interval
  rounds up to the next millisecond). A deadline is noticed within the same bound.
  The waiting task resumes in the loop pass after the query that ended it (its
  future is set in the tick's callback).
* **CPU**: spinning keeps the loop thread busy (that is its price: µs instead of
  a wake-up from ``epoll_wait``); past the spin the cost is one loop wake-up per
  period for all the waits together, whatever their number; nothing registered:
  no timer, no callback, no fd -- zero.
* **Resources**: at most one ``timerfd`` and one scheduled callback per loop, held
  only while some wait is registered: the last wait's end closes the fd. A loop
  closed with waits still registered leaves their fd to the waiter's finalizer
  (closed when the loop and its waiter are collected); :func:`waiter_for` holds
  waiters weakly, so at most one is alive per loop, and never hands out the waiter
  of a closed loop.
* **Cancellation**: cancelling a task in :meth:`wait_until` unregisters its wait at
  once (no further query). An :meth:`add` callback stays registered until it
  returns True or :meth:`Waiter.discard` removes it -- the caller decides (the
  progress poller keeps a cancelled transfer's buffers until its event fires).

This module knows nothing of engines, CUDA or NCCL; it runs on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

from aiokv._runtime.finesleep import TimerFd, close_box

__all__ = ["DEFAULT_INTERVAL_S", "FinePoll", "WaitEntry", "Waiter", "waiter_for"]

#: the tick of a wait that names none: a quarter of the loop's own timer resolution
DEFAULT_INTERVAL_S = 0.00025

# id(loop) -> its waiter, held weakly: a waiter lives while someone holds it (a wait in
# progress, a poller) or its loop's timer reader does; an idle one holds nothing worth
# keeping, and a loop closed and dropped takes its waiter along
_waiters: weakref.WeakValueDictionary[int, Waiter] = weakref.WeakValueDictionary()


def waiter_for(loop: asyncio.AbstractEventLoop | None = None) -> Waiter:
    """The waiter of ``loop`` (default: the running loop), made on first use."""
    if loop is None:
        loop = asyncio.get_running_loop()
    w = _waiters.get(id(loop))
    if w is None or w._loop is not loop or loop.is_closed():
        w = Waiter(loop)
        if not loop.is_closed():
            _waiters[id(loop)] = w
    return w


class WaitEntry:
    """One registration of :meth:`Waiter.add` (fields may be changed by its owner,
    followed by :meth:`Waiter.reschedule`)."""

    __slots__ = (
        "deadline",
        "fut",
        "interval",
        "max_interval",
        "next_at",
        "owner",
        "poll",
        "query",
        "spin_until",
        "start_interval",
    )

    def __init__(
        self,
        poll: Callable[[float], bool] | None,
        interval: float,
        max_interval: float,
        spin_until: float,
        next_at: float,
    ) -> None:
        self.poll = poll
        # a wait_until's, asked in the tick itself (no callback per query)
        self.query: Callable[[], Any] | None = None
        self.fut: asyncio.Future[bool] | None = None
        self.deadline = 0.0
        self.owner: Any = None  # counts the ticks it was asked at (FinePoll)
        self.interval = interval
        self.start_interval = interval
        self.max_interval = max_interval
        self.spin_until = spin_until
        self.next_at = next_at

    def reset(self, now: float, spin: float) -> None:
        """Activity: spin for ``spin`` more seconds, then tick from the first interval."""
        self.spin_until = max(self.spin_until, now + spin)
        self.interval = self.start_interval
        self.next_at = min(self.next_at, now + self.interval)


class _FdSlot:
    """The fd of a waiter's timer, for its finalizer: a loop closed with waits still
    registered drops the timer's reader; the fd is closed when the waiter goes."""

    def __init__(self) -> None:
        self.box: list[int] = [-1]

    def close(self) -> None:
        close_box(self.box)


class Waiter:
    """The waits of one event loop; see the module docstring. Use :func:`waiter_for`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._entries: list[WaitEntry] = []
        self._timer: TimerFd | None = None
        self._slot = _FdSlot()
        self._period = 0.0  # the timer's period while it runs
        self._handle: asyncio.TimerHandle | None = None  # the ticks without a timerfd
        self._soon: asyncio.Handle | None = None  # the spin callback
        # what a spin pass asks: the entries spinning at the last schedule, until
        # _spin_due (the first spin's end, or the first tick wait due): then a full tick
        self._spinners: list[WaitEntry] = []
        self._spin_due = 0.0
        #: ticks so far (timer ticks and spin passes)
        self.ticks = 0
        #: timer ticks so far
        self.timer_ticks = 0
        weakref.finalize(self, self._slot.close)

    # ------------------------------------------------------------------ state
    @property
    def waiting(self) -> int:
        """Registered waits."""
        return len(self._entries)

    @property
    def ticking(self) -> bool:
        """Whether a timer runs (only while some wait is past its spin)."""
        return self._period > 0 and (self._timer is not None or self._handle is not None)

    @property
    def spinning(self) -> bool:
        """Whether the spin callback is scheduled (only while some wait spins)."""
        return self._soon is not None

    # ------------------------------------------------------------------ waits
    async def wait_until(
        self,
        query: Callable[[], Any],
        deadline: float,
        *,
        spin: float = 0.0,
        interval: float = DEFAULT_INTERVAL_S,
        max_interval: float | None = None,
        _owner: Any = None,
    ) -> bool:
        """True once ``query()`` is true; False once ``time.monotonic() >= deadline``.

        Asked at once, then on every loop pass for ``spin`` seconds (bounded by the
        deadline), then every ``interval`` seconds, growing to ``max_interval``
        (default: ``interval``). Cancellation unregisters the wait at once."""
        if query():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        fut: asyncio.Future[bool] = self._loop.create_future()
        entry = self._register(
            None, interval, max_interval, min(spin, deadline - now), now, query, fut, deadline
        )
        entry.owner = _owner
        try:
            return await fut
        finally:
            self.discard(entry)
            if not fut.done() and not self._loop.is_closed():
                fut.cancel()

    async def wait_for(
        self, query: Callable[[], Any], timeout: float, **kw: Any
    ) -> bool:
        """:meth:`wait_until` with a deadline ``timeout`` seconds from now."""
        return await self.wait_until(query, time.monotonic() + timeout, **kw)

    def add(
        self,
        poll: Callable[[float], bool],
        *,
        interval: float = DEFAULT_INTERVAL_S,
        max_interval: float | None = None,
        spin: float = 0.0,
    ) -> WaitEntry:
        """Call ``poll(now)`` (``now``: ``time.monotonic()``) at the ticks until it
        returns True; see the module docstring for when. Raises ``RuntimeError`` on
        a closed loop."""
        return self._register(poll, interval, max_interval, spin, time.monotonic())

    def _register(
        self,
        poll: Callable[[float], bool] | None,
        interval: float,
        max_interval: float | None,
        spin: float,
        now: float,
        query: Callable[[], Any] | None = None,
        fut: asyncio.Future[bool] | None = None,
        deadline: float = 0.0,
    ) -> WaitEntry:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        if self._loop.is_closed():
            raise RuntimeError("the event loop is closed")
        top = interval if max_interval is None else max(interval, max_interval)
        entry = WaitEntry(poll, interval, top, now + max(spin, 0.0), now + interval)
        entry.query, entry.fut, entry.deadline = query, fut, deadline
        self._entries.append(entry)
        self._schedule(now)
        return entry

    def futures_of(self, owner: object) -> list[asyncio.Future[bool]]:
        """The futures of the :meth:`wait_until` waits registered for ``owner``."""
        return [e.fut for e in self._entries if e.owner is owner and e.fut is not None]

    def discard(self, entry: WaitEntry) -> None:
        """Unregister ``entry`` (idempotent); the timer stops with the last one."""
        try:
            self._entries.remove(entry)
        except ValueError:
            return
        self._schedule(time.monotonic())

    def reschedule(self) -> None:
        """Apply changes made to a :class:`WaitEntry`'s spin or interval."""
        self._schedule(time.monotonic())

    # ------------------------------------------------------------------ ticks
    def _tick(self) -> None:
        self.ticks += 1
        now = time.monotonic()
        slack = self._period / 2
        done: list[WaitEntry] = []
        for e in self._entries[:]:
            spinning = now < e.spin_until
            if not spinning and now < e.next_at - slack:
                continue
            try:
                finished = e.poll(now) if e.poll is not None else self._ask(e, now)
            except Exception as exc:  # (a poll's own bug): reported, its entry dropped
                self._loop.call_exception_handler(
                    {"message": "aiokv waiter: a poll callback failed", "exception": exc}
                )
                finished = True
            if finished:
                done.append(e)
            elif now >= e.spin_until:
                e.next_at = now + e.interval
                if e.interval < e.max_interval:
                    e.interval = min(e.interval * 2, e.max_interval)
        for e in done:
            try:
                self._entries.remove(e)
            except ValueError:  # (discarded by its own poll)
                pass
        self._schedule(now)

    def _ask(self, e: WaitEntry, now: float) -> bool:
        """A :meth:`wait_until`'s query at a tick; True when its wait is over."""
        fut = e.fut
        if fut is None or fut.done():
            return True
        o = e.owner
        if o is not None and o._last_tick != self.ticks:
            o._last_tick = self.ticks
            o.ticks += 1
        try:
            fired = e.query() if e.query is not None else True
        except Exception as exc:  # (a sticky CUDA error, a closed poll): raised in the wait
            fut.set_exception(exc)
            return True
        if fired:
            fut.set_result(True)
            return True
        if now >= e.deadline:
            fut.set_result(False)
            return True
        return False

    def _spin_tick(self) -> None:
        """A spin pass: asks the spinning waits only, not walking the others, until a
        spin ends or a ticking wait is due (then a full :meth:`_tick`), so that a pass
        costs the same whatever the number of waits past their spin."""
        self._soon = None
        now = time.monotonic()
        if now >= self._spin_due:
            self._tick()
            return
        self.ticks += 1
        done: list[WaitEntry] | None = None
        for e in self._spinners:
            try:
                finished = e.poll(now) if e.poll is not None else self._ask(e, now)
            except Exception as exc:  # (a poll's own bug): reported, its entry dropped
                self._loop.call_exception_handler(
                    {"message": "aiokv waiter: a poll callback failed", "exception": exc}
                )
                finished = True
            if finished:
                if done is None:
                    done = []
                done.append(e)
        if done is not None:
            for e in done:
                try:
                    self._entries.remove(e)
                except ValueError:  # (discarded by its own poll)
                    pass
            self._schedule(now)
        elif self._soon is None and self._spinners:
            self._soon = self._loop.call_soon(self._spin_tick)

    def _timer_tick(self) -> None:
        self.timer_ticks += 1
        self._tick()

    def _loop_tick(self) -> None:
        self._handle = None
        if self._period > 0:
            self._handle = self._loop.call_later(self._period, self._loop_tick)
        self._timer_tick()

    def _schedule(self, now: float) -> None:
        entries = self._entries
        if not entries or self._loop.is_closed():
            self._stop_timer()
            self._spinners = []
            if self._soon is not None:
                self._soon.cancel()
                self._soon = None
            return
        spinners: list[WaitEntry] = []
        period = 0.0
        spin_end = next_at = float("inf")
        for e in entries:
            if now < e.spin_until:
                spinners.append(e)
                spin_end = min(spin_end, e.spin_until)
            else:
                next_at = min(next_at, e.next_at)
                if period == 0.0 or e.interval < period:
                    period = e.interval
        self._spinners = spinners
        if spinners and self._soon is None:
            self._soon = self._loop.call_soon(self._spin_tick)
        if period == 0.0:
            self._pause_timer()  # (all spin: no tick until one stops; its fd is kept)
        elif not (self.ticking and period == self._period):
            self._start_timer(period)
        self._spin_due = min(spin_end, next_at - self._period / 2)

    def _start_timer(self, period: float) -> None:
        self._period = period
        timer = self._timer
        if timer is None and self._handle is None:
            timer = self._timer = TimerFd.open(self._loop)
            if timer is not None:
                self._slot.box = timer.fd_box()
        if timer is not None:
            try:
                timer.every(period, self._timer_tick)
                return
            except OSError:  # (the timer failed: the loop's own from now on)
                self._close_timer()
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_later(period, self._loop_tick)

    def _pause_timer(self) -> None:
        """No ticks while every wait spins: a timer ticking meanwhile woke the loop for
        nothing at every period, and each wake-up slowed the spinning loop (measured: a
        quarter fewer loop passes at 0.2 ms, asyncio and uvloop). The timerfd stays
        open (re-armed by the next wait past its spin); the loop's own timer is
        cancelled."""
        if self._period == 0.0:
            return
        self._period = 0.0
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()
        if self._timer is not None:
            try:
                self._timer.pause()
            except OSError:  # (the timer failed: closed; the loop's own from now on)
                self._close_timer()

    def _close_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.close()

    def _stop_timer(self) -> None:
        self._period = 0.0
        self._close_timer()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()


class FinePoll:
    """Waits for conditions (a CUDA event's ``query``) by asking them every
    ``interval_s``: a name for :meth:`aiokv._runtime.waiter.Waiter.wait_until` on the running
    loop's waiter, whose ONE periodic timer serves every wait of the loop (see
    :mod:`aiokv._runtime.waiter`: N waits cost one loop wake-up per tick, not N; the waiting
    task resumes in the loop pass after the tick that ended it; a wait that gives up
    leaves nothing registered; the timer stops when no wait is left). What this
    adds: :meth:`aclose` fails the waits of this poll still registered, and
    :attr:`ticks` counts the ticks at which its waits were asked."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._waiter: Waiter | None = None
        self._last_tick = -1
        self.ticks = 0

    @property
    def waiting(self) -> int:
        return 0 if self._waiter is None else len(self._waiter.futures_of(self))

    @property
    def ticking(self) -> bool:
        """Whether the loop's waiter runs a timer (only while some wait is registered)."""
        return self._waiter is not None and self._waiter.ticking

    async def wait(self, query: Callable[[], Any], timeout: float) -> bool:
        """True once ``query()`` was true, False once ``timeout`` seconds passed
        (noticed at the tick after); an exception ``query`` raises is raised here."""
        if timeout <= 0:
            return False
        waiter = self._waiter = waiter_for()
        return await waiter.wait_until(
            query, time.monotonic() + timeout, interval=self.interval_s, _owner=self
        )

    async def aclose(self, error: BaseException | None = None) -> None:
        """Waits of this poll still registered fail with ``error`` now (None: they go
        on to their own ends). A later wait works as before."""
        if error is not None and self._waiter is not None:
            for fut in self._waiter.futures_of(self):
                if not fut.done():
                    fut.set_exception(error)
