"""Push mode for requests saved layer by layer (``save_layer``), on CPU.

CUDA is faked as in test_ipc_plane.py (the copy is torch's, at launch). What is
checked: a consumer waiting for a layer-wise request grants it; the producer takes the
grant at the request's first saved layer, pushes every layer as it is saved (no
message per layer) and sends one push descriptor at ``wait_saved``; without a grant
the request is pulled layer by layer and the consumer keeps granting; a cancelled
request's later layers write nothing; a layer never saved fails the request on both
sides; a push is taken whichever way each side saved or waited for it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from support.kvutil import blocks
from test_ipc_layers import layer_landed, save_all
from test_ipc_plane import landed
from test_ipc_push import _granted, push_pair, push_under_other_gids

from aiokv import ConfigError, TransferTimeoutError
from aiokv.kv.ipc._push import PUSH_REFUSED


def _layerwise(cons: Any, rid: str, dst: list[int], frm: str, timeout: float = 10) -> Any:
    return asyncio.create_task(
        cons.recv_request(rid, dst, frm=frm, timeout=timeout, layerwise=True)
    )


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layerwise_requests_are_pushed() -> None:
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        L = pl.num_layers
        sent_before = prod._ipc.producer.n_events
        for i, order in enumerate([list(range(L)), list(reversed(range(L)))]):
            src, dst = [5 + i, 9, 13 + i], [10 + i, 4, 20 - i]
            t = _layerwise(cons, f"l{i}", dst, a.address)
            await asyncio.sleep(0.05)  # the grant lands
            await save_all(prod, f"l{i}", src, b.address, order)
            assert await t == "ipc"
            assert landed(pl, p, src, c, dst)
        ps, cs = prod._ipc.statistics(), cons._ipc.statistics()
        assert ps.pushed == 2 and cs.grants == 2 and cs.pushes_received == 2
        assert not ps.fallbacks and not cs.fallbacks
        # one completion event per request, none per layer
        assert prod._ipc.producer.n_events - sent_before <= 2
        assert prod.finished_sending() >= {"l0", "l1"}
        assert cons.finished_receiving() >= {"l0", "l1"}


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_layerwise_pull_keeps_the_consumer_granting() -> None:
    """Regression: a layer-wise descriptor could not say ``can_push`` (its wire form
    dropped it), and the consumer took its silence for "cannot push": after one
    layer-wise request pulled (saved before the consumer granted it) no request was
    granted again."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        src, dst = [3, 4], [7, 8]
        saving = asyncio.create_task(
            save_all(prod, "early", src, b.address, list(range(pl.num_layers)))
        )
        await asyncio.sleep(0.05)  # the first layers are saved before the consumer asks
        t = _layerwise(cons, "early", dst, a.address)
        await saving
        assert await t == "ipc"
        assert landed(pl, p, src, c, dst)
        assert prod._ipc.statistics().pushed == 0  # pulled, layer by layer
        (m,) = cons._ipc.state.maps.values()
        assert m.can_push
        t = await _granted(cons, "next", [11], a.address)
        await prod.send_request("next", [12], to=b.address, timeout=10)
        assert await t == "ipc"
        assert cons._ipc.statistics().pushes_received == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_cancelled_layerwise_push_writes_nothing_more() -> None:
    """The consumer gives up after the first layer was pushed: its grant's abort word
    is set, so the layers saved afterwards copy nothing into its blocks."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        L = pl.num_layers
        src, dst = [5, 6], [14, 15]
        before = [blocks(c[li], pl, dst).clone() for li in range(L)]
        t = _layerwise(cons, "k", dst, a.address)
        await asyncio.sleep(0.05)
        prod.save_layer("k", 0, src, to=b.address, timeout=2)
        assert layer_landed(pl, p, src, c, dst, 0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        for li in range(1, L):
            prod.save_layer("k", li, src, to=b.address, timeout=2)
        with pytest.raises(TransferTimeoutError):  # nobody releases it
            await prod.wait_saved("k")
        assert all(blocks(c[li], pl, dst).equal(before[li]) for li in range(1, L))
        assert prod._ipc.statistics().pushed == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_layer_never_saved_fails_the_pushed_request() -> None:
    async with push_pair() as (pl, _p, _c, a, b, prod, cons):
        L = pl.num_layers
        t = _layerwise(cons, "m", [9, 10], a.address, timeout=0.8)
        await asyncio.sleep(0.05)
        for li in range(L - 1):
            prod.save_layer("m", li, [1, 2], to=b.address, timeout=5)
        with pytest.raises(ConfigError, match="never saved"):
            await prod.wait_saved("m")
        assert prod._ipc.statistics().pushed == 0  # no descriptor was sent
        with pytest.raises(TransferTimeoutError):
            await t
        deadline, done = time.monotonic() + 5, set()
        while "m" not in done and time.monotonic() < deadline:
            done |= prod.finished_sending()  # (it hands each id out once)
            await asyncio.sleep(0.01)
        assert "m" in done  # once its launches ended


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("saved_by_layer", [True, False])
async def test_a_push_is_taken_whichever_way_each_side_saved_or_waited(
    saved_by_layer: bool,
) -> None:
    """A pushed request is in place whole, however the producer saved it: a consumer
    waiting layer by layer takes a whole push, and one waiting for the whole request
    takes a layer-wise push (pulled, the two must match: kv_mode_mismatch)."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        src, dst = [2, 3], [17, 18]
        t = asyncio.create_task(
            cons.recv_request("w", dst, frm=a.address, timeout=10, layerwise=not saved_by_layer)
        )
        await asyncio.sleep(0.05)
        if saved_by_layer:
            await save_all(prod, "w", src, b.address, list(range(pl.num_layers)))
        else:
            await prod.send_request("w", src, to=b.address, timeout=10)
        assert await t == "ipc"
        assert landed(pl, p, src, c, dst)
        assert cons._ipc.statistics().pushes_received == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_refused_layerwise_push_comes_the_ordinary_way_layer_by_layer() -> None:
    """A layer-wise push under another grant id (a faulty peer): the consumer refuses
    it and waits for the request the ordinary way *layer by layer*; the producer, told
    so at ``wait_saved``, sends every layer that way."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        push_under_other_gids(prod)
        src, dst = [5, 6], [17, 18]
        t = _layerwise(cons, "f", dst, a.address)
        await asyncio.sleep(0.05)
        await save_all(prod, "f", src, b.address, list(range(pl.num_layers)))
        assert await t == "engine"
        assert landed(pl, p, src, c, dst)
        assert cons._ipc.statistics().fallbacks == {PUSH_REFUSED: 1}
        assert prod._ipc.statistics().fallbacks == {PUSH_REFUSED: 1}
