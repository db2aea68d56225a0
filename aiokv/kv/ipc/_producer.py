"""The IPC plane's producer (:class:`Producer`, a part of
:class:`aiokv.kv.ipc.IpcPlane`): the export and its offer, the ready events, the
descriptor (by the engine and the doorbell ring), the lease and the release, and
layer-wise saving. Push mode's launches are the push sender's
(:class:`aiokv.kv.ipc._push.Pusher`, seen as :class:`~aiokv.kv.ipc._parts.Pushing`).
docs/ipc.md has the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from aiokv._runtime.deadlines import _time_left

from ..._exceptions import (
    AiokvError,
    ConfigError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
)
from . import _doorbell, _kernel
from ._common import (
    HELLO,
    NO_OFFER,
    PREPARE_RID,
    RING,
    UNDELIVERED,
    AnswerWait,
    _Export,
    _layer_id,
    _mark,
    _retrieve,
    log,
)
from ._mapping import seg_bytes
from ._push import PUSH_REFUSED, _IpcSave
from ._state import PlaneState
from ._wire import (
    _PROBE_SEGMENTS,
    LAYERS,
    Descriptor,
    Offer,
    Release,
    decode_message,
    probe_pattern,
)
from ._wire_layers import layer_messages
from .lease import LeaseEvent, LeaseState

if TYPE_CHECKING:
    from ._parts import Pushing


def _release_event(rel: Release | None) -> LeaseEvent:
    """The lease event a consumer's release (None: none before lease + grace) is."""
    if rel is None:
        return LeaseEvent.LEASE_OVER
    if rel.fallback:
        return LeaseEvent.RELEASE_FALLBACK
    return LeaseEvent.RELEASE_OK if rel.ok else LeaseEvent.RELEASE_FAILED


def _error_event(exc: BaseException) -> LeaseEvent:
    """The lease event the wait for a release ending with ``exc`` is."""
    return LeaseEvent.UNDELIVERED if isinstance(exc, UNDELIVERED) else LeaseEvent.BAD_RELEASE


def _answer_from(fut: asyncio.Future[Release | None], t: asyncio.Task[Release | None]) -> None:
    """Hand the release receive's outcome to the wait for it (already settled: by a
    message that failed; the outcome is retrieved and dropped)."""
    if fut.done():
        if not t.cancelled():
            t.exception()
    elif t.cancelled():
        fut.cancel()
    elif (exc := t.exception()) is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(t.result())


def _stop_task(task: asyncio.Task[Any], _: object) -> None:
    """The wait for a release ended (a message failed): stop receiving it."""
    if not task.done():
        task.cancel()


def _same_ids(block_ids: object, host: tuple[int, ...]) -> bool:
    """Whether ``block_ids`` (a list, tuple or 1-D CPU tensor) holds ``host``'s ids
    (the request's, checked at its first layer), without checking them again."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.device.type != "cpu" or block_ids.dim() != 1:
            return False
        block_ids = block_ids.tolist()
    elif type(block_ids) is not list and type(block_ids) is not tuple:
        return False
    return len(block_ids) == len(host) and tuple(block_ids) == host


class Producer:
    """The producer's part of a plane: its export (made once), its pool of IPC events,
    what it knows of each consumer (acknowledged the offer, reads the ring, fell back),
    the requests saved layer by layer. ``push`` is the plane's push sender."""

    push: Pushing

    def __init__(self, s: PlaneState) -> None:
        self.s = s
        self.export: _Export | None = None
        self.acked: set[str] = set()  # consumers that used our offer
        self.broken_to: dict[str, str] = {}  # consumer -> reason (fall back from now on)
        self.free_events: list[tuple[int, Any, bytes]] = []
        self.n_events = 0
        self.saves: dict[str, _IpcSave] = {}  # layer-wise requests being saved over IPC
        self.bells: dict[str, _doorbell.BellWriter | None] = {}  # consumer -> its ring
        self.ring_ok: set[str] = set()  # consumers whose last release said "by the ring"
        self.ring_only: dict[str, int] = {}  # consumer -> ring-only descriptors unreleased
        self.plain_saves: set[str] = set()  # ... and those that take the ordinary path
        # consumers an offer-only request is going to -> whether another hello came
        self.offering: dict[str, bool] = {}

    def publish_hello(self) -> None:
        """Consumers may ask for the offer ahead of their first request (``prepare``):
        publish :data:`HELLO` where the plane is on and the engine has a GET mode."""
        pull = self.s.port.pull
        if not self.s.disabled and pull is not None:
            with contextlib.suppress(AiokvError):
                pull.publish(HELLO, torch.zeros(1, dtype=torch.uint8), on_get=self.hello)

    def close(self) -> None:
        """Unpublish :data:`HELLO` (the plane closes)."""
        if self.s.port.pull is not None:
            with contextlib.suppress(AiokvError):
                self.s.port.pull.unpublish(HELLO)

    def close_bells(self) -> None:
        """Close every consumer's doorbell ring (the plane closes)."""
        for bell in self.bells.values():
            if bell is not None:
                bell.close()
        self.bells.clear()

    def _send_plain(
        self, request_id: str, n: int, to: str, deadline: float, reason: str | None
    ) -> None:
        """Tell the consumer (which waits for a descriptor either way) that this request's
        blocks come the ordinary way; count it under ``reason`` if the plane is off."""
        self.s.send_msg(
            f"{request_id}#ipc",
            Descriptor(request_id, "chunks", n).to_wire(),
            to,
            _time_left(deadline),
        )
        if reason:
            self.s.stats.fallbacks[reason] = self.s.stats.fallbacks.get(reason, 0) + 1

    def make_export(self) -> _Export:
        if self.export is not None:
            return self.export
        tensors = self.s.port.caches.tensors
        storages: list[torch.UntypedStorage] = []
        index: dict[int, int] = {}
        layers: list[tuple[int, int]] = []
        for t in tensors:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in index:
                index[key] = len(storages)
                storages.append(st)
            layers.append((index[key], t.data_ptr() - key))
        seg = seg_bytes(self.s.layout)
        nonce = secrets.randbits(62)
        probe = probe_pattern(nonce, _PROBE_SEGMENTS * seg, self.s.device)
        word = _kernel.word_size(*(t.data_ptr() for t in tensors))
        offer = Offer(
            token=secrets.randbits(62) | 1,
            boot_id=self.s.boot_id,
            pid=os.getpid(),
            mono=self.s.clock(),
            layout=self.s.layout.to_wire(),
            storages=tuple(self.s.backend.export(s) for s in storages),
            layers=tuple(layers),
            word=word,
            probe=self.s.backend.export(probe.untyped_storage()),
            nonce=nonce,
        )
        self.export = _Export(offer, probe, storages)
        return self.export

    def take_event(self) -> tuple[int, Any, bytes]:
        if self.free_events:
            return self.free_events.pop()
        ev, handle = self.s.backend.new_event(self.s.device)
        self.n_events += 1
        return self.n_events - 1, ev, handle

    def record(self, ev: Any) -> None:
        """Record ``ev`` on the caller's current stream of this plane's device."""
        rs = self.s.raw_stream()
        if rs is not None:
            assert self.s.drv is not None
            self.s.drv.event_record(ev.cuda_event, rs)
        else:
            ev.record(
                torch.cuda.current_stream(self.s.device) if self.s.device.type == "cuda" else None
            )

    async def send_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
        _offer_only: bool = False,
    ) -> None:
        _mark(request_id, "send")
        deadline, host = self.s.begin(request_id, block_ids, timeout, unique=False, what="send")
        n = len(host)
        _mark(request_id, "ids")
        _time_left(deadline)  # (timeout=0: over before anything is taken or sent)
        reason = self.s.disabled or self.broken_to.get(to)
        if _offer_only and reason:  # no offer to make: the consumer's prepare() is False
            self._send_plain(request_id, 0, to, deadline, None)
            return
        if reason or (n == 0 and not _offer_only):
            self._send_plain(request_id, n, to, deadline, reason)
            await self.s.port.send_plain(
                request_id, host, to=to, timeout=max(0.0, deadline - time.monotonic())
            )
            return
        try:
            export = self.make_export()
        except Exception as exc:  # an allocation torch cannot share (expandable segments ...)
            self.s.disabled = "export_failed"  # counted per request on the plain path
            self.s.log_fallback("export_failed", to, f"{type(exc).__name__}: {exc}")
            return await self.send_request(
                request_id, host, to=to, timeout=timeout, _offer_only=_offer_only
            )
        pm = self.push.maps.get(to) if self.s.options.push and n and not _offer_only else None
        if pm is not None:
            got = self.push.take_grant(request_id, to, pm, n, deadline)
            _mark(request_id, "grant:taken")
            if got is not None and await self.push.push(request_id, host, to, deadline, pm, *got):
                return
        slot, ev, ev_handle = self.take_event()
        self.record(ev)  # on the current stream: after the KV writes queued so far
        _mark(request_id, "recorded")
        lease = self.s.clock() + max(0.0, deadline - time.monotonic())
        offer = None
        if to not in self.acked:
            offer = export.offer
            bell = self._bell_for(to)
            if bell is not None:  # named only over the engine (authenticated)
                offer = dataclasses.replace(offer, bell=bell.name, bell_key=bell.key)
        desc = Descriptor(
            rid=request_id,
            plane="ipc",
            n=n,
            reply_to=str(getattr(self.s.port.engine, "address", "")),
            token=export.offer.token,
            src=host,
            event=ev_handle,
            event_slot=slot,
            lease=lease,
            offer=offer,
            can_push=pm is not None,
        )
        _mark(request_id, "built")
        ok = await self.post(request_id, desc, to, lease, [(slot, ev, ev_handle)])
        if not ok and not _offer_only:  # nothing was read: the ordinary way (from now on)
            await self.s.port.send_plain(
                request_id, host, to=to, timeout=max(0.0, deadline - time.monotonic())
            )

    async def post(
        self,
        request_id: str,
        desc: Descriptor,
        to: str,
        lease: float,
        events: list[tuple[int, Any, bytes]],
    ) -> bool:
        """Send a whole request's descriptor (ring and/or engine) and settle the
        consumer's release (:meth:`_settle_release`)."""
        t0 = time.perf_counter()
        offer = desc.offer
        tid = f"{request_id}#ipc"
        # The ring alone carries the descriptor to a consumer whose last release said it
        # took one from the ring, while fewer than SLOTS - 1 of them are unreleased (so
        # none is overwritten unread); the engine's copy follows only if no release came
        # within doorbell_backup_s. Otherwise the engine carries it too, at once.
        ring_only = (
            offer is None
            and to in self.ring_ok
            and self.ring_only.get(to, 0) < _doorbell.SLOTS - 1
            and self._ring(desc, to, solo=True)
        )
        backup: asyncio.TimerHandle | None = None
        if ring_only:
            self.ring_only[to] = self.ring_only.get(to, 0) + 1
            backup = asyncio.get_running_loop().call_later(
                self.s.options.doorbell_backup_s, self._send_backup, tid, desc, to, lease
            )
        rel = self._wait_release(request_id, to, lease)
        rel.fut.add_done_callback(functools.partial(self._released, to, backup))
        if not ring_only:
            rung = offer is None and self._ring(desc, to, solo=False)
            # the engine alone carrying it, a failed send fails the wait for its release
            # (with the ring's copy too, the consumer may be reading: the lease decides)
            left = _time_left(lease, self.s.clock)
            self.s.send_msg(tid, desc.to_wire(), to, left, None if rung else rel)
        _mark(request_id, "sent")
        return await self._settle_release(
            request_id,
            to,
            rel,
            events,
            n_blocks=desc.n,
            started=t0,
            count_errors=False,
        )

    def _bell_for(self, to: str) -> _doorbell.BellWriter | None:
        """The doorbell ring for consumer ``to`` (made once; None where the option is off
        or no ring can be made here, e.g. no ``/dev/shm``)."""
        if not self.s.options.doorbell:
            return None
        if to in self.bells:
            return self.bells[to]
        try:
            bell: _doorbell.BellWriter | None = _doorbell.BellWriter()
        except OSError as exc:
            log.info("aiokv IPC plane: no doorbell for %s: %s", to, exc)
            bell = None
        self.bells[to] = bell
        return bell

    def _ring(self, desc: Descriptor, to: str, *, solo: bool) -> bool:
        """Post the descriptor in ``to``'s doorbell ring, if it has one; whether it was."""
        bell = self.bells.get(to)
        if bell is not None and bell.post(desc.to_ring(solo=solo)):
            _mark(desc.rid, "rung")
            return True
        return False

    def _send_backup(self, tid: str, desc: Descriptor, to: str, lease: float) -> None:
        """No release came soon after a ring-only descriptor: send it by the engine too
        (the ring message was lost, or the consumer does not wait yet; a consumer that
        took the ring's copy drops this one).

        A one-shot timer of the loop, cancelled by the release (:meth:`_released`), not
        a waiter poll: it asks nothing, and as a poll of the loop's waiter it would make
        the waiter open and close its timerfd for every ring-only request while nothing
        else waits -- ~0.1 ms more per request, measured on CPU (docs/design.md)."""
        left = lease - self.s.clock()
        if left > 0 and not self.s.closed:
            self.s.stats.doorbell_backups += 1
            self.s.send_msg(tid, desc.to_wire(), to, left)

    def _wait_release(self, rid: str, to: str, lease: float) -> AnswerWait:
        """The wait for the consumer's release of ``rid`` (:meth:`_await_release`, run as
        a task) as an :class:`AnswerWait`, which the request's messages tell of their
        failures: one the consumer never took ends it at once (and the receive)."""
        fut: asyncio.Future[Release | None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._await_release(rid, to, lease))
        task.add_done_callback(functools.partial(_answer_from, fut))
        fut.add_done_callback(functools.partial(_stop_task, task))
        return AnswerWait(fut)

    def _released(
        self, to: str, backup: asyncio.TimerHandle | None, t: asyncio.Future[Release | None]
    ) -> None:
        """The release of a request sent over the plane came (or never will): a pending
        engine copy is not needed; the consumer's release says whether it reads the
        ring (``reason == "ring"`` on an ok release)."""
        if backup is not None:
            backup.cancel()
            self.ring_only[to] -= 1
        rel = None if t.cancelled() or t.exception() is not None else t.result()
        if rel is not None and rel.ok:
            if rel.reason == RING:
                self.ring_ok.add(to)
            else:
                self.ring_ok.discard(to)

    async def _settle_release(
        self,
        request_id: str,
        to: str,
        wait: AnswerWait,
        events: list[tuple[int, Any, bytes]],
        *,
        n_blocks: int,
        started: float,
        count_errors: bool,
    ) -> bool:
        """Wait for the consumer's release of a request it reads over the plane and settle
        it (``send_request`` and ``wait_saved`` alike): True when the blocks landed (the
        request joins ``finished_sending()``), False when the consumer asked for the
        ordinary path (nothing was read; the caller sends it that way). Raises
        :class:`~aiokv.TransferTimeoutError` when no release came before lease + grace
        and :class:`~aiokv.TransferAbortedError` when the consumer failed the request.

        Cancelled, the request joins ``finished_sending()`` (and its ``events`` go back to
        the pool) only at the release or once lease + grace are over: the consumer may
        still be reading. ``count_errors``: whether another error while waiting (a bad
        release) counts as a send failure -- ``wait_saved`` counts it, ``send_request``
        never did (tests/kv/ipc/test_ipc_settle.py pins both)."""
        lease = wait.lease
        try:
            rel = await asyncio.shield(wait.fut)
        except asyncio.CancelledError:
            lease.handle(LeaseEvent.CANCEL)
            self.s.track(self._settle_cancelled(wait, events, request_id))
            self.s.port.send_failed()
            raise
        except BaseException as exc:
            if lease.handle(_error_event(exc)) is LeaseState.UNDELIVERED or count_errors:
                self.s.port.send_failed()
            raise
        _mark(request_id, "released")
        state = lease.handle(_release_event(rel))
        if lease.events_reusable:
            self.free_events.extend(events)
        if state is LeaseState.EXPIRED:
            self.s.port.send_failed()
            self.s.stats.lease_expired += 1
            lost = wait.lost
            raise TransferTimeoutError(
                f"IPC: no release of {request_id!r} from {to} before its lease ran out "
                "(the consumer no longer reads the blocks)"
                + (f"; a message of it failed: {lost!r}" if lost is not None else "")
            ) from lost
        assert rel is not None
        if rel.fallback and rel.reason == PUSH_REFUSED:  # pull (and the ordinary way) goes on
            pm = self.push.maps.pop(to, None)
            if pm is not None:
                self.push.close(pm)
            self.s.count_fallback(PUSH_REFUSED, to)
            return False
        if state is LeaseState.FALLBACK:
            reason = rel.reason or "consumer_refused"
            pm = self.push.maps.pop(to, None)  # (a consumer that lost our offer restarted:
            if pm is not None:  # its export we map is stale too; it offers its new one)
                self.push.close(pm)
            self.ring_ok.discard(to)
            self.acked.discard(to)
            bell = self.bells.pop(to, None)
            if bell is not None:
                bell.close()
            if reason != NO_OFFER:
                self.broken_to[to] = reason
            # else: the consumer does not know our export -- it restarted, or lost the
            # offer -- so the next request offers it again (with a new ring) instead of
            # sending this consumer everything the ordinary way from now on
            self.s.count_fallback(reason, to)
            return False
        if state is LeaseState.FAILED:
            self.s.port.send_failed()
            raise TransferAbortedError(
                f"IPC: the consumer {to} failed request {request_id!r}: {rel.reason}"
            )
        if to not in self.acked:
            self.acked.add(to)
            bell = self.bells.get(to)
            if bell is not None:  # the consumer opened both with the offer: names can go
                bell.open_wake()
                bell.unlink()
        if rel.push is not None:
            self.push.received(to, rel.push)
        if request_id == PREPARE_RID:  # an offer alone: no request to count or report
            return True
        self.s.stats.requests_sent += 1
        self.s.port.sent(request_id, n_blocks, started)  # (no chunks: one copy by the plane)
        return True

    async def _await_release(self, rid: str, frm: str, lease: float) -> Release | None:
        """The consumer's release, or None once the lease plus the grace period is over."""
        left = lease + self.s.options.grace_s - self.s.clock()
        try:
            raw = await self.s.channel.recv(f"{rid}#ipcrel", frm=frm, timeout=max(0.0, left))
        except TransferTimeoutError:
            return None
        rel = Release.from_wire(decode_message(raw))
        if rel.rid != rid:
            raise RemoteProtocolError(f"IPC release for {rel.rid!r:.64} under {rid!r:.64}")
        return rel

    async def _settle_cancelled(
        self, wait: AnswerWait, events: list[tuple[int, Any, bytes]], rid: str
    ) -> None:
        """A request whose caller left (its lease CANCELLED): once the consumer's answer
        (or the lease's end) ends the loan, its events serve again where the lease
        says so and its blocks are free."""
        try:
            event = _release_event(await wait.fut)
        except Exception as exc:
            event = _error_event(exc)
        wait.lease.handle(event)
        if wait.lease.events_reusable:
            self.free_events.extend(events)
        if rid != PREPARE_RID:  # (blocks_free: release, or lease + grace over)
            self.s.port.blocks_free(rid)

    def hello(self, address: str) -> None:
        """``on_get`` of :data:`HELLO`: the consumer at ``address`` (an authenticated
        session's address) maps our export ahead of its first request
        (``prepare``); send it an offer-only request (the offer rides along unless
        that consumer acknowledged it already). Every hello gets its answer, one at a
        time per consumer: a hello while one is being answered (the consumer may ask
        again as soon as it released the last, before we took that release) is
        answered after it."""
        if self.s.closed:
            return
        if address in self.offering:
            self.offering[address] = True  # answer once more when this one is done
            return
        self.offering[address] = False

        async def offer() -> None:
            again = True
            while again and not self.s.closed:
                try:
                    await self.send_request(
                        PREPARE_RID, (), to=address, timeout=None, _offer_only=True
                    )
                except AiokvError as exc:
                    log.info("aiokv IPC plane: the offer to %s did not land: %r", address, exc)
                again = self.offering.get(address, False)
                self.offering[address] = False
            self.offering.pop(address, None)

        self.s.track(offer())

    def owns_save(self, request_id: str) -> bool:
        """True when the layers of ``request_id`` are being saved over IPC (not the
        ordinary path)."""
        return request_id in self.saves

    def save_layer(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """Layer-wise streaming over the plane (see :meth:`KVConnector.save_layer`).

        The first layer of a request sends its descriptor (plane ``"ipc-layers"``: the
        block ids, the lease, the offer); every layer then records an IPC event of its
        own on the current stream; at the end of the loop pass the layers saved in it
        are announced, one :class:`LayerReady` per run of consecutive layers, each
        layer with its own event. The consumer copies each layer with one launch once
        its event fired. Where the plane is off for this consumer the descriptor
        says ``"chunks"`` and the request takes the ordinary path from its first layer.
        """
        self.s.port.check_request(request_id)
        L = self.s.layout.num_layers
        if type(layer) is not int or not 0 <= layer < L:
            raise ConfigError(f"layer must be an int in [0, {L}), got {layer!r}")
        if request_id in self.plain_saves:
            self.s.port.save_layer_plain(request_id, layer, block_ids, to=to, timeout=timeout)
            return
        sv = self.saves.get(request_id)
        if sv is not None and _same_ids(block_ids, sv.host):
            host = sv.host  # (the layers after the first: checked then, ~10 µs a layer)
        else:
            host = self.s.ids(block_ids, unique=False, what="save_layer")
        n = len(host)
        if sv is None:
            _mark(request_id, "send")  # (the request's first layer)
            deadline = self.s.port.deadline(timeout)
            reason = self.s.disabled or self.broken_to.get(to)
            export = None
            if not reason and n:
                try:
                    export = self.make_export()
                except Exception as exc:  # see send_request
                    reason = self.s.disabled = "export_failed"  # counted just below
                    self.s.log_fallback("export_failed", to, f"{type(exc).__name__}: {exc}")
            if export is None:
                self._send_plain(request_id, n, to, deadline, reason)
                self.plain_saves.add(request_id)
                self.s.port.save_layer_plain(request_id, layer, host, to=to, timeout=timeout)
                return
            lease = self.s.clock() + max(0.0, deadline - time.monotonic())
            pm = self.push.maps.get(to) if self.s.options.push else None
            sv = self.push.first_layer(request_id, layer, host, to, deadline, lease, pm)
            if sv is not None:
                self.saves[request_id] = sv
                return
            desc = Descriptor(
                rid=request_id,
                plane=LAYERS,
                n=n,
                reply_to=str(getattr(self.s.port.engine, "address", "")),
                token=export.offer.token,
                src=host,
                lease=lease,
                offer=None if to in self.acked else export.offer,
                can_push=pm is not None,
            )
            rel = self._wait_release(request_id, to, lease)
            rel.fut.add_done_callback(_retrieve)
            left = _time_left(lease, self.s.clock)
            self.s.send_msg(f"{request_id}#ipc", desc.to_wire(), to, left, rel)
            sv = _IpcSave(to, host, deadline, lease, time.perf_counter(), rel)
            self.saves[request_id] = sv
        elif sv.to != to or sv.host != host:
            raise ConfigError(
                f"save_layer({request_id!r}, {layer}): other block ids or peer than the "
                "earlier layers of the request"
            )
        if layer in sv.saved:
            raise ConfigError(f"layer {layer} of {request_id!r} was already saved")
        if sv.push is not None:
            self.push.next_layer(sv, sv.push, request_id, layer)
            return
        sv.saved.add(layer)
        slot, ev, handle = self.take_event()
        sv.events.append((slot, ev, handle))
        self.record(ev)  # after everything queued so far on the current stream (the layer)
        sv.pending.append((layer, handle, slot))
        if len(sv.pending) == 1:  # one flush per loop pass: a message per run of layers
            asyncio.get_running_loop().call_soon(self._flush_layers, request_id, sv)

    def _flush_layers(self, request_id: str, sv: _IpcSave) -> None:
        pending, sv.pending = sv.pending, []
        left = max(0.0, sv.lease - self.s.clock())
        for lr in layer_messages(request_id, pending):
            try:
                self.s.send_msg(_layer_id(lr.rid, lr.lo), lr.to_wire(), sv.to, left, sv.rel)
            except Exception as exc:  # engine closing: the consumer's lease runs out instead
                log.warning(
                    "aiokv IPC plane: could not announce %r: %s", _layer_id(lr.rid, lr.lo), exc
                )

    async def wait_saved(self, request_id: str) -> None:
        """Wait for the consumer's release of a request saved over IPC (see
        :meth:`KVConnector.wait_saved`); the request then joins ``finished_sending()``.

        As with :meth:`send_request`, the blocks are the consumer's to read until its
        release or the lease (plus grace) is over: also when this raises (layers never
        saved, cancellation), the request joins ``finished_sending()`` only then."""
        sv = self.saves.pop(request_id, None)
        if sv is None:  # saved the ordinary way (or never saved: the ConfigError is its)
            self.plain_saves.discard(request_id)
            await self.s.port.wait_saved_plain(request_id)
            return
        if sv.push is not None:
            return await self.push.saved(request_id, sv, sv.push)
        self._flush_layers(request_id, sv)
        L = self.s.layout.num_layers
        missing = [i for i in range(L) if i not in sv.saved]
        assert sv.rel is not None
        if missing:
            # the consumer waits for them until the lease; what it read so far stays its
            sv.rel.lease.handle(LeaseEvent.CANCEL)
            self.s.track(self._settle_cancelled(sv.rel, sv.events, request_id))
            self.s.port.send_failed()
            raise ConfigError(
                f"request {request_id!r}: layers {missing[:8]}{'...' if len(missing) > 8 else ''} "
                "were never saved"
            )
        ok = await self._settle_release(
            request_id,
            sv.to,
            sv.rel,
            sv.events,
            n_blocks=len(sv.host),
            started=sv.started,
            count_errors=True,
        )
        if not ok:  # nothing was read: every layer the ordinary way (all are written now)
            await self.save_plain(request_id, sv)

    async def save_plain(self, request_id: str, sv: _IpcSave) -> None:
        """Every layer of ``sv`` the ordinary way (the connector's engine path; all
        are written by now), in what is left of its deadline, and wait for them."""
        left = max(0.0, sv.deadline - time.monotonic())
        for i in range(self.s.layout.num_layers):
            self.s.port.save_layer_plain(request_id, i, sv.host, to=sv.to, timeout=left)
        await self.s.port.wait_saved_plain(request_id)
