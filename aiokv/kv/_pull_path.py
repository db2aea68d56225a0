"""Pull mode of :class:`~aiokv.kv.KVConnector`: the producer holds a request behind a
once-published ticket (:meth:`~aiokv.kv.KVConnector.serve_request`), the consumer
that GETs it first receives it (:meth:`~aiokv.kv.KVConnector.fetch_request`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import ConfigError, LayoutMismatchError
from ._batched_path import BatchResults
from ._connector_base import ConnectorState, _PullEngine
from ._request_codec import (
    _TICKET_VERSION,
    MAX_HEADER_BYTES,
    _pulled_offset,
    check_ticket,
    ticket_name,
)
from .ops import gather_blocks, scatter_blocks


class _Requests(Protocol):
    """What pull mode needs of its connector: a whole request sent and received the way
    the connector picks (:meth:`KVConnector.send_request`, :meth:`KVConnector.recv_request`:
    the IPC plane where it works, the engine's transport otherwise)."""

    async def send_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None = None,
    ) -> None: ...

    async def recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None = None,
        timeout: float | None = None,
        layerwise: bool = False,
    ) -> str: ...


class _PullPath:
    """Serve and fetch a request, on the connector's state (the request itself moves by
    the connector's :class:`_Requests`, which picks the plane)."""

    def __init__(self, state: ConnectorState, requests: _Requests) -> None:
        self._st = state
        self._requests = requests

    def _pull_engine(self, what: str) -> _PullEngine:
        if self._st.pull is None:
            raise ConfigError(f"{what} needs an engine with GET mode (an aiokv.Engine)")
        return self._st.pull

    async def serve_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        timeout: float | None = None,
        on_published: Callable[[], object] | None = None,
    ) -> str:
        """Pull mode, producer side (:meth:`KVConnector.serve_request`)."""
        eng = self._pull_engine("serve_request")
        self._st.check_open()
        self._st.check_rid(request_id)
        deadline = self._st.deadline(timeout)
        host = self._st.host_ids(block_ids, unique=False, what="serve_request")
        name = ticket_name(request_id)
        # A CPU cache without the IPC plane: the ticket IS the request (header and
        # gathered blocks), moved by the GET itself -- one exchange, and the blocks are
        # free once gathered. Otherwise a small ticket; the request follows it.
        inline = self._st.ipc is None and self._st.device.type == "cpu" and host.numel() > 0
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
            self._st.sent(request_id, 1, host.numel(), t0)
        else:
            await self._requests.send_request(request_id, host, to=to, timeout=_time_left(deadline))
        return to

    async def _pulled_request(self, host: torch.Tensor) -> torch.Tensor:
        """A whole request as one uint8 tensor: ``<u32 header length>``, the header
        (JSON), zero padding to a multiple of 16 bytes, then the gathered blocks."""
        n = host.numel()
        header = self._st.codec.header_bytes(n, "chunks")
        off = _pulled_offset(len(header))
        prefix = (struct.pack("<I", len(header)) + header).ljust(off, b"\0")
        nbytes = self._st.layout.request_nbytes(n)
        buf = torch.empty(off + nbytes, dtype=torch.uint8)  # the blocks fill the rest
        buf[:off] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        await self._st.copy(
            functools.partial(
                gather_blocks,
                self._st.caches,
                self._st.layout,
                self._st.op_ids(host),
                out=buf[off:],
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
        """Pull mode, consumer side (:meth:`KVConnector.fetch_request`)."""
        eng = self._pull_engine("fetch_request")
        self._st.check_open()
        self._st.check_rid(request_id)
        deadline = self._st.deadline(timeout)
        host = self._st.host_ids(block_ids, unique=True, what="fetch_request")
        failures = self._st.stats.recv_failures
        try:
            if self._st.ipc is not None and self._st.ipc.stages_for(frm):
                return await self._fetch_staged(eng, request_id, host, frm, deadline)
            raw = await eng.get(ticket_name(request_id), frm=frm, timeout=_time_left(deadline))
            if raw.dtype == torch.uint8:  # the request itself (see serve_request)
                return await self.take_pulled(request_id, raw, host)
            check_ticket(request_id, frm, raw, host.numel())
            return await self._requests.recv_request(
                request_id, host, frm=frm, timeout=_time_left(deadline)
            )
        except BaseException:
            # a failed fetch is a failed receive, counted once: where the receive it
            # started did not count it (the GET, the ticket, a refused whole request)
            if self._st.stats.recv_failures == failures:
                self._st.stats.recv_failures += 1
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
            self._requests.recv_request(request_id, host, frm=frm, timeout=_time_left(deadline))
        )
        try:
            raw = await eng.get(ticket_name(request_id), frm=frm, timeout=_time_left(deadline))
            if raw.dtype == torch.uint8:  # a whole request (a producer without the plane)
                recv.cancel()
                await asyncio.gather(recv, return_exceptions=True)
                return await self.take_pulled(request_id, raw, host)
            check_ticket(request_id, frm, raw, host.numel())
        except BaseException:
            recv.cancel()
            await asyncio.gather(recv, return_exceptions=True)
            raise
        return await recv

    async def take_pulled(self, request_id: str, raw: torch.Tensor, host: torch.Tensor) -> str:
        """Write a request that came whole with its ticket (:meth:`_pulled_request`),
        checked by :meth:`_pulled_blocks` before anything is written."""
        data = self._pulled_blocks(request_id, raw, host.numel())
        t0 = time.perf_counter()
        await self._st.copy(
            functools.partial(
                scatter_blocks, data, self._st.caches, self._st.layout, self._st.op_ids(host)
            ),
            data.numel(),
        )
        self._st.received(request_id, 1, host.numel(), t0)
        return "engine"

    def _pulled_blocks(self, request_id: str, raw: torch.Tensor, n: int) -> torch.Tensor:
        """The blocks of a whole pulled request for ``n`` blocks: its header checked like
        :meth:`recv_request`'s, and its size (LayoutMismatchError otherwise)."""

        def bad(why: str) -> LayoutMismatchError:
            return LayoutMismatchError(f"KV request {request_id!r}: {why}", code="kv_size_mismatch")

        if raw.dim() != 1 or raw.numel() < 4:
            raise bad("the pulled request is too short")
        pre = raw[: min(raw.numel(), 4 + MAX_HEADER_BYTES)].cpu()
        (hlen,) = struct.unpack_from("<I", bytes(pre[:4].tolist()))
        if hlen > MAX_HEADER_BYTES or 4 + hlen > pre.numel():
            raise bad(f"the pulled request's header length {hlen} is out of range")
        self._st.codec.check_header(request_id, pre[4 : 4 + hlen], n, False)
        data = raw[_pulled_offset(hlen) :]
        if data.numel() != self._st.layout.request_nbytes(n):
            raise bad(
                f"the pulled request holds {data.numel()} bytes of blocks, "
                f"expected {self._st.layout.request_nbytes(n)}"
            )
        return data

    # ------------------------------------------------------------------ step batches

    async def fetch_batch(
        self,
        items: list[tuple[str, torch.Tensor | Sequence[int]]],
        *,
        frm: str,
        timeout: float | None,
    ) -> BatchResults:
        """:meth:`KVConnector.fetch_requests`: ``items`` are pairs already checked as a
        batch (:meth:`_BatchedPath.batch_items`). Every block id is checked, and no block
        shared, before anything is asked for (ConfigError). The tickets' GETs go out at
        once; the whole requests that come back pass their checks and are written with
        ONE scatter over one index tensor of all their blocks; a small ticket's request
        follows as :meth:`fetch_request`'s does, all of them concurrently."""
        eng = self._pull_engine("fetch_requests")
        self._st.check_open()
        deadline = self._st.deadline(timeout)
        hosts = [
            (rid, self._st.host_ids(b, unique=True, what="fetch_requests")) for rid, b in items
        ]
        if len(hosts) > 1:
            every = torch.cat([h for _, h in hosts])
            if torch.unique(every).numel() != every.numel():
                raise ConfigError(
                    "fetch_requests: two requests of the batch share a block; nothing was fetched"
                )
        out: BatchResults = {rid: None for rid, _ in hosts}
        gate = asyncio.Semaphore(GETS_AT_ONCE)

        async def fetch(rid: str, host: torch.Tensor) -> str:
            async with gate:
                return await self.fetch_request(rid, host, frm=frm, timeout=_time_left(deadline))

        async def get(rid: str) -> torch.Tensor:
            async with gate:
                return await eng.get(ticket_name(rid), frm=frm, timeout=_time_left(deadline))

        if self._st.ipc is not None and self._st.ipc.stages_for(frm):
            # the plane's receive starts beside each GET (_fetch_staged): one by one, at once
            staged = await asyncio.gather(
                *(fetch(rid, h) for rid, h in hosts), return_exceptions=True
            )
            for (rid, _), r in zip(hosts, staged, strict=True):
                out[rid] = _outcome(r)
            return out
        raws = await asyncio.gather(*(get(rid) for rid, _ in hosts), return_exceptions=True)
        whole: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # id, blocks, block ids
        follow: list[tuple[str, torch.Tensor]] = []
        for (rid, host), raw in zip(hosts, raws, strict=True):
            try:
                if isinstance(raw, BaseException):
                    raise raw
                if raw.dtype == torch.uint8:  # the request itself (see serve_request)
                    whole.append((rid, self._pulled_blocks(rid, raw, host.numel()), host))
                else:
                    check_ticket(rid, frm, raw, host.numel())
                    follow.append((rid, host))
            except Exception as exc:  # this request only: nothing of it is written
                out[rid] = exc
                self._st.stats.recv_failures += 1
        following = asyncio.gather(
            *(
                self._requests.recv_request(rid, h, frm=frm, timeout=_time_left(deadline))
                for rid, h in follow
            ),
            return_exceptions=True,
        )
        try:
            if whole:
                await self._scatter_whole(whole, out)
            for (rid, _), r in zip(follow, await following, strict=True):
                out[rid] = _outcome(r)
        finally:
            if not following.done():
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
        return out

    async def _scatter_whole(
        self, whole: list[tuple[str, torch.Tensor, torch.Tensor]], out: BatchResults
    ) -> None:
        """Write the whole pulled requests of a batch with one scatter: their blocks side
        by side per layer (and per part before the block dimension), which is the packing
        of one request of all their blocks (:mod:`aiokv.kv.ops`)."""
        lay = self._st.layout
        rows = lay.num_layers * math.prod(lay.staging_shape(1)[: lay.block_dim])
        ids = torch.cat([h for _, _, h in whole])
        datas = [d for _, d, _ in whole]

        def scatter() -> None:
            if len(datas) == 1:
                stage = datas[0]
            else:
                stage = torch.cat([d.view(rows, d.numel() // rows) for d in datas], 1).view(-1)
            scatter_blocks(stage, self._st.caches, lay, self._st.op_ids(ids))

        t0 = time.perf_counter()
        try:
            await self._st.copy(scatter, lay.request_nbytes(ids.numel()))
        except Exception as exc:  # the one scatter: every request it carried
            for rid, _, _ in whole:
                out[rid] = exc
            self._st.stats.recv_failures += len(whole)
            return
        for rid, _, h in whole:
            self._st.received(rid, 1, h.numel(), t0)


#: the most GETs of one batch in flight at once: a producer's engine serves at most 16
#: GETs of one session at a time and answers more with ``busy``
#: (``aiokv.engine.server._MAX_GETS_PER_SESSION``)
GETS_AT_ONCE = 16


def _outcome(r: object) -> Exception | None:
    """A request's outcome from ``gather(..., return_exceptions=True)``: its error or
    None; a BaseException that is no Exception (a cancellation) propagates."""
    if isinstance(r, BaseException):
        if not isinstance(r, Exception):
            raise r
        return r
    return None
