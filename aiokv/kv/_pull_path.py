"""Pull mode of :class:`~aiokv.kv.KVConnector`: the producer holds a request behind a
once-published ticket (:meth:`~aiokv.kv.KVConnector.serve_request`), the consumer
that GETs it first receives it (:meth:`~aiokv.kv.KVConnector.fetch_request`).
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import ConfigError, LayoutMismatchError
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
        self._st.codec.check_header(request_id, pre[4 : 4 + hlen], n, False)
        data = raw[_pulled_offset(hlen) :]
        if data.numel() != self._st.layout.request_nbytes(n):
            raise bad(
                f"the pulled request holds {data.numel()} bytes of blocks, "
                f"expected {self._st.layout.request_nbytes(n)}"
            )
        t0 = time.perf_counter()
        await self._st.copy(
            functools.partial(
                scatter_blocks, data, self._st.caches, self._st.layout, self._st.op_ids(host)
            ),
            data.numel(),
        )
        self._st.received(request_id, 1, n, t0)
        return "engine"
