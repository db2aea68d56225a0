"""vLLM's paged KV caches -> an aiokv :class:`~aiokv.kv.KVLayout`.

vLLM hands a connector one tensor per attention layer (``register_kv_caches``) in
the layout its attention backend chose (``cache_config.kv_cache_layout``, a
stride permutation of the logical ``[L (K/V), B (block), H (head), N (token),
C (channel)]``). aiokv moves whole blocks, so it must know where a block lies in
each tensor and that both sides order the bytes inside a block alike; a layout
kind says both. Known here:

=================  =============  ==========================================  ==================
backend            vLLM layout    per-layer tensor                            aiokv layout
=================  =============  ==========================================  ==================
CPU attention      LBHNC          ``[B, H, N, 2*C]`` (K rows, then V rows)     CPUAttentionLayout
FlashAttention     LBNHC          ``[2, B, N, H, C]``                          FlashAttentionLayout
FlashInfer (NHD)   BLNHC          ``[B, 2, N, H, C]``                          FlashInferLayout
MLA backends       (any)          ``[B, N, latent]``                           MLALayout
=================  =============  ==========================================  ==================

Anything else raises :class:`~aiokv.ConfigError` naming the layout, the shape and
what is known: a layout aiokv does not know is refused, never guessed.

Pure torch (no vLLM import).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._exceptions import ConfigError
from ..kv.layouts import (
    DTYPES,
    CPUAttentionLayout,
    FlashAttentionLayout,
    FlashInferLayout,
    KVLayout,
    MLALayout,
)

__all__ = ["KNOWN", "describe_caches"]

#: the (device kind, vLLM layout) pairs aiokv maps, for error messages
KNOWN = (
    "cpu/LBHNC (CPU attention)",
    "cuda/LBNHC (FlashAttention)",
    "cuda/BLNHC (FlashInfer, NHD)",
    "MLA [blocks, block_size, latent]",
)

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def describe_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    layout_name: str | None,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    use_mla: bool = False,
) -> tuple[KVLayout, list[torch.Tensor], list[str]]:
    """The aiokv layout of vLLM's caches, the per-layer tensors and the layer names
    (in vLLM's order, the same on every worker of one model)."""
    if not kv_caches:
        raise ConfigError("AiokvConnector: vLLM registered no KV caches")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    shape = tuple(first.shape)
    for n, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"AiokvConnector: the cache of {n!r} is not a tensor")
        if tuple(t.shape) != shape or t.dtype != first.dtype or t.device != first.device:
            raise ConfigError(
                f"AiokvConnector: layer {n!r} has a cache of shape {tuple(t.shape)} "
                f"{t.dtype} on {t.device}, {names[0]!r} one of {shape} {first.dtype} on "
                f"{first.device}: layers of different geometry (a hybrid model) are not "
                "supported"
            )
    dtype = _DTYPE_NAMES.get(first.dtype)
    if dtype is None:
        raise ConfigError(f"AiokvConnector: KV cache dtype {first.dtype} is not supported")
    device = first.device.type
    L = len(tensors)
    where = (
        f"vLLM KV cache layout {layout_name!r} on {device}, per-layer shape {shape} "
        f"(block_size {block_size}, {num_kv_heads} KV heads, head size {head_dim})"
    )
    layout: KVLayout | None = None
    if use_mla:
        if len(shape) == 3 and shape[1] == block_size:
            layout = MLALayout(L, shape[0], block_size, shape[2], dtype)
    elif device == "cpu" and layout_name == "LBHNC":
        if len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
            layout = CPUAttentionLayout(L, shape[0], block_size, num_kv_heads, head_dim, dtype)
    elif device == "cuda" and layout_name == "LBNHC":
        if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
            layout = FlashAttentionLayout(L, shape[1], block_size, num_kv_heads, head_dim, dtype)
    elif device == "cuda" and layout_name == "BLNHC":
        if len(shape) == 5 and shape[1] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
            layout = FlashInferLayout(L, shape[0], block_size, num_kv_heads, head_dim, dtype)
    else:
        raise ConfigError(f"AiokvConnector does not know the {where}; known: {', '.join(KNOWN)}")
    if layout is None:
        raise ConfigError(
            f"AiokvConnector: the {where} does not match that layout's shape; "
            f"known: {', '.join(KNOWN)}"
        )
    for n, t in zip(names, tensors):
        if not t.is_contiguous():
            raise ConfigError(
                f"AiokvConnector: the cache of {n!r} is not contiguous (strides "
                f"{t.stride()}); the {where} is not one aiokv can move block by block"
            )
    return layout, tensors, names
