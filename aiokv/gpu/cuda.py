"""CUDA events and streams seen from asyncio: futures resolved when GPU work ends.

:class:`ProgressPoller` is how the engine's NCCL transfers learn that GPU work
finished; it is one client of the loop's waiter (:mod:`aiokv._runtime.waiter`), whose other
clients (the IPC plane's event waits, NCCL's settle polls) ask their own queries.
It never calls ``synchronize()``: it asks each registered event ``query()``
(a non-blocking ``cudaEventQuery``) and each communicator with waiters its
``async_error()``, and resolves the matching asyncio futures.

When it asks, designed from the measurements in ``docs/benchmarks.md`` (an idle
loop's own timers end on whole milliseconds; a wake-up from ``epoll_wait`` costs
tens to hundreds of µs; spinning costs a core):

1. **spins** (asked on every loop pass, other tasks still run in between) while a
   completion is due: for ``spin_s`` after any activity (a new registration
   or a completion), and until the soonest ``expected_s`` hint given to
   :meth:`ProgressPoller.wait` (plus ``spin_s``);
2. then **backs off**: asked at the waiter's timer ticks, every ``min_sleep_s``
   doubling to ``max_sleep_s`` — an op that runs longer than expected costs at
   most one ``max_sleep_s`` of extra latency, and an idle-but-registered wait
   costs ~nothing;
3. **parks** when nothing is registered: no callback, no timer, no CPU.

A waiter whose task is cancelled stays registered (with its ``keepalive``
object, e.g. the buffers an NCCL kernel is still reading) until the event
fires: a completion is never dropped and memory is never freed under a kernel.
An asynchronous error on a waiter's communicator fails that waiter with
:class:`~aiokv.NcclError`; an aborted communicator fails its waiters with
:class:`~aiokv.TransferAbortedError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from aiokv._exceptions import EngineClosedError, NcclError, TransferAbortedError
from aiokv._runtime.waiter import WaitEntry, Waiter, waiter_for

__all__ = [
    "AsyncErrorSource",
    "EventLike",
    "PollerStats",
    "ProgressPoller",
    "module_loading",
    "order_after",
    "preload_copy_kernels",
    "record_event",
    "stream_wait",
]

_SUCCESS = 0
_IN_PROGRESS = 7


@runtime_checkable
class EventLike(Protocol):
    """Anything with a non-blocking ``query() -> bool`` (a ``torch.cuda.Event``)."""

    def query(self) -> bool: ...


@runtime_checkable
class AsyncErrorSource(Protocol):
    """What the poller needs of a communicator (see :class:`aiokv.gpu.nccl.Communicator`)."""

    @property
    def aborted(self) -> bool: ...

    def async_error(self) -> int: ...


# --------------------------------------------------------------------------- helpers


def record_event(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """Record a fresh (timing-free) event on ``stream`` (default: the current stream)."""
    ev = torch.cuda.Event(enable_timing=False)  # type: ignore[no-untyped-call]
    ev.record(stream if stream is not None else torch.cuda.current_stream())
    return ev


def stream_wait(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """Make future work on ``stream`` wait for ``event`` (GPU-side; the host does not wait)."""
    stream.wait_event(event)


def order_after(
    stream: torch.cuda.Stream, producer: torch.cuda.Stream | None = None
) -> torch.cuda.Event:
    """Order ``stream`` after everything queued so far on ``producer`` (default: current).

    This is how a send stream is kept behind the compute that wrote the tensor.
    Returns the event recorded on ``producer``.
    """
    ev = record_event(producer if producer is not None else torch.cuda.current_stream())
    stream.wait_event(ev)
    return ev


def module_loading() -> str:
    """How this process's CUDA loads kernels: ``"LAZY"`` (torch's default) or ``"EAGER"``.

    Read from ``CUDA_MODULE_LOADING``, which CUDA reads once, when the context
    is created. Under lazy loading the first launch of a kernel loads its
    module, and that load waits until the GPU has no work left, holding the
    context lock (every CUDA call of every thread waits behind it). An NCCL
    kernel waiting for its peer is work left: see docs/reliability.md,
    "First launches and NCCL".
    """
    return os.environ.get("CUDA_MODULE_LOADING", "LAZY").strip().upper() or "LAZY"


def preload_copy_kernels(device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
    """Launch once, now, the kernels aiokv itself runs between NCCL operations.

    aiokv's only kernel on the data path is the copy that makes a strided
    tensor contiguous before it is sent (one kernel per dtype). Under lazy
    module loading its first launch would wait for every queued NCCL kernel
    (see :func:`module_loading`); launched at engine start, before any
    communicator exists, it loads at no risk. Nothing is waited for here.
    """
    with torch.cuda.device(device):
        for dt in dtypes:
            torch.empty((2, 2), dtype=dt, device=device).t().contiguous()


# --------------------------------------------------------------------------- poller


@dataclass(slots=True)
class _Waiter:
    event: EventLike
    future: asyncio.Future[None]
    comm: AsyncErrorSource | None
    keepalive: Any
    due: float  # perf_counter time by which completion is expected (spin until then)
    registered: float
    failed_at: float = 0.0


@dataclass(slots=True)
class PollerStats:
    """Counters of a :class:`ProgressPoller` (see :meth:`ProgressPoller.statistics`)."""

    registered: int = 0
    completed: int = 0
    failed: int = 0
    fast_path: int = 0
    passes: int = 0
    spin_passes: int = 0
    sleeps: int = 0
    parks: int = 0
    pending: int = 0
    orphaned: int = 0  # waiters whose awaiting task went away, kept until their event fires
    extra: dict[str, int] = field(default_factory=dict)


class ProgressPoller:
    """Turns CUDA events into resolved futures, on its loop's :mod:`aiokv._runtime.waiter`.

    ``wait(event, comm)`` returns a future; it is resolved when ``event.query()``
    is true, or failed when ``comm`` reports an asynchronous error or was aborted.
    All the poller's waits are asked in one pass, one registration with the loop's
    waiter (shared with every other poller and wait of that loop: the engine's and
    the IPC plane's pollers tick on the same timer). The registration starts with
    the first wait (or :meth:`start`) and ends when nothing is left; end with
    ``await stop()``.
    """

    def __init__(
        self,
        *,
        spin_s: float = 0.0005,
        min_sleep_s: float = 0.0002,
        max_sleep_s: float = 0.002,
        orphan_grace_s: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not (0 <= spin_s and 0 < min_sleep_s <= max_sleep_s):
            raise ValueError("need spin_s >= 0 and 0 < min_sleep_s <= max_sleep_s")
        self.spin_s = spin_s
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.orphan_grace_s = orphan_grace_s
        self._clock = clock
        self._waiters: list[_Waiter] = []
        self._waiter: Waiter | None = None  # the loop's, bound at the first start
        self._entry: WaitEntry | None = None  # registered with it while work is left
        self._stopped = False
        self._active_until = 0.0  # spin until this clock time
        self._hold_until = 0.0  # touch(): keep the loop spinning until then, even idle
        self._stats = PollerStats()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Register with the running loop's waiter (idempotent)."""
        if self._stopped:
            raise EngineClosedError("the progress poller is stopped")
        if self._waiter is None:
            self._waiter = waiter_for()
        now = self._clock()
        spin = max(self._active_until, self._hold_until) - now
        if self._entry is None:
            self._entry = self._waiter.add(
                self._pass,
                interval=self.min_sleep_s,
                max_interval=self.max_sleep_s,
                spin=spin,
            )
        else:
            self._entry.reset(time.monotonic(), spin)
            self._waiter.reschedule()

    async def stop(self) -> None:
        """Unregister; every still-pending waiter fails with :class:`EngineClosedError`."""
        self._stopped = True
        entry, self._entry = self._entry, None
        if entry is not None and self._waiter is not None:
            self._waiter.discard(entry)
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            self._fail(w, EngineClosedError("the progress poller stopped before this completed"))

    def touch(self, spin_s: float = 0.005) -> None:
        """Keep the loop spinning (yielding) for ``spin_s``, even with nothing to poll.

        The engine calls this when it expects a control reply soon (it sent a
        RESERVE or a GRANT): while the loop spins, the reply's socket is read on
        the next loop pass instead of after the loop thread is woken from
        ``epoll_wait`` — a wake-up that cost tens to hundreds of µs per hop
        on an idle host (docs/benchmarks.md).
        """
        if self._stopped:
            return
        until = self._clock() + spin_s
        if until > self._hold_until:
            self._hold_until = until
        self.start()

    @property
    def running(self) -> bool:
        """Whether the poller is registered with its loop's waiter."""
        return self._entry is not None

    @property
    def pending(self) -> int:
        """Completions still awaited (safe to read from another thread)."""
        return len(self._waiters)

    def statistics(self) -> PollerStats:
        self._stats.pending = len(self._waiters)
        self._stats.orphaned = sum(1 for w in self._waiters if w.future.done())
        return dataclasses.replace(self._stats, extra=dict(self._stats.extra))

    # ------------------------------------------------------------------ waiting
    def wait(
        self,
        event: EventLike,
        comm: AsyncErrorSource | None = None,
        *,
        keepalive: Any = None,
        expected_s: float | None = None,
    ) -> asyncio.Future[None]:
        """A future resolved once ``event.query()`` is true.

        ``comm``: fail the future if that communicator errors or is aborted.
        ``keepalive``: held until the event fires, even if the future is cancelled.
        ``expected_s``: how long the GPU work should take; the poller spins
        until then, so a 1 ms transfer is noticed within µs.
        """
        if self._stopped:
            raise EngineClosedError("the progress poller is stopped")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if comm is not None and comm.aborted:
            fut.set_exception(TransferAbortedError("the NCCL communicator was aborted"))
            return fut
        if not self._waiters and event.query():  # fast path: nothing earlier pending
            self._stats.fast_path += 1
            fut.set_result(None)
            return fut
        now = self._clock()
        due = now + (expected_s if expected_s is not None and expected_s > 0 else 0.0)
        self._waiters.append(_Waiter(event, fut, comm, keepalive, due, now))
        self._stats.registered += 1
        self._active_until = max(self._active_until, due + self.spin_s)
        self.start()
        return fut

    async def wait_event(
        self,
        event: EventLike,
        comm: AsyncErrorSource | None = None,
        *,
        keepalive: Any = None,
        expected_s: float | None = None,
    ) -> None:
        """``await`` form of :meth:`wait`."""
        await self.wait(event, comm, keepalive=keepalive, expected_s=expected_s)

    # ------------------------------------------------------------------ the task
    def _fail(self, w: _Waiter, exc: BaseException) -> None:
        self._stats.failed += 1
        if not w.future.done():
            w.future.set_exception(exc)
            # the awaiting side may be gone already; do not warn "never retrieved"
            w.future.exception()

    def _poll_once(self) -> int:
        """One pass over every waiter; returns how many left the list.

        A communicator's failure is checked before the event: an aborted NCCL
        kernel exits and its event fires, which must not read as success. The
        failed waiter stays registered (keeping its buffers alive) until its
        event fires or ``orphan_grace_s`` passes.
        """
        self._stats.passes += 1
        comm_state: dict[int, BaseException | None] = {}
        keep: list[_Waiter] = []
        done = 0
        now = self._clock()
        for w in self._waiters:
            err: BaseException | None = None
            if w.comm is not None:
                key = id(w.comm)
                if key not in comm_state:
                    comm_state[key] = self._comm_error(w.comm)
                err = comm_state[key]
            try:
                fired = w.event.query()
            except Exception as exc:  # a sticky CUDA error: the work will never complete
                self._fail(w, TransferAbortedError(f"CUDA event query failed: {exc}"))
                done += 1
                continue
            if err is not None:
                if w.failed_at == 0.0:
                    w.failed_at = now
                    self._fail(w, err)
                if fired or now - w.failed_at > self.orphan_grace_s:
                    done += 1
                else:
                    keep.append(w)
                continue
            if fired:
                self._stats.completed += 1
                if not w.future.done():
                    w.future.set_result(None)
                done += 1
                continue
            keep.append(w)
        self._waiters = keep
        return done

    @staticmethod
    def _comm_error(comm: AsyncErrorSource) -> BaseException | None:
        if comm.aborted:
            return TransferAbortedError("the NCCL communicator was aborted")
        try:
            state = comm.async_error()
        except Exception as exc:
            return TransferAbortedError(f"could not query the NCCL communicator: {exc}")
        if state in (_SUCCESS, _IN_PROGRESS):
            return None
        if comm.aborted:
            return TransferAbortedError("the NCCL communicator was aborted")
        lib = getattr(comm, "lib", None)
        handle = getattr(comm, "handle", None)
        if lib is not None and hasattr(lib, "error"):
            err = lib.error(state, "NCCL communicator (asynchronous error)", handle)
            if isinstance(err, NcclError):
                return err
        return NcclError(
            f"NCCL communicator reported asynchronous error {state}",
            code=state,
            code_name=_result_name(state),
        )

    def _pass(self, _now: float) -> bool:
        """One pass of the waiter over this poller; True once it has nothing left.

        Spins (a pass on every loop pass) while a completion is due -- for ``spin_s``
        after any activity and until the soonest ``expected_s`` hint -- or while
        :meth:`touch`'s window lasts; past that the waiter asks every
        ``min_sleep_s``, doubling to ``max_sleep_s``; back to both at each completion.
        """
        entry = self._entry
        now = self._clock()
        spinning = now < self._active_until or now < self._hold_until
        if self._waiters:
            if spinning:
                self._stats.spin_passes += 1
            else:
                self._stats.sleeps += 1
            if self._poll_once():
                self._active_until = max(self._active_until, now + self.spin_s)
                if entry is not None:
                    entry.reset(time.monotonic(), self._active_until - now)
            if self._waiters:
                return False
        if now < self._hold_until:
            if not self._waiters:
                self._stats.spin_passes += 1
            return False
        self._stats.parks += 1
        self._entry = None
        return True


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _result_name(code: int) -> str:
    names = {
        1: "ncclUnhandledCudaError",
        2: "ncclSystemError",
        3: "ncclInternalError",
        4: "ncclInvalidArgument",
        5: "ncclInvalidUsage",
        6: "ncclRemoteError",
        8: "ncclTimeout",
    }
    return names.get(code, f"ncclResult({code})")
