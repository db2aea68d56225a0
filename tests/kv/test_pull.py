"""Pull mode: ``publish(once=True)`` / ``wait_fetched`` on the engine, and the connector's
``serve_request`` / ``fetch_request`` over real engines on loopback TCP (CPU)."""

from __future__ import annotations

import asyncio
import struct
import time
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kvutil import blocks, filled, make_layout, rand_ids

with warnings.catch_warnings():  # this CPU torch build warns at import when numpy is absent
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import (
    ConfigError,
    Engine,
    EngineClosedError,
    EngineConfig,
    LayoutMismatchError,
    NotPublishedError,
    Timeouts,
    TransferTimeoutError,
)
from aiokv.kv import KVConnector
from aiokv.kv._request_codec import check_ticket

# anyio_backend (asyncio in debug mode, and uvloop) comes from tests/conftest.py


def cfg() -> EngineConfig:
    return EngineConfig(timeouts=Timeouts(transfer=20.0))


# --------------------------------------------------------------------------- engine


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_once_published_goes_to_one_get_and_says_to_whom() -> None:
    async with Engine(cfg()) as a, Engine(cfg()) as b, Engine(cfg()) as c:
        t = torch.arange(6, dtype=torch.int64)
        a.publish("x", t, once=True)
        waiting = asyncio.ensure_future(a.wait_fetched("x", timeout=10))
        await asyncio.sleep(0)
        got = await b.get("x", frm=a.address, timeout=10)
        assert torch.equal(got, t)
        assert await waiting == b.address
        with pytest.raises(NotPublishedError):  # served once: gone
            await c.get("x", frm=a.address, timeout=10)
        with pytest.raises(NotPublishedError):  # and waited for: nothing left to wait for
            await a.wait_fetched("x", timeout=1)
        # an ordinary publish serves any number of GETs, and has nobody to wait for
        a.publish("y", t)
        for e in (b, c):
            assert torch.equal(await e.get("y", frm=a.address, timeout=10), t)
        with pytest.raises(NotPublishedError):
            await a.wait_fetched("y", timeout=1)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_fetch_before_the_wait_is_remembered() -> None:
    async with Engine(cfg()) as a, Engine(cfg()) as b:
        a.publish("x", torch.zeros(2), once=True)
        await b.get("x", frm=a.address, timeout=10)
        assert await a.wait_fetched("x", timeout=1) == b.address


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_wait_fetched_times_out_and_unpublish_ends_a_wait() -> None:
    async with Engine(cfg()) as a:
        a.publish("x", torch.zeros(2), once=True)
        with pytest.raises(TransferTimeoutError):
            await a.wait_fetched("x", timeout=0.05)
        waiting = asyncio.ensure_future(a.wait_fetched("x", timeout=10))
        await asyncio.sleep(0.01)
        with pytest.raises(ConfigError):  # one waiter per tensor
            await a.wait_fetched("x", timeout=1)
        assert a.unpublish("x")
        with pytest.raises(NotPublishedError):
            await waiting


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_closing_the_engine_ends_a_wait_for_a_fetch() -> None:
    a = Engine(cfg())
    await a.start()
    a.publish("x", torch.zeros(2), once=True)
    waiting = asyncio.ensure_future(a.wait_fetched("x", timeout=20))
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    await a.aclose()
    with pytest.raises(EngineClosedError):
        await waiting
    assert time.perf_counter() - t0 < 5


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_cancelled_wait_loses_no_fetch() -> None:
    async with Engine(cfg()) as a:
        a.publish("x", torch.zeros(2), once=True)
        waiting = asyncio.ensure_future(a.wait_fetched("x", timeout=10))
        await asyncio.sleep(0)
        # taken and cancelled in one loop pass: the waiter resumes with the cancel
        a._claim_published(["x"], "127.0.0.1:9")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await a.wait_fetched("x", timeout=1) == "127.0.0.1:9"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_taker_is_known_when_its_get_arrives() -> None:
    """wait_fetched returns when the GET is accepted, not when the tensor has landed
    there: the producer's next message to that peer starts a round trip sooner."""
    async with Engine(cfg()) as a, Engine(cfg()) as b:
        await b.connect(a.address)
        big = torch.ones(32 << 20, dtype=torch.uint8)  # takes a while to move
        a.publish("x", big, once=True)
        waiting = asyncio.ensure_future(a.wait_fetched("x", timeout=10))
        t0 = time.perf_counter()
        getting = asyncio.ensure_future(b.get("x", frm=a.address, timeout=10))
        assert await waiting == b.address
        t_taken = time.perf_counter() - t0
        assert not getting.done()
        assert (await getting).numel() == big.numel()
        t_landed = time.perf_counter() - t0
        assert t_taken < t_landed / 2, (t_taken, t_landed)
        assert not a._is_published("x")


# --------------------------------------------------------------------------- connector


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "mla"])
async def test_pull_moves_the_request_bit_exact(kind: str) -> None:
    pl = make_layout(kind, "bfloat16", num_blocks=41)
    cl = make_layout(kind, "bfloat16", num_blocks=29)
    p, c = filled(pl, 1), filled(cl, 2)
    src, dst = rand_ids(11, pl.num_blocks, 3), rand_ids(11, cl.num_blocks, 4)
    async with Engine(cfg()) as a, Engine(cfg()) as b:
        prod, cons = KVConnector(a, pl, p), KVConnector(b, cl, c)
        serving = asyncio.ensure_future(prod.serve_request("r1", src, timeout=20))
        await asyncio.sleep(0.01)  # the producer answers first; the consumer comes later
        await cons.fetch_request("r1", dst, frm=a.address, timeout=20)
        assert await serving == b.address
        assert prod.finished_sending() == {"r1"}
        assert cons.finished_receiving() == {"r1"}
        for li in range(pl.num_layers):
            assert torch.equal(blocks(p[li], pl, src), blocks(c[li], cl, dst))
        with pytest.raises(NotPublishedError):  # a second consumer: taken already
            await cons.fetch_request("r1", dst, frm=a.address, timeout=5)
        await prod.aclose()
        await cons.aclose()


@asynccontextmanager
async def connectors() -> AsyncIterator[
    tuple[Engine, KVConnector, KVConnector, Callable[[], None]]
]:
    """Two engines with connectors over small caches; yields ``(producer's engine,
    producer, consumer, untouched)``: ``untouched()`` asserts the consumer's cache is
    as it was."""
    lay = make_layout("fa", "float16", num_blocks=16)
    p, c = filled(lay, 1), filled(lay, 2)
    before = [t.clone() for t in c]

    def untouched() -> None:
        for x, y in zip(c, before, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))

    async with Engine(cfg()) as a, Engine(cfg()) as b:
        yield a, KVConnector(a, lay, p), KVConnector(b, lay, c), untouched


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pull_nobody_fetches_then_a_late_consumer_is_refused_at_once() -> None:
    async with connectors() as (a, prod, cons, untouched):
        with pytest.raises(TransferTimeoutError):
            await prod.serve_request("r1", [1, 2, 3], timeout=0.2)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(NotPublishedError):
            await cons.fetch_request("r1", [4, 5, 6], frm=a.address, timeout=10)
        assert asyncio.get_running_loop().time() - t0 < 5
        assert prod.finished_sending() == set()
        assert cons.statistics().recv_failures == 1  # a failed fetch is a failed receive
        untouched()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pull_block_count_mismatch_is_refused_before_anything_is_written() -> None:
    async with connectors() as (a, prod, cons, untouched):
        serving = asyncio.ensure_future(prod.serve_request("r1", [1, 2, 3], timeout=2))
        await asyncio.sleep(0.01)
        with pytest.raises(LayoutMismatchError) as ei:
            await cons.fetch_request("r1", [4, 5], frm=a.address, timeout=10)
        assert ei.value.code == "kv_size_mismatch"
        assert cons.statistics().recv_failures == 1
        await asyncio.wait([serving], timeout=10)
        untouched()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_pull_needs_an_engine_with_get_mode() -> None:
    lay = make_layout("fa", "float16", num_blocks=16)

    class SendRecvOnly:
        def send_nowait(self, *a: object, **k: object) -> None:
            raise AssertionError

        async def recv(self, *a: object, **k: object) -> None:
            raise AssertionError

    con = KVConnector(SendRecvOnly(), lay, filled(lay, 1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="GET mode"):
        await con.serve_request("r", [1], timeout=1)
    with pytest.raises(ConfigError, match="GET mode"):
        await con.fetch_request("r", [1], frm="127.0.0.1:1", timeout=1)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_request_pulled_whole_is_checked_before_anything_is_written() -> None:
    """A CPU producer without the IPC plane hands the request over with its ticket (header
    and blocks in one GET): the consumer checks the header like recv_request's (here a
    layout of the same bytes per block but other heads) and refuses a malformed one."""
    from aiokv.kv import FlashAttentionLayout

    mine = FlashAttentionLayout(3, 16, 4, 1, 16, "float16")
    theirs = FlashAttentionLayout(3, 16, 4, 2, 8, "float16")  # same block bytes
    assert mine.block_nbytes() == theirs.block_nbytes()
    p, c = filled(theirs, 1), filled(mine, 2)
    before = [t.clone() for t in c]
    async with Engine(cfg()) as a, Engine(cfg()) as b:
        prod, cons = KVConnector(a, theirs, p), KVConnector(b, mine, c)
        serving = asyncio.ensure_future(prod.serve_request("r1", [1, 2], timeout=5))
        await asyncio.sleep(0.01)
        with pytest.raises(LayoutMismatchError) as ei:
            await cons.fetch_request("r1", [3, 4], frm=a.address, timeout=5)
        assert ei.value.code == "layout_mismatch"
        await serving  # taken (the producer's blocks were copied out)
        for bad in (
            torch.zeros(2, dtype=torch.uint8),  # too short
            torch.tensor([255, 255, 0, 0, 1, 2], dtype=torch.uint8),  # header length
        ):
            a.publish("r2#pull", bad, once=True)
            with pytest.raises(LayoutMismatchError):
                await cons.fetch_request("r2", [3, 4], frm=a.address, timeout=5)
        for x, y in zip(c, before, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        assert cons.finished_receiving() == set()
        assert cons.statistics().recv_failures == 3  # each refused fetch, once


# --------------------------------------------------------------------------- hostile input


def _consumer() -> tuple[KVConnector, list[torch.Tensor], list[torch.Tensor]]:
    lay = make_layout("fa", "float16", num_blocks=16)
    c = filled(lay, 2)

    class NoEngine:  # _take_pulled / _check_ticket touch no engine
        def send_nowait(self, *a: object, **k: object) -> None:
            raise AssertionError

        async def recv(self, *a: object, **k: object) -> None:
            raise AssertionError

    return KVConnector(NoEngine(), lay, c), c, [t.clone() for t in c]  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    head=st.binary(max_size=64),
    hlen=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    tail=st.binary(max_size=512),
)
def test_a_hostile_pulled_request_is_refused_and_writes_nothing(
    head: bytes, hlen: int | None, tail: bytes
) -> None:
    """Whatever bytes a producer sends as a whole pulled request: a LayoutMismatchError
    or (only for a well-formed one) the write -- never another exception, and nothing
    written when refused."""
    con, c, before = _consumer()
    prefix = b"" if hlen is None else struct.pack("<I", hlen)
    raw = (
        torch.frombuffer(bytearray(prefix + head + tail), dtype=torch.uint8)
        if (prefix + head + tail)
        else torch.empty(0, dtype=torch.uint8)
    )
    try:
        asyncio.run(con._pulled.take_pulled("r", raw, torch.tensor([3, 4])))
    except LayoutMismatchError:
        for x, y in zip(c, before, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.float32]),
)
def test_a_hostile_ticket_is_refused(values: list[int], dtype: torch.dtype) -> None:
    if dtype is not torch.int64:
        values = [v % 1000 for v in values]
    t = torch.tensor(values, dtype=dtype)
    ok = dtype is torch.int64 and len(values) >= 2 and values[0] == 1 and values[1] == 2
    try:
        check_ticket("r", "peer", t, 2)
    except LayoutMismatchError:
        assert not ok
    else:
        assert ok
