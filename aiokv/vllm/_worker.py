"""The worker side of :class:`~aiokv.vllm.AiokvConnector`: an aiokv engine and
:class:`~aiokv.kv.KVConnector` over vLLM's paged caches on an event loop of the
worker's own thread; each synchronous call hands its whole step to that loop
(docs/vllm.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)

from .._exceptions import AiokvError
from ._layout import describe_caches
from ._loop import LoopThread
from ._protocol import (
    DeclineSpec,
    LoadSpec,
    SendSpec,
    batch_wire_id,
    decline_name,
    with_port_offset,
)
from ._settings import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from aiokv.engine import Engine

    from ..kv import KVConnector, KVLayout

from ._meta import AiokvHandshake, AiokvMetadata

if TYPE_CHECKING:
    from .connector import AiokvConnector

log = logging.getLogger("aiokv.vllm")

#: declines a decode worker has in flight at once (beyond: the prefill's lease frees)
_MAX_DECLINES = 256
#: how long a decline waits for the prefill's engine
_DECLINE_TIMEOUT = 5.0
#: how long a decode waits for the rest of a step batch once one of its requests came
_BATCH_GRACE = 2.0
#: step batches a decode remembers having received
_BATCHES_REMEMBERED = 4096


@dataclasses.dataclass(eq=False)
class _Batch:
    """A step batch on a worker: its requests (vLLM's ids), those that ended."""

    members: set[str]
    ended: set[str] = dataclasses.field(default_factory=set)
    task: asyncio.Task[None] | None = None


@dataclasses.dataclass(eq=False)
class _RecvBatch(_Batch):
    """A step batch a decode receives: the producer's wire ids, the places taken (by
    a request that loads, or one that failed), those that load."""

    frm: str = ""
    wire: tuple[str, ...] = ()
    taken: set[int] = dataclasses.field(default_factory=set)
    slots: dict[int, LoadSpec] = dataclasses.field(default_factory=dict)
    complete: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except AssertionError:  # no tensor-parallel group (a bare worker in tests)
        return 0


class _WorkerSide:
    def __init__(self, c: AiokvConnector, vllm_config: VllmConfig) -> None:
        self.c = c
        self.settings: Settings = c.settings
        self.vllm_config = vllm_config
        self.rank = _tp_rank()
        self.loop: LoopThread | None = None
        self.engine: Engine | None = None
        self.kv: KVConnector | None = None
        self.layout: KVLayout | None = None
        self.address: str | None = None
        self._layer_index: dict[str, int] = {}
        self._saved: dict[str, set[int]] = {}  # layer-wise pushes: layers saved (loop thread)
        self._lock = threading.Lock()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # by request id (loop thread)
        self._sending: set[str] = set()
        self._sent: set[str] = set()  # done, not reported yet
        self._loaded: set[str] = set()  # done (or cancelled), not reported yet
        self._failed: set[str] = set()  # subset of _loaded
        self._finished: set[str] = set()  # request ids vLLM said finished
        self._declines: set[asyncio.Task[None]] = set()  # (loop thread)
        # step batches (loop thread): by request id; being received, by (peer, wire ids);
        # received lately (a request of one that comes later fails at once)
        self._batches: dict[str, _Batch] = {}
        self._recv_batches: dict[tuple[str, tuple[str, ...]], _RecvBatch] = {}
        self._batches_done: dict[tuple[str, tuple[str, ...]], None] = {}
        self._stats: dict[str, Any] = {
            "loads": 0,
            "load_failures": 0,
            "loads_cancelled": 0,
            "sends": 0,
            "send_failures": 0,
            "sends_declined": 0,
            "batches_sent": 0,  # step batches (send_requests), each of 2 or more requests
            "batches_received": 0,  # (recv_requests)
            "declines": 0,
            "layers_saved": 0,  # in the forward (save_kv_layer)
            "layers_saved_after": 0,  # after it (vLLM did not save them)
            "blocks_loaded": 0,
            "bytes_loaded": 0,
        }

    # ---------------------------------------------------------------- set-up

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc = self.vllm_config.model_config
        layout, tensors, names = describe_caches(
            kv_caches,
            layout_name=self.vllm_config.cache_config.kv_cache_layout,
            block_size=self.c._block_size,
            num_kv_heads=mc.get_num_kv_heads(self.vllm_config.parallel_config),
            head_dim=mc.get_head_size(),
            use_mla=bool(getattr(mc, "use_mla", False)),
        )
        self.layout = layout
        self._layer_index = {n: i for i, n in enumerate(names)}
        self.loop = LoopThread(f"aiokv-vllm-{self.rank}")
        self.engine, self.kv = self.loop.call(self._start(layout, tensors), 60.0)
        self.address = self.settings.advertised(self.engine.address, self.rank)
        log.info(
            "AiokvConnector: worker %d: aiokv engine at %s, layout %s, mode %s",
            self.rank,
            self.address,
            layout.to_wire(),
            self.settings.mode,
        )

    async def _start(
        self, layout: KVLayout, tensors: list[torch.Tensor]
    ) -> tuple[Engine, KVConnector]:
        from .. import Engine, EngineConfig, Limits, Timeouts
        from ..kv import KVConnector

        s = self.settings
        device = tensors[0].device
        cfg = EngineConfig(
            listen=s.address_for(self.rank),
            device=str(device) if device.type == "cuda" else "cpu",
            layout=layout.to_wire(),
            gc_freeze=False,  # vLLM's process: not ours to freeze
            timeouts=Timeouts(transfer=max(s.timeout, s.lease_seconds)),
            limits=Limits(
                store_bytes=s.store_bytes, credit_bytes=min(64 << 20, s.store_bytes // 4)
            ),
            nccl_max_channels=s.nccl_max_channels,
        )
        engine = Engine(cfg)
        await engine.start()
        kv = KVConnector(
            engine, layout, tensors, chunk_bytes=s.chunk_bytes, staging_bytes=s.staging_bytes
        )
        return engine, kv

    def handshake_metadata(self) -> AiokvHandshake | None:
        if self.address is None or self.layout is None:
            return None
        return AiokvHandshake(self.address, self.layout.to_wire())

    # ---------------------------------------------------------------- work

    def _loop(self) -> LoopThread:
        if self.loop is None:
            raise RuntimeError("AiokvConnector: a transfer before register_kv_caches")
        return self.loop

    # Each of these hands the whole step to the loop thread at once: one hand-off per
    # step (per layer for save_layer), whatever the number of requests.

    def start_loads(self, meta: AiokvMetadata) -> None:
        if meta.load or meta.cancel or meta.decline:
            self._loop().soon(
                functools.partial(self._step_loads, meta.load, meta.cancel, meta.decline)
            )

    def start_sends(self, meta: AiokvMetadata) -> None:
        if meta.send:
            with self._lock:
                self._sending.update(s.req_id for s in meta.send)
            self._loop().soon(functools.partial(self._step_sends, meta.send))

    def save_layer(self, meta: AiokvMetadata, layer_name: str) -> None:
        """(forward thread) Start sending ``layer_name`` of the step's layer-wise pushes."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        specs = [s for s in meta.send if s.layerwise]
        if specs:
            self._loop().soon(functools.partial(self._save_layers, specs, layer))

    def _save_layers(self, specs: list[SendSpec], layer: int) -> None:
        for s in specs:
            self._save_layer(s, layer, True)

    def _step_sends(self, specs: list[SendSpec]) -> None:
        """(loop thread) The step's hand-ons: the whole pushes of one step batch in one
        task (one ``send_requests``), every other request in a task of its own."""
        assert self.loop is not None
        groups: dict[tuple[str, tuple[str, ...]], list[SendSpec]] = {}
        for s in specs:
            if s.batch is not None and s.push_to is not None and not s.layerwise:
                groups.setdefault((s.push_to, tuple(s.batch)), []).append(s)
            else:
                self._start_send(s)
        for group in groups.values():
            b = _Batch({s.req_id for s in group})
            b.task = self.loop.loop.create_task(self._send_batch(group))
            self._report_if_unstarted(b.task, group.copy)
            for s in group:
                self._tasks[s.req_id] = b.task
                self._batches[s.req_id] = b

    def _step_loads(
        self, loads: list[LoadSpec], cancel: list[str], declines: list[DeclineSpec]
    ) -> None:
        """(loop thread) The step's loads (a push step batch joins its batch; the pulls
        from one prefill, past no local hit, run as one task, one ``fetch_requests``;
        every other load runs as a task known by its request id at once, so that an
        abort that follows finds it), aborts and declines."""
        assert self.loop is not None
        pulls: dict[str, list[LoadSpec]] = {}
        for spec in loads:
            if spec.batch is not None and spec.mode == "push":
                self._join_batch(spec)
            elif spec.mode == "pull" and spec.skip == 0:
                pulls.setdefault(spec.addresses[self.rank], []).append(spec)
            else:
                self._start_load(spec)
        for frm, group in pulls.items():
            if len(group) == 1:
                self._start_load(group[0])
                continue
            b = _Batch({s.req_id for s in group})
            b.task = self.loop.loop.create_task(self._fetch_batch(frm, group))
            self._report_if_unstarted(b.task, group.copy)
            for s in group:
                self._tasks[s.req_id] = b.task
                self._batches[s.req_id] = b
        if cancel:
            self._cancel(set(cancel))
        for d in declines:
            self._start_decline(d)

    def _save_layer(self, s: SendSpec, layer: int, in_forward: bool) -> None:
        """(loop thread) One layer of a layer-wise push; a layer that fails is tried
        again after the forward (:meth:`_send`), and then missed by ``wait_saved``."""
        assert self.kv is not None and s.push_to is not None
        done = self._saved.setdefault(s.req_id, set())
        if layer in done:
            return
        try:
            self.kv.save_layer(
                s.key,
                layer,
                s.block_ids,
                to=with_port_offset(s.push_to, self.rank),
                timeout=self.settings.timeout,
            )
        except AiokvError as exc:
            log.debug("AiokvConnector: %s: layer %d not saved: %s", s.req_id, layer, exc)
            return
        done.add(layer)
        with self._lock:
            self._stats["layers_saved" if in_forward else "layers_saved_after"] += 1

    def _start_send(self, s: SendSpec) -> None:
        assert self.loop is not None
        task = self._tasks[s.req_id] = self.loop.loop.create_task(self._send(s))
        self._report_if_unstarted(task, [s].copy)

    def _start_load(self, spec: LoadSpec) -> None:
        assert self.loop is not None
        task = self._tasks[spec.req_id] = self.loop.loop.create_task(self._load(spec))
        self._report_if_unstarted(task, [spec].copy)

    def _report_if_unstarted(
        self,
        task: asyncio.Task[None],
        specs: Callable[[], Iterable[SendSpec | LoadSpec]],
    ) -> None:
        """A task cancelled before its first step (an abort in the same loop pass as
        its start) never runs its own reporting: its requests are reported when it
        ends instead (a request is reported once: its task entry goes with it)."""

        def done(t: asyncio.Task[None]) -> None:
            for spec in specs():
                if self._tasks.get(spec.req_id) is not t:
                    continue
                if isinstance(spec, SendSpec):
                    self._send_done(spec, False, False)
                else:
                    self._load_done(spec, "cancelled")

        task.add_done_callback(done)

    def _join_batch(self, spec: LoadSpec) -> None:
        """(loop thread) ``spec`` was pushed in a step batch: it takes its place there,
        and the batch is received (one ``recv_requests``) once every place is taken,
        or :data:`_BATCH_GRACE` after its first request came. A request whose own key
        is not the one at its place (its prompt is not the one the prefill computed),
        or that comes after its batch was received, fails alone."""
        assert self.loop is not None and spec.batch is not None
        frm = spec.addresses[self.rank]
        wire = tuple(spec.batch)
        k = (frm, wire)
        i = spec.batch_index
        why = None
        b = self._recv_batches.get(k)
        if k in self._batches_done:
            why = "its step batch was received before it came"
        elif b is not None and i in b.taken:
            why = f"place {i} of its step batch is taken"
        else:
            if b is None:
                b = _RecvBatch(set(), frm=frm, wire=wire)
                self._recv_batches[k] = b
                b.task = self.loop.loop.create_task(self._recv_batch(b))
                self._report_if_unstarted(b.task, b.slots.values)
            b.taken.add(i)  # by a request that fails too: nobody else comes for it
            if len(b.taken) == len(wire):
                b.complete.set()
            if batch_wire_id(spec.key) != wire[i]:
                why = "its prompt is not the one its prefill sent in that place"
        if why is not None:
            log.warning(
                "AiokvConnector: %s could not load its KV from %s: %s", spec.req_id, frm, why
            )
            self._load_done(spec, "failed")
            return
        assert b is not None and b.task is not None
        b.slots[i] = spec
        b.members.add(spec.req_id)
        self._tasks[spec.req_id] = b.task
        self._batches[spec.req_id] = b

    async def _send_batch(self, group: list[SendSpec]) -> None:
        """(loop thread) One step batch of whole pushes: one ``send_requests``; each
        request's outcome is its own."""
        assert self.kv is not None and group[0].push_to is not None
        to = with_port_offset(group[0].push_to, self.rank)
        outcome = dict.fromkeys((s.req_id for s in group), False)
        t0 = time.perf_counter()
        try:
            wire = [(s.batch[s.batch_index], s.block_ids) for s in group if s.batch is not None]
            res = await self.kv.send_requests(wire, to=to, timeout=self.settings.timeout)
            for s, (w, _) in zip(group, wire, strict=True):
                err = res.get(w)
                outcome[s.req_id] = err is None
                if err is not None:
                    log.warning("AiokvConnector: %s was not handed on: %s", s.req_id, err)
            with self._lock:
                self._stats["batches_sent"] += 1
            log.debug(
                "AiokvConnector: a step batch of %d requests handed to %s in %.1f ms",
                len(group),
                to,
                (time.perf_counter() - t0) * 1e3,
            )
        except asyncio.CancelledError:
            log.debug("AiokvConnector: a step batch stopped (its requests ended)")
        except AiokvError as exc:
            log.warning("AiokvConnector: a step batch of %d was not handed on: %s", len(group), exc)
        except Exception:
            log.exception("AiokvConnector: a step batch of %d was not handed on", len(group))
        finally:
            for s in group:
                self._send_done(s, outcome[s.req_id], False)

    async def _recv_batch(self, b: _RecvBatch) -> None:
        """(loop thread) Receive step batch ``b`` once its places are taken (or the
        grace ended): one ``recv_requests`` into this cache -- or, when a request's
        first blocks are a local prefix hit, into a scratch cache, copying the rest."""
        from ..kv import KVConnector

        assert self.kv is not None and self.layout is not None and self.engine is not None
        outcome: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(b.complete.wait(), min(_BATCH_GRACE, self.settings.timeout))
            self._recv_batches.pop((b.frm, b.wire), None)
            self._batches_done[(b.frm, b.wire)] = None
            while len(self._batches_done) > _BATCHES_REMEMBERED:
                del self._batches_done[next(iter(self._batches_done))]
            outcome = dict.fromkeys((s.req_id for s in b.slots.values()), "failed")
            if not b.slots:
                return
            kv, scratch = self.kv, None
            places: dict[int, Iterable[int]] = {i: s.block_ids for i, s in b.slots.items()}
            if any(s.skip for s in b.slots.values()):
                lay = dataclasses.replace(  # type: ignore[type-var]
                    self.layout, num_blocks=sum(s.n_remote for s in b.slots.values())
                )
                scratch = lay.allocate(self.kv.device)
                kv = KVConnector(self.engine, lay, scratch, chunk_bytes=self.settings.chunk_bytes)
                at = 0
                for i, s in b.slots.items():
                    places[i] = range(at, at + s.n_remote)
                    at += s.n_remote
            try:
                res = await kv.recv_requests(
                    [(w, list(places.get(i, ()))) for i, w in enumerate(b.wire)],
                    frm=b.frm,
                    timeout=self.settings.timeout,
                )
            finally:
                if scratch is not None:
                    await kv.aclose()
            for i, s in b.slots.items():
                err = res.get(b.wire[i])
                if err is not None:
                    log.warning(
                        "AiokvConnector: %s could not load its KV from %s: %s", s.req_id, b.frm, err
                    )
                    continue
                if scratch is not None:
                    self._copy_past_hit(scratch, s, int(next(iter(places[i]), 0)))
                outcome[s.req_id] = "ok"
            with self._lock:
                self._stats["batches_received"] += 1
            log.debug(
                "AiokvConnector: a step batch of %d requests from %s in %.1f ms",
                len(b.wire),
                b.frm,
                (time.perf_counter() - t0) * 1e3,
            )
        except asyncio.CancelledError:
            outcome = dict.fromkeys(outcome, "cancelled")
        except AiokvError as exc:
            log.warning("AiokvConnector: a step batch from %s could not load: %s", b.frm, exc)
        except Exception:
            log.exception("AiokvConnector: a step batch from %s could not load", b.frm)
        finally:
            self._recv_batches.pop((b.frm, b.wire), None)
            for s in b.slots.values():
                self._load_done(s, outcome.get(s.req_id, "cancelled"))

    async def _fetch_batch(self, frm: str, group: list[LoadSpec]) -> None:
        """(loop thread) A step's pull loads from the prefill at ``frm``: one
        ``fetch_requests``; each request's outcome is its own."""
        assert self.kv is not None
        outcome = dict.fromkeys((s.req_id for s in group), "failed")
        try:
            res = await self.kv.fetch_requests(
                [(s.key, list(s.block_ids)) for s in group],
                frm=frm,
                timeout=self.settings.timeout,
            )
            for s in group:
                err = res[s.key]
                if err is None:
                    outcome[s.req_id] = "ok"
                else:
                    log.warning(
                        "AiokvConnector: %s could not load its KV from %s: %s", s.req_id, frm, err
                    )
        except asyncio.CancelledError:
            outcome = dict.fromkeys(outcome, "cancelled")
        except AiokvError as exc:
            log.warning("AiokvConnector: a step's pulls from %s could not load: %s", frm, exc)
        except Exception:
            log.exception("AiokvConnector: a step's pulls from %s could not load", frm)
        finally:
            for s in group:
                self._load_done(s, outcome[s.req_id])

    def _copy_past_hit(self, scratch: list[torch.Tensor], spec: LoadSpec, at: int) -> None:
        """Copy remote blocks ``skip..n_remote`` of ``spec``, received into ``scratch``
        from block ``at`` on, to the request's blocks."""
        assert self.kv is not None and self.layout is not None
        dev = self.kv.device
        src = torch.arange(at + spec.skip, at + spec.n_remote, dtype=torch.int64, device=dev)
        dst = torch.tensor(spec.block_ids, dtype=torch.int64, device=dev)
        bd = self.layout.block_dim
        for s_l, d_l in zip(scratch, self.kv.caches.tensors):
            d_l.index_copy_(bd, dst, s_l.index_select(bd, src))

    def _start_decline(self, d: DeclineSpec) -> None:
        """(loop thread) Tell the pull prefill of ``d`` to free its blocks, in a task
        (bounded: beyond :data:`_MAX_DECLINES` in flight, the prefill's lease frees)."""
        assert self.loop is not None
        if len(self._declines) >= _MAX_DECLINES:
            log.warning("AiokvConnector: too many declines in flight; %s is not sent", d.req_id)
            return
        task = self.loop.loop.create_task(self._decline(d))
        self._declines.add(task)
        task.add_done_callback(self._declines.discard)

    async def _decline(self, d: DeclineSpec) -> None:
        assert self.engine is not None
        frm = d.addresses[self.rank]
        try:
            await self.engine.get(decline_name(d.key), frm=frm, timeout=_DECLINE_TIMEOUT)
        except AiokvError as exc:  # gone, or already taken: its lease or its decode freed it
            log.debug("AiokvConnector: %s: the decline to %s failed: %s", d.req_id, frm, exc)
            return
        with self._lock:
            self._stats["declines"] += 1
        log.debug("AiokvConnector: %s: %s frees the blocks it held for it", d.req_id, frm)

    async def _serve(self, s: SendSpec) -> str | None:
        """Pull: hold the request for one GET of its ticket, beside a decline ticket; a
        decode that will not load it GETs the decline and the blocks are free at once.
        Returns where the request went, or None when it was declined."""
        from ..kv import KVConnector

        assert self.kv is not None and self.engine is not None
        eng, lease = self.engine, self.settings.lease_seconds
        no = decline_name(s.key)
        eng.publish(no, torch.ones(1, dtype=torch.int64), once=True)
        declined = asyncio.ensure_future(eng.wait_fetched(no, timeout=lease))
        published = asyncio.Event()
        serve = asyncio.ensure_future(
            self.kv.serve_request(s.key, s.block_ids, timeout=lease, on_published=published.set)
        )
        try:
            await asyncio.wait({serve, declined}, return_when=asyncio.FIRST_COMPLETED)
            if not serve.done() and declined.done() and declined.exception() is None:
                out = asyncio.ensure_future(published.wait())
                await asyncio.wait({serve, out}, return_when=asyncio.FIRST_COMPLETED)
                out.cancel()
                # a decline counts while nobody took the request: then nobody will
                if not serve.done() and eng.unpublish(KVConnector.ticket_name(s.key)):
                    with contextlib.suppress(AiokvError):
                        await serve  # it ends at once: its ticket is gone
                    return None
            return await serve
        finally:
            eng.unpublish(no)
            declined.cancel()
            if not serve.done():
                serve.cancel()
                await asyncio.wait({serve})  # it stops before the blocks are reported

    async def _send(self, s: SendSpec) -> None:
        assert self.kv is not None
        ok = declined = False
        t0 = time.perf_counter()
        try:
            if s.push_to is None:
                to = await self._serve(s)
                declined = to is None
            elif s.layerwise:
                to = with_port_offset(s.push_to, self.rank)
                assert self.layout is not None
                # the layers the forward did not save (or that failed) go now; then
                # every layer is waited for (an unsaved one fails it, naming the layer)
                for layer in range(self.layout.num_layers):
                    self._save_layer(s, layer, False)
                await self.kv.wait_saved(s.key)
            else:
                to = with_port_offset(s.push_to, self.rank)
                await self.kv.send_request(s.key, s.block_ids, to=to, timeout=self.settings.timeout)
            ok = not declined
            log.debug(
                "AiokvConnector: %s %s in %.1f ms",
                s.req_id,
                "declined by its decode" if declined else f"handed to {to}",
                (time.perf_counter() - t0) * 1e3,
            )
        except asyncio.CancelledError:
            log.debug("AiokvConnector: %s: handing on stopped (the request ended)", s.req_id)
        except AiokvError as exc:
            log.warning("AiokvConnector: %s was not handed on: %s", s.req_id, exc)
        except Exception:
            log.exception("AiokvConnector: %s was not handed on", s.req_id)
        finally:
            self._send_done(s, ok, declined)

    def _send_done(self, s: SendSpec, ok: bool, declined: bool) -> None:
        self._tasks.pop(s.req_id, None)
        self._batches.pop(s.req_id, None)
        self._saved.pop(s.req_id, None)
        with self._lock:
            self._sending.discard(s.req_id)
            self._sent.add(s.req_id)
            self._stats["sends" if ok else "sends_declined" if declined else "send_failures"] += 1

    async def _load(self, spec: LoadSpec) -> None:
        assert self.kv is not None and self.layout is not None
        outcome = "failed"
        t0 = time.perf_counter()
        frm = spec.addresses[self.rank]
        try:
            if spec.skip == 0:
                await self._move(self.kv, spec, spec.block_ids, frm)
            else:
                await self._load_past_local_hit(spec, frm)
            outcome = "ok"
            log.debug(
                "AiokvConnector: %s loaded %d blocks from %s in %.1f ms",
                spec.req_id,
                len(spec.block_ids),
                frm,
                (time.perf_counter() - t0) * 1e3,
            )
        except asyncio.CancelledError:
            outcome = "cancelled"
        except AiokvError as exc:
            log.warning(
                "AiokvConnector: %s could not load its KV from %s: %s", spec.req_id, frm, exc
            )
        except Exception:
            log.exception("AiokvConnector: %s could not load its KV from %s", spec.req_id, frm)
        finally:
            self._load_done(spec, outcome)

    def _load_done(self, spec: LoadSpec, outcome: str) -> None:
        """(loop thread) Report a load: ``"ok"``, ``"cancelled"`` or ``"failed"`` (vLLM
        then recomputes the request, or fails it, by its ``kv_load_failure_policy``)."""
        assert self.layout is not None
        self._tasks.pop(spec.req_id, None)
        self._batches.pop(spec.req_id, None)
        with self._lock:
            self._loaded.add(spec.req_id)
            if outcome == "ok":
                self._stats["loads"] += 1
                self._stats["blocks_loaded"] += len(spec.block_ids)
                self._stats["bytes_loaded"] += self.layout.request_nbytes(len(spec.block_ids))
            elif outcome == "cancelled":
                self._stats["loads_cancelled"] += 1
            else:
                self._failed.add(spec.req_id)
                self._stats["load_failures"] += 1

    async def _move(
        self, kv: KVConnector, spec: LoadSpec, ids: Iterable[int] | torch.Tensor, frm: str
    ) -> None:
        ids = list(ids) if not isinstance(ids, torch.Tensor) else ids
        if spec.mode == "pull":
            await kv.fetch_request(spec.key, ids, frm=frm, timeout=self.settings.timeout)
        else:
            await kv.recv_request(
                spec.key, ids, frm=frm, timeout=self.settings.timeout, layerwise=spec.layerwise
            )

    async def _load_past_local_hit(self, spec: LoadSpec, frm: str) -> None:
        """The first ``skip`` remote blocks are in this cache already: the request is
        received whole into a scratch cache and only the rest is copied in."""
        from ..kv import KVConnector

        assert self.kv is not None and self.layout is not None and self.engine is not None
        lay = dataclasses.replace(self.layout, num_blocks=spec.n_remote)  # type: ignore[type-var]
        scratch = lay.allocate(self.kv.device)
        tmp = KVConnector(self.engine, lay, scratch, chunk_bytes=self.settings.chunk_bytes)
        try:
            await self._move(tmp, spec, range(spec.n_remote), frm)
        finally:
            await tmp.aclose()
        self._copy_past_hit(scratch, spec, 0)

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        loop = self.loop
        if loop is not None and finished_req_ids:
            # a load whose request ended (aborted) stops; its blocks are reported
            # once nothing writes them any more
            loop.soon(functools.partial(self._cancel, set(finished_req_ids), loads_only=True))
        with self._lock:
            self._finished |= finished_req_ids & (self._sending | self._sent)
            done = self._sent & self._finished
            self._sent -= done
            self._finished -= done
            out.finished_sending = done
            out.finished_recving, self._loaded = self._loaded, set()
            out.failed_recving, self._failed = self._failed, set()
        return out

    def _cancel(self, ids: set[str], loads_only: bool = False) -> None:
        for rid in ids:
            task = self._tasks.get(rid)
            if task is None or (loads_only and rid in self._sending):
                continue
            b = self._batches.get(rid)
            if b is not None:
                # a step batch stops only once all its requests ended: the others
                # still move (an ended one's blocks are reported when it is done)
                b.ended.add(rid)
                if not b.members <= b.ended:
                    continue
            task.cancel()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        loop, self.loop = self.loop, None
        if loop is None:
            return

        async def down() -> None:
            if self.kv is not None:
                await self.kv.aclose()
            if self.engine is not None:
                await self.engine.aclose()

        try:
            loop.call(down(), 10.0)
        except AiokvError:
            pass
        loop.stop()
