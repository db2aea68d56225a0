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
from typing import TYPE_CHECKING, Any

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import ConfigError, LayoutMismatchError
from ._chunked_path import _ChunkedPath
from ._connector_base import _PullEngine
from ._request_codec import _TICKET_VERSION, MAX_HEADER_BYTES, _pulled_offset
from .ops import gather_blocks, scatter_blocks


class _PullPath(_ChunkedPath):
    """Serve and fetch a request (calls the facade's :meth:`send_request` and
    :meth:`recv_request`, which pick the plane)."""

    if TYPE_CHECKING:  # defined by KVConnector (connector.py)

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
