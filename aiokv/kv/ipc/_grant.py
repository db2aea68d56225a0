"""The consumer's half of the IPC plane's push mode (:class:`Granter`, a part of
:class:`aiokv.kv.ipc.IpcPlane`; docs/ipc.md, "Push mode"): its own export offered to a
producer, each whole request's blocks granted to that producer, the wait for its push,
and the rules that settle a grant that ends without one (:mod:`aiokv.kv.ipc._push` has
them and the producer's half)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from typing import TYPE_CHECKING

import torch

from aiokv._runtime.deadlines import _time_left
from aiokv._runtime.waiter import waiter_for

from ..._exceptions import (
    AiokvTimeoutError,
    IpcUnavailableError,
    RemoteProtocolError,
    TransferTimeoutError,
)
from . import _doorbell
from ._common import _mark, log
from ._mapping import ABORT_WORDS, _Mapping, _pid_alive
from ._mapping import seg_bytes as _seg_bytes
from ._push import PUSH_REFUSED
from ._state import PlaneState
from ._wire import LAYERS, PUSH, REVOKE, Descriptor, Grant, PushOffer, Release, revoke_record

if TYPE_CHECKING:
    from ._parts import Arrivals, Producing, Receiving

#: how often an aborted grant's state is asked until it is settled (or ``grace_s`` passed)
_SETTLE_POLL_S = 0.001


class Granter:
    """The consumer's half of push mode: its push offer (made once, with the buffers it
    names), the grants, the waits for pushes. ``producer`` (for the export the offer
    names), ``consumer`` and ``inbox`` are the plane's."""

    producer: Producing
    consumer: Receiving
    inbox: Arrivals

    def __init__(self, s: PlaneState) -> None:
        self.s = s
        self.offer: PushOffer | None = None
        self.keep: list[torch.Tensor] = []

    def offer_push(self, m: _Mapping) -> PushOffer | None:
        """Our export for push mode, to send with an ok release to the producer of ``m``
        (once per mapping), or None (push off, sent already, or it cannot be made)."""
        if not self.s.options.push or m.push_offered or self.s.disabled:
            return None
        m.push_offered = True
        base = self._push_base()
        if base is None or not self.s.options.doorbell:
            return base
        try:  # our grants' ring to this producer (named only in this offer)
            m.grant_bell = _doorbell.BellWriter()
        except OSError as exc:
            log.info("aiokv IPC plane: grants go by the engine alone: %s", exc)
            return base
        return dataclasses.replace(base, bell=m.grant_bell.name, bell_key=m.grant_bell.key)

    def _push_base(self) -> PushOffer | None:
        """Our export for push mode without a grants ring (made once), or None."""
        if self.offer is None:
            try:
                ex = self.producer.make_export()
                seg = _seg_bytes(self.s.layout)
                # the producer zeroes it before its probe writes it: no fill here (a
                # kernel's first launch, and a wait for it, on the loop)
                target = torch.empty(2 * seg, dtype=torch.uint8, device=self.s.device)
                self.keep.append(target)
                self.offer = PushOffer(
                    ex.offer,
                    self.s.backend.export(target.untyped_storage()),
                    self.s.words.export(0),
                )
            except Exception as exc:
                log.warning("aiokv IPC plane: no push offer (%s: %s)", type(exc).__name__, exc)
                return None
        return self.offer

    def token(self) -> int:
        """Our push export's token (a pushed descriptor names it), 0 before there is one."""
        return self.offer.offer.token if self.offer is not None else 0

    def source(self, frm: str | None) -> _Mapping | None:
        """The verified mapping of producer ``frm`` when it said it can push to us (with
        ``frm`` None: the one producer that can, if exactly one can)."""
        ms = [
            m
            for m in self.s.maps.values()
            if m.can_push and not m.broken and (frm is None or m.reply_to == frm)
        ]
        return ms[0] if len(ms) == 1 else None

    async def recv_granted(
        self,
        rid: str,
        host: tuple[int, ...],
        frm: str | None,
        deadline: float,
        m: _Mapping,
        *,
        layerwise: bool,
    ) -> str:
        """A request in push mode (whole, or saved layer by layer: ``layerwise``): grant
        its blocks to the producer of ``m``, then wait for the answer (from ``frm``, or
        anyone when None) -- a push (wait for its copy's end) or any other descriptor
        (the grant is void; the request goes on as that descriptor says)."""
        early = self.inbox.desc_nowait(rid, frm, deadline)
        if early is not None:  # answered already (we come late): no grant
            return await self.consumer.after_desc(
                rid, host, early[0], early[1], frm, deadline, layerwise=layerwise, rung=early[2]
            )
        _mark(rid, "grant")
        g = self.s.words.slot()
        blk = g // ABORT_WORDS
        gid = secrets.randbits(62) | 1
        told = blk in m.told
        grant = Grant(rid, gid, host, g, deadline, None if told else self.s.words.export(blk))
        self.s.stats.grants += 1
        bell = m.grant_bell
        if bell is not None and m.can_push and not m.grant_bell_unlinked:
            bell.open_wake()  # the producer opened both ends before it said it can push:
            bell.unlink()  # each grant wakes it; the names can go
            m.grant_bell_unlinked = True
        by_ring = told and bell is not None and bell.post(grant.to_ring())
        if not by_ring:
            self.s.send_msg(f"{rid}#ipcgrant", grant.to_wire(), m.reply_to, _time_left(deadline))
        _mark(rid, "granted")
        try:
            desc, plout, rung = await self.inbox.recv_desc(rid, frm, deadline, None)
        except BaseException as exc:
            await self._grant_aborted(m, g, gid, rid, frm, deadline, None, exc, by_ring=by_ring)
            raise
        if desc.plane != PUSH:  # answered by pull (or the ordinary way): the grant is void
            self.s.words.set(g)
            if desc.plane in ("ipc", "chunks", LAYERS):
                m.can_push = m.can_push and desc.can_push
            return await self.consumer.after_desc(
                rid, host, desc, plout, frm, deadline, layerwise=layerwise, rung=rung
            )
        if (
            desc.rid != rid
            or desc.gid != gid
            or desc.n != len(host)
            or self.offer is None
            or desc.token != self.offer.offer.token
        ):
            # another grant's push (that grant's word was set when it ended: it wrote
            # nothing), or nonsense: this grant is void too
            self.s.words.set(g)
            return await self.refuse_push(
                desc,
                rid,
                host,
                frm,
                deadline,
                m.reply_to,
                "a push descriptor not for this grant",
                layerwise=layerwise,
            )
        t0 = time.perf_counter()
        until = min(deadline, time.monotonic() + desc.lease - self.s.clock())
        try:
            ev = self.s.event(m, desc.event_slot, desc.event)
            await self.s.wait_ready(ev, until, "the producer's push did not end")
        except BaseException as exc:
            await self._grant_aborted(m, g, gid, rid, frm, deadline, desc, exc)
            raise
        _mark(rid, "done")
        m.told.add(blk)
        self.s.words.free.append(g)  # (never set; the copy that read it is over)
        self.s.release_soon(desc, Release(rid, True, reason="ring" if rung else ""))
        self.s.stats.pushes_received += 1
        self.s.stats.requests_received += 1
        self.s.stats.bytes_received += self.s.layout.request_nbytes(desc.n)
        self.s.port.received(rid, desc.n, t0)
        _mark(rid, "return")
        return "ipc"

    async def refuse_push(
        self,
        desc: Descriptor,
        rid: str,
        host: tuple[int, ...],
        frm: str | None,
        deadline: float,
        peer: str,
        detail: str,
        *,
        layerwise: bool = False,
    ) -> str:
        """Refuse a push that is not for a grant of this request (``push_refused``): the
        producer at ``peer`` is granted nothing more (and stops pushing to us), and the
        request comes the ordinary way (``layerwise``: as the producer saves its layers)."""
        self.s.release(desc, Release(rid, False, fallback=True, reason=PUSH_REFUSED))
        self.s.count_fallback(PUSH_REFUSED, peer, detail)
        for m in self.s.maps.values():
            if m.reply_to == peer:
                m.can_push = False
        await self.s.recv_plain(rid, host, frm, deadline, layerwise)
        return "engine"

    async def _grant_aborted(
        self,
        m: _Mapping,
        g: int,
        gid: int,
        rid: str,
        frm: str | None,
        deadline: float,
        desc: Descriptor | None,
        exc: BaseException,
        *,
        by_ring: bool = False,
    ) -> None:
        """A granted request failed (cancelled, deadline, error): set the grant's abort
        word and settle the grant before the caller may reuse the blocks -- the word
        landed, and the producer's push (``desc``, or one that comes within the grace
        period) ended, or its answer says it never pushed (a descriptor, or -- for a
        grant sent by the ring and revoked there once the word landed -- its answer that
        it had not taken the grant and never will), or it is gone. Raises
        :class:`TransferTimeoutError` for a timeout; the caller re-raises the rest."""
        self.s.words.set(g)  # never reused: a stale grant copies nothing
        self.s.stats.aborted += 1
        landed = self.s.words.landed()
        end = time.monotonic() + self.s.options.grace_s
        revoke = by_ring and desc is None
        rung = False  # (the answer came by the ring: its engine copy is dropped already)

        def settles() -> bool:
            """One look at the grant's state (every millisecond until ``end``): whether
            it is settled now."""
            nonlocal desc, revoke, rung
            if desc is None:
                with contextlib.suppress(RemoteProtocolError):  # (a bad answer: none)
                    got = self.inbox.desc_nowait(rid, frm, deadline)
                    if got is not None:
                        desc, _, rung = got
            if not bool(landed.query()):
                return False
            if revoke and desc is None and m.grant_bell is not None:
                # (after the word landed: a launch after the producer read this
                # copies nothing, and it answers only for a grant it never took)
                m.grant_bell.post(revoke_record(REVOKE, rid, gid))
            revoke = False
            if m.revoked.get(gid) == rid:
                del m.revoked[gid]
                return True  # the producer never took it, and never will
            settled = False
            if desc is not None and (desc.plane != PUSH or desc.gid != gid):
                settled = True  # it answered without using this grant
            elif desc is not None:
                try:
                    settled = bool(self.s.event(m, desc.event_slot, desc.event).query())
                except IpcUnavailableError:
                    settled = False
            return settled or bool(m.pid and not _pid_alive(m.pid))

        settled = await waiter_for().wait_until(settles, end, interval=_SETTLE_POLL_S)
        if not settled:
            if desc is not None:  # pushed, and its copy did not end in time
                self.s.stats.push_unsettled += 1
                log.warning(
                    "aiokv IPC plane: the push of %r did not end within the grace period "
                    "after its abort (its abort word is set)",
                    rid,
                )
        if not rung:  # the answer's engine copy, or the answer itself, still to come
            self.s.port.drop(rid, [f"{rid}#ipc"], frm, time.monotonic() + 60.0)
        if desc is not None and desc.plane != "chunks":  # (the plane's: it waits for this)
            reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            self.s.release(desc, Release(rid, False, reason=reason))
        self.s.port.recv_failed()
        if isinstance(exc, (AiokvTimeoutError, asyncio.TimeoutError, TimeoutError)) and not (
            isinstance(exc, TransferTimeoutError)
        ):
            raise TransferTimeoutError(f"IPC push of {rid!r} did not end within its deadline")
