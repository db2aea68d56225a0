"""The consumer's inbox (:class:`Inbox`, owned by :class:`aiokv.kv.ipc._consumer.Consumer`):
a request's descriptor from whichever comes first, the producer's doorbell ring
(:mod:`aiokv.kv.ipc._doorbell`, polled while a request waits) or the engine's copy;
a descriptor the ring gave is never taken again from a late engine copy. The ring's poll
hands a staged request's descriptor to the copier on the spot (docs/ipc.md,
"Doorbell", "Staged launches").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

from aiokv._runtime.deadlines import _time_left
from aiokv._runtime.waiter import WaitEntry, Waiter, waiter_for

from ..._exceptions import RemoteProtocolError
from ..layouts import KVLayout
from . import _doorbell
from ._common import _mark, log
from ._mapping import _Mapping
from ._state import PlaneState
from ._wire import PUSH, REVOKED, Descriptor, decode_message, parse_revoke

if TYPE_CHECKING:
    from ._copy import _Staged
    from ._parts import Copies, Grants

#: ring messages a consumer keeps per producer for requests that do not wait yet (the
#: producer has at most SLOTS - 1 ring-only descriptors unreleased, so this is slack)
_MAX_PENDING = 2 * _doorbell.SLOTS
#: request ids whose descriptor came by the ring, remembered (with the lease that tells
#: one send from another) so that a late engine copy of it is not taken for a new one
_MAX_TAKEN = 4096
#: the timed doorbell poll after the spin: every millisecond without a wake FIFO, a
#: safety net with one
_BELL_POLL_S = 0.001
_BELL_POLL_WAKE_S = 0.01
_REVOKED_B = bytes((REVOKED,))


def _engine_first(bell: asyncio.Future[Any], _: object) -> None:
    """The engine's receive of a descriptor ended before the ring gave it."""
    if not bell.done():
        bell.set_result(None)


class Inbox:
    """Where a consumer's descriptors arrive: the requests waiting for one (``waiting``:
    request id -> its future, the producer it must come from, its staged copy), the
    ring's poll (a poll of the loop's waiter while a request waits), the request ids
    the ring gave. ``copier`` launches what the poll finds staged; ``granter`` names
    the push export a pushed descriptor must name."""

    def __init__(self, s: PlaneState, copier: Copies, granter: Grants) -> None:
        self.s = s
        self.copier = copier
        self.granter = granter
        # doorbell (consumer): request id -> (its waiter, the producer it must come from)
        self.waiting: dict[
            str,
            tuple[asyncio.Future[tuple[Descriptor, bool] | None], str | None, _Staged | None],
        ] = {}
        # the ring's poll (registered with the loop's waiter while a request waits), and
        # that waiter, held: nothing else may hold it between two requests, and one
        # made anew per request costs the request ~8 us (measured on CPU)
        self.entry: WaitEntry | None = None
        self._waiter: Waiter | None = None
        self._taken: dict[str, Any] = {}  # request id -> lease of a descriptor the ring gave

    def close(self) -> None:
        """Stop the ring's poll (the plane closes)."""
        if self.entry is not None:
            waiter_for().discard(self.entry)
            self.entry = None
        self._waiter = None

    async def recv_desc(
        self, rid: str, frm: str | None, deadline: float, staged: _Staged | None = None
    ) -> tuple[Descriptor, KVLayout | None, bool]:
        """The request's descriptor (decoded; not yet checked against the request) and
        its inline offer's layout from whichever comes first: a producer's doorbell
        ring or the engine; and whether the ring gave it.
        When the ring wins, an engine copy (sent too, or late as a backup) is discarded
        as far as it is here or on its way, and one landing later is never taken for a
        new request of the same id (``_taken``)."""
        got = self._bell_take(rid, frm)  # read before this call (or right now)
        if got is not None:
            return self._rung(rid, *got, frm, deadline), None, True
        while True:
            # One future for both: the ring's poll sets the descriptor, the engine's
            # receive (ending first, in any way) sets None. Awaited directly, it wakes
            # this task a loop pass sooner than asyncio.wait over the two.
            bell: asyncio.Future[tuple[Descriptor, bool] | None] = (
                asyncio.get_running_loop().create_future()
            )
            self.waiting[rid] = (bell, frm, staged)
            self._bell_kick()
            eng = asyncio.ensure_future(
                self.s.channel.recv(f"{rid}#ipc", frm=frm, timeout=_time_left(deadline))
            )
            eng.add_done_callback(functools.partial(_engine_first, bell))
            try:
                got = await bell
            except BaseException:
                eng.cancel()  # (a descriptor already handed over goes back to the store)
                raise
            finally:
                w = self.waiting.get(rid)
                if w is not None and w[0] is bell:
                    del self.waiting[rid]
            if got is not None:
                if eng.done():
                    if not eng.cancelled():
                        eng.exception()  # retrieved; a descriptor it took goes with it
                else:
                    eng.cancel()
                return self._rung(rid, *got, frm, deadline), None, True
            taken = self._from_engine(rid, eng.result())
            if taken is not None:
                return taken

    def desc_nowait(
        self, rid: str, frm: str | None, deadline: float
    ) -> tuple[Descriptor, KVLayout | None, bool] | None:
        """The request's descriptor if it is here already (ring or engine), as
        :meth:`recv_desc` returns it; None if not yet."""
        got = self._bell_take(rid, frm)
        if got is not None:
            return self._rung(rid, *got, frm, deadline), None, True
        raw = self.s.channel.recv_nowait(f"{rid}#ipc", frm=frm)
        return None if raw is None else self._from_engine(rid, raw)

    def _from_engine(self, rid: str, raw: Any) -> tuple[Descriptor, KVLayout | None, bool] | None:
        """A descriptor the engine delivered for ``rid``, decoded, as :meth:`recv_desc`
        returns it; None for a late engine copy of one the ring gave (``_taken``: it was
        collected, and is dropped)."""
        d = decode_message(raw)
        if rid in self._taken and self._taken[rid] == d.get("lease"):
            return None
        _mark(rid, "desc")
        return *Descriptor.from_wire(d), False

    def _rung(
        self, rid: str, desc: Descriptor, solo: bool, frm: str | None, deadline: float
    ) -> Descriptor:
        """A descriptor taken from the ring: count it, drop the engine's copy, remember
        its lease. The copy of a descriptor the engine carried too is collected and
        dropped as it lands (it surely comes); one sent by the ring alone (``solo``) has
        an engine copy only as a late backup: dropped where it is (landed or in flight),
        else left to land and expire -- and never taken for a new request of the same id
        (``_taken``)."""
        _mark(rid, "desc")
        self.s.stats.doorbell_hits += 1
        self.s.port.drop(rid, [f"{rid}#ipc"], frm, deadline, late=not solo)
        self._taken.pop(rid, None)
        self._taken[rid] = desc.lease
        if len(self._taken) > _MAX_TAKEN:
            del self._taken[next(iter(self._taken))]
        return desc

    def _bell_take(self, rid: str, frm: str | None) -> tuple[Descriptor, bool] | None:
        """Read the rings of the mappings from ``frm`` (every one when None) and take
        ``rid``'s descriptor if one of them had it."""
        for m in list(self.s.maps.values()):
            if m.bell is None or (frm is not None and frm != m.reply_to):
                continue
            self._bell_poll(m)
            got = m.pending.pop(rid, None)
            if got is not None:
                return got
        return None

    def _bell_kick(self) -> None:
        """Spin the doorbell poll for ``doorbell_spin_s`` from now (start it if needed)."""
        spin = self.s.options.doorbell_spin_s
        entry = self.entry
        w = self._waiter = waiter_for()
        if entry is None:
            self.entry = w.add(self._bell_tick, interval=_BELL_POLL_S, spin=spin)
        else:
            entry.reset(time.monotonic(), spin)
            w.reschedule()

    def _bell_tick(self, _now: float) -> bool:
        """Poll every mapped producer's ring while a request waits: a poll of the loop's
        waiter, asked on every loop pass while spinning (``doorbell_spin_s`` after the
        latest request began to wait), then on the waiter's timer -- every millisecond,
        or every 10 ms where each ring's wake FIFO wakes the loop anyway. True (done,
        unregistered) once no request waits. An error escaping it (a bug: the ring's
        poll keeps its own failures in) is the waiter's to report; the next request
        registers the poll again."""
        if not self.waiting or self.s.closed:
            self.entry = None
            return True
        woken = True
        try:
            for m in list(self.s.maps.values()):
                if m.bell is not None:
                    self._bell_poll(m)
                    woken = woken and m.bell is not None and m.bell.wake_fd >= 0
        except BaseException:
            self.entry = None
            raise
        if not self.waiting:
            self.entry = None
            return True
        entry = self.entry
        if entry is not None:  # (the interval the waiter takes next)
            entry.interval = entry.max_interval = _BELL_POLL_WAKE_S if woken else _BELL_POLL_S
        return False

    def woken(self, m: _Mapping) -> None:
        """The producer wrote into ``m``'s wake FIFO: read its ring now."""
        b = m.bell
        if b is None:
            return
        if not b.drain_wake():  # the producer closed it: the timed poll serves alone
            asyncio.get_running_loop().remove_reader(b.wake_fd)
            b.close_wake()
        self._bell_poll(m)

    def drop(self, m: _Mapping) -> None:
        """Stop reading ``m``'s ring (and watching its wake FIFO), and close our grants'
        ring to its producer."""
        gb, m.grant_bell = m.grant_bell, None
        if gb is not None:
            gb.close()
        b, m.bell = m.bell, None
        if b is None:
            return
        if b.wake_fd >= 0:
            with contextlib.suppress(Exception):  # (no loop any more at interpreter exit)
                asyncio.get_running_loop().remove_reader(b.wake_fd)
        b.close()

    def _bell_poll(self, m: _Mapping) -> None:
        """Hand the descriptors in ``m``'s ring to their waiting requests, and keep those
        of requests that do not wait yet in ``m.pending``. A message is only taken for a
        request from this producer (the caller's ``frm``), for this export, plane
        ``"ipc"``; anything else is left to the engine's copy. A record is decoded with
        the engine message's field rules (:meth:`Descriptor.from_ring`); one that does
        not decode is rejected. Checks against the request follow in ``recv_request``,
        as for the engine's."""
        b = m.bell
        assert b is not None
        before = b.rejected
        try:
            msgs = b.poll()
        except Exception as exc:  # (defensive: a ring that cannot be read is dropped)
            log.warning("aiokv IPC plane: doorbell of export %x dropped: %s", m.token, exc)
            self.drop(m)
            return
        for payload in msgs:
            try:
                if payload[:1] == _REVOKED_B:  # push mode: a revoked grant never taken
                    rid, gid = parse_revoke(payload, REVOKED)
                    m.revoked[gid] = rid
                    if len(m.revoked) > _MAX_PENDING:
                        del m.revoked[next(iter(m.revoked))]
                    continue
                desc, solo = Descriptor.from_ring(payload, m.reply_to)
            except RemoteProtocolError:
                b.rejected += 1
                continue
            if desc.token != (m.token if desc.plane != PUSH else self.granter.token()):
                continue
            rid = desc.rid
            w = self.waiting.get(rid)
            if w is not None and (w[1] is None or w[1] == m.reply_to) and not w[0].done():
                if w[2] is not None and w[2].m is m:
                    self.copier.launch_staged(w[2], desc)
                if not w[0].done():  # (the task was not cancelled meanwhile)
                    w[0].set_result((desc, solo))
                continue
            m.pending.pop(rid, None)
            m.pending[rid] = (desc, solo)  # nobody waits yet: a later recv_request takes it
            if len(m.pending) > _MAX_PENDING:
                del m.pending[next(iter(m.pending))]
        if b.rejected != before:
            self.s.stats.doorbell_rejected += b.rejected - before
            log.warning(
                "aiokv IPC plane: %d doorbell slot(s) of export %x rejected (MAC or format)",
                b.rejected - before,
                m.token,
            )
