"""Small KV-layout helpers shared by the CPU tests of the KV connector and the IPC plane."""

from __future__ import annotations

import torch

from aiokv.kv import FlashAttentionLayout, FlashInferLayout, KVLayout, MLALayout


def make_layout(kind: str, dtype: str, num_blocks: int, num_layers: int = 3) -> KVLayout:
    if kind == "fa":
        return FlashAttentionLayout(num_layers, num_blocks, 4, 2, 8, dtype)
    if kind == "fi":
        return FlashInferLayout(num_layers, num_blocks, 4, 2, 8, dtype)
    return MLALayout(num_layers, num_blocks, 4, 24, dtype)


def filled(layout: KVLayout, seed: int, *, stacked: bool = False) -> list[torch.Tensor]:
    caches = layout.allocate(stacked=stacked)
    g = torch.Generator().manual_seed(seed)
    for t in caches:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return caches


def rand_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(num_blocks, generator=g)[:n]]


def blocks(cache: torch.Tensor, layout: KVLayout, ids: list[int]) -> torch.Tensor:
    return cache.view(torch.uint8).index_select(layout.block_dim, torch.tensor(ids))
