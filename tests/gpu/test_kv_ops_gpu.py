"""gather/scatter on CUDA: the fused Triton path and the torch paths agree bit for bit."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

with warnings.catch_warnings():  # CPU torch without numpy warns at import (filterwarnings=error)
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv.kv import (
    BoundCaches,
    FlashAttentionLayout,
    FlashInferLayout,
    KVLayout,
    MLALayout,
    gather_blocks,
    scatter_blocks,
)
from aiokv.kv import _triton as kv_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

needs_triton = pytest.mark.skipif(not kv_triton.available(), reason="triton is not importable")

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8"]
DEV = "cuda:0"


def make_layout(kind: str, dtype: str, num_blocks: int, num_layers: int = 5) -> KVLayout:
    if kind == "fa":
        return FlashAttentionLayout(num_layers, num_blocks, 16, 4, 64, dtype)
    if kind == "fi":
        return FlashInferLayout(num_layers, num_blocks, 16, 4, 64, dtype)
    return MLALayout(num_layers, num_blocks, 16, 576, dtype)


def random_caches(lay: KVLayout, stacked: bool, seed: int) -> list[torch.Tensor]:
    caches = lay.allocate(DEV, stacked=stacked)
    g = torch.Generator(device=DEV).manual_seed(seed)
    for t in caches:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=DEV, generator=g))
    return caches


def blocks(cache: torch.Tensor, lay: KVLayout, ids: list[int]) -> torch.Tensor:
    return cache.view(torch.uint8).index_select(
        lay.block_dim, torch.tensor(ids, device=cache.device)
    )


def perm(n: int, count: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(n, generator=g)[:count]]


@needs_triton
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
def test_triton_equals_torch_bit_exact(kind: str, dtype: str, stacked: bool) -> None:
    prod = make_layout(kind, dtype, 97)
    cons = make_layout(kind, dtype, 61)
    p = random_caches(prod, stacked, 1)
    src, dst = perm(prod.num_blocks, 23, 2), perm(cons.num_blocks, 23, 3)
    ref = gather_blocks(p, prod, src, impl="per_layer")
    cpu_ref = torch.cat(
        [blocks(t, prod, src).reshape(-1) for t in p]
    )  # packing order = index_select, layer-major
    assert torch.equal(ref, cpu_ref)
    impls: list[Any] = ["triton", "torch", "auto"]
    for impl in impls:
        got = gather_blocks(p, prod, src, impl=impl)
        assert torch.equal(got, ref), impl
    base = random_caches(cons, not stacked, 4)
    results = {}
    for impl in ["per_layer", *impls]:
        c = cons.allocate(DEV, stacked=not stacked)
        for x, y in zip(c, base, strict=True):
            x.copy_(y)
        scatter_blocks(ref, c, cons, dst, impl=impl)
        results[impl] = c
    others = [i for i in range(cons.num_blocks) if i not in dst]
    for impl, c in results.items():
        for li in range(cons.num_layers):
            assert torch.equal(c[li].view(torch.uint8), results["per_layer"][li].view(torch.uint8))
            assert torch.equal(blocks(c[li], cons, dst), blocks(p[li], prod, src)), impl
            assert torch.equal(blocks(c[li], cons, others), blocks(base[li], cons, others))


@needs_triton
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
def test_triton_layer_subsets_device_ids_and_pool_slices(kind: str) -> None:
    lay = make_layout(kind, "float8_e4m3fn", 50, num_layers=7)
    p = random_caches(lay, False, 5)
    bound = BoundCaches(lay, p)
    src = torch.tensor(perm(50, 9, 6), device=DEV)  # device ids: trusted, no sync
    dst = perm(50, 9, 7)
    pool = torch.zeros(lay.request_nbytes(9) + 4096, dtype=torch.uint8, device=DEV)
    sub = range(1, 7, 2)
    for layers in (range(7), sub, range(3, 4)):
        off = 256  # staging is a slice of a bigger buffer
        nb = len(layers) * 9 * lay.block_nbytes()
        a = gather_blocks(bound, lay, src, out=pool[off : off + nb], layers=layers, impl="triton")
        b = gather_blocks(bound, lay, src, layers=layers, impl="per_layer")
        assert a.data_ptr() == pool.data_ptr() + off and torch.equal(a, b)
        c1 = lay.allocate(DEV, zero=True)
        c2 = lay.allocate(DEV, zero=True)
        scatter_blocks(a, c1, lay, dst, layers=layers, impl="triton")
        scatter_blocks(b, c2, lay, dst, layers=layers, impl="per_layer")
        for x, y in zip(c1, c2, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@needs_triton
@pytest.mark.timeout(120)
def test_triton_on_side_stream_and_odd_alignment() -> None:
    lay = MLALayout(3, 40, 5, 7, "float16")  # 70-byte segments: 2-byte words
    p = random_caches(lay, False, 8)
    src, dst = perm(40, 6, 9), perm(40, 6, 10)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        a = gather_blocks(p, lay, src, impl="triton")
        c = lay.allocate(DEV, zero=True)
        scatter_blocks(a, c, lay, dst, impl="triton")
    s.synchronize()
    for li in range(3):
        assert torch.equal(blocks(c[li], lay, dst), blocks(p[li], lay, src))


def _time(fn: Callable[[], None], iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


@needs_triton
@pytest.mark.timeout(300)
def test_timing_triton_vs_torch(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3-8B geometry, one 256-token and one 4096-token request: gather + scatter."""
    for tokens in (256, 4096):
        n = tokens // 16
        lay = FlashAttentionLayout(32, 4 * n, 16, 8, 128, "bfloat16")
        p = BoundCaches(lay, lay.allocate(DEV, stacked=True, zero=True))
        c = BoundCaches(lay, lay.allocate(DEV, stacked=True, zero=True))
        src = torch.tensor(perm(4 * n, n, 11), device=DEV)
        dst = torch.tensor(perm(4 * n, n, 12), device=DEV)
        stage = torch.empty(lay.request_nbytes(n), dtype=torch.uint8, device=DEV)
        rates = {}
        for impl in ("triton", "stacked", "per_layer"):

            def step(
                impl: Any = impl,
                args: tuple[Any, ...] = (p, c, lay, src, dst, stage),
            ) -> None:
                p_, c_, lay_, src_, dst_, stage_ = args
                gather_blocks(p_, lay_, src_, out=stage_, impl=impl)
                scatter_blocks(stage_, c_, lay_, dst_, impl=impl)

            dt = _time(step)
            rates[impl] = (lay.request_nbytes(n) / dt / 1e9, dt * 1e6)
        with capsys.disabled():
            print(
                f"\n[kv_ops gpu] {tokens} tokens ({lay.request_nbytes(n) >> 20} MiB) gather+scatter: "
                + ", ".join(f"{k} {r:.1f} GB/s ({us:.0f} us)" for k, (r, us) in rates.items())
            )
        assert all(r > 0 for r, _ in rates.values())
