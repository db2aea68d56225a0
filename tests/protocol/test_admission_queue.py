"""The receiver's queue of reservations waiting for room (aiokv.protocol.admission),
without sockets: random operation sequences against a plain reference model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.protocol.admission import AdmissionQueue, PeerBounds, PeerQueue

pytestmark = pytest.mark.timeout(60)


@dataclass
class Item:
    xfer: int
    size: int


@dataclass
class Model:
    """The rules stated plainly: a list per session, the oldest fitting head first."""

    queues: dict[int, list[tuple[int, Item]]] = field(default_factory=dict)  # s -> [(arrival, it)]
    arrivals: int = 0

    def add(self, s: int, it: Item) -> None:
        self.queues.setdefault(s, []).append((self.arrivals, it))
        self.arrivals += 1

    def withdraw(self, s: int, xfer: int) -> Item | None:
        q = self.queues.get(s, [])
        for i, (_, it) in enumerate(q):
            if it.xfer == xfer:
                del q[i]
                return it
        return None

    def close(self, s: int) -> list[Item]:
        return [it for _, it in self.queues.pop(s, [])]

    def pump(self, room: list[int]) -> list[tuple[int, int]]:
        out = []
        stuck: set[int] = set()
        while True:
            heads = [(q[0][0], s) for s, q in self.queues.items() if q and s not in stuck]
            if not heads:
                return out
            _, s = min(heads)
            it = self.queues[s][0][1]
            if it.size <= room[0]:
                room[0] -= it.size
                self.queues[s].pop(0)
                out.append((s, it.xfer))
            else:
                stuck.add(s)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 10)),
        st.tuples(st.just("withdraw"), st.integers(0, 3), st.integers(0, 5)),
        st.tuples(st.just("pump"), st.integers(0, 25), st.just(0)),
        st.tuples(st.just("close"), st.integers(0, 3), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_queue_matches_the_reference_model(seq: list[tuple[str, int, int]]) -> None:
    aq: AdmissionQueue[Item] = AdmissionQueue()
    peers: dict[int, PeerQueue[Item]] = {}
    model = Model()
    room_real, room_model = [0], [0]
    next_xfer = 0
    for op, a, b in seq:
        if op == "add":
            q = peers.get(a)
            if q is None or q.closed:
                q = peers[a] = PeerQueue(owner=a)
                model.queues.pop(a, None)
            next_xfer += 1
            it = Item(next_xfer, b)
            aq.add(q, it.xfer, it, [f"t{it.xfer}"])
            model.add(a, it)
            assert q.claims_any([f"t{it.xfer}"])
        elif op == "withdraw":
            q = peers.get(a)
            mq = model.queues.get(a, [])
            if q is None or not mq:
                continue
            xfer = mq[b % len(mq)][1].xfer
            got = aq.withdraw(q, xfer)
            want = model.withdraw(a, xfer)
            assert got is want
            assert not q.claims_any([f"t{xfer}"])
            assert aq.withdraw(q, xfer) is None  # a second withdrawal finds nothing
        elif op == "close":
            q = peers.get(a)
            if q is None or q.closed:
                continue
            assert aq.close(q) == model.close(a)
            assert not q and q.closed and not q.ids
        else:
            room_real[0] += a
            room_model[0] += a

            def grant(q: PeerQueue[Item], it: Item) -> bool:
                if it.size > room_real[0]:
                    return False
                room_real[0] -= it.size
                return True

            got = [(q.owner, xfer) for q, xfer, _ in aq.pump(grant)]
            assert got == model.pump(room_model)
            assert room_real == room_model
        live = {s: q for s, q in peers.items() if not q.closed}
        assert aq.queued == sum(len(q) for q in live.values())
        assert aq.queued == sum(len(q) for s, q in model.queues.items() if s in live)
        for s, q in live.items():
            assert [it.xfer for it in q] == [it.xfer for _, it in model.queues.get(s, [])]


def test_a_large_head_never_blocks_another_session() -> None:
    aq: AdmissionQueue[Item] = AdmissionQueue()
    big, small = PeerQueue[Item](owner="big"), PeerQueue[Item](owner="small")
    aq.add(big, 1, Item(1, 1000), ["a"])
    aq.add(big, 2, Item(2, 1), ["b"])  # behind its own session's head: waits
    aq.add(small, 1, Item(1, 1), ["a"])  # the same id in another session is fine
    room = [5]

    def grant(q: PeerQueue[Item], it: Item) -> bool:
        if it.size > room[0]:
            return False
        room[0] -= it.size
        return True

    assert [(q.owner, x) for q, x, _ in aq.pump(grant)] == [("small", 1)]
    assert len(big) == 2 and aq.queued == 2
    room[0] = 2000
    assert [(q.owner, x) for q, x, _ in aq.pump(grant)] == [("big", 1), ("big", 2)]


def test_withdrawals_stay_cheap_with_a_long_queue() -> None:
    """Withdrawing from a queue of 20,000 must not rebuild anything (hostile input 14)."""
    import time

    aq: AdmissionQueue[Item] = AdmissionQueue()
    q = PeerQueue[Item]()
    for i in range(20_000):
        aq.add(q, i, Item(i, 1), [f"t{i}"])
    t0 = time.thread_time()
    for i in range(19_999, 0, -1):  # from the tail: the head stays, nothing re-filed
        assert aq.withdraw(q, i) is not None
    assert time.thread_time() - t0 < 0.5
    assert aq.queued == 1 and q.head() is not None


def test_adding_twice_or_to_a_closed_queue_is_a_bug() -> None:
    aq: AdmissionQueue[Item] = AdmissionQueue()
    q = PeerQueue[Item]()
    aq.add(q, 1, Item(1, 1), ["a"])
    with pytest.raises(ValueError):
        aq.add(q, 1, Item(1, 1), ["a"])
    aq.close(q)
    with pytest.raises(ValueError):
        aq.add(q, 2, Item(2, 1), ["b"])


# --------------------------------------------------------------------------- per-peer bounds

BOUNDS = PeerBounds(budget_bytes=1000, max_queued=4, max_granted=3, max_tensors_in_flight=10)


@pytest.mark.parametrize(
    ("ask", "code"),
    [
        ({"nbytes": 1001}, "too_large"),
        ({"queued": 4}, "busy"),
        ({"granted": 3}, "busy"),
        ({"granted_tensors": 8, "ntensors": 3}, "busy"),
        ({"nbytes": 1000, "queued": 3, "granted": 2, "granted_tensors": 7, "ntensors": 3}, None),
        ({"nbytes": 5000, "queued": 9}, "too_large"),  # the first rule broken answers
    ],
)
def test_peer_bounds_table(ask: dict[str, int], code: str | None) -> None:
    args = {"nbytes": 1, "ntensors": 1, "queued": 0, "granted": 0, "granted_tensors": 0}
    args.update(ask)
    got = BOUNDS.refusal(**args)
    assert (got[0] if got else None) == code


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2000),
    st.integers(1, 12),
    st.integers(0, 6),
    st.integers(0, 5),
    st.integers(0, 12),
)
def test_peer_bounds_refuse_exactly_when_a_bound_is_broken(
    nbytes: int, ntensors: int, queued: int, granted: int, granted_tensors: int
) -> None:
    ok = nbytes <= 1000 and queued < 4 and granted < 3 and granted_tensors + ntensors <= 10
    got = BOUNDS.refusal(
        nbytes=nbytes,
        ntensors=ntensors,
        queued=queued,
        granted=granted,
        granted_tensors=granted_tensors,
    )
    assert (got is None) == ok
    if got is not None:
        assert got[0] == ("too_large" if nbytes > 1000 else "busy") and got[1]
