"""AiokvConnector: vLLM's KV connector API (``KVConnectorBase_V1``) on aiokv.

Load it by name (docs/vllm.md)::

    kv_transfer_config={"kv_connector": "AiokvConnector",
                        "kv_connector_module_path": "aiokv.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}

Scheduler side (vLLM's engine core): a prefill request that asks for remote decode
(``kv_transfer_params={"do_remote_decode": true}``) keeps its blocks when it finishes
and answers with the parameters the decode needs (:mod:`aiokv.vllm._protocol`); a
decode request carrying them waits for its KV (``WAITING_FOR_REMOTE_KVS``) instead of
computing the prompt, and recomputes it when the parameters are not usable or the
load fails (with ``kv_load_failure_policy="recompute"``; vLLM's default, "fail",
ends the request with an error instead).

Worker side: each worker runs an aiokv :class:`~aiokv.Engine` and a
:class:`~aiokv.kv.KVConnector` over vLLM's paged caches on an event loop of its
own thread; the synchronous calls only hand work to that loop, once per step
whatever the number of requests (once per layer for ``save_kv_layer``). A prefill
worker pushes the prompt's blocks layer by layer during the forward that completes
the prompt (``save_kv_layer``: each layer leaves as soon as vLLM wrote it), or, in
pull mode, serves them whole once the forward is done (``wait_for_save``: the
decode is not known before the prefill answers); with ``layerwise`` off it pushes
them whole after the forward, the step's requests for one decode as one step batch
(``KVConnector.send_requests``; the decode takes it with one ``recv_requests``). A
decode worker loads a request between scheduler steps, and
:meth:`AiokvConnector.get_transfer_results` reports what finished. Nothing waits
inside vLLM's forward: the decode is scheduled only once its KV is in place, so
``wait_for_layer_load`` has nothing to wait for.
"""

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
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .._exceptions import AiokvError, ConfigError
from ._layout import describe_caches
from ._loop import LoopThread
from ._protocol import (
    MAX_BATCH,
    PARAMS_VERSION,
    DeclineSpec,
    LoadSpec,
    RemoteKV,
    SendSpec,
    batch_wire_id,
    decline_name,
    decode_address_of,
    parse_remote,
    transfer_key,
    with_port_offset,
)
from ._settings import Settings, parse_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from aiokv.engine import Engine

    from ..kv import KVConnector, KVLayout

__all__ = ["AiokvConnector", "AiokvHandshake", "AiokvMetadata"]

log = logging.getLogger("aiokv.vllm")

#: request statuses after which a prefill's KV is complete and worth handing on
_DONE = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
#: declines a decode worker has in flight at once (beyond: the prefill's lease frees)
_MAX_DECLINES = 256
#: how long a decline waits for the prefill's engine
_DECLINE_TIMEOUT = 5.0
#: how long a decode waits for the rest of a step batch once one of its requests came
_BATCH_GRACE = 2.0
#: step batches a decode remembers having received
_BATCHES_REMEMBERED = 4096


@dataclasses.dataclass
class AiokvHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler: where its aiokv engine is reached."""

    address: str
    layout: dict[str, Any]


@dataclasses.dataclass
class AiokvMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step: transfers to start."""

    send: list[SendSpec] = dataclasses.field(default_factory=list)
    load: list[LoadSpec] = dataclasses.field(default_factory=list)
    #: prefill requests that ended otherwise than finished (aborted): stop handing on
    cancel: list[str] = dataclasses.field(default_factory=list)
    #: decode requests that will not load what their pull prefill holds: release it
    decline: list[DeclineSpec] = dataclasses.field(default_factory=list)


class AiokvConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM KV connector over aiokv (see the module docstring and docs/vllm.md)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.settings, warnings = parse_settings(cfg.kv_connector_extra_config)
        for w in warnings:
            log.warning("AiokvConnector: %s", w)
        self._block_size: int = vllm_config.cache_config.block_size
        self._tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self._engine_id: str = str(cfg.engine_id)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self, vllm_config)

    # ------------------------------------------------------------------ scheduler side

    def _s(self) -> _SchedulerSide:
        if self._sched is None:
            raise RuntimeError("AiokvConnector: a scheduler-side call on a worker")
        return self._sched

    def _w(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("AiokvConnector: a worker-side call on the scheduler")
        return self._worker

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().matched(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s().after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        self._s().new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._s().handshake(metadata)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w().handshake_metadata()

    def _meta(self) -> AiokvMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, AiokvMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self._w().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before their request is scheduled

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # vLLM wrote this layer's KV: the layer-wise pushes of the step start sending it
        meta = self._meta()
        if meta is not None and meta.send:
            self._w().save_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        # the step's forward has written the KV of the prompts it completed: hand them on
        # (asynchronously; the blocks stay allocated until get_transfer_results says so)
        meta = self._meta()
        if meta is not None:
            self._w().start_sends(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self._w().results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._w().results(finished_req_ids)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ for tests

    def statistics(self) -> dict[str, Any]:
        """Counters of this worker (loads, sends, failures, bytes)."""
        return self._w().stats()


# ============================================================================ scheduler


class _SchedulerSide:
    def __init__(self, c: AiokvConnector) -> None:
        self.c = c
        self.addresses: list[str] | None = None
        self._computed: dict[str, int] = {}
        self._producing: dict[str, Request] = {}  # prefill requests whose prompt is not done
        self._handed: dict[str, SendSpec] = {}  # prefill requests being handed on
        self._tokens: dict[str, int] = {}
        self._send: list[SendSpec] = []
        self._load: list[LoadSpec] = []
        self._cancel: list[str] = []
        self._decline: list[DeclineSpec] = []
        self._warned_push = False

    def handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        addrs = []
        for rank in sorted(metadata):
            m = metadata[rank]
            if not isinstance(m, AiokvHandshake):
                raise ConfigError(f"AiokvConnector: worker {rank} sent {type(m).__name__}")
            addrs.append(m.address)
        self.addresses = addrs
        log.info("AiokvConnector: workers' aiokv engines at %s", addrs)

    # ------------------------------------------------------------ decode side

    def _remote(self, request: Request) -> tuple[Any, str | None]:
        prompt = request.prompt_token_ids
        return parse_remote(
            request.kv_transfer_params,
            prompt_len=len(prompt) if prompt is not None else 0,
            block_size=self.c._block_size,
            tp_size=self.c._tp_size,
        )

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote, why = self._remote(request)
        if remote is None:
            if why is not None:
                log.warning(
                    "AiokvConnector: request %s recomputes its prompt: %s", request.request_id, why
                )
                request.kv_transfer_params["do_remote_prefill"] = False
            return 0, False
        count = remote.num_tokens - num_computed_tokens
        if count <= 0 or num_computed_tokens % self.c._block_size:
            return 0, False
        self._computed[request.request_id] = num_computed_tokens
        return count, True

    def _release(self, request: Request, remote: RemoteKV) -> None:
        """``request`` does not load what its prefill holds: a pull prefill keeps it
        until a decode takes it or its lease ends, so tell it now. (A push prefill
        let go once its decode's engine held the request.)"""
        if remote.mode == "pull":
            prompt = request.prompt_token_ids or []
            self._decline.append(
                DeclineSpec(
                    request.request_id,
                    transfer_key(remote.request_id, prompt[: remote.num_tokens]),
                    list(remote.addresses),
                )
            )

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        params = request.kv_transfer_params
        computed = self._computed.pop(request.request_id, None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        remote, _ = self._remote(request)
        params["do_remote_prefill"] = False  # one load per request, also after preemption
        if remote is None:
            return
        if num_external <= 0 or computed is None:
            # this cache holds every remote token already, or vLLM computes the prompt
            self._release(request, remote)
            return
        ids = blocks.get_block_ids()[0]
        skip = computed // self.c._block_size
        n = len(remote.block_ids)
        if len(ids) < n:
            raise RuntimeError(
                f"AiokvConnector: {request.request_id} got {len(ids)} blocks for {n} remote ones"
            )
        prompt = request.prompt_token_ids or []
        self._load.append(
            LoadSpec(
                req_id=request.request_id,
                key=transfer_key(remote.request_id, prompt[: remote.num_tokens]),
                addresses=list(remote.addresses),
                mode=remote.mode,
                n_remote=n,
                skip=skip,
                block_ids=list(ids[skip:n]),
                layerwise=remote.layerwise,
                batch=list(remote.batch) if remote.batch is not None else None,
                batch_index=remote.batch_index,
            )
        )

    # ------------------------------------------------------------ prefill side

    def new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if (
            isinstance(params, dict)
            and params.get("do_remote_decode")
            and request.prompt_token_ids is not None
        ):
            self._producing[request.request_id] = request

    def _hand_on(self, request: Request) -> SendSpec | None:
        """The request's prompt is computed once this step ran: what to hand on."""
        if self.addresses is None:
            log.warning(
                "AiokvConnector: no worker engine address yet; %s is not handed on",
                request.request_id,
            )
            return None
        mgr = self.c._kv_cache_manager
        prompt = request.prompt_token_ids
        if mgr is None or prompt is None:
            return None
        n_tokens = len(prompt)
        blocks = list(
            mgr.get_block_ids(request.request_id)[0][: -(-n_tokens // self.c._block_size)]
        )
        mode = self.c.settings.mode
        params = request.kv_transfer_params
        push_to = None if mode == "pull" else decode_address_of(request.request_id, params)
        if mode == "push" and push_to is None and not self._warned_push:
            self._warned_push = True
            log.warning(
                "AiokvConnector: mode push, but %s names no decode (kv_transfer_params "
                "'aiokv_decode' or ___decode_addr_ in the request id): it is pulled instead",
                request.request_id,
            )
        self._tokens[request.request_id] = n_tokens
        return SendSpec(
            request.request_id,
            transfer_key(request.request_id, prompt),
            blocks,
            push_to,
            layerwise=push_to is not None and self.c.settings.layerwise,
        )

    def build_meta(self, so: SchedulerOutput) -> AiokvMetadata:
        if self._producing:
            for rid, n in so.num_scheduled_tokens.items():
                req = self._producing.get(rid)
                if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                    continue
                del self._producing[rid]
                spec = self._hand_on(req)
                if spec is not None:
                    self._handed[rid] = spec
                    self._send.append(spec)
            _batch_whole_pushes(self._send)
        meta = AiokvMetadata(
            send=self._send, load=self._load, cancel=self._cancel, decline=self._decline
        )
        self._send, self._load, self._cancel, self._decline = [], [], [], []
        return meta

    def finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._computed.pop(rid, None)
        self._producing.pop(rid, None)
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            # a decode request that ended before its blocks were allocated (aborted
            # while waiting): it never loads
            remote, _ = self._remote(request)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._release(request, remote)
        spec = self._handed.pop(rid, None)
        n_tokens = self._tokens.pop(rid, 0)
        if spec is None:
            return False, None
        # the worker may be reading the blocks: they stay until it reports the request
        if request.status.name not in _DONE:
            self._cancel.append(rid)
            return True, None
        assert self.addresses is not None
        host, _, port = self.addresses[0].rpartition(":")
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.c._engine_id,
            "remote_request_id": rid,
            "remote_block_ids": spec.block_ids,
            "remote_host": host,
            "remote_port": int(port),
            "remote_num_tokens": n_tokens,
            "tp_size": self.c._tp_size,
            "aiokv": PARAMS_VERSION,
            "aiokv_mode": "pull" if spec.push_to is None else "push",
            "aiokv_addresses": list(self.addresses),
            "aiokv_layerwise": spec.layerwise,
            **(
                {"aiokv_batch": list(spec.batch), "aiokv_batch_index": spec.batch_index}
                if spec.batch is not None
                else {}
            ),
        }


def _batch_whole_pushes(sends: list[SendSpec]) -> None:
    """The step's whole pushes to one decode travel as one step batch (two or more)."""
    groups: dict[str, list[SendSpec]] = {}
    for s in sends:
        if s.push_to is not None and not s.layerwise:
            groups.setdefault(s.push_to, []).append(s)
    for group in groups.values():
        for part in range(0, len(group), MAX_BATCH):
            members = group[part : part + MAX_BATCH]
            if len(members) < 2:
                continue
            wire = [batch_wire_id(s.key) for s in members]
            for i, s in enumerate(members):
                s.batch, s.batch_index = wire, i


# ============================================================================ worker


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
        """(loop thread) The step's loads (a push step batch joins its batch; every
        other load runs as a task known by its request id at once, so that an abort
        that follows finds it), aborts and declines."""
        for spec in loads:
            if spec.batch is not None and spec.mode == "push":
                self._join_batch(spec)
            else:
                self._start_load(spec)
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
