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
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import ConfigError, LayoutMismatchError, TransferError
from ._chunked_path import _ChunkedPath
from ._connector_base import _cancelling
from .ops import gather_blocks, scatter_blocks

#: one request of a batch: its id and its block ids (this side's)
BatchItem = tuple[str, "torch.Tensor | Sequence[int]"]
#: what a batch call returns: each request's id, and None (moved) or its error
BatchResults = dict[str, Exception | None]


class _BatchedPath(_ChunkedPath):
    """Both sides of a step batch over the engine's transport."""

    def _batch_items(
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
            self._check_rid(rid)
            if rid in seen:
                raise ConfigError(
                    f"{what}: request {rid!r} appears twice in the batch; nothing was moved"
                )
            seen.add(rid)
            out.append((rid, block_ids))
        return out

    # ------------------------------------------------------------------ producer

    async def _send_batch(
        self, requests: Iterable[BatchItem], *, to: str, timeout: float | None
    ) -> BatchResults:
        """:meth:`send_requests` by the engine's transport."""
        self._check_open()
        items = self._batch_items(requests, "send_requests")
        deadline = self._deadline(timeout)
        out: BatchResults = {rid: None for rid, _ in items}
        if not items:
            return out
        hosts: list[tuple[str, torch.Tensor]] = []
        for rid, block_ids in items:
            try:
                if rid in self._sending:
                    raise ConfigError(f"request {rid!r} is already being sent")
                hosts.append((rid, self._host_ids(block_ids, unique=False, what="send_requests")))
            except ConfigError as exc:  # this request only: the others go on
                out[rid] = exc
                self._stats.send_failures += 1
        sent = [rid for rid, _ in hosts]
        self._sending.update(sent)
        t0 = time.perf_counter()
        base = self.batch_name(list(out))
        all_ids = torch.cat([h for _, h in hosts]) if hosts else torch.empty(0, dtype=torch.int64)
        plan = self.chunk_plan(all_ids.numel())
        inline = self.device.type == "cpu" and bool(plan)
        prefix = self._batch_prefix([(rid, h.numel()) for rid, h in hosts], inline)
        inflight: deque[asyncio.Task[BaseException | None]] = deque()
        try:
            if not inline:  # the header travels alone (a CUDA cache, or no blocks at all)
                head = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
                handle = self.engine.send_nowait(base, head, to=to, timeout=_time_left(deadline))
                inflight.append(self._track(handle, None, head))
            ids = self._op_ids(all_ids)
            for i, s in enumerate(plan):
                while len(inflight) >= self.max_inflight:
                    await self._result(inflight.popleft())
                first = inline and i == 0
                inflight.append(
                    await self._stage_batch_chunk(
                        base if first else self.batch_chunk_name(base, i),
                        all_ids.numel(),
                        ids,
                        s.layers,
                        prefix if first else b"",
                        to,
                        deadline,
                    )
                )
            while inflight:
                await self._result(inflight.popleft())
        except Exception as exc:  # the transfer is all-or-nothing: every request failed
            self._stats.send_failures += len(sent)
            for rid in sent:
                out[rid] = exc
            return out
        except BaseException:
            self._stats.send_failures += len(sent)
            raise
        finally:
            self._sending.difference_update(sent)
        self._stats.chunks_sent += len(plan)
        for rid, h in hosts:
            self._sent(rid, 0, h.numel(), t0)
        return out

    async def _stage_batch_chunk(
        self,
        name: str,
        n_blocks: int,
        ids: torch.Tensor,
        layers: range,
        prefix: bytes,
        to: str,
        deadline: float,
    ) -> asyncio.Task[BaseException | None]:
        """Gather one chunk of a batch (after ``prefix``, the header, when it opens the
        batch) into staging and start its send."""
        row = n_blocks * self.layout.block_nbytes()
        nbytes = len(layers) * row
        off = len(prefix)
        lease = await self._lease(off + nbytes, deadline)
        try:
            buf = (
                lease.tensor
                if lease is not None
                else torch.empty(off + nbytes, dtype=torch.uint8, device=self.device)
            )
            if off:
                buf[:off] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
            await self._copy(
                functools.partial(
                    gather_blocks, self.caches, self.layout, ids, out=buf[off:], layers=layers
                ),
                nbytes,
            )
            msg = buf if off else buf.view(len(layers), row)
            handle = self.engine.send_nowait(name, msg, to=to, timeout=_time_left(deadline))
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return self._track(handle, lease, msg)

    # ------------------------------------------------------------------ consumer

    async def _recv_batch(
        self, requests: Iterable[BatchItem], *, frm: str | None, timeout: float | None
    ) -> BatchResults:
        """:meth:`recv_requests` by the engine's transport."""
        self._check_open()
        items = self._batch_items(requests, "recv_requests")
        deadline = self._deadline(timeout)
        out: BatchResults = {rid: None for rid, _ in items}
        if not items:
            return out
        hosts: dict[str, torch.Tensor] = {}
        for rid, block_ids in items:
            try:
                if rid in self._receiving:
                    raise ConfigError(f"request {rid!r} is already being received")
                hosts[rid] = self._host_ids(block_ids, unique=True, what="recv_requests")
            except ConfigError as exc:  # this request only: the others go on
                out[rid] = exc
        if len(hosts) > 1:
            every = torch.cat(list(hosts.values()))
            if torch.unique(every).numel() != every.numel():
                raise ConfigError(
                    "recv_requests: two requests of the batch share a block; nothing was moved"
                )
        self._stats.recv_failures += len(out) - len(hosts)
        base = self.batch_name(list(out))
        mine = list(hosts)
        self._receiving.update(mine)
        for rid in mine:
            drain = self._drains.pop(rid, None)
            if drain is not None:  # a cancelled predecessor's leftovers
                drain.cancel()
        task = asyncio.current_task()
        cancels = _cancelling(task)
        t0 = time.perf_counter()
        # until the header says otherwise: the chunks this side's requests would take
        expect = len(self.chunk_plan(sum(h.numel() for h in hosts.values())))
        names = [base] + [self.batch_chunk_name(base, i) for i in range(expect)]
        taken = 0  # of names: collected from the engine
        landed: list[tuple[str, int]] = []
        try:
            raw = await self.engine.recv(base, frm=frm, timeout=_time_left(deadline))
            taken = 1
            self._check_cancelled(task, cancels)
            entries, inline, off = self._check_batch_header(base, raw, out)
            total = sum(n for _, n in entries)
            plan = self.chunk_plan(total)
            names = [base] + [
                self.batch_chunk_name(base, i) for i in range(1 if inline else 0, len(plan))
            ]
            keep, failed = self._batch_plan(base, entries, hosts)
            out.update(failed)
            landed = [(rid, n) for rid, _, n in keep]
            ids = self._op_ids(
                torch.cat([hosts[rid] for rid, _, _ in keep])
                if keep
                else torch.empty(0, dtype=torch.int64)
            )
            # (the blocks of the batch this side writes, when not all of them)
            picks = (
                None
                if not keep or sum(n for _, _, n in keep) == total
                else self._op_ids(torch.cat([torch.arange(at, at + n) for _, at, n in keep]))
            )
            for i, s in enumerate(plan):
                if inline and i == 0:
                    chunk = self._check_chunk(base, raw[off:], len(s.layers), total)
                else:
                    name = self.batch_chunk_name(base, i)
                    got = await self.engine.recv(name, frm=frm, timeout=_time_left(deadline))
                    taken += 1
                    # a cancel that arrived while the chunk landed: never scatter it
                    self._check_cancelled(task, cancels)
                    chunk = self._check_chunk(name, got, len(s.layers), total)
                    del got
                if not keep:
                    continue
                if picks is not None:  # only the requests that land here, packed as one
                    lay = self.layout
                    chunk = (
                        chunk.view(lay.torch_dtype)
                        .view(len(s.layers), *lay.staging_shape(total))
                        .index_select(lay.block_dim + 1, picks)
                        .reshape(-1)
                        .view(torch.uint8)
                    )
                # a copy on the thread pool is waited for even when cancelled
                await self._copy(
                    functools.partial(
                        scatter_blocks, chunk, self.caches, self.layout, ids, layers=s.layers
                    ),
                    chunk.numel(),
                )
                del chunk
            del raw
        except Exception as exc:  # the transfer is all-or-nothing: every request failed
            self._stats.recv_failures += len(mine)
            self._drop(base, names[taken:], frm, deadline)
            for rid in mine:
                out[rid] = exc
            return out
        except BaseException:
            self._stats.recv_failures += len(mine)
            self._drop(base, names[taken:], frm, deadline)
            raise
        finally:
            self._receiving.difference_update(mine)
        self._stats.recv_failures += len(mine) - len(landed)
        if landed:
            self._stats.chunks_received += len(plan)
        for rid, n in landed:
            self._received(rid, 0, n, t0)
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

    # ------------------------------------------------------------------ one by one

    async def _each(
        self, items: list[tuple[str, torch.Tensor | Sequence[int]]], calls: list[Any]
    ) -> BatchResults:
        """A batch moved request by request (the IPC plane): each outcome in the map."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        out: BatchResults = {}
        for (rid, _), r in zip(items, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out[rid] = r if isinstance(r, Exception) else None
        return out
