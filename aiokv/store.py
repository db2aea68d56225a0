"""The receive store: where arriving tensors wait to be collected.

Each tensor is keyed by the id its sender gave it *and* the sending peer, so
two peers can use the same id without colliding (ids are namespaced per
peer). Collecting is awaiting a future: no condition variables, no threads.

Memory is governed by a byte budget that covers both tensors granted but not
yet landed and tensors landed but not yet collected. The engine grants a
reservation only when :meth:`ReceiveStore.try_reserve` succeeds, so a sender
waits for credit instead of the receiver running out of memory; the budget
is never exceeded. An uncollected tensor expires after its TTL; collecting it
later raises :class:`~aiokv.ExpiredError`, never stale data.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._exceptions import (
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
    peer: PeerRef
    nbytes: int
    value: Any = None  # the tensor once landed
    landed: bool = False
    expires: float = 0.0


@dataclass(slots=True)
class _Waiter:
    frm: str | None
    fut: asyncio.Future[Any]


@dataclass(slots=True)
class StoreStatistics:
    capacity: int
    reserved_bytes: int
    held_bytes: int
    peak_bytes: int
    held_tensors: int
    pending_tensors: int
    expired: int
    collected: int


@dataclass(slots=True)
class ReceiveStore:
    """Tensors by (tensor id, peer); a byte budget; TTL expiry."""

    capacity: int
    ttl: float
    resolve_peer: Callable[[str], str | None] = lambda addr: None
    _entries: dict[str, dict[str, _Entry]] = field(default_factory=dict)
    _waiters: dict[str, list[_Waiter]] = field(default_factory=dict)
    _tombstones: OrderedDict[str, float] = field(default_factory=OrderedDict)
    reserved: int = 0  # granted, not landed
    held: int = 0  # landed, not collected
    peak: int = 0
    expired_count: int = 0
    collected_count: int = 0

    # ---------------------------------------------------------------- budget
    @property
    def used(self) -> int:
        return self.reserved + self.held

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def check_free(self, peer: PeerRef, tensor_ids: list[str]) -> None:
        """Raise DuplicateTensorError if any id from this peer is pending or held."""
        for tid in tensor_ids:
            per = self._entries.get(tid)
            if per is not None and peer.engine_id in per:
                raise DuplicateTensorError(
                    f"tensor {tid!r} from {peer.address} is already held or in flight",
                    code="duplicate",
                )

    def try_reserve(self, peer: PeerRef, specs: list[tuple[str, int]]) -> bool:
        """Reserve room and claim the ids for a transfer; False if it does not fit now."""
        total = sum(n for _, n in specs)
        self.check_free(peer, [t for t, _ in specs])
        if not self.fits(total):
            return False
        self.reserved += total
        self.peak = max(self.peak, self.used)
        for tid, n in specs:
            self._entries.setdefault(tid, {})[peer.engine_id] = _Entry(peer, n)
        return True

    def cancel(self, peer: PeerRef, tensor_ids: list[str], exc: BaseException | None) -> None:
        """Drop pending (not landed) entries; fail their waiters with ``exc`` if given."""
        for tid in tensor_ids:
            per = self._entries.get(tid)
            e = per.get(peer.engine_id) if per else None
            if e is None or e.landed:
                continue
            del per[peer.engine_id]  # type: ignore[union-attr]
            if not per:
                del self._entries[tid]
            self.reserved -= e.nbytes
            if exc is not None:
                self._fail_waiters(tid, peer, exc)

    def land(self, peer: PeerRef, tid: str, value: Any) -> None:
        """A reserved tensor arrived: hand it to a waiter or keep it until its TTL."""
        per = self._entries.get(tid)
        e = per.get(peer.engine_id) if per else None
        if e is None or e.landed:
            raise TransferAbortedError(f"tensor {tid!r} landed without a reservation")
        self.reserved -= e.nbytes
        for w in self._waiters.get(tid, ()):
            if not w.fut.done() and self._matches(w.frm, peer):
                self._waiters[tid].remove(w)
                if not self._waiters[tid]:
                    del self._waiters[tid]
                del per[peer.engine_id]  # type: ignore[union-attr]
                if not per:
                    del self._entries[tid]
                self.collected_count += 1
                w.fut.set_result((peer, value))
                return
        e.landed = True
        e.value = value
        e.expires = time.monotonic() + self.ttl
        self.held += e.nbytes
        self.peak = max(self.peak, self.used)

    # ---------------------------------------------------------------- collect
    def take_nowait(self, tid: str, frm: str | None) -> tuple[PeerRef, Any]:
        """Return ``(peer, tensor)`` and remove it, or raise KeyError / ExpiredError."""
        per = self._entries.get(tid)
        if per:
            for eid, e in per.items():
                if e.landed and self._matches(frm, e.peer):
                    del per[eid]
                    if not per:
                        del self._entries[tid]
                    self.held -= e.nbytes
                    self.collected_count += 1
                    return (e.peer, e.value)
        self._raise_if_expired(tid, frm)
        raise KeyError(tid)

    def wait_future(self, tid: str, frm: str | None) -> asyncio.Future[Any]:
        """A future resolved with ``(peer, tensor)`` (already landed or arriving later)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self.take_nowait(tid, frm))
        except KeyError:
            self._waiters.setdefault(tid, []).append(_Waiter(frm, fut))
        except ExpiredError as exc:
            fut.set_exception(exc)
        return fut

    def put_back(self, tid: str, peer: PeerRef, value: Any, nbytes: int) -> None:
        """Return a tensor whose collector was cancelled after it was handed over."""
        self._entries.setdefault(tid, {})[peer.engine_id] = _Entry(
            peer, nbytes, value, True, time.monotonic() + self.ttl
        )
        self.held += nbytes
        self.collected_count -= 1
        for w in list(self._waiters.get(tid, ())):
            if not w.fut.done() and self._matches(w.frm, peer):
                self._waiters[tid].remove(w)
                del self._entries[tid][peer.engine_id]
                if not self._entries[tid]:
                    del self._entries[tid]
                self.held -= nbytes
                self.collected_count += 1
                w.fut.set_result((peer, value))
                return

    def forget_waiter(self, tid: str, fut: asyncio.Future[Any]) -> None:
        ws = self._waiters.get(tid)
        if ws:
            ws[:] = [w for w in ws if w.fut is not fut]
            if not ws:
                del self._waiters[tid]

    # ---------------------------------------------------------------- upkeep
    def expire(self, now: float | None = None) -> int:
        """Drop landed tensors past their TTL; returns bytes freed."""
        now = time.monotonic() if now is None else now
        freed = 0
        for tid in list(self._entries):
            per = self._entries[tid]
            for eid in list(per):
                e = per[eid]
                if e.landed and e.expires <= now:
                    del per[eid]
                    self.held -= e.nbytes
                    freed += e.nbytes
                    self.expired_count += 1
                    self._tombstone(f"{eid}\x00{tid}", now)
                    self._tombstone(f"\x00{tid}", now)
                    self._tombstone(f"{e.peer.address}\x01{tid}", now)
            if not per:
                del self._entries[tid]
        return freed

    def peer_lost(self, peer: PeerRef, exc: BaseException) -> None:
        """Fail waiters of tensors still in flight from ``peer`` and release their room."""
        for tid in list(self._entries):
            e = self._entries[tid].get(peer.engine_id)
            if e is not None and not e.landed:
                self.cancel(peer, [tid], exc)

    def fail_all(self, exc: BaseException) -> None:
        for ws in self._waiters.values():
            for w in ws:
                if not w.fut.done():
                    w.fut.set_exception(exc)
        self._waiters.clear()
        self._entries.clear()
        self.reserved = self.held = 0

    def statistics(self) -> StoreStatistics:
        held = sum(1 for per in self._entries.values() for e in per.values() if e.landed)
        pending = sum(1 for per in self._entries.values() for e in per.values() if not e.landed)
        return StoreStatistics(
            capacity=self.capacity,
            reserved_bytes=self.reserved,
            held_bytes=self.held,
            peak_bytes=self.peak,
            held_tensors=held,
            pending_tensors=pending,
            expired=self.expired_count,
            collected=self.collected_count,
        )

    # ---------------------------------------------------------------- helpers
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
