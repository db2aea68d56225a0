"""The IPC plane's shared state (:class:`PlaneState`): what every part of one
:class:`~aiokv.kv.ipc.IpcPlane` works on -- its connector (:class:`ConnectorPort`), the
control channel, the options, the backend and driver, the consumer's mappings and abort
words, the counters -- and the helpers they all use (messages, block ids, the current
stream, releases, producer events and the waits for them, on the loop's one waiter).

The parts hold it as ``self.s``; it knows none of them (docs/ipc.md, "Structure").
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from aiokv._runtime.threads import in_daemon
from aiokv._runtime.waiter import waiter_for

from ..._exceptions import (
    EngineClosedError,
    IpcUnavailableError,
    TransferTimeoutError,
)
from ..ops import _to_device, plain_block_ids
from . import _cudrv
from ._common import (
    AnswerWait,
    Backend,
    ControlChannel,
    CudaBackend,
    EngineChannel,
    boot_id,
    log,
    unsupported_reason,
)
from ._mapping import AbortWords, Mapper, _Mapping
from ._wire import Descriptor, Release
from .interfaces import ConnectorPort
from .options import IpcOptions, IpcStatistics

#: how long a wait for a CUDA event is asked on every loop pass (a forward pass or a
#: copy that ends within it is noticed within microseconds)
_READY_SPIN_S = 0.002


class PlaneState:
    """The state the parts of one plane share, and the helpers they use on it."""

    def __init__(
        self,
        port: ConnectorPort,
        options: IpcOptions,
        *,
        backend: Backend | None,
        channel: ControlChannel | None,
        clock: Callable[[], float],
    ) -> None:
        self.port = port
        self.channel: ControlChannel = (
            channel if channel is not None else EngineChannel(port.engine)
        )
        self.options = options
        self.layout = port.layout
        self.device = port.device
        self.backend: Backend = backend if backend is not None else CudaBackend()
        self.clock = clock
        self.stats = IpcStatistics()
        self.boot_id = boot_id()
        cfg = getattr(port.engine, "config", None)
        authenticated = getattr(cfg, "curve", None) is not None
        self.disabled: str | None = (
            unsupported_reason(self.device, authenticated=authenticated, options=options)
            if backend is None
            else None
        )
        if self.disabled:
            log.info("IPC plane off for this connector: %s", self.disabled)
        self.background: set[asyncio.Task[None]] = set()
        self.closed = False
        # event waits still running when the plane's aclose ends fail (a dead
        # producer's never fire)
        self.waits_ended = False
        # consumer: the verified mappings of producers' exports, by token
        self.maps: dict[int, _Mapping] = {}
        # abort words (never freed; a slot is a global number, the ids buffers are keyed
        # by it, so no two slots ever share a word) and what a launch may touch forever
        self.words = AbortWords(self.device, self.backend)
        self.keep: list[Any] = []
        # the CUDA set-up the first mapping needs (control stream, pinned sources, the
        # first abort block), made once on a daemon thread
        self.prepared: asyncio.Future[None] | None = None
        self.deferred: list[tuple[Descriptor, Release]] = []  # ok releases, sent soon
        # the driver for the per-request CUDA calls (options.driver_calls, real CUDA)
        self.drv = (
            _cudrv.driver()
            if backend is None and options.driver_calls and self.device.type == "cuda"
            else None
        )
        self.dev_index = self.device.index if self.device.index is not None else 0
        self.mapper = Mapper(
            self.device,
            self.layout,
            port.caches,
            self.backend,
            options,
            self.drv,
            self.words,
            warm=not self.disabled and backend is None,
        )

    async def cuda_ready(self) -> None:
        """On a GPU: the CUDA set-up a mapping needs (what the mapping thread shares
        with the loop: the control stream, the abort copies' pinned sources and the
        probe copies' abort slots), made once off the loop; waited for by each
        mapping of an export (a producer's, or a consumer's push export)."""
        if self.device.type == "cuda":
            if self.prepared is None:
                self.prepared = in_daemon(self.words.prepare, "aiokv-ipc-prep")
            await asyncio.shield(self.prepared)

    def statistics(self) -> IpcStatistics:
        return dataclasses.replace(self.stats, fallbacks=dict(self.stats.fallbacks))

    def count_fallback(self, reason: str, peer: str, detail: str = "") -> None:
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        self.log_fallback(reason, peer, detail)

    def log_fallback(self, reason: str, peer: str, detail: str = "") -> None:
        log.warning(
            "aiokv IPC plane: falling back to the ordinary transport with %s: %s%s",
            peer,
            reason,
            f" ({detail})" if detail else "",
        )

    def track(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def send_msg(
        self,
        tensor_id: str,
        msg: Mapping[str, Any],
        to: str,
        timeout: float,
        waiter: AnswerWait | None = None,
    ) -> None:
        """Start sending a control message; a failure is never left unretrieved. It is
        logged, and handed to ``waiter`` (:meth:`AnswerWait.message_failed`): the wait
        of the caller for the peer's answer to this message."""
        h = self.channel.send(tensor_id, msg, to=to, timeout=timeout)

        async def reap() -> None:
            try:
                await h
            except Exception as exc:
                log.warning("aiokv IPC plane: sending %r to %s failed: %s", tensor_id, to, exc)
                if waiter is not None:
                    waiter.message_failed(exc)

        self.track(reap())

    def ids(
        self, block_ids: torch.Tensor | Sequence[int], *, unique: bool, what: str
    ) -> tuple[int, ...]:
        """Block ids as a checked tuple (the connector's rules). A list or tuple of ints
        is checked in Python: the torch calls of the connector's check cost ~80 µs per
        request on an H200 host, more than the copy itself."""
        ids = plain_block_ids(block_ids, self.layout.num_blocks, unique=unique, what=what)
        if ids is not None:
            return tuple(ids)
        return tuple(self.port.host_ids(block_ids, unique=unique, what=what).tolist())

    def begin(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        timeout: float | None,
        *,
        unique: bool,
        what: str,
    ) -> tuple[float, tuple[int, ...]]:
        """A request's start on either side (``what``: ``"send"`` or ``"recv"``): the
        connector open, the request id checked, its deadline, its checked block ids."""
        self.port.check_request(request_id)
        deadline = self.port.deadline(timeout)
        return deadline, self.ids(block_ids, unique=unique, what=f"{what}_request")

    async def recv_plain(
        self,
        rid: str,
        host: tuple[int, ...],
        frm: str | None,
        deadline: float,
        layerwise: bool,
    ) -> None:
        """The request the ordinary way (the connector's engine path), in what is left
        of its deadline."""
        await self.port.recv_plain(
            rid,
            host,
            frm=frm,
            timeout=max(0.0, deadline - time.monotonic()),
            layerwise=layerwise,
        )

    def ids_buffers(self, n: int) -> tuple[int, torch.Tensor, torch.Tensor, memoryview]:
        """New buffers for ``n`` block pairs' ids (``2 n`` int64, rounded up to a power of
        two, at least 64): ``(capacity, pinned host buffer, its device twin -- the host
        one itself on CPU --, a memoryview of the host one for struct.pack_into)``."""
        from ...transport.tcp import tensor_buffer

        cap = max(64, 1 << max(0, 2 * n - 1).bit_length())
        cuda = self.device.type == "cuda"
        pin = torch.empty(cap, dtype=torch.int64, pin_memory=cuda)
        dev = torch.empty(cap, dtype=torch.int64, device=self.device) if cuda else pin
        return cap, pin, dev, tensor_buffer(pin)

    def raw_stream(self) -> int | None:
        """The caller's current stream on this plane's device as a raw handle, when the
        driver calls can be used (driver loaded, this device is the current one: the
        kernel and events live in its context); None otherwise."""
        if self.drv is None or not self.on_device():
            return None
        return int(torch._C._cuda_getCurrentRawStream(self.dev_index))

    def on_device(self) -> bool:
        """Whether this plane's device is the current one (its context is current)."""
        return bool(torch.cuda.current_device() == self.dev_index)

    def release(self, desc: Descriptor, rel: Release) -> None:
        try:
            self.send_msg(
                f"{desc.rid}#ipcrel", rel.to_wire(), desc.reply_to, self.options.grace_s + 30.0
            )
        except Exception as exc:  # engine closing: the producer's lease runs out instead
            log.warning("aiokv IPC plane: could not send the release of %r: %s", desc.rid, exc)

    def event(self, m: _Mapping, slot: int, handle: bytes) -> Any:
        """The producer's IPC event in ``slot`` (opened once per slot and handle)."""
        cached = m.events.get(slot)
        if cached is not None and cached[0] == handle:
            return cached[1]
        try:
            ev = self.backend.open_event(handle, self.device)
        except Exception as exc:
            raise IpcUnavailableError("event_failed", f"{type(exc).__name__}: {exc}") from None
        if len(m.events) >= 4096:
            m.events.clear()
        m.events[slot] = (handle, ev)
        return ev

    def release_soon(self, desc: Descriptor, rel: Release) -> None:
        """Send ``rel`` two loop passes from now: the caller of ``recv_request``, woken
        by its return in the next pass, runs before the release is encoded and sent.
        Releases of one pass go together; the plane's ``aclose`` sends any still waiting."""
        self.deferred.append((desc, rel))
        if len(self.deferred) == 1:
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self.flush_releases)

    def flush_releases(self) -> None:
        pending, self.deferred = self.deferred, []
        for desc, rel in pending:
            self.release(desc, rel)

    def tables(self, m: _Mapping, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination base-address tables of layers ``[lo, hi)`` (device)."""
        t = m.tables.get((lo, hi))
        if t is None:
            if lo == 0 and hi == self.layout.num_layers:
                t = (m.src_table, self.port.caches.ptr_table(range(lo, hi)))
            else:
                src = [x.data_ptr() for x in m.src_layers[lo:hi]]
                dst = [x.data_ptr() for x in self.port.caches.tensors[lo:hi]]
                # from pinned memory, not blocking: a copy from pageable memory first
                # waits for the stream's queued work -- a producer's forward, when a
                # layer-wise push makes its first layer's table
                both = _to_device(torch.tensor([src, dst], dtype=torch.int64), self.device)
                t = (both[0].clone(), both[1].clone())  # two allocations, both aligned
            m.tables[(lo, hi)] = t
        return t

    async def event_fired(self, ev: Any, until: float) -> bool:
        """True once CUDA event ``ev`` fired, False at ``until`` (``time.monotonic``).

        Queried from the waiting task on every loop pass (``sleep(0)``: other tasks run
        between queries) for the first ``_READY_SPIN_S`` -- a copy or the end of a
        forward within it is noticed a pass after it --, then a wait of the loop's one
        waiter (:mod:`aiokv._runtime.waiter`), asked every ``options.event_poll_s`` on
        its timer (a timerfd: the loop's own sleeps end on whole milliseconds, which
        noticed an event 0.5 ms late on average). Nothing stays registered afterwards
        (a dead producer's event never fires); a wait still registered when the
        plane's ``aclose`` ends fails with :class:`~aiokv.EngineClosedError`.

        The spin stays in the task: a wait the waiter ends resumes its task one loop
        pass after the query that saw the event (the waiter sets its future), which
        measured 4-5 µs more per wait at p50 on CPU (asyncio and uvloop alike), and
        most copies end within the spin: every request would pay it."""
        spin_until = time.monotonic() + _READY_SPIN_S
        while not bool(ev.query()):
            now = time.monotonic()
            if now >= until:
                return False
            if now >= spin_until:

                def fired() -> bool:
                    if self.waits_ended:
                        raise EngineClosedError("the IPC plane closed during the wait")
                    return bool(ev.query())

                return await waiter_for().wait_until(
                    fired, until, interval=self.options.event_poll_s
                )
            await asyncio.sleep(0)
        return True

    async def wait_done(self, done: Any, timeout: float) -> None:
        """Wait for a request's copy to end (:meth:`event_fired`); ``TimeoutError``
        after ``timeout``."""
        if not await self.event_fired(done, time.monotonic() + timeout):
            raise TimeoutError

    async def wait_ready(
        self, ev: Any, until: float, what: str = "the producer's ready event did not fire"
    ) -> None:
        """Wait for the producer's event (its ready event; push mode: its copy's
        completion; :meth:`event_fired`), or raise :class:`~aiokv.TransferTimeoutError`
        ("IPC: ``what`` in time") at ``until`` (``time.monotonic``)."""
        if not await self.event_fired(ev, until):
            raise TransferTimeoutError(f"IPC: {what} in time")
