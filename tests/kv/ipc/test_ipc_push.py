"""Push mode of the IPC plane (``IpcOptions(push=True)``) on CPU: its messages, the
handshake, grants, the rules for void, stale, hostile and refused grants.

CUDA is faked as in test_ipc_plane.py (:class:`FakeBackend`: both connectors in this
process, "exports" looked up, events fired at once); the producer's "kernel" is the
torch copy, which honours the grant's abort word as the kernel does (it reads the
word first). The GPU tests (tests/gpu/test_ipc_push_gpu.py) cover the real mapping,
the kernel into another process's memory, cancellation behind the producer's work and
a killed consumer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kvutil import blocks, filled, make_layout
from test_ipc_plane import OPTS, connectors, landed, pair

from aiokv import RemoteProtocolError, TransferAbortedError, TransferTimeoutError
from aiokv.kv.ipc._mapping import ABORT_WORDS
from aiokv.kv.ipc._push import PUSH_REFUSED
from aiokv.kv.ipc._wire import (
    LAYERS,
    PUSH,
    Descriptor,
    Grant,
    PushOffer,
    Release,
    StorageExport,
    decode_message,
    encode_message,
)

PUSH_OPTS = dataclasses.replace(OPTS, push=True)
ADDR = "127.0.0.1:5555"


# --------------------------------------------------------------------------- messages


def _in_shm(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def _export(size: int = 1 << 16) -> StorageExport:
    return StorageExport(b"h" * 64, size, 0, b"", 0, b"")


def _wire(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` through msgpack and the decoder, as a peer's message arrives."""
    return decode_message(encode_message(d))


@settings(max_examples=200, deadline=None)
@given(
    rid=st.text(min_size=1, max_size=40),
    gid=st.integers(1, (1 << 63) - 1),
    dst=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=64, unique=True),
    slot=st.integers(0, (1 << 40) - 1),
    until=st.floats(allow_nan=False, allow_infinity=False),
    abort=st.booleans(),
)
def test_grant_round_trip_by_engine_and_ring(
    rid: str, gid: int, dst: list[int], slot: int, until: float, abort: bool
) -> None:
    g = Grant(rid, gid, tuple(dst), slot, until, _export() if abort else None)
    assert Grant.from_wire(_wire(g.to_wire())) == g
    if not abort:  # (a grant naming an abort block goes by the engine only)
        assert Grant.from_ring(g.to_ring()) == g


def test_grant_ring_record_checked() -> None:
    b = Grant("r", 5, (1, 2), 3, 10.0).to_ring()
    for bad in (
        b[:-1],
        b + b"x",
        b"\xa2" + b[1:],  # not a grant
        b[:1] + b"\x01" + b[2:],  # an unknown flag
        b[:-4] + struct.pack("<I", 1),  # one block twice
    ):
        with pytest.raises(RemoteProtocolError):
            Grant.from_ring(bad)


@settings(max_examples=300, deadline=None)
@given(b=st.binary(max_size=120))
def test_grant_ring_garbage_raises_only_the_protocol_error(b: bytes) -> None:
    try:
        Grant.from_ring(bytes([0xA3]) + b)
    except RemoteProtocolError:
        pass


@pytest.mark.parametrize(
    "over",
    [
        {"gid": 0},
        {"gid": 1 << 63},
        {"dst": b""},  # a grant of nothing
        {"dst": b"\x01\x00\x00"},  # not whole u32s
        {"dst": struct.pack("<2I", 3, 3)},  # one block twice
        {"slot": -1},
        {"slot": 1 << 40},
        {"until": float("nan")},
        {"until": True},
        {"abort": _export(4 * ABORT_WORDS - 1).to_wire()},
        {"extra": 1},
        {"rid": 7},
    ],
)
def test_grant_fields_checked(over: dict[str, Any]) -> None:
    good = Grant("r", 5, (1, 2), 3, 10.0).to_wire()
    assert Grant.from_wire(_wire(good)).dst == (1, 2)
    with pytest.raises(RemoteProtocolError):
        Grant.from_wire(_wire({**good, **over}))


def _pushed(**over: Any) -> Descriptor:
    f: dict[str, Any] = {
        "rid": "r1",
        "plane": PUSH,
        "n": 3,
        "reply_to": ADDR,
        "token": 9,
        "event": b"e" * 64,
        "event_slot": 4,
        "lease": 12.5,
        "gid": 77,
    }
    f.update(over)
    return Descriptor(**f)


@settings(max_examples=200, deadline=None)
@given(
    rid=st.text(min_size=1, max_size=60),
    n=st.integers(0, 1 << 22),
    slot=st.integers(0, 1 << 20),
    token=st.integers(1, (1 << 63) - 1),
    gid=st.integers(1, (1 << 63) - 1),
    lease=st.floats(allow_nan=False, allow_infinity=False),
    ev=st.binary(min_size=1, max_size=256),
    solo=st.booleans(),
)
def test_pushed_descriptor_round_trips_by_engine_and_ring(
    rid: str, n: int, slot: int, token: int, gid: int, lease: float, ev: bytes, solo: bool
) -> None:
    d = _pushed(rid=rid, n=n, event_slot=slot, token=token, gid=gid, lease=lease, event=ev)
    assert Descriptor.from_wire(_wire(d.to_wire())) == (d, None)
    assert Descriptor.from_ring(d.to_ring(solo=solo), ADDR) == (d, solo)


@pytest.mark.parametrize(
    "over",
    [{"gid": 0}, {"src": b""}, {"offer": None}, {"push": True}, {"event": b""}, {"token": 0}],
)
def test_pushed_descriptor_fields_checked(over: dict[str, Any]) -> None:
    good = _pushed().to_wire()
    with pytest.raises(RemoteProtocolError):
        Descriptor.from_wire(_wire({**good, **over}))


def test_pushed_ring_record_checked() -> None:
    b = _pushed().to_ring(solo=False)
    assert Descriptor.from_ring(b, ADDR)[0].gid == 77
    for bad in (b[:-1], b + b"x", b[:1] + b"\x04" + b[2:]):  # sizes, an unknown flag
        with pytest.raises(RemoteProtocolError):
            Descriptor.from_ring(bad, ADDR)
    gid0 = bytearray(b)
    gid0[20:28] = bytes(8)  # (magic, flags, rid len, n, slot, token: 20 bytes; then gid)
    with pytest.raises(RemoteProtocolError):
        Descriptor.from_ring(bytes(gid0), ADDR)


@settings(max_examples=300, deadline=None)
@given(b=st.binary(max_size=120))
def test_push_ring_garbage_raises_only_the_protocol_error(b: bytes) -> None:
    try:
        Descriptor.from_ring(bytes([0xA2]) + b, ADDR)
    except RemoteProtocolError:
        pass


@pytest.mark.parametrize("can_push", [False, True])
def test_a_pull_descriptor_says_whether_the_producer_can_push(can_push: bool) -> None:
    d = Descriptor("r", "ipc", 2, ADDR, 9, (4, 5), b"e" * 64, 1, 3.0, can_push=can_push)
    assert Descriptor.from_wire(_wire(d.to_wire()))[0].can_push is can_push
    assert Descriptor.from_ring(d.to_ring(solo=True), ADDR)[0].can_push is can_push
    # an older producer's descriptor has no "push" key: it cannot push
    w = d.to_wire()
    w.pop("push", None)
    assert Descriptor.from_wire(_wire(w))[0].can_push is False
    with pytest.raises(RemoteProtocolError):
        Descriptor.from_wire(_wire({**w, "push": 1}))
    # a layer-wise pull says it too (its events come per layer; none here)
    lw = Descriptor("r", LAYERS, 2, ADDR, 9, (4, 5), lease=3.0, can_push=can_push)
    assert Descriptor.from_wire(_wire(lw.to_wire()))[0].can_push is can_push


async def _offer() -> tuple[PushOffer, Any]:
    """A real consumer's push offer (FakeBackend exports)."""
    pl = make_layout("fa", "bfloat16", 8)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, filled(pl, 1), pl, filled(pl, 2), opts=PUSH_OPTS)
        m: Any = type("M", (), {"push_offered": False, "grant_bell": None})()
        po = cons._ipc.granter.offer_push(m)
        assert po is not None and m.push_offered
        assert po.bell == m.grant_bell.name and po.bell_key == m.grant_bell.key
        assert cons._ipc.granter.offer_push(m) is None  # once per mapping
        m.grant_bell.close()
        await prod.aclose()
        await cons.aclose()
        return po, pl


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_release_carries_the_push_offer() -> None:
    po, _ = await _offer()
    rel = Release("r", True, push=po)
    assert Release.from_wire(_wire(rel.to_wire())) == rel
    with pytest.raises(RemoteProtocolError):  # only an ok release carries one
        Release.from_wire(_wire({**rel.to_wire(), "ok": False}))
    w = po.to_wire()
    for bad in (
        {**w, "target": _export(1).to_wire()},  # smaller than two segments
        {**w, "abort0": _export(16).to_wire()},
        {**w, "offer": {**w["offer"], "bell": "aiokv-bell-x", "bell_key": b"k" * 32}},
        {**w, "x": 1},
    ):
        with pytest.raises(RemoteProtocolError):
            PushOffer.from_wire(_wire({"p": bad})["p"])


# --------------------------------------------------------------------------- flow


async def _handshake(prod: Any, cons: Any, a: Any, b: Any, *, wait: bool = True) -> None:
    """Two pulled requests: the first's release carries the consumer's export, the
    producer maps it, the second's descriptor says it can push."""
    for i in range(2):
        recv = asyncio.create_task(cons.recv_request(f"h{i}", [i], frm=a.address, timeout=10))
        await asyncio.sleep(0.02)
        await prod.send_request(f"h{i}", [i], to=b.address, timeout=10)
        assert await recv == "ipc"
        for _ in range(200 if wait and i == 0 else 0):
            if b.address in prod._ipc.pusher.maps:
                break
            await asyncio.sleep(0.01)


@asynccontextmanager
async def push_pair(*, producer_push: bool = True) -> AsyncIterator[tuple[Any, ...]]:
    """Two engines and push-mode connectors (FlashAttention, bf16, 24 blocks) past the
    handshake (``producer_push`` False: the producer's side without push mode, so no
    handshake to wait for); closed afterwards. Yields ``(layout, producer caches,
    consumer caches, a, b, producer, consumer)``."""
    pl = make_layout("fa", "bfloat16", 24)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, opts=PUSH_OPTS)
        if not producer_push:
            prod._ipc.options = OPTS
        try:
            await _handshake(prod, cons, a, b, wait=producer_push)
            yield pl, p, c, a, b, prod, cons
        finally:  # (also after a failed assertion: a ring left in /dev/shm fails others)
            await prod.aclose()
            await cons.aclose()


def push_under_other_gids(prod: Any) -> None:
    """Make ``prod`` push under another grant id than the one it took (a faulty peer)."""
    take = prod._ipc.pusher.take_grant

    def other_gid(*args: Any) -> Any:
        got = take(*args)
        return None if got is None else (dataclasses.replace(got[0], gid=got[0].gid ^ 2), got[1])

    prod._ipc.pusher.take_grant = other_gid


async def _granted(cons: Any, rid: str, dst: list[int], frm: Any, **kw: Any) -> asyncio.Task[Any]:
    """Start a consumer's request and let its grant land at the producer."""
    t = asyncio.create_task(cons.recv_request(rid, dst, frm=frm, timeout=kw.get("timeout", 10)))
    await asyncio.sleep(0.05)
    return t


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name_producer", [True, False])
async def test_granted_requests_are_pushed(name_producer: bool) -> None:
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        for i in range(3):
            src, dst = [5 + i, 9, 13 + i], [10 + i, 4, 20 - i]
            t = await _granted(cons, f"r{i}", dst, a.address if name_producer else None)
            # r1 and r2 came by the grants ring, read as they came (woken by its FIFO)
            assert (f"r{i}" in prod._ipc.pusher.maps[b.address].grants) is (i > 0)
            await prod.send_request(f"r{i}", src, to=b.address, timeout=10)
            assert await t == "ipc"
            assert landed(pl, p, src, c, dst)
        ps, cs = prod._ipc.statistics(), cons._ipc.statistics()
        assert ps.pushed == 3 and cs.grants == 3 and cs.pushes_received == 3
        # the first grant named its abort block (by the engine), the next two came by
        # the grants ring (whose name is gone from /dev/shm since the producer opened it)
        (m,) = cons._ipc.state.maps.values()
        assert m.grant_bell is not None and m.grant_bell._seq == 2
        assert not _in_shm(m.grant_bell.name)
        assert cs.requests_received == 5 and ps.requests_sent == 5
        assert not ps.fallbacks and not cs.fallbacks
        assert prod.finished_sending() >= {"r0", "r1", "r2"}
        assert cons.finished_receiving() >= {"r0", "r1", "r2"}


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_staged_pull_also_learns_that_the_producer_can_push() -> None:
    """Regression: the descriptor of a pull the ring's poll launched (a
    staged copy) says ``can_push`` too; only the unstaged path read it, so on a GPU --
    where whole requests are staged -- the consumer never granted."""
    from test_ipc_staged import staged_pair

    async with staged_pair(PUSH_OPTS) as t:
        # r0 (the staged pair's first request) carried the offer; wait for the mapping
        for _ in range(200):
            if t.b.address in t.prod._ipc.pusher.maps:
                break
            await asyncio.sleep(0.01)
        r1 = asyncio.create_task(t.cons.recv_request("r1", [7], frm=t.a.address, timeout=10))
        await asyncio.sleep(0.02)
        await t.prod.send_request("r1", [8], to=t.b.address, timeout=10)
        assert await r1 == "ipc"
        assert t.plane.statistics().ring_launches == 1  # staged, launched by the poll
        r2 = await _granted(t.cons, "r2", [9], t.a.address)
        await t.prod.send_request("r2", [10], to=t.b.address, timeout=10)
        assert await r2 == "ipc"
        assert t.plane.statistics().pushes_received == 1
        assert landed(t.pl, t.p, [10], t.c, [9])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_late_grant_is_void_and_its_word_set() -> None:
    """The producer sends before the grant landed: it answers by pull (the data is
    right) and the grant, landing later or never, can copy nothing (its word is set)."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        words = cons._ipc.state.words
        nxt = words.free[-1] if words.free else words._next
        recv = asyncio.create_task(cons.recv_request("r1", [11, 12], frm=a.address, timeout=10))
        await asyncio.sleep(0)  # the grant is sent, not landed
        await prod.send_request("r1", [3, 4], to=b.address, timeout=10)
        assert await recv == "ipc"
        assert landed(pl, p, [3, 4], c, [11, 12])
        ab, w = words.word(nxt)
        assert int(ab[w]) == 1 and nxt not in words.free
        assert prod._ipc.statistics().pushed == 0 and cons._ipc.statistics().grants == 1
        await asyncio.sleep(0.1)  # the late grant landed and was dropped, not kept
        assert prod._ipc.channel.recv_nowait("r1#ipcgrant", frm=b.address) is None


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_cancelled_grant_copies_nothing_when_the_producer_takes_it() -> None:
    async with push_pair() as (pl, _p, c, a, b, prod, cons):
        before = [x.clone() for x in c]
        t = await _granted(cons, "k1", [14, 15, 16], a.address)
        t.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await t
        # settled: the word landed, no answer within the grace period
        assert PUSH_OPTS.grace_s - 0.05 <= time.monotonic() - t0 < PUSH_OPTS.grace_s + 1.0
        with pytest.raises(TransferTimeoutError):  # pushed (nothing), no release comes
            await prod.send_request("k1", [1, 2, 3], to=b.address, timeout=0.5)
        assert prod._ipc.statistics().pushed == 1
        assert all(
            torch_equal(blocks(x, pl, [14, 15, 16]), blocks(y, pl, [14, 15, 16]))
            for x, y in zip(before, c, strict=True)
        )
        assert cons._ipc.statistics().aborted == 1
        assert "k1" not in cons.finished_receiving()


def torch_equal(x: Any, y: Any) -> bool:
    import torch

    return bool(torch.equal(x, y))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_push_for_another_grant_is_refused_and_the_request_still_lands() -> None:
    """A producer pushing under another grant id (a stale grant of the same request
    id, or a faulty peer): the consumer refuses it, the producer stops pushing to it and
    sends the request the ordinary way."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        push_under_other_gids(prod)
        t = await _granted(cons, "r1", [17, 18], a.address)
        await prod.send_request("r1", [5, 6], to=b.address, timeout=10)
        assert await t == "engine"
        assert landed(pl, p, [5, 6], c, [17, 18])
        assert cons._ipc.statistics().fallbacks == {PUSH_REFUSED: 1}
        assert prod._ipc.statistics().fallbacks == {PUSH_REFUSED: 1}
        assert b.address not in prod._ipc.pusher.maps
        # the next requests are pulled (the producer says it cannot push any more)
        recv = asyncio.create_task(cons.recv_request("r2", [19], frm=a.address, timeout=10))
        await asyncio.sleep(0.02)
        await prod.send_request("r2", [7], to=b.address, timeout=10)
        assert await recv == "ipc" and landed(pl, p, [7], c, [19])
        assert cons._ipc.statistics().grants == 1  # it stopped granting at the refusal


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["out_of_range", "other_rid", "expired", "count"])
async def test_a_grant_the_producer_cannot_use_is_answered_by_pull(bad: str) -> None:
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        send = cons._ipc.state.send_msg

        def tamper(tid: str, msg: Any, to: str, timeout: float, *wait: Any) -> None:
            if tid.endswith("#ipcgrant"):
                msg = dict(msg)
                if bad == "out_of_range":
                    msg["dst"] = struct.pack("<2I", 0, 24)
                elif bad == "other_rid":
                    msg["rid"] = "someone-else"
                elif bad == "expired":
                    msg["until"] = time.monotonic() - 1
                else:
                    msg["dst"] = struct.pack("<3I", 1, 2, 3)
            send(tid, msg, to, timeout, *wait)

        cons._ipc.state.send_msg = tamper
        t = await _granted(cons, "r1", [20, 21], a.address)
        await prod.send_request("r1", [8, 9], to=b.address, timeout=10)
        assert await t == "ipc"
        assert landed(pl, p, [8, 9], c, [20, 21])
        assert prod._ipc.statistics().pushed == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_no_grants_to_a_producer_without_push_mode() -> None:
    async with push_pair(producer_push=False) as (pl, p, c, a, b, prod, cons):
        await asyncio.sleep(0.1)
        t = await _granted(cons, "r1", [22], a.address)
        await prod.send_request("r1", [10], to=b.address, timeout=10)
        assert await t == "ipc" and landed(pl, p, [10], c, [22])
        assert not prod._ipc.pusher.maps and cons._ipc.statistics().grants == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_consumer_that_comes_after_the_answer_grants_nothing() -> None:
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        send = asyncio.create_task(prod.send_request("r1", [4, 5], to=b.address, timeout=10))
        await asyncio.sleep(0.05)  # the (pull) descriptor is here before the request
        assert await cons.recv_request("r1", [6, 7], frm=a.address, timeout=10) == "ipc"
        await send
        assert landed(pl, p, [4, 5], c, [6, 7])
        assert cons._ipc.statistics().grants == 0 and prod._ipc.statistics().pushed == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_grants_ring_rejects_garbage_and_void_grants() -> None:
    """A record that does not decode is rejected (counted) and the request pulled; a
    grant arriving by the ring for a request already answered by pull is dropped, not
    kept for a later request of the same id."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        t = await _granted(cons, "r0", [2], a.address)  # (tells the abort block)
        await prod.send_request("r0", [3], to=b.address, timeout=10)
        assert await t == "ipc"
        (m,) = cons._ipc.state.maps.values()
        assert m.grant_bell is not None
        m.grant_bell.post(b"\xa3 not a grant")
        # a pull answer first, then its grant by the ring (the consumer's grant is late)
        send = asyncio.create_task(prod.send_request("r1", [4], to=b.address, timeout=10))
        await asyncio.sleep(0.05)
        pm = prod._ipc.pusher.maps[b.address]
        assert "r1" in pm.pulled
        m.grant_bell.post(Grant("r1", 9, (5,), 12345, time.monotonic() + 30).to_ring())
        assert await cons.recv_request("r1", [6], frm=a.address, timeout=10) == "ipc"
        await send
        t = await _granted(cons, "r2", [7], a.address)  # the producer reads the ring again
        await prod.send_request("r2", [8], to=b.address, timeout=10)
        assert await t == "ipc"
        assert prod._ipc.statistics().doorbell_rejected == 1
        assert "r1" not in pm.grants and "r1" not in pm.pulled
        assert prod._ipc.statistics().pushed == 2 and landed(pl, p, [8], c, [7])
        assert landed(pl, p, [4], c, [6])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_restarted_consumer_offers_its_new_export() -> None:
    """A consumer that restarts (a fresh plane on the same engine) answers the next
    descriptor with a ``no_offer`` fallback: the producer drops its mapping of the old
    export too (stale), and after the handshake pushes into the new one."""
    from test_ipc_plane import FakeBackend

    from aiokv.kv.ipc import IpcPlane

    async with push_pair() as (pl, p, c, a, b, prod, cons):
        old = cons._ipc
        old_token = prod._ipc.pusher.maps[b.address].token
        cons._ipc = IpcPlane(cons._port, old.options, backend=FakeBackend())  # the restart
        t = await _granted(cons, "n1", [9], a.address)  # no mapping here: no grant
        await prod.send_request("n1", [5], to=b.address, timeout=10)
        assert await t == "engine" and landed(pl, p, [5], c, [9])
        assert b.address not in prod._ipc.pusher.maps  # the old export is not pushed to
        await _handshake(prod, cons, a, b)
        assert prod._ipc.pusher.maps[b.address].token != old_token
        t = await _granted(cons, "n2", [10, 11], a.address)
        await prod.send_request("n2", [6, 7], to=b.address, timeout=10)
        assert await t == "ipc" and landed(pl, p, [6, 7], c, [10, 11])
        assert cons._ipc.statistics().pushes_received == 1
        assert cons._ipc.statistics().fallbacks == {"no_offer": 1}
        await old.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_push_nobody_granted_is_refused_and_the_request_lands() -> None:
    """A later request of the same id that granted nothing receives a push under the
    earlier, cancelled request's grant (the producer kept it): that copy wrote nothing
    (its abort word is set); the consumer refuses it and the request comes the ordinary
    way (it failed with a protocol error before)."""
    async with push_pair() as (pl, p, c, a, b, prod, cons):
        before = [x.clone() for x in c]
        t = await _granted(cons, "s1", [12, 13], a.address)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        (m,) = cons._ipc.state.maps.values()
        m.can_push = False  # (this consumer grants nothing for the next one)
        t = await _granted(cons, "s1", [14, 15], a.address)
        await prod.send_request("s1", [2, 3], to=b.address, timeout=10)
        assert await t == "engine" and landed(pl, p, [2, 3], c, [14, 15])
        assert torch_equal(blocks(before[0], pl, [12, 13]), blocks(c[0], pl, [12, 13]))
        assert prod._ipc.statistics().pushed == 1
        assert cons._ipc.statistics().fallbacks == {PUSH_REFUSED: 1}
        assert b.address not in prod._ipc.pusher.maps


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_push_that_never_ends_is_counted_unsettled_after_the_grace() -> None:
    """The consumer is cancelled while the producer's push has not ended (its event
    never fires here): it sets the grant's word, waits ``grace_s`` for the event, then
    gives up (``push_unsettled``, logged) and tells the producer the request failed."""
    from test_ipc_plane import FakeEvent

    async with push_pair() as (_pl, _p, _c, a, b, prod, cons):
        t = await _granted(cons, "u1", [16], a.address)
        FakeEvent.fire_after = None  # the producer's event, recorded after its launch
        try:
            send = asyncio.create_task(prod.send_request("u1", [1], to=b.address, timeout=10))
            await asyncio.sleep(0.1)  # the consumer has the descriptor, polls the event
            assert not t.done()
            t.cancel()
            t0 = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await t
            took = time.monotonic() - t0
        finally:
            FakeEvent.fire_after = 0.0
        assert PUSH_OPTS.grace_s - 0.05 <= took < PUSH_OPTS.grace_s + 0.5
        st = cons._ipc.statistics()
        assert st.push_unsettled == 1 and st.aborted == 1 and st.pushes_received == 0
        with pytest.raises(TransferAbortedError):
            await send
        assert "u1" not in cons.finished_receiving()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_cancelled_grant_settles_at_a_pull_answer_and_fails_it() -> None:
    """Cancelled while the producer answers by pull: the grant is settled by that
    answer (no copy will come under it), before the grace period, and the producer
    hears at once that the request failed (not at its lease)."""
    async with push_pair() as (_pl, _p, _c, a, b, prod, cons):
        prod._ipc.pusher.take_grant = lambda *args: None  # (this producer answers by pull)
        t = await _granted(cons, "v1", [17], a.address)
        t.cancel()
        t0 = time.monotonic()
        send = asyncio.create_task(prod.send_request("v1", [3], to=b.address, timeout=10))
        with pytest.raises(asyncio.CancelledError):
            await t
        assert time.monotonic() - t0 < PUSH_OPTS.grace_s
        with pytest.raises(TransferAbortedError):
            await send
        assert time.monotonic() - t0 < 2.0  # the release, not the lease (10 s)
        assert cons._ipc.statistics().push_unsettled == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_prepare_also_hands_the_producer_our_export() -> None:
    """``prepare()`` (the offer-only request) carries the consumer's push offer on its
    release: the producer maps it ahead, so the first request already says it can push
    and the second is pushed."""
    pl = make_layout("fa", "bfloat16", 24)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, opts=PUSH_OPTS)
        try:
            assert await cons.prepare(a.address, timeout=10)
            for _ in range(200):
                if b.address in prod._ipc.pusher.maps:
                    break
                await asyncio.sleep(0.01)
            assert b.address in prod._ipc.pusher.maps
            for i, (src, dst) in enumerate((([1], [2]), ([3], [4]))):
                t = await _granted(cons, f"r{i}", dst, a.address)
                await prod.send_request(f"r{i}", src, to=b.address, timeout=10)
                assert await t == "ipc" and landed(pl, p, src, c, dst)
            st = cons._ipc.statistics()
            assert st.grants == 1 and st.pushes_received == 1 and st.requests_received == 2
        finally:
            await prod.aclose()
            await cons.aclose()


def test_revoke_records_round_trip_and_are_checked() -> None:
    from aiokv.kv.ipc._wire import REVOKE, REVOKED, parse_revoke, revoke_record

    for magic in (REVOKE, REVOKED):
        b = revoke_record(magic, "r-7", 99)
        assert parse_revoke(b, magic) == ("r-7", 99)
        other = REVOKED if magic == REVOKE else REVOKE
        for bad in (b[:-1], b + b"x", bytes((other,)) + b[1:], b[:4] + bytes(8) + b[12:]):
            with pytest.raises(RemoteProtocolError):
                parse_revoke(bad, magic)


@settings(max_examples=300, deadline=None)
@given(b=st.binary(max_size=80))
def test_revoke_garbage_raises_only_the_protocol_error(b: bytes) -> None:
    from aiokv.kv.ipc._wire import REVOKE, parse_revoke

    try:
        parse_revoke(bytes((REVOKE,)) + b, REVOKE)
    except RemoteProtocolError:
        pass


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_grant_revoked_by_the_ring_settles_at_once() -> None:
    """A ring grant whose request is cancelled before the producer sends: once its word
    landed the consumer revokes it by the ring; the producer, holding it untaken, drops
    it and says so, and the cancellation returns at that answer, not after grace_s. The
    producer's later send then has no grant: it is pulled (no push)."""
    async with push_pair() as (_pl, _p, _c, a, b, prod, cons):
        t = await _granted(cons, "r0", [2], a.address)  # (tells the abort block)
        await prod.send_request("r0", [3], to=b.address, timeout=10)
        assert await t == "ipc"
        pm = prod._ipc.pusher.maps[b.address]
        t = await _granted(cons, "k2", [18, 19], a.address)
        assert "k2" in pm.grants  # by the ring, read as it came
        t.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert time.monotonic() - t0 < PUSH_OPTS.grace_s / 2
        assert "k2" not in pm.grants
        with pytest.raises(TransferTimeoutError):  # pulled; the consumer is gone
            await prod.send_request("k2", [5, 6], to=b.address, timeout=0.5)
        assert prod._ipc.statistics().pushed == 1
        (m,) = cons._ipc.state.maps.values()
        assert not m.revoked and cons._ipc.statistics().push_unsettled == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_revoke_for_a_taken_grant_gets_no_answer() -> None:
    """Revoking a grant the producer took already (its push is on its way) is not
    answered: the consumer settles by that push's end, as without the revoke."""
    async with push_pair() as (_pl, _p, _c, a, b, prod, cons):
        t = await _granted(cons, "r0", [2], a.address)
        await prod.send_request("r0", [3], to=b.address, timeout=10)
        assert await t == "ipc"
        pm = prod._ipc.pusher.maps[b.address]
        t = await _granted(cons, "k3", [20], a.address)
        g, _ = prod._ipc.pusher.take_grant("k3", b.address, pm, 1, time.monotonic() + 5)
        from aiokv.kv.ipc._wire import REVOKE, revoke_record

        (m,) = cons._ipc.state.maps.values()
        assert m.grant_bell is not None
        m.grant_bell.post(revoke_record(REVOKE, "k3", g.gid))
        await asyncio.sleep(0.05)
        assert not m.revoked  # nothing answered: the grant was taken
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
