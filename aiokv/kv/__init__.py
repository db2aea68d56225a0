"""Paged KV caches: layouts (FlashAttention, FlashInfer, MLA, vLLM's CPU attention) and
the gather/scatter core.

See :mod:`aiokv.kv.layouts` for the layouts and their wire form, and
:mod:`aiokv.kv.ops` for the staging packing order and the implementations.
"""

from __future__ import annotations

from ._triton import set_enabled as set_triton
from .connector import ConnectorStatistics, KVConnector
from .ipc.options import IpcOptions, IpcStatistics
from .layouts import (
    DTYPES,
    CPUAttentionLayout,
    FlashAttentionLayout,
    FlashInferLayout,
    KVLayout,
    MLALayout,
    check_compatible,
    engine_layout_check,
    layout_from_wire,
)
from .ops import (
    BoundCaches,
    Impl,
    LayerChunker,
    Lease,
    PoolStatistics,
    StagingPool,
    StagingSlice,
    gather_blocks,
    scatter_blocks,
)

__all__ = [
    "DTYPES",
    "BoundCaches",
    "CPUAttentionLayout",
    "ConnectorStatistics",
    "FlashAttentionLayout",
    "FlashInferLayout",
    "Impl",
    "IpcOptions",
    "IpcStatistics",
    "KVConnector",
    "KVLayout",
    "LayerChunker",
    "Lease",
    "MLALayout",
    "PoolStatistics",
    "StagingPool",
    "StagingSlice",
    "check_compatible",
    "engine_layout_check",
    "gather_blocks",
    "layout_from_wire",
    "scatter_blocks",
    "set_triton",
]
