"""Optional Triton kernel: gather/scatter KV blocks of ALL layers in ONE launch.

Used only when ``triton`` imports and the tensors are on CUDA. The kernel moves
raw machine words (int64/int32/int16/int8, chosen by the caller from the
alignment), so every dtype -- fp8 included -- round-trips bit-exactly.

Work decomposition: a *unit* is one contiguous segment of one block of one
layer (FlashAttention has two per block: K and V). Units are numbered in
staging order ``(layer, part, block)``, so unit ``u`` lives at staging word
offset ``u * seg_words``. Each program copies ``BLOCK`` words of one unit; the
grid is flattened into axis 0 (``units * chunks_per_unit`` programs).

Unit ``u = (li, p, j)`` lives in the cache of the ``li``-th selected layer, whose
base address is ``table[li]`` (int64 data_ptr), at word offset
``p * part_stride + ids[j] * block_stride``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["apply_env", "available", "launch_copy", "set_enabled"]

_BLOCK_BYTES = 8192  # bytes per program
_MAX_PROGRAMS = 2**31 - 1


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def kv_copy_kernel(  # type: ignore[no-untyped-def]
        table_ptr,
        ids_ptr,
        stage_ptr,
        n_blocks,
        parts,
        seg_words,
        part_stride,
        block_stride,
        chunks,
        SCATTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        unit = pid // chunks
        chunk = pid - unit * chunks
        j = unit % n_blocks
        t = unit // n_blocks
        p = t % parts
        li = t // parts
        bid = tl.load(ids_ptr + j).to(tl.int64)
        base = tl.load(table_ptr + li).to(tl.pointer_type(stage_ptr.dtype.element_ty))
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < seg_words
        cache_ptrs = base + (p * part_stride + bid * block_stride) + offs
        stage_ptrs = stage_ptr + unit * seg_words + offs
        if SCATTER:
            v = tl.load(stage_ptrs, mask=mask)
            tl.store(cache_ptrs, v, mask=mask)
        else:
            v = tl.load(cache_ptrs, mask=mask)
            tl.store(stage_ptrs, v, mask=mask)

    return kv_copy_kernel


_enabled = True


def set_enabled(enabled: bool) -> None:
    """Use the Triton kernels when they import (True, the default) or never (False).

    Process-wide (public as :func:`aiokv.kv.set_triton`); the command-line entry points
    call it for ``AIOKV_DISABLE_TRITON=1``. Without Triton the copies are torch ops.
    """
    global _enabled
    _enabled = bool(enabled)


def apply_env(environ: Mapping[str, str] | None = None) -> None:
    """Turn the kernels off when ``AIOKV_DISABLE_TRITON`` is set (for entry points)."""
    from aiokv import envs

    if envs.flag("AIOKV_DISABLE_TRITON", environ):
        set_enabled(False)


def available() -> bool:
    """True when Triton imports and :func:`set_enabled` did not turn it off."""
    return _enabled and _importable()


@functools.lru_cache(maxsize=1)
def _importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def launch_copy(
    table: torch.Tensor,
    ids: torch.Tensor,
    stage: torch.Tensor,
    *,
    n_layers: int,
    parts: int,
    seg_words: int,
    part_stride: int,
    block_stride: int,
    scatter: bool,
) -> bool:
    """Launch the fused kernel on the current stream. Returns False if the grid is too big.

    ``stage`` is a 1-D word-typed tensor (the word type decides the kernel's
    element type); ``table`` holds ``n_layers`` int64 base addresses, aligned to
    the word size; ``ids`` is int64 on the same device. Strides are in words.
    """
    n_blocks = ids.numel()
    word = stage.element_size()
    block = max(1, _BLOCK_BYTES // word)
    # no wider than the segment, and a power of two
    block = min(block, 1 << max(0, (seg_words - 1).bit_length()))
    chunks = -(-seg_words // block)
    programs = n_layers * parts * n_blocks * chunks
    if programs == 0:
        return True
    if programs > _MAX_PROGRAMS:
        return False
    num_warps = 4 if block * word >= 4096 else 1
    _kernel()[(programs,)](
        table,
        ids,
        stage,
        n_blocks,
        parts,
        seg_words,
        part_stride,
        block_stride,
        chunks,
        SCATTER=scatter,
        BLOCK=block,
        num_warps=num_warps,
    )
    return True
