"""ReceiveStore: byte budget, per-peer namespacing, duplicates, TTL, put_back, peer loss."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiokv
from aiokv.engine.store import PeerRef, ReceiveStore

pytestmark = pytest.mark.timeout(60)

P = PeerRef("engine-p", "10.0.0.1:1")
Q = PeerRef("engine-q", "10.0.0.2:1")


def _consistent(s: ReceiveStore) -> None:
    pending = sum(n for per in s._pending.values() for n in per.values())
    held = sum(e.nbytes for per in s._entries.values() for e in per.values())
    assert (s.reserved, s.held) == (pending, held)
    assert 0 <= s.used <= s.capacity
    assert s.peak <= s.capacity
    n_pending = sum(len(per) for per in s._pending.values())
    landed = [(t, eid) for t, per in s._entries.items() for eid in per]
    assert s.pending_n == n_pending
    assert sorted(s._landed) == sorted(landed)
    # no empty inner index; a doomed tensor is pending; who is pending is known, and how often
    assert all(s._entries.values()) and all(s._pending.values())
    assert all(eid in s._pending.get(t, {}) for t, eid in s._doomed)
    per_peer: dict[str, int] = {}
    for per in s._pending.values():
        for eid in per:
            per_peer[eid] = per_peer.get(eid, 0) + 1
    assert s._peer_pending == per_peer and set(s._peers) == set(per_peer)
    assert s.count <= s.max_tensors
    deadlines = [e.expires for e in s._landed.values()]
    assert deadlines == sorted(deadlines)  # landing order is expiry order


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["reserve", "land", "take", "cancel", "expire", "lost", "discard", "put1", "put2"]
        ),
        st.sampled_from([P, Q]),
        st.integers(0, 5),  # tensor id
        st.integers(0, 400),  # size
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_budget_never_exceeded(seq: list[tuple[str, PeerRef, int, int]]) -> None:
    s = ReceiveStore(capacity=1000, ttl=5.0, max_tensors=6)
    now = 0.0
    for op, peer, i, n in seq:
        tid = f"r{i % 2}#{i}"
        if op == "reserve":
            try:
                fitted = s.try_reserve(peer, [(tid, n), (tid + "b", n // 2)])
            except aiokv.DuplicateTensorError:
                fitted = None
            if fitted is False:
                assert s.used + n + n // 2 > s.capacity or s.count + 2 > s.max_tensors
        elif op in ("put1", "put2"):  # a PUT: reserved and landed in one step
            items = [(tid, n, n)] if op == "put1" else [(tid, n, n), (tid + "b", n // 2, n)]
            before = (s.used, s.count, s.held)
            try:
                fitted = s.try_land(peer, items)
            except aiokv.DuplicateTensorError:
                assert (s.used, s.count, s.held) == before  # a refused PUT claims nothing
                fitted = None
            if fitted is False:
                total = sum(x[1] for x in items)
                assert s.used + total > s.capacity or s.count + len(items) > s.max_tensors
                assert (s.used, s.count, s.held) == before
            elif fitted:
                assert s.held == before[2] + sum(x[1] for x in items)
        elif op == "land":
            try:
                s.land(peer, tid, n)
            except aiokv.TransferAbortedError:
                pass
        elif op == "take":
            try:
                s.take_nowait(tid, peer.address)
            except (KeyError, aiokv.ExpiredError):
                pass
        elif op == "cancel":
            s.cancel(peer, [tid, tid + "b"], None)
        elif op == "expire":
            now += 3.0
            s.expire(time.monotonic() + now)
        elif op == "discard":
            s.discard(tid if n % 2 else f"r{i % 2}#")
        else:
            s.peer_lost(peer, aiokv.PeerLostError("x"))
        _consistent(s)


def test_reserve_refuses_when_full_and_counts_peak() -> None:
    s = ReceiveStore(capacity=100, ttl=10)
    assert s.try_reserve(P, [("a", 60)])
    assert not s.try_reserve(P, [("b", 41)])
    assert "b" not in s._entries  # a refused reservation claims nothing
    assert s.try_reserve(P, [("b", 40)])
    assert s.used == s.peak == 100
    s.land(P, "a", "A")
    assert s.take_nowait("a", None) == (P, "A")
    assert s.used == 40 and s.peak == 100
    st_ = s.statistics()
    assert (
        st_.reserved_bytes,
        st_.held_bytes,
        st_.pending_tensors,
        st_.held_tensors,
        st_.collected,
    ) == (40, 0, 1, 0, 1)


def test_duplicates_refused_and_ids_namespaced_per_peer() -> None:
    s = ReceiveStore(capacity=1000, ttl=10)
    assert s.try_reserve(P, [("x", 10)])
    with pytest.raises(aiokv.DuplicateTensorError):  # pending
        s.try_reserve(P, [("x", 10)])
    with pytest.raises(aiokv.DuplicateTensorError):  # one id of several
        s.try_reserve(P, [("y", 1), ("x", 1)])
    assert "y" not in s._entries
    assert s.try_reserve(Q, [("x", 10)])  # same id from another peer: fine
    s.land(P, "x", "from-p")
    with pytest.raises(aiokv.DuplicateTensorError):  # held, not collected
        s.try_reserve(P, [("x", 10)])
    assert s.take_nowait("x", P.address) == (P, "from-p")  # never overwritten
    assert s.try_reserve(P, [("x", 10)])  # collected: the id is free again
    with pytest.raises(aiokv.TransferAbortedError):
        s.land(Q, "nope", 1)  # landing without a reservation
    s.land(Q, "x", "from-q")
    with pytest.raises(aiokv.TransferAbortedError):
        s.land(Q, "x", "again")  # landing twice


@pytest.mark.anyio
async def test_ttl_expiry_raises_expired_on_late_collect() -> None:
    s = ReceiveStore(
        capacity=1000, ttl=0.05, resolve_peer=lambda a: P.engine_id if a == P.address else None
    )
    for tid in ("a", "b", "c"):
        s.try_reserve(P, [(tid, 10)])
        s.land(P, tid, tid.upper())
    assert s.expire() == 0  # not yet
    await asyncio.sleep(0.1)
    assert s.expire() == 30
    assert s.held == 0 and s.statistics().expired == 3
    with pytest.raises(aiokv.ExpiredError):
        s.take_nowait("a", None)
    with pytest.raises(aiokv.ExpiredError):
        s.take_nowait("b", P.address)  # by address
    with pytest.raises(aiokv.ExpiredError):
        await asyncio.wait_for(s.wait_future("c", P.engine_id), 2)  # by engine id
    with pytest.raises(KeyError):
        s.take_nowait("never-sent", None)
    # the id may be used again after expiry: new data, never the stale one
    s.try_reserve(P, [("a", 10)])
    s.land(P, "a", "NEW")
    assert s.take_nowait("a", None) == (P, "NEW")


@pytest.mark.anyio
async def test_waiter_gets_tensor_on_land_and_put_back_returns_it() -> None:
    s = ReceiveStore(capacity=100, ttl=10)
    fut = s.wait_future("a", None)
    assert not fut.done()
    s.try_reserve(P, [("a", 30)])
    s.land(P, "a", "A")
    assert fut.result() == (P, "A")
    assert s.used == 0
    # the collector was cancelled after the hand-over: put it back
    s.put_back("a", P, "A", 30)
    assert s.held == 30 and s.statistics().held_tensors == 1
    assert s.take_nowait("a", None) == (P, "A")
    # put back while somebody else waits: the waiter gets it at once
    fut2 = s.wait_future("b", P.address)
    s.put_back("b", P, "B", 5)
    assert fut2.result() == (P, "B") and s.held == 0
    _consistent(s)


@pytest.mark.anyio
async def test_waiter_from_other_peer_is_not_served() -> None:
    s = ReceiveStore(capacity=100, ttl=10)
    fut = s.wait_future("a", Q.address)
    s.try_reserve(P, [("a", 1)])
    s.land(P, "a", "from-p")
    assert not fut.done()
    s.forget_waiter("a", fut)
    assert s.take_nowait("a", None) == (P, "from-p")


@pytest.mark.anyio
async def test_peer_lost_fails_waiters_and_frees_room() -> None:
    s = ReceiveStore(capacity=100, ttl=10)
    s.try_reserve(P, [("landed", 10), ("pending", 20)])
    s.try_reserve(Q, [("q", 30)])
    s.land(P, "landed", "L")
    w_pending = s.wait_future("pending", None)
    w_q = s.wait_future("q", None)
    s.peer_lost(P, aiokv.PeerLostError("gone"))
    with pytest.raises(aiokv.PeerLostError):
        w_pending.result()
    assert not w_q.done()  # the other peer's transfer is untouched
    assert s.reserved == 30 and s.held == 10
    assert s.take_nowait("landed", None) == (P, "L")  # what already landed stays collectable
    s.cancel(Q, ["q"], None)  # cancel without an error leaves the waiter waiting
    assert not w_q.done() and s.used == 0
    s.fail_all(aiokv.EngineClosedError("closed"))
    with pytest.raises(aiokv.EngineClosedError):
        w_q.result()


@pytest.mark.anyio
async def test_many_waiters_same_id_different_peers(anyio_backend: Any) -> None:
    s = ReceiveStore(capacity=100, ttl=10)
    fp, fq = s.wait_future("x", P.address), s.wait_future("x", Q.address)
    s.try_reserve(Q, [("x", 1)])
    s.try_reserve(P, [("x", 1)])
    s.land(Q, "x", "q")
    s.land(P, "x", "p")
    assert fp.result() == (P, "p") and fq.result() == (Q, "q")
    assert s.used == 0 and not s._waiters
