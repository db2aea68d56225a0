"""The engine-transport path of :class:`~aiokv.kv.KVConnector` (TCP or NCCL): a
request's blocks gathered into staging in chunks of whole layers (or one layer at a
time), sent pipelined beside the request's header, and on the consumer collected,
checked and scattered -- or, after a failure or a cancellation, dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import AiokvError, ConfigError
from ._connector_base import _cancelling, _ConnectorBase, _LayerSave
from .ops import Lease, gather_blocks, scatter_blocks


class _ChunkedPath(_ConnectorBase):
    """The producer's and the consumer's side of a request over the engine's transport."""

    def _send_header(
        self, request_id: str, n_blocks: int, mode: str, to: str, deadline: float
    ) -> asyncio.Task[BaseException | None]:
        t = self._header(n_blocks, mode)
        handle = self.engine.send_nowait(
            self.header_name(request_id), t, to=to, timeout=_time_left(deadline)
        )
        return self._track(handle, None, t)

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
