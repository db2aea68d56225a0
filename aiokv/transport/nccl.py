"""GPU tensors over NCCL point-to-point, one communicator per session.

A session's data flows one way (client -> server), so its communicator only
ever carries sends on the client (rank 0) and receives on the server
(rank 1). Each end posts on a stream of its own for this session, strictly
in grant order; so both ends post the same sequence of operations whatever
the concurrency above them, and a dead peer stalls only its own stream.

Completion is never waited for on the loop: an event is recorded after the
posted operations and the engine's :class:`~aiokv.gpu.cuda.ProgressPoller` (one
client of the loop's waiter, :mod:`aiokv._runtime.waiter`) resolves the future when it fires (or fails it when the communicator
reports an error or is aborted).

Stream ordering: :func:`capture_ready` records an event on the caller's
current stream when ``send`` is called; the send stream waits for it on the
device, so a kernel still writing the tensor finishes before NCCL reads it.
On the receiving side the buffer is allocated on the device's current stream
and the receive stream waits for that stream first, so memory the caching
allocator hands back is never written while an earlier owner still reads it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiokv.gpu.cuda import ProgressPoller, record_event
from aiokv.gpu.nccl.comm import Communicator

from .._config import DEFAULT_NCCL_RECV_BATCH, DEFAULT_NCCL_RECV_BATCH_BYTES
from .._exceptions import TransferAbortedError
from ..protocol.messages import TensorSpec
from .tcp import torch_dtype

__all__ = ["NcclSink", "NcclSource", "capture_ready"]

_ids = itertools.count(1)
# A batch of receives is one NCCL group with one completion event, so it lands
# as a whole: its first transfer is handed out (and its budget re-granted) only
# when its last one finished. Batches are kept small, so several are in flight
# and the next grant is posted while the GPU still has queued work: with
# unbounded batches (up to the whole window) each batch waited a full control
# round trip with the link idle (~0.3-0.4 ms per batch on 2x H200).
# They must not be too small either: posting a group costs ~300 us (the
# non-blocking enqueue settling), and one receive per group at 32 MiB left the
# receiver posting slower than the link (posted->landed 2.1 ms with 16 in
# flight, on 2x H200). A batch may carry about what the link moves in one
# post: 128 MiB. ``EngineConfig.nccl_recv_batch`` / ``nccl_recv_batch_bytes`` override
# (``AIOKV_NCCL_RECV_BATCH="count,MiB"`` for the command-line tools).
_MAX_BATCH = DEFAULT_NCCL_RECV_BATCH
_MAX_BATCH_BYTES = DEFAULT_NCCL_RECV_BATCH_BYTES


def capture_ready(tensors: Sequence[torch.Tensor]) -> torch.cuda.Event:
    """Record, on the caller's current stream, the point the tensors are ready at."""
    return record_event(torch.cuda.current_stream(tensors[0].device))


class NcclSource:
    """Client end: posts ``ncclSend`` of each granted transfer, in grant order."""

    name = "nccl"

    def __init__(self, comm: Communicator, poller: ProgressPoller, device: torch.device) -> None:
        self.comm = comm
        self.poller = poller
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._dead: BaseException | None = None

    async def post_many(
        self, items: Sequence[tuple[Sequence[torch.Tensor], torch.cuda.Event | None]]
    ) -> asyncio.Future[None]:
        """Post several granted transfers (consecutive in grant order) as one NCCL group."""
        if self._dead is not None or self.comm.closed:
            raise TransferAbortedError(f"NCCL link aborted: {self._dead}")
        for _, ready in items:
            if ready is not None:
                self.stream.wait_event(ready)
        keep: list[torch.Tensor] = [t for tensors, _ in items for t in tensors]
        try:
            with torch.cuda.device(self.device), self.comm.group():
                for t in keep:
                    if t.numel():
                        self.comm.send(t, 1, self.stream)
            if self.comm.pending:
                await self.comm.wait_ready()
        except BaseException:
            _hold_until_passed(self.poller, self.stream, keep)
            keep = []  # a traceback keeps this frame: it must not keep the tensors
            items = ()
            raise
        ev = record_event(self.stream)
        # the tensors stay referenced until the send has read them
        return self.poller.wait(ev, self.comm, keepalive=keep)

    def abort(self, exc: BaseException) -> None:
        self._dead = exc
        self.comm.abort()


@dataclass(slots=True)
class _Expected:
    seq: int
    xfer: int
    specs: Sequence[TensorSpec]
    fut: asyncio.Future[list[torch.Tensor]]
    nbytes: int = 0


class NcclSink:
    """Server end: posts ``ncclRecv`` for each grant, in grant order, into fresh buffers."""

    name = "nccl"

    def __init__(
        self,
        comm: Communicator,
        poller: ProgressPoller,
        device: torch.device,
        *,
        max_batch: int = _MAX_BATCH,
        max_batch_bytes: int = _MAX_BATCH_BYTES,
    ) -> None:
        self.comm = comm
        self.poller = poller
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._max_batch, self._max_bytes = max_batch, max_batch_bytes
        self._queue: asyncio.Queue[_Expected] = asyncio.Queue()
        self._dead: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"aiokv-nccl-sink-{next(_ids)}"
        )
        self._landing: deque[
            tuple[list[_Expected], list[list[torch.Tensor]], asyncio.Future[None]]
        ] = deque()

    def expect(
        self, header_seq: int, xfer: int, specs: Sequence[TensorSpec]
    ) -> asyncio.Future[list[torch.Tensor]]:
        fut: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
        if self._dead is not None:
            fut.set_exception(TransferAbortedError(f"NCCL link aborted: {self._dead}"))
            return fut
        self._queue.put_nowait(
            _Expected(header_seq, xfer, specs, fut, sum(s.nbytes for s in specs))
        )
        return fut

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # what was granted meanwhile is posted as one group (one kernel launch), up to a cap
            nbytes = batch[0].nbytes
            while (
                not self._queue.empty()
                and len(batch) < self._max_batch
                and nbytes < self._max_bytes
            ):
                e = self._queue.get_nowait()
                batch.append(e)
                nbytes += e.nbytes
            outs: list[list[torch.Tensor]] = []
            try:
                outs = self._post(batch)
                if self.comm.pending:
                    await self.comm.wait_ready()
                ev = record_event(self.stream)
            except BaseException as exc:
                # Cancelled (the session was dropped) or failed while posting: the
                # buffers stay alive until the stream has passed them, and no frame
                # that a traceback retains may keep them (a cancelled task keeps
                # its CancelledError and so this frame: a 1 GiB receive buffer
                # outlived its session that way on 2x H200).
                _hold_until_passed(self.poller, self.stream, outs)
                outs = []
                cancelled = isinstance(exc, asyncio.CancelledError)
                if cancelled:  # abort() cancelled us mid-post: this batch is lost with the link
                    why = f"NCCL link aborted: {self._dead}"
                else:
                    err = exc.with_traceback(None)
                    self.abort(err)
                    why = f"posting NCCL receive failed: {err}"
                for e in batch:
                    if not e.fut.done():
                        e.fut.set_exception(TransferAbortedError(why))
                batch = []
                if cancelled:
                    raise
                return
            done = self.poller.wait(ev, self.comm, keepalive=outs)
            # Batches land strictly in posting order: a later batch's event may be
            # seen first (the poller's pass, or its fast path), though the stream
            # finished the earlier one before it.
            self._landing.append((batch, outs, done))
            done.add_done_callback(self._drain)
            # nothing of this batch stays in the frame while waiting for the next
            batch = []
            outs = []

    def _post(self, batch: list[_Expected]) -> list[list[torch.Tensor]]:
        dev = self.device
        with torch.cuda.device(dev):
            alloc_stream = torch.cuda.current_stream(dev)
            outs = [
                [torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=dev) for s in e.specs]
                for e in batch
            ]
            self.stream.wait_stream(alloc_stream)
            flat = [t for out in outs for t in out if t.numel()]
            try:
                with self.comm.group():  # its end runs (and launches what was posted) on error too
                    for t in flat:
                        self.comm.recv(t, 0, self.stream)
            except BaseException:
                _hold_until_passed(self.poller, self.stream, outs)
                outs = []
                flat = []
                raise
        return outs

    def _drain(self, _f: asyncio.Future[None] | None = None) -> None:
        while self._landing and self._landing[0][2].done():
            batch, outs, f = self._landing.popleft()
            self._landed(batch, outs, f)

    @staticmethod
    def _landed(
        batch: list[_Expected], outs: list[list[torch.Tensor]], f: asyncio.Future[None]
    ) -> None:
        for e, out in zip(batch, outs):
            if e.fut.done():
                continue
            if f.cancelled():
                e.fut.set_exception(TransferAbortedError("receive cancelled"))
            elif f.exception() is not None:
                exc = f.exception()
                assert exc is not None
                e.fut.set_exception(exc)
            else:
                e.fut.set_result(out)

    def abort(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
        self.comm.abort()
        while self._landing:
            batch, _outs, _f = self._landing.popleft()
            for e in batch:
                if not e.fut.done():
                    e.fut.set_exception(TransferAbortedError(f"NCCL link aborted: {exc}"))
        while not self._queue.empty():
            e = self._queue.get_nowait()
            if not e.fut.done():
                e.fut.set_exception(TransferAbortedError(f"NCCL link aborted: {exc}"))
        if self._task is not asyncio.current_task():
            self._task.cancel()


def _hold_until_passed(poller: ProgressPoller, stream: torch.cuda.Stream, buffers: object) -> None:
    """Keep ``buffers`` referenced until ``stream`` has passed everything queued on it.

    For buffers of operations that may have been posted when posting was cut
    short: freeing them at once could hand memory to the allocator under a
    running (or aborting) NCCL kernel. No communicator is given, so the
    poller waits for the event itself (an aborted kernel exits, and it fires).
    """
    if not buffers:
        return
    try:
        fut = poller.wait(record_event(stream), None, keepalive=buffers)
    except Exception:  # the poller is closed (engine closing): nothing left to wait with
        return
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


def nccl_available(device: str) -> tuple[bool, str]:
    """Whether this process can run the NCCL transport on ``device`` (and why not)."""
    if not device.startswith("cuda"):
        return False, "the engine's device is not CUDA"
    try:
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        from aiokv.gpu.nccl.library import load_library

        lib = load_library()
        lib.require_nonblocking()
    except Exception as exc:
        return False, str(exc)
    return True, ""
