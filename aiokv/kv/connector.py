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

Step batches
------------
:meth:`KVConnector.send_requests` / :meth:`KVConnector.recv_requests` move all the
requests a scheduler step hands over for one peer as one batch: one gather over one
index tensor of all their blocks, one transfer (on a CPU cache; on a CUDA cache the
header and the blocks go as two), each request's outcome reported on its own; with the
IPC plane as one plane request (one copy on the consumer). The wire form:
:mod:`aiokv.kv._batched_path`.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .._exceptions import ConfigError
from . import _request_codec
from ._batched_path import BatchItem, BatchResults, _BatchedPath
from ._chunked_path import _ChunkedPath
from ._connector_base import ConnectorState, ConnectorStatistics, EngineLike, MiB
from ._pull_path import _PullPath
from .ipc import IpcPlane
from .ipc.interfaces import Plane
from .ipc.options import IpcOptions
from .layouts import KVLayout
from .ops import BoundCaches, StagingSlice

__all__ = ["ConnectorStatistics", "EngineLike", "KVConnector"]


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
        bound = caches if isinstance(caches, BoundCaches) else BoundCaches(layout, caches)
        if bound.layout != layout:
            raise ConfigError("BoundCaches was bound to a different layout")
        # the one state its parts share, and the parts
        self._st = ConnectorState(
            engine,
            layout,
            bound,
            chunk_bytes=chunk_bytes,
            staging_bytes=staging_bytes if staging_bytes is not None else 4 * chunk_bytes,
            max_inflight=max_inflight,
            thread_min_bytes=thread_min_bytes,
        )
        self._chunked = _ChunkedPath(self._st)
        self._batched = _BatchedPath(self._st, self._chunked)
        self._pulled = _PullPath(self._st, self)
        # the same-host IPC plane (docs/ipc.md); None: the ordinary path only
        self._port = _Port(self._st, self._chunked)
        self._st.ipc = IpcPlane(self._port, ipc) if ipc is not None else None

    # ------------------------------------------------------------------ the state

    @property
    def engine(self) -> EngineLike:
        return self._st.engine

    @property
    def layout(self) -> KVLayout:
        return self._st.layout

    @property
    def caches(self) -> BoundCaches:
        return self._st.caches

    @property
    def device(self) -> torch.device:
        return self._st.device

    @property
    def chunk_bytes(self) -> int:
        return self._st.chunk_bytes

    @property
    def staging_bytes(self) -> int:
        return self._st.staging_bytes

    @property
    def max_inflight(self) -> int:
        return self._st.max_inflight

    @property
    def thread_min_bytes(self) -> int:
        return self._st.thread_min_bytes

    @property
    def _ipc(self) -> Plane | None:
        """The IPC plane (None: the ordinary path only); tests put a plane of their own."""
        return self._st.ipc

    @_ipc.setter
    def _ipc(self, plane: Plane | None) -> None:
        self._st.ipc = plane

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
        if self._st.ipc is not None:
            await self._st.ipc.send_request(request_id, block_ids, to=to, timeout=timeout)
        else:
            await self._chunked.send_ordinary(request_id, block_ids, to=to, timeout=timeout)

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
        if self._st.ipc is not None:
            self._st.ipc.save_layer(request_id, layer, block_ids, to=to, timeout=timeout)
        else:
            self._chunked.save_layer_ordinary(request_id, layer, block_ids, to=to, timeout=timeout)

    async def wait_saved(self, request_id: str) -> None:
        """Wait until every layer saved with :meth:`save_layer` is held by the peer.

        Raises the first layer's error, or :class:`~aiokv.ConfigError` when not all
        ``num_layers`` layers were saved (the consumer would wait for them) or the
        request is unknown. On success the request joins :meth:`finished_sending`.
        """
        if self._st.ipc is not None:
            await self._st.ipc.wait_saved(request_id)
        else:
            await self._chunked.wait_saved_ordinary(request_id)

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
        if self._st.ipc is not None:
            return await self._st.ipc.recv_request(
                request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
            )
        return await self._chunked.recv_ordinary(
            request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
        )

    async def send_requests(
        self,
        requests: Iterable[BatchItem],
        *,
        to: str,
        timeout: float | None = None,
    ) -> BatchResults:
        """Send a step's requests to the engine at ``to`` as ONE batch.

        ``requests``: ``(request_id, block_ids)`` pairs, as :meth:`send_request` takes
        them. Their blocks are gathered with one index tensor into one staging buffer
        and travel as one transfer (the header with them; a batch larger than
        ``chunk_bytes`` in chunks of whole layers, pipelined; on a CUDA cache the header
        is a transfer of its own). The consumer takes it with :meth:`recv_requests` of
        the same request ids (in any order).

        Returns ``{request_id: None or its error}`` in the order given; the requests
        mapped to None were sent and join :meth:`finished_sending`. Per request: block
        ids that fail :meth:`send_request`'s checks, or a request already being sent,
        map to their :class:`~aiokv.ConfigError` and stay out of the batch -- the
        others go (the consumer learns which were left out). All-or-nothing: the
        transfer itself -- a timeout, a dead or refusing peer maps every request it
        carried to that one error. Raises, with nothing sent, on a malformed call (a
        request id twice, something else than pairs: :class:`~aiokv.ConfigError`) or a
        closed connector; an empty batch returns ``{}`` at once and sends nothing.
        Cancellation propagates as for :meth:`send_request`.

        With ``ipc=`` the requests that pass their checks go through the IPC plane as
        ONE plane request (one descriptor; on the consumer one copy), their blocks
        concatenated in order of request id; the consumer derives the same request from
        its own call. Over the plane the batch is all-or-nothing as a whole: both sides
        must agree on which requests go and on each one's block count -- a request one
        side refuses, or another block count, leaves the two sides' plane requests
        unpaired and every request of the batch fails at the deadline
        (:class:`~aiokv.TransferTimeoutError`), nothing written. A batch of more than
        :data:`~aiokv.kv._batched_path.IPC_BATCH_BLOCKS` blocks goes as several plane
        requests, each all-or-nothing for its requests.
        """
        if self._st.ipc is None:
            return await self._batched.send_batch(requests, to=to, timeout=timeout)
        return await self._batched.send_batch_ipc(self._st.ipc, requests, to=to, timeout=timeout)

    async def recv_requests(
        self,
        requests: Iterable[BatchItem],
        *,
        frm: str | None = None,
        timeout: float | None = None,
    ) -> BatchResults:
        """Receive a batch sent with :meth:`send_requests` and write each request into
        this cache at its ``block_ids`` (THIS side's, distinct, not shared between
        requests of the batch).

        ``requests``: the same request ids the producer batched (any order), with this
        side's block ids. Everything waits under one deadline (``timeout``, default the
        engine's transfer timeout). The batch's header is checked first (layout, chunk
        plan: :class:`~aiokv.LayoutMismatchError`); then the blocks of every request
        that lands here are written with one scatter per chunk.

        Returns ``{request_id: None or its error}`` in the order given; the requests
        mapped to None are in place and join :meth:`finished_receiving`. Per request:
        bad block ids or a request already being received (:class:`~aiokv.ConfigError`),
        another block count than the producer's (:class:`~aiokv.LayoutMismatchError`,
        ``code`` ``"kv_size_mismatch"``), a request the producer left out
        (:class:`~aiokv.TransferError`): nothing of it is written, the others land.
        All-or-nothing: the transfer and the header -- a timeout, an incompatible
        layout or chunk plan, a chunk of the wrong size map every request to that one
        error (blocks scattered before it hold data; treat them as not received) and
        the batch's leftovers are dropped as :meth:`recv_request`'s are. Raises, with
        nothing received, on a malformed call (a request id twice, two requests sharing
        a block: :class:`~aiokv.ConfigError`) or a closed connector; an empty batch
        returns ``{}`` at once. Cancellation propagates as for :meth:`recv_request`
        (nothing is scattered after it arrived).

        With ``ipc=`` the batch comes as the producer's plane request(s) (see
        :meth:`send_requests`): this side's block ids of the requests that pass their
        checks, concatenated in order of request id, are written by one copy; a request
        refused here, or the producer's, or another block count fails the whole batch at
        the deadline (:class:`~aiokv.TransferTimeoutError`) with nothing written.
        """
        if self._st.ipc is None:
            return await self._batched.recv_batch(requests, frm=frm, timeout=timeout)
        return await self._batched.recv_batch_ipc(self._st.ipc, requests, frm=frm, timeout=timeout)

    # ------------------------------------------------------------------ pull mode

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
        return await self._pulled.serve_request(
            request_id, block_ids, timeout=timeout, on_published=on_published
        )

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
        return await self._pulled.fetch_request(request_id, block_ids, frm=frm, timeout=timeout)

    async def fetch_requests(
        self,
        requests: Iterable[BatchItem],
        *,
        frm: str,
        timeout: float | None = None,
    ) -> BatchResults:
        """Pull mode, consumer side, a step's requests from the producer at ``frm`` at
        once: :meth:`fetch_request` of each ``(request_id, block_ids)`` pair, under one
        deadline.

        Checked first, with nothing fetched (:class:`~aiokv.ConfigError`, raised): the
        call's form (pairs, no request id twice), every request's block ids, and no
        block shared between two requests. Then every ticket's GET goes out at once;
        the requests that come whole with their ticket (a CPU producer without the IPC
        plane) are checked each, and those that pass are written with ONE scatter over
        one index tensor of all their blocks; a small ticket's request follows as
        :meth:`fetch_request`'s does (with the IPC plane: :meth:`fetch_request` of each,
        concurrently).

        Returns ``{request_id: None or its error}`` in the order given; None: in place,
        and it joins :meth:`finished_receiving`. Each request fails alone: one not
        served (:class:`~aiokv.NotPublishedError`), of another block count
        (:class:`~aiokv.LayoutMismatchError`), or not come in time
        (:class:`~aiokv.TransferTimeoutError`) has nothing written, and the others
        land. An empty batch returns ``{}``. Cancellation propagates (the GETs in
        flight are withdrawn; a scatter already running is waited for).
        """
        items = self._batched.batch_items(requests, "fetch_requests")
        return await self._pulled.fetch_batch(items, frm=frm, timeout=timeout)

    async def prepare(self, peer: str, *, timeout: float | None = None) -> bool:
        """Consumer side: set up what the first request from the producer at ``peer``
        would otherwise wait for. With the IPC plane, that is mapping and verifying the
        producer's export (0.17-0.6 s on the first request otherwise, docs/ipc.md):
        returns True once it is mapped here, False when IPC is not used with that
        producer (the plane is off on either side, or it fell back: counted and logged
        as for a request). Without the plane, False. Call it for the producers this
        side will read from (a decode worker: its prefill peers), e.g. once the session
        to them is warm (:class:`aiokv.serving.PeerWarmer`'s ``after_connect``)."""
        self._st.check_open()
        if self._st.ipc is None:
            return False
        return await self._st.ipc.prepare(peer, timeout)

    # ------------------------------------------------------------------ tracking

    def finished_sending(self) -> set[str]:
        """Request ids fully sent since the last call (their blocks may be freed)."""
        return self._st.take_finished_sending()

    def finished_receiving(self) -> set[str]:
        """Request ids fully received and scattered since the last call."""
        return self._st.take_finished_receiving()

    def statistics(self) -> ConnectorStatistics:
        return self._st.statistics()

    # ------------------------------------------------------------------ names and plan

    def chunk_plan(self, n_blocks: int) -> list[StagingSlice]:
        """The chunks a request of ``n_blocks`` blocks travels in (same on both sides)."""
        return self._st.codec.chunk_plan(n_blocks)

    chunk_name = staticmethod(_request_codec.chunk_name)
    layer_name = staticmethod(_request_codec.layer_name)
    ticket_name = staticmethod(_request_codec.ticket_name)
    header_name = staticmethod(_request_codec.header_name)
    batch_name = staticmethod(_request_codec.batch_name)
    batch_chunk_name = staticmethod(_request_codec.batch_chunk_name)

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self, timeout: float = 5.0) -> None:
        """Refuse new work, wait (bounded) for in-flight sends, close the IPC plane."""
        st = self._st
        st.closed = True
        pending: list[asyncio.Task[Any]] = list(st.background)
        for save in st.saves.values():
            pending.extend(save.tasks.values())
            if save.header is not None:
                pending.append(save.header)
        st.saves.clear()
        for d in st.drains.values():
            d.cancel()
        st.drains.clear()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        if st.ipc is not None:
            await st.ipc.aclose(timeout)

    async def __aenter__(self) -> KVConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Port:
    """The connector as its IPC plane sees it (:class:`~aiokv.kv.ipc.interfaces.ConnectorPort`):
    the caches, the argument checks, the ordinary path, the bookkeeping."""

    def __init__(self, state: ConnectorState, chunked: _ChunkedPath) -> None:
        self._st = state
        self._chunked = chunked

    @property
    def engine(self) -> Any:
        return self._st.engine

    @property
    def pull(self) -> Any:
        return self._st.pull

    @property
    def layout(self) -> KVLayout:
        return self._st.layout

    @property
    def caches(self) -> BoundCaches:
        return self._st.caches

    @property
    def device(self) -> torch.device:
        return self._st.device

    def check_request(self, request_id: str) -> None:
        self._st.check_open()
        self._st.check_rid(request_id)

    def deadline(self, timeout: float | None) -> float:
        return self._st.deadline(timeout)

    def host_ids(
        self, block_ids: torch.Tensor | Sequence[int], *, unique: bool, what: str
    ) -> torch.Tensor:
        return self._st.host_ids(block_ids, unique=unique, what=what)

    async def send_plain(
        self, request_id: str, block_ids: Sequence[int], *, to: str, timeout: float
    ) -> None:
        await self._chunked.send_ordinary(request_id, block_ids, to=to, timeout=timeout)

    def save_layer_plain(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        self._chunked.save_layer_ordinary(request_id, layer, block_ids, to=to, timeout=timeout)

    async def wait_saved_plain(self, request_id: str) -> None:
        await self._chunked.wait_saved_ordinary(request_id)

    async def recv_plain(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        frm: str | None,
        timeout: float,
        layerwise: bool,
    ) -> None:
        await self._chunked.recv_ordinary(
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
        self._chunked.drop(request_id, names, frm, deadline, late=late)

    def sent(self, request_id: str, n_blocks: int, started: float) -> None:
        self._st.sent(request_id, 0, n_blocks, started)  # (no chunks: one copy)

    def received(self, request_id: str, n_blocks: int, started: float) -> None:
        self._st.received(request_id, 0, n_blocks, started)

    def blocks_free(self, request_id: str) -> None:
        members = self._st.ipc_batches.pop(request_id, None)
        if members is None:
            self._st.finished_sent.add(request_id)
        else:  # a step batch's plane request: each of its requests
            self._st.finished_sent.update(rid for rid, _ in members)

    def send_failed(self) -> None:
        self._st.stats.send_failures += 1

    def recv_failed(self) -> None:
        self._st.stats.recv_failures += 1
