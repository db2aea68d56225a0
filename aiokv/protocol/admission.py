"""Receiver-side admission of reservations that must wait for room, without I/O.

A RESERVE (protocol v1, or a v2 transfer larger than the standing window)
that does not fit the receive budget at once waits here until room frees.
The rules, and why:

=================================  ==================================================
one order per session              a session's reservations are granted in arrival
                                   order: its oldest that does not fit holds up its
                                   later ones (the sender posts data in grant order)
no session blocks another          a session whose head does not fit is skipped for
                                   this round: one peer's 2 GiB reservation waiting
                                   for room never stalls a small one of another peer
oldest first across sessions       among heads that fit, the earliest arrival is
                                   granted first (a heap keyed by each session's
                                   head: O(log sessions) per grant)
withdrawal is cheap                a withdrawn reservation leaves its session's
                                   queue in O(1); a withdrawn head re-files its
                                   session under the next head lazily
ids are claimed while queued       a tensor id may not be reserved twice by one
                                   session, queued or granted
=================================  ==================================================

:class:`PeerQueue` is one session's queue; :class:`AdmissionQueue` orders
the heads of all of them. The engine decides whether a reservation fits (the
``grant`` callback of :meth:`AdmissionQueue.pump`, which reserves the room
when it answers True); this module only keeps the order. Tested without
sockets in ``tests/protocol/test_admission_queue.py`` against a plain reference model.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["AdmissionQueue", "PeerBounds", "PeerQueue"]

T = TypeVar("T")

_tiebreak = itertools.count()


@dataclass(frozen=True, slots=True)
class PeerBounds:
    """What one session may ask of the receiver at a time, checked at each RESERVE.

    ================  ==========================  =====================================
    rule              refusal                     why
    ================  ==========================  =====================================
    bytes             ``too_large``               larger than the whole budget: it can
                                                  never fit, waiting would be forever
    queued            ``busy``                    a session's waiting RESERVEs are
                                                  bounded (the queue lives in memory)
    granted           ``busy``                    as many granted-not-landed transfers
    tensors           ``busy``                    its share of the store's tensor count
                                                  (granted and queued): empty tensors
                                                  cost no bytes, and a queued spec
                                                  costs memory
    ================  ==========================  =====================================

    Checked in that order; the first rule broken is the answer. A RESERVE that must
    wait is also refused (``busy``) when the reservations all sessions queue hold
    ``max_queued_tensors`` tensors, unless its session queues less than
    ``own_queued_tensors`` (:meth:`queue_refusal`): many sessions together cannot
    take the queue an established one needs.
    """

    budget_bytes: int
    max_queued: int
    max_granted: int
    max_tensors_in_flight: int
    #: tensors of the reservations queued by all sessions together: what strangers can
    #: make this end hold (and its collector walk) does not grow with their number ...
    max_queued_tensors: int = 1 << 62
    #: ... but a session may always queue this many of its own, whatever the others hold
    own_queued_tensors: int = 0

    def refusal(
        self, *, nbytes: int, ntensors: int, queued: int, granted: int, granted_tensors: int
    ) -> tuple[str, str] | None:
        """``(code, detail)`` if a RESERVE of this size may not be queued or granted now."""
        if nbytes > self.budget_bytes:
            return "too_large", f"{nbytes} bytes exceed the receive budget of {self.budget_bytes}"
        if queued >= self.max_queued:
            return "busy", "too many queued reservations"
        if granted >= self.max_granted:
            return "busy", "too many granted transfers in flight"
        if granted_tensors + ntensors > self.max_tensors_in_flight:
            return "busy", "too many tensors in flight from this peer"
        return None

    def queue_refusal(
        self, *, ntensors: int, queued_tensors: int, all_queued_tensors: int
    ) -> tuple[str, str] | None:
        """``(code, detail)`` if a RESERVE that must wait may not be queued: the queue of
        all sessions is full, and this session already queues its own allowance."""
        if (
            queued_tensors + ntensors > self.own_queued_tensors
            and all_queued_tensors + ntensors > self.max_queued_tensors
        ):
            return "busy", "the reservation queue is full"
        return None


class PeerQueue(Generic[T]):
    """One session's waiting reservations: ``xfer -> (item, arrival)``, oldest first."""

    __slots__ = ("_items", "_tie", "closed", "heap_key", "ids", "owner")

    def __init__(self, owner: Any = None) -> None:
        self.owner = owner  # the session (the engine's callback gets it back)
        self._items: dict[int, tuple[T, int, tuple[str, ...]]] = {}
        self.ids: set[str] = set()  # tensor ids the queued reservations claim
        self.heap_key: int | None = None  # the arrival its heap entry is filed under
        self.closed = False
        self._tie = next(_tiebreak)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, xfer: object) -> bool:
        return xfer in self._items

    def __iter__(self) -> Iterator[T]:
        return (item for item, _, _ in self._items.values())

    def claims_any(self, ids: Iterable[str]) -> bool:
        """Does a queued reservation of this session claim any of ``ids``?"""
        return bool(self.ids) and not self.ids.isdisjoint(ids)

    def head(self) -> tuple[int, T, int] | None:
        """``(xfer, item, arrival)`` of the oldest queued reservation, or None."""
        for xfer, (item, arrival, _) in self._items.items():
            return xfer, item, arrival
        return None

    def _pop(self, xfer: int) -> T | None:
        entry = self._items.pop(xfer, None)
        if entry is None:
            return None
        item, _, ids = entry
        self.ids.difference_update(ids)
        return item


class AdmissionQueue(Generic[T]):
    """The heads of every session's queue, oldest first; see the module docstring."""

    __slots__ = ("_arrivals", "_heads", "queued", "tensors")

    def __init__(self) -> None:
        self._heads: list[tuple[int, int, PeerQueue[T]]] = []
        self._arrivals = itertools.count()
        self.queued = 0  # reservations waiting, all sessions
        self.tensors = 0  # tensor ids they claim, all sessions

    def add(self, q: PeerQueue[T], xfer: int, item: T, ids: Iterable[str]) -> None:
        """Queue ``item`` (transfer ``xfer`` of ``q``'s session), claiming ``ids``."""
        if q.closed:
            raise ValueError("queue of a closed session")
        if xfer in q:
            raise ValueError(f"transfer {xfer} queued twice")
        n = next(self._arrivals)
        claimed = tuple(ids)
        q._items[xfer] = (item, n, claimed)
        before = len(q.ids)
        q.ids.update(claimed)
        self.tensors += len(q.ids) - before
        self.queued += 1
        if q.heap_key is None:
            q.heap_key = n
            heapq.heappush(self._heads, (n, q._tie, q))

    def withdraw(self, q: PeerQueue[T], xfer: int) -> T | None:
        """Take a waiting reservation out (the sender gave up); None if not queued.

        A withdrawn head leaves a stale heap entry that :meth:`pump` re-files.
        """
        before = len(q.ids)
        item = q._pop(xfer)
        if item is not None:
            self.queued -= 1
            self.tensors -= before - len(q.ids)
        return item

    def close(self, q: PeerQueue[T]) -> list[T]:
        """The session is gone: drop (and return) everything it had queued."""
        items = [item for item, _, _ in q._items.values()]
        self.queued -= len(items)
        self.tensors -= len(q.ids)
        q._items.clear()
        q.ids.clear()
        q.closed = True
        return items

    def pump(
        self,
        grant: Callable[[PeerQueue[T], T], bool],
        stop: Callable[[], bool] | None = None,
    ) -> list[tuple[PeerQueue[T], int, T]]:
        """Offer heads to ``grant``, oldest first; return what was granted, in order.

        ``grant(q, item)`` reserves the room and answers True, or answers False when
        the item does not fit now: then ``q``'s session waits for the next round and
        the others go on. ``stop()``, asked after each grant, ends the round early
        (a time budget: the caller pumps again later, the order is kept).
        """
        heads = self._heads
        stuck: list[tuple[int, int, PeerQueue[T]]] = []
        out: list[tuple[PeerQueue[T], int, T]] = []
        while heads and not (out and stop is not None and stop()):
            key, tie, q = heads[0]
            if q.closed or not q or q.heap_key != key:
                heapq.heappop(heads)  # stale entry
                if q.heap_key == key:
                    q.heap_key = None
                continue
            head = q.head()
            assert head is not None
            xfer, item, arrival = head
            if arrival != key:  # its head was withdrawn: re-file under the new head
                q.heap_key = arrival
                heapq.heapreplace(heads, (arrival, tie, q))
                continue
            if not grant(q, item):
                stuck.append(heapq.heappop(heads))
                continue
            before = len(q.ids)
            q._pop(xfer)
            self.queued -= 1
            self.tensors -= before - len(q.ids)
            out.append((q, xfer, item))
            nxt = q.head()
            if nxt is not None:
                q.heap_key = nxt[2]
                heapq.heapreplace(heads, (nxt[2], tie, q))
            else:
                q.heap_key = None
                heapq.heappop(heads)
        for e in stuck:
            heapq.heappush(heads, e)
        return out
