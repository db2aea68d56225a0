"""The rules of a request's lease on the producer's side, as one table (no I/O).

A request the IPC plane sends lends its blocks to the consumer: from the moment its
descriptor (the *offer* of the blocks, with the lease's deadline) is out, the consumer
may read them, until its release says it is done with them (the *grant* back) or the
lease plus the grace period is over. Every way that loan can end is a transition of
:data:`TRANSITIONS`, and only what it allows happens: the plane feeds a request's
:class:`Lease` the events it observes (a release, the lease running out, a message the
consumer never took, the caller's cancellation) and acts on the state it reaches --
whether the caller gets the blocks back, whether the request's events serve again,
whether it goes the ordinary way. An event a state does not accept is a bug in the
plane, raised as :class:`~aiokv.LocalProtocolError`.

::

    OFFERED --release ok-------> RELEASED      copied; blocks free, counted as sent
            --release fallback-> FALLBACK      nothing read; the ordinary path sends it
            --release failed---> FAILED        the consumer failed it; blocks free
            --bad release------> BROKEN        a malformed release; the wait fails
            --lease over-------> EXPIRED       no release in lease + grace; blocks free
            --undelivered------> UNDELIVERED   the consumer never took the descriptor
            --cancel-----------> CANCELLED     the caller left; the consumer may read on
    CANCELLED --(any of the above but cancel)--> the same end, for the blocks
"""

from __future__ import annotations

import enum

from ..._exceptions import LocalProtocolError

__all__ = [
    "BLOCKS_FREE",
    "EVENTS_REUSABLE",
    "TRANSITIONS",
    "Lease",
    "LeaseEvent",
    "LeaseState",
]


class LeaseState(enum.Enum):
    """Where a request's loan of its blocks stands (producer)."""

    OFFERED = "offered"  # the descriptor is out: the consumer may read the blocks
    CANCELLED = "cancelled"  # the caller left; the consumer may still read them
    RELEASED = "released"  # the consumer's ok release: copied
    FALLBACK = "fallback"  # the consumer read nothing and asks for the ordinary path
    FAILED = "failed"  # the consumer's release says it failed the request
    BROKEN = "broken"  # the release could not be read (a protocol error)
    EXPIRED = "expired"  # lease + grace over without a release
    UNDELIVERED = "undelivered"  # a message the consumer surely never took


class LeaseEvent(enum.Enum):
    """What the plane observes about a request's lease."""

    RELEASE_OK = "release_ok"
    RELEASE_FALLBACK = "release_fallback"
    RELEASE_FAILED = "release_failed"
    BAD_RELEASE = "bad_release"
    LEASE_OVER = "lease_over"
    UNDELIVERED = "undelivered"
    CANCEL = "cancel"


S, E = LeaseState, LeaseEvent

#: the consumer's answer (or its absence) ends the loan the same way whether or not the
#: caller still waits for it
_ENDS: dict[LeaseEvent, LeaseState] = {
    E.RELEASE_OK: S.RELEASED,
    E.RELEASE_FALLBACK: S.FALLBACK,
    E.RELEASE_FAILED: S.FAILED,
    E.BAD_RELEASE: S.BROKEN,
    E.LEASE_OVER: S.EXPIRED,
    E.UNDELIVERED: S.UNDELIVERED,
}

#: every transition of a request's lease: state -> event -> next state (absent: illegal)
TRANSITIONS: dict[LeaseState, dict[LeaseEvent, LeaseState]] = {
    S.OFFERED: {**_ENDS, E.CANCEL: S.CANCELLED},
    S.CANCELLED: dict(_ENDS),
    S.RELEASED: {},
    S.FALLBACK: {},
    S.FAILED: {},
    S.BROKEN: {},
    S.EXPIRED: {},
    S.UNDELIVERED: {},
}

#: end states: the consumer reads the blocks no more (they are the producer's again)
BLOCKS_FREE = frozenset(s for s, out in TRANSITIONS.items() if not out)

#: end states after which the request's events serve another request: a release came,
#: so the consumer waits on them no more (after a lease that ran out, a consumer may
#: still hold them: they are never reused)
EVENTS_REUSABLE = frozenset({S.RELEASED, S.FALLBACK, S.FAILED})


class Lease:
    """One request's lease, driven by :meth:`handle` through :data:`TRANSITIONS`."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = LeaseState.OFFERED

    def handle(self, event: LeaseEvent) -> LeaseState:
        """Apply ``event``; the new state. :class:`~aiokv.LocalProtocolError` when the
        state does not accept it (the state stays)."""
        nxt = TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise LocalProtocolError(f"IPC lease: {event.value!r} in state {self.state.value!r}")
        self.state = nxt
        return nxt

    @property
    def blocks_free(self) -> bool:
        """Whether the consumer reads the blocks no more."""
        return self.state in BLOCKS_FREE

    @property
    def events_reusable(self) -> bool:
        """Whether the request's events may serve another request."""
        return self.state in EVENTS_REUSABLE
