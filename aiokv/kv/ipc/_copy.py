"""The consumer's copier (:class:`Copier`, owned by
:class:`aiokv.kv.ipc._consumer.Consumer`): a request's copy out of a mapped export --
staged before its descriptor came (the ring's poll may launch it), or launched once
the producer's event fired (or queued behind it: ``gpu_wait``), one launch per request
or per run of layers --, the abort rules when it fails, and the release (docs/ipc.md,
"Abort rules", "Staged launches").
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aiokv._runtime.waiter import waiter_for

from ..._exceptions import (
    AiokvTimeoutError,
    ConfigError,
    IpcUnavailableError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
)
from . import _kernel
from ._common import RING, _layer_id, _mark, _on, log
from ._mapping import _Mapping
from ._state import PlaneState
from ._wire import LAYERS, Descriptor, Release, decode_message
from ._wire_layers import LayerReady

if TYPE_CHECKING:
    from ._parts import Grants, Receiving


@dataclass(slots=True, eq=False)
class _SlotBufs:
    """Per abort slot (consumer): the ids buffers and the two events its launches use."""

    cap: int  # int64 elements of each buffer (2 n ids fit)
    pin: torch.Tensor  # pinned host (CPU caches: the only buffer)
    dev: torch.Tensor  # device copy the kernel reads
    done: Any  # recorded after each launch of the slot's request
    order: Any  # the caller's stream, recorded before the ids' upload
    mv: memoryview  # of pin, for struct.pack_into
    streams: list[Any] = field(default_factory=list)  # dev was record_stream'ed on these


@dataclass(slots=True, eq=False)
class _Staged:
    """A whole request's copy made ready before its descriptor came (consumer): the
    abort slot, its ids buffer with the destination ids written, the caller's raw
    stream at ``recv_request``, the launch's arguments. When the descriptor comes by
    the ring and everything checks out at once, the ring's poll launches it on the
    spot (:meth:`Copier.launch_staged`) instead of a loop pass later after the
    request's task decoded it again (docs/ipc.md, "Staged launches")."""

    rid: str
    m: _Mapping
    g: int
    sb: _SlotBufs
    rs: int
    n: int
    deadline: float
    programs: int
    params: Any  # the launch's parameter block (RawLaunch.params), made at staging
    t0: float = 0.0
    desc: Descriptor | None = None  # the descriptor, once the ring's poll validated it
    ready: Any = None  # ... and the producer's event it waits for
    launched: bool = False  # the copy was (or may have been) launched: abort rules apply
    error: BaseException | None = None  # a launch call that failed after the upload


class Copier:
    """The consumer's copies: each abort slot's ids buffers and events (reused, never
    reallocated per request), those retired while an upload may still be queued, the
    launches and their waits. ``consumer`` keeps the mappings' in-flight counts;
    ``granter`` gives the push offer an ok release carries."""

    def __init__(self, s: PlaneState, consumer: Receiving, granter: Grants) -> None:
        self.s = s
        self.consumer = consumer
        self.granter = granter
        self.slotbufs: dict[int, _SlotBufs] = {}
        # slot buffers whose ids' upload may still be queued (not launched, retired):
        # freed once their event fired
        self._draining: list[_SlotBufs] = []

    def _slot_bufs(self, slot: int, n: int) -> _SlotBufs:
        """The abort slot's reusable ids buffers (pinned host + device) and events.

        A slot is handed out again only after the launch that used it finished (or
        never, once its abort word was set), so its buffers can be rewritten without
        a wait: no allocation, pinning or event creation per request.
        """
        sb = self.slotbufs.get(slot)
        if sb is not None and sb.cap >= 2 * n:
            return sb
        dev = self.s.device
        cap, pin, dbuf, mv = self.s.ids_buffers(n)
        done = order = None
        if dev.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            order = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(torch.cuda.current_stream(dev))  # created now (the driver records it)
            self._draining = [d for d in self._draining if not d.done.query()]
        sb = _SlotBufs(cap, pin, dbuf, done, order, mv)
        self.slotbufs[slot] = sb
        return sb

    def _retire_slot(self, slot: int, keep: bool, upload_on: int | None = None) -> None:
        """The slot's buffers after an abort or a failed launch: never rewritten again
        (kept forever when a launch may still read them; until an event after the ids'
        upload fired when the driver queued that upload on raw stream ``upload_on``)."""
        sb = self.slotbufs.pop(slot, None)
        if sb is not None and keep:
            self.s.keep.append(sb)
        elif sb is not None and upload_on is not None and self.s.drv is not None:
            self.s.drv.event_record(sb.done.cuda_event, upload_on)
            self._draining.append(sb)

    def staging_mapping(self, frm: str | None) -> _Mapping | None:
        """The mapping a whole request from ``frm`` would be staged for (one mapping
        it can come from, with a ring and a verified raw launch), or None."""
        if self.s.drv is None or self.s.options.gpu_wait or self.s.disabled:
            return None
        ms = [
            m
            for m in self.s.maps.values()
            if m.bell is not None
            and m.raw is not None
            and not m.broken
            and (frm is None or m.reply_to == frm)
        ]
        if len(ms) != 1 or not self.s.mapper.use_triton():
            return None
        return ms[0]

    def stage(
        self, rid: str, host: tuple[int, ...], frm: str | None, deadline: float
    ) -> _Staged | None:
        """Make a whole request's copy ready ahead of its descriptor, when the driver's
        launch will serve it: one mapping it can come from (``frm``'s, or the only one),
        with a ring and a verified raw launch, the caller's current stream on this
        device. Everything but the source ids is done here, off the critical path."""
        m = self.staging_mapping(frm) if host else None
        if m is None:
            return None
        rs = self.s.raw_stream()
        if rs is None:
            return None
        n = len(host)
        g = self.s.words.slot()
        ab, slot = self.s.words.word(g)
        sb = self._slot_bufs(g, n)
        programs, args = self._raw_args(m, sb.dev, ab, slot, n, 0, self.s.layout.num_layers)
        if not 0 < programs <= _kernel.MAX_PROGRAMS:
            self.s.words.free.append(g)
            return None
        struct.pack_into(f"<{n}q", sb.mv, 8 * n, *host)  # destination ids: second half
        assert m.raw is not None
        params = m.raw.params(args)
        return _Staged(rid, m, g, sb, rs, n, deadline, programs, params)

    def unstage(self, st: _Staged | None) -> None:
        """A staged copy the ring's poll did not take: its slot serves again (no upload
        was queued with it)."""
        if st is not None and st.desc is None:
            self.s.words.free.append(st.g)

    def launch_staged(self, st: _Staged, desc: Descriptor) -> None:
        """The ring's poll has ``st``'s descriptor (decoded): check it as
        ``recv_request`` and :meth:`pull` would, and launch the copy now if the
        producer's event already fired. A descriptor that fails a check is left alone
        (the request's task goes the ordinary way, the same checks raising the same
        errors); one whose event has not fired yet stays checked (``st.desc``): the task
        waits for the event and launches (:meth:`pull_staged`)."""
        _mark(st.rid, "ring")
        m = st.m
        now = time.monotonic()
        try:  # (this runs inside the ring's poll: nothing may escape into it)
            ok = not (
                desc.rid != st.rid
                or desc.plane != "ipc"
                or desc.n != st.n
                or desc.offer is not None
                or desc.token != m.token
                or self.s.maps.get(desc.token) is not m
                or m.broken
                or max(desc.src) >= m.layout.num_blocks
                or min(st.deadline, now + desc.lease - self.s.clock()) <= now
                or not self.s.on_device()
            )
        except Exception:
            ok = False
        if not ok:
            _mark(st.rid, "ring:check")
            return
        _mark(st.rid, "ring:checked")
        try:
            st.ready = self.s.event(m, desc.event_slot, desc.event)
            fired = bool(st.ready.query())
            _mark(st.rid, "ring:queried")
        except Exception:
            _mark(st.rid, "ring:event")
            return
        st.desc = desc
        if not fired:
            _mark(st.rid, "ring:not-ready")
            return
        with contextlib.suppress(Exception):  # (the upload failed: the task retries, fails)
            self._fire_staged(st)
            self.s.stats.ring_launches += 1

    def _fire_staged(self, st: _Staged) -> None:
        """Upload the source ids of ``st``'s validated descriptor and launch its copy on
        the caller's stream. Raises if the upload fails (then nothing was queued); a
        failed launch call after it is kept in ``st.error`` (the abort rules apply)."""
        if not self.s.on_device():  # (switched by other code while the task waited)
            with torch.cuda.device(self.s.dev_index):
                return self._fire_staged(st)
        m, sb, n, desc = st.m, st.sb, st.n, st.desc
        drv = self.s.drv
        assert drv is not None and m.raw is not None and sb.done is not None and desc is not None
        struct.pack_into(f"<{n}q", sb.mv, 0, *desc.src)
        st.t0 = time.perf_counter()
        drv.memcpy_htod_async(sb.dev.data_ptr(), sb.pin.data_ptr(), 16 * n, st.rs)
        _mark(st.rid, "staged")
        st.launched = True
        m.inflight += 1
        self.s.stats.staged_launches += 1
        try:
            m.raw.launch_with(st.programs, st.rs, st.params)
            drv.event_record(sb.done.cuda_event, st.rs)
        except Exception as exc:
            st.error = exc
        _mark(st.rid, "launched0")

    async def pull(
        self,
        m: _Mapping,
        desc: Descriptor,
        host: tuple[int, ...],
        deadline: float,
        frm: str | None = None,
        *,
        rung: bool = False,
    ) -> None:
        """Copy the request: one launch (``plane == "ipc"``), or one per chunk of layers
        as the producer's :class:`LayerReady` messages arrive (``LAYERS``). ``rung``:
        the descriptor came by the doorbell (the ok release says so)."""
        n = len(host)
        lay = self.s.layout
        layerwise = desc.plane == LAYERS
        if n and max(desc.src) >= m.layout.num_blocks:  # uint32 on the wire: never < 0
            self.s.release(desc, Release(desc.rid, False, reason="source block id out of range"))
            raise RemoteProtocolError(
                f"IPC descriptor of {desc.rid!r}: source block ids out of [0, {m.layout.num_blocks})"
            )
        # our own deadline, and never past the producer's lease (both as time.monotonic())
        until = min(deadline, time.monotonic() + desc.lease - self.s.clock())
        if until <= time.monotonic():
            self.s.stats.lease_expired += 1
            self.s.release(desc, Release(desc.rid, False, reason="lease over before the copy"))
            raise TransferTimeoutError(f"IPC: the lease of {desc.rid!r} was over on arrival")
        if not layerwise:
            try:
                first = self.s.event(m, desc.event_slot, desc.event)
            except IpcUnavailableError as exc:
                self.s.count_fallback(exc.reason, desc.reply_to, str(exc))
                self.s.release(desc, Release(desc.rid, False, fallback=True, reason=exc.reason))
                left = max(0.0, deadline - time.monotonic())
                await self.s.port.recv_plain(
                    desc.rid, host, frm=None, timeout=left, layerwise=False
                )
                return
        t0 = time.perf_counter()
        triton = self.s.mapper.use_triton()
        g = self.s.words.slot()
        ab, slot = self.s.words.word(g)
        sb = self._slot_bufs(g, n)
        _mark(desc.rid, "slot")
        dev = self.s.device
        # The copy runs on the caller's current stream: ordered after its work so far and
        # before its next, with no extra stream, event or switch per request. Only a
        # launch that may be queued behind the producer's event (gpu_wait) runs on the
        # mapping's own stream, so that a dead producer can only ever block that one.
        own = triton and self.s.options.gpu_wait and dev.type == "cuda"
        # the driver path: the caller's current stream as a raw handle, the ids' upload,
        # launch and completion record through the driver (the launch verified bit-exact)
        rs = self.s.raw_stream() if triton and not own and m.raw is not None else None
        if rs is not None:
            stream: Any = rs
        else:
            stream = m.stream if own or dev.type != "cuda" else torch.cuda.current_stream(dev)
        L = lay.num_layers
        nxt = 0  # layers [0, nxt) are launched
        got = 0  # layers [0, got) were announced; marks: those of [nxt, got)
        marks: deque[tuple[int, bytes, int]] = deque()
        launched = False
        awaited = False  # since `stream` was taken (other code may switch streams meanwhile)
        m.inflight += 1
        try:
            ids = self._stage_ids(stream, own, sb, desc.src, host, raw=rs is not None)
            _mark(desc.rid, "staged")
            while nxt < L:
                if layerwise:
                    awaited = True
                    if not marks:  # (then nxt == got)
                        lr = await self._next_layers(m, desc, got, frm, until)
                        marks.extend(lr.marks)
                        got = lr.hi
                    hi, handle, eslot = marks.popleft()
                    ready = self._layer_event(m, eslot, handle)
                    if marks and got == L and self._all_fired(m, marks):
                        # every later layer is written already (the consumer came
                        # after the producer's forward): one launch for all of them
                        hi = L
                        marks.clear()
                else:
                    hi, ready = L, first
                _mark(desc.rid, f"ready?{nxt}")
                gpu_wait = False
                if not bool(ready.query()):
                    if triton and self.s.options.gpu_wait:
                        gpu_wait = True
                    else:
                        # Not launched before the producer's event fired: a launch queued
                        # behind the event of a producer that then dies would keep its
                        # stream (and any device-wide synchronize) waiting forever.
                        awaited = True
                        await self.s.wait_ready(ready, until)
                _mark(desc.rid, f"ready{nxt}")
                launched = True  # (from here on a launch may be queued: abort rules apply)
                self._launch(
                    m,
                    stream,
                    ready if gpu_wait else None,
                    ids,
                    ab,
                    slot,
                    triton,
                    nxt,
                    hi,
                    sb,
                    n,
                    current=not own and not awaited,
                    raw=rs is not None,
                )
                _mark(desc.rid, f"launched{nxt}")
                nxt = hi
            done = sb.done if sb.done is not None else _Fired()
            await self.s.wait_done(done, until - time.monotonic())
            _mark(desc.rid, "done")
        except BaseException as exc:
            if layerwise and got < L:  # the producer's later layer messages: dropped
                self.s.port.drop(
                    desc.rid, [_layer_id(desc.rid, i) for i in range(got, L)], frm, deadline
                )
            if not launched:
                self.consumer.copy_ended(m)
                # nothing was launched with the slot: it may serve again, with new buffers
                # (its ids' upload may still be queued: with torch's copy the device buffer
                # is marked used by the copy stream and the pinned one by the copy; with the
                # driver's, the buffers are held until an event after the upload fired)
                self._retire_slot(g, keep=False, upload_on=rs)
                self.s.words.free.append(g)
                self._unlaunched_failed(desc, exc)
                raise
            await self._abort_launched(m, desc, g, sb, exc)
            raise
        self._copied(m, desc, g, sb, rs, stream, own, rung, t0)

    async def pull_staged(
        self, st: _Staged, deadline: float, rung: bool, exc: BaseException | None
    ) -> None:
        """The rest of a request whose descriptor the ring's poll validated
        (:meth:`launch_staged`): when its producer's event had not fired then, wait for
        it and launch; then wait for the copy. ``exc``: the request failed (was
        cancelled) after the poll took its descriptor: end it by the abort rules (a
        launched copy is settled, an unlaunched one released) and re-raise."""
        m, desc = st.m, st.desc
        assert desc is not None
        m.can_push = desc.can_push
        until = min(deadline, time.monotonic() + desc.lease - self.s.clock())
        if not st.launched:
            try:
                if exc is not None:
                    raise exc
                await self.s.wait_ready(st.ready, until)
                _mark(desc.rid, "ready0")
                self._fire_staged(st)
            except BaseException as e:
                if not st.launched:
                    self.s.words.free.append(st.g)  # nothing was queued with it
                    self._unlaunched_failed(desc, e)
                    raise
                exc = e  # (interrupted after the upload: the abort rules apply)
        try:
            if exc is not None:
                raise exc
            if st.error is not None:
                raise st.error
            done = st.sb.done if st.sb.done is not None else _Fired()
            await self.s.wait_done(done, until - time.monotonic())
            _mark(desc.rid, "done")
        except BaseException as e:
            await self._abort_launched(m, desc, st.g, st.sb, e)
            raise
        self._copied(m, desc, st.g, st.sb, st.rs, st.rs, False, rung, st.t0)

    def _unlaunched_failed(self, desc: Descriptor, exc: BaseException) -> None:
        """A request failed before its copy was launched: the producer's blocks are
        released with the reason (its event did not fire in time, cancelled, failed)."""
        if isinstance(exc, (AiokvTimeoutError, asyncio.TimeoutError, TimeoutError)):
            self.s.stats.lease_expired += 1
            why = "producer not ready"
        else:
            why = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
        self.s.release(desc, Release(desc.rid, False, reason=why))
        self.s.port.recv_failed()

    async def _abort_launched(
        self, m: _Mapping, desc: Descriptor, g: int, sb: _SlotBufs, exc: BaseException
    ) -> None:
        """A copy that may have been launched failed (deadline, cancellation, error):
        set its abort word, wait (bounded) until the launch is over, release the
        producer's blocks with a failure. Raises :class:`TransferTimeoutError` for a
        timeout; the caller re-raises anything else."""
        timeout = isinstance(exc, (AiokvTimeoutError, asyncio.TimeoutError, TimeoutError))
        self.s.words.set(g)
        self.s.stats.aborted += 1
        settled = await self._settle(m, sb.done if sb.done is not None else _Fired())
        self._retire_slot(g, keep=not settled)
        if not settled:  # a stuck launch keeps its mapping's tensors forever
            self.s.keep.append((m.src_table, m.tables, m.storages))
        self.consumer.copy_ended(m)
        reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else "deadline"
        if not (timeout or isinstance(exc, asyncio.CancelledError)):
            reason = "failed"
        self.s.release(desc, Release(desc.rid, False, reason=reason))
        self.s.port.recv_failed()
        if timeout and not isinstance(exc, TransferTimeoutError):
            raise TransferTimeoutError(
                f"IPC copy of {desc.rid!r} did not finish within its deadline/lease"
            ) from None

    def _copied(
        self,
        m: _Mapping,
        desc: Descriptor,
        g: int,
        sb: _SlotBufs,
        rs: int | None,
        stream: Any,
        own: bool,
        rung: bool,
        t0: float,
    ) -> None:
        """A copy finished: the slot serves again, the caller's current stream is
        ordered after the copy, the release goes out soon, the counters move."""
        dev = self.s.device
        self.consumer.copy_ended(m)
        self.s.words.free.append(g)
        if rs is not None:
            if self.s.raw_stream() != rs:
                torch.cuda.current_stream(dev).wait_event(sb.done)  # switched meanwhile
        elif sb.done is not None and (own or torch.cuda.current_stream(dev) != stream):
            # the copy ran on another stream than the caller's current one (gpu_wait, or
            # a stream switched by other code during our awaits): order the caller after it
            torch.cuda.current_stream(dev).wait_event(sb.done)
        # off the critical path: sent after the caller (woken by our return) ran
        rel = Release(desc.rid, True, reason=RING if rung else "", push=self.granter.offer_push(m))
        self.s.release_soon(desc, rel)
        self.s.stats.requests_received += 1
        self.s.stats.bytes_received += self.s.layout.request_nbytes(desc.n)
        self.s.port.received(desc.rid, desc.n, t0)  # (no chunks: one copy by the plane)
        _mark(desc.rid, "return")

    async def _next_layers(
        self, m: _Mapping, desc: Descriptor, lo: int, frm: str | None, until: float
    ) -> LayerReady:
        """The producer's message for the layers starting at ``lo`` (validated)."""
        raw = await self.s.channel.recv(
            _layer_id(desc.rid, lo), frm=frm, timeout=max(0.0, until - time.monotonic())
        )
        _mark(desc.rid, f"layermsg{lo}")
        lr = LayerReady.from_wire(decode_message(raw), self.s.layout.num_layers)
        if lr.rid != desc.rid or lr.lo != lo:
            raise RemoteProtocolError(
                f"IPC layer message for {lr.rid!r:.64} layer {lr.lo} under {desc.rid!r:.64} "
                f"layer {lo}"
            )
        return lr

    def _all_fired(self, m: _Mapping, marks: deque[tuple[int, bytes, int]]) -> bool:
        """Whether the events of all ``marks`` fired (the last first: while a
        forward still runs it has not, and one query says so)."""
        return all(bool(self._layer_event(m, sl, h).query()) for _, h, sl in reversed(marks))

    def _layer_event(self, m: _Mapping, slot: int, handle: bytes) -> Any:
        try:
            return self.s.event(m, slot, handle)
        except IpcUnavailableError as exc:  # mid-stream: no fallback once layers were read
            raise TransferAbortedError(f"IPC: {exc}") from None

    def _stage_ids(
        self,
        stream: Any,
        own: bool,
        sb: _SlotBufs,
        src: Sequence[int],
        dst: Sequence[int],
        *,
        raw: bool = False,
    ) -> torch.Tensor:
        """Write the ids (``n`` source, then ``n`` destination) into the slot's pinned
        buffer and, on a GPU, enqueue their upload on ``stream``; returns what the copy
        reads. The mapping's own stream (``own``) first waits for the caller's current
        stream (its work so far may still read the destination blocks). A few Python
        and torch calls, no allocation: each one costs tens of µs on an H200 host."""
        n = len(dst)
        if n:
            struct.pack_into(f"<{2 * n}q", sb.mv, 0, *src, *dst)
        if self.s.device.type != "cuda":
            return sb.pin[: 2 * n].view(2, n)
        if raw:  # ``stream`` is a raw handle; exactly the ids' bytes
            assert self.s.drv is not None
            self.s.drv.memcpy_htod_async(sb.dev.data_ptr(), sb.pin.data_ptr(), 16 * n, stream)
            return sb.dev
        if own:
            assert sb.order is not None
            sb.order.record(torch.cuda.current_stream(self.s.device))
            stream.wait_event(sb.order)
        # the whole buffer (at most twice the ids): no slices, two torch calls fewer; when
        # the copy runs on the caller's stream it is the current one (no check, no switch)
        with _on(stream, self.s.device) if own else contextlib.nullcontext():
            sb.dev.copy_(sb.pin, non_blocking=True)
        if stream not in sb.streams:
            sb.dev.record_stream(stream)  # freed (retired) only after this stream's work
            sb.streams.append(stream)
        return sb.dev

    def _raw_args(
        self,
        m: _Mapping,
        ids: torch.Tensor,
        ab: torch.Tensor,
        slot: int,
        n: int,
        lo: int,
        hi: int,
    ) -> tuple[int, tuple[int, ...]]:
        """``(programs, arguments)`` of the raw launch copying layers ``[lo, hi)`` of
        ``n`` block pairs whose ids are in ``ids``, abort word ``ab[slot]``."""
        st, dt = self.s.tables(m, lo, hi)
        return _kernel.pair_copy_args(
            st.data_ptr(),
            dt.data_ptr(),
            ids.data_ptr(),
            ab.data_ptr(),
            self.s.device,
            slot,
            **self.s.mapper.geometry(m, n_pairs=n, n_layers=hi - lo, parts=self.s.layout.kv_parts),
        )

    def _launch(
        self,
        m: _Mapping,
        stream: Any,
        ready: Any,
        ids: torch.Tensor,
        ab: torch.Tensor,
        slot: int,
        triton: bool,
        lo: int,
        hi: int,
        sb: _SlotBufs,
        n: int,
        current: bool = False,
        raw: bool = False,
    ) -> None:
        """Enqueue the copy of layers ``[lo, hi)`` on ``stream`` (after the producer's
        event ``ready`` on the GPU, if given) and re-record the slot's completion event
        after it. ``current``: ``stream`` is known to be the current stream (taken with
        no await since), so no check (a CUDA call) is needed."""
        dev = self.s.device
        lay = self.s.layout
        whole = lo == 0 and hi == lay.num_layers
        if raw:  # ``stream`` is a raw handle; m.raw verified at mapping time
            assert m.raw is not None and self.s.drv is not None and sb.done is not None
            programs, args = self._raw_args(m, ids, ab, slot, n, lo, hi)
            if programs > _kernel.MAX_PROGRAMS:
                raise ConfigError("IPC: request too large for one launch")
            if programs:
                m.raw.launch(programs, stream, args)
            self.s.drv.event_record(sb.done.cuda_event, stream)
            return
        if dev.type != "cuda":
            dst = self.s.port.caches.raw(m.word)
            src = m.src_layers if whole else m.src_layers[lo:hi]
            _kernel.torch_pair_copy(
                src, dst if whole else dst[lo:hi], lay.block_dim, ids[0], ids[1]
            )
            return
        with contextlib.nullcontext() if current else _on(stream, dev):
            if ready is not None:
                stream.wait_event(ready)  # the producer's KV is written (GPU-side wait)
            if triton:
                st, dt = self.s.tables(m, lo, hi)
                ok = _kernel.launch_pair_copy(
                    st,
                    dt,
                    ids,
                    ab,
                    slot,
                    **self.s.mapper.geometry(m, n_pairs=n, n_layers=hi - lo, parts=lay.kv_parts),
                )
                if not ok:
                    raise ConfigError("IPC: request too large for one launch")
            else:
                dst = self.s.port.caches.raw(m.word)
                _kernel.torch_pair_copy(
                    m.src_layers[lo:hi], dst[lo:hi], lay.block_dim, ids[:n], ids[n : 2 * n]
                )
            assert sb.done is not None
            sb.done.record(stream)

    async def _settle(self, m: _Mapping, done: Any) -> bool:
        """After an abort: wait (bounded by the grace period) until the launch is over.
        A launch still queued then is behind an event that does not fire (a dead
        producer) and will copy nothing when it runs; its stream is retired."""
        until = time.monotonic() + self.s.options.grace_s
        if await waiter_for().wait_until(done.query, until, interval=self.s.options.event_poll_s):
            return True
        self.s.stats.stuck_streams += 1
        m.broken = "stuck_stream"
        log.warning(
            "aiokv IPC plane: a copy from export %x is stuck behind its producer's event; "
            "that export is no longer used",
            m.token,
        )
        return False


class _Fired:
    """A completed event (the CPU path copies synchronously)."""

    def query(self) -> bool:
        return True
