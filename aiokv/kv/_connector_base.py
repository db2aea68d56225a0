"""What every part of :class:`~aiokv.kv.KVConnector` shares: the engine it needs
(typed structurally), its counters, and :class:`ConnectorState` -- the one state
object its parts (the chunked, batched and pull paths, the IPC plane's port) hold,
with the argument checks, the deadline, the staging pool, the cache copies and the
bookkeeping of finished requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from aiokv._runtime.deadlines import _time_left
from aiokv._runtime.threads import in_pool

from .._exceptions import AiokvTimeoutError, ConfigError, EngineClosedError, TransferTimeoutError
from ._request_codec import RequestCodec
from .ipc.interfaces import Plane
from .ipc.options import IpcStatistics
from .layouts import KVLayout
from .ops import BoundCaches, Lease, PoolStatistics, StagingPool, gather_blocks


class SendHandle(Protocol):
    """What ``send_nowait`` returns: awaitable outcome, plus when the buffer is free."""

    def __await__(self) -> Generator[Any, None, None]: ...

    async def released(self) -> None: ...


@runtime_checkable
class _PullEngine(Protocol):
    """What pull mode (:meth:`KVConnector.serve_request` / :meth:`~KVConnector.fetch_request`)
    needs of the engine besides :class:`EngineLike`: GET mode, once-published tensors."""

    def publish(
        self,
        tensor_id: str,
        tensor: torch.Tensor,
        *,
        once: bool = False,
        on_get: Callable[[str], None] | None = None,
    ) -> None: ...

    def unpublish(self, tensor_id: str) -> bool: ...

    async def wait_fetched(self, tensor_id: str, *, timeout: float | None = None) -> str: ...

    async def get(
        self, tensor_id: str, *, frm: str, timeout: float | None = None
    ) -> torch.Tensor: ...


class EngineLike(Protocol):
    """What the connector needs of an :class:`aiokv.Engine` (typed structurally)."""

    def send_nowait(
        self, tensor_id: str, tensor: torch.Tensor, *, to: str, timeout: float | None = None
    ) -> SendHandle: ...

    async def recv(
        self, tensor_id: str, *, frm: str | None = None, timeout: float | None = None
    ) -> torch.Tensor: ...


MiB = 1 << 20
T = TypeVar("T")

_DEFAULT_TIMEOUT = 60.0


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """Cancellation requests pending on ``task`` (Python >= 3.11; 0 before)."""
    if task is None or sys.version_info < (3, 11):
        return 0
    return task.cancelling()


def _check_cancelled(task: asyncio.Task[Any] | None, base: int) -> None:
    """Raise CancelledError if the task was cancelled since ``base`` was read, also when
    an await swallowed it (``asyncio.wait_for`` returns a result that completed in the
    same loop pass as the cancel, on Python <= 3.11)."""
    if task is not None and _cancelling(task) > base:
        raise asyncio.CancelledError()


@runtime_checkable
class _Discards(Protocol):
    """An engine that can drop received tensors (:meth:`aiokv.Engine.discard`)."""

    def discard(self, tensor_id_or_prefix: str) -> int: ...


@dataclass(slots=True)
class ConnectorStatistics:
    """Counters of one connector (a snapshot; see :meth:`KVConnector.statistics`).

    ``*_seconds`` are the summed wall times of the completed requests (from the
    call until the last chunk was acknowledged / scattered).
    """

    requests_sent: int = 0
    requests_received: int = 0
    send_failures: int = 0
    recv_failures: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    chunks_sent: int = 0
    chunks_received: int = 0
    send_seconds: float = 0.0
    recv_seconds: float = 0.0
    staging: PoolStatistics | None = field(default=None)
    ipc: IpcStatistics | None = field(default=None)


@dataclass(slots=True, eq=False)
class _LayerSave:
    to: str
    n_blocks: int
    started: float
    tasks: dict[int, asyncio.Task[BaseException | None]] = field(default_factory=dict)
    header: asyncio.Task[BaseException | None] | None = None


class ConnectorState:
    """The connector's state, one object its parts share (built by
    :class:`~aiokv.kv.KVConnector`'s constructor, which checks the arguments), and the
    helpers its transfer paths share."""

    def __init__(
        self,
        engine: EngineLike,
        layout: KVLayout,
        caches: BoundCaches,
        *,
        chunk_bytes: int,
        staging_bytes: int,
        max_inflight: int,
        thread_min_bytes: int,
    ) -> None:
        self.engine = engine
        # (checked once: a runtime Protocol check costs µs on every request's path)
        self.discards: _Discards | None = engine if isinstance(engine, _Discards) else None
        self.pull: _PullEngine | None = engine if isinstance(engine, _PullEngine) else None
        self.layout = layout
        self.caches = caches
        self.device = caches.device
        self.chunk_bytes = chunk_bytes
        self.staging_bytes = staging_bytes
        self.max_inflight = max_inflight
        self.thread_min_bytes = thread_min_bytes
        self.codec = RequestCodec(layout, chunk_bytes, self.device)
        self.pool: StagingPool | None = None
        #: requests done since the last finished_sending() / finished_receiving()
        self.finished_sent: set[str] = set()
        self.finished_received: set[str] = set()
        self.sending: set[str] = set()
        self.receiving: set[str] = set()
        self.saves: dict[str, _LayerSave] = {}
        self.background: set[asyncio.Task[BaseException | None]] = set()
        self.drains: dict[str, asyncio.Task[None]] = {}
        self.stats = ConnectorStatistics()
        self.closed = False
        #: the same-host IPC plane (docs/ipc.md); None: the ordinary path only
        self.ipc: Plane | None = None
        #: plane requests of step batches over the IPC plane, by name: their requests and
        #: block counts in packing order (the plane reports the plane request, the
        #: bookkeeping is per request)
        self.ipc_batches: dict[str, tuple[tuple[str, int], ...]] = {}

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("KVConnector closed")

    @staticmethod
    def check_rid(request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")

    def host_ids(
        self, block_ids: torch.Tensor | Sequence[int], *, unique: bool, what: str
    ) -> torch.Tensor:
        """Block ids as a checked 1-D int64 CPU tensor."""
        nb = self.layout.num_blocks
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.is_complex():
                raise ConfigError(
                    f"{what}: block ids must be a 1-D integer tensor, got {block_ids.dtype} "
                    f"of shape {tuple(block_ids.shape)}"
                )
            host = block_ids.detach().to("cpu", torch.int64)
        else:
            if isinstance(block_ids, (str, bytes)):
                raise ConfigError(f"{what}: block ids must be a sequence of ints or a tensor")
            try:
                seq = list(block_ids)
            except TypeError:
                raise ConfigError(
                    f"{what}: block ids must be a sequence of ints or a tensor"
                ) from None
            if not all(type(i) is int for i in seq):
                raise ConfigError(f"{what}: block ids must be ints")
            host = torch.tensor(seq, dtype=torch.int64)
        n = host.numel()
        if n:
            lo, hi = (int(v) for v in torch.aminmax(host))
            if lo < 0 or hi >= nb:
                raise ConfigError(f"{what}: block ids must be in [0, {nb}), got [{lo}, {hi}]")
            if unique and torch.unique(host).numel() != n:
                raise ConfigError(f"{what}: duplicate block ids")
        return host.contiguous()

    def op_ids(self, host: torch.Tensor) -> torch.Tensor:
        """The ids as gather/scatter want them: checked host tensor on CPU, device copy on GPU."""
        if self.device.type == "cpu" or host.numel() == 0:
            return host
        try:
            pinned = host.pin_memory()
        except RuntimeError:
            return host.to(self.device)
        return pinned.to(self.device, non_blocking=True)

    async def copy(self, fn: Callable[[], T], nbytes: int) -> T:
        """Run a cache copy: inline on GPU (async on the stream) or for small CPU copies,
        else on aiokv's shared pool for short CPU work (:mod:`aiokv._runtime.threads`). On
        cancellation, wait for a running copy to finish."""
        if self.device.type != "cpu" or nbytes < self.thread_min_bytes:
            return fn()
        fut = in_pool(fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue
                except BaseException:
                    break
            raise

    def get_pool(self) -> StagingPool:
        if self.pool is None:
            self.pool = StagingPool(self.staging_bytes, self.device)
        return self.pool

    async def lease(self, nbytes: int, deadline: float) -> Lease | None:
        pool = self.get_pool()
        if pool._round(nbytes) > pool.capacity:
            return None  # larger than the whole pool: gather into a temporary buffer
        try:
            return await pool.alloc(nbytes, timeout=max(0.0, deadline - time.monotonic()))
        except AiokvTimeoutError as exc:
            raise TransferTimeoutError(
                f"no staging room for {nbytes} bytes in time: {exc}"
            ) from None

    async def stage_and_send(
        self,
        name: str,
        n_blocks: int,
        ids: torch.Tensor,
        layers: range,
        to: str,
        deadline: float,
        prefix: bytes = b"",
    ) -> asyncio.Task[BaseException | None]:
        """Gather ``layers`` of the ``n_blocks`` blocks ``ids`` into staging -- after
        ``prefix`` (a batch's header, when the chunk opens the batch) -- and start
        sending it as ``name``: a ``(layers, row)`` view, or the flat bytes with a
        prefix. The staging goes back once the send is done (:meth:`track`)."""
        row = n_blocks * self.layout.block_nbytes()
        nbytes = len(layers) * row
        off = len(prefix)
        lease = await self.lease(off + nbytes, deadline)
        try:
            buf = lease.tensor if lease is not None else None
            if off:
                if buf is None:
                    buf = torch.empty(off + nbytes, dtype=torch.uint8, device=self.device)
                buf[:off] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
            stage = await self.copy(
                functools.partial(
                    gather_blocks,
                    self.caches,
                    self.layout,
                    ids,
                    out=None if buf is None else buf[off:],
                    layers=layers,
                ),
                nbytes,
            )
            msg = buf if off and buf is not None else stage.view(len(layers), row)
            handle = self.engine.send_nowait(name, msg, to=to, timeout=_time_left(deadline))
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return self.track(handle, lease, msg)

    def track(
        self, handle: SendHandle, lease: Lease | None, keep: torch.Tensor
    ) -> asyncio.Task[BaseException | None]:
        """A task that waits for the send to finish, then gives the staging back.

        It returns the send's exception (or None) instead of raising, so a failure
        nobody waits for is never logged as unretrieved.
        """

        async def settle() -> BaseException | None:
            err: BaseException | None = None
            try:
                await handle
            except BaseException as exc:  # reported to the waiter
                err = exc
            # A granted transfer that timed out may still be read by the data plane:
            # the staging goes back to the pool only once the engine is done with it.
            await handle.released()
            if lease is not None:
                lease.release()
            del keep_ref[:]
            return err

        keep_ref = [keep]  # the staged tensor stays alive until the send finished
        task = asyncio.ensure_future(settle())
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    @staticmethod
    async def result(task: asyncio.Task[BaseException | None]) -> None:
        exc = await asyncio.shield(task)
        if exc is not None:
            raise exc

    def deadline(self, timeout: float | None) -> float:
        if timeout is None:
            timeout = getattr(
                getattr(getattr(self.engine, "config", None), "timeouts", None),
                "transfer",
                _DEFAULT_TIMEOUT,
            )
        if not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ConfigError(f"timeout must be >= 0 or None, got {timeout!r}")
        return time.monotonic() + float(timeout)

    def sent(self, request_id: str, chunks: int, n_blocks: int, started: float) -> None:
        """A request sent (``chunks``: 0 when the IPC plane copied it): counted, and its
        blocks may be freed."""
        members = self.ipc_batches.get(request_id)
        if members is not None:  # a step batch's plane request: each of its requests
            self.stats.chunks_sent += chunks
            for rid, n in members:
                self.sent(rid, 0, n, started)
            return
        st = self.stats
        st.requests_sent += 1
        st.chunks_sent += chunks
        st.bytes_sent += self.layout.request_nbytes(n_blocks)
        st.send_seconds += time.perf_counter() - started
        self.finished_sent.add(request_id)

    def received(self, request_id: str, chunks: int, n_blocks: int, started: float) -> None:
        """A request received, every block in place (``chunks``: 0 when the IPC plane
        copied it): counted."""
        members = self.ipc_batches.get(request_id)
        if members is not None:  # a step batch's plane request: each of its requests
            self.stats.chunks_received += chunks
            for rid, n in members:
                self.received(rid, 0, n, started)
            return
        st = self.stats
        st.requests_received += 1
        st.chunks_received += chunks
        st.bytes_received += self.layout.request_nbytes(n_blocks)
        st.recv_seconds += time.perf_counter() - started
        self.finished_received.add(request_id)

    # ------------------------------------------------------------------ tracking

    def take_finished_sending(self) -> set[str]:
        """Request ids fully sent since the last call (their blocks may be freed)."""
        out, self.finished_sent = self.finished_sent, set()
        return out

    def take_finished_receiving(self) -> set[str]:
        """Request ids fully received and scattered since the last call."""
        out, self.finished_received = self.finished_received, set()
        return out

    def statistics(self) -> ConnectorStatistics:
        s = dataclasses.replace(self.stats)
        s.staging = self.pool.statistics() if self.pool is not None else None
        s.ipc = self.ipc.statistics() if self.ipc is not None else None
        return s
