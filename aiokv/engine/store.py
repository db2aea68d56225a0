"""The receive store: where arriving tensors wait to be collected.

Each tensor is keyed by the id its sender gave it *and* the sending peer, so
two peers can use the same id without colliding (ids are namespaced per
peer). Collecting is awaiting a future: no condition variables, no threads.

Memory is governed by a byte budget that covers both tensors granted but not
yet landed and tensors landed but not yet collected, and by a tensor count
(``max_tensors``) so that empty tensors, which use no bytes, cannot grow the
store either. The engine grants a reservation only when
:meth:`ReceiveStore.try_reserve` succeeds, so a sender waits for credit
instead of the receiver running out of memory; the byte budget is never
exceeded, the count only by one transfer into an empty store (so that no
transfer waits forever). An uncollected tensor expires after its TTL; collecting it later
raises :class:`~aiokv.ExpiredError`, never stale data. Landed tensors are kept
in landing order, which is expiry order (one TTL, a monotonic clock), so
:meth:`ReceiveStore.expire` only looks at the tensors that do expire.

:meth:`ReceiveStore.discard` drops what a consumer will never collect (e.g. the
chunks of a cancelled request) at once instead of at its TTL.

A granted tensor that has not landed is one ``int`` (its bytes) in a dict of ints, a
shape CPython's cyclic collector does not track: tens of thousands of reservations a
peer holds (empty tensors cost no bytes) add nothing to the full collections that pause
the engine's loop. A landed tensor is an entry object (it holds the tensor anyway).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokv._config import DEFAULT_STORE_TENSORS
from aiokv._exceptions import (
    ConfigError,
    DuplicateTensorError,
    ExpiredError,
    TransferAbortedError,
)

__all__ = ["PeerRef", "ReceiveStore", "StoreStatistics"]

_TOMBSTONES = 65536


@dataclass(frozen=True, slots=True)
class PeerRef:
    """Who sent a tensor: its engine id and the address it listens on."""

    engine_id: str
    address: str


@dataclass(slots=True)
class _Entry:
    """A landed tensor, held until collected or its TTL."""

    peer: PeerRef
    nbytes: int
    value: Any
    expires: float


@dataclass(slots=True)
class _Waiter:
    frm: str | None
    fut: asyncio.Future[Any]


@dataclass(slots=True)
class StoreStatistics:
    """A snapshot of the receive store (:attr:`aiokv.EngineStatistics.store`).

    Bytes: ``capacity`` (the budget), ``reserved_bytes`` (granted, not landed),
    ``held_bytes`` (landed, not collected), ``peak_bytes``. Tensors:
    ``held_tensors``, ``pending_tensors``, ``max_tensors`` (the count budget over
    both); counters ``expired``, ``collected`` and ``discarded`` (dropped by
    :meth:`ReceiveStore.discard`).
    """

    capacity: int
    reserved_bytes: int
    held_bytes: int
    peak_bytes: int
    held_tensors: int
    pending_tensors: int
    expired: int
    collected: int
    max_tensors: int = 0
    discarded: int = 0


@dataclass(slots=True)
class ReceiveStore:
    """Tensors by (tensor id, peer); a byte budget and a tensor count; TTL expiry."""

    capacity: int
    ttl: float
    resolve_peer: Callable[[str], str | None] = lambda addr: None
    max_tensors: int = DEFAULT_STORE_TENSORS  # pending + held, all peers
    #: landed tensors: tensor id -> engine id -> entry
    _entries: dict[str, dict[str, _Entry]] = field(default_factory=dict)
    #: granted, not landed: tensor id -> engine id -> bytes (untracked by the collector)
    _pending: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the pending ones discarded while in flight, dropped when they land: (id, engine id)
    _doomed: set[tuple[str, str]] = field(default_factory=set)
    #: who the engine ids with pending tensors are, and how many each has pending
    _peers: dict[str, PeerRef] = field(default_factory=dict)
    _peer_pending: dict[str, int] = field(default_factory=dict)
    _waiters: dict[str, list[_Waiter]] = field(default_factory=dict)
    _tombstones: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # landed entries in landing order = expiry order, keyed (tensor id, engine id)
    _landed: OrderedDict[tuple[str, str], _Entry] = field(default_factory=OrderedDict)
    reserved: int = 0  # granted, not landed
    held: int = 0  # landed, not collected
    pending_n: int = 0  # tensors granted, not landed
    #: tensors of the standing credit windows the engine granted its peers: set aside
    #: in the count as credit bytes are in ``reserved``, so that other peers' grants
    #: never take the room a credited transfer lands in
    credit_n: int = 0
    peak: int = 0
    expired_count: int = 0
    collected_count: int = 0
    discarded_count: int = 0
    #: the engine's event loop, set when it starts (saves a system call per wait)
    loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- budget
    @property
    def used(self) -> int:
        return self.reserved + self.held

    @property
    def count(self) -> int:
        """Tensors granted, held or set aside as credit (what ``max_tensors`` bounds)."""
        return self.pending_n + len(self._landed) + self.credit_n

    def fits(self, nbytes: int, ntensors: int = 0) -> bool:
        """Room for ``nbytes`` and ``ntensors`` more. A transfer of more tensors than
        ``max_tensors`` still fits a store that holds and expects nothing (the wire limit
        bounds it), so no transfer can wait forever."""
        if self.used + nbytes > self.capacity:
            return False
        return self.count + ntensors <= self.max_tensors or self.pending_n + len(self._landed) == 0

    def check_free(self, peer: PeerRef, tensor_ids: list[str]) -> None:
        """Raise DuplicateTensorError if any id from this peer is pending or held."""
        eid = peer.engine_id
        for tid in tensor_ids:
            per = self._entries.get(tid)
            pend = self._pending.get(tid)
            if (per is not None and eid in per) or (pend is not None and eid in pend):
                raise DuplicateTensorError(
                    f"tensor {tid!r} from {peer.address} is already held or in flight",
                    code="duplicate",
                )

    def try_reserve(self, peer: PeerRef, specs: list[tuple[str, int]]) -> bool:
        """Reserve room and claim the ids for a transfer; False if it does not fit now."""
        total = sum(n for _, n in specs)
        self.check_free(peer, [t for t, _ in specs])
        if not self.fits(total, len(specs)):
            return False
        self.reserved += total
        self.pending_n += len(specs)
        self.peak = max(self.peak, self.used)
        eid = peer.engine_id
        pending = self._pending
        for tid, n in specs:
            pending.setdefault(tid, {})[eid] = n
        self._peers[eid] = peer
        self._peer_pending[eid] = self._peer_pending.get(eid, 0) + len(specs)
        return True

    def try_land(
        self, peer: PeerRef, items: list[tuple[str, int, Any]], *, credited: bool = False
    ) -> bool:
        """``try_reserve`` and ``land`` of every ``(id, nbytes, tensor)`` in one step (a
        transfer whose data came with its header): False if it does not fit now; raises
        DuplicateTensorError like ``try_reserve``. A waiting collector gets its tensor at
        once; the rest is held until collected or its TTL. ``credited``: the caller took
        the tensors from ``credit_n`` (their room was set aside): the count is not checked."""
        eid = peer.engine_id
        entries, pending = self._entries, self._pending
        for tid, _, _ in items:
            # (an id nobody holds is the rule: two lookups on the PUT's path, no call)
            if tid in entries or tid in pending:
                self.check_free(peer, [tid])  # raises if it is this peer's
        total = items[0][1] if len(items) == 1 else sum(n for _, n, _ in items)
        if not self.fits(total, 0 if credited else len(items)):
            return False
        self.peak = max(self.peak, self.used + total)
        expires = time.monotonic() + self.ttl
        for tid, n, value in items:
            if self._hand_over(tid, peer, value):
                continue
            e = _Entry(peer, n, value, expires)
            entries.setdefault(tid, {})[eid] = e
            self._landed[(tid, eid)] = e
            self.held += n
        return True

    def cancel(self, peer: PeerRef, tensor_ids: list[str], exc: BaseException | None) -> None:
        """Drop pending (not landed) entries; fail their waiters with ``exc`` if given."""
        for tid in tensor_ids:
            if self._unpend(tid, peer.engine_id) is not None and exc is not None:
                self._fail_waiters(tid, peer, exc)

    def land(self, peer: PeerRef, tid: str, value: Any) -> None:
        """A reserved tensor arrived: hand it to a waiter or keep it until its TTL."""
        eid = peer.engine_id
        doomed = bool(self._doomed) and (tid, eid) in self._doomed  # (before _unpend forgets)
        n = self._unpend(tid, eid)
        if n is None:
            raise TransferAbortedError(f"tensor {tid!r} landed without a reservation")
        if doomed or self._hand_over(tid, peer, value):
            return  # discarded while in flight (nobody may have it), or handed over
        e = _Entry(peer, n, value, time.monotonic() + self.ttl)
        self._entries.setdefault(tid, {})[eid] = e
        self._landed[(tid, eid)] = e
        self.held += n
        self.peak = max(self.peak, self.used)

    # ---------------------------------------------------------------- collect
    def take(self, tid: str, frm: str | None) -> tuple[PeerRef, Any] | None:
        """Return ``(peer, tensor)`` and remove it, or None if it has not landed."""
        per = self._entries.get(tid)
        if per:
            for eid, e in per.items():
                if self._matches(frm, e.peer):
                    del per[eid]
                    if not per:
                        del self._entries[tid]
                    del self._landed[(tid, eid)]
                    self.held -= e.nbytes
                    self.collected_count += 1
                    return (e.peer, e.value)
        return None

    def take_nowait(self, tid: str, frm: str | None) -> tuple[PeerRef, Any]:
        """Return ``(peer, tensor)`` and remove it, or raise KeyError / ExpiredError."""
        got = self.take(tid, frm)
        if got is None:
            self._raise_if_expired(tid, frm)
            raise KeyError(tid)
        return got

    def wait_future(
        self, tid: str, frm: str | None, *, looked: bool = False
    ) -> asyncio.Future[Any]:
        """A future resolved with ``(peer, tensor)`` (already landed or arriving later).
        ``looked``: the caller's :meth:`take` just found nothing (no second look)."""
        fut: asyncio.Future[Any] = (self.loop or asyncio.get_running_loop()).create_future()
        got = None if looked else self.take(tid, frm)
        if got is not None:
            fut.set_result(got)
            return fut
        try:
            self._raise_if_expired(tid, frm)
        except ExpiredError as exc:
            fut.set_exception(exc)
            return fut
        self._waiters.setdefault(tid, []).append(_Waiter(frm, fut))
        return fut

    def put_back(self, tid: str, peer: PeerRef, value: Any, nbytes: int) -> None:
        """Return a tensor whose collector was cancelled after it was handed over."""
        e = _Entry(peer, nbytes, value, time.monotonic() + self.ttl)
        self._entries.setdefault(tid, {})[peer.engine_id] = e
        self._landed[(tid, peer.engine_id)] = e  # expires last: goes last
        self.held += nbytes
        self.collected_count -= 1
        if self._hand_over(tid, peer, value):
            del self._entries[tid][peer.engine_id]
            if not self._entries[tid]:
                del self._entries[tid]
            del self._landed[(tid, peer.engine_id)]
            self.held -= nbytes

    def _hand_over(self, tid: str, peer: PeerRef, value: Any) -> bool:
        """Give ``value`` to the first live waiter for ``tid`` that takes ``peer``'s
        tensors (counted as collected); False if none waits."""
        ws = self._waiters.get(tid)
        if ws:
            for w in ws:
                if not w.fut.done() and self._matches(w.frm, peer):
                    ws.remove(w)
                    if not ws:
                        del self._waiters[tid]
                    self.collected_count += 1
                    w.fut.set_result((peer, value))
                    return True
        return False

    def forget_waiter(self, tid: str, fut: asyncio.Future[Any]) -> None:
        ws = self._waiters.get(tid)
        if ws:
            ws[:] = [w for w in ws if w.fut is not fut]
            if not ws:
                del self._waiters[tid]

    # ---------------------------------------------------------------- upkeep
    def expire(self, now: float | None = None) -> int:
        """Drop landed tensors past their TTL; returns bytes freed.

        Looks only at the tensors that expire (plus one): landing order is expiry order.
        """
        now = time.monotonic() if now is None else now
        freed = 0
        landed = self._landed
        while landed:
            (tid, eid), e = next(iter(landed.items()))
            if e.expires > now:
                break
            landed.popitem(last=False)
            per = self._entries[tid]
            del per[eid]
            if not per:
                del self._entries[tid]
            self.held -= e.nbytes
            freed += e.nbytes
            self.expired_count += 1
            self._tombstone(f"{eid}\x00{tid}", now)
            self._tombstone(f"\x00{tid}", now)
            self._tombstone(f"{e.peer.address}\x01{tid}", now)
        return freed

    def discard(self, tensor_id_or_prefix: str) -> int:
        """Drop tensors nobody will collect; returns how many were dropped.

        Matches the tensor id ``tensor_id_or_prefix`` exactly or, when it ends with
        ``"#"``, every id that starts with it (``"req-7#"`` is all chunks of the KV
        connector's request ``req-7``), from every peer. Held tensors are freed now;
        tensors still in flight are dropped the moment they land, and anyone waiting
        for them gets :class:`~aiokv.TransferAbortedError`. A later tensor of the same
        id is not affected.
        """
        x = tensor_id_or_prefix
        if type(x) is not str or not x:
            raise ConfigError(f"discard takes a non-empty tensor id or prefix, got {x!r:.80}")
        n = 0
        for tid in self._ids(self._entries, x):
            per = self._entries.pop(tid)
            for eid, e in per.items():
                del self._landed[(tid, eid)]
                self.held -= e.nbytes
                n += 1
        for tid in self._ids(self._pending, x):
            for eid in self._pending[tid]:
                if (tid, eid) in self._doomed:
                    continue
                self._doomed.add((tid, eid))
                self._fail_waiters(
                    tid, self._peers[eid], TransferAbortedError(f"tensor {tid!r} was discarded")
                )
                n += 1
        self.discarded_count += n
        return n

    @staticmethod
    def _ids(index: dict[str, Any], x: str) -> list[str]:
        """The ids of ``index`` that :meth:`discard` of ``x`` names."""
        if x.endswith("#"):
            return [t for t in index if t.startswith(x)]
        return [x] if x in index else []

    def peer_lost(self, peer: PeerRef, exc: BaseException) -> None:
        """Fail waiters of tensors still in flight from ``peer`` and release their room."""
        eid = peer.engine_id
        if eid in self._peer_pending:
            self.cancel(peer, [t for t, per in self._pending.items() if eid in per], exc)

    def fail_all(self, exc: BaseException) -> None:
        for ws in self._waiters.values():
            for w in ws:
                if not w.fut.done():
                    w.fut.set_exception(exc)
        self._waiters.clear()
        self._entries.clear()
        self._landed.clear()
        self._pending.clear()
        self._doomed.clear()
        self._peers.clear()
        self._peer_pending.clear()
        self.reserved = self.held = self.pending_n = self.credit_n = 0

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            capacity=self.capacity,
            reserved_bytes=self.reserved,
            held_bytes=self.held,
            peak_bytes=self.peak,
            held_tensors=len(self._landed),
            pending_tensors=self.pending_n,
            expired=self.expired_count,
            collected=self.collected_count,
            max_tensors=self.max_tensors,
            discarded=self.discarded_count,
        )

    # ---------------------------------------------------------------- helpers
    def _unpend(self, tid: str, eid: str) -> int | None:
        """Forget a pending tensor and release its room; its bytes, None if not pending."""
        per = self._pending.get(tid)
        n = per.pop(eid, None) if per else None
        if n is None:
            return None
        if not per:
            del self._pending[tid]
        if self._doomed:
            self._doomed.discard((tid, eid))
        self.reserved -= n
        self.pending_n -= 1
        left = self._peer_pending[eid] - 1
        if left:
            self._peer_pending[eid] = left
        else:  # the last one of this peer: who it is need not be kept
            del self._peer_pending[eid]
            del self._peers[eid]
        return n

    def _matches(self, frm: str | None, peer: PeerRef) -> bool:
        if frm is None or frm == peer.address or frm == peer.engine_id:
            return True
        return self.resolve_peer(frm) == peer.engine_id

    def _fail_waiters(self, tid: str, peer: PeerRef, exc: BaseException) -> None:
        ws = self._waiters.get(tid)
        if not ws:
            return
        keep = []
        for w in ws:
            if not w.fut.done() and self._matches(w.frm, peer):
                w.fut.set_exception(exc)
            else:
                keep.append(w)
        if keep:
            self._waiters[tid] = keep
        else:
            del self._waiters[tid]

    def _tombstone(self, key: str, now: float) -> None:
        self._tombstones[key] = now
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _raise_if_expired(self, tid: str, frm: str | None) -> None:
        if frm is None:
            keys = [f"\x00{tid}"]
        else:
            # ``frm`` may be an address or an engine id (see _matches)
            eid = self.resolve_peer(frm)
            keys = [f"{frm}\x00{tid}", f"{frm}\x01{tid}"] + ([f"{eid}\x00{tid}"] if eid else [])
        if any(k in self._tombstones for k in keys):
            raise ExpiredError(f"tensor {tid!r} expired before it was collected (TTL {self.ttl}s)")
