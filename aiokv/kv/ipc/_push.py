"""The IPC plane's push mode (``IpcOptions(push=True)``; docs/ipc.md, "Push mode"): the
producer's half, :class:`Pusher` (a part of :class:`aiokv.kv.ipc.IpcPlane`); the
consumer's half is :class:`aiokv.kv.ipc._grant.Granter`.

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
import functools
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aiokv._runtime.threads import in_daemon
from aiokv._runtime.waiter import waiter_for

from ..._exceptions import ConfigError, IpcUnavailableError, RemoteProtocolError
from ..layouts import check_compatible, layout_from_wire
from . import _doorbell, _kernel
from ._common import AnswerWait, _mark, check_same_host, log
from ._mapping import ABORT_WORDS, _Mapping
from ._state import PlaneState
from ._wire import (
    PUSH,
    REVOKE,
    REVOKED,
    Descriptor,
    Grant,
    PushOffer,
    decode_message,
    parse_revoke,
    revoke_record,
)

if TYPE_CHECKING:
    from ._parts import Producing

#: a fallback release's reason when the consumer refused a pushed request (under another
#: grant, or with none): the producer stops pushing to it and sends this one the
#: ordinary way
PUSH_REFUSED = "push_refused"
#: grants read ahead, and request ids answered by pull, a producer keeps per consumer
#: (and revoke answers a consumer keeps per producer)
_MAX_HELD = 4096
_REVOKE_B = bytes((REVOKE,))
#: how often an abandoned layer-wise push's completion event is asked (not latency-bound:
#: it only returns the push's ids buffer and event to their pools)
_ABANDONED_POLL_S = 0.001
#: how soon before a grant's deadline the producer stops using it (the consumer must not
#: be past its deadline when the copy starts)
_GRANT_MARGIN_S = 0.005


@dataclass(slots=True, eq=False)
class _PushBuf:
    """The producer's ids buffers of one pushed request (pinned host, device)."""

    cap: int
    pin: torch.Tensor
    dev: torch.Tensor
    mv: memoryview


@dataclass(slots=True, eq=False)
class _PushSave:
    """A request saved layer by layer in push mode: the consumer's grant taken at its
    first saved layer, the ids buffer filled and uploaded then, the stream of the
    latest launch (a raw handle), and the error of a launch that failed after the
    first (the request then fails)."""

    pm: _Mapping
    grant: Grant
    ab: torch.Tensor
    buf: _PushBuf | None
    stream: int | None
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class _IpcSave:
    """A request being saved layer by layer over the plane (the producer's record, kept
    beside its push part): pulled by the consumer layer by layer (``rel`` waits for its
    release), or pushed (``push``; its descriptor and release come at ``wait_saved``)."""

    to: str
    host: tuple[int, ...]
    deadline: float
    lease: float
    started: float
    rel: AnswerWait | None
    saved: set[int] = field(default_factory=set)
    events: list[tuple[int, Any, bytes]] = field(default_factory=list)
    pending: list[tuple[int, bytes, int]] = field(default_factory=list)  # (layer, event, slot)
    push: _PushSave | None = None


class Pusher:
    """The producer's half of push mode: the consumers' exports it mapped and verified,
    the grants read from their rings, its ids buffers, the push launches (whole and
    layer by layer) and their descriptors. ``producer`` is the plane's producer."""

    producer: Producing

    def __init__(self, s: PlaneState) -> None:
        self.s = s
        # consumer address -> its verified export; mappings being made; consumers whose
        # export failed (reason); the consumer's abort blocks being mapped
        self.maps: dict[str, _Mapping] = {}
        self.opening: set[str] = set()
        self.failed: dict[str, str] = {}
        self._abort_opening: set[tuple[int, int]] = set()
        self.bufs: list[_PushBuf] = []
        self.draining: list[tuple[Any, _PushBuf]] = []

    def close_all(self) -> None:
        """Stop reading every consumer's grants ring (the plane closes)."""
        for pm in self.maps.values():
            self.close(pm)
        self.maps.clear()

    def received(self, to: str, po: PushOffer) -> None:
        """A consumer's ok release carried its push offer: map and verify it in the
        background (once per consumer at a time; a later offer replaces the mapping)."""
        if not self.s.options.push or self.s.disabled or to in self.opening or self.s.closed:
            return
        old = self.maps.get(to)
        if old is not None and old.token == po.offer.token:
            return
        self.opening.add(to)
        self.s.track(self._open_push(to, po))

    async def _open_push(self, to: str, po: PushOffer) -> None:
        try:
            try:
                check_same_host(po.offer, my_boot_id=self.s.boot_id, now=self.s.clock())
                layout = layout_from_wire(po.offer.layout)
                check_compatible(layout, self.s.layout)
                await self.s.cuda_ready()
                slots = (
                    [self.s.words.slot() for _ in range(4)] if self.s.mapper.use_triton() else []
                )
                m = await in_daemon(
                    functools.partial(self.s.mapper.map_push, po, layout, slots), "aiokv-ipc-push"
                )
                self.s.words.free += slots[0::2]
            except IpcUnavailableError as exc:
                self.failed[to] = exc.reason
                self.s.count_fallback("push:" + exc.reason, to, str(exc))
                return
            except Exception as exc:
                self.failed[to] = "map_failed"
                self.s.count_fallback("push:map_failed", to, f"{type(exc).__name__}: {exc}")
                return
        finally:
            self.opening.discard(to)
        if self.s.closed:
            return
        m.reply_to = to
        if po.bell and self.s.options.doorbell:
            try:  # the consumer's grants ring (it unlinks the name once we push)
                m.bell = _doorbell.BellReader(po.bell, po.bell_key)
            except (OSError, ValueError) as exc:
                log.info("aiokv IPC plane: grants from %s come by the engine: %s", to, exc)
            else:  # read as grants arrive (woken by its FIFO), not when a request is sent
                if m.bell.wake_fd >= 0:
                    asyncio.get_running_loop().add_reader(m.bell.wake_fd, self._grants_woken, m)
        old = self.maps.get(to)
        if old is not None:
            self.close(old)
        self.maps[to] = m
        self.failed.pop(to, None)
        log.info("aiokv IPC plane: pushing to %s from now on (export %x verified)", to, m.token)

    def take_grant(
        self, rid: str, to: str, pm: _Mapping, n: int, deadline: float
    ) -> tuple[Grant, Any] | None:
        """The consumer's grant for ``rid`` if it has landed and can be used now, with the
        mapped abort block of its slot; else None (the request goes by pull, and a grant
        still on its way is collected and dropped as it lands, until ``deadline``: it is
        void, and kept it would wait for a later request of the same id)."""
        g = self._ring_grant(pm, rid)
        if g is None:
            tid = f"{rid}#ipcgrant"
            raw = self.s.channel.recv_nowait(tid, frm=to)
            if raw is None:
                self.s.port.drop(rid, [tid], to, deadline)
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
            or g.until - _GRANT_MARGIN_S <= self.s.clock()
        ):
            _mark(rid, "grant:check")
            return None
        blk = g.slot // ABORT_WORDS
        ab = pm.aborts.get(blk)
        if ab is None:
            if g.abort is not None and (pm.token, blk) not in self._abort_opening:
                self._abort_opening.add((pm.token, blk))
                self.s.track(self._map_abort(pm, blk, g.abort))
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

    def close(self, pm: _Mapping) -> None:
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
            self.s.stats.doorbell_rejected += b.rejected - before

    def _revoke(self, pm: _Mapping, rid: str, gid: int) -> None:
        """The consumer revoked grant ``gid`` of ``rid`` (its request ended; its abort word
        landed). If the grant is here untaken, it is dropped -- no request takes it now
        -- and the consumer told so by the descriptor ring; otherwise it was taken and
        answered (a push or a pull descriptor), or came by the engine: no answer."""
        g = pm.grants.get(rid)
        if g is None or g.gid != gid:
            return
        del pm.grants[rid]
        bell = self.producer.bells.get(pm.reply_to)
        if bell is not None:
            bell.post(revoke_record(REVOKED, rid, gid))

    async def _map_abort(self, pm: _Mapping, blk: int, e: Any) -> None:
        try:
            pm.aborts[blk] = await in_daemon(
                functools.partial(self.s.mapper.map_abort_block, e), "aiokv-ipc-abort"
            )
        except Exception as exc:
            log.warning("aiokv IPC plane: a consumer's abort block did not map: %r", exc)
        finally:
            self._abort_opening.discard((pm.token, blk))

    def _push_buf(self, n: int) -> _PushBuf:
        self.draining = [(ev, b) for ev, b in self.draining if not self._recycle(ev, b)]
        for i, b in enumerate(self.bufs):
            if b.cap >= 2 * n:
                return self.bufs.pop(i)
        return _PushBuf(*self.s.ids_buffers(n))

    def _recycle(self, ev: Any, b: _PushBuf) -> bool:
        """Back to the pool once the copy that read ``b`` is over (``ev`` fired)."""
        if bool(ev.query()):
            self.bufs.append(b)
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
        L = self.s.layout.num_layers
        hi = L if hi is None else hi
        fresh = buf is None
        if buf is None:
            buf = self._push_buf(n)
            _mark(g.rid, "push:buf")
            struct.pack_into(f"<{2 * n}q", buf.mv, 0, *host, *g.dst)
        word = g.slot % ABORT_WORDS
        if self.s.device.type != "cuda":  # (the CPU tests' fake: the torch copy)
            if int(ab[word]) == 0:
                ids = buf.pin[: 2 * n].view(2, n)
                _kernel.torch_pair_copy(
                    self.s.port.caches.raw(pm.word)[lo:hi],
                    pm.src_layers[lo:hi],
                    self.s.layout.block_dim,
                    ids[0],
                    ids[1],
                )
            if ev is not None:
                self.producer.record(ev)
            return buf
        theirs, own = self.s.tables(pm, lo, hi)  # (pull's orientation: source, ours)
        geo = self.s.mapper.geometry(pm, n_pairs=n, n_layers=hi - lo, parts=self.s.layout.kv_parts)
        if rs is not None:
            assert self.s.drv is not None and pm.raw is not None
            if fresh:
                self.s.drv.memcpy_htod_async(buf.dev.data_ptr(), buf.pin.data_ptr(), 16 * n, rs)
                _mark(g.rid, "push:uploaded")
            programs, args = _kernel.pair_copy_args(
                own.data_ptr(),
                theirs.data_ptr(),
                buf.dev.data_ptr(),
                ab.data_ptr(),
                self.s.device,
                word,
                **geo,
            )
            _mark(g.rid, "push:args")
            pm.raw.launch(programs, rs, args)
            _mark(g.rid, "push:launched")
        else:
            with torch.cuda.device(self.s.device):
                if fresh:
                    buf.dev.copy_(buf.pin, non_blocking=True)
                if not _kernel.launch_pair_copy(own, theirs, buf.dev, ab, word, **geo):
                    raise IpcUnavailableError("grid_too_big")
        if ev is not None:
            self.producer.record(ev)
        return buf

    def done(self, ev: Any, buf: _PushBuf) -> None:
        """A pushed request is settled: its ids buffers serve again once the copy ended."""
        if not self._recycle(ev, buf):
            self.draining.append((ev, buf))

    async def push(
        self,
        request_id: str,
        host: tuple[int, ...],
        to: str,
        deadline: float,
        pm: _Mapping,
        g: Grant,
        ab: torch.Tensor,
    ) -> bool:
        """Push mode: copy the request into the blocks of the consumer's grant ``g`` (on
        the current stream, after the KV writes), send the descriptor naming the copy's
        event and settle it like a pull. False when the launch failed before anything
        was queued (the request then goes by pull, which also answers the grant)."""
        slot, ev, ev_handle = self.producer.take_event()
        try:
            rs = self.s.raw_stream() if pm.raw is not None else None
            buf = self._launch_push(pm, g, ab, host, ev, rs)
        except Exception as exc:
            self.producer.free_events.append((slot, ev, ev_handle))
            log.warning("aiokv IPC plane: push of %r not launched: %r", request_id, exc)
            return False
        lease = self.s.clock() + max(0.0, deadline - time.monotonic())
        event = (slot, ev, ev_handle)
        if not await self._post_push(request_id, len(host), to, lease, pm, g, event, buf):
            # the consumer refused the push (nothing of it is used): the ordinary way
            await self.s.port.send_plain(
                request_id, host, to=to, timeout=max(0.0, deadline - time.monotonic())
            )
        return True

    async def _post_push(
        self,
        request_id: str,
        n: int,
        to: str,
        lease: float,
        pm: _Mapping,
        g: Grant,
        event: tuple[int, Any, bytes],
        buf: _PushBuf | None,
    ) -> bool:
        """Send the push descriptor of grant ``g`` naming ``event`` (recorded after the
        request's launches) and settle it like a pull (:meth:`Producer.post`); the ids buffer
        ``buf`` serves again once the copy ended. False: the consumer refused it."""
        _mark(request_id, "pushed")
        self.s.stats.pushed += 1
        slot, ev, handle = event
        desc = Descriptor(
            rid=request_id,
            plane=PUSH,
            n=n,
            reply_to=str(getattr(self.s.port.engine, "address", "")),
            token=pm.token,
            event=handle,
            event_slot=slot,
            lease=lease,
            gid=g.gid,
        )
        try:
            return await self.producer.post(request_id, desc, to, lease, [event])
        finally:
            if buf is not None:
                self.done(ev, buf)

    def first_layer(
        self,
        request_id: str,
        layer: int,
        host: tuple[int, ...],
        to: str,
        deadline: float,
        lease: float,
        pm: _Mapping | None,
    ) -> _IpcSave | None:
        """The first saved layer of a request whose consumer granted its blocks (push
        mode, ``pm`` its verified export): take the grant and push this layer -- no
        descriptor yet, no message per layer. None (the request is pulled layer by
        layer, which answers the grant) without a usable grant, or when this first
        launch failed before anything was queued."""
        if pm is None or not host:
            return None
        got = self.take_grant(request_id, to, pm, len(host), deadline)
        _mark(request_id, "grant:taken")
        if got is None:
            return None
        g, ab = got
        ps = _PushSave(pm, g, ab, None, None)
        try:
            rs = self._join_push_stream(ps)
            ps.buf = self._launch_push(pm, g, ab, host, None, rs, lo=layer, hi=layer + 1)
        except Exception as exc:
            log.warning("aiokv IPC plane: push of %r not launched: %r", request_id, exc)
            return None
        sv = _IpcSave(to, host, deadline, lease, time.perf_counter(), None, push=ps)
        sv.saved.add(layer)
        return sv

    def next_layer(self, sv: _IpcSave, ps: _PushSave, request_id: str, layer: int) -> None:
        """Push one more layer of a request in push mode, on the current stream after
        the layer's writes (joined first to the stream of the layers before, if it is
        another: the ids' upload and those launches come before this one and before
        the completion event). A launch that fails fails the request: the layers
        before it may be in the consumer's blocks, so it cannot go by pull any more
        (the consumer's deadline ends it, by the abort rules)."""
        if ps.error is not None:
            raise ps.error
        try:
            rs = self._join_push_stream(ps)
            self._launch_push(
                ps.pm, ps.grant, ps.ab, sv.host, None, rs, buf=ps.buf, lo=layer, hi=layer + 1
            )
        except Exception as exc:
            ps.error = exc
            raise
        sv.saved.add(layer)

    def _join_push_stream(self, ps: _PushSave) -> int | None:
        """Order the current stream after the stream a pushed request's earlier layers
        were launched on, when it is another one (a torch event; serving engines save
        every layer from one stream, so this is rare). Returns the current stream as
        :meth:`_launch_push` takes it (a raw handle for the driver's launch, or None)."""
        if self.s.device.type != "cuda":
            return None
        rs = self.s.raw_stream() if ps.pm.raw is not None else None
        now = rs if rs is not None else int(torch.cuda.current_stream(self.s.device).cuda_stream)
        if now == ps.stream:
            return rs
        if ps.stream is not None:
            joined = torch.cuda.Event()  # type: ignore[no-untyped-call]
            old = torch.cuda.ExternalStream(ps.stream, device=self.s.device)  # type: ignore[no-untyped-call]
            joined.record(old)
            torch.cuda.current_stream(self.s.device).wait_event(joined)
        ps.stream = now
        return rs

    async def saved(self, request_id: str, sv: _IpcSave, ps: _PushSave) -> None:
        """``wait_saved`` of a request pushed layer by layer: record the IPC event
        after its last launch, send the push descriptor naming it and settle it like a
        whole push. With a layer never saved (or a launch that failed) nothing is sent:
        the consumer's deadline ends its grant (docs/ipc.md, "Push mode"), and the
        request joins ``finished_sending()`` once the launches made have ended."""
        L = self.s.layout.num_layers
        missing = [i for i in range(L) if i not in sv.saved]
        slot, ev, handle = self.producer.take_event()
        try:
            self._join_push_stream(ps)
            self.producer.record(ev)  # after every launch of the request
        except Exception as exc:  # (CUDA failing: the launches before may have run)
            ps.error = ps.error or exc
        if missing or ps.error is not None:
            self.s.track(self._push_abandoned(request_id, sv, ps, (slot, ev, handle)))
            self.s.port.send_failed()
            if ps.error is not None:
                raise ps.error
            raise ConfigError(
                f"request {request_id!r}: layers {missing[:8]}{'...' if len(missing) > 8 else ''} "
                "were never saved"
            )
        event = (slot, ev, handle)
        if not await self._post_push(
            request_id, len(sv.host), sv.to, sv.lease, ps.pm, ps.grant, event, ps.buf
        ):  # the consumer refused the push: every layer the ordinary way
            await self.producer.save_plain(request_id, sv)

    async def _push_abandoned(
        self, request_id: str, sv: _IpcSave, ps: _PushSave, event: tuple[int, Any, bytes]
    ) -> None:
        """A layer-wise push that sends no descriptor: once its launches ended (the event
        recorded after them fired, or the lease and grace passed) its ids buffer and
        event serve again and the request joins ``finished_sending()`` (after the lease
        and grace at the latest, as a pulled request: our stream orders any later write
        of these blocks after the launches anyway)."""
        until = time.monotonic() + max(0.0, sv.lease - self.s.clock()) + self.s.options.grace_s
        ev = event[1]
        # (asked every millisecond on the loop's waiter; never fired in time: the buffer
        # and the event are not reused)
        if await waiter_for().wait_until(ev.query, until, interval=_ABANDONED_POLL_S):
            if ps.buf is not None:  # fired: the launches are over
                self.done(ev, ps.buf)
            self.producer.free_events.append(event)
        self.s.port.blocks_free(request_id)
