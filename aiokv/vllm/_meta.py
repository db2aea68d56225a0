"""What vLLM's scheduler and workers exchange through the connector API: the
worker's handshake (where its aiokv engine is reached) and the per-step metadata."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from ._protocol import (
    DeclineSpec,
    LoadSpec,
    SendSpec,
)

if TYPE_CHECKING:
    pass

__all__ = ["AiokvHandshake", "AiokvMetadata"]


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
