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

import torch

from aiokv._runtime.deadlines import _time_left

from .._exceptions import AiokvError, ConfigError
from ._connector_base import ConnectorState, _cancelling, _check_cancelled, _LayerSave
from ._request_codec import chunk_name, header_name, layer_name
from .ops import Lease, gather_blocks, scatter_blocks


class _ChunkedPath:
    """The producer's and the consumer's side of a request over the engine's transport,
    on the connector's state."""

    def __init__(self, state: ConnectorState) -> None:
        self._st = state

    def _send_header(
        self, request_id: str, n_blocks: int, mode: str, to: str, deadline: float
    ) -> asyncio.Task[BaseException | None]:
        t = self._st.codec.header(n_blocks, mode)
        handle = self._st.engine.send_nowait(
            header_name(request_id), t, to=to, timeout=_time_left(deadline)
        )
        return self._st.track(handle, None, t)

    async def send_ordinary(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """:meth:`KVConnector.send_request` by the engine's transport."""
        self._st.check_open()
        self._st.check_rid(request_id)
        deadline = self._st.deadline(timeout)
        host = self._st.host_ids(block_ids, unique=False, what="send_request")
        if request_id in self._st.sending:
            raise ConfigError(f"request {request_id!r} is already being sent")
        self._st.sending.add(request_id)
        t0 = time.perf_counter()
        inflight: deque[asyncio.Task[BaseException | None]] = deque()
        try:
            plan = self._st.codec.chunk_plan(host.numel())
            # the header travels beside the chunks (not counted in max_inflight); an
            # empty request moves nothing, not even a header
            head = (
                self._send_header(request_id, host.numel(), "chunks", to, deadline)
                if plan
                else None
            )
            ids = self._st.op_ids(host)
            for i, s in enumerate(plan):
                while len(inflight) >= self._st.max_inflight:
                    await self._st.result(inflight.popleft())
                inflight.append(
                    await self._st.stage_and_send(
                        chunk_name(request_id, i), host.numel(), ids, s.layers, to, deadline
                    )
                )
            if head is not None:
                await self._st.result(head)
            while inflight:
                await self._st.result(inflight.popleft())
        except BaseException:
            self._st.stats.send_failures += 1
            raise
        finally:
            self._st.sending.discard(request_id)
        self._st.sent(request_id, len(plan), host.numel(), t0)

    def save_layer_ordinary(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """:meth:`KVConnector.save_layer` by the engine's transport."""
        self._st.check_open()
        self._st.check_rid(request_id)
        if type(layer) is not int or not 0 <= layer < self._st.layout.num_layers:
            raise ConfigError(
                f"layer must be an int in [0, {self._st.layout.num_layers}), got {layer!r}"
            )
        host = self._st.host_ids(block_ids, unique=False, what="save_layer")
        n = host.numel()
        save = self._st.saves.get(request_id)
        if save is None:
            save = _LayerSave(to, n, time.perf_counter())
            if n:
                save.header = self._send_header(
                    request_id, n, "layers", to, self._st.deadline(timeout)
                )
            self._st.saves[request_id] = save
        elif save.to != to or save.n_blocks != n:
            raise ConfigError(
                f"save_layer({request_id!r}, {layer}): {n} blocks to {to} but earlier layers "
                f"had {save.n_blocks} blocks to {save.to}"
            )
        if layer in save.tasks:
            raise ConfigError(f"layer {layer} of {request_id!r} was already saved")
        deadline = self._st.deadline(timeout)
        nbytes = n * self._st.layout.block_nbytes()
        lease: Lease | None = None
        if nbytes:
            pool = self._st.get_pool()
            if pool._round(nbytes) <= pool.capacity:
                lease = pool.try_alloc(nbytes)
        try:
            out = lease.tensor if lease is not None else None
            ids = self._st.op_ids(host)
            stage = gather_blocks(
                self._st.caches, self._st.layout, ids, out=out, layers=range(layer, layer + 1)
            )
            view = stage.view(1, nbytes)
            handle = self._st.engine.send_nowait(
                layer_name(request_id, layer),
                view,
                to=to,
                timeout=_time_left(deadline),
            )
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        save.tasks[layer] = self._st.track(handle, lease, view)

    async def wait_saved_ordinary(self, request_id: str) -> None:
        """:meth:`KVConnector.wait_saved` of layers saved by the engine's transport."""
        save = self._st.saves.pop(request_id, None)
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
            self._st.stats.send_failures += 1
            raise
        if failed is not None:
            self._st.stats.send_failures += 1
            raise failed
        missing = [i for i in range(self._st.layout.num_layers) if i not in save.tasks]
        if missing:
            self._st.stats.send_failures += 1
            raise ConfigError(
                f"request {request_id!r}: layers {missing[:8]}{'...' if len(missing) > 8 else ''} "
                "were never saved"
            )
        self._st.sent(request_id, len(save.tasks), save.n_blocks, save.started)

    async def recv_ordinary(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        """:meth:`KVConnector.recv_request` by the engine's transport."""
        self._st.check_open()
        self._st.check_rid(request_id)
        deadline = self._st.deadline(timeout)
        host = self._st.host_ids(block_ids, unique=True, what="recv_request")
        n = host.numel()
        if request_id in self._st.receiving:
            raise ConfigError(f"request {request_id!r} is already being received")
        self._st.receiving.add(request_id)
        drain = self._st.drains.pop(request_id, None)
        if drain is not None:  # a cancelled predecessor's leftovers: this request owns the ids now
            drain.cancel()
        task = asyncio.current_task()
        base = _cancelling(task)
        t0 = time.perf_counter()
        if layerwise:
            L = self._st.layout.num_layers
            items = (
                [(layer_name(request_id, li), range(li, li + 1)) for li in range(L)] if n else []
            )
        else:
            items = [
                (chunk_name(request_id, i), s.layers)
                for i, s in enumerate(self._st.codec.chunk_plan(n))
            ]
        # an empty request moves nothing, not even a header, and completes at once
        names = ([header_name(request_id)] if n else []) + [name for name, _ in items]
        taken = 0  # of names: collected from the engine (scattered or dropped)
        try:
            if n:
                left = _time_left(deadline)
                raw = await self._st.engine.recv(names[0], frm=frm, timeout=left)
                taken = 1
                _check_cancelled(task, base)
                self._st.codec.check_header(request_id, raw, n, layerwise)
                del raw
            ids = self._st.op_ids(host)
            for name, layers in items:
                left = _time_left(deadline)
                raw = await self._st.engine.recv(name, frm=frm, timeout=left)
                taken += 1
                # a cancel that arrived while the chunk landed: never scatter it
                _check_cancelled(task, base)
                chunk = self._st.codec.check_chunk(name, raw, len(layers), n)
                del raw
                # a copy on the thread pool is waited for even when cancelled
                await self._st.copy(
                    functools.partial(
                        scatter_blocks, chunk, self._st.caches, self._st.layout, ids, layers=layers
                    ),
                    chunk.numel(),
                )
                del chunk
        except BaseException:
            self._st.stats.recv_failures += 1
            self.drop(request_id, names[taken:], frm, deadline)
            raise
        finally:
            self._st.receiving.discard(request_id)
        self._st.received(request_id, len(items), n, t0)
        return "engine"

    def drop(
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
        eng = self._st.discards
        rest: list[str] = []
        for name in names:
            try:
                if eng is not None and eng.discard(name):
                    continue
            except AiokvError:  # the engine is closed: nothing is left to drop
                return
            rest.append(name)
        if not rest or not late or self._st.closed:
            return
        window = max(deadline - time.monotonic(), self._st.deadline(None) - time.monotonic())
        d = asyncio.ensure_future(self._drain(rest, frm, window))
        self._st.drains[request_id] = d

        def forget(t: asyncio.Task[None]) -> None:
            if self._st.drains.get(request_id) is t:
                del self._st.drains[request_id]

        d.add_done_callback(forget)

    async def _drain(self, names: list[str], frm: str | None, window: float) -> None:
        """Collect and drop ``names`` as they arrive (all at once: any may come first)."""

        async def one(name: str) -> None:
            # a timeout or a closed engine ends the wait; the tensor, if any, is dropped
            with contextlib.suppress(AiokvError):
                await self._st.engine.recv(name, frm=frm, timeout=window)

        await asyncio.gather(*(one(name) for name in names))
