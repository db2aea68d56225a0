"""The client side of a session: this engine sends, the peer receives.

A :class:`_ClientSession` is this engine's session to one peer (a control and a
data DEALER; its NCCL plane is :mod:`aiokv.engine.client_nccl`);
:class:`~aiokv.engine.outgoing._OutXfer` is one transfer it sends (``send`` and
``send_nowait`` hand the caller a :class:`~aiokv.engine.handle.TransferHandle`). The
session holds its engine as a :class:`~aiokv.engine.interfaces.ClientOwner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq
import zmq.asyncio

from aiokv._config import parse_address
from aiokv._exceptions import (
    AiokvError,
    ConnectError,
    ConnectTimeoutError,
    DuplicateTensorError,
    EngineClosedError,
    LayoutMismatchError,
    PeerLostError,
    RefusedError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferError,
)
from aiokv._runtime import trace as _trace
from aiokv._runtime.deadlines import (
    _DATA_CAP,
    _PLAIN_USER,
    MAX_FRAMES_PER_MESSAGE,
    _await_shielded,
    _Deadline,
    _retrieve,
)
from aiokv._runtime.zmqerr import channel_error
from aiokv._runtime.zsock import LoopSocket, Outbox, max_msg_size, monitor_socket
from aiokv.engine.client_nccl import _NcclPlane
from aiokv.engine.interfaces import ClientOwner
from aiokv.engine.outgoing import _OutXfer
from aiokv.protocol.credit import CreditAccount
from aiokv.protocol.messages import (
    DATA_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    AckReq,
    Bye,
    DataHeader,
    DataHello,
    Done,
    ErrorMsg,
    Failed,
    GetReply,
    Grant,
    Hello,
    Message,
    NcclReady,
    Ping,
    Pong,
    Refuse,
    Reserve,
    Return,
    TensorSpec,
    Welcome,
    Withdraw,
    Withdrawn,
)
from aiokv.protocol.session import Role, Session, SessionState, XferState
from aiokv.transport.base import MessageSource
from aiokv.transport.tcp import (
    TcpSource,
    fits_put,
    tensor_buffer,
    tensor_frames,
)

__all__: list[str] = []

log = logging.getLogger("aiokv")

#: PUTs of one loop pass leave in zmq messages of about this many frames: large enough
#: to share a message's cost, small enough that the receiver's ACK for the first ones
#: is on its way while the sender still writes the rest (one message per pass would
#: make a pipelined sender and its receiver take turns)
_PUT_BATCH_FRAMES = 32
_PUT_BATCH_BYTES = 256 * 1024

_REFUSALS: dict[str, type[RefusedError]] = {
    "duplicate": DuplicateTensorError,
    "layout_mismatch": LayoutMismatchError,
}


def _data_port(caps: Sequence[str]) -> int | None:
    """The data port a WELCOME announced, or None."""
    for c in caps:
        if c.startswith(_DATA_CAP):
            digits = c[len(_DATA_CAP) :]
            if digits.isascii() and digits.isdigit() and 0 < int(digits[:6]) < 65536:
                return int(digits)
    return None


class _ClientSession:
    """This engine's session to one peer: it sends data, the peer receives."""

    def __init__(self, owner: ClientOwner, address: str) -> None:
        self.owner = owner  # the engine that opened it (what it may use: ClientOwner)
        self.address = address
        # what the per-transfer path uses, bound once (no look-ups on the owner per transfer)
        self.loop = owner._loop
        self.codec = owner._codec
        self.stats = owner._stats
        self.count_error = owner._count_error
        self.granted_now = owner._granted_now  # a resolved future: "no room to wait for"
        self.trace_id = owner.engine_id  # this (sending) engine's id, for aiokv._runtime.trace
        self.sess = Session(Role.CLIENT, owner._codec)
        ctx = owner._sctx
        ctrl = ctx.socket(zmq.DEALER)
        data = ctx.socket(zmq.DEALER)
        linger = int(owner.config.timeouts.linger * 1000)
        for s in (ctrl, data):
            s.setsockopt(zmq.LINGER, linger)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(
                zmq.MAXMSGSIZE,
                max_msg_size(owner.config.limits.max_frame_bytes, owner.config.curve is not None),
            )
        owner._apply_curve_client(ctrl, address)
        owner._apply_curve_client(data, address)
        host, port = parse_address(address)
        self.host = f"[{host}]" if ":" in host else host
        # A zmq DEALER reconnects by itself; a peer that restarted on the same port
        # must not see this session's messages. Watch for the connection dropping.
        # While connecting, zmq reports each attempt the peer's host refused (nothing
        # listens there: the OS answered with a reset) as CONNECT_RETRIED, and a
        # connection made as CONNECTED: attempts refused for Timeouts.connect_retry
        # end the session set-up at once rather than at the connect deadline.
        self.monitor = monitor_socket(
            ctrl,
            owner._ctx,
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED,
        )
        self.refused_since: float | None = None
        ctrl.connect(f"tcp://{self.host}:{port}")
        # the data socket connects once WELCOME named the data port and the token (open)
        self.ctrl = LoopSocket(ctrl, self._on_ctrl, self._on_socket_error)
        self.data = LoopSocket(data, None, self._on_socket_error)
        self.source: MessageSource = TcpSource(self.data)
        self.welcome: asyncio.Future[Welcome] = owner._loop.create_future()
        self.welcome.add_done_callback(_retrieve)
        self.xfers: dict[int, _OutXfer] = {}
        self.gets: dict[int, asyncio.Future[GetReply]] = {}
        self.last_recv = time.monotonic()
        self.last_ping = 0.0
        self.last_used = time.monotonic()
        self.outbox = Outbox(
            self.ctrl,
            lambda exc: self.fail(channel_error(exc, f"control channel to {address}")),
            max_frames=MAX_FRAMES_PER_MESSAGE,
        )
        self.suspect = False  # missed its heartbeat once; judged on the next tick
        self.nonce = itertools.count(1)
        self.get_ids = itertools.count(1)
        self.dead: BaseException | None = None
        # its NCCL data plane: the communicator's set-up, the poster of NCCL transfers
        self.nccl_plane = _NcclPlane(self)
        self.tasks: list[asyncio.Task[None]] = []
        self.credit = CreditAccount()  # protocol v2, once the peer announced its window
        self.credit_wait: deque[_OutXfer] = deque()  # PUTs waiting for credit, in order
        self.gave_up: set[int] = set()  # posted PUTs whose caller timed out: a late ACK is fine
        self.puts_unacked = 0  # posted PUTs not settled yet
        self.last_put = 0  # the newest PUT posted
        self.ack_asked = 0  # the newest PUT an ACK_REQ covers
        # what each message the session lets through does: one look-up per message
        # (Session.receive has checked that a client may receive it in this state)
        self.handlers: dict[type[Message], Callable[[Any], None]] = {
            Ack: self._on_ack,  # the hot path's one message
            Welcome: self._on_welcome,
            Grant: self._on_grant,
            Refuse: self._on_refuse,
            Withdrawn: self._on_withdrawn,
            Done: self._on_done,
            Failed: self._on_failed,
            GetReply: self._on_get_reply,
            Pong: self._on_pong,
            ErrorMsg: self._on_error,
            Bye: self._on_bye,
            NcclReady: self.nccl_plane.on_nccl_ready,
        }
        # PUT/RETURN frames of this loop pass: a PUT's frames stay in one message
        self.data_out = Outbox(
            self.data,
            lambda exc: self.fail(channel_error(exc, f"data channel to {address}")),
            copy=False,
            batch_frames=_PUT_BATCH_FRAMES,
            batch_bytes=_PUT_BATCH_BYTES,
        )

    @property
    def peer_id(self) -> str | None:
        """The peer's identity: its CURVE key when CURVE is on, else the id it announced."""
        cc = self.owner.config.curve
        if cc is not None:
            key = cc.server_keys.get(self.address, cc.default_server_key)
            return "curve:" + key.decode() if key else None
        w = self.welcome.result() if self.welcome.done() and not self.welcome.exception() else None
        return w.engine_id if w else None

    async def open(self, timeout: float) -> None:
        e = self.owner
        self.tasks.append(
            asyncio.create_task(
                self.nccl_plane.poster(), name=f"aiokv-client-poster-{self.address}"
            )
        )
        self.tasks.append(
            asyncio.create_task(self._watch(), name=f"aiokv-client-monitor-{self.address}")
        )
        hello = Hello(PROTOCOL_VERSION, e.engine_id, e.address, e._capabilities(), e.config.layout)
        dl = _Deadline(timeout)
        try:
            # With IMMEDIATE set, the HELLO send itself waits until a peer is connected:
            # bound it by the connect deadline too (nothing listening must not hang).
            await asyncio.wait_for(self.ctrl.send_wait([self.sess.send(hello)]), dl.left())
            w = await _await_shielded(self.welcome, dl.left())
            self._connect_data(w)
            # the first message waits for the data port's handshake (and its ZAP check)
            await asyncio.wait_for(
                self.data.send_wait([e._codec.encode(DataHello(w.token))]), dl.left()
            )
        except (TimeoutError, asyncio.TimeoutError):  # the latter differs on Python 3.10
            raise ConnectTimeoutError(
                f"no answer from {self.address} within {timeout:.3g}s"
            ) from None
        except (asyncio.CancelledError, zmq.ZMQError):
            # Closing the sockets of a session that failed meanwhile cancels (or fails)
            # their pending sends: report why the session failed, not that.
            if self.dead is not None:
                raise (
                    self.dead if isinstance(self.dead, AiokvError) else ConnectError(str(self.dead))
                ) from None
            raise
        self.last_recv = time.monotonic()

    def _connect_data(self, w: Welcome) -> None:
        """Connect the data socket to the port WELCOME announced, proving the session's token.

        The peer's data port reads frames up to a tensor's size, so it lets a connection
        in only after zmq's handshake authenticated it: with CURVE by its key (as the
        control connection), else by PLAIN with the session token as the password.
        """
        port = _data_port(w.capabilities)
        if port is None:
            raise ConnectError(f"{self.address} announced no data port")
        sock = self.data.sock
        if self.owner.config.curve is None:
            sock.setsockopt(zmq.PLAIN_USERNAME, _PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, w.token.hex().encode())
        sock.connect(f"tcp://{self.host}:{port}")

    # ---- transfers
    def start(
        self,
        specs: list[TensorSpec],
        tensors: list[torch.Tensor],
        transport: str = "tcp",
        ready: Any = None,
        lean: bool = False,
        watched: bool = False,
        strided: bool = False,
    ) -> _OutXfer:
        """Start a transfer. ``lean``: the caller awaits ``done`` itself (no ``released``
        future, no retrieval callback) and wants an immediate PUT sent at once rather
        than with the rest of this loop pass's. ``watched``: an ``_XferWatch`` will
        read ``done``'s outcome (no retrieval callback needed). ``strided``: a tensor
        is a non-contiguous CPU view, copied when posted (see :meth:`_OutXfer.dense`)."""
        if self.dead is not None:
            raise PeerLostError(f"session with {self.address} is gone: {self.dead}")
        loop = self.loop
        nbytes = specs[0].nbytes if len(specs) == 1 else sum(s.nbytes for s in specs)
        k = len(specs)
        if transport == "tcp" and not self.credit_wait and not strided:
            if (
                self.credit.fits_window(nbytes, k)
                and fits_put(specs, nbytes)  # larger tensors: RESERVE (reassembled off-loop)
                and self.credit.try_spend(nbytes, k)
            ):
                # the common case: credit in hand, nobody queued before it. Posted now;
                # "granted" is the engine's resolved future (no room to wait for)
                x = _OutXfer(
                    self.sess.new_xfer_id(),
                    specs,
                    tensors,
                    self.granted_now,
                    loop.create_future(),
                    put=True,
                    waited=lean or not watched,
                    nbytes=nbytes,
                )
                self.last_used = time.monotonic()
                if not lean:
                    x.released = loop.create_future()
                    if not watched:
                        x.done.add_done_callback(_retrieve)
                if _trace.enabled:
                    _trace.mark("start", self.trace_id, x.xfer)
                self.xfers[x.xfer] = x
                self._post_put(x)  # (lean: waited, so ack_now and at once)
                return x
        x = _OutXfer(
            self.sess.new_xfer_id(), specs, tensors, loop.create_future(), loop.create_future()
        )
        x.transport = transport
        x.ready = ready
        x.strided = strided
        x.waited = not watched
        x.released = loop.create_future()
        self.last_used = time.monotonic()
        x.granted.add_done_callback(_retrieve)
        x.done.add_done_callback(_retrieve)
        x.nbytes = nbytes
        if transport == "tcp":
            # protocol v2: a transfer within the window spends standing credit (one
            # message, no round trip); one larger asks with RESERVE. Both wait in one
            # queue per session, so a later transfer never takes room from an earlier.
            # A PUT lands synchronously on the receiver's loop, so it carries only
            # tensors of at most PUT_MAX_TENSOR_BYTES (a short copy there, if any).
            x.put = self.credit.fits_window(nbytes, k) and fits_put(specs, nbytes)
            if x.put and _trace.enabled:
                _trace.mark("start", self.trace_id, x.xfer)
            if x.put or self.credit_wait:
                self.xfers[x.xfer] = x
                self.credit_wait.append(x)
                self._drain_credit_wait()
                return x
        self.xfers[x.xfer] = x
        self._reserve(x)
        return x

    @property
    def peer_caps(self) -> tuple[str, ...]:
        if self.welcome.done() and not self.welcome.exception():
            return self.welcome.result().capabilities
        return ()

    def _reserve(self, x: _OutXfer) -> None:
        x.posted = True
        if x.transport == "tcp" and self.credit.credit_bytes:
            # give unspent credit back first (after our PUTs, on their connection), so
            # that the whole budget can serve a transfer larger than the window
            b, t = self.credit.take_all()
            self.data_out.put([self.codec.encode(Return(x.xfer, b, t))])
        self._send_ctrl(self.sess.send(Reserve(x.xfer, x.transport, tuple(x.specs))))
        if _trace.enabled:
            _trace.mark("start", self.trace_id, x.xfer)
        if x.transport == "nccl":
            self.owner._get_poller().touch()  # the GRANT is read on a spinning loop

    def _post_put(self, x: _OutXfer) -> None:
        # the receiver answers at once if the caller waits, or if nothing else is in
        # flight (a lone PUT_ASYNC is likely awaited next); else it may gather ACKs
        x.ack_now = x.waited or not self.puts_unacked
        self.puts_unacked += 1
        self.last_put = x.xfer
        header = self.codec.encode_put(x.xfer, x.specs, x.ack_now)
        if x.strided:
            x.dense()
        if len(x.tensors) == 1 and x.nbytes <= DATA_FRAME_BYTES:
            frames = [header, tensor_buffer(x.tensors[0])]
        elif x.nbytes <= DATA_FRAME_BYTES:
            frames = [header, *(tensor_buffer(t) for t in x.tensors)]
        else:
            frames = [header]
            for t in x.tensors:
                frames.extend(tensor_frames(t))
        # a PUT somebody waits for (or a lone PUT_ASYNC, likely awaited next) leaves now;
        # the others of a burst or a stream leave together at the end of the loop pass
        self.data_out.put(frames, nbytes=x.nbytes, now=x.ack_now)
        x.posted = True
        if not x.granted.done():
            x.granted.set_result(0)
        if _trace.enabled:
            _trace.mark("posted", self.trace_id, x.xfer)

    def _drain_credit_wait(self) -> None:
        """Post waiting PUTs, in order, while the credit lasts."""
        w = self.credit_wait
        while w and self.dead is None:
            x = w[0]
            if x.abandoned:
                w.popleft()
                continue
            if not x.put:
                w.popleft()
                self._reserve(x)
                continue
            if not self.credit.try_spend(x.nbytes, len(x.specs)):
                self.ask_ack()  # a top-up may be riding on a deferred ACK
                return
            w.popleft()
            self._post_put(x)

    def want_ack(self, x: _OutXfer) -> None:
        """Somebody started waiting for ``x``: if its PUT let the receiver gather ACKs
        and none came yet, ask for them (ACK_REQ, after the PUTs on their connection);
        if it still waits for credit, its PUT will ask for its ACK itself."""
        if not x.put or x.done.done():
            return
        if not x.posted:
            x.waited = True
        elif not x.ack_now and x.xfer > self.ack_asked:
            self.ask_ack()

    def ask_ack(self) -> None:
        """ACK_REQ for every PUT posted so far (once), unless all asked for theirs."""
        if self.last_put > self.ack_asked and self.puts_unacked and self.dead is None:
            self.ack_asked = self.last_put
            self.data_out.put([self.codec.encode(AckReq(self.last_put))])

    def _settle_put(self, xfer: int, exc: BaseException | None) -> bool:
        """An ACK settled a PUT; False if it names none of ours (a protocol error)."""
        x = self.xfers.get(xfer)
        if x is None and xfer in self.gave_up:
            self.gave_up.discard(xfer)
            self.puts_unacked -= 1
            return True
        if x is None or not x.put or not x.posted:
            return False
        del self.xfers[xfer]
        self.puts_unacked -= 1
        if exc is not None:
            self.stats.refused_received += 1
        self._end(x, exc)
        return True

    def _end(self, x: _OutXfer, exc: BaseException | None) -> None:
        """A transfer is over: landed (``exc`` None, counted as sent) or failed with ``exc``."""
        if exc is None:
            if _trace.enabled:
                _trace.mark("done", self.trace_id, x.xfer)
            st = self.stats
            st.transfers_sent += 1
            st.tensors_sent += len(x.specs)
            st.bytes_sent += x.nbytes
            x.tensors = []
        x.release_when_idle()
        if exc is None:
            if not x.done.done():
                x.done.set_result(None)
            return
        for f in (x.granted, x.done):
            if not f.done():
                f.set_exception(exc)

    def _on_ack(self, msg: Ack) -> None:
        try:
            self.credit.add(msg.window_bytes, msg.window_tensors, msg.add_bytes, msg.add_tensors)
        except RemoteProtocolError as exc:
            self.fail(exc)
            return
        for xfer in msg.done:
            if not self._settle_put(xfer, None):
                self.count_error("bad_ack")
                self.fail(RemoteProtocolError(f"ACK for transfer {xfer}, not a PUT in flight"))
                return
        for xfer, code in msg.refused:
            cls = _REFUSALS.get(code, RefusedError)
            why = cls(f"{self.address} refused the transfer: {code}", code=code)
            if not self._settle_put(xfer, why):
                self.count_error("bad_ack")
                self.fail(RemoteProtocolError(f"ACK refuses transfer {xfer}, not a PUT in flight"))
                return
        self._drain_credit_wait()

    def abandon(self, x: _OutXfer, deadline: bool = False) -> None:
        """The caller gave up. A transfer not granted yet is withdrawn (a GRANT that
        crosses the WITHDRAW is answered with FAILED, no data). One granted is withdrawn
        too when its deadline passed (``deadline``) and it travels by TCP: FAILED tells
        the receiver, which frees its room and the tensor ids and drops the data when it
        comes; cancelled, it completes in the background (it is committed)."""
        if not x.posted:  # still waiting in this end's queue: nothing left the process
            x.abandoned = True
            self.xfers.pop(x.xfer, None)
            x.release_when_idle()
            self.stats.withdrawn += 1
            for f in (x.granted, x.done):
                if not f.done():
                    f.cancel()
            self._drain_credit_wait()  # the next in line may go now
            return
        if x.put:  # posted: it lands or not, the caller is gone; a late ACK is expected
            self.xfers.pop(x.xfer, None)
            x.release_when_idle()
            if len(self.gave_up) >= 4096:
                self.gave_up.clear()
            self.gave_up.add(x.xfer)
            return
        if self.dead is not None:
            return
        state = self.sess.xfer_state(x.xfer)
        if state is XferState.RESERVED:
            x.abandoned = True  # a GRANT crossing the WITHDRAW gets FAILED (see _on_grant)
            self._send_ctrl(self.sess.send(Withdraw(x.xfer)))
        elif deadline and x.transport == "tcp" and state in (XferState.GRANTED, XferState.SENT):
            self._withdraw_granted(x)

    def _withdraw_granted(self, x: _OutXfer) -> None:
        """End a granted TCP transfer the caller gave up on: FAILED to the receiver (which
        drops its data, late or not, and frees its room and ids), failed here, never
        counted as sent; a DONE or FAILED that crossed it is expected (Session)."""
        self.xfers.pop(x.xfer, None)
        self._send_ctrl(
            self.sess.send(Failed(x.xfer, "withdrawn", "the sender gave up on the transfer"))
        )
        self.stats.withdrawn += 1
        x.tensors = []
        x.release_when_idle()
        for f in (x.granted, x.done):
            if not f.done():
                f.cancel()

    def _send_ctrl(self, data: bytes) -> None:
        """Queue a control message; everything queued in one loop pass leaves as one zmq message."""
        if self.dead is None:
            self.outbox.put([data])

    def _on_socket_error(self, exc: zmq.ZMQError) -> None:
        self.fail(channel_error(exc, f"connection to {self.address}"))

    def _on_ctrl(self, frames: list[zmq.Frame]) -> None:
        """Control messages from the peer (called by the socket's reader, in order)."""
        if self.dead is not None:
            return
        self.last_recv = time.monotonic()
        handlers = self.handlers
        for frame in frames:
            try:
                msg = self.sess.receive(frame.buffer)
            except RemoteProtocolError as exc:
                self.count_error(getattr(exc, "code", "protocol"))
                with contextlib.suppress(Exception):
                    self.ctrl.send([self.codec.encode(ErrorMsg("protocol", str(exc)[:200]))])
                self.fail(exc)
                return
            handlers[type(msg)](msg)
            if self.dead is not None:
                return

    def _on_welcome(self, msg: Welcome) -> None:
        if not self.welcome.done():
            self.welcome.set_result(msg)

    def _on_grant(self, msg: Grant) -> None:
        x = self.xfers[msg.xfer]
        if x.abandoned and x.transport == "tcp":
            self._withdraw_granted(x)  # it crossed the WITHDRAW: no data, FAILED instead
            return
        x.seq = msg.seq
        if _trace.enabled:
            _trace.mark("grant", self.trace_id, x.xfer)
        if not x.granted.done():
            x.granted.set_result(msg.seq)
        if x.transport == "tcp":
            # zmq queues sends in call order: post at once, in grant order
            header = DataHeader(x.xfer, x.seq, len(x.specs))
            try:
                self.source.post_nowait(self.sess.send(header), x.dense())
            except (zmq.ZMQError, AiokvError) as perr:
                self.fail(PeerLostError(f"data channel to {self.address} failed: {perr}"))
                return
            if _trace.enabled:
                _trace.mark("posted", self.trace_id, x.xfer)
        else:
            self.nccl_plane.post_queue.put_nowait(x)

    def _on_refuse(self, msg: Refuse) -> None:
        self.stats.refused_received += 1
        cls = _REFUSALS.get(msg.code, RefusedError)
        self._end(
            self.xfers.pop(msg.xfer),
            cls(f"{self.address} refused the transfer: {msg.code}: {msg.detail}", code=msg.code),
        )

    def _on_withdrawn(self, msg: Withdrawn) -> None:
        self.stats.withdrawn += 1
        self._end(self.xfers.pop(msg.xfer), TransferError("withdrawn"))

    def _on_done(self, msg: Done) -> None:
        x = self.xfers.pop(msg.xfer, None)
        if x is not None:  # (None: it crossed this end's FAILED, the transfer is over)
            self._end(x, None)

    def _on_failed(self, msg: Failed) -> None:
        x = self.xfers.pop(msg.xfer, None)
        if x is not None:  # (None: it crossed this end's FAILED)
            self._end(
                x,
                TransferAbortedError(
                    f"{self.address} failed the transfer: {msg.code}: {msg.detail}"
                ),
            )

    def _on_get_reply(self, msg: GetReply) -> None:
        g = self.gets.pop(msg.req, None)
        if g is not None and not g.done():
            g.set_result(msg)

    def _on_pong(self, msg: Pong) -> None:
        pass  # its arrival (last_recv) is what counts

    def _on_error(self, msg: ErrorMsg) -> None:
        self.count_error("peer_error")
        if msg.code == "layout_mismatch":
            self.fail(
                LayoutMismatchError(
                    f"{self.address} refused the session: {msg.detail}", code=msg.code
                )
            )
        else:
            self.fail(
                RemoteProtocolError(f"{self.address} reported a protocol error: {msg.detail}")
            )

    def _on_bye(self, msg: Bye) -> None:
        self.fail(PeerLostError(f"{self.address} closed the session"))

    def ping(self, now: float) -> None:
        self.last_ping = now
        self._send_ctrl(self.sess.send(Ping(next(self.nonce))))

    def fail(self, exc: BaseException) -> None:
        """Tear the session down and fail everything waiting on it."""
        if self.dead is not None:
            return
        self.dead = exc
        self.outbox.close()  # what this session had queued dies with it
        self.data_out.close()
        e = self.owner
        if not self.welcome.done():
            self.welcome.set_exception(
                exc if isinstance(exc, AiokvError) else ConnectError(str(exc))
            )
        for x in self.xfers.values():
            for f in (x.granted, x.done):
                if not f.done():
                    f.set_exception(exc)
            x.release_when_idle()  # after an abort the poller settles ``sent``
        self.xfers.clear()
        self.credit_wait.clear()
        for g in self.gets.values():
            if not g.done():
                g.set_exception(exc)
        self.gets.clear()
        self.sess.close()
        self.source.abort(exc)
        self.nccl_plane.abort(exc)
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        e._forget_client(self.address, self)
        if isinstance(exc, PeerLostError):
            e._stats.peers_lost += 1
        e._spawn(self._close_sockets())

    async def _watch(self) -> None:
        """Fail the session as soon as its control connection drops (peer died or restarted)."""
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                frames = await self.monitor.recv_multipart()
                event = parse_monitor_message(frames)
                if event["event"] == zmq.EVENT_CONNECT_RETRIED:
                    if self.welcome.done():
                        continue
                    now = time.monotonic()
                    if self.refused_since is None:
                        self.refused_since = now
                    elif now - self.refused_since >= self.owner.config.timeouts.connect_retry:
                        self.fail(
                            ConnectError(
                                f"{self.address} refused every connection for "
                                f"{now - self.refused_since:.2f}s (nothing listens there)"
                            )
                        )
                        return
                elif event["event"] == zmq.EVENT_CONNECTED:
                    self.refused_since = None
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    if self.welcome.done():
                        self.fail(PeerLostError(f"connection to {self.address} closed"))
                    else:
                        self.fail(
                            ConnectError(
                                f"{self.address} closed the connection during the handshake "
                                "(not an aiokv engine, or a CURVE key it does not accept)"
                            )
                        )
                    return
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, ValueError):
            return

    async def _close_sockets(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        with contextlib.suppress(zmq.ZMQError):
            self.ctrl.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.ctrl.close()
        self.data.close()

    async def bye(self, exc: BaseException | None = None) -> None:
        if self.dead is None and self.sess.state is SessionState.OPEN:
            with contextlib.suppress(Exception):
                self._send_ctrl(self.sess.send(Bye()))
                self.outbox.flush()  # now: fail() below stops the session's queue
        self.fail(exc or EngineClosedError("engine closed"))
