"""The IPC plane's push mode (``IpcOptions(push=True)``; docs/ipc.md, "Push mode"), both
sides, a base of :class:`aiokv.kv.ipc.IpcPlane`.

A consumer that pulled a first request from a producer sends it, with that request's
ok release, its own export (:class:`PushOffer`); the producer maps and verifies it and
says so in its next descriptors (``can_push``). From then on the consumer *grants*
each whole request's blocks as it allocates them (:class:`Grant`: destination ids, an
abort slot of its own, a deadline), and a producer that holds the grant when it sends
launches the copy itself, on its current stream right after its KV writes, records an
IPC event after it and sends a :data:`PUSH` descriptor naming that event. The consumer
returns once the event fired. A request without a grant in time goes by pull.

Rules (docs/ipc.md, "Push mode"; docs/design.md, "Push after a grant"): the producer launches only for a grant it
took before it answered the request, not past the grant's deadline, with ids checked
against the consumer's layout; every grant that ends without its push (a pull answer,
cancellation, a deadline) has its abort word set and never reused, so a stale grant
copies nothing; an aborted grant is settled -- its blocks may be reused -- once the
word has landed and the producer's answer came (a push: its copy's end; for a grant
sent by the ring and revoked there, the producer's word that it dropped it untaken),
or the producer is gone, or ``grace_s`` passed (then only a copy launched before the
word landed could still write, and its descriptor would have come right after its
launch).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aiokv._runtime.deadlines import _time_left
from aiokv._runtime.threads import in_daemon
from aiokv._runtime.waiter import waiter_for

from ..._exceptions import (
    AiokvTimeoutError,
    IpcUnavailableError,
    RemoteProtocolError,
    TransferTimeoutError,
)
from ..layouts import check_compatible, layout_from_wire
from . import _doorbell, _kernel
from ._common import _mark, _PlaneBase, check_same_host, log
from ._mapping import ABORT_WORDS, AbortWords, Mapper, _Mapping, _pid_alive
from ._mapping import seg_bytes as _seg_bytes
from ._wire import (
    LAYERS,
    PUSH,
    REVOKE,
    REVOKED,
    Descriptor,
    Grant,
    PushOffer,
    Release,
    decode_message,
    parse_revoke,
    revoke_record,
)

if TYPE_CHECKING:
    from ..layouts import KVLayout
    from ._common import _Export

#: a fallback release's reason when the consumer refused a pushed request (under another
#: grant, or with none): the producer stops pushing to it and sends this one the
#: ordinary way
PUSH_REFUSED = "push_refused"
#: grants read ahead, and request ids answered by pull, a producer keeps per consumer
#: (and revoke answers a consumer keeps per producer)
_MAX_HELD = 4096
_REVOKE_B = bytes((REVOKE,))
#: how soon before a grant's deadline the producer stops using it (the consumer must not
#: be past its deadline when the copy starts)
_GRANT_MARGIN_S = 0.005
#: how often an aborted grant's state is asked until it is settled (or ``grace_s`` passed)
_SETTLE_POLL_S = 0.001


@dataclass(slots=True, eq=False)
class _PushBuf:
    """The producer's ids buffers of one pushed request (pinned host, device)."""

    cap: int
    pin: torch.Tensor
    dev: torch.Tensor
    mv: memoryview


class _PushSide(_PlaneBase):
    """Push mode's two halves (state set in ``IpcPlane.__init__`` via
    :meth:`_init_push`)."""

    _maps: dict[int, _Mapping]
    _words: AbortWords
    _mapper: Mapper
    _prepared: asyncio.Future[None] | None
    _export: _Export | None
    _bells: dict[str, _doorbell.BellWriter | None]

    if TYPE_CHECKING:  # (IpcPlane and its producer side provide these)

        def _make_export(self) -> _Export: ...
        def _record(self, ev: Any) -> None: ...
        def _tables(self, m: _Mapping, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]: ...
        def _event(self, m: _Mapping, slot: int, handle: bytes) -> Any: ...
        def _release(self, desc: Descriptor, rel: Release) -> None: ...
        def _release_soon(self, desc: Descriptor, rel: Release) -> None: ...
        def _bell_take(self, rid: str, frm: str | None) -> tuple[Descriptor, bool] | None: ...
        async def _wait_ready(self, ev: Any, until: float, what: str = ...) -> None: ...
        def _desc_nowait(
            self, rid: str, frm: str | None, deadline: float
        ) -> tuple[Descriptor, KVLayout | None, bool] | None: ...
        async def _recv_desc(
            self, rid: str, frm: str | None, deadline: float, staged: Any = None
        ) -> tuple[Descriptor, KVLayout | None, bool]: ...
        async def _after_desc(
            self,
            request_id: str,
            host: tuple[int, ...],
            desc: Descriptor,
            plout: KVLayout | None,
            frm: str | None,
            deadline: float,
            *,
            layerwise: bool,
            rung: bool,
        ) -> str: ...

    def _init_push(self) -> None:
        # producer: consumer address -> its verified export; mappings being made;
        # consumers whose export failed (reason); the consumer's abort blocks being mapped
        self._push_maps: dict[str, _Mapping] = {}
        self._push_opening: set[str] = set()
        self._push_failed: dict[str, str] = {}
        self._abort_opening: set[tuple[int, int]] = set()
        self._push_bufs: list[_PushBuf] = []
        self._push_draining: list[tuple[Any, _PushBuf]] = []
        # consumer: our push offer (made once) and the buffers it names
        self._push_offer: PushOffer | None = None
        self._push_keep: list[torch.Tensor] = []

    # ================================================================== consumer

    def _offer_push(self, m: _Mapping) -> PushOffer | None:
        """Our export for push mode, to send with an ok release to the producer of ``m``
        (once per mapping), or None (push off, sent already, or it cannot be made)."""
        if not self.options.push or m.push_offered or self.disabled:
            return None
        m.push_offered = True
        base = self._push_base()
        if base is None or not self.options.doorbell:
            return base
        try:  # our grants' ring to this producer (named only in this offer)
            m.grant_bell = _doorbell.BellWriter()
        except OSError as exc:
            log.info("aiokv IPC plane: grants go by the engine alone: %s", exc)
            return base
        return dataclasses.replace(base, bell=m.grant_bell.name, bell_key=m.grant_bell.key)

    def _push_base(self) -> PushOffer | None:
        """Our export for push mode without a grants ring (made once), or None."""
        if self._push_offer is None:
            try:
                ex = self._make_export()
                seg = _seg_bytes(self.layout)
                # the producer zeroes it before its probe writes it: no fill here (a
                # kernel's first launch, and a wait for it, on the loop)
                target = torch.empty(2 * seg, dtype=torch.uint8, device=self.device)
                self._push_keep.append(target)
                self._push_offer = PushOffer(
                    ex.offer,
                    self.backend.export(target.untyped_storage()),
                    self._words.export(0),
                )
            except Exception as exc:
                log.warning("aiokv IPC plane: no push offer (%s: %s)", type(exc).__name__, exc)
                return None
        return self._push_offer

    def _push_token(self) -> int:
        """Our push export's token (a pushed descriptor names it), 0 before there is one."""
        return self._push_offer.offer.token if self._push_offer is not None else 0

    def _push_source(self, frm: str | None) -> _Mapping | None:
        """The verified mapping of producer ``frm`` when it said it can push to us (with
        ``frm`` None: the one producer that can, if exactly one can)."""
        ms = [
            m
            for m in self._maps.values()
            if m.can_push and not m.broken and (frm is None or m.reply_to == frm)
        ]
        return ms[0] if len(ms) == 1 else None

    async def _recv_granted(
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
        early = self._desc_nowait(rid, frm, deadline)
        if early is not None:  # answered already (we come late): no grant
            return await self._after_desc(
                rid, host, early[0], early[1], frm, deadline, layerwise=layerwise, rung=early[2]
            )
        _mark(rid, "grant")
        g = self._words.slot()
        blk = g // ABORT_WORDS
        gid = secrets.randbits(62) | 1
        told = blk in m.told
        grant = Grant(rid, gid, host, g, deadline, None if told else self._words.export(blk))
        self._stats.grants += 1
        bell = m.grant_bell
        if bell is not None and m.can_push and not m.grant_bell_unlinked:
            bell.open_wake()  # the producer opened both ends before it said it can push:
            bell.unlink()  # each grant wakes it; the names can go
            m.grant_bell_unlinked = True
        by_ring = told and bell is not None and bell.post(grant.to_ring())
        if not by_ring:
            self._send_msg(f"{rid}#ipcgrant", grant.to_wire(), m.reply_to, _time_left(deadline))
        _mark(rid, "granted")
        try:
            desc, plout, rung = await self._recv_desc(rid, frm, deadline, None)
        except BaseException as exc:
            await self._grant_aborted(m, g, gid, rid, frm, deadline, None, exc, by_ring=by_ring)
            raise
        if desc.plane != PUSH:  # answered by pull (or the ordinary way): the grant is void
            self._words.set(g)
            if desc.plane in ("ipc", "chunks", LAYERS):
                m.can_push = m.can_push and desc.can_push
            return await self._after_desc(
                rid, host, desc, plout, frm, deadline, layerwise=layerwise, rung=rung
            )
        if (
            desc.rid != rid
            or desc.gid != gid
            or desc.n != len(host)
            or self._push_offer is None
            or desc.token != self._push_offer.offer.token
        ):
            # another grant's push (that grant's word was set when it ended: it wrote
            # nothing), or nonsense: this grant is void too
            self._words.set(g)
            return await self._refuse_push(
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
        until = min(deadline, time.monotonic() + desc.lease - self._clock())
        try:
            ev = self._event(m, desc.event_slot, desc.event)
            await self._wait_ready(ev, until, "the producer's push did not end")
        except BaseException as exc:
            await self._grant_aborted(m, g, gid, rid, frm, deadline, desc, exc)
            raise
        _mark(rid, "done")
        m.told.add(blk)
        self._words.free.append(g)  # (never set; the copy that read it is over)
        self._release_soon(desc, Release(rid, True, reason="ring" if rung else ""))
        self._stats.pushes_received += 1
        self._stats.requests_received += 1
        self._stats.bytes_received += self.layout.request_nbytes(desc.n)
        self.port.received(rid, desc.n, t0)
        _mark(rid, "return")
        return "ipc"

    async def _refuse_push(
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
        self._release(desc, Release(rid, False, fallback=True, reason=PUSH_REFUSED))
        self._count_fallback(PUSH_REFUSED, peer, detail)
        for m in self._maps.values():
            if m.reply_to == peer:
                m.can_push = False
        await self._recv_plain(rid, host, frm, deadline, layerwise)
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
        self._words.set(g)  # never reused: a stale grant copies nothing
        self._stats.aborted += 1
        landed = self._words.landed()
        end = time.monotonic() + self.options.grace_s
        revoke = by_ring and desc is None
        rung = False  # (the answer came by the ring: its engine copy is dropped already)

        def settles() -> bool:
            """One look at the grant's state (every millisecond until ``end``): whether
            it is settled now."""
            nonlocal desc, revoke, rung
            if desc is None:
                with contextlib.suppress(RemoteProtocolError):  # (a bad answer: none)
                    got = self._desc_nowait(rid, frm, deadline)
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
                    settled = bool(self._event(m, desc.event_slot, desc.event).query())
                except IpcUnavailableError:
                    settled = False
            return settled or bool(m.pid and not _pid_alive(m.pid))

        settled = await waiter_for().wait_until(settles, end, interval=_SETTLE_POLL_S)
        if not settled:
            if desc is not None:  # pushed, and its copy did not end in time
                self._stats.push_unsettled += 1
                log.warning(
                    "aiokv IPC plane: the push of %r did not end within the grace period "
                    "after its abort (its abort word is set)",
                    rid,
                )
        if not rung:  # the answer's engine copy, or the answer itself, still to come
            self.port.drop(rid, [f"{rid}#ipc"], frm, time.monotonic() + 60.0)
        if desc is not None and desc.plane != "chunks":  # (the plane's: it waits for this)
            reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            self._release(desc, Release(rid, False, reason=reason))
        self.port.recv_failed()
        if isinstance(exc, (AiokvTimeoutError, asyncio.TimeoutError, TimeoutError)) and not (
            isinstance(exc, TransferTimeoutError)
        ):
            raise TransferTimeoutError(f"IPC push of {rid!r} did not end within its deadline")

    # ================================================================== producer

    def _push_received(self, to: str, po: PushOffer) -> None:
        """A consumer's ok release carried its push offer: map and verify it in the
        background (once per consumer at a time; a later offer replaces the mapping)."""
        if not self.options.push or self.disabled or to in self._push_opening or self._closed:
            return
        old = self._push_maps.get(to)
        if old is not None and old.token == po.offer.token:
            return
        self._push_opening.add(to)
        self._track(self._open_push(to, po))

    async def _open_push(self, to: str, po: PushOffer) -> None:
        try:
            try:
                check_same_host(po.offer, my_boot_id=self._boot_id, now=self._clock())
                layout = layout_from_wire(po.offer.layout)
                check_compatible(layout, self.layout)
                if self.device.type == "cuda":
                    if self._prepared is None:
                        self._prepared = in_daemon(self._words.prepare, "aiokv-ipc-prep")
                    await asyncio.shield(self._prepared)
                slots = [self._words.slot() for _ in range(4)] if self._mapper.use_triton() else []
                m = await in_daemon(
                    functools.partial(self._mapper.map_push, po, layout, slots), "aiokv-ipc-push"
                )
                self._words.free += slots[0::2]
            except IpcUnavailableError as exc:
                self._push_failed[to] = exc.reason
                self._count_fallback("push:" + exc.reason, to, str(exc))
                return
            except Exception as exc:
                self._push_failed[to] = "map_failed"
                self._count_fallback("push:map_failed", to, f"{type(exc).__name__}: {exc}")
                return
        finally:
            self._push_opening.discard(to)
        if self._closed:
            return
        m.reply_to = to
        if po.bell and self.options.doorbell:
            try:  # the consumer's grants ring (it unlinks the name once we push)
                m.bell = _doorbell.BellReader(po.bell, po.bell_key)
            except (OSError, ValueError) as exc:
                log.info("aiokv IPC plane: grants from %s come by the engine: %s", to, exc)
            else:  # read as grants arrive (woken by its FIFO), not when a request is sent
                if m.bell.wake_fd >= 0:
                    asyncio.get_running_loop().add_reader(m.bell.wake_fd, self._grants_woken, m)
        old = self._push_maps.get(to)
        if old is not None:
            self._close_push(old)
        self._push_maps[to] = m
        self._push_failed.pop(to, None)
        log.info("aiokv IPC plane: pushing to %s from now on (export %x verified)", to, m.token)

    def _take_grant(
        self, rid: str, to: str, pm: _Mapping, n: int, deadline: float
    ) -> tuple[Grant, Any] | None:
        """The consumer's grant for ``rid`` if it has landed and can be used now, with the
        mapped abort block of its slot; else None (the request goes by pull, and a grant
        still on its way is collected and dropped as it lands, until ``deadline``: it is
        void, and kept it would wait for a later request of the same id)."""
        g = self._ring_grant(pm, rid)
        if g is None:
            tid = f"{rid}#ipcgrant"
            raw = self.channel.recv_nowait(tid, frm=to)
            if raw is None:
                self.port.drop(rid, [tid], to, deadline)
                if pm.bell is not None:  # one by the ring, later, is void too
                    pm.pulled[rid] = None
                    if len(pm.pulled) > _MAX_HELD:
                        del pm.pulled[next(iter(pm.pulled))]
                return None
            try:
                g = Grant.from_wire(decode_message(raw))
            except RemoteProtocolError as exc:
                log.warning("aiokv IPC plane: a bad grant from %s: %s", to, exc)
                return None
        if (
            g.rid != rid
            or len(g.dst) != n
            or max(g.dst) >= pm.layout.num_blocks
            or g.until - _GRANT_MARGIN_S <= self._clock()
        ):
            _mark(rid, "grant:check")
            return None
        blk = g.slot // ABORT_WORDS
        ab = pm.aborts.get(blk)
        if ab is None:
            if g.abort is not None and (pm.token, blk) not in self._abort_opening:
                self._abort_opening.add((pm.token, blk))
                self._track(self._map_abort(pm, blk, g.abort))
            _mark(rid, "grant:block")
            return None
        return g, ab

    def _ring_grant(self, pm: _Mapping, rid: str) -> Grant | None:
        """``rid``'s grant from the consumer's grants ring, if it has one: read as it came
        (:meth:`_grants_woken`), or now."""
        got: Grant | None = pm.grants.pop(rid, None)
        if got is None and pm.bell is not None:
            self._read_grants(pm)
            got = pm.grants.pop(rid, None)
        return got

    def _grants_woken(self, pm: _Mapping) -> None:
        """The consumer posted a grant (its wake FIFO): read the ring now, off the path of
        the request that will use it."""
        b = pm.bell
        if b is None:
            return
        if not b.drain_wake():  # the consumer closed it: read when a request is sent
            self._unwatch_grants(pm)
        self._read_grants(pm)

    def _close_push(self, pm: _Mapping) -> None:
        """A push mapping is no longer used: stop reading its grants ring (the mapping
        itself goes with its last reference: nothing of ours runs on it any more once
        the requests that pushed through it settled)."""
        self._unwatch_grants(pm)
        if pm.bell is not None:
            pm.bell.close()
            pm.bell = None

    def _unwatch_grants(self, pm: _Mapping) -> None:
        b = pm.bell
        if b is not None and b.wake_fd >= 0:
            with contextlib.suppress(Exception):  # (no loop any more at interpreter exit)
                asyncio.get_running_loop().remove_reader(b.wake_fd)
            b.close_wake()

    def _read_grants(self, pm: _Mapping) -> None:
        """Take the grants in the consumer's ring into ``pm.grants``. A record that does
        not decode is rejected (counted); a grant for a request this side answered by
        pull already is void and dropped."""
        b = pm.bell
        assert b is not None
        before = b.rejected
        for payload in b.poll():
            try:
                if payload[:1] == _REVOKE_B:
                    self._revoke(pm, *parse_revoke(payload, REVOKE))
                    continue
                g = Grant.from_ring(payload)
            except RemoteProtocolError:
                b.rejected += 1
                continue
            if g.rid in pm.pulled:  # answered by pull before it came
                del pm.pulled[g.rid]
                continue
            pm.grants.pop(g.rid, None)
            pm.grants[g.rid] = g
            if len(pm.grants) > _MAX_HELD:
                del pm.grants[next(iter(pm.grants))]
        if b.rejected != before:
            self._stats.doorbell_rejected += b.rejected - before

    def _revoke(self, pm: _Mapping, rid: str, gid: int) -> None:
        """The consumer revoked grant ``gid`` of ``rid`` (its request ended; its abort word
        landed). If the grant is here untaken, it is dropped -- no request takes it now
        -- and the consumer told so by the descriptor ring; otherwise it was taken and
        answered (a push or a pull descriptor), or came by the engine: no answer."""
        g = pm.grants.get(rid)
        if g is None or g.gid != gid:
            return
        del pm.grants[rid]
        bell = self._bells.get(pm.reply_to)
        if bell is not None:
            bell.post(revoke_record(REVOKED, rid, gid))

    async def _map_abort(self, pm: _Mapping, blk: int, e: Any) -> None:
        try:
            pm.aborts[blk] = await in_daemon(
                functools.partial(self._mapper.map_abort_block, e), "aiokv-ipc-abort"
            )
        except Exception as exc:
            log.warning("aiokv IPC plane: a consumer's abort block did not map: %r", exc)
        finally:
            self._abort_opening.discard((pm.token, blk))

    def _push_buf(self, n: int) -> _PushBuf:
        self._push_draining = [(ev, b) for ev, b in self._push_draining if not self._recycle(ev, b)]
        for i, b in enumerate(self._push_bufs):
            if b.cap >= 2 * n:
                return self._push_bufs.pop(i)
        return _PushBuf(*self._ids_buffers(n))

    def _recycle(self, ev: Any, b: _PushBuf) -> bool:
        """Back to the pool once the copy that read ``b`` is over (``ev`` fired)."""
        if bool(ev.query()):
            self._push_bufs.append(b)
            return True
        return False

    def _launch_push(
        self,
        pm: _Mapping,
        g: Grant,
        ab: torch.Tensor,
        host: tuple[int, ...],
        ev: Any,
        rs: int | None,
        *,
        buf: _PushBuf | None = None,
        lo: int = 0,
        hi: int | None = None,
    ) -> _PushBuf:
        """Enqueue the copy of ``host`` (ours) into ``g.dst`` (the consumer's), layers
        ``[lo, hi)`` (all by default), on the current stream -- after the KV writes
        queued so far -- and record ``ev`` after it (None: no record). The kernel reads
        the grant's abort word first and copies nothing once it is set. ``rs``: the
        current stream as a raw handle for the driver's launch (None: torch's and
        Triton's calls). ``buf``: the ids buffer an earlier launch of the same request
        filled and uploaded on this stream (layer-wise push); else one is taken and
        filled here."""
        n = len(host)
        L = self.layout.num_layers
        hi = L if hi is None else hi
        fresh = buf is None
        if buf is None:
            buf = self._push_buf(n)
            _mark(g.rid, "push:buf")
            struct.pack_into(f"<{2 * n}q", buf.mv, 0, *host, *g.dst)
        word = g.slot % ABORT_WORDS
        if self.device.type != "cuda":  # (the CPU tests' fake: the torch copy)
            if int(ab[word]) == 0:
                ids = buf.pin[: 2 * n].view(2, n)
                _kernel.torch_pair_copy(
                    self.port.caches.raw(pm.word)[lo:hi],
                    pm.src_layers[lo:hi],
                    self.layout.block_dim,
                    ids[0],
                    ids[1],
                )
            if ev is not None:
                self._record(ev)
            return buf
        theirs, own = self._tables(pm, lo, hi)  # (pull's orientation: source, ours)
        geo = self._mapper.geometry(pm, n_pairs=n, n_layers=hi - lo, parts=self.layout.kv_parts)
        if rs is not None:
            assert self._drv is not None and pm.raw is not None
            if fresh:
                self._drv.memcpy_htod_async(buf.dev.data_ptr(), buf.pin.data_ptr(), 16 * n, rs)
                _mark(g.rid, "push:uploaded")
            programs, args = _kernel.pair_copy_args(
                own.data_ptr(),
                theirs.data_ptr(),
                buf.dev.data_ptr(),
                ab.data_ptr(),
                self.device,
                word,
                **geo,
            )
            _mark(g.rid, "push:args")
            pm.raw.launch(programs, rs, args)
            _mark(g.rid, "push:launched")
        else:
            with torch.cuda.device(self.device):
                if fresh:
                    buf.dev.copy_(buf.pin, non_blocking=True)
                if not _kernel.launch_pair_copy(own, theirs, buf.dev, ab, word, **geo):
                    raise IpcUnavailableError("grid_too_big")
        if ev is not None:
            self._record(ev)
        return buf

    def _push_done(self, ev: Any, buf: _PushBuf) -> None:
        """A pushed request is settled: its ids buffers serve again once the copy ended."""
        if not self._recycle(ev, buf):
            self._push_draining.append((ev, buf))
