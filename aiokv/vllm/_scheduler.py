"""The scheduler side of :class:`~aiokv.vllm.AiokvConnector` (vLLM's engine core):
which requests load remote KV, which prefills keep their blocks and hand them on, and
the per-step metadata for the workers (docs/vllm.md)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
)

from .._exceptions import ConfigError
from ._protocol import (
    MAX_BATCH,
    PARAMS_VERSION,
    DeclineSpec,
    LoadSpec,
    RemoteKV,
    SendSpec,
    batch_wire_id,
    decode_address_of,
    parse_remote,
    transfer_key,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


from ._meta import AiokvHandshake, AiokvMetadata

if TYPE_CHECKING:
    from .connector import AiokvConnector

log = logging.getLogger("aiokv.vllm")

#: request statuses after which a prefill's KV is complete and worth handing on
_DONE = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


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
