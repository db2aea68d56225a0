"""Step batches of :class:`~aiokv.kv.KVConnector` over the engine's transport: all the
requests a scheduler step hands over for one peer gathered with ONE index tensor and
moved as one transfer (:meth:`~aiokv.kv.KVConnector.send_requests`,
:meth:`~aiokv.kv.KVConnector.recv_requests`).

On the wire a batch is named by the set of its request ids (``batch_name``). Its first
tensor, a 1-D CPU uint8 tensor, opens with the header (``_batch_prefix``: the requests
it carries, in packing order, with their block counts); on a CPU cache chunk 0 of the
blocks follows the header in that same tensor, so a batch that fits one chunk is ONE
transfer; on a CUDA cache the chunks travel as tensors of their own (the engine moves
CPU and CUDA tensors in different transfers). The blocks are packed as one request of
all the batch's blocks, request after request, in chunks of whole layers
(``chunk_bytes``) like :meth:`~aiokv.kv.KVConnector.send_request`'s.

Over the IPC plane a batch is ONE plane request (``ipc_batch_name``, :func:`_ipc_parts`;
docs/ipc.md, "Step batches"): both sides derive it from their own call, the plane moves
it as it moves a request, and its outcome is each of its requests'.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import ConfigError, LayoutMismatchError, TransferError
from ._connector_base import ConnectorState, _cancelling, _check_cancelled
from ._request_codec import batch_chunk_name, batch_name, ipc_batch_name
from .ipc.interfaces import Plane
from .ops import plain_block_ids, scatter_blocks

#: one request of a batch: its id and its block ids (this side's)
BatchItem = tuple[str, "torch.Tensor | Sequence[int]"]
#: what a batch call returns: each request's id, and None (moved) or its error
BatchResults = dict[str, Exception | None]


class _Drops(Protocol):
    """What the batched path needs of the chunked path: dropping a failed batch's
    leftovers from the receive store (:meth:`_ChunkedPath.drop`)."""

    def drop(
        self,
        request_id: str,
        names: list[str],
        frm: str | None,
        deadline: float,
        *,
        late: bool = True,
    ) -> None: ...


class _BatchedPath:
    """Both sides of a step batch, over the engine's transport or the IPC plane, on the
    connector's state."""

    def __init__(self, state: ConnectorState, drops: _Drops) -> None:
        self._st = state
        self._drops = drops

    def batch_items(
        self, requests: Iterable[BatchItem], what: str
    ) -> list[tuple[str, torch.Tensor | Sequence[int]]]:
        """The call's requests, checked as a whole (ConfigError, nothing moved): pairs
        of a valid request id and block ids, no request id twice."""
        if isinstance(requests, (str, bytes, torch.Tensor)):
            raise ConfigError(f"{what}: requests must be (request_id, block_ids) pairs")
        try:
            items = list(requests)
        except TypeError:
            raise ConfigError(f"{what}: requests must be (request_id, block_ids) pairs") from None
        seen: set[str] = set()
        out: list[tuple[str, torch.Tensor | Sequence[int]]] = []
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ConfigError(
                    f"{what}: each request must be a (request_id, block_ids) pair, got {item!r:.80}"
                )
            rid, block_ids = item
            self._st.check_rid(rid)
            if rid in seen:
                raise ConfigError(
                    f"{what}: request {rid!r} appears twice in the batch; nothing was moved"
                )
            seen.add(rid)
            out.append((rid, block_ids))
        return out

    # ------------------------------------------------------------------ producer

    async def send_batch(
        self, requests: Iterable[BatchItem], *, to: str, timeout: float | None
    ) -> BatchResults:
        """:meth:`KVConnector.send_requests` by the engine's transport."""
        self._st.check_open()
        items = self.batch_items(requests, "send_requests")
        deadline = self._st.deadline(timeout)
        out: BatchResults = {rid: None for rid, _ in items}
        if not items:
            return out
        hosts: list[tuple[str, torch.Tensor]] = []
        for rid, block_ids in items:
            try:
                if rid in self._st.sending:
                    raise ConfigError(f"request {rid!r} is already being sent")
                hosts.append(
                    (rid, self._st.host_ids(block_ids, unique=False, what="send_requests"))
                )
            except ConfigError as exc:  # this request only: the others go on
                out[rid] = exc
                self._st.stats.send_failures += 1
        sent = [rid for rid, _ in hosts]
        self._st.sending.update(sent)
        t0 = time.perf_counter()
        base = batch_name(list(out))
        all_ids = torch.cat([h for _, h in hosts]) if hosts else torch.empty(0, dtype=torch.int64)
        plan = self._st.codec.chunk_plan(all_ids.numel())
        inline = self._st.device.type == "cpu" and bool(plan)
        prefix = self._st.codec.batch_prefix([(rid, h.numel()) for rid, h in hosts], inline)
        inflight: deque[asyncio.Task[BaseException | None]] = deque()
        try:
            if not inline:  # the header travels alone (a CUDA cache, or no blocks at all)
                head = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
                handle = self._st.engine.send_nowait(
                    base, head, to=to, timeout=_time_left(deadline)
                )
                inflight.append(self._st.track(handle, None, head))
            ids = self._st.op_ids(all_ids)
            for i, s in enumerate(plan):
                while len(inflight) >= self._st.max_inflight:
                    await self._st.result(inflight.popleft())
                first = inline and i == 0
                inflight.append(
                    await self._st.stage_and_send(
                        base if first else batch_chunk_name(base, i),
                        all_ids.numel(),
                        ids,
                        s.layers,
                        to,
                        deadline,
                        prefix if first else b"",
                    )
                )
            while inflight:
                await self._st.result(inflight.popleft())
        except Exception as exc:  # the transfer is all-or-nothing: every request failed
            self._st.stats.send_failures += len(sent)
            for rid in sent:
                out[rid] = exc
            return out
        except BaseException:
            self._st.stats.send_failures += len(sent)
            raise
        finally:
            self._st.sending.difference_update(sent)
        self._st.stats.chunks_sent += len(plan)
        for rid, h in hosts:
            self._st.sent(rid, 0, h.numel(), t0)
        return out

    # ------------------------------------------------------------------ consumer

    async def recv_batch(
        self, requests: Iterable[BatchItem], *, frm: str | None, timeout: float | None
    ) -> BatchResults:
        """:meth:`KVConnector.recv_requests` by the engine's transport."""
        self._st.check_open()
        items = self.batch_items(requests, "recv_requests")
        deadline = self._st.deadline(timeout)
        out: BatchResults = {rid: None for rid, _ in items}
        if not items:
            return out
        hosts: dict[str, torch.Tensor] = {}
        for rid, block_ids in items:
            try:
                if rid in self._st.receiving:
                    raise ConfigError(f"request {rid!r} is already being received")
                hosts[rid] = self._st.host_ids(block_ids, unique=True, what="recv_requests")
            except ConfigError as exc:  # this request only: the others go on
                out[rid] = exc
        if len(hosts) > 1:
            every = torch.cat(list(hosts.values()))
            if torch.unique(every).numel() != every.numel():
                raise ConfigError(
                    "recv_requests: two requests of the batch share a block; nothing was moved"
                )
        self._st.stats.recv_failures += len(out) - len(hosts)
        base = batch_name(list(out))
        mine = list(hosts)
        self._st.receiving.update(mine)
        for rid in mine:
            drain = self._st.drains.pop(rid, None)
            if drain is not None:  # a cancelled predecessor's leftovers
                drain.cancel()
        task = asyncio.current_task()
        cancels = _cancelling(task)
        t0 = time.perf_counter()
        # until the header says otherwise: the chunks this side's requests would take
        expect = len(self._st.codec.chunk_plan(sum(h.numel() for h in hosts.values())))
        names = [base] + [batch_chunk_name(base, i) for i in range(expect)]
        taken = 0  # of names: collected from the engine
        landed: list[tuple[str, int]] = []
        try:
            raw = await self._st.engine.recv(base, frm=frm, timeout=_time_left(deadline))
            taken = 1
            _check_cancelled(task, cancels)
            entries, inline, off = self._st.codec.check_batch_header(base, raw, out)
            total = sum(n for _, n in entries)
            plan = self._st.codec.chunk_plan(total)
            names = [base] + [
                batch_chunk_name(base, i) for i in range(1 if inline else 0, len(plan))
            ]
            keep, failed = self._batch_plan(base, entries, hosts)
            out.update(failed)
            landed = [(rid, n) for rid, _, n in keep]
            ids = self._st.op_ids(
                torch.cat([hosts[rid] for rid, _, _ in keep])
                if keep
                else torch.empty(0, dtype=torch.int64)
            )
            # (the blocks of the batch this side writes, when not all of them)
            picks = (
                None
                if not keep or sum(n for _, _, n in keep) == total
                else self._st.op_ids(torch.cat([torch.arange(at, at + n) for _, at, n in keep]))
            )
            for i, s in enumerate(plan):
                if inline and i == 0:
                    chunk = self._st.codec.check_chunk(base, raw[off:], len(s.layers), total)
                else:
                    name = batch_chunk_name(base, i)
                    got = await self._st.engine.recv(name, frm=frm, timeout=_time_left(deadline))
                    taken += 1
                    # a cancel that arrived while the chunk landed: never scatter it
                    _check_cancelled(task, cancels)
                    chunk = self._st.codec.check_chunk(name, got, len(s.layers), total)
                    del got
                if not keep:
                    continue
                if picks is not None:  # only the requests that land here, packed as one
                    lay = self._st.layout
                    chunk = (
                        chunk.view(lay.torch_dtype)
                        .view(len(s.layers), *lay.staging_shape(total))
                        .index_select(lay.block_dim + 1, picks)
                        .reshape(-1)
                        .view(torch.uint8)
                    )
                # a copy on the thread pool is waited for even when cancelled
                await self._st.copy(
                    functools.partial(
                        scatter_blocks,
                        chunk,
                        self._st.caches,
                        self._st.layout,
                        ids,
                        layers=s.layers,
                    ),
                    chunk.numel(),
                )
                del chunk
            del raw
        except Exception as exc:  # the transfer is all-or-nothing: every request failed
            self._st.stats.recv_failures += len(mine)
            self._drops.drop(base, names[taken:], frm, deadline)
            for rid in mine:
                out[rid] = exc
            return out
        except BaseException:
            self._st.stats.recv_failures += len(mine)
            self._drops.drop(base, names[taken:], frm, deadline)
            raise
        finally:
            self._st.receiving.difference_update(mine)
        self._st.stats.recv_failures += len(mine) - len(landed)
        if landed:
            self._st.stats.chunks_received += len(plan)
        for rid, n in landed:
            self._st.received(rid, 0, n, t0)
        return out

    @staticmethod
    def _batch_plan(
        base: str, entries: list[tuple[str, int]], hosts: dict[str, torch.Tensor]
    ) -> tuple[list[tuple[str, int, int]], dict[str, Exception]]:
        """Which of the batch's requests land here, as ``(request_id, first block in the
        batch, block count)`` in packing order, and the errors of those that do not: a
        block count other than this side's, or not in the batch (refused by the
        producer)."""
        keep: list[tuple[str, int, int]] = []
        failed: dict[str, Exception] = {}
        at = 0
        for rid, n in entries:
            h = hosts.get(rid)
            if h is not None and h.numel() == n:
                keep.append((rid, at, n))
            elif h is not None:
                failed[rid] = LayoutMismatchError(
                    f"KV request {rid!r}: the producer sent {n} blocks in batch {base!r}, "
                    f"the consumer expects {h.numel()}",
                    code="kv_size_mismatch",
                )
            at += n
        carried = {rid for rid, _ in entries}
        for rid in hosts:
            if rid not in carried:
                failed[rid] = TransferError(
                    f"KV request {rid!r}: the producer did not send it in batch {base!r} "
                    "(its send_requests refused it)"
                )
        return keep, failed

    # ------------------------------------------------------------------ over the IPC plane

    def _plain_ids(
        self, block_ids: torch.Tensor | Sequence[int], *, unique: bool, what: str
    ) -> list[int]:
        """Block ids checked by :meth:`ConnectorState.host_ids`'s rules, as a list: a list, tuple or
        CPU integer tensor is checked in Python (the torch calls of the tensor check cost
        tens of µs per request on a GPU host, more than an IPC batch's whole host work
        per request)."""
        ids = plain_block_ids(block_ids, self._st.layout.num_blocks, unique=unique, what=what)
        if ids is not None:
            return ids
        out: list[int] = self._st.host_ids(block_ids, unique=unique, what=what).tolist()
        return out

    async def send_batch_ipc(
        self, plane: Plane, requests: Iterable[BatchItem], *, to: str, timeout: float | None
    ) -> BatchResults:
        """:meth:`KVConnector.send_requests` over the IPC plane: the requests that pass their checks
        go as one plane request per part (:func:`_ipc_parts`), named and packed as the
        consumer derives them (:func:`ipc_batch_name`)."""
        self._st.check_open()
        items = self.batch_items(requests, "send_requests")
        deadline = self._st.deadline(timeout)
        out: BatchResults = {rid: None for rid, _ in items}
        going: dict[str, list[int]] = {}
        for rid, block_ids in items:
            try:
                if rid in self._st.sending:
                    raise ConfigError(f"request {rid!r} is already being sent")
                going[rid] = self._plain_ids(block_ids, unique=False, what="send_requests")
            except ConfigError as exc:  # this request only: the others go on
                out[rid] = exc
                self._st.stats.send_failures += 1
        parts = _ipc_parts(sorted((rid, len(ids)) for rid, ids in going.items()))
        self._st.sending.update(going)
        try:
            results = await asyncio.gather(
                *(self._send_ipc_part(plane, part, going, to, deadline) for part in parts),
                return_exceptions=True,
            )
        finally:
            self._st.sending.difference_update(going)
        return self._part_results(out, parts, results)

    async def _send_ipc_part(
        self,
        plane: Plane,
        part: tuple[tuple[str, int], ...],
        ids: dict[str, list[int]],
        to: str,
        deadline: float,
    ) -> None:
        """One plane request of a batch: its requests' blocks, concatenated in packing
        order, sent by the plane (which takes the ordinary path by itself where IPC does
        not work); the plane's report of it is each request's (:meth:`ConnectorState.sent`)."""
        if not any(n for _, n in part):  # no blocks at all: nothing to move
            t0 = time.perf_counter()
            for rid, _ in part:
                self._st.sent(rid, 0, 0, t0)
            return
        name = ipc_batch_name(part)
        self._st.ipc_batches[name] = part
        try:
            await plane.send_request(
                name,
                [i for rid, _ in part for i in ids[rid]],
                to=to,
                timeout=max(0.0, deadline - time.monotonic()),
            )
        except asyncio.CancelledError:
            # the plane frees the blocks once the consumer's release (or the lease)
            # ends the loan (blocks_free: every request joins finished_sending); the
            # name is forgotten in any case some time after the deadline
            asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()) + _FORGET_S, self._forget, name, part
            )
            raise
        except BaseException:
            self._forget(name, part)
            raise
        self._forget(name, part)

    def _forget(self, name: str, part: tuple[tuple[str, int], ...]) -> None:
        if self._st.ipc_batches.get(name) is part:
            del self._st.ipc_batches[name]

    async def recv_batch_ipc(
        self,
        plane: Plane,
        requests: Iterable[BatchItem],
        *,
        frm: str | None,
        timeout: float | None,
    ) -> BatchResults:
        """:meth:`KVConnector.recv_requests` over the IPC plane: the requests that pass their checks
        are received as the producer's parts (:func:`_ipc_parts`), one plane request
        each, straight into this side's blocks."""
        self._st.check_open()
        items = self.batch_items(requests, "recv_requests")
        deadline = self._st.deadline(timeout)
        out: BatchResults = {rid: None for rid, _ in items}
        going: dict[str, list[int]] = {}
        for rid, block_ids in items:
            try:
                if rid in self._st.receiving:
                    raise ConfigError(f"request {rid!r} is already being received")
                going[rid] = self._plain_ids(block_ids, unique=True, what="recv_requests")
            except ConfigError as exc:  # this request only: the others go on
                out[rid] = exc
        if len(going) > 1:
            n_all = sum(len(ids) for ids in going.values())
            if len({i for ids in going.values() for i in ids}) != n_all:
                raise ConfigError(
                    "recv_requests: two requests of the batch share a block; nothing was moved"
                )
        self._st.stats.recv_failures += len(out) - len(going)
        parts = _ipc_parts(sorted((rid, len(ids)) for rid, ids in going.items()))
        self._st.receiving.update(going)
        try:
            results = await asyncio.gather(
                *(self._recv_ipc_part(plane, part, going, frm, deadline) for part in parts),
                return_exceptions=True,
            )
        finally:
            self._st.receiving.difference_update(going)
        return self._part_results(out, parts, results)

    async def _recv_ipc_part(
        self,
        plane: Plane,
        part: tuple[tuple[str, int], ...],
        ids: dict[str, list[int]],
        frm: str | None,
        deadline: float,
    ) -> None:
        """One plane request of a batch into this side's blocks of its requests,
        concatenated in packing order; the plane's report of it is each request's
        (:meth:`ConnectorState.received`)."""
        if not any(n for _, n in part):  # no blocks at all: nothing to move
            t0 = time.perf_counter()
            for rid, _ in part:
                self._st.received(rid, 0, 0, t0)
            return
        name = ipc_batch_name(part)
        self._st.ipc_batches[name] = part
        try:
            await plane.recv_request(
                name,
                [i for rid, _ in part for i in ids[rid]],
                frm=frm,
                timeout=max(0.0, deadline - time.monotonic()),
                layerwise=False,
            )
        finally:
            self._forget(name, part)

    @staticmethod
    def _part_results(
        out: BatchResults,
        parts: list[tuple[tuple[str, int], ...]],
        results: list[BaseException | None],
    ) -> BatchResults:
        """Each part's outcome is each of its requests' (a part is all-or-nothing)."""
        for part, r in zip(parts, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            if r is not None:
                for rid, _ in part:
                    out[rid] = r
        return out


#: the most blocks one plane request of a batch carries: the plane's descriptor lists the
#: source block ids (4 bytes each) in one control message of at most 1 MiB
#: (``aiokv.kv.ipc._wire.MAX_MESSAGE_BYTES``), beside the producer's offer on the first
#: request to a consumer; this leaves that offer three quarters of it
IPC_BATCH_BLOCKS = 1 << 16
#: how long after its deadline a cancelled batch's plane request is remembered at most
#: (the plane reports its blocks free at the consumer's release, or at the lease's end
#: plus ``IpcOptions.grace_s``, at most 600 s)
_FORGET_S = 660.0


def _ipc_parts(entries: list[tuple[str, int]]) -> list[tuple[tuple[str, int], ...]]:
    """A batch's ``(request_id, block count)`` pairs, in packing order, cut into the plane
    requests that carry them: consecutive runs of at most :data:`IPC_BATCH_BLOCKS`
    blocks (a request larger than that alone). One part unless the batch is that large;
    both sides cut the same pairs the same way."""
    parts: list[tuple[tuple[str, int], ...]] = []
    cur: list[tuple[str, int]] = []
    size = 0
    for rid, n in entries:
        if cur and size + n > IPC_BATCH_BLOCKS:
            parts.append(tuple(cur))
            cur, size = [], 0
        cur.append((rid, n))
        size += n
    if cur:
        parts.append(tuple(cur))
    return parts
