"""Pull mode in step batches: ``KVConnector.fetch_requests`` over real engines on loopback
TCP (CPU), on asyncio and uvloop: bit-exact against ``fetch_request`` one by one, each
request's outcome on its own, the call checked before anything is fetched."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
    NotPublishedError,
    Timeouts,
    TransferTimeoutError,
)
from aiokv.kv import KVConnector, KVLayout
from aiokv.kv._request_codec import _TICKET_VERSION, ticket_name

# anyio_backend (asyncio in debug mode, and uvloop) comes from tests/conftest.py


def cfg() -> EngineConfig:
    return EngineConfig(timeouts=Timeouts(transfer=20.0))


@asynccontextmanager
async def engines(n: int) -> AsyncIterator[list[Engine]]:
    es = [Engine(cfg()) for _ in range(n)]
    try:
        for e in es:
            await e.start()
        yield es
    finally:
        for e in es:
            await e.aclose()


def tables(sizes: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint random block tables of the given sizes."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in sizes:
        out.append(perm[at : at + n])
        at += n
    return out


async def served(prod: KVConnector, reqs: list[tuple[str, list[int]]]) -> list[asyncio.Future[str]]:
    """Serve every request; returns once each ticket is published."""
    ready = [asyncio.Event() for _ in reqs]
    tasks = [
        asyncio.ensure_future(prod.serve_request(rid, ids, timeout=20, on_published=ev.set))
        for (rid, ids), ev in zip(reqs, ready, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in ready)), 20)
    return tasks


def same(lay: KVLayout, a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.anyio
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("kind", "n"), [("fa", 1), ("fa", 16), ("fa", 64), ("fi", 16), ("mla", 16)]
)
async def test_a_batch_lands_bit_exact_as_one_by_one_does(kind: str, n: int) -> None:
    lay = make_layout(kind, "bfloat16", num_blocks=4 * 64 + 8)
    sizes = [1 + (i * 7) % 4 for i in range(n)]  # 1..4 blocks: mixed sizes
    src, dst = tables(sizes, lay.num_blocks, 1), tables(sizes, lay.num_blocks, 2)
    p = filled(lay, 3)
    async with engines(2) as (a, b):
        prod = KVConnector(a, lay, p)
        one, batch = filled(lay, 4), filled(lay, 4)  # same stale contents in both
        c_one, c_batch = KVConnector(b, lay, one), KVConnector(b, lay, batch)
        tasks = await served(prod, [(f"o{i}", src[i]) for i in range(n)])
        for i in range(n):
            assert await c_one.fetch_request(f"o{i}", dst[i], frm=a.address, timeout=20)
        assert await asyncio.gather(*tasks) == [b.address] * n
        tasks = await served(prod, [(f"b{i}", src[i]) for i in range(n)])
        want = [(f"b{i}", dst[i]) for i in reversed(range(n))]
        got = await c_batch.fetch_requests(want, frm=a.address, timeout=20)
        assert list(got) == [rid for rid, _ in want]  # in the order given
        assert all(v is None for v in got.values()), {k: v for k, v in got.items() if v}
        assert await asyncio.gather(*tasks) == [b.address] * n
        assert same(lay, one, batch)
        for i in range(n):
            for li in range(lay.num_layers):
                assert torch.equal(blocks(p[li], lay, src[i]), blocks(batch[li], lay, dst[i]))
        assert c_batch.finished_receiving() == {f"b{i}" for i in range(n)}
        st = c_batch.statistics()
        assert st.requests_received == n and st.recv_failures == 0
        assert st.bytes_received == lay.request_nbytes(sum(sizes))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_missing_or_mismatched_request_fails_alone() -> None:
    lay = make_layout("fa", "float16", num_blocks=64)
    p = filled(lay, 1)
    async with engines(2) as (a, b):
        prod = KVConnector(a, lay, p)
        c = filled(lay, 2)
        before = [t.clone() for t in c]
        cons = KVConnector(b, lay, c)
        tasks = await served(prod, [("ok0", [1, 2]), ("short", [3, 4, 5]), ("ok1", [6])])
        got = await cons.fetch_requests(
            [("ok0", [10, 11]), ("gone", [12]), ("short", [13, 14]), ("ok1", [15])],
            frm=a.address,
            timeout=20,
        )
        assert got["ok0"] is None and got["ok1"] is None
        assert isinstance(got["gone"], NotPublishedError)
        assert isinstance(got["short"], LayoutMismatchError)
        assert got["short"].code == "kv_size_mismatch"
        for li in range(lay.num_layers):
            assert torch.equal(blocks(p[li], lay, [1, 2, 6]), blocks(c[li], lay, [10, 11, 15]))
            # nothing of a failed request is written
            assert torch.equal(
                blocks(c[li], lay, [12, 13, 14]), blocks(before[li], lay, [12, 13, 14])
            )
        assert cons.finished_receiving() == {"ok0", "ok1"}
        st = cons.statistics()
        assert st.requests_received == 2 and st.recv_failures == 2
        await asyncio.gather(*tasks)  # every ticket was taken


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_malformed_call_is_refused_and_nothing_is_fetched() -> None:
    lay = make_layout("fa", "float16", num_blocks=32)
    async with engines(2) as (a, b):
        prod = KVConnector(a, lay, filled(lay, 1))
        cons = KVConnector(b, lay, filled(lay, 2))
        tasks = await served(prod, [("x", [1]), ("y", [2])])
        bad = [
            [("x", [1]), ("y", [2]), ("x", [3])],  # a request id twice
            [("x", [1]), ("y", [99])],  # a block id out of range
            [("x", [1, 1]), ("y", [2])],  # a block twice in one request
            [("x", [4, 5]), ("y", [5])],  # two requests share a block
            "xy",
        ]
        for call in bad:
            with pytest.raises(ConfigError):
                await cons.fetch_requests(call, frm=a.address, timeout=5)  # type: ignore[arg-type]
        assert a._is_published(ticket_name("x")) and a._is_published(ticket_name("y"))
        assert cons.statistics().recv_failures == 0
        assert await cons.fetch_requests([], frm=a.address) == {}
        got = await cons.fetch_requests([("x", [1]), ("y", [2])], frm=a.address, timeout=20)
        assert got == {"x": None, "y": None}
        await asyncio.gather(*tasks)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_dead_producer_fails_every_request() -> None:
    lay = make_layout("fa", "float16", num_blocks=32)
    async with engines(2) as (dead, b):
        addr = dead.address
        await dead.aclose()
        c = filled(lay, 2)
        before = [t.clone() for t in c]
        cons = KVConnector(b, lay, c)
        got = await cons.fetch_requests([(f"d{i}", [i]) for i in range(5)], frm=addr, timeout=2.0)
        assert list(got) == [f"d{i}" for i in range(5)]
        assert all(isinstance(e, ConnectError) for e in got.values())
        assert same(lay, c, before)
        assert cons.finished_receiving() == set() and cons.statistics().recv_failures == 5


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_request_that_never_follows_its_ticket_times_out_alone() -> None:
    lay = make_layout("fa", "float16", num_blocks=32)
    p = filled(lay, 1)
    async with engines(2) as (a, b):
        prod = KVConnector(a, lay, p)
        c = filled(lay, 2)
        before = [t.clone() for t in c]
        cons = KVConnector(b, lay, c)
        tasks = await served(prod, [("ok", [1, 2])])
        # a small ticket whose request is never sent
        a.publish(ticket_name("late"), torch.tensor([_TICKET_VERSION, 2]), once=True)
        got = await cons.fetch_requests(
            [("late", [5, 6]), ("ok", [7, 8])], frm=a.address, timeout=0.5
        )
        assert isinstance(got["late"], TransferTimeoutError) and got["ok"] is None
        for li in range(lay.num_layers):
            assert torch.equal(blocks(p[li], lay, [1, 2]), blocks(c[li], lay, [7, 8]))
            assert torch.equal(blocks(c[li], lay, [5, 6]), blocks(before[li], lay, [5, 6]))
        assert cons.finished_receiving() == {"ok"}
        await asyncio.gather(*tasks)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_cancelled_batch_writes_nothing() -> None:
    lay = make_layout("fa", "float16", num_blocks=64)
    async with engines(2) as (a, b):
        prod = KVConnector(a, lay, filled(lay, 1))
        c = filled(lay, 2)
        before = [t.clone() for t in c]
        cons = KVConnector(b, lay, c)
        reqs = [(f"c{i}", [2 * i, 2 * i + 1]) for i in range(20)]
        tasks = await served(prod, reqs)
        fetching = asyncio.ensure_future(cons.fetch_requests(reqs, frm=a.address, timeout=20))
        await asyncio.sleep(0)
        fetching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetching
        assert same(lay, c, before)
        assert cons.finished_receiving() == set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
