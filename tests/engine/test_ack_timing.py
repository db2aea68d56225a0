"""ACK timing (protocol v3): PUTs nobody waits for yet are acknowledged in groups.

A PUT says whether its sender waits for it (``ack_now``); the receiver answers those at
once and gathers the others until ``_ACK_EVERY`` landed, credit runs low, the sender
asks (ACK_REQ), or ``_ACK_DELAY_S`` passed. Here the delay is stretched so that any
path that forgot to ask would hang instead of passing slowly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from support.procs import engines, same_bytes, wait_until
from test_data_frames_bounded import _session

import aiokv
import aiokv.engine.server_granting as engine_mod
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
CODEC = Codec()


@pytest.fixture
async def zctx() -> Any:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def _put(xfer: int, tid: str, ack_now: bool) -> list[bytes]:
    spec = (m.TensorSpec(tid, "uint8", (16,)),)
    return [CODEC.encode(m.Put(xfer, spec, ack_now)), bytes(range(16))]


async def _acks(ctrl: zmq.asyncio.Socket, timeout: float) -> list[m.Message]:
    """The control messages that arrive until the first ACK, or for ``timeout`` seconds
    if none does (the hand-made peer stays silent no longer than that: its session
    would be judged dead)."""
    out: list[m.Message] = []
    try:
        async with asyncio.timeout(timeout):
            while not any(isinstance(x, m.Ack) for x in out):
                out.extend(CODEC.decode(f) for f in await ctrl.recv_multipart())
    except TimeoutError:
        pass
    return out


def _done(msgs: list[m.Message]) -> list[int]:
    return [x for a in msgs if isinstance(a, m.Ack) for x in a.done]


async def test_a_lazy_put_waits_for_ack_req_and_an_eager_one_does_not(
    anyio_backend: Any, zctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_mod, "_ACK_DELAY_S", 60.0)
    async with aiokv.Engine() as eng:
        ctrl, data, _w = await _session(zctx, eng, credit=True)
        await data.send_multipart(_put(1, "a", ack_now=False))
        assert same_bytes(await eng.recv("a", timeout=5), torch.arange(16, dtype=torch.uint8))
        assert _done(await _acks(ctrl, 0.3)) == []  # landed, its ACK gathered
        await data.send(CODEC.encode(m.AckReq(1)))
        assert _done(await _acks(ctrl, 2.0)) == [1]
        await data.send_multipart(_put(2, "b", ack_now=True))
        assert _done(await _acks(ctrl, 2.0)) == [2]
        # eight gathered ones are acknowledged without being asked
        for i in range(3, 3 + engine_mod._ACK_EVERY):
            await data.send_multipart(_put(i, f"c{i}", ack_now=False))
        got = await _acks(ctrl, 2.0)
        ss = next(iter(eng._server.state.servers.values()))
        print(
            "DBG",
            got,
            ss.acks,
            ss.ack_due,
            ss.ack_force,
            ss.ack_timer,
            engine_mod._ACK_EVERY,
            ss.ledger,
        )
        assert _done(got) == list(range(3, 3 + engine_mod._ACK_EVERY))
        await data.send(CODEC.encode(m.AckReq(99)))  # nothing owed: no ACK, no error
        assert [x for x in await _acks(ctrl, 0.3) if not isinstance(x, m.Pong)] == []
        assert sum(eng.statistics().protocol_errors.values()) == 0
        ctrl.close(0)
        data.close(0)


async def test_ack_req_without_credit_is_a_protocol_error(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    async with aiokv.Engine() as eng:
        ctrl, data, _w = await _session(zctx, eng, credit=False)
        await data.send(CODEC.encode(m.AckReq(1)))
        msgs = await _acks(ctrl, 2.0)
        assert any(isinstance(x, m.ErrorMsg) and x.code == "protocol" for x in msgs), msgs
        ctrl.close(0)
        data.close(0)


def _all_lazy(a: aiokv.Engine, b: aiokv.Engine) -> None:
    """Make every PUT_ASYNC from ``a`` to ``b`` one the receiver may gather: a phantom PUT
    "in flight" (so none is the only one), and no count that would force an ACK."""
    a._clients[b.address].puts_unacked = 1


async def test_awaiting_a_burst_of_send_nowait_asks_for_its_acks(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV connector's pattern: many PUT_ASYNCs, then await them. Without ACK_REQ
    they would wait for the (here: one minute) timer."""
    monkeypatch.setattr(engine_mod, "_ACK_DELAY_S", 60.0)
    monkeypatch.setattr(engine_mod, "_ACK_EVERY", 1000)
    async with engines(aiokv.EngineConfig(), aiokv.EngineConfig()) as (a, b):
        await a.connect(b.address)
        _all_lazy(a, b)
        for rnd in range(3):
            hs = [
                a.send_nowait(f"r{rnd}-{i}", torch.full((64,), i), to=b.address) for i in range(11)
            ]
            async with asyncio.timeout(5):
                for h in hs:
                    await h
            # a later burst whose last handle alone is awaited, by its release
            hs = [a.send_nowait(f"q{rnd}-{i}", torch.full((8,), i), to=b.address) for i in range(3)]
            await asyncio.sleep(0.05)  # (posted and landed, unacknowledged)
            assert not any(h._task.done() for h in hs)
            async with asyncio.timeout(5):
                await hs[-1].released()
            hs = [a.send_nowait(f"p{rnd}-{i}", torch.full((8,), i), to=b.address) for i in range(2)]
            async with asyncio.timeout(5):  # polling done() asks too
                while not all(h.done() for h in hs):
                    await asyncio.sleep(0.01)
        assert a.statistics().transfers_failed == 0
        assert a.statistics().transfers_sent == 3 * 16


async def test_puts_nobody_waits_for_are_acknowledged_after_the_delay(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_mod, "_ACK_DELAY_S", 0.05)
    monkeypatch.setattr(engine_mod, "_ACK_EVERY", 1000)
    async with engines(aiokv.EngineConfig(), aiokv.EngineConfig()) as (a, b):
        await a.connect(b.address)
        _all_lazy(a, b)
        hs = [a.send_nowait(f"f{i}", torch.full((4,), i), to=b.address) for i in range(3)]
        # nobody awaits or polls the handles: only the receiver's timer can settle them
        await wait_until(lambda: a.statistics().transfers_sent == 3, 5, "deferred ACKs")
        assert [h._task.done() for h in hs] == [True] * 3


async def test_a_sender_short_of_credit_asks_for_the_gathered_acks(
    anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver tops credit up without being asked only below a quarter of the window;
    a transfer larger than what is left above that makes the sender ask."""
    monkeypatch.setattr(engine_mod, "_ACK_DELAY_S", 60.0)
    monkeypatch.setattr(engine_mod, "_ACK_EVERY", 1000)
    small = aiokv.EngineConfig(limits=aiokv.Limits(credit_bytes=64 * 1024))
    async with engines(aiokv.EngineConfig(), small) as (a, b):
        await a.connect(b.address)
        _all_lazy(a, b)
        first = a.send_nowait("first", torch.zeros(20 * 1024, dtype=torch.uint8), to=b.address)
        await asyncio.sleep(0.05)  # landed; 44 KiB of credit left: its ACK is gathered
        assert not first._task.done()
        second = a.send_nowait("second", torch.ones(48 * 1024, dtype=torch.uint8), to=b.address)
        async with asyncio.timeout(5):
            # (the handle asks only once its PUT is out: before that, only the ask on
            # short credit can bring the top-up that lets it go)
            await second
        assert first._task.done()
        assert (await b.recv("second", timeout=5)).sum().item() == 48 * 1024


async def test_a_lone_put_async_leaves_at_once_a_burst_at_the_end_of_the_pass(
    anyio_backend: Any,
) -> None:
    """A PUT_ASYNC with nothing else in flight is likely awaited next: it is handed to zmq
    within the call (the IPC plane's descriptor); the rest of a burst waits for the end of
    the loop pass and leaves in few messages."""
    async with engines(aiokv.EngineConfig(), aiokv.EngineConfig()) as (a, b):
        await a.connect(b.address)
        cs = a._clients[b.address]
        h = a.send_nowait("lone", torch.ones(8), to=b.address)
        assert len(cs.data_out) == 0  # sent within the call
        hs = [a.send_nowait(f"burst{i}", torch.ones(8), to=b.address) for i in range(4)]
        assert len(cs.data_out) == 2 * 4  # header + tensor each, queued for the pass's end
        await h
        for x in hs:
            await x
        assert a.statistics().transfers_sent == 5
