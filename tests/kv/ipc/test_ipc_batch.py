"""Step batches (KVConnector.send_requests / recv_requests) over the IPC plane, on CPU
with the faked CUDA IPC of test_ipc_plane: a batch is ONE plane request (one descriptor,
one copy), bit-exact, reported per request; per-request refusals; the all-or-nothing
pairing of both sides' plane requests; a batch too large for one descriptor in parts.
The GPU test (tests/gpu/test_ipc_batch_gpu.py) covers the real kernel."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from support.kvutil import blocks, filled, make_layout
from test_ipc_plane import connectors, landed, pair

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import ConfigError, Engine, TransferTimeoutError
from aiokv.kv import KVConnector, KVLayout, _batched_path
from aiokv.kv._batched_path import IPC_BATCH_BLOCKS, _ipc_parts
from aiokv.kv.ipc._wire import MAX_MESSAGE_BYTES


@asynccontextmanager
async def plane(
    lay: KVLayout, p: list[torch.Tensor], c: list[torch.Tensor], **kw: Any
) -> AsyncIterator[tuple[Engine, Engine, KVConnector, KVConnector]]:
    """Two engines and connectors with the faked plane; the connectors are closed
    whatever the test does (a producer's doorbell ring lives in /dev/shm until then)."""
    async with pair(lay, lay) as (a, b):
        prod, cons = connectors(a, b, lay, p, lay, c, **kw)
        try:
            yield a, b, prod, cons
        finally:
            await prod.aclose()
            await cons.aclose()


def tables(sizes: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint block tables of the given sizes, in a scrambled order."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in sizes:
        out.append(perm[at : at + n])
        at += n
    return out


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [1, 3, 16])
async def test_a_batch_is_one_plane_request_bit_exact(count: int) -> None:
    lay = make_layout("fa", "bfloat16", num_blocks=120)
    sizes = [(i % 5) + 1 for i in range(count)]
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p, c = filled(lay, 1), filled(lay, 2)
    before = [t.clone() for t in c]
    rids = [f"r{i:02d}" for i in range(count)]
    async with plane(lay, p, c) as (a, b, prod, cons):
        # the consumer lists the requests in another order than the producer
        recv = asyncio.create_task(
            cons.recv_requests(
                list(reversed([(r, d) for r, d in zip(rids, dst, strict=True)])),
                frm=a.address,
                timeout=20,
            )
        )
        sent = await prod.send_requests(list(zip(rids, src, strict=True)), to=b.address, timeout=20)
        got = await recv
        assert list(sent) == rids and set(sent.values()) == {None}
        assert list(got) == rids[::-1] and set(got.values()) == {None}
        for s, d in zip(src, dst, strict=True):
            assert landed(lay, p, s, c, d)
        touched = {i for d in dst for i in d}
        others = [i for i in range(lay.num_blocks) if i not in touched]
        for li in range(lay.num_layers):
            assert same_bytes(blocks(c[li], lay, others), blocks(before[li], lay, others))
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.requests_sent == 1 and cs.ipc.requests_received == 1  # ONE plane request
        assert not ps.ipc.fallbacks and not cs.ipc.fallbacks
        assert ps.chunks_sent == 0 and cs.chunks_received == 0  # nothing the ordinary way
        assert ps.requests_sent == cs.requests_received == count  # reported per request
        assert cs.bytes_received == lay.request_nbytes(sum(sizes))
        assert prod.finished_sending() == set(rids) and cons.finished_receiving() == set(rids)
        assert prod._st.ipc_batches == {} and cons._st.ipc_batches == {}


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_request_refused_on_both_sides_leaves_the_others_one_plane_request() -> None:
    lay = make_layout("fi", "float32", num_blocks=40)
    src, dst = tables([2, 3, 1], lay.num_blocks, 3), tables([2, 3, 1], lay.num_blocks, 4)
    p, c = filled(lay, 1), filled(lay, 2)
    async with plane(lay, p, c) as (a, b, prod, cons):
        bad = [lay.num_blocks]  # out of range on both sides
        recv = asyncio.create_task(
            cons.recv_requests(
                [("x0", dst[0]), ("x1", bad), ("x2", dst[2])], frm=a.address, timeout=20
            )
        )
        sent = await prod.send_requests(
            [("x0", src[0]), ("x1", bad), ("x2", src[2])], to=b.address, timeout=20
        )
        got = await recv
        for out in (sent, got):
            assert out["x0"] is None and out["x2"] is None
            assert isinstance(out["x1"], ConfigError) and "must be in" in str(out["x1"])
        assert landed(lay, p, src[0], c, dst[0]) and landed(lay, p, src[2], c, dst[2])
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.requests_sent == 1 and cs.ipc.requests_received == 1
        assert ps.send_failures == 1 and cs.recv_failures == 1
        assert cons.finished_receiving() == {"x0", "x2"}


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_sides_that_disagree_on_a_block_count_never_pair_and_write_nothing() -> None:
    # equal totals (2 + 3 against 3 + 2): without the counts in the plane request's
    # name, the consumer would write one request's blocks into the other's
    lay = make_layout("fa", "float32", num_blocks=40)
    src = tables([2, 3], lay.num_blocks, 5)
    dst = tables([3, 2], lay.num_blocks, 6)
    p, c = filled(lay, 1), filled(lay, 2)
    before = [t.clone() for t in c]
    async with plane(lay, p, c) as (a, b, prod, cons):
        recv = asyncio.create_task(
            cons.recv_requests([("m0", dst[0]), ("m1", dst[1])], frm=a.address, timeout=1.0)
        )
        sent = await prod.send_requests([("m0", src[0]), ("m1", src[1])], to=b.address, timeout=1.0)
        got = await recv
        for out in (sent, got):
            assert isinstance(out["m0"], TransferTimeoutError) and out["m1"] is out["m0"]
        for li in range(lay.num_layers):
            assert same_bytes(c[li], before[li])
        assert cons.finished_receiving() == set()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_batch_larger_than_one_descriptor_goes_in_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_batched_path, "IPC_BATCH_BLOCKS", 6)
    lay = make_layout("mla", "bfloat16", num_blocks=64)
    sizes = [4, 2, 3, 7, 1]  # parts: (4, 2), (3,), (7,), (1,)
    src, dst = tables(sizes, lay.num_blocks, 7), tables(sizes, lay.num_blocks, 8)
    p, c = filled(lay, 1), filled(lay, 2)
    rids = [f"s{i}" for i in range(len(sizes))]
    async with plane(lay, p, c) as (a, b, prod, cons):
        recv = asyncio.create_task(
            cons.recv_requests(list(zip(rids, dst, strict=True)), frm=a.address, timeout=20)
        )
        sent = await prod.send_requests(list(zip(rids, src, strict=True)), to=b.address, timeout=20)
        got = await recv
        assert set(sent.values()) == set(got.values()) == {None}
        for s, d in zip(src, dst, strict=True):
            assert landed(lay, p, s, c, d)
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.requests_sent == 4 and cs.ipc.requests_received == 4


def test_parts_cut_runs_of_at_most_the_descriptors_blocks() -> None:
    # a part's source ids (4 bytes each) leave most of a control message to the offer
    assert IPC_BATCH_BLOCKS * 4 <= MAX_MESSAGE_BYTES // 4
    assert _ipc_parts([]) == []
    assert _ipc_parts([("a", 3), ("b", 0), ("c", 2)]) == [(("a", 3), ("b", 0), ("c", 2))]
    big = IPC_BATCH_BLOCKS
    assert _ipc_parts([("a", big - 1), ("b", 2), ("c", big + 5), ("d", 1)]) == [
        (("a", big - 1),),
        (("b", 2),),
        (("c", big + 5),),
        (("d", 1),),
    ]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_batch_of_requests_without_blocks_moves_nothing() -> None:
    lay = make_layout("fa", "float32", num_blocks=8)
    p, c = filled(lay, 1), filled(lay, 2)
    async with plane(lay, p, c) as (a, b, prod, cons):
        got = await cons.recv_requests([("e0", []), ("e1", [])], frm=a.address, timeout=5)
        sent = await prod.send_requests([("e0", []), ("e1", [])], to=b.address, timeout=5)
        assert got == sent == {"e0": None, "e1": None}
        assert prod.finished_sending() == cons.finished_receiving() == {"e0", "e1"}
        ps = prod.statistics()
        assert ps.ipc is not None and ps.ipc.requests_sent == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_cancelled_batch_frees_each_requests_blocks_at_the_release() -> None:
    lay = make_layout("fa", "float32", num_blocks=20)
    src, dst = tables([2, 2], lay.num_blocks, 9), tables([2, 2], lay.num_blocks, 10)
    p, c = filled(lay, 1), filled(lay, 2)
    async with plane(lay, p, c) as (a, b, prod, cons):
        send = asyncio.create_task(
            prod.send_requests([("k0", src[0]), ("k1", src[1])], to=b.address, timeout=3)
        )
        await asyncio.sleep(0.2)  # the descriptor is out; no consumer reads it yet
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert prod.finished_sending() == set()
        got = await cons.recv_requests([("k0", dst[0]), ("k1", dst[1])], frm=a.address, timeout=3)
        assert got == {"k0": None, "k1": None}
        end = asyncio.get_running_loop().time() + 10
        freed: set[str] = set()
        while freed != {"k0", "k1"}:  # at the consumer's release, per request
            freed |= prod.finished_sending()
            assert asyncio.get_running_loop().time() < end, freed
            await asyncio.sleep(0.01)
        assert prod._st.ipc_batches == {}
