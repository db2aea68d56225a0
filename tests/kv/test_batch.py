"""Step batches (KVConnector.send_requests / recv_requests) over real engines on loopback
TCP (CPU), on asyncio and uvloop: bit-exact against the same requests sent one by one,
one engine transfer per batch, per-request failures, the all-or-nothing transfer."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from support.kvutil import blocks, filled, make_layout

with warnings.catch_warnings():  # this CPU torch build warns at import when numpy is absent
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import (
    ConfigError,
    ConnectError,
    Engine,
    EngineConfig,
    LayoutMismatchError,
    Timeouts,
    TransferError,
    TransferTimeoutError,
)
from aiokv.kv import IpcOptions, KVConnector, KVLayout

# anyio_backend (asyncio in debug mode, and uvloop) comes from tests/conftest.py


def cfg(layout: KVLayout) -> EngineConfig:
    return EngineConfig(timeouts=Timeouts(transfer=20.0), layout=layout.to_wire())


@asynccontextmanager
async def pair(layout: KVLayout) -> AsyncIterator[tuple[Engine, Engine]]:
    async with Engine(cfg(layout)) as a, Engine(cfg(layout)) as b:
        yield a, b


def tables(sizes: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint random block tables of the given sizes."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in sizes:
        out.append(perm[at : at + n])
        at += n
    return out


def landed(
    layout: KVLayout,
    p: list[torch.Tensor],
    src: list[int],
    c: list[torch.Tensor],
    dst: list[int],
) -> bool:
    return all(
        torch.equal(blocks(p[li], layout, src), blocks(c[li], layout, dst))
        for li in range(layout.num_layers)
    )


async def one_by_one(
    prod: KVConnector, cons: KVConnector, reqs: list[tuple[str, list[int], list[int]]], to: str
) -> None:
    recvs = [asyncio.ensure_future(cons.recv_request(rid, dst, timeout=20)) for rid, _, dst in reqs]
    for rid, src, _ in reqs:
        await prod.send_request(rid, src, to=to, timeout=20)
    await asyncio.gather(*recvs)


async def batched(
    prod: KVConnector,
    cons: KVConnector,
    reqs: list[tuple[str, list[int], list[int]]],
    to: str,
    **kw: Any,
) -> tuple[dict[str, Exception | None], dict[str, Exception | None]]:
    want = [(rid, dst) for rid, _, dst in reversed(reqs)]
    task = asyncio.create_task(cons.recv_requests(want, timeout=20, **kw))
    sent = await prod.send_requests([(rid, src) for rid, src, _ in reqs], to=to, timeout=20)
    got = await task
    return sent, got


# --------------------------------------------------------------------------- bit-exact


@pytest.mark.anyio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 16, 64])
async def test_a_batch_lands_bit_exact_as_one_by_one_does(n: int) -> None:
    lay = make_layout("fa", "bfloat16", num_blocks=4 * 64 + 8)
    sizes = [1 + (i * 7) % 4 for i in range(n)]  # 1..4 blocks: mixed sizes
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p = filled(lay, 3)
    reqs = [(f"r{i}", src[i], dst[i]) for i in range(n)]
    async with pair(lay) as (a, b):
        prod = KVConnector(a, lay, p)
        one, batch = filled(lay, 4), filled(lay, 4)  # same stale contents in both
        await one_by_one(prod, KVConnector(b, lay, one), reqs, b.address)
        transfers = a.statistics().transfers_sent
        cons = KVConnector(b, lay, batch)
        brq = [(f"b{i}", s, d) for i, (_, s, d) in enumerate(reqs)]
        sent, got = await batched(prod, cons, brq, b.address)
        assert a.statistics().transfers_sent - transfers == 1  # the whole step: ONE transfer
        assert list(sent) == [rid for rid, _, _ in brq]  # in the order given
        assert list(got) == [rid for rid, _, _ in reversed(brq)]
        assert all(v is None for v in sent.values()) and all(v is None for v in got.values())
        for li in range(lay.num_layers):
            assert torch.equal(one[li].view(torch.uint8), batch[li].view(torch.uint8)), li
        assert all(landed(lay, p, s, batch, d) for _, s, d in brq)
        assert prod.finished_sending() >= {rid for rid, _, _ in brq}
        assert cons.finished_receiving() == {rid for rid, _, _ in brq}
        ps, cs = prod.statistics(), cons.statistics()
        assert cs.requests_received == n and cs.recv_failures == 0
        assert cs.bytes_received == lay.request_nbytes(sum(sizes))
        assert ps.staging is not None and ps.staging.in_use == 0 and ps.staging.leases == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_batch_larger_than_a_chunk_goes_in_chunks_of_whole_layers() -> None:
    lay = make_layout("mla", "float8_e4m3fn", num_blocks=80, num_layers=7)
    sizes = [5, 0, 12, 1, 9]  # an empty request rides along
    total = sum(sizes)
    chunk = 2 * total * lay.block_nbytes() + 1  # two layers a chunk: 4 chunks
    src, dst = tables(sizes, lay.num_blocks, 5), tables(sizes, lay.num_blocks, 6)
    p, c = filled(lay, 7), filled(lay, 8, stacked=True)
    reqs = [(f"m{i}", src[i], dst[i]) for i in range(len(sizes))]
    async with pair(lay) as (a, b):
        prod = KVConnector(a, lay, p, chunk_bytes=chunk, max_inflight=2)
        cons = KVConnector(b, lay, c, chunk_bytes=chunk)
        sent, got = await batched(prod, cons, reqs, b.address)
        assert set(sent.values()) == {None} and set(got.values()) == {None}
        assert all(landed(lay, p, s, c, d) for _, s, d in reqs if s)
        assert prod.statistics().chunks_sent == 4 == cons.statistics().chunks_received
        assert a.statistics().transfers_sent == 4  # the header rides in chunk 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_an_empty_batch_moves_nothing() -> None:
    lay = make_layout("fi", "float16", num_blocks=8)
    async with pair(lay) as (a, b):
        prod, cons = KVConnector(a, lay, filled(lay, 1)), KVConnector(b, lay, filled(lay, 2))
        assert await prod.send_requests([], to=b.address) == {}
        assert await cons.recv_requests([], timeout=0.01) == {}
        assert a.statistics().transfers_sent == 0 == prod.statistics().requests_sent


# --------------------------------------------------------------------------- failures


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_request_id_twice_is_refused_and_nothing_moves() -> None:
    lay = make_layout("fa", "float32", num_blocks=16)
    async with pair(lay) as (a, b):
        prod, cons = KVConnector(a, lay, filled(lay, 1)), KVConnector(b, lay, filled(lay, 2))
        with pytest.raises(ConfigError, match="'x' appears twice in the batch"):
            await prod.send_requests([("x", [1]), ("y", [2]), ("x", [3])], to=b.address)
        with pytest.raises(ConfigError, match="'x' appears twice in the batch"):
            await cons.recv_requests([("x", [1]), ("x", [2])], timeout=5)
        with pytest.raises(ConfigError, match="share a block"):
            await cons.recv_requests([("x", [1, 2]), ("y", [2])], timeout=5)
        with pytest.raises(ConfigError, match="pair"):
            await prod.send_requests([("x", [1], 5)], to=b.address)  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="non-empty string"):
            await prod.send_requests([("", [1])], to=b.address)
        await asyncio.sleep(0.05)
        assert a.statistics().transfers_sent == 0
        assert prod.finished_sending() == set() and prod.statistics().send_failures == 0
        assert cons.statistics().recv_failures == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_bad_request_fails_alone() -> None:
    lay = make_layout("fa", "bfloat16", num_blocks=40)
    sizes = [3, 2, 4, 2]
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p, c = filled(lay, 3), filled(lay, 4)
    before = [t.clone() for t in c]
    async with pair(lay) as (a, b):
        prod, cons = KVConnector(a, lay, p), KVConnector(b, lay, c)
        producer_side = [("ok0", src[0]), ("bad", [0, 999]), ("ok2", src[2]), ("short", src[3])]
        # the consumer expects 3 blocks of "short" where the producer sends 2
        consumer_side = [("ok0", dst[0]), ("bad", dst[1]), ("ok2", dst[2]), ("short", dst[3][:1])]
        recv = asyncio.ensure_future(cons.recv_requests(consumer_side, timeout=20))
        sent = await prod.send_requests(producer_side, to=b.address, timeout=20)
        got = await recv
        assert isinstance(sent["bad"], ConfigError) and "[0, 40)" in str(sent["bad"])
        assert sent["ok0"] is None and sent["ok2"] is None and sent["short"] is None
        assert isinstance(got["bad"], TransferError) and "did not send it" in str(got["bad"])
        assert isinstance(got["short"], LayoutMismatchError)
        assert got["short"].code == "kv_size_mismatch"
        assert got["ok0"] is None and got["ok2"] is None
        assert landed(lay, p, src[0], c, dst[0]) and landed(lay, p, src[2], c, dst[2])
        for rid, ids in (("bad", dst[1]), ("short", dst[3][:1])):  # untouched
            for li in range(lay.num_layers):
                assert torch.equal(blocks(c[li], lay, ids), blocks(before[li], lay, ids)), rid
        assert prod.finished_sending() == {"ok0", "ok2", "short"}
        assert cons.finished_receiving() == {"ok0", "ok2"}
        assert prod.statistics().send_failures == 1 and cons.statistics().recv_failures == 2
        # a consumer-side bad request: the others still land
        recv = asyncio.ensure_future(cons.recv_requests([("n0", dst[0]), ("n1", [-1])], timeout=20))
        sent = await prod.send_requests([("n1", src[1]), ("n0", src[2][:3])], to=b.address)
        got = await recv
        assert sent == {"n1": None, "n0": None}
        assert isinstance(got["n1"], ConfigError) and got["n0"] is None
        assert landed(lay, p, src[2][:3], c, dst[0])


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_batch_to_a_dead_peer_fails_every_request_with_one_error() -> None:
    lay = make_layout("fa", "float16", num_blocks=32)
    async with Engine(cfg(lay)) as a:
        dead = Engine(cfg(lay))
        await dead.start()
        addr = dead.address
        await dead.aclose()
        prod = KVConnector(a, lay, filled(lay, 1))
        reqs = [(f"d{i}", [i, i + 8]) for i in range(6)] + [("bad", [99])]
        out = await prod.send_requests(reqs, to=addr, timeout=1.0)
        errors = {rid: e for rid, e in out.items() if rid != "bad"}
        first = errors["d0"]
        assert isinstance(first, ConnectError) and "nothing listens" in str(first)
        assert all(e is first for e in errors.values())  # the transfer: all-or-nothing
        assert isinstance(out["bad"], ConfigError)
        assert prod.finished_sending() == set()
        st = prod.statistics()
        assert st.send_failures == 7 and st.requests_sent == 0
        assert st.staging is not None and st.staging.in_use == 0
        await prod.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_batch_that_never_comes_times_out_every_request() -> None:
    lay = make_layout("fa", "float16", num_blocks=32)
    async with pair(lay) as (_a, b):
        cons = KVConnector(b, lay, filled(lay, 1))
        out = await cons.recv_requests([("t0", [1, 2]), ("t1", [3])], timeout=0.3)
        assert isinstance(out["t0"], TransferTimeoutError) and out["t1"] is out["t0"]
        assert cons.finished_receiving() == set() and cons.statistics().recv_failures == 2
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_batch_from_another_chunk_plan_is_refused_before_any_write() -> None:
    lay = make_layout("fa", "bfloat16", num_blocks=40, num_layers=4)
    sizes = [3, 4]
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p, c = filled(lay, 3), filled(lay, 4)
    before = [t.clone() for t in c]
    one_layer = sum(sizes) * lay.block_nbytes()
    async with pair(lay) as (a, b):
        prod = KVConnector(a, lay, p, chunk_bytes=one_layer)  # 4 chunks
        cons = KVConnector(b, lay, c)  # 1 chunk
        reqs = [(f"p{i}", src[i], dst[i]) for i in range(2)]
        sent, got = await batched(prod, cons, reqs, b.address)
        assert set(sent.values()) == {None}
        err = got["p0"]
        assert isinstance(err, LayoutMismatchError) and err.code == "kv_size_mismatch"
        assert got["p1"] is err and "chunk_bytes" in str(err)
        for li in range(lay.num_layers):
            assert torch.equal(c[li].view(torch.uint8), before[li].view(torch.uint8))
        assert cons.finished_receiving() == set()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_with_the_ipc_plane_a_batch_is_one_plane_request() -> None:
    # on CPU caches the plane falls back to the engine's path: the batch's ONE plane
    # request goes that way as one request (one fallback, one chunk), reported per request
    lay = make_layout("fa", "float32", num_blocks=32)
    sizes = [2, 3, 1]
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p, c = filled(lay, 3), filled(lay, 4)
    reqs = [(f"q{i}", src[i], dst[i]) for i in range(3)]
    async with pair(lay) as (a, b):
        prod = KVConnector(a, lay, p, ipc=IpcOptions())
        cons = KVConnector(b, lay, c, ipc=IpcOptions())
        sent, got = await batched(prod, cons, reqs, b.address, frm=a.address)
        assert set(sent.values()) == {None} and set(got.values()) == {None}
        assert all(landed(lay, p, s, c, d) for _, s, d in reqs)
        assert cons.finished_receiving() == {"q0", "q1", "q2"}
        assert prod.finished_sending() == {"q0", "q1", "q2"}
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.fallbacks == {"not_cuda": 1} and cs.ipc.fallbacks == {}
        assert ps.chunks_sent == 1 and cs.chunks_received == 1
        assert ps.requests_sent == cs.requests_received == 3
        assert ps.bytes_sent == cs.bytes_received == lay.request_nbytes(sum(sizes))
        with pytest.raises(ConfigError, match="appears twice"):
            await prod.send_requests([("z", [1]), ("z", [2])], to=b.address)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_cancelled_batch_writes_nothing_and_leaves_nothing_in_the_store() -> None:
    lay = make_layout("fi", "float32", num_blocks=40, num_layers=4)
    sizes = [2, 3]
    one_layer = sum(sizes) * lay.block_nbytes()
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p, c = filled(lay, 3), filled(lay, 4)
    before = [t.view(torch.uint8).clone() for t in c]
    async with pair(lay) as (a, b):
        prod = KVConnector(a, lay, p, chunk_bytes=one_layer)  # 4 chunks
        cons = KVConnector(b, lay, c, chunk_bytes=one_layer)
        task = asyncio.create_task(cons.recv_requests([("k0", dst[0]), ("k1", dst[1])], timeout=10))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sent = await prod.send_requests([("k0", src[0]), ("k1", src[1])], to=b.address)
        assert sent == {"k0": None, "k1": None}  # the producer's side is done
        end = asyncio.get_running_loop().time() + 5
        while True:  # the late batch is collected and dropped, not left in the store
            st = b.statistics().store
            assert st is not None
            if st.held_tensors == st.pending_tensors == st.held_bytes == 0 and st.collected >= 4:
                break  # (the header with chunk 0, then chunks 1-3)
            assert asyncio.get_running_loop().time() < end, f"store not empty: {st}"
            await asyncio.sleep(0.01)
        for t, old in zip(c, before, strict=True):
            assert torch.equal(t.view(torch.uint8), old)
        assert cons.finished_receiving() == set() and cons.statistics().recv_failures == 2
        await cons.aclose()
