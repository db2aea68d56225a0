"""KV layouts and the gather/scatter core on CPU (the GPU twin is tests/gpu/test_kv_ops_gpu.py)."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():  # this CPU torch build warns at import when numpy is absent
    warnings.simplefilter("ignore", UserWarning)
    import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv._exceptions import AiokvTimeoutError, ConfigError, LayoutMismatchError
from aiokv.kv import (
    DTYPES,
    BoundCaches,
    FlashAttentionLayout,
    FlashInferLayout,
    KVLayout,
    LayerChunker,
    MLALayout,
    StagingPool,
    check_compatible,
    gather_blocks,
    layout_from_wire,
    scatter_blocks,
)

pytestmark = pytest.mark.timeout(60)

DTYPE_NAMES = ["bfloat16", "float16", "float8_e4m3fn", "float32"]
IMPLS = ["auto", "torch", "per_layer"]


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def make_layout(kind: str, dtype: str, num_blocks: int = 37, num_layers: int = 3) -> KVLayout:
    if kind == "fa":
        return FlashAttentionLayout(num_layers, num_blocks, 4, 2, 8, dtype)
    if kind == "fi":
        return FlashInferLayout(num_layers, num_blocks, 4, 2, 8, dtype)
    return MLALayout(num_layers, num_blocks, 4, 24, dtype)


def randomize(caches: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in caches:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def block_bytes(cache: torch.Tensor, layout: KVLayout, ids: list[int]) -> torch.Tensor:
    return cache.view(torch.uint8).index_select(layout.block_dim, torch.tensor(ids))


def rand_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(num_blocks, generator=g)[:n]]


# --------------------------------------------------------------------------- round trips


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
def test_round_trip_bit_exact(kind: str, dtype: str, impl: str, stacked: bool) -> None:
    prod = make_layout(kind, dtype, num_blocks=41)
    cons = make_layout(kind, dtype, num_blocks=29)  # num_blocks may differ
    check_compatible(prod, cons)
    p = prod.allocate(stacked=stacked)
    c = cons.allocate(stacked=not stacked)
    randomize(p, 1)
    randomize(c, 2)
    before = [t.clone() for t in c]
    src = rand_ids(11, prod.num_blocks, 3)
    dst = rand_ids(11, cons.num_blocks, 4)
    staging = gather_blocks(p, prod, src, impl=impl)  # type: ignore[arg-type]
    assert staging.dtype == torch.uint8 and staging.numel() == prod.request_nbytes(11)
    scatter_blocks(staging, c, cons, dst, impl=impl)  # type: ignore[arg-type]
    others = [i for i in range(cons.num_blocks) if i not in dst]
    for li in range(prod.num_layers):
        assert torch.equal(block_bytes(p[li], prod, src), block_bytes(c[li], cons, dst))
        assert torch.equal(block_bytes(c[li], cons, others), block_bytes(before[li], cons, others))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
def test_packing_order_is_index_select(kind: str) -> None:
    lay = make_layout(kind, "bfloat16")
    p = lay.allocate()
    randomize(p, 5)
    ids = [7, 3, 3, 30]  # repeats are fine when gathering
    st_ = gather_blocks(p, lay, ids)
    want = torch.cat(
        [t.index_select(lay.block_dim, torch.tensor(ids)).reshape(-1).view(torch.uint8) for t in p]
    )
    assert torch.equal(st_, want)
    if kind == "fa":  # layer-major, then K/V, then block
        seg = lay.segment_numel() * lay.itemsize
        assert torch.equal(st_[:seg], p[0][0, 7].reshape(-1).view(torch.uint8))
        assert torch.equal(st_[4 * seg : 5 * seg], p[0][1, 7].reshape(-1).view(torch.uint8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("impl", IMPLS)
def test_layer_subsets_and_chunks(kind: str, impl: Any) -> None:
    lay = make_layout(kind, "float8_e4m3fn", num_layers=7)
    p, c = lay.allocate(), lay.allocate(zero=True)
    randomize(p, 6)
    src, dst = rand_ids(9, lay.num_blocks, 7), rand_ids(9, lay.num_blocks, 8)
    ch = LayerChunker(lay, 9)
    assert ch.nbytes == lay.request_nbytes(9)
    full = gather_blocks(p, lay, src, impl=impl)
    chunks = ch.chunks(max_bytes=2 * ch.layer_nbytes + 1)
    assert [len(s.layers) for s in chunks] == [2, 2, 2, 1]
    assert chunks[-1].offset + chunks[-1].nbytes == ch.nbytes
    assert [len(s.layers) for s in ch.chunks(num_chunks=3)] == [3, 3, 1]
    staging = torch.zeros(ch.nbytes + 512, dtype=torch.uint8)  # bigger than needed is fine
    for s in chunks:
        part = gather_blocks(
            p, lay, src, out=staging[s.offset : s.offset + s.nbytes], layers=s.layers, impl=impl
        )
        assert part.data_ptr() == staging.data_ptr() + s.offset
    assert torch.equal(staging[: ch.nbytes], full)
    for s in ch.per_layer():  # stream it layer by layer
        assert ch.layer_slice(s.layers[0]) == (s.offset, s.nbytes)
        scatter_blocks(staging[s.offset : s.offset + s.nbytes], c, lay, dst, layers=s.layers)
    for li in range(lay.num_layers):
        assert torch.equal(block_bytes(p[li], lay, src), block_bytes(c[li], lay, dst))
    # a strided layer selection
    sub = range(1, 7, 3)
    c2 = lay.allocate(zero=True)
    scatter_blocks(gather_blocks(p, lay, src, layers=sub, impl=impl), c2, lay, dst, layers=sub)
    for li in range(lay.num_layers):
        got = block_bytes(c2[li], lay, dst)
        if li in sub:
            assert torch.equal(block_bytes(p[li], lay, src), got)
        else:
            assert not got.any()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
def test_single_allocation_input_and_bound(kind: str) -> None:
    lay = make_layout(kind, "float16")
    big = torch.empty((lay.num_layers, *lay.layer_shape()), dtype=torch.float16)
    randomize([big], 9)
    bound = BoundCaches(lay, big)
    assert bound.stacked_ok and len(bound.tensors) == lay.num_layers
    cons_big = torch.zeros_like(big)
    src, dst = rand_ids(5, lay.num_blocks, 10), rand_ids(5, lay.num_blocks, 11)
    out = torch.empty(lay.request_nbytes(5) // 2, dtype=torch.float16)  # cache-dtype staging
    s = gather_blocks(bound, lay, torch.tensor(src), out=out)
    assert s.data_ptr() == out.data_ptr()
    scatter_blocks(out, cons_big, lay, torch.tensor(dst, dtype=torch.int32), impl="stacked")
    for li in range(lay.num_layers):
        assert torch.equal(block_bytes(big[li], lay, src), block_bytes(cons_big[li], lay, dst))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("impl", IMPLS)
def test_contiguous_block_tables(kind: str, impl: Any) -> None:
    lay = make_layout(kind, "bfloat16")
    p, c = lay.allocate(), lay.allocate(zero=True)
    randomize(p, 12)
    s = gather_blocks(p, lay, range(4, 12), impl=impl)
    assert torch.equal(s, gather_blocks(p, lay, list(range(4, 12)), impl="per_layer"))
    scatter_blocks(s, c, lay, [20, 21, 22, 23, 24, 25, 26, 27], impl=impl)
    for li in range(lay.num_layers):
        assert torch.equal(
            block_bytes(p[li], lay, list(range(4, 12))),
            block_bytes(c[li], lay, list(range(20, 28))),
        )
    assert not block_bytes(c[0], lay, list(range(20))).any()


@pytest.mark.timeout(60)
def test_empty_requests() -> None:
    lay = make_layout("fa", "bfloat16")
    p = lay.allocate()
    s = gather_blocks(p, lay, [])
    assert s.numel() == 0
    scatter_blocks(s, p, lay, [])
    assert gather_blocks(p, lay, [1], layers=range(0)).numel() == 0


# --------------------------------------------------------------------------- argument errors


@pytest.mark.timeout(60)
def test_bad_arguments_raise_config_error() -> None:
    lay = make_layout("fa", "bfloat16")
    p = lay.allocate()
    s = gather_blocks(p, lay, [1, 2])
    bad_calls = [
        lambda: gather_blocks(p, lay, [lay.num_blocks]),
        lambda: gather_blocks(p, lay, [-1]),
        lambda: gather_blocks(p, lay, [1.5]),  # type: ignore[list-item]
        lambda: gather_blocks(p, lay, [True]),  # type: ignore[list-item]
        lambda: gather_blocks(p, lay, torch.tensor([[1]])),
        lambda: gather_blocks(p, lay, torch.tensor([1.0])),
        lambda: gather_blocks(p, lay, [1], out=torch.empty(3, dtype=torch.uint8)),
        lambda: gather_blocks(p, lay, [1], layers=range(2, 9)),
        lambda: gather_blocks(p, lay, [1], layers=range(2, 0, -1)),
        lambda: gather_blocks(p, lay, [1], impl="bogus"),  # type: ignore[arg-type]
        lambda: gather_blocks(p, lay, [1], impl="triton"),  # no CUDA here
        lambda: gather_blocks(p[:2], lay, [1]),
        lambda: gather_blocks([t.float() for t in p], lay, [1]),
        lambda: gather_blocks([t.transpose(1, 2) for t in p], lay, [1]),
        lambda: gather_blocks(p, lay, [1], impl="stacked"),  # separate allocations
        lambda: scatter_blocks(s, p, lay, [3, 3]),  # duplicate destination
        lambda: scatter_blocks(s, p, lay, [3]),  # count mismatch
        lambda: scatter_blocks(s[:-2], p, lay, [3, 4]),
        lambda: BoundCaches(lay, torch.empty(3)),
        lambda: LayerChunker(lay, 2).layer_slice(99),
    ]
    for call in bad_calls:
        with pytest.raises(ConfigError):
            call()


# --------------------------------------------------------------------------- layouts


@pytest.mark.timeout(60)
def test_layout_geometry() -> None:
    fa = FlashAttentionLayout(32, 1000, 16, 8, 128, "bfloat16")
    assert fa.layer_shape() == (2, 1000, 16, 8, 128)
    assert fa.block_nbytes() == 2 * 16 * 8 * 128 * 2 == 64 * 1024
    assert fa.request_nbytes(16) == 32 * 1024 * 1024  # 256 tokens of Llama-3-8B
    fi = FlashInferLayout(2, 10, 16, 8, 128, "float8_e5m2")
    assert fi.layer_shape() == (10, 2, 16, 8, 128) and fi.block_nbytes() == 2 * 16 * 8 * 128
    mla = MLALayout(61, 100, 64, 576, "bfloat16")
    assert mla.layer_shape() == (100, 64, 576) and mla.block_nbytes() == 64 * 576 * 2
    for lay in (fa, fi, mla):
        assert layout_from_wire(lay.to_wire()) == lay
    for bad in (
        lambda: FlashAttentionLayout(0, 10, 16, 8, 128),
        lambda: FlashAttentionLayout(1, 10, 16, 8, 128, "float64"),
        lambda: FlashAttentionLayout(1, 10, 16, 8, True),  # type: ignore[arg-type]
        lambda: MLALayout(1, 2**31 - 1, 1 << 16, 1 << 20, "float32"),  # absurd
    ):
        with pytest.raises(ConfigError):
            bad()


@pytest.mark.timeout(60)
def test_allocate_and_validate() -> None:
    lay = MLALayout(4, 8, 4, 16, "float8_e4m3fn")
    sep = lay.allocate()
    assert not BoundCaches(lay, sep).stacked_ok or len(sep) == 1
    stk = lay.allocate(stacked=True, zero=True)
    assert BoundCaches(lay, stk).stacked_ok
    assert all(t.dtype == torch.float8_e4m3fn and not t.view(torch.uint8).any() for t in stk)
    assert len(lay.validate_caches(torch.empty((4, 8, 4, 16), dtype=torch.float8_e4m3fn))) == 4
    with pytest.raises(ConfigError):
        lay.validate_caches(torch.empty((3, 8, 4, 16), dtype=torch.float8_e4m3fn))
    with pytest.raises(ConfigError):
        lay.validate_caches("abcd")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        lay.validate_caches([*sep[:3], 5])  # type: ignore[list-item]


@pytest.mark.timeout(60)
def test_check_compatible_names_field() -> None:
    a = FlashAttentionLayout(32, 100, 16, 8, 128, "bfloat16")
    check_compatible(a, FlashAttentionLayout(32, 5, 16, 8, 128, "bfloat16"))
    cases = {
        "kind": FlashInferLayout(32, 100, 16, 8, 128, "bfloat16"),
        "num_layers": FlashAttentionLayout(16, 100, 16, 8, 128, "bfloat16"),
        "block_size": FlashAttentionLayout(32, 100, 32, 8, 128, "bfloat16"),
        "num_kv_heads": FlashAttentionLayout(32, 100, 16, 4, 128, "bfloat16"),
        "head_dim": FlashAttentionLayout(32, 100, 16, 8, 64, "bfloat16"),
        "dtype": FlashAttentionLayout(32, 100, 16, 8, 128, "float8_e4m3fn"),
    }
    for field, other in cases.items():
        with pytest.raises(LayoutMismatchError, match=field) as ei:
            check_compatible(a, other)
        assert ei.value.code == "layout_mismatch"
    with pytest.raises(LayoutMismatchError, match="latent_dim"):
        check_compatible(MLALayout(2, 3, 4, 5), MLALayout(2, 3, 4, 6))


HOSTILE = [
    None,
    [],
    "flash_attention",
    {},
    {"kind": "nope"},
    {"kind": ["flash_attention"]},
    {"kind": "mla", "num_layers": 1, "num_blocks": 1, "block_size": 1, "latent_dim": 1},
    {
        "kind": "mla",
        "num_layers": 1,
        "num_blocks": 1,
        "block_size": 1,
        "latent_dim": 1,
        "dtype": "float64",
    },
    {
        "kind": "mla",
        "num_layers": 1,
        "num_blocks": 1,
        "block_size": 1,
        "latent_dim": 1,
        "dtype": "__class__",
    },
    {
        "kind": "mla",
        "num_layers": 1.0,
        "num_blocks": 1,
        "block_size": 1,
        "latent_dim": 1,
        "dtype": "int8",
    },
    {
        "kind": "mla",
        "num_layers": -1,
        "num_blocks": 1,
        "block_size": 1,
        "latent_dim": 1,
        "dtype": "int8",
    },
    {
        "kind": "mla",
        "num_layers": 10**40,
        "num_blocks": 1,
        "block_size": 1,
        "latent_dim": 1,
        "dtype": "int8",
    },
    {
        "kind": "mla",
        "num_layers": 1,
        "num_blocks": 1,
        "block_size": 1,
        "latent_dim": 1,
        "dtype": "int8",
        "extra": 1,
    },
    {"kind": "mla", 1: 2},
    {
        "kind": "flash_attention",
        "num_layers": 4096,
        "num_blocks": 2**31 - 1,
        "block_size": 65536,
        "num_kv_heads": 4096,
        "head_dim": 65536,
        "dtype": "float32",
    },
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("d", HOSTILE)
def test_hostile_wire_dicts(d: object) -> None:
    with pytest.raises(ConfigError):
        layout_from_wire(d)


_wire_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["flash_attention", "flashinfer", "mla", *DTYPES]),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
)
_wire_keys = st.one_of(
    st.sampled_from(
        [
            "kind",
            "num_layers",
            "num_blocks",
            "block_size",
            "num_kv_heads",
            "head_dim",
            "latent_dim",
            "dtype",
        ]
    ),
    st.text(max_size=10),
    st.integers(),
)


@pytest.mark.timeout(60)
@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_wire_keys, _wire_values, max_size=9))
def test_arbitrary_wire_dicts_only_raise_config_error(d: dict[Any, Any]) -> None:
    try:
        lay = layout_from_wire(d)
    except ConfigError:
        return
    assert layout_from_wire(lay.to_wire()) == lay


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["fa", "fi", "mla"]),
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(1, 2**20),
    st.sampled_from(sorted(DTYPES)),
)
def test_valid_wire_round_trip(kind: str, layers: int, bs: int, blocks: int, dtype: str) -> None:
    lay: KVLayout
    if kind == "fa":
        lay = FlashAttentionLayout(layers, blocks, bs, 8, 128, dtype)
    elif kind == "fi":
        lay = FlashInferLayout(layers, blocks, bs, 8, 128, dtype)
    else:
        lay = MLALayout(layers, blocks, bs, 576, dtype)
    w = lay.to_wire()
    assert all(isinstance(v, (int, str)) for v in w.values())
    assert layout_from_wire(dict(w)) == lay


# --------------------------------------------------------------------------- staging pool


@pytest.mark.timeout(60)
def test_pool_alloc_free_coalesce() -> None:
    pool = StagingPool(4096)
    a = pool.try_alloc(100)
    b = pool.try_alloc(256)
    c = pool.try_alloc(1000)
    assert a is not None and b is not None and c is not None
    assert (a.offset, b.offset, c.offset) == (0, 256, 512)
    assert a.tensor.numel() == 100 and a.tensor.dtype == torch.uint8
    assert a.tensor.data_ptr() == pool.buffer.data_ptr()
    s = pool.statistics()
    assert (s.in_use, s.peak, s.fragments, s.leases) == (1536, 1536, 1, 3)
    b.release()
    b.release()  # idempotent
    assert pool.statistics().fragments == 2
    assert pool.try_alloc(4096 - 1536 + 1) is None
    a.release()  # merges with b's hole
    s = pool.statistics()
    assert (s.fragments, s.largest_free, s.in_use) == (2, 2560, 1024)
    d = pool.try_alloc(513)  # the 512-byte hole is skipped (first fit)
    assert d is not None and d.offset == 1536
    d.release()
    with c:
        pass
    s = pool.statistics()
    assert (s.fragments, s.largest_free, s.in_use, s.peak, s.leases) == (1, 4096, 0, 1792, 0)
    big = pool.try_alloc(4096)
    assert big is not None and big.offset == 0
    big.release()
    z = pool.try_alloc(0)
    assert z is not None and z.tensor.numel() == 0
    z.release()
    for bad in (-1, 4097, 1.5):
        with pytest.raises(ConfigError):
            pool.try_alloc(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        StagingPool(0)


@pytest.mark.timeout(60)
def test_pool_first_fit_and_gather_into_lease() -> None:
    lay = make_layout("fa", "bfloat16")
    p = lay.allocate()
    randomize(p, 13)
    pool = StagingPool(4 * lay.request_nbytes(3))
    filler = pool.try_alloc(10)
    lease = pool.try_alloc(lay.request_nbytes(3))
    assert filler is not None and lease is not None and lease.offset == 256
    s = gather_blocks(p, lay, [1, 2, 5], out=lease.tensor)
    assert torch.equal(s, gather_blocks(p, lay, [1, 2, 5]))
    filler.release()
    lease.release()
    assert pool.statistics().fragments == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pool_waiters_fifo() -> None:
    pool = StagingPool(1024)
    a = await pool.alloc(1024)
    order: list[str] = []

    async def want(name: str, n: int) -> None:
        lease = await pool.alloc(n, timeout=5)
        order.append(name)
        await asyncio.sleep(0.01)
        lease.release()

    tasks = [asyncio.ensure_future(want(n, k)) for n, k in (("big", 1024), ("s1", 10), ("s2", 10))]
    await asyncio.sleep(0.01)
    assert pool.statistics().waiters == 3
    assert pool.try_alloc(1) is None  # no queue jumping while others wait
    a.release()
    await asyncio.gather(*tasks)
    assert order == ["big", "s1", "s2"]
    s = pool.statistics()
    assert (s.in_use, s.waiters, s.leases) == (0, 0, 0)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pool_timeout_and_cancel() -> None:
    pool = StagingPool(1024)
    a = await pool.alloc(600)
    with pytest.raises(AiokvTimeoutError):
        await pool.alloc(600, timeout=0.02)
    with pytest.raises(TimeoutError):  # also a builtin TimeoutError
        await pool.alloc(600, timeout=0)
    assert pool.statistics().waiters == 0
    # a cancelled head waiter must not block the ones behind it
    head = asyncio.ensure_future(pool.alloc(1000))
    small = asyncio.ensure_future(pool.alloc(100, timeout=5))
    await asyncio.sleep(0.01)
    assert not small.done()
    head.cancel()
    lease = await small
    assert lease.nbytes == 100
    with pytest.raises(asyncio.CancelledError):
        await head
    lease.release()
    # granted and cancelled in the same loop iteration: the lease is given back
    w = asyncio.ensure_future(pool.alloc(400))
    await asyncio.sleep(0.01)
    a.release()  # grants w's future
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    s = pool.statistics()
    assert (s.in_use, s.leases, s.waiters) == (0, 0, 0)
    with pytest.raises(ConfigError):
        await pool.alloc(2048)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pool_many_concurrent_users() -> None:
    pool = StagingPool(8 * 1024)
    g = torch.Generator().manual_seed(0)
    sizes = [int(x) for x in torch.randint(1, 3000, (200,), generator=g)]

    async def user(n: int) -> None:
        lease = await pool.alloc(n, timeout=10)
        lease.tensor.fill_(n % 251)
        await asyncio.sleep(0)
        assert bool((lease.tensor == n % 251).all())  # nobody else wrote into our region
        lease.release()

    await asyncio.gather(*(user(n) for n in sizes))
    s = pool.statistics()
    assert (s.in_use, s.fragments, s.largest_free, s.leases) == (0, 1, 8 * 1024, 0)
