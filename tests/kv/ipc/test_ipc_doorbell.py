"""The IPC plane's doorbell: descriptors through a shared-memory ring, on CPU.

The ring (``aiokv.kv.ipc._doorbell``) on its own -- order, laps, MACs, torn slots, names
and files it refuses -- and the plane with it: the consumer takes a descriptor from
the ring when it waits for it, the engine's copy is dropped, a ring with forged
slots only costs the engine's latency, the ring's name is gone once the consumer
acknowledged, and the option turns it off. CUDA is faked as in test_ipc_plane.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import struct
import subprocess
import sys
import weakref
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kvutil import filled, make_layout
from test_ipc_plane import OPTS, FakeBackend, FakeEvent, connectors, landed, pair, plane_pair

from aiokv import RemoteProtocolError, TransferTimeoutError
from aiokv._runtime.waiter import waiter_for
from aiokv.kv import IpcOptions
from aiokv.kv.ipc import Descriptor, IpcPlane, Offer
from aiokv.kv.ipc import _doorbell as db

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or sys.platform != "linux", reason="needs /dev/shm"
)


# --------------------------------------------------------------------------- the ring


def test_ring_in_order_and_once() -> None:
    w = db.BellWriter()
    try:
        r = db.BellReader(w.name, w.key)
        assert r.poll() == []
        for i in range(5):
            assert w.post(b"m%d" % i)
        assert r.poll() == [b"m0", b"m1", b"m2", b"m3", b"m4"]
        assert r.poll() == []
        assert w.post(b"x" * db.MAX_PAYLOAD)
        assert not w.post(b"x" * (db.MAX_PAYLOAD + 1))  # too large: the engine alone
        assert r.poll() == [b"x" * db.MAX_PAYLOAD]
        r.close()
    finally:
        w.close()
    assert not os.path.exists(os.path.join("/dev/shm", w.name))


def test_ring_lapped_reader_gets_the_newest(writer: db.BellWriter) -> None:
    w = writer
    r = db.BellReader(w.name, w.key)
    for i in range(db.SLOTS + 3):
        w.post(b"%d" % i)
    got = r.poll() + r.poll()
    # messages 0..2 were overwritten by 64..66: lost here (the engine has them); the
    # reader resumes at the oldest still in the ring and keeps the order
    assert got == [b"%d" % i for i in range(3, db.SLOTS + 3)]
    assert r.rejected == 0
    w.post(b"next")
    assert r.poll() == [b"next"]
    r.close()


def test_ring_rejects_a_wrong_key_and_garbage(writer: db.BellWriter) -> None:
    w = writer
    forged = db.BellReader(w.name, secrets.token_bytes(db.KEY_BYTES))
    w.post(b"hello")
    assert forged.poll() == [] and forged.rejected == 1
    # a slot whose sequence number is not one the writer makes
    r = db.BellReader(w.name, w.key)
    w._mm[0:8] = (7).to_bytes(8, "little")  # slot 0 says 7: neither 1 nor 1 + k*SLOTS
    assert r.poll() == [] and r.rejected == 1
    w.post(b"again")  # seq 2, slot 1
    assert r.poll() == [b"again"]
    r.close()
    forged.close()


def test_ring_slot_being_rewritten_is_left_for_later(writer: db.BellWriter) -> None:
    w = writer
    r = db.BellReader(w.name, w.key)
    w.post(b"one")
    w._mm[0:8] = bytes(8)  # the writer's "invalid while rewritten"
    assert r.poll() == [] and r.rejected == 0
    w._mm[0:8] = (1).to_bytes(8, "little")
    assert r.poll() == [b"one"]
    r.close()


def test_reader_refuses_other_names_and_files() -> None:
    key = secrets.token_bytes(db.KEY_BYTES)
    for bad in ("../etc/passwd", "aiokv-bell-xyz", "psm_123", ""):
        with pytest.raises(ValueError):
            db.BellReader(bad, key)
    with pytest.raises(ValueError):
        db.BellReader("aiokv-bell-" + "0" * 32, b"short")
    name = "aiokv-bell-" + secrets.token_hex(16)
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(b"x" * 100)  # not a ring's size
    try:
        with pytest.raises(OSError):
            db.BellReader(name, key)
    finally:
        os.unlink(path)
    with pytest.raises(OSError):
        db.BellReader("aiokv-bell-" + secrets.token_hex(16), key)  # no such file


# --------------------------------------------------------------------------- the offer


def _offer_wire(**over: Any) -> dict[str, Any]:
    from test_ipc_plane import _offer_wire as base

    return base(**over)


def test_offer_doorbell_fields() -> None:
    w = _offer_wire(bell="aiokv-bell-" + "ab" * 16, bell_key=bytes(32))
    off, _ = Offer.from_wire(w)
    assert off.bell == "aiokv-bell-" + "ab" * 16 and off.bell_key == bytes(32)
    assert off.to_wire()["bell"] == off.bell
    plain, _ = Offer.from_wire(_offer_wire())
    assert plain.bell == "" and "bell" not in plain.to_wire()  # older consumers' wire
    for over in (
        {"bell": "../x", "bell_key": bytes(32)},
        {"bell": "aiokv-bell-" + "ab" * 16, "bell_key": bytes(31)},
        {"bell": "aiokv-bell-" + "ab" * 16},
        {"bell_key": bytes(32)},
        {"bell": 5, "bell_key": bytes(32)},
    ):
        with pytest.raises(RemoteProtocolError):
            Offer.from_wire(_offer_wire(**over))


# --------------------------------------------------------------------------- the ring record


_ids = st.lists(st.integers(0, (1 << 32) - 1), max_size=300)


@st.composite
def _descriptors(draw: Any) -> Descriptor:
    src = tuple(draw(_ids))
    return Descriptor(
        rid=draw(st.text(max_size=80)),
        plane="ipc",
        n=len(src),
        reply_to="127.0.0.1:5555",
        token=draw(st.integers(1, (1 << 63) - 1)),
        src=src,
        event=draw(st.binary(min_size=1, max_size=256)),
        event_slot=draw(st.integers(0, 1 << 20)),
        lease=draw(st.floats(allow_nan=False, allow_infinity=False)),
    )


@settings(max_examples=300, deadline=None)
@given(d=_descriptors(), solo=st.booleans())
def test_ring_record_round_trip(d: Descriptor, solo: bool) -> None:
    """A descriptor comes back from its ring record as it went in (the reply address
    is the ring's producer's, not the record's)."""
    assert Descriptor.from_ring(d.to_ring(solo=solo), d.reply_to) == (d, solo)
    got, _ = Descriptor.from_ring(d.to_ring(solo=solo), "10.0.0.1:1")
    assert got.reply_to == "10.0.0.1:1"


@settings(max_examples=300, deadline=None)
@given(d=_descriptors(), cut=st.integers(1, 64), extra=st.binary(min_size=1, max_size=8))
def test_ring_record_of_the_wrong_size_is_refused(d: Descriptor, cut: int, extra: bytes) -> None:
    b = d.to_ring(solo=False)
    for bad in (b[: max(0, len(b) - cut)], b + extra):
        with pytest.raises(RemoteProtocolError):
            Descriptor.from_ring(bad, "127.0.0.1:5555")


def _record(**over: Any) -> bytes:
    f = {"magic": 0xA1, "flags": 0, "n": 2, "slot": 0, "token": 7, "lease": 1.0, "ev": 64}
    f.update(over)
    rid = over.pop("rid", b"r")
    head = struct.pack(
        "<BBHIIQdH", f["magic"], f["flags"], len(rid), f["n"], f["slot"], f["token"],
        f["lease"], f["ev"],
    )  # fmt: skip
    return head + b"e" * f["ev"] + rid + struct.pack(f"<{f['n']}I", *range(f["n"]))


@pytest.mark.parametrize(
    "over",
    [
        {"magic": 0x82},  # (a msgpack map: an older producer's record)
        {"flags": 4},  # (bit 1 says the producer can push)
        {"ev": 0},
        {"ev": 257},
        {"slot": (1 << 20) + 1},
        {"token": 0},
        {"token": 1 << 63},
        {"lease": float("nan")},
        {"lease": float("inf")},
        {"rid": b"\xff\xfe"},
        {"rid": b"x" * 4097},
    ],
)
def test_ring_record_fields_checked(over: dict[str, Any]) -> None:
    assert Descriptor.from_ring(_record(), "127.0.0.1:5555")[0].src == (0, 1)
    with pytest.raises(RemoteProtocolError):
        Descriptor.from_ring(_record(**over), "127.0.0.1:5555")


@settings(max_examples=500, deadline=None)
@given(b=st.binary(max_size=200))
def test_ring_record_garbage_raises_only_the_protocol_error(b: bytes) -> None:
    for x in (b, bytes([0xA1]) + b):
        try:
            Descriptor.from_ring(x, "127.0.0.1:5555")
        except RemoteProtocolError:
            pass


# --------------------------------------------------------------------------- the plane


def _shm_names() -> list[str]:
    return os.listdir("/dev/shm")


async def _move_waiting(prod: Any, cons: Any, a: Any, b: Any, rid: str, src: Any, dst: Any) -> None:
    """The consumer waits before the producer sends (as the doorbell expects)."""
    recv = asyncio.create_task(cons.recv_request(rid, dst, frm=a.address, timeout=10))
    await asyncio.sleep(0.02)
    await prod.send_request(rid, src, to=b.address, timeout=10)
    await recv


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_descriptors_come_by_the_doorbell() -> None:
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    # rings other processes of this host own (other test runs) are not this test's
    before = {n for n in _shm_names() if n.startswith("aiokv-bell-")}
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await _move_waiting(prod, cons, a, b, "d0", [1, 2], [3, 4])  # the offer: engine
        bell = prod._ipc.producer.bells[b.address]
        assert bell is not None
        assert bell.name not in _shm_names()  # gone after the ack
        for i in range(1, 4):
            await _move_waiting(prod, cons, a, b, f"d{i}", [5 + i, 9 + i], [10 + i, 14 + i])
            assert landed(pl, p, [5 + i, 9 + i], c, [10 + i, 14 + i])
        st = cons.statistics().ipc
        assert st is not None and st.doorbell_hits == 3 and st.doorbell_rejected == 0
        assert prod.finished_sending() == {"d0", "d1", "d2", "d3"}
        # the engine's copies of the rung descriptors were dropped, not left in the store
        await asyncio.sleep(0.2)
        for i in range(1, 4):
            with pytest.raises(TransferTimeoutError):
                await b.recv(f"d{i}#ipc", timeout=0.1)
        await prod.aclose()
        await cons.aclose()
    assert not {n for n in _shm_names() if n.startswith("aiokv-bell-")} - before


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_consumer_keeps_its_loops_waiter_between_requests() -> None:
    """The ring's poll is a poll of the loop's waiter while a request waits; between
    requests nothing else may hold that waiter, and one made anew for every request
    cost the request ~8 us. The consumer holds it."""
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        try:
            await _move_waiting(prod, cons, a, b, "k0", [1, 2], [3, 4])  # the offer: engine
            await _move_waiting(prod, cons, a, b, "k1", [5, 6], [7, 8])
            held = weakref.ref(waiter_for())
            gc.collect()
            assert held() is not None
            await _move_waiting(prod, cons, a, b, "k2", [9, 10], [11, 12])
            assert held() is waiter_for()
            st = cons.statistics().ipc
            assert st is not None and st.doorbell_hits == 2
        finally:
            await prod.aclose()
            await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_forged_ring_slots_cost_only_latency() -> None:
    """Slots whose MAC fails (here: the consumer holds another key, as a process that
    guessed the file would) are rejected and counted; the engine delivers."""
    async with plane_pair("mla", "float16", 20) as (pl, p, c, a, b, prod, cons):
        await _move_waiting(prod, cons, a, b, "f0", [1], [2])
        (m,) = cons._ipc.state.maps.values()
        assert m.bell is not None
        m.bell.key = secrets.token_bytes(db.KEY_BYTES)
        await _move_waiting(prod, cons, a, b, "f1", [3, 4], [5, 6])
        assert landed(pl, p, [3, 4], c, [5, 6])
        st = cons.statistics().ipc
        assert st is not None and st.doorbell_hits == 0 and st.doorbell_rejected == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_record_that_does_not_decode_costs_only_latency() -> None:
    """A slot whose MAC verifies but whose record does not decode (a producer's bug, or
    an older producer's msgpack record) is rejected and counted; the engine's copy
    delivers, and nothing was launched from it."""
    async with plane_pair("fa", "float16", 20) as (pl, p, c, a, b, prod, cons):
        await _move_waiting(prod, cons, a, b, "k0", [1], [2])
        real = Descriptor.to_ring
        Descriptor.to_ring = lambda self, *, solo: real(self, solo=solo)[:-1]  # type: ignore[method-assign]
        try:
            await _move_waiting(prod, cons, a, b, "k1", [3, 4], [5, 6])
        finally:
            Descriptor.to_ring = real  # type: ignore[method-assign]
        assert landed(pl, p, [3, 4], c, [5, 6])
        st_ = cons.statistics().ipc
        assert st_ is not None and st_.doorbell_hits == 0 and st_.doorbell_rejected == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_doorbell_off() -> None:
    opts = IpcOptions(trust_unauthenticated=True, grace_s=0.3, doorbell=False)
    async with plane_pair("fa", "float32", 20, opts=opts) as (_pl, _p, _c, a, b, prod, cons):
        for i in range(3):
            await _move_waiting(prod, cons, a, b, f"o{i}", [i + 1], [i + 5])
        st = cons.statistics().ipc
        assert st is not None and st.doorbell_hits == 0
        assert prod._ipc.producer.bells == {} and all(
            m.bell is None for m in cons._ipc.state.maps.values()
        )


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_ring_message_for_another_producer_is_ignored() -> None:
    """A waiter that names its producer (``frm``) takes ring messages of that producer's
    export only; here it names another address, so the ring is ignored and the call
    runs into its deadline (the engine, asked for ``frm``, has nothing either)."""
    async with plane_pair("fa", "bfloat16", 20) as (_pl, _p, _c, a, b, prod, cons):
        await _move_waiting(prod, cons, a, b, "g0", [1], [2])
        recv = asyncio.create_task(cons.recv_request("g1", [3], frm="127.0.0.1:9", timeout=0.5))
        await asyncio.sleep(0.02)
        send = asyncio.create_task(prod.send_request("g1", [4], to=b.address, timeout=0.4))
        with pytest.raises(TransferTimeoutError):
            await recv
        st = cons.statistics().ipc
        assert st is not None and st.doorbell_hits == 0
        with pytest.raises(TransferTimeoutError):
            await send


def _engine_sends(prod: Any) -> list[str]:
    """Record the ids of the control messages the producer's plane sends by the engine."""
    sent: list[str] = []
    plane = prod._ipc
    orig = plane.state.send_msg

    def spy(tid: str, msg: Any, to: str, timeout: float, *wait: Any) -> None:
        sent.append(tid)
        orig(tid, msg, to, timeout, *wait)

    plane.state.send_msg = spy
    return sent


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_ring_alone_once_the_consumer_reads_it() -> None:
    """The engine carries a descriptor too until the consumer's release says it took one
    from the ring; from then on the ring alone does (no engine copy, no backup)."""
    async with plane_pair("fa", "bfloat16", 24) as (pl, p, c, a, b, prod, cons):
        sent = _engine_sends(prod)
        await _move_waiting(prod, cons, a, b, "s0", [1], [2])  # the offer: engine
        await _move_waiting(prod, cons, a, b, "s1", [3], [4])  # engine and ring
        for _ in range(200):  # (s1's release, which says "ring", is sent soon after)
            if b.address in prod._ipc.producer.ring_ok:
                break
            await asyncio.sleep(0.01)
        assert "s1#ipc" in sent and b.address in prod._ipc.producer.ring_ok
        for i in range(2, 6):
            await _move_waiting(prod, cons, a, b, f"s{i}", [4 + i], [10 + i])
            assert landed(pl, p, [4 + i], c, [10 + i])
        assert not any(
            t.startswith(("s2#", "s3#", "s4#", "s5#")) and t.endswith("#ipc") for t in sent
        )
        await asyncio.sleep(0.1)  # past doorbell_backup_s: still no backup was needed
        pst, cst = prod.statistics().ipc, cons.statistics().ipc
        assert pst is not None and cst is not None
        assert pst.doorbell_backups == 0 and cst.doorbell_hits == 5
        assert prod._ipc.producer.ring_only == {b.address: 0}
        assert prod.finished_sending() >= {f"s{i}" for i in range(6)}


@contextlib.asynccontextmanager
async def _ringing(kind: str, dtype: str, **opts: Any) -> Any:
    """Two engines and connectors whose consumer has taken one descriptor from the
    ring (so the producer sends by the ring alone from then on); yields
    ``(layout, producer caches, consumer caches, a, b, prod, cons)``."""
    o = IpcOptions(trust_unauthenticated=True, grace_s=0.3, **opts)
    async with plane_pair(kind, dtype, 24, opts=o) as (pl, p, c, a, b, prod, cons):
        await _move_waiting(prod, cons, a, b, "w0", [1], [2])
        await _move_waiting(prod, cons, a, b, "w1", [3], [4])
        for _ in range(100):
            if b.address in prod._ipc.producer.ring_ok:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the consumer's release never said 'ring'")
        yield pl, p, c, a, b, prod, cons


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_ring_messages_read_early_wait_for_their_request() -> None:
    """A ring message read while another request waited is kept for its own request,
    which takes it when it comes (with a long backup delay, a message dropped on
    reading would leave that request to run into its deadline)."""
    async with _ringing("mla", "float16", doorbell_backup_s=30) as (pl, p, c, a, b, prod, cons):
        first = asyncio.create_task(cons.recv_request("e1", [10], frm=a.address, timeout=5))
        await asyncio.sleep(0.02)
        s2 = asyncio.create_task(prod.send_request("e2", [6], to=b.address, timeout=5))
        await asyncio.sleep(0.05)  # e2's message is read (first is waiting), not taken
        s1 = asyncio.create_task(prod.send_request("e1", [5], to=b.address, timeout=5))
        await first
        await cons.recv_request("e2", [11], frm=a.address, timeout=2)
        await asyncio.gather(s1, s2)
        assert landed(pl, p, [5, 6], c, [10, 11])
        pst, cst = prod.statistics().ipc, cons.statistics().ipc
        assert pst is not None and cst is not None
        assert pst.doorbell_backups == 0 and cst.doorbell_hits == 3


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_lost_ring_message_comes_by_the_engine_backup() -> None:
    """A ring-only descriptor the consumer cannot take (here its MAC fails, as for a
    tampered slot) arrives by the engine after doorbell_backup_s; the consumer's
    release then says "not by the ring" and the producer sends by both again."""
    async with _ringing("fi", "bfloat16", doorbell_backup_s=0.1) as (pl, p, c, a, b, prod, cons):
        (m,) = cons._ipc.state.maps.values()
        assert m.bell is not None
        m.bell.key = secrets.token_bytes(db.KEY_BYTES)
        sent = _engine_sends(prod)
        await _move_waiting(prod, cons, a, b, "l1", [7, 8], [12, 13])
        assert landed(pl, p, [7, 8], c, [12, 13])
        pst, cst = prod.statistics().ipc, cons.statistics().ipc
        assert pst is not None and cst is not None
        assert pst.doorbell_backups == 1 and sent.count("l1#ipc") == 1
        assert cst.doorbell_rejected == 1
        await asyncio.sleep(0.05)
        assert b.address not in prod._ipc.producer.ring_ok
        await _move_waiting(prod, cons, a, b, "l2", [9], [14])
        assert "l2#ipc" in sent  # at once, beside the ring


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_late_backup_is_not_taken_for_a_new_request(monkeypatch: Any) -> None:
    """The consumer takes a ring-only descriptor at once, but the producer's event fires
    only later, so no release comes before doorbell_backup_s and the engine's backup
    copy lands after the consumer dropped what was there. A new request of the same id
    must not take that stale copy (it would read the old request's blocks)."""
    async with _ringing("fa", "float32", doorbell_backup_s=0.05) as (pl, p, c, a, b, prod, cons):
        monkeypatch.setattr(FakeEvent, "fire_after", 0.3)
        await _move_waiting(prod, cons, a, b, "r", [5], [15])  # by the ring; backup late
        monkeypatch.setattr(FakeEvent, "fire_after", 0.0)
        pst = prod.statistics().ipc
        assert pst is not None and pst.doorbell_backups == 1
        assert landed(pl, p, [5], c, [15])
        await asyncio.sleep(0.1)  # the backup has landed by now
        # the same id again: this must be the new send's descriptor, not the stale one
        await _move_waiting(prod, cons, a, b, "r", [6], [16])
        assert landed(pl, p, [6], c, [16])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_wake_fifo_brings_a_waiting_consumer_at_once(monkeypatch: Any) -> None:
    """With no spinning and the timed poll pushed out to 5 s, only the wake FIFO can
    bring the ring's descriptor to the consumer before its 2 s deadline."""
    from aiokv.kv.ipc import _inbox as ipcmod

    ring = _ringing("fa", "bfloat16", doorbell_spin_s=0, doorbell_backup_s=30)
    async with ring as (pl, p, c, a, b, prod, cons):
        monkeypatch.setattr(ipcmod, "_BELL_POLL_WAKE_S", 5.0)
        monkeypatch.setattr(ipcmod, "_BELL_POLL_S", 5.0)
        (m,) = cons._ipc.state.maps.values()
        assert m.bell is not None and m.bell.wake_fd >= 0
        for i in range(3):
            recv = asyncio.create_task(
                cons.recv_request(f"k{i}", [10 + i], frm=a.address, timeout=2)
            )
            await asyncio.sleep(0.05)  # the consumer's loop sleeps in its timed poll
            await prod.send_request(f"k{i}", [5 + i], to=b.address, timeout=2)
            await recv
        assert landed(pl, p, [5, 6, 7], c, [10, 11, 12])
        pst = prod.statistics().ipc
        assert pst is not None and pst.doorbell_backups == 0


@pytest.fixture
def writer() -> Any:
    w = db.BellWriter()
    yield w
    w.close()


def test_wake_fifo(writer: db.BellWriter) -> None:
    import select

    w = writer
    assert not w.open_wake()  # no reader has it open
    r = db.BellReader(w.name, w.key)
    assert r.wake_fd >= 0 and w.open_wake()
    w.unlink()
    assert not any(n.startswith(w.name) for n in os.listdir(db._DIR))
    assert select.select([r.wake_fd], [], [], 0)[0] == []
    for i in range(3):
        w.post(b"%d" % i)
    assert select.select([r.wake_fd], [], [], 1)[0] == [r.wake_fd]
    assert r.drain_wake() and select.select([r.wake_fd], [], [], 0)[0] == []
    assert r.poll() == [b"0", b"1", b"2"]
    w.close()  # the writer is gone: end of file
    assert select.select([r.wake_fd], [], [], 1)[0] == [r.wake_fd]
    assert not r.drain_wake()
    r.close()
    assert r.wake_fd == -1


def test_a_wake_path_that_is_no_fifo_is_not_watched(writer: db.BellWriter) -> None:
    os.unlink(writer._path + ".wake")
    with open(writer._path + ".wake", "wb") as f:  # a regular file (always "readable")
        f.write(b"x")
    r = db.BellReader(writer.name, writer.key)
    assert r.wake_fd == -1  # the ring is still read, on the timer
    writer.post(b"m")
    assert r.poll() == [b"m"]
    r.close()


def test_doorbell_backup_option_checked() -> None:
    from aiokv import ConfigError

    for bad in (0, -1, 61, "x"):
        with pytest.raises(ConfigError):
            IpcOptions(doorbell_backup_s=bad)  # type: ignore[arg-type]


def test_doorbell_spin_option_checked() -> None:
    from aiokv import ConfigError

    for bad in (-1, 2, "x"):
        with pytest.raises(ConfigError):
            IpcOptions(doorbell_spin_s=bad)  # type: ignore[arg-type]
    assert OPTS.doorbell and IpcOptions(doorbell_spin_s=0).doorbell_spin_s == 0


# ---------------------------------------------------------------- a hostile producer's file


@pytest.mark.timeout(20)
def test_a_fifo_named_as_the_ring_is_refused_without_blocking() -> None:
    """The producer names the file: a FIFO of a valid name must not block the consumer's
    loop in open() (waiting for a writer that never comes)."""
    name = "aiokv-bell-" + secrets.token_hex(16)
    path = os.path.join(db._DIR, name)
    os.mkfifo(path, 0o600)
    try:
        code = subprocess.run(
            [sys.executable, "-c", _READ.format(name=name, key=secrets.token_hex(db.KEY_BYTES))],
            timeout=10,
            capture_output=True,
            text=True,
        )
        assert code.returncode == 0, code.stderr
        assert "refused" in code.stdout, code.stdout
    finally:
        os.unlink(path)


@pytest.mark.timeout(20)
def test_a_ring_truncated_under_the_reader_does_not_kill_it() -> None:
    """A producer can shrink its file after the consumer opened it: reading a mapping past
    the file's end is SIGBUS, which kills the process. The reader must see no messages
    (and the engine copy still comes) instead."""
    w = db.BellWriter()
    try:
        w.post(b"before")
        script = _TRUNCATE.format(name=w.name, key=w.key.hex(), path=w._path)
        code = subprocess.run(
            [sys.executable, "-c", script], timeout=10, capture_output=True, text=True
        )
        assert code.returncode == 0, (code.returncode, code.stderr)
        assert code.stdout.split() == ["1", "0"], code.stdout
    finally:
        w.close()


_READ = """
import aiokv.kv.ipc._doorbell as db
try:
    db.BellReader({name!r}, bytes.fromhex({key!r}))
except (OSError, ValueError) as exc:
    print("refused", type(exc).__name__)
"""

_TRUNCATE = """
import os
import aiokv.kv.ipc._doorbell as db
r = db.BellReader({name!r}, bytes.fromhex({key!r}))
print(len(r.poll()))
os.truncate({path!r}, 0)
print(len(r.poll()))
r.close()
"""


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_restarted_consumer_is_offered_the_export_again() -> None:
    """A consumer that restarts (here: a fresh plane on the same engine) no longer knows
    the producer's export and answers the next descriptor with a ``no_offer`` fallback.
    That request goes the ordinary way; the next one carries the offer again and the
    plane is used again (regression: the producer sent that consumer everything the
    ordinary way from then on)."""
    async with _ringing("fa", "bfloat16", doorbell_backup_s=0.05) as (pl, p, c, a, b, prod, cons):
        old = cons._ipc
        cons._ipc = IpcPlane(cons._port, old.options, backend=FakeBackend())  # the restart
        await _move_waiting(prod, cons, a, b, "n1", [5], [9])  # no_offer: the ordinary way
        assert landed(pl, p, [5], c, [9])
        await _move_waiting(prod, cons, a, b, "n2", [6], [10])
        await _move_waiting(prod, cons, a, b, "n3", [7], [11])
        assert landed(pl, p, [6, 7], c, [10, 11])
        cst, pst = cons.statistics().ipc, prod.statistics().ipc
        assert cst is not None and pst is not None
        assert cst.fallbacks == {"no_offer": 1}
        assert cst.mappings_verified == 1 and cst.requests_received == 2
        assert b.address not in prod._ipc.producer.broken_to
        await old.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_hostile_records_in_a_live_ring_cost_only_latency() -> None:
    """MAC-valid slots (the key holder's bytes) that are not records -- random bytes, cut
    or padded records, another magic -- and well-formed records of requests nobody
    waits for, posted into the ring ahead of each real record: the waiting request
    still lands (by the ring, or by the engine's backup), every bad slot is counted, the
    records kept for later requests stay bounded, and the ring's poll keeps running."""
    import random

    rnd = random.Random(7)
    loop = asyncio.get_running_loop()
    failed: list[Any] = []  # the waiter reports a poll that raised (it drops that poll)
    loop.set_exception_handler(lambda _loop, ctx: failed.append(ctx))
    async with _ringing("fa", "bfloat16") as (pl, p, c, a, b, prod, cons):
        bell = prod._ipc.producer.bells[b.address]
        assert bell is not None
        (m,) = cons._ipc.state.maps.values()
        real = Descriptor(
            rid="x", plane="ipc", n=2, reply_to=a.address, token=m.token, src=(1, 2),
            event=b"e" * 64, event_slot=0, lease=1.0,
        ).to_ring(solo=True)  # fmt: skip
        bad = 0
        for i in range(4):
            before = cons.statistics().ipc.doorbell_rejected  # type: ignore[union-attr]
            recv = asyncio.create_task(
                cons.recv_request(f"h{i}", [10 + i, 15 + i], frm=a.address, timeout=10)
            )
            await asyncio.sleep(0.01)
            junk = [rnd.randbytes(rnd.randrange(0, 200)) for _ in range(10)]
            junk += [real[: rnd.randrange(len(real))] for _ in range(10)]
            junk += [real + rnd.randbytes(rnd.randrange(1, 9)) for _ in range(10)]
            junk += [bytes([0x82]) + real[1:]]
            for x in junk:
                assert bell.post(x)
            bad += len(junk)
            for k in range(40):  # well-formed, for requests that never wait
                other = Descriptor(
                    rid=f"nobody-{i}-{k}", plane="ipc", n=1, reply_to=a.address,
                    token=m.token, src=(3,), event=b"e" * 64, event_slot=k, lease=1.0,
                )  # fmt: skip
                assert bell.post(other.to_ring(solo=True))
                if k % 10 == 9:
                    await asyncio.sleep(0)  # (the consumer reads; the ring holds 64)
            await prod.send_request(f"h{i}", [4 + i, 9 + i], to=b.address, timeout=10)
            assert await recv == "ipc"
            assert landed(pl, p, [4 + i, 9 + i], c, [10 + i, 15 + i])
            after = cons.statistics().ipc.doorbell_rejected  # type: ignore[union-attr]
            assert after - before == len(junk)
        assert len(m.pending) <= 2 * db.SLOTS
        loop.set_exception_handler(None)
        assert not failed, failed  # the ring's poll never ended by an error
        assert cons.statistics().ipc.doorbell_rejected == bad  # type: ignore[union-attr]
