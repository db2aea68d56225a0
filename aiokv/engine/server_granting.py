"""The server side's admission and granting: room for a peer's transfers, and their landing.

:class:`_Granting` is a part :class:`~aiokv.engine.server._Server` owns: RESERVE
(refused, granted, or queued in the admission queue until the receive budget has
room), WITHDRAW and FAILED, granted transfers' expiry, DATA and PUT/RETURN landing in
the receive store, standing credit and its ACKs (ACK timing: docs/design.md), and a
lost session's teardown in slices. It works on the server's
:class:`~aiokv.engine.server_state._ServerState` and sees the server as a
:class:`~aiokv.engine.server_state.SessionDropper`; the connections part sees it as a
:class:`~aiokv.engine.server_connections.Landing`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import zmq
import zmq.asyncio

from aiokv._exceptions import (
    DuplicateTensorError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
)
from aiokv._runtime import trace as _trace
from aiokv._runtime.deadlines import _retrieve
from aiokv.engine.server_state import SessionDropper, _InXfer, _ServerSession, _ServerState
from aiokv.engine.store import PeerRef
from aiokv.protocol.codec import MAX_ACKS
from aiokv.protocol.messages import (
    DATA_FRAME_BYTES,
    Ack,
    AckReq,
    DataHeader,
    Done,
    ErrorMsg,
    Failed,
    Grant,
    Put,
    Refuse,
    Reserve,
    Return,
    Withdraw,
    Withdrawn,
)
from aiokv.protocol.session import SessionState
from aiokv.transport.base import SinkLink
from aiokv.transport.tcp import FrameTensor, frames_to_tensors, put_frame_count

__all__: list[str] = []

_CANCEL_SLICE = 256  # pending tensors of a lost session released per step
_CLEANUP_S = 0.002  # lost sessions' teardown per loop pass (_run_cleanups)
_OPEN = SessionState.OPEN
#: granting queued reservations runs at most this long per call (then again next pass)
_PUMP_S = 0.004
# ACK timing (docs/design.md, "ACK timing"): PUTs nobody waits for yet are acknowledged
# in groups of this many, or when credit runs low, or after _ACK_DELAY_S at the latest
_ACK_EVERY = 8
_ACK_DELAY_S = 0.001


def _share(ss: _ServerSession) -> int:
    return ss.ledger.share if ss.ledger is not None else 0


class _Granting:
    """Admission, grants, credit, ACKs and landing (see the module)."""

    def __init__(self, st: _ServerState, server: SessionDropper) -> None:
        self._st = st  # the sessions' indexes, the loop (shared with the other parts)
        self._server = server
        # what never changes, bound once: the landing path looks none of it up twice
        self._owner = st.owner
        self.config = st.config
        self._codec = st.codec
        self._store = st.store
        self._stats = st.stats
        self._admission = st.admission
        self._bounds = st.bounds
        self._reply = st.reply
        self._reply_raw = st.reply_raw
        self._count_error = st.owner._count_error
        self._get_poller = st.owner._get_poller
        self._ack_now: list[_ServerSession] = []  # sessions whose data awaits an ACK
        self._pump_due = False  # pump_queue ran out of time and is scheduled again
        self._cleanups: deque[Callable[[], bool]] = deque()  # lost sessions' teardown
        self._cleanup_due = False

    # ------------------------------------------------------------------ admission

    def on_withdraw(self, ss: _ServerSession, msg: Withdraw) -> None:
        if self._admission.withdraw(ss.queued, msg.xfer) is not None:
            self._reply(ss, ss.sess.send(Withdrawn(msg.xfer)))
            self._unpause_credit(ss, msg.xfer)
            self._stats.withdrawn += 1
        elif msg.xfer in ss.granted:
            ss.granted[msg.xfer].discard = True

    def on_failed(self, ss: _ServerSession, msg: Failed) -> None:
        """The sender ended a granted transfer (``withdrawn``: its caller gave up): its
        room and tensor ids are free now; TCP data still on its way is dropped when it
        comes. A withdrawn transfer's waiters keep waiting (for a retry, or their own
        deadline); any other failure fails them."""
        inx = ss.granted.pop(msg.xfer, None)
        if inx is None:
            return  # it crossed this end's DONE or FAILED (Session let it through)
        ss.granted_tensors -= len(inx.specs)
        if inx.transport == "tcp" and ss.sink.cancel(msg.xfer):
            if len(ss.expired) >= 4096:  # its data has not come yet: drop it when it does
                ss.expired.clear()
            ss.expired.add(msg.xfer)
        if ss.peer is not None:
            why = None if msg.code == "withdrawn" else TransferAbortedError(msg.detail)
            self._store.cancel(ss.peer, [s.tensor_id for s in inx.specs], why)
            self.pump_queue()

    def on_reserve(self, ss: _ServerSession, msg: Reserve) -> None:
        assert ss.peer is not None
        if _trace.enabled:
            _trace.mark("reserve", ss.trace_id, msg.xfer)
        code, detail = "", ""
        if self._owner._closed:
            code, detail = "closing", "engine closing"
        elif msg.transport == "nccl" and ss.nccl is None:
            code, detail = "transport", "NCCL is not set up for this session"
        elif (
            why := self._bounds.refusal(
                nbytes=msg.nbytes,
                ntensors=len(msg.specs),
                queued=len(ss.queued),
                granted=len(ss.granted),
                # queued ones too: what a session may make this end hold in memory
                granted_tensors=ss.granted_tensors + len(ss.queued.ids),
            )
        ) is not None:
            code, detail = why
        else:
            ids = [s.tensor_id for s in msg.specs]
            try:
                self._store.check_free(ss.peer, ids)
                if ss.queued.claims_any(ids):
                    raise DuplicateTensorError("duplicate")
            except DuplicateTensorError:
                code, detail = (
                    "duplicate",
                    "a tensor id of this transfer is already held or in flight",
                )
        if code:
            self._stats.refused_sent += 1
            self._reply(ss, ss.sess.send(Refuse(msg.xfer, code, detail)))
            self._unpause_credit(ss, msg.xfer)
            return
        if not ss.queued and self._try_grant(ss, msg):
            return
        why = self._bounds.queue_refusal(
            ntensors=len(msg.specs),
            queued_tensors=len(ss.queued.ids),
            all_queued_tensors=self._admission.tensors,
        )
        if why is not None:
            self._stats.refused_sent += 1
            self._reply(ss, ss.sess.send(Refuse(msg.xfer, *why)))
            self._unpause_credit(ss, msg.xfer)
            return
        self._admission.add(ss.queued, msg.xfer, msg, [s.tensor_id for s in msg.specs])

    def _try_grant(self, ss: _ServerSession, msg: Reserve) -> bool:
        assert ss.peer is not None
        if not self._store.try_reserve(ss.peer, [(s.tensor_id, s.nbytes) for s in msg.specs]):
            return False
        self._unpause_credit(ss, msg.xfer)
        seq = ss.sess.next_grant_seq
        inx = _InXfer(
            msg.xfer,
            msg.specs,
            msg.nbytes,
            seq=seq,
            transport=msg.transport,
            expires=time.monotonic() + self.config.timeouts.transfer,
        )
        ss.granted[msg.xfer] = inx
        ss.granted_tensors += len(msg.specs)
        sink: SinkLink | None = ss.nccl if msg.transport == "nccl" else ss.sink
        assert sink is not None  # (_on_reserve refuses NCCL before the communicator)
        fut = sink.expect(seq, msg.xfer, msg.specs)
        fut.add_done_callback(functools.partial(self._grant_done, ss, inx))
        self._reply(ss, ss.sess.send(Grant(msg.xfer, seq)))
        if msg.transport == "nccl":
            self._get_poller().touch()  # a granted NCCL receive lands soon: spin for it
        if _trace.enabled:
            _trace.mark("granted", ss.trace_id, msg.xfer)
        return True

    def _grant_done(
        self, ss: _ServerSession, inx: _InXfer, fut: asyncio.Future[list[torch.Tensor]]
    ) -> None:
        _retrieve(fut)  # a sink aborted after the session died is not an error to log
        self._on_landed(ss, inx, fut)

    def cleanup(self, step: Callable[[], bool]) -> None:
        """Queue a lost session's teardown: ``step()`` does a slice of it and answers
        whether some is left. Every session's steps share one budget per loop pass
        (_CLEANUP_S), so ten sessions lost together cost no more per pass than one."""
        self._cleanups.append(step)
        if not self._cleanup_due:
            self._cleanup_due = True
            self._st.loop.call_soon(self._run_cleanups)

    def _run_cleanups(self) -> None:
        self._cleanup_due = False
        steps = self._cleanups
        end = time.perf_counter() + _CLEANUP_S
        while steps and time.perf_counter() < end:
            if not steps[0]():
                steps.popleft()
        if steps:
            self._cleanup_due = True
            self._st.loop.call_soon(self._run_cleanups)

    def cancel_in_slices(self, peer: PeerRef, ids: list[str], err: BaseException) -> None:
        """Release a lost session's pending tensors (their waiters fail with ``err``)."""
        pos = 0

        def step() -> bool:
            nonlocal pos
            self._store.cancel(peer, ids[pos : pos + _CANCEL_SLICE], err)
            pos += _CANCEL_SLICE
            if pos < len(ids):
                return True
            self.pump_queue()
            return False

        self.cleanup(step)

    def pump_queue(self) -> None:
        """Grant queued reservations that fit now, oldest first across sessions.

        A session's oldest reservation that does not fit holds up that session's
        later ones (one order per peer) but never another session's: one peer's
        large reservation waiting for room does not block the others.
        """
        if self._admission.queued and not self._pump_due:
            end = time.perf_counter() + _PUMP_S
            self._admission.pump(
                lambda q, msg: self._try_grant(q.owner, msg),
                stop=lambda: time.perf_counter() > end,
            )
            if self._admission.queued and time.perf_counter() > end:
                self._pump_due = True  # granting goes on next loop pass
                self._st.loop.call_soon(self._pump_later)
        if self._st.starved:
            for ss in sorted(self._st.starved, key=_share):
                if not ss.ack_due:
                    self.send_credit(ss)

    def _pump_later(self) -> None:
        self._pump_due = False
        self.pump_queue()

    def forget_expired_credit(self, ss: _ServerSession, now: float) -> None:
        """Tensors held on credit past the store's TTL have expired: refill the window."""
        assert ss.ledger is not None
        ttl = self.config.limits.ttl
        freed = 0
        while ss.credit_held:
            tid, (n, at) = next(iter(ss.credit_held.items()))
            if now - at <= ttl:
                break
            del ss.credit_held[tid]
            ss.ledger.release(n, 1)
            freed += 1
        if freed and not ss.ack_due:
            self.send_credit(ss)

    def expire_grants(self, ss: _ServerSession, now: float) -> None:
        """Fail TCP grants whose data never came (their room goes back to the store).

        Queued reservations have no deadline here: the sender withdraws at its own
        (a patient producer may wait long for credit); what a session may queue is
        bounded, and a head that does not fit holds up only its own session.
        """
        for inx in list(ss.granted.values()):
            if inx.expires > now:
                break  # granted in order, each with the same lifetime
            if inx.transport != "tcp":
                continue  # a posted NCCL receive ends by the pair's abort rules
            del ss.granted[inx.xfer]
            ss.granted_tensors -= len(inx.specs)
            ss.sink.cancel(inx.xfer)
            if len(ss.expired) >= 4096:
                ss.expired.clear()
            ss.expired.add(inx.xfer)
            assert ss.peer is not None
            err = TransferTimeoutError("the granted data did not arrive in time")
            self._store.cancel(ss.peer, [s.tensor_id for s in inx.specs], err)
            self._count_error("grant_expired")
            self._reply(ss, ss.sess.send(Failed(inx.xfer, "timeout", str(err))))

    # ------------------------------------------------------------------ landing

    def on_data(self, ss: _ServerSession, frames: list[zmq.Frame]) -> None:
        try:
            header = self._codec.decode(frames[0].buffer)
            if isinstance(header, (Put, Return, AckReq)):
                # protocol v2: one zmq message carries the PUTs (each header + its tensor
                # frames) and RETURNs of one loop pass of the sender, in its order
                i = 0
                while True:
                    if isinstance(header, Put):
                        n = put_frame_count(header.specs)
                        self._on_put(ss, header, frames[i + 1 : i + 1 + n])
                        i += 1 + n
                    elif isinstance(header, Return):
                        self._on_return(ss, header)
                        i += 1
                    elif isinstance(header, AckReq):
                        if ss.ledger is None:
                            raise RemoteProtocolError("ACK_REQ without credit")
                        ss.ack_due = ss.ack_force = True  # after the PUTs it follows
                        i += 1
                    else:
                        raise RemoteProtocolError(f"{header.NAME} among PUTs")
                    if i >= len(frames) or ss.dead:
                        break
                    header = self._codec.decode(frames[i].buffer)
                # an ACK the sender waits for leaves as soon as the messages that
                # arrived together are handled (_acks_now), before anything they woke
                # up (a waiting recv) runs: it is the sender's critical path. Others
                # are gathered (see _ack_deferrable)
                if ss.ack_due and not ss.dead:
                    if ss.ack_force:  # the sender waits: now, not after the read run
                        self.send_credit(ss, now=True)
                    elif self._ack_deferrable(ss):
                        self._defer_ack(ss)
                    else:
                        self._ack_now.append(ss)
                return
            if not isinstance(header, DataHeader):
                raise RemoteProtocolError(f"{header.NAME} on the data connection")
            if header.xfer in ss.expired:
                # data of a grant this end gave up on (and said so with FAILED): drop it
                ss.expired.discard(header.xfer)
                self._count_error("late_data")
                return
            ss.sess.receive_message(header)
            inx = ss.granted.get(header.xfer)
            fut = ss.sink.feed(header, frames[1:])
            if inx is not None:
                self._on_landed(ss, inx, fut)  # now, not a loop pass later
        except RemoteProtocolError as exc:
            self._count_error(getattr(exc, "code", "protocol"))
            self._reply_raw(ss.rid, ErrorMsg("protocol", str(exc)[:200]))
            self._server.drop_server(ss, exc, lost=True)

    def _on_return(self, ss: _ServerSession, msg: Return) -> None:
        if ss.ledger is None:
            raise RemoteProtocolError("RETURN without credit")
        ss.ledger.give_back(msg.credit_bytes, msg.credit_tensors)
        self._store.reserved -= msg.credit_bytes
        self._store.credit_n -= msg.credit_tensors
        # the RESERVE it makes room for (control connection: it may come before or
        # after) is granted or ends before new credit could take the room
        if msg.xfer in ss.queued or msg.xfer > ss.sess.max_xfer_seen:
            ss.ledger.paused_for = msg.xfer
        self._st.starved.add(ss)
        self.pump_queue()

    def _on_put(self, ss: _ServerSession, msg: Put, frames: list[zmq.Frame]) -> None:
        """Protocol v2: a transfer on standing credit lands now (raises RemoteProtocolError)."""
        ledger = ss.ledger
        if ledger is None or msg.xfer <= ss.last_put:
            raise RemoteProtocolError(f"PUT {msg.xfer} out of order or without credit")
        ss.last_put = msg.xfer
        specs = msg.specs
        k = len(specs)
        n = msg.nbytes
        ledger.spend(n, k)
        self._store.reserved -= n  # the session's credit becomes this transfer's room
        self._store.credit_n -= k
        assert ss.peer is not None
        if k == 1 and len(frames) == 1 and 0 < n <= DATA_FRAME_BYTES and len(frames[0]) == n:
            # one frame, length checked: the collector makes it a tensor (FrameTensor)
            items: list[tuple[str, int, Any]] = [
                (specs[0].tensor_id, n, FrameTensor(frames[0], specs[0]))
            ]
        else:
            tensors = frames_to_tensors(specs, frames)
            items = [(sp.tensor_id, sp.nbytes, t) for sp, t in zip(specs, tensors)]
        why = ""
        try:
            if ss.queued.claims_any(t for t, _, _ in items):
                raise DuplicateTensorError("duplicate")
            if not self._store.try_land(ss.peer, items, credited=True):
                why = "busy"  # (bytes and tensors were credited: not for want of room)
        except DuplicateTensorError:
            why = "duplicate"
        if why:
            self._stats.refused_sent += 1
            ss.refused.append((msg.xfer, why))
        else:
            now = time.monotonic()
            held = ss.credit_held
            for tid, nb, _ in items:
                held[tid] = (nb, now)
            ledger.hold(n, k)
            if _trace.enabled:
                _trace.mark("landed", ss.trace_id, msg.xfer)
            self._stats.transfers_received += 1
            self._stats.tensors_received += k
            self._stats.bytes_received += n
            ss.acks.append(msg.xfer)
        ss.ack_due = True  # sent by _on_data once the whole message is handled
        if msg.ack_now:
            ss.ack_force = True

    # ------------------------------------------------------------------ credit and ACKs

    def send_credit(self, ss: _ServerSession, now: bool = False) -> None:
        """One ACK for everything landed or refused this loop pass, with any new credit
        (``now``: the caller flushes the session's replies itself, at once)."""
        ss.ack_due = ss.ack_force = False
        if ss.ack_timer is not None:
            ss.ack_timer.cancel()
            ss.ack_timer = None
        ledger = ss.ledger
        if ledger is None or ss.dead:
            return
        store = self._store
        # this session's own RESERVE that its credit was returned for comes first; other
        # sessions' waiting reservations do not stop its credit (one peer's large
        # reservation must not starve every other peer: windows are bounded instead).
        # When room is short, sessions holding less go first (see pump_queue).
        room = 0 if ledger.paused_for else max(0, store.capacity - store.used)
        room_t = 0 if ledger.paused_for else max(0, store.max_tensors - store.count)
        if (
            (room or room_t)
            and self._st.starved
            and any(
                o is not ss and o.ledger is not None and o.ledger.share < ledger.share
                for o in self._st.starved
            )
        ):
            room = room_t = 0
        add_b, add_t = ledger.top_up(room, room_t)
        store.reserved += add_b
        store.credit_n += add_t
        if ledger.short:
            self._st.starved.add(ss)  # the budget is short: retried as room frees
        else:
            self._st.starved.discard(ss)
        if not (add_b or add_t or ss.acks or ss.refused or not ledger.announced):
            return
        ledger.announced = True
        acks, ss.acks = ss.acks, []
        refused, ss.refused = ss.refused, []
        wb, wt = ledger.window_bytes, ledger.window_tensors
        if ss.sess.state is not _OPEN:  # the session's rule: no ACK outside an open session
            ss.sess.send(Ack(wb, wt, add_b, add_t, (), ()))  # (raises LocalProtocolError)
        # an ACK changes no session state: encoded directly, at most MAX_ACKS of each list
        for i in range(0, max(len(acks), len(refused), 1), MAX_ACKS):
            data = self._codec.encode_ack(
                wb,
                wt,
                add_b if i == 0 else 0,
                add_t if i == 0 else 0,
                acks[i : i + MAX_ACKS],
                refused[i : i + MAX_ACKS],
            )
            self._reply(ss, data, now)

    def acks_now(self) -> None:
        """The data port read everything that had arrived: one ACK per session that
        landed something (messages read in one run share it)."""
        due, self._ack_now = self._ack_now, []
        for ss in due:
            if ss.ack_due and not ss.dead:
                self.send_credit(ss, now=True)

    def _ack_soon(self, ss: _ServerSession) -> None:
        """Credit freed (a tensor collected, a RESERVE ended): one ACK at the end of this
        loop pass with whatever landed, was refused or freed until then -- or, while
        the sender still holds a quarter of its window and waits for nothing, a deferred one."""
        if ss.ack_timer is not None:  # already deferred: the top-up rides on that ACK
            if self._ack_deferrable(ss):
                return
            ss.ack_timer.cancel()
            ss.ack_timer = None
            ss.ack_due = False
        if not ss.ack_due:
            ss.ack_due = True
            if self._ack_deferrable(ss):
                self._defer_ack(ss)
            else:
                self._st.loop.call_soon(self._ack_if_due, ss)

    @staticmethod
    def _ack_deferrable(ss: _ServerSession) -> bool:
        """May this session's owed ACK wait a little (to be sent with later ones)?

        Not if the sender waits for one of the PUTs (``ack_now``, ACK_REQ), a PUT was
        refused, ``_ACK_EVERY`` landed since the last ACK, or the sender's credit fell
        to a quarter of its window (it must never run dry for want of a top-up). A sender
        that starts waiting for a deferred PUT asks with ACK_REQ; one that waits for
        nothing gets the ACK after ``_ACK_DELAY_S``.
        """
        led = ss.ledger
        return not (
            ss.ack_force
            or ss.refused
            or len(ss.acks) >= _ACK_EVERY
            or led is None
            or not led.announced
            or 4 * led.credit_bytes < led.window_bytes
            or 4 * led.credit_tensors < led.window_tensors
        )

    def _defer_ack(self, ss: _ServerSession) -> None:
        if ss.ack_timer is None:
            ss.ack_timer = self._st.loop.call_later(_ACK_DELAY_S, self._ack_if_due, ss)

    def _ack_if_due(self, ss: _ServerSession) -> None:
        ss.ack_timer = None
        if ss.ack_due:
            self.send_credit(ss)

    def _unpause_credit(self, ss: _ServerSession, xfer: int) -> None:
        if ss.ledger is not None and ss.ledger.paused_for == xfer:
            ss.ledger.paused_for = 0
            self._ack_soon(ss)

    def collected(self, peer: PeerRef, tensor_id: str) -> None:
        """A tensor left the store through ``recv``: its session's credit may refill."""
        ss = self._st.by_peer.get(peer.engine_id)
        if ss is None or ss.ledger is None:
            return
        held = ss.credit_held.pop(tensor_id, None)
        if held is not None:
            ss.ledger.release(held[0], 1)
            if ss.ledger.short:  # else the window is full: nothing to top up
                self._ack_soon(ss)

    def _on_landed(
        self, ss: _ServerSession, inx: _InXfer, fut: asyncio.Future[list[torch.Tensor]]
    ) -> None:
        if ss.dead or fut.cancelled() or not fut.done():
            return
        if ss.granted.pop(inx.xfer, None) is None:
            return  # already handled (TCP lands synchronously; the callback comes later)
        ss.granted_tensors -= len(inx.specs)
        assert ss.peer is not None
        exc = fut.exception()
        if exc is None and inx.transport == "nccl":
            # NCCL matched the receive in posting order: that is this transfer's DATA.
            try:
                ss.sess.receive_message(DataHeader(inx.xfer, inx.seq, len(inx.specs)))
            except RemoteProtocolError as perr:
                exc = perr
        ids = [s.tensor_id for s in inx.specs]
        if exc is not None:
            self._store.cancel(ss.peer, ids, exc)
            self._reply(ss, ss.sess.send(Failed(inx.xfer, "aborted", str(exc)[:200])))
            self.pump_queue()
            return
        if inx.discard:
            self._store.cancel(ss.peer, ids, None)
            self.pump_queue()
        else:
            for spec, t in zip(inx.specs, fut.result()):
                self._store.land(ss.peer, spec.tensor_id, t)
            if _trace.enabled:
                _trace.mark("landed", ss.trace_id, inx.xfer)
            self._stats.transfers_received += 1
            self._stats.tensors_received += len(inx.specs)
            self._stats.bytes_received += inx.nbytes
        self._reply(ss, ss.sess.send(Done(inx.xfer)))
