"""KVConnector: move a request's paged KV blocks between two engines.

A producer (prefill) calls :meth:`KVConnector.send_request` with the request's
block ids in ITS cache; a consumer (decode) calls :meth:`KVConnector.recv_request`
with the block ids it allocated in ITS cache. The blocks travel coalesced: all
layers of a request go as one tensor under one negotiation when they fit one
chunk (``chunk_bytes``), else as a few large chunks of whole layers, pipelined
so that chunk i+1 is gathered while chunk i is on the wire.

Chunk names and sizes
---------------------
Both sides derive the chunk plan from ``(layout, len(block_ids), chunk_bytes)``
with :class:`~aiokv.kv.LayerChunker`::

    LayerChunker(layout, n_blocks).chunks(max_bytes=chunk_bytes)

Chunk ``i`` is sent under the tensor id ``f"{request_id}#kv{i}"`` as a uint8
tensor of shape ``(len(chunk.layers), n_blocks * layout.block_nbytes())``: its
bytes are exactly :func:`~aiokv.kv.gather_blocks` of those layers (see
:mod:`aiokv.kv.ops` for the packing order); uint8 keeps every dtype, fp8
included, bit-exact. The consumer checks each chunk's shape (which pins both the
layer count and the block count) before scattering it, and raises
:class:`~aiokv.LayoutMismatchError` (a :class:`~aiokv.TransferError`, ``code``
``"kv_size_mismatch"``) without touching the cache on a mismatch — different
block counts, or different ``chunk_bytes`` on the two sides. A 1-D uint8 chunk of
the right byte count is also accepted.

Layer-wise streaming (:meth:`KVConnector.save_layer`) sends layer ``l`` as
``f"{request_id}#L{l}"`` of shape ``(1, n_blocks * block_nbytes)`` (with the IPC
plane: an event and a small message per layer instead, docs/ipc.md).

Every request also carries a small header, ``f"{request_id}#kvh"``: a CPU uint8
tensor (so it travels over TCP and is read on the host, never synchronising a
GPU) holding JSON with the producer's layout (:meth:`~aiokv.kv.KVLayout.to_wire`),
the packing version, the mode (chunks or layers), the block count and
``chunk_bytes``. The consumer collects it first and checks it against its own
layout and plan **on every request, whatever the engines' configuration**: an
incompatible layout (kind, layers, block size, heads, head dim, dtype -- also
when the bytes per block happen to agree, e.g. 8 heads x 64 against 4 heads x
128) raises :class:`~aiokv.LayoutMismatchError` naming the field, a different
block count or chunk plan raises it with ``code`` ``"kv_size_mismatch"``, and
the cache is never touched. Engines built with ``EngineConfig(layout=...)``
additionally refuse an incompatible peer at session set-up.

Cancellation and failure
------------------------
A cancelled (or failed) :meth:`KVConnector.recv_request` scatters nothing after
the cancellation arrived: a chunk whose receive completed in the same loop pass
as the cancel (which ``asyncio.wait_for`` may hand back instead of raising) is
dropped, a copy already running on the thread pool is waited for, and then
``CancelledError`` propagates. The request's other chunks are dropped from the
receive store at once (:meth:`aiokv.Engine.discard`), chunks still in flight
when they land, and chunks not yet announced by the producer are collected and
dropped in the background until the request's deadline (at least the engine's
transfer timeout) -- so the blocks may be handed to another request at once.

Devices
-------
On CUDA, gathers and scatters are enqueued on the CURRENT stream and nothing
here synchronises: the engine's NCCL transport orders its send after the
current stream, and hands received tensors out ordered for it. On CPU the copies
are plain torch ops; large ones (``thread_min_bytes``) run on a small thread
pool so the event loop keeps serving sockets meanwhile (a cancelled operation
still waits for its copy to finish before it releases memory or returns).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from aiokv._runtime.deadlines import _time_left
from aiokv._runtime.threads import in_pool

from .._exceptions import (
    AiokvError,
    AiokvTimeoutError,
    ConfigError,
    EngineClosedError,
    LayoutMismatchError,
    TransferTimeoutError,
)
from .ipc import IpcPlane
from .ipc.interfaces import Plane
from .ipc.options import IpcOptions, IpcStatistics
from .layouts import KVLayout, check_compatible, layout_from_wire
from .ops import (
    BoundCaches,
    LayerChunker,
    Lease,
    PoolStatistics,
    StagingPool,
    StagingSlice,
    gather_blocks,
    scatter_blocks,
)


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


__all__ = ["ConnectorStatistics", "EngineLike", "KVConnector"]

MiB = 1 << 20
T = TypeVar("T")

_DEFAULT_TIMEOUT = 60.0

#: version of the request header (see the module docstring)
_HEADER_VERSION = 1
#: the packing order of gathered blocks (:mod:`aiokv.kv.ops`); bump when it changes
PACKING = "aiokv-kv-1"
#: version of pull mode's ticket (see :meth:`KVConnector.serve_request`)
_TICKET_VERSION = 1


def _pulled_offset(header_len: int) -> int:
    """Where the blocks start in a whole pulled request: after the u32 header length
    and the header, padded to a multiple of 16 bytes."""
    return -(-(4 + header_len) // 16) * 16


#: a request header is at most this many bytes (the consumer refuses larger ones)
MAX_HEADER_BYTES = 4096


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """Cancellation requests pending on ``task`` (Python >= 3.11; 0 before)."""
    if task is None or sys.version_info < (3, 11):
        return 0
    return task.cancelling()


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


class KVConnector:
    """Moves paged KV blocks of requests between engines (see the module docstring).

    ``engine``: a started :class:`aiokv.Engine`. ``layout``: this side's
    :class:`~aiokv.kv.KVLayout`. ``caches``: the per-layer cache tensors (or one
    stacked tensor). ``staging_bytes``: size of the send staging pool, allocated
    on the caches' device at the first send (default ``4 * chunk_bytes``, at
    least one whole request of the largest chunk seen is never required: a chunk
    larger than the pool is gathered into a temporary buffer). ``chunk_bytes``:
    the largest chunk (whole layers; at least one layer) — must be equal on both
    sides. ``max_inflight``: chunks of one request in flight at once.

    Every request is checked against the producer's layout and plan (a small
    header per request); giving both engines ``EngineConfig(layout=layout)``
    also refuses incompatible peers at connection set-up.

    ``ipc``: :class:`~aiokv.kv.IpcOptions` turns on the same-host IPC plane
    (docs/ipc.md): the consumer copies each request straight out of the
    producer's cache in one kernel where CUDA IPC works, this path otherwise.
    Give both sides the same setting.
    """

    def __init__(
        self,
        engine: EngineLike,
        layout: KVLayout,
        caches: Sequence[torch.Tensor] | torch.Tensor | BoundCaches,
        *,
        staging_bytes: int | None = None,
        chunk_bytes: int = 64 * MiB,
        max_inflight: int = 4,
        thread_min_bytes: int = 4 * MiB,
        ipc: IpcOptions | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if staging_bytes is not None and (type(staging_bytes) is not int or staging_bytes <= 0):
            raise ConfigError(f"staging_bytes must be a positive int, got {staging_bytes!r}")
        if type(max_inflight) is not int or max_inflight <= 0:
            raise ConfigError(f"max_inflight must be a positive int, got {max_inflight!r}")
        self.engine = engine
        # (checked once: a runtime Protocol check costs µs on every request's path)
        self._discards: _Discards | None = engine if isinstance(engine, _Discards) else None
        self._pull: _PullEngine | None = engine if isinstance(engine, _PullEngine) else None
        self.layout = layout
        if isinstance(caches, BoundCaches):
            if caches.layout != layout:
                raise ConfigError("BoundCaches was bound to a different layout")
            self.caches = caches
        else:
            self.caches = BoundCaches(layout, caches)
        self.device = self.caches.device
        self.chunk_bytes = chunk_bytes
        self.staging_bytes = staging_bytes if staging_bytes is not None else 4 * chunk_bytes
        self.max_inflight = max_inflight
        self.thread_min_bytes = thread_min_bytes
        self._pool: StagingPool | None = None
        self._finished_sending: set[str] = set()
        self._finished_receiving: set[str] = set()
        self._sending: set[str] = set()
        self._receiving: set[str] = set()
        self._saves: dict[str, _LayerSave] = {}
        self._background: set[asyncio.Task[BaseException | None]] = set()
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._stats = ConnectorStatistics()
        self._closed = False
        # the same-host IPC plane (docs/ipc.md); None: the ordinary path only
        self._port = _Port(self)
        self._ipc: Plane | None = IpcPlane(self._port, ipc) if ipc is not None else None

    # ------------------------------------------------------------------ helpers

    def chunk_plan(self, n_blocks: int) -> list[StagingSlice]:
        """The chunks a request of ``n_blocks`` blocks travels in (same on both sides)."""
        if n_blocks == 0:
            return []
        return LayerChunker(self.layout, n_blocks).chunks(max_bytes=self.chunk_bytes)

    @staticmethod
    def chunk_name(request_id: str, index: int) -> str:
        return f"{request_id}#kv{index}"

    @staticmethod
    def layer_name(request_id: str, layer: int) -> str:
        return f"{request_id}#L{layer}"

    @staticmethod
    def ticket_name(request_id: str) -> str:
        """Pull mode: the id of the request's ticket the producer publishes."""
        return f"{request_id}#pull"

    @staticmethod
    def header_name(request_id: str) -> str:
        return f"{request_id}#kvh"

    def _header_bytes(self, n_blocks: int, mode: str) -> bytes:
        """The request header (see the module docstring): JSON."""
        body = {
            "v": _HEADER_VERSION,
            "packing": PACKING,
            "layout": self.layout.to_wire(),
            "mode": mode,
            "n_blocks": n_blocks,
            "chunk_bytes": self.chunk_bytes,
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def _header(self, n_blocks: int, mode: str) -> torch.Tensor:
        """The request header as a CPU uint8 tensor."""
        return torch.frombuffer(bytearray(self._header_bytes(n_blocks, mode)), dtype=torch.uint8)

    def _send_header(
        self, request_id: str, n_blocks: int, mode: str, to: str, deadline: float
    ) -> asyncio.Task[BaseException | None]:
        t = self._header(n_blocks, mode)
        handle = self.engine.send_nowait(
            self.header_name(request_id), t, to=to, timeout=_time_left(deadline)
        )
        return self._track(handle, None, t)

    def _check_header(
        self, request_id: str, raw: torch.Tensor, n_blocks: int, layerwise: bool
    ) -> None:
        """Raise LayoutMismatchError unless the producer's header matches this side."""
        name = self.header_name(request_id)

        def bad(why: str, code: str = "layout_mismatch") -> LayoutMismatchError:
            return LayoutMismatchError(f"KV request {request_id!r}: {why}", code=code)

        if (
            raw.dtype != torch.uint8
            or raw.dim() != 1
            or raw.numel() > MAX_HEADER_BYTES
            or raw.device.type != "cpu"
        ):
            raise bad(f"{name!r} is not an aiokv KV request header")
        try:
            h = json.loads(bytes(raw.tolist()))
            if type(h) is not dict:
                raise ValueError("not an object")
            producer = layout_from_wire(h.get("layout"))
        except Exception as exc:  # untrusted bytes: whatever is wrong, it is a mismatch
            raise bad(f"unreadable header {name!r} ({type(exc).__name__}: {exc})"[:300]) from None
        if h.get("v") != _HEADER_VERSION or h.get("packing") != PACKING:
            raise bad(
                f"the producer packs blocks as {h.get('packing')!r:.40} (header v{h.get('v')!r:.8}), "
                f"this side as {PACKING!r} (v{_HEADER_VERSION})"
            )
        check_compatible(producer, self.layout)
        mode = "layers" if layerwise else "chunks"
        if h.get("mode") != mode:
            raise bad(
                f"the producer sent {h.get('mode')!r:.20} but the consumer expects {mode!r} "
                "(send_request pairs with recv_request(layerwise=False), save_layer with "
                "layerwise=True)",
                "kv_mode_mismatch",
            )
        theirs = h.get("n_blocks")
        if type(theirs) is not int or theirs != n_blocks:
            raise bad(
                f"the producer sent {theirs!r:.20} blocks, the consumer expects {n_blocks} "
                "blocks: the two sides disagree on the number of blocks of the request",
                "kv_size_mismatch",
            )
        cb = h.get("chunk_bytes")
        if type(cb) is not int or cb <= 0:
            raise bad(f"bad chunk_bytes {cb!r:.20} in the header")
        if not layerwise and n_blocks and cb != self.chunk_bytes:
            mine = [s.layers for s in self.chunk_plan(n_blocks)]
            plan = LayerChunker(self.layout, n_blocks).chunks(max_bytes=cb)
            if [s.layers for s in plan] != mine:
                raise bad(
                    f"the producer's chunk_bytes {cb} splits the request into {len(plan)} "
                    f"chunks, this side's chunk_bytes {self.chunk_bytes} into {len(mine)}: "
                    "chunk_bytes must be equal on both sides",
                    "kv_size_mismatch",
                )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("KVConnector closed")

    @staticmethod
    def _check_rid(request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request_id!r}")

    def _host_ids(
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

    def _op_ids(self, host: torch.Tensor) -> torch.Tensor:
        """The ids as gather/scatter want them: checked host tensor on CPU, device copy on GPU."""
        if self.device.type == "cpu" or host.numel() == 0:
            return host
        try:
            pinned = host.pin_memory()
        except RuntimeError:
            return host.to(self.device)
        return pinned.to(self.device, non_blocking=True)

    async def _copy(self, fn: Callable[[], T], nbytes: int) -> T:
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

    def _get_pool(self) -> StagingPool:
        if self._pool is None:
            self._pool = StagingPool(self.staging_bytes, self.device)
        return self._pool

    async def _lease(self, nbytes: int, deadline: float) -> Lease | None:
        pool = self._get_pool()
        if pool._round(nbytes) > pool.capacity:
            return None  # larger than the whole pool: gather into a temporary buffer
        try:
            return await pool.alloc(nbytes, timeout=max(0.0, deadline - time.monotonic()))
        except AiokvTimeoutError as exc:
            raise TransferTimeoutError(
                f"no staging room for {nbytes} bytes in time: {exc}"
            ) from None

    def _track(
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
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _stage_and_send(
        self,
        name: str,
        host_ids: torch.Tensor,
        ids: torch.Tensor,
        layers: range,
        to: str,
        deadline: float,
    ) -> asyncio.Task[BaseException | None]:
        n = host_ids.numel()
        nbytes = len(layers) * n * self.layout.block_nbytes()
        lease = await self._lease(nbytes, deadline)
        try:
            out = lease.tensor if lease is not None else None
            stage = await self._copy(
                functools.partial(
                    gather_blocks, self.caches, self.layout, ids, out=out, layers=layers
                ),
                nbytes,
            )
            view = stage.view(len(layers), n * self.layout.block_nbytes())
            handle = self.engine.send_nowait(name, view, to=to, timeout=_time_left(deadline))
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return self._track(handle, lease, view)

    @staticmethod
    async def _result(task: asyncio.Task[BaseException | None]) -> None:
        exc = await asyncio.shield(task)
        if exc is not None:
            raise exc

    def _deadline(self, timeout: float | None) -> float:
        if timeout is None:
            timeout = getattr(
                getattr(getattr(self.engine, "config", None), "timeouts", None),
                "transfer",
                _DEFAULT_TIMEOUT,
            )
        if not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ConfigError(f"timeout must be >= 0 or None, got {timeout!r}")
        return time.monotonic() + float(timeout)

    # ------------------------------------------------------------------ producer

    async def send_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None = None,
    ) -> None:
        """Send all layers of the request's blocks to the engine at ``to``.

        Returns once the peer's engine holds every chunk (the consumer then
        scatters them with :meth:`recv_request`). Raises the engine's errors
        (:class:`~aiokv.TransferTimeoutError`, :class:`~aiokv.PeerError`,
        :class:`~aiokv.RefusedError`, ...). On failure or cancellation, chunks
        already committed to the wire finish in the background; their staging is
        released when they do. With ``ipc=`` the request goes through the IPC plane
        (docs/ipc.md), which falls back to this path by itself.
        """
        if self._ipc is not None:
            await self._ipc.send_request(request_id, block_ids, to=to, timeout=timeout)
        else:
            await self._send_ordinary(request_id, block_ids, to=to, timeout=timeout)

    async def _send_ordinary(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """:meth:`send_request` by the engine's transport."""
        self._check_open()
        self._check_rid(request_id)
        deadline = self._deadline(timeout)
        host = self._host_ids(block_ids, unique=False, what="send_request")
        if request_id in self._sending:
            raise ConfigError(f"request {request_id!r} is already being sent")
        self._sending.add(request_id)
        t0 = time.perf_counter()
        inflight: deque[asyncio.Task[BaseException | None]] = deque()
        try:
            plan = self.chunk_plan(host.numel())
            # the header travels beside the chunks (not counted in max_inflight); an
            # empty request moves nothing, not even a header
            head = (
                self._send_header(request_id, host.numel(), "chunks", to, deadline)
                if plan
                else None
            )
            ids = self._op_ids(host)
            for i, s in enumerate(plan):
                while len(inflight) >= self.max_inflight:
                    await self._result(inflight.popleft())
                inflight.append(
                    await self._stage_and_send(
                        self.chunk_name(request_id, i), host, ids, s.layers, to, deadline
                    )
                )
            if head is not None:
                await self._result(head)
            while inflight:
                await self._result(inflight.popleft())
        except BaseException:
            self._stats.send_failures += 1
            raise
        finally:
            self._sending.discard(request_id)
        self._sent(request_id, len(plan), host.numel(), t0)

    def save_layer(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None = None,
    ) -> None:
        """Start sending one layer of a request (call after the layer's KV is written).

        Non-blocking: gathers the layer into staging (the current CUDA stream on a
        GPU) and starts ``send_nowait`` of ``f"{request_id}#L{layer}"``. Then
        ``await wait_saved(request_id)`` once every layer was saved. ``timeout``
        bounds each layer's transfer. Must be called from the event loop's thread.
        With ``ipc=`` the layers go through the IPC plane where it works (an event
        per layer, one copy per layer on the consumer; docs/ipc.md).
        """
        if self._ipc is not None:
            self._ipc.save_layer(request_id, layer, block_ids, to=to, timeout=timeout)
        else:
            self._save_layer_ordinary(request_id, layer, block_ids, to=to, timeout=timeout)

    def _save_layer_ordinary(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """:meth:`save_layer` by the engine's transport."""
        self._check_open()
        self._check_rid(request_id)
        if type(layer) is not int or not 0 <= layer < self.layout.num_layers:
            raise ConfigError(
                f"layer must be an int in [0, {self.layout.num_layers}), got {layer!r}"
            )
        host = self._host_ids(block_ids, unique=False, what="save_layer")
        n = host.numel()
        save = self._saves.get(request_id)
        if save is None:
            save = _LayerSave(to, n, time.perf_counter())
            if n:
                save.header = self._send_header(
                    request_id, n, "layers", to, self._deadline(timeout)
                )
            self._saves[request_id] = save
        elif save.to != to or save.n_blocks != n:
            raise ConfigError(
                f"save_layer({request_id!r}, {layer}): {n} blocks to {to} but earlier layers "
                f"had {save.n_blocks} blocks to {save.to}"
            )
        if layer in save.tasks:
            raise ConfigError(f"layer {layer} of {request_id!r} was already saved")
        deadline = self._deadline(timeout)
        nbytes = n * self.layout.block_nbytes()
        lease: Lease | None = None
        if nbytes:
            pool = self._get_pool()
            if pool._round(nbytes) <= pool.capacity:
                lease = pool.try_alloc(nbytes)
        try:
            out = lease.tensor if lease is not None else None
            ids = self._op_ids(host)
            stage = gather_blocks(
                self.caches, self.layout, ids, out=out, layers=range(layer, layer + 1)
            )
            view = stage.view(1, nbytes)
            handle = self.engine.send_nowait(
                self.layer_name(request_id, layer),
                view,
                to=to,
                timeout=_time_left(deadline),
            )
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        save.tasks[layer] = self._track(handle, lease, view)

    async def wait_saved(self, request_id: str) -> None:
        """Wait until every layer saved with :meth:`save_layer` is held by the peer.

        Raises the first layer's error, or :class:`~aiokv.ConfigError` when not all
        ``num_layers`` layers were saved (the consumer would wait for them) or the
        request is unknown. On success the request joins :meth:`finished_sending`.
        """
        if self._ipc is not None:
            await self._ipc.wait_saved(request_id)
        else:
            await self._wait_saved_ordinary(request_id)

    async def _wait_saved_ordinary(self, request_id: str) -> None:
        """:meth:`wait_saved` of layers saved by the engine's transport."""
        save = self._saves.pop(request_id, None)
        if save is None:
            raise ConfigError(f"no layers of {request_id!r} are being saved")
        failed: BaseException | None = None
        waits = ([save.header] if save.header is not None else []) + [
            save.tasks[layer] for layer in sorted(save.tasks)
        ]
        try:
            for w in waits:
                exc = await asyncio.shield(w)
                if exc is not None and failed is None:
                    failed = exc
        except BaseException:
            self._stats.send_failures += 1
            raise
        if failed is not None:
            self._stats.send_failures += 1
            raise failed
        missing = [i for i in range(self.layout.num_layers) if i not in save.tasks]
        if missing:
            self._stats.send_failures += 1
            raise ConfigError(
                f"request {request_id!r}: layers {missing[:8]}{'...' if len(missing) > 8 else ''} "
                "were never saved"
            )
        self._sent(request_id, len(save.tasks), save.n_blocks, save.started)

    # ------------------------------------------------------------------ consumer

    def _check_chunk(
        self, name: str, t: torch.Tensor, n_layers: int, n_blocks: int
    ) -> torch.Tensor:
        """The chunk as a 1-D uint8 buffer on the cache device, or LayoutMismatchError."""
        row = n_blocks * self.layout.block_nbytes()
        want = n_layers * row
        got = t.numel() * t.element_size()
        shape = tuple(t.shape)
        ok = t.dtype == torch.uint8 and (shape == (n_layers, row) or shape == (want,))
        if not ok:
            raise LayoutMismatchError(
                f"KV chunk {name!r} has dtype {t.dtype} and shape {shape} ({got} bytes); "
                f"expected uint8 ({n_layers}, {row}) = {n_layers} layers x {n_blocks} blocks x "
                f"{self.layout.block_nbytes()} bytes ({want} bytes). The two sides disagree on "
                "the number of blocks of the request, on chunk_bytes, or on the KV layout",
                code="kv_size_mismatch",
            )
        if not t.is_contiguous():
            t = t.contiguous()
        t = t.reshape(-1)
        if t.device != self.device:
            t = t.to(self.device, non_blocking=True)
        elif t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    async def recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None = None,
        timeout: float | None = None,
        layerwise: bool = False,
    ) -> str:
        """Collect the request's KV and write it into the local cache at ``block_ids``.

        ``block_ids`` are THIS side's (distinct) block ids, as many as the producer
        sent. ``frm``: the producer's engine address or id (None: any peer).
        ``layerwise``: the producer used :meth:`save_layer` instead of
        :meth:`send_request`. Everything waits under one deadline (``timeout``,
        default the engine's transfer timeout).

        Returns once every chunk is scattered; the request then joins
        :meth:`finished_receiving`. Returns which plane carried it: ``"ipc"`` (the
        same-host IPC plane copied it) or ``"engine"`` (the engine's transport). The producer's header is checked first: an
        incompatible layout, another block count, mode or chunk plan raises
        :class:`~aiokv.LayoutMismatchError` before anything is scattered, as does a
        chunk of the wrong size.

        On timeout, cancellation or error it raises and the request is NOT marked
        finished: blocks whose chunk was scattered before the cancel or error hold
        this request's data, the others are untouched; treat them all as not
        received. Nothing is scattered after a cancellation arrived (a copy
        already running on the thread pool is waited for first), and the request
        leaves nothing behind: its chunks are dropped from the engine's receive
        store (in-flight ones when they land, late ones by a background drain until
        the deadline), so the blocks may be given to another request at once.
        Reusing the same ``request_id`` for a new request stops that drain.
        """
        if self._ipc is not None:
            return await self._ipc.recv_request(
                request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
            )
        return await self._recv_ordinary(
            request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
        )

    async def _recv_ordinary(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        """:meth:`recv_request` by the engine's transport."""
        self._check_open()
        self._check_rid(request_id)
        deadline = self._deadline(timeout)
        host = self._host_ids(block_ids, unique=True, what="recv_request")
        n = host.numel()
        if request_id in self._receiving:
            raise ConfigError(f"request {request_id!r} is already being received")
        self._receiving.add(request_id)
        drain = self._drains.pop(request_id, None)
        if drain is not None:  # a cancelled predecessor's leftovers: this request owns the ids now
            drain.cancel()
        task = asyncio.current_task()
        base = _cancelling(task)
        t0 = time.perf_counter()
        if layerwise:
            L = self.layout.num_layers
            items = (
                [(self.layer_name(request_id, li), range(li, li + 1)) for li in range(L)]
                if n
                else []
            )
        else:
            items = [
                (self.chunk_name(request_id, i), s.layers) for i, s in enumerate(self.chunk_plan(n))
            ]
        # an empty request moves nothing, not even a header, and completes at once
        names = ([self.header_name(request_id)] if n else []) + [name for name, _ in items]
        taken = 0  # of names: collected from the engine (scattered or dropped)
        try:
            if n:
                left = _time_left(deadline)
                raw = await self.engine.recv(names[0], frm=frm, timeout=left)
                taken = 1
                self._check_cancelled(task, base)
                self._check_header(request_id, raw, n, layerwise)
                del raw
            ids = self._op_ids(host)
            for name, layers in items:
                left = _time_left(deadline)
                raw = await self.engine.recv(name, frm=frm, timeout=left)
                taken += 1
                # a cancel that arrived while the chunk landed: never scatter it
                self._check_cancelled(task, base)
                chunk = self._check_chunk(name, raw, len(layers), n)
                del raw
                # a copy on the thread pool is waited for even when cancelled
                await self._copy(
                    functools.partial(
                        scatter_blocks, chunk, self.caches, self.layout, ids, layers=layers
                    ),
                    chunk.numel(),
                )
                del chunk
        except BaseException:
            self._stats.recv_failures += 1
            self._drop(request_id, names[taken:], frm, deadline)
            raise
        finally:
            self._receiving.discard(request_id)
        self._received(request_id, len(items), n, t0)
        return "engine"

    @staticmethod
    def _check_cancelled(task: asyncio.Task[Any] | None, base: int) -> None:
        """Raise CancelledError if the task was cancelled since ``base`` was read, also when
        an await swallowed it (``asyncio.wait_for`` returns a result that completed in the
        same loop pass as the cancel, on Python <= 3.11)."""
        if task is not None and _cancelling(task) > base:
            raise asyncio.CancelledError()

    def _drop(
        self,
        request_id: str,
        names: list[str],
        frm: str | None,
        deadline: float,
        *,
        late: bool = True,
    ) -> None:
        """Free the receive store of a failed or cancelled request's chunks.

        What the store holds goes now and what is in flight when it lands
        (``engine.discard``); chunks the producer has not announced yet are collected
        and dropped by a background task until the request's deadline, and at least the
        engine's transfer timeout -- unless ``late`` is False (they may never come).
        """
        if not names:
            return
        eng = self._discards
        rest: list[str] = []
        for name in names:
            try:
                if eng is not None and eng.discard(name):
                    continue
            except AiokvError:  # the engine is closed: nothing is left to drop
                return
            rest.append(name)
        if not rest or not late or self._closed:
            return
        window = max(deadline - time.monotonic(), self._deadline(None) - time.monotonic())
        d = asyncio.ensure_future(self._drain(rest, frm, window))
        self._drains[request_id] = d

        def forget(t: asyncio.Task[None]) -> None:
            if self._drains.get(request_id) is t:
                del self._drains[request_id]

        d.add_done_callback(forget)

    async def _drain(self, names: list[str], frm: str | None, window: float) -> None:
        """Collect and drop ``names`` as they arrive (all at once: any may come first)."""

        async def one(name: str) -> None:
            # a timeout or a closed engine ends the wait; the tensor, if any, is dropped
            with contextlib.suppress(AiokvError):
                await self.engine.recv(name, frm=frm, timeout=window)

        await asyncio.gather(*(one(name) for name in names))

    # ------------------------------------------------------------------ pull mode

    def _pull_engine(self, what: str) -> _PullEngine:
        if self._pull is None:
            raise ConfigError(f"{what} needs an engine with GET mode (an aiokv.Engine)")
        return self._pull

    async def serve_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        timeout: float | None = None,
        on_published: Callable[[], object] | None = None,
    ) -> str:
        """Pull mode, producer side: hold the request's blocks for the consumer that
        fetches it (:meth:`fetch_request`), then send them to that consumer.

        For a producer that answers before it knows its consumer (vLLM's
        disaggregation protocol: the prefill returns, a router picks the decode, the
        decode pulls). The producer publishes a ticket ``"{request_id}#pull"`` for one
        GET; the first consumer whose GET takes it gets the request. With the IPC plane
        or a CUDA cache the ticket is small (a CPU int64 tensor: version, block count)
        and the request follows it, sent exactly as :meth:`send_request` sends it to
        that consumer's address (the IPC plane where it works); a CPU cache without the
        plane makes the ticket the request itself (a uint8 tensor: header and gathered
        blocks, moved by the GET). Returns that address once the request is sent or
        taken (:meth:`send_request`'s meaning; the request joins
        :meth:`finished_sending`). Raises :class:`~aiokv.TransferTimeoutError` when
        nobody fetched it in time (the ticket is withdrawn: a late consumer gets
        :class:`~aiokv.NotPublishedError` at once), and :meth:`send_request`'s errors.
        When this returns or raises, the blocks may be freed -- except when it was
        cancelled while sending (then, as for :meth:`send_request`, wait for
        :meth:`finished_sending`).

        ``on_published`` is called once the ticket is published (with a CPU cache that
        is after the blocks were gathered): a producer that tells the consumer where
        its request is only from then on never sends it to a ticket not there yet.
        """
        eng = self._pull_engine("serve_request")
        self._check_open()
        self._check_rid(request_id)
        deadline = self._deadline(timeout)
        host = self._host_ids(block_ids, unique=False, what="serve_request")
        name = self.ticket_name(request_id)
        # A CPU cache without the IPC plane: the ticket IS the request (header and
        # gathered blocks), moved by the GET itself -- one exchange, and the blocks are
        # free once gathered. Otherwise a small ticket; the request follows it.
        inline = self._ipc is None and self.device.type == "cpu" and host.numel() > 0
        t0 = time.perf_counter()
        ticket = (
            await self._pulled_request(host)
            if inline
            else torch.tensor([_TICKET_VERSION, host.numel()], dtype=torch.int64)
        )
        eng.publish(name, ticket, once=True)
        if on_published is not None:
            on_published()
        try:
            to = await eng.wait_fetched(name, timeout=_time_left(deadline))
        finally:
            eng.unpublish(name)
        if inline:
            self._sent(request_id, 1, host.numel(), t0)
        else:
            await self.send_request(request_id, host, to=to, timeout=_time_left(deadline))
        return to

    async def _pulled_request(self, host: torch.Tensor) -> torch.Tensor:
        """A whole request as one uint8 tensor: ``<u32 header length>``, the header
        (JSON), zero padding to a multiple of 16 bytes, then the gathered blocks."""
        n = host.numel()
        header = self._header_bytes(n, "chunks")
        off = _pulled_offset(len(header))
        prefix = (struct.pack("<I", len(header)) + header).ljust(off, b"\0")
        nbytes = self.layout.request_nbytes(n)
        buf = torch.empty(off + nbytes, dtype=torch.uint8)  # the blocks fill the rest
        buf[:off] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        await self._copy(
            functools.partial(
                gather_blocks, self.caches, self.layout, self._op_ids(host), out=buf[off:]
            ),
            nbytes,
        )
        return buf

    async def fetch_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str,
        timeout: float | None = None,
    ) -> str:
        """Pull mode, consumer side: fetch a request the producer at ``frm`` holds with
        :meth:`serve_request` and write it into this cache at ``block_ids``.

        GETs the request's ticket (:class:`~aiokv.NotPublishedError` at once if ``frm``
        does not hold it, or another consumer took it). A small ticket: checks its block
        count against ``block_ids`` (:class:`~aiokv.LayoutMismatchError`, ``code``
        ``"kv_size_mismatch"``, before anything is written), then receives as
        :meth:`recv_request` does (same deadline, same guarantees on cancellation and
        failure). A whole request: checks its header like :meth:`recv_request` and its
        size, then writes it. Returns which plane carried it. A consumer cancelled between
        the ticket and the data leaves the producer's send to end at its deadline.
        """
        eng = self._pull_engine("fetch_request")
        self._check_open()
        self._check_rid(request_id)
        deadline = self._deadline(timeout)
        host = self._host_ids(block_ids, unique=True, what="fetch_request")
        failures = self._stats.recv_failures
        try:
            if self._ipc is not None and self._ipc.stages_for(frm):
                return await self._fetch_staged(eng, request_id, host, frm, deadline)
            raw = await eng.get(self.ticket_name(request_id), frm=frm, timeout=_time_left(deadline))
            if raw.dtype == torch.uint8:  # the request itself (see serve_request)
                return await self._take_pulled(request_id, raw, host)
            self._check_ticket(request_id, frm, raw, host.numel())
            return await self.recv_request(request_id, host, frm=frm, timeout=_time_left(deadline))
        except BaseException:
            # a failed fetch is a failed receive, counted once: where the receive it
            # started did not count it (the GET, the ticket, a refused whole request)
            if self._stats.recv_failures == failures:
                self._stats.recv_failures += 1
            raise

    async def _fetch_staged(
        self, eng: Any, request_id: str, host: torch.Tensor, frm: str, deadline: float
    ) -> str:
        """``fetch_request`` from a producer whose IPC ring this side reads: the receive
        starts beside the ticket's GET, its copy staged, so that the ring's poll
        launches it as soon as the producer sends (which it does when it accepts the
        GET, before the ticket is back here). The descriptor is checked against the
        block count as the ticket would be; a failed GET or ticket check ends the
        receive (nothing was launched for a GET that failed: the producer sends only
        after accepting it)."""
        recv = asyncio.ensure_future(
            self.recv_request(request_id, host, frm=frm, timeout=_time_left(deadline))
        )
        try:
            raw = await eng.get(self.ticket_name(request_id), frm=frm, timeout=_time_left(deadline))
            if raw.dtype == torch.uint8:  # a whole request (a producer without the plane)
                recv.cancel()
                await asyncio.gather(recv, return_exceptions=True)
                return await self._take_pulled(request_id, raw, host)
            self._check_ticket(request_id, frm, raw, host.numel())
        except BaseException:
            recv.cancel()
            await asyncio.gather(recv, return_exceptions=True)
            raise
        return await recv

    @staticmethod
    def _check_ticket(request_id: str, frm: str, raw: torch.Tensor, n: int) -> None:
        """A small pull ticket this side can read, for ``n`` blocks (else
        LayoutMismatchError, ``kv_size_mismatch``)."""
        if (
            raw.dtype != torch.int64
            or raw.dim() != 1
            or raw.numel() < 2
            or int(raw[0]) != _TICKET_VERSION
        ):
            raise LayoutMismatchError(
                f"request {request_id!r}: {frm} sent a ticket this side cannot read "
                f"({raw.dtype}, shape {tuple(raw.shape)})",
                code="kv_size_mismatch",
            )
        if int(raw[1]) != n:
            raise LayoutMismatchError(
                f"request {request_id!r}: {frm} holds {int(raw[1])} blocks, {n} were given here",
                code="kv_size_mismatch",
            )

    async def _take_pulled(self, request_id: str, raw: torch.Tensor, host: torch.Tensor) -> str:
        """Write a request that came whole with its ticket (:meth:`_pulled_request`):
        its header is checked like :meth:`recv_request`'s, and its size, before
        anything is written."""
        n = host.numel()

        def bad(why: str) -> LayoutMismatchError:
            return LayoutMismatchError(f"KV request {request_id!r}: {why}", code="kv_size_mismatch")

        if raw.dim() != 1 or raw.numel() < 4:
            raise bad("the pulled request is too short")
        pre = raw[: min(raw.numel(), 4 + MAX_HEADER_BYTES)].cpu()
        (hlen,) = struct.unpack_from("<I", bytes(pre[:4].tolist()))
        if hlen > MAX_HEADER_BYTES or 4 + hlen > pre.numel():
            raise bad(f"the pulled request's header length {hlen} is out of range")
        self._check_header(request_id, pre[4 : 4 + hlen], n, False)
        data = raw[_pulled_offset(hlen) :]
        if data.numel() != self.layout.request_nbytes(n):
            raise bad(
                f"the pulled request holds {data.numel()} bytes of blocks, "
                f"expected {self.layout.request_nbytes(n)}"
            )
        t0 = time.perf_counter()
        await self._copy(
            functools.partial(scatter_blocks, data, self.caches, self.layout, self._op_ids(host)),
            data.numel(),
        )
        self._received(request_id, 1, n, t0)
        return "engine"

    async def prepare(self, peer: str, *, timeout: float | None = None) -> bool:
        """Consumer side: set up what the first request from the producer at ``peer``
        would otherwise wait for. With the IPC plane, that is mapping and verifying the
        producer's export (0.17-0.6 s on the first request otherwise, docs/ipc.md):
        returns True once it is mapped here, False when IPC is not used with that
        producer (the plane is off on either side, or it fell back: counted and logged
        as for a request). Without the plane, False. Call it for the producers this
        side will read from (a decode worker: its prefill peers), e.g. once the session
        to them is warm (:class:`aiokv.serving.PeerWarmer`'s ``after_connect``)."""
        self._check_open()
        if self._ipc is None:
            return False
        return await self._ipc.prepare(peer, timeout)

    def _sent(self, request_id: str, chunks: int, n_blocks: int, started: float) -> None:
        """A request sent (``chunks``: 0 when the IPC plane copied it): counted, and its
        blocks may be freed."""
        st = self._stats
        st.requests_sent += 1
        st.chunks_sent += chunks
        st.bytes_sent += self.layout.request_nbytes(n_blocks)
        st.send_seconds += time.perf_counter() - started
        self._finished_sending.add(request_id)

    def _received(self, request_id: str, chunks: int, n_blocks: int, started: float) -> None:
        """A request received, every block in place (``chunks``: 0 when the IPC plane
        copied it): counted."""
        st = self._stats
        st.requests_received += 1
        st.chunks_received += chunks
        st.bytes_received += self.layout.request_nbytes(n_blocks)
        st.recv_seconds += time.perf_counter() - started
        self._finished_receiving.add(request_id)

    # ------------------------------------------------------------------ tracking

    def finished_sending(self) -> set[str]:
        """Request ids fully sent since the last call (their blocks may be freed)."""
        out, self._finished_sending = self._finished_sending, set()
        return out

    def finished_receiving(self) -> set[str]:
        """Request ids fully received and scattered since the last call."""
        out, self._finished_receiving = self._finished_receiving, set()
        return out

    def statistics(self) -> ConnectorStatistics:
        s = dataclasses.replace(self._stats)
        s.staging = self._pool.statistics() if self._pool is not None else None
        s.ipc = self._ipc.statistics() if self._ipc is not None else None
        return s

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self, timeout: float = 5.0) -> None:
        """Refuse new work, wait (bounded) for in-flight sends, close the IPC plane."""
        self._closed = True
        pending: list[asyncio.Task[Any]] = list(self._background)
        for save in self._saves.values():
            pending.extend(save.tasks.values())
            if save.header is not None:
                pending.append(save.header)
        self._saves.clear()
        for d in self._drains.values():
            d.cancel()
        self._drains.clear()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        if self._ipc is not None:
            await self._ipc.aclose(timeout)

    async def __aenter__(self) -> KVConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Port:
    """The connector as its IPC plane sees it (:class:`~aiokv.kv.ipc.interfaces.ConnectorPort`):
    the caches, the argument checks, the ordinary path, the bookkeeping."""

    def __init__(self, con: KVConnector) -> None:
        self._con = con

    @property
    def engine(self) -> Any:
        return self._con.engine

    @property
    def pull(self) -> Any:
        return self._con._pull

    @property
    def layout(self) -> KVLayout:
        return self._con.layout

    @property
    def caches(self) -> BoundCaches:
        return self._con.caches

    @property
    def device(self) -> torch.device:
        return self._con.device

    def check_request(self, request_id: str) -> None:
        self._con._check_open()
        self._con._check_rid(request_id)

    def deadline(self, timeout: float | None) -> float:
        return self._con._deadline(timeout)

    def host_ids(
        self, block_ids: torch.Tensor | Sequence[int], *, unique: bool, what: str
    ) -> torch.Tensor:
        return self._con._host_ids(block_ids, unique=unique, what=what)

    async def send_plain(
        self, request_id: str, block_ids: Sequence[int], *, to: str, timeout: float
    ) -> None:
        await self._con._send_ordinary(request_id, block_ids, to=to, timeout=timeout)

    def save_layer_plain(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        self._con._save_layer_ordinary(request_id, layer, block_ids, to=to, timeout=timeout)

    async def wait_saved_plain(self, request_id: str) -> None:
        await self._con._wait_saved_ordinary(request_id)

    async def recv_plain(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        frm: str | None,
        timeout: float,
        layerwise: bool,
    ) -> None:
        await self._con._recv_ordinary(
            request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
        )

    def drop(
        self,
        request_id: str,
        names: list[str],
        frm: str | None,
        deadline: float,
        *,
        late: bool = True,
    ) -> None:
        self._con._drop(request_id, names, frm, deadline, late=late)

    def sent(self, request_id: str, n_blocks: int, started: float) -> None:
        self._con._sent(request_id, 0, n_blocks, started)  # (no chunks: one copy)

    def received(self, request_id: str, n_blocks: int, started: float) -> None:
        self._con._received(request_id, 0, n_blocks, started)

    def blocks_free(self, request_id: str) -> None:
        self._con._finished_sending.add(request_id)

    def send_failed(self) -> None:
        self._con._stats.send_failures += 1

    def recv_failed(self) -> None:
        self._con._stats.recv_failures += 1
