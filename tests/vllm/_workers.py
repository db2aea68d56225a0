"""AiokvConnector's worker side driven directly, without vLLM engines: real CPU caches
in vLLM's CPU attention layout, a prefill worker and a decode worker in this process,
each with its aiokv engine on its own loop thread, handed the metadata the scheduler
side would build for one step. Used by ``test_workers.py`` and ``bench_step.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from aiokv.vllm import AiokvMetadata
from aiokv.vllm._protocol import LoadSpec, SendSpec
from aiokv.vllm._settings import parse_settings
from aiokv.vllm._worker import _WorkerSide

BS = 32


def make_worker(
    *, layers: int, blocks: int, heads: int = 4, head_dim: int = 64, **extra: Any
) -> _WorkerSide:
    """A registered worker side over fresh random caches (``extra``: settings)."""
    settings, _ = parse_settings(extra)
    conn = SimpleNamespace(settings=settings, _block_size=BS)
    model = SimpleNamespace(
        get_num_kv_heads=lambda _pc: heads, get_head_size=lambda: head_dim, use_mla=False
    )
    cfg = SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(kv_cache_layout="LBHNC"),
        parallel_config=None,
    )
    w = _WorkerSide(conn, cfg)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(blocks * 131 + layers)
    w.register(
        {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                blocks, heads, BS, 2 * head_dim, generator=g
            )
            for i in range(layers)
        }
    )
    return w


def batch_sends(sends: list[SendSpec]) -> None:
    """What the scheduler side does to a step's sends: whole pushes to one decode
    become one step batch."""
    from aiokv.vllm._scheduler import _batch_whole_pushes

    _batch_whole_pushes(sends)


def load_of(s: SendSpec, frm: str, block_ids: Sequence[int]) -> LoadSpec:
    """The decode's load of ``s`` (as its scheduler side builds it from the answer)."""
    mode = "push" if s.push_to is not None else "pull"
    spec = LoadSpec(s.req_id, s.key, [frm], mode, len(s.block_ids), 0, list(block_ids))
    spec.layerwise = s.layerwise
    batch = getattr(s, "batch", None)
    if batch is not None:
        spec.batch, spec.batch_index = list(batch), s.batch_index
    return spec


def drain(w: _WorkerSide, ids: set[str], *, sending: bool, timeout: float = 60.0) -> set[str]:
    """Poll the worker's results as vLLM does each step until every one of ``ids`` is
    reported; returns those whose load failed."""
    left, failed = set(ids), set()
    end = time.monotonic() + timeout
    finished = set(ids) if sending else set()  # vLLM names a finished request once
    while left:
        if time.monotonic() > end:
            raise TimeoutError(f"not reported within {timeout} s: {sorted(left)[:4]}")
        r = w.results(finished)
        finished = set()
        got = (r.finished_sending if sending else r.finished_recving) or set()
        failed |= r.failed_recving or set()
        left -= got
        if left:
            time.sleep(0.002)
    return failed


def step_sends(w: _WorkerSide, sends: list[SendSpec]) -> None:
    w.start_sends(AiokvMetadata(send=sends))


def step_loads(w: _WorkerSide, loads: list[LoadSpec]) -> None:
    w.start_loads(AiokvMetadata(load=loads))
