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

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ._settings import parse_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


from ._meta import AiokvHandshake, AiokvMetadata
from ._scheduler import _SchedulerSide
from ._worker import _WorkerSide

__all__ = ["AiokvConnector", "AiokvHandshake", "AiokvMetadata"]

log = logging.getLogger("aiokv.vllm")


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
