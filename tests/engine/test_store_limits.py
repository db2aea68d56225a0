"""Hostile inputs 3 and 11 (store part): the receive store counts tensors, expires cheaply,
and drops what a consumer will never collect.

Item 11: zero-byte tensors used no budget, so 100 RESERVEs x 8,000 empty tensors grew a victim
by ~430 MiB, and ``expire()`` scanned every entry on every housekeeping tick (264 ms). Item 3:
chunks of a cancelled request stayed in the store until their TTL (120 s), counting against the
budget; :meth:`ReceiveStore.discard` drops them at once.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

import aiokv
from aiokv.engine.store import PeerRef, ReceiveStore

pytestmark = pytest.mark.timeout(60)

P = PeerRef("engine-p", "10.0.0.1:1")
Q = PeerRef("engine-q", "10.0.0.2:1")


# --------------------------------------------------------------------------- item 11


def test_pending_reservations_add_nothing_for_the_cyclic_collector() -> None:
    # peers holding tens of thousands of granted empty tensors must not lengthen the full
    # collections that pause the engine's loop: a pending tensor is no tracked object
    s = ReceiveStore(capacity=1 << 30, ttl=60.0, max_tensors=1 << 20)
    gc.collect()
    before = len(gc.get_objects())
    for peer in [PeerRef(f"e{k}", f"10.0.0.{k}:1") for k in range(10)]:
        for x in range(40):
            assert s.try_reserve(peer, [(f"s{x}.{j}", 0) for j in range(64)])
    gc.collect()
    assert s.statistics().pending_tensors == 25_600
    assert len(gc.get_objects()) - before < 100  # (as objects: two per tensor, 51,200)
    s.cancel(PeerRef("e0", "10.0.0.0:1"), [f"s0.{j}" for j in range(64)], None)
    assert s.statistics().pending_tensors == 25_600 - 64


def test_zero_byte_tensors_are_bounded_by_the_tensor_count() -> None:
    s = ReceiveStore(capacity=1 << 30, ttl=60.0, max_tensors=1000)
    granted = 0
    for r in range(100):  # the hostile pattern, scaled: many RESERVEs of many empty tensors
        if s.try_reserve(P, [(f"r{r}-{i}", 0) for i in range(80)]):
            granted += 1
    assert granted == 12  # 12 x 80 = 960 <= 1000 < 13 x 80
    assert s.count == 960 and s.used == 0
    st = s.statistics()
    assert (st.pending_tensors, st.held_tensors, st.max_tensors) == (960, 0, 1000)
    # landing keeps the count; collecting frees it
    s.land(P, "r0-0", "x")
    assert s.count == 960 and s.statistics().held_tensors == 1
    assert not s.try_reserve(P, [(f"n{i}", 0) for i in range(41)])
    s.take_nowait("r0-0", None)
    assert s.try_reserve(P, [(f"n{i}", 0) for i in range(41)])
    assert s.count == 1000


def test_limits_store_tensors_is_validated() -> None:
    assert aiokv.Limits().store_tensors >= aiokv.Limits().max_tensors_per_transfer
    with pytest.raises(aiokv.ConfigError):
        aiokv.Limits(store_tensors=0)
    with pytest.raises(aiokv.ConfigError):  # one transfer could never fit: it would wait forever
        aiokv.Limits(store_tensors=100, max_tensors_per_transfer=101)
    assert aiokv.Limits(store_tensors=100, max_tensors_per_transfer=100).store_tensors == 100


def _full_store(n: int) -> ReceiveStore:
    s = ReceiveStore(capacity=1 << 40, ttl=3600.0, max_tensors=n)
    tids = [f"t{i}" for i in range(n)]
    assert s.try_reserve(P, [(t, 0) for t in tids])
    for t in tids:
        s.land(P, t, None)
    return s


def test_expire_with_nothing_expired_does_not_scan() -> None:
    """100k held tensors, none due: expire() looks at one (the old code scanned all 100k)."""
    s = _full_store(100_000)
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        assert s.expire() == 0
        best = min(best, time.perf_counter() - t0)
    assert best < 0.5e-3, f"expire() over 100k held tensors took {best * 1e3:.2f} ms"
    assert s.statistics().held_tensors == 100_000


def test_expire_pops_only_what_is_due_in_landing_order() -> None:
    s = ReceiveStore(capacity=1000, ttl=10.0)
    s.try_reserve(P, [("a", 1), ("b", 2), ("c", 4)])
    s.land(P, "a", "A")
    s.land(P, "b", "B")
    t_b = s._landed[("b", P.engine_id)].expires
    s.land(P, "c", "C")
    assert s.expire(t_b) == 3  # a and b are due, c is not
    assert s.statistics().expired == 2 and s.held == 4
    assert s.take_nowait("c", None) == (P, "C")
    with pytest.raises(aiokv.ExpiredError):
        s.take_nowait("a", None)


@pytest.mark.anyio
async def test_put_back_goes_to_the_end_of_the_expiry_order() -> None:
    s = ReceiveStore(capacity=1000, ttl=10.0)
    s.try_reserve(P, [("a", 1), ("b", 1)])
    s.land(P, "a", "A")
    s.land(P, "b", "B")
    peer, v = s.take_nowait("a", None)
    s.put_back("a", peer, v, 1)  # a collector was cancelled after the hand-over
    assert list(s._landed) == [("b", P.engine_id), ("a", P.engine_id)]
    assert s.expire(s._landed[("b", P.engine_id)].expires) == 1
    assert s.take_nowait("a", None) == (P, "A")


# --------------------------------------------------------------------------- item 3


@pytest.mark.anyio
async def test_discard_drops_held_now_and_in_flight_when_it_lands() -> None:
    s = ReceiveStore(capacity=1000, ttl=120.0)
    assert s.try_reserve(P, [("req#kv0", 100), ("req#kv1", 200), ("req#kv2", 300)])
    assert s.try_reserve(Q, [("req#kv0", 10), ("other#kv0", 50), ("req#kvX", 1)])
    s.land(P, "req#kv0", "P0")
    waiter = s.wait_future("req#kv1", None)  # someone still waiting for an in-flight chunk
    assert s.discard("req#") == 5  # P: kv0 held, kv1 + kv2 in flight; Q: kv0 + kvX in flight
    assert s.held == 0 and s.statistics().held_tensors == 0
    with pytest.raises(aiokv.TransferAbortedError):
        await asyncio.wait_for(waiter, 1)
    # in flight: still reserved (the data is on its way) until it lands, then dropped
    assert s.reserved == 200 + 300 + 10 + 50 + 1
    assert s.discard("req#") == 0  # already doomed: not counted twice
    s.land(P, "req#kv1", "P1")
    s.land(P, "req#kv2", "P2")
    s.land(Q, "req#kv0", "Q0")
    s.cancel(Q, ["req#kvX"], None)
    assert s.reserved == 50 and s.held == 0 and s.count == 1
    for tid in ("req#kv0", "req#kv1", "req#kv2"):
        with pytest.raises(KeyError):  # gone, not "expired": nothing stale is ever returned
            s.take_nowait(tid, None)
    # another request is untouched; a later tensor under a discarded id is a new tensor
    s.land(Q, "other#kv0", "O")
    assert s.take_nowait("other#kv0", None) == (Q, "O")
    assert s.try_reserve(P, [("req#kv0", 100)])
    s.land(P, "req#kv0", "NEW")
    assert s.take_nowait("req#kv0", None) == (P, "NEW")
    assert s.statistics().discarded == 5


def test_discard_exact_id_does_not_match_longer_ids() -> None:
    s = ReceiveStore(capacity=1000, ttl=120.0)
    s.try_reserve(P, [("r#kv1", 1), ("r#kv10", 1), ("r#kv1#x", 1)])
    for t in ("r#kv1", "r#kv10", "r#kv1#x"):
        s.land(P, t, t)
    assert s.discard("r#kv1") == 1
    assert s.discard("nothing") == 0 and s.discard("zzz#") == 0
    assert sorted(s._entries) == ["r#kv1#x", "r#kv10"]
    assert s.discard("r#kv1#") == 1
    assert sorted(s._entries) == ["r#kv10"]


@pytest.mark.parametrize("bad", ["", None, 5, b"r#"])
def test_discard_refuses_non_ids(bad: object) -> None:
    s = ReceiveStore(capacity=10, ttl=1.0)
    with pytest.raises(aiokv.ConfigError):
        s.discard(bad)  # type: ignore[arg-type]


def test_a_transfer_over_the_count_budget_still_fits_an_empty_store() -> None:
    """No transfer waits forever: one larger than the count budget goes when the store is
    empty of tensors (its size is bounded by the wire limit on tensors per transfer)."""
    s = ReceiveStore(capacity=1 << 20, ttl=60.0, max_tensors=10)
    assert s.try_reserve(P, [("x", 0)])
    assert not s.try_reserve(Q, [(f"big{i}", 0) for i in range(11)])  # waits for credit
    s.cancel(P, ["x"], None)
    assert s.try_reserve(Q, [(f"big{i}", 0) for i in range(11)])
    assert not s.try_reserve(P, [("y", 0)])  # and nothing else until it is gone
