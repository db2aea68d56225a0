"""The lease's state table (aiokv.kv.ipc.lease), driven without I/O: every state is
reachable, every end is final, and any sequence of events follows the table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiokv import LocalProtocolError
from aiokv.kv.ipc.lease import (
    BLOCKS_FREE,
    EVENTS_REUSABLE,
    TRANSITIONS,
    Lease,
    LeaseEvent,
    LeaseState,
)

S, E = LeaseState, LeaseEvent
ENDINGS = [e for e in E if e is not E.CANCEL]


def test_the_table_covers_every_state_and_event() -> None:
    assert set(TRANSITIONS) == set(S)
    # a loan in flight takes every ending; only the caller's first cancellation counts
    assert set(TRANSITIONS[S.OFFERED]) == set(E)
    assert set(TRANSITIONS[S.CANCELLED]) == set(ENDINGS)
    # the consumer's answer ends a loan the same way whether the caller still waits
    for e in ENDINGS:
        assert TRANSITIONS[S.OFFERED][e] is TRANSITIONS[S.CANCELLED][e]
    assert BLOCKS_FREE == {S.RELEASED, S.FALLBACK, S.FAILED, S.BROKEN, S.EXPIRED, S.UNDELIVERED}
    assert EVENTS_REUSABLE < BLOCKS_FREE
    assert EVENTS_REUSABLE == {S.RELEASED, S.FALLBACK, S.FAILED}


def test_every_state_is_reachable_from_an_offer() -> None:
    seen = {S.OFFERED}
    todo = [S.OFFERED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()].values():
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(S)


@pytest.mark.parametrize(
    "events, end",
    [
        ([E.RELEASE_OK], S.RELEASED),
        ([E.RELEASE_FALLBACK], S.FALLBACK),
        ([E.RELEASE_FAILED], S.FAILED),
        ([E.LEASE_OVER], S.EXPIRED),
        ([E.UNDELIVERED], S.UNDELIVERED),
        ([E.BAD_RELEASE], S.BROKEN),
        ([E.CANCEL, E.RELEASE_OK], S.RELEASED),
        ([E.CANCEL, E.LEASE_OVER], S.EXPIRED),
    ],
)
def test_known_paths(events: list[LeaseEvent], end: LeaseState) -> None:
    lease = Lease()
    for e in events:
        lease.handle(e)
    assert lease.state is end and lease.blocks_free
    assert lease.events_reusable is (end in (S.RELEASED, S.FALLBACK, S.FAILED))


def test_an_illegal_event_raises_and_changes_nothing() -> None:
    lease = Lease()
    lease.handle(E.CANCEL)
    with pytest.raises(LocalProtocolError, match="'cancel' in state 'cancelled'"):
        lease.handle(E.CANCEL)
    assert lease.state is S.CANCELLED and not lease.blocks_free
    lease.handle(E.RELEASE_OK)
    for e in E:
        with pytest.raises(LocalProtocolError):
            lease.handle(e)
        assert lease.state is S.RELEASED


@given(st.lists(st.sampled_from(list(E)), max_size=12))
def test_any_sequence_follows_the_table(events: list[LeaseEvent]) -> None:
    """Applying any events in any order: each accepted one moves as the table says, each
    refused one raises and leaves the state; the blocks are free exactly in an end
    state, the first ending decides it, and nothing moves after it."""
    lease = Lease()
    first_end: LeaseEvent | None = None
    for e in events:
        before = lease.state
        want = TRANSITIONS[before].get(e)
        if want is None:
            with pytest.raises(LocalProtocolError):
                lease.handle(e)
            assert lease.state is before
        else:
            assert lease.handle(e) is want and lease.state is want
            if first_end is None and e is not E.CANCEL:
                first_end = e
        assert lease.blocks_free is (lease.state in BLOCKS_FREE)
        assert not (lease.events_reusable and not lease.blocks_free)
    if first_end is None:
        assert lease.state in (S.OFFERED, S.CANCELLED) and not lease.blocks_free
    else:
        assert lease.state is TRANSITIONS[S.OFFERED][first_end]
