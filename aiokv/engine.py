"""The engine: sessions with peers, the receive store, and the public API.

An :class:`Engine` listens on one zmq ROUTER socket (``config.listen``) and
opens, lazily, one *client session* per peer it sends to: a DEALER socket for
control messages and a second DEALER for data, both connected to the peer's
ROUTER. Data flows client -> server inside a session; a peer that sends back
uses its own client session. Every wait is an awaited future resolved by one
of three tasks per engine (the ROUTER reader, the housekeeping loop, and a
reader + poster per client session); no thread waits on anything.

The rules the design keeps (see docs/design.md):

* reserve before launch: nothing is put on the wire before the receiver's
  GRANT, and the receiver grants only what fits in its byte budget, so a
  sender waits for credit rather than the receiver dropping data;
* one order per peer: data is posted in the receiver's grant order;
* cancellation is honest: before its grant a transfer is withdrawn on both
  sides; after it the transfer is committed and finishes in the background
  while the caller gets its CancelledError at once;
* every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq
import zmq.asyncio

from . import _blocking, _trace
from ._config import EngineConfig, parse_address
from ._exceptions import (
    AiokvError,
    ConfigError,
    ConnectError,
    ConnectTimeoutError,
    DuplicateTensorError,
    EngineClosedError,
    LayoutMismatchError,
    NegotiateTimeoutError,
    NotPublishedError,
    PeerLostError,
    RefusedError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from ._zmqerr import channel_error, listen_error
from ._zsock import LoopSocket, Outbox, monitor_socket
from .cuda import _resolve
from .protocol.admission import AdmissionQueue, PeerBounds, PeerQueue
from .protocol.codec import MAX_ACKS, TOKEN_BYTES, Codec, WireError, WireLimits
from .protocol.credit import CreditAccount, CreditLedger
from .protocol.messages import (
    DATA_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Bye,
    DataHeader,
    DataHello,
    Done,
    ErrorMsg,
    Failed,
    Get,
    GetReply,
    Grant,
    Hello,
    Message,
    NcclReady,
    NcclSetup,
    Ping,
    Pong,
    Put,
    Refuse,
    Reserve,
    Return,
    TensorSpec,
    Welcome,
    Withdraw,
    Withdrawn,
)
from .protocol.session import Role, Session, SessionState, XferState
from .store import PeerRef, ReceiveStore, StoreStatistics
from .transport.tcp import (
    TcpSink,
    TcpSource,
    dtype_name,
    fits_put,
    frames_to_tensors,
    put_frame_count,
    tensor_buffer,
    tensor_frames,
)

if TYPE_CHECKING:
    from ._watchdog import LoopWatchdog
    from .cuda import ProgressPoller
    from .transport.nccl import NcclSink, NcclSource

__all__ = ["Engine", "EngineStatistics", "TransferHandle"]

log = logging.getLogger("aiokv")

#: Control messages queued in one loop pass leave as one zmq message of at most this
#: many frames (a peer refuses more than 4x this; the sender splits, never the peer).
MAX_FRAMES_PER_MESSAGE = 1024
#: PUTs of one loop pass leave in zmq messages of about this many frames: large enough
#: to share a message's cost, small enough that the receiver's ACK for the first ones
#: is on its way while the sender still writes the rest (one message per pass would
#: make a pipelined sender and its receiver take turns)
_PUT_BATCH_FRAMES = 32
_PUT_BATCH_BYTES = 256 * 1024
#: a new connection's first message is one HELLO: anything larger is refused (and hung up)
_MAX_FIRST_FRAME = 64 * 1024
#: the capability in WELCOME naming the data port ("data:<port>")
_DATA_CAP = "data:"
#: PLAIN user name of data connections (the password is the session token, in hex)
_PLAIN_USER = b"aiokv"
#: ZAP domain of the data port without CURVE (this engine's own ZAP handler answers it)
_DATA_DOMAIN = b"aiokv-data"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_MAX_GETS_PER_SESSION = 16
_CANCEL_SLICE = 4096  # pending tensors of a lost session released per loop pass
#: granted, not yet landed transfers of one session (zero-byte ones cost no budget)
_MAX_GRANTED_PER_SESSION = 16384
_MAX_GETS_SERVING = 64

_REFUSALS: dict[str, type[RefusedError]] = {
    "duplicate": DuplicateTensorError,
    "layout_mismatch": LayoutMismatchError,
}


@dataclass(slots=True)
class EngineStatistics:
    """Counters of one engine (a snapshot; see :meth:`Engine.statistics`)."""

    address: str = ""
    transfers_sent: int = 0
    transfers_failed: int = 0
    tensors_sent: int = 0
    bytes_sent: int = 0
    transfers_received: int = 0
    tensors_received: int = 0
    bytes_received: int = 0
    refused_sent: int = 0
    refused_received: int = 0
    withdrawn: int = 0
    queued_reservations: int = 0
    gets_served: int = 0
    peers_lost: int = 0
    sessions_opened: int = 0
    client_sessions: int = 0
    server_sessions: int = 0
    protocol_errors: dict[str, int] = field(default_factory=dict)
    store: StoreStatistics | None = None
    #: protocol v2: standing credit granted to peers and not yet spent (bytes, tensors);
    #: it is held in the receive budget but not counted in ``store.reserved_bytes``
    credit_bytes: int = 0
    credit_tensors: int = 0
    #: protocol v2, sending side: transfers waiting in this engine for the peer's credit
    waiting_for_credit: int = 0
    #: protocol v2, receiving side: peer sessions whose credit the full budget holds back
    credit_starved: int = 0
    #: NCCL data plane: live communicators, enqueues that had to settle (count,
    #: total and max seconds), and the progress poller's counters
    nccl: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


_STRIDED = torch.strided


def _prepare(
    items: Iterable[tuple[str, torch.Tensor]], max_id: int, max_tensors: int = 1 << 30
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    seen: set[str] = set()
    for tid, t in items:
        if not isinstance(tid, str) or not tid or len(tid) > max_id:
            raise ConfigError(f"tensor ids are non-empty strings of at most {max_id} characters")
        if tid in seen:
            raise ConfigError(f"tensor id {tid!r} given twice in one transfer")
        seen.add(tid)
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{tid!r}: expected a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cpu or t.is_cuda) or t.layout is not torch.strided:
            # a meta tensor has no memory (zmq would read address 0); sparse ones no flat bytes
            raise ConfigError(
                f"{tid!r}: only dense CPU or CUDA tensors can be sent, "
                f"got a {t.layout} tensor on {t.device}"
            )
        name = dtype_name(t.dtype)
        if name is None:
            raise ConfigError(f"{tid!r}: dtype {t.dtype} cannot be sent")
        c = t.detach() if t.requires_grad else t  # (a new tensor object costs a little)
        if not c.is_contiguous():
            c = c.contiguous()
        specs.append(TensorSpec(tid, name, tuple(c.shape)))
        tensors.append(c)
    if not specs:
        raise ConfigError("nothing to send")
    if len(specs) > max_tensors:
        raise ConfigError(
            f"{len(specs)} tensors in one transfer; at most {max_tensors} "
            "(Limits.max_tensors_per_transfer, both ends)"
        )
    return specs, tensors


@dataclass(slots=True)
class _Staged:
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    ready: Any  # torch.cuda.Event for CUDA tensors
    cuda: bool


class _Deadline:
    """One time budget for all phases of an operation."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        r = max(0.0, self.at - time.monotonic())
        return r if cap is None else min(r, cap)


async def _await_shielded(fut: asyncio.Future[Any], timeout: float) -> Any:
    """Wait for ``fut`` at most ``timeout`` s without cancelling it on timeout/cancel.

    Raises TimeoutError on timeout; cancelling the caller leaves ``fut`` alone.
    (A waiter future and a timer: cheaper than ``wait_for(shield(...))``, which
    creates a task per wait, on the hot path of every transfer.)
    """
    if fut.done():
        return fut.result()
    loop = fut.get_loop()  # (asyncio.get_running_loop costs a getpid syscall on 3.11)
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    fut.add_done_callback(wake)
    timer = loop.call_later(timeout, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    if fut.done():
        return fut.result()
    raise TimeoutError


def _watchdog_report(why: str) -> None:
    """The loop watchdog's report (on its thread): the engine's log, at ERROR."""
    log.error("aiokv: %s", why)


def _share(ss: _ServerSession) -> int:
    return ss.ledger.share if ss.ledger is not None else 0


def _frame_fd(frame: zmq.Frame) -> int | None:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def _peer_name(fd: int) -> str | None:
    """The remote end of a connection's descriptor (zmq owns it; we look through a dup)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return repr(s.getpeername())
    except OSError:
        return None


def _shutdown_fd(fd: int, expect: str | None) -> None:
    """Hang up a connection zmq owns: shut the socket down, zmq then closes it.

    ``expect`` is the remote end seen when the connection was accepted; if the
    descriptor now names another connection (closed and reused), leave it alone.
    """
    if expect is None:
        # no remote end was seen: the connection was gone already, and the descriptor
        # may name somebody else's by now (a reused number): leave it alone
        return
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if repr(s.getpeername()) != expect:
                return
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _data_port(caps: Sequence[str]) -> int | None:
    """The data port a WELCOME announced, or None."""
    for c in caps:
        if c.startswith(_DATA_CAP):
            digits = c[len(_DATA_CAP) :]
            if digits.isascii() and digits.isdigit() and 0 < int(digits[:6]) < 65536:
                return int(digits)
    return None


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


# --------------------------------------------------------------------------- client side


@dataclass(slots=True, eq=False)
class _OutXfer:
    xfer: int
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    granted: asyncio.Future[int]
    done: asyncio.Future[None]
    seq: int = -1
    transport: str = "tcp"
    ready: Any = None  # CUDA event: the producer's stream reached the send
    sent: Any = None  # NCCL: future of the send's completion on this side
    released: asyncio.Future[None] | None = None  # set once nothing reads the tensors any more
    put: bool = False  # protocol v2: sent on standing credit (PUT), settled by an ACK
    posted: bool = False
    abandoned: bool = False
    nbytes: int = 0

    def release_when_idle(self) -> None:
        """Resolve ``released`` once the data plane is done with the source buffers."""
        rel = self.released
        if rel is None or rel.done():
            return
        sent = self.sent
        if sent is not None and not sent.done():
            sent.add_done_callback(lambda _f: _resolve(rel))
        else:
            rel.set_result(None)


class _ClientSession:
    """This engine's session to one peer: it sends data, the peer receives."""

    def __init__(self, engine: Engine, address: str) -> None:
        self.engine = engine
        self.address = address
        self.sess = Session(Role.CLIENT, engine._codec)
        ctx = engine._sctx
        ctrl = ctx.socket(zmq.DEALER)
        data = ctx.socket(zmq.DEALER)
        linger = int(engine.config.timeouts.linger * 1000)
        for s in (ctrl, data):
            s.setsockopt(zmq.LINGER, linger)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.MAXMSGSIZE, engine.config.limits.max_frame_bytes)
        engine._apply_curve_client(ctrl, address)
        engine._apply_curve_client(data, address)
        host, port = parse_address(address)
        self.host = f"[{host}]" if ":" in host else host
        # A zmq DEALER reconnects by itself; a peer that restarted on the same port
        # must not see this session's messages. Watch for the connection dropping.
        self.monitor = monitor_socket(ctrl, engine._ctx, zmq.EVENT_DISCONNECTED)
        ctrl.connect(f"tcp://{self.host}:{port}")
        # the data socket connects once WELCOME named the data port and the token (open)
        self.ctrl = LoopSocket(ctrl, self._on_ctrl, self._on_socket_error)
        self.data = LoopSocket(data, None, self._on_socket_error)
        self.source = TcpSource(self.data)
        self.nccl: NcclSource | None = None
        self.nccl_setup: asyncio.Future[None] | None = None
        self.nccl_ready: asyncio.Future[NcclReady] | None = None
        self.welcome: asyncio.Future[Welcome] = engine._loop.create_future()
        self.welcome.add_done_callback(_retrieve)
        self.xfers: dict[int, _OutXfer] = {}
        self.gets: dict[int, asyncio.Future[GetReply]] = {}
        self.post_queue: asyncio.Queue[_OutXfer] = asyncio.Queue()
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
        self.tasks: list[asyncio.Task[None]] = []
        self.credit = CreditAccount()  # protocol v2, once the peer announced its window
        self.credit_wait: deque[_OutXfer] = deque()  # PUTs waiting for credit, in order
        self.gave_up: set[int] = set()  # posted PUTs whose caller timed out: a late ACK is fine
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
        cc = self.engine.config.curve
        if cc is not None:
            key = cc.server_keys.get(self.address, cc.default_server_key)
            return "curve:" + key.decode() if key else None
        w = self.welcome.result() if self.welcome.done() and not self.welcome.exception() else None
        return w.engine_id if w else None

    async def open(self, timeout: float) -> None:
        e = self.engine
        self.tasks.append(
            asyncio.create_task(self._poster(), name=f"aiokv-client-poster-{self.address}")
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
        except asyncio.CancelledError:
            # Closing the sockets of a session that failed meanwhile cancels their
            # pending sends: report why the session failed, not a cancellation.
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
        if self.engine.config.curve is None:
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
    ) -> _OutXfer:
        """Start a transfer. ``lean``: the caller awaits ``done`` itself (no ``released``
        future, no retrieval callback) and wants an immediate PUT sent at once rather
        than with the rest of this loop pass's. ``watched``: an ``_XferWatch`` will
        read ``done``'s outcome (no retrieval callback needed)."""
        if self.dead is not None:
            raise PeerLostError(f"session with {self.address} is gone: {self.dead}")
        loop = self.engine._loop
        nbytes = specs[0].nbytes if len(specs) == 1 else sum(s.nbytes for s in specs)
        k = len(specs)
        if transport == "tcp" and not self.credit_wait:
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
                    self.engine._granted_now,
                    loop.create_future(),
                    put=True,
                    nbytes=nbytes,
                )
                self.last_used = time.monotonic()
                if not lean:
                    x.released = loop.create_future()
                    if not watched:
                        x.done.add_done_callback(_retrieve)
                if _trace.enabled:
                    _trace.mark("start", self.engine.engine_id, x.xfer)
                self.xfers[x.xfer] = x
                self._post_put(x, flush=lean)
                return x
        x = _OutXfer(
            self.sess.new_xfer_id(), specs, tensors, loop.create_future(), loop.create_future()
        )
        x.transport = transport
        x.ready = ready
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
                _trace.mark("start", self.engine.engine_id, x.xfer)
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

    async def ensure_nccl(self, timeout: float) -> None:
        """Create this session's communicator (rank 0 here, rank 1 at the peer) once."""
        if self.nccl is not None:
            return
        if self.nccl_setup is None:
            self.nccl_setup = asyncio.get_running_loop().create_future()
            self.nccl_setup.add_done_callback(_retrieve)
            self.engine._spawn(self._setup_nccl(self.nccl_setup, timeout))
        try:
            await _await_shielded(self.nccl_setup, timeout)
        except TimeoutError:
            raise ConnectTimeoutError(f"NCCL set-up with {self.address} timed out") from None

    async def _setup_nccl(self, fut: asyncio.Future[None], timeout: float) -> None:
        from .nccl.comm import Communicator, get_unique_id
        from .transport.nccl import NcclSource

        e = self.engine
        try:
            uid = get_unique_id()
            self.nccl_ready = asyncio.get_running_loop().create_future()
            self.nccl_ready.add_done_callback(_retrieve)
            self._send_ctrl(self.sess.send(NcclSetup(1, uid)))
            device = torch.device(e.config.device)
            blocking = e.config.nccl_blocking_ops
            comm = await Communicator.create(
                uid,
                0,
                2,
                device,
                timeout=timeout,
                max_ctas=e.config.nccl_max_channels,
                blocking_ops=blocking,
            )
            if blocking:
                await comm.warmup(timeout)
            try:
                ready = await _await_shielded(self.nccl_ready, timeout)
            except BaseException:
                comm.abort()
                raise
            if not ready.ok:
                comm.abort()
                raise ConnectError(f"{self.address} could not set up NCCL: {ready.detail}")
            if self.dead is not None:
                comm.abort()
                raise PeerLostError(f"session with {self.address} is gone")
            self.nccl = NcclSource(comm, e._get_poller(), device)
            fut.set_result(None)
        except BaseException as exc:
            self.nccl_setup = None
            if not fut.done():
                fut.set_exception(
                    exc
                    if isinstance(exc, AiokvError)
                    else ConnectError(f"NCCL set-up failed: {exc}")
                )
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _reserve(self, x: _OutXfer) -> None:
        x.posted = True
        if x.transport == "tcp" and self.credit.credit_bytes:
            # give unspent credit back first (after our PUTs, on their connection), so
            # that the whole budget can serve a transfer larger than the window
            b, t = self.credit.take_all()
            self.data_out.put([self.engine._codec.encode(Return(x.xfer, b, t))])
        self._send_ctrl(self.sess.send(Reserve(x.xfer, x.transport, tuple(x.specs))))
        if _trace.enabled:
            _trace.mark("start", self.engine.engine_id, x.xfer)
        if x.transport == "nccl":
            self.engine._get_poller().touch()  # the GRANT is read on a spinning loop

    def _post_put(self, x: _OutXfer, flush: bool = False) -> None:
        header = self.engine._codec.encode_put(x.xfer, x.specs)
        if len(x.tensors) == 1 and x.nbytes <= DATA_FRAME_BYTES:
            frames = [header, tensor_buffer(x.tensors[0])]
        elif x.nbytes <= DATA_FRAME_BYTES:
            frames = [header, *(tensor_buffer(t) for t in x.tensors)]
        else:
            frames = [header]
            for t in x.tensors:
                frames.extend(tensor_frames(t))
        self.data_out.put(frames, nbytes=x.nbytes, now=flush)
        x.posted = True
        if not x.granted.done():
            x.granted.set_result(0)
        if _trace.enabled:
            _trace.mark("posted", self.engine.engine_id, x.xfer)

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
                return
            w.popleft()
            self._post_put(x)

    def _settle_put(self, xfer: int, exc: BaseException | None) -> bool:
        """An ACK settled a PUT; False if it names none of ours (a protocol error)."""
        x = self.xfers.get(xfer)
        if x is None and xfer in self.gave_up:
            self.gave_up.discard(xfer)
            return True
        if x is None or not x.put or not x.posted:
            return False
        del self.xfers[xfer]
        if exc is not None:
            self.engine._stats.refused_received += 1
        self._end(x, exc)
        return True

    def _end(self, x: _OutXfer, exc: BaseException | None) -> None:
        """A transfer is over: landed (``exc`` None, counted as sent) or failed with ``exc``."""
        e = self.engine
        if exc is None:
            if _trace.enabled:
                _trace.mark("done", e.engine_id, x.xfer)
            e._stats.transfers_sent += 1
            e._stats.tensors_sent += len(x.specs)
            e._stats.bytes_sent += x.nbytes
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
                self.engine._count_error("bad_ack")
                self.fail(RemoteProtocolError(f"ACK for transfer {xfer}, not a PUT in flight"))
                return
        for xfer, code in msg.refused:
            cls = _REFUSALS.get(code, RefusedError)
            why = cls(f"{self.address} refused the transfer: {code}", code=code)
            if not self._settle_put(xfer, why):
                self.engine._count_error("bad_ack")
                self.fail(RemoteProtocolError(f"ACK refuses transfer {xfer}, not a PUT in flight"))
                return
        self._drain_credit_wait()

    def abandon(self, x: _OutXfer) -> None:
        """The caller gave up. Withdraw if not granted; a granted transfer still completes."""
        if not x.posted:  # still waiting in this end's queue: nothing left the process
            x.abandoned = True
            self.xfers.pop(x.xfer, None)
            x.release_when_idle()
            self.engine._stats.withdrawn += 1
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
        if self.dead is None and self.sess.xfer_state(x.xfer) is XferState.RESERVED:
            self._send_ctrl(self.sess.send(Withdraw(x.xfer)))

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
        e = self.engine
        self.last_recv = time.monotonic()
        for frame in frames:
            try:
                msg = self.sess.receive(frame.buffer)
            except RemoteProtocolError as exc:
                e._count_error(getattr(exc, "code", "protocol"))
                with contextlib.suppress(Exception):
                    self.ctrl.send([e._codec.encode(ErrorMsg("protocol", str(exc)[:200]))])
                self.fail(exc)
                return
            self._dispatch(msg)
            if self.dead is not None:
                return

    def _dispatch(self, msg: Message) -> None:
        if type(msg) is Ack:  # the one message of the hot path: first
            self._on_ack(msg)
            return
        e = self.engine
        if isinstance(msg, Welcome):
            if not self.welcome.done():
                self.welcome.set_result(msg)
        elif isinstance(msg, Grant):
            x = self.xfers[msg.xfer]
            x.seq = msg.seq
            if _trace.enabled:
                _trace.mark("grant", e.engine_id, x.xfer)
            if not x.granted.done():
                x.granted.set_result(msg.seq)
            if x.transport == "tcp":
                # zmq queues sends in call order: post at once, in grant order
                header = DataHeader(x.xfer, x.seq, len(x.specs))
                try:
                    self.source.post_nowait(self.sess.send(header), x.tensors)
                except (zmq.ZMQError, AiokvError) as perr:
                    self.fail(PeerLostError(f"data channel to {self.address} failed: {perr}"))
                    return
                if _trace.enabled:
                    _trace.mark("posted", e.engine_id, x.xfer)
            else:
                self.post_queue.put_nowait(x)
        elif isinstance(msg, Refuse):
            e._stats.refused_received += 1
            cls = _REFUSALS.get(msg.code, RefusedError)
            self._end(
                self.xfers.pop(msg.xfer),
                cls(
                    f"{self.address} refused the transfer: {msg.code}: {msg.detail}", code=msg.code
                ),
            )
        elif isinstance(msg, Withdrawn):
            e._stats.withdrawn += 1
            self._end(self.xfers.pop(msg.xfer), TransferError("withdrawn"))
        elif isinstance(msg, Done):
            self._end(self.xfers.pop(msg.xfer), None)
        elif isinstance(msg, Failed):
            self._end(
                self.xfers.pop(msg.xfer),
                TransferAbortedError(
                    f"{self.address} failed the transfer: {msg.code}: {msg.detail}"
                ),
            )
        elif isinstance(msg, GetReply):
            g = self.gets.pop(msg.req, None)
            if g is not None and not g.done():
                g.set_result(msg)
        elif isinstance(msg, Pong):
            pass
        elif isinstance(msg, ErrorMsg):
            e._count_error("peer_error")
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
        elif isinstance(msg, Bye):
            self.fail(PeerLostError(f"{self.address} closed the session"))
        elif isinstance(msg, NcclReady):
            if self.nccl_ready is not None and not self.nccl_ready.done():
                self.nccl_ready.set_result(msg)

    async def _poster(self) -> None:
        """Posts granted NCCL transfers (TCP ones leave straight from the GRANT).

        Everything granted meanwhile goes out as one NCCL group, in grant order.
        """
        try:
            while True:
                batch = [await self.post_queue.get()]
                while not self.post_queue.empty() and len(batch) < 64:
                    batch.append(self.post_queue.get_nowait())
                for b in batch:
                    self.sess.note_sent(DataHeader(b.xfer, b.seq, len(b.specs)))
                assert self.nccl is not None
                sent = await self.nccl.post_many([(b.tensors, b.ready) for b in batch])
                sent.add_done_callback(_retrieve)
                for b in batch:
                    b.sent = sent
                    if _trace.enabled:
                        _trace.mark("posted", self.engine.engine_id, b.xfer)
                batch = []  # while waiting for the next grant this frame holds no tensors
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, AiokvError) as exc:
            self.fail(channel_error(exc, f"data channel to {self.address}"))

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
        e = self.engine
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
        if self.nccl is not None:
            self.nccl.abort(exc)
        if self.nccl_ready is not None and not self.nccl_ready.done():
            self.nccl_ready.set_exception(exc)
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        if e._clients.get(self.address) is self:
            del e._clients[self.address]
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
                if event["event"] == zmq.EVENT_DISCONNECTED:
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


# --------------------------------------------------------------------------- server side


@dataclass(slots=True, eq=False)
class _InXfer:
    xfer: int
    specs: tuple[TensorSpec, ...]
    nbytes: int
    discard: bool = False
    seq: int = -1
    transport: str = "tcp"
    expires: float = 0.0  # the data must have landed by then (TCP)


class _ServerSession:
    """The listening end of a peer's client session: this engine receives."""

    def __init__(self, engine: Engine, rid: bytes, user: str | None) -> None:
        self.engine = engine
        self.rid = rid
        self.user = user  # CURVE public key of the peer, when CURVE is on
        self.trace_id = ""  # the engine id the peer announced (aiokv._trace joins on it)
        self.sess = Session(Role.SERVER, engine._codec)
        self.peer: PeerRef | None = None
        self.token = secrets.token_bytes(16)
        self.data_rid: bytes | None = None
        self.data_authed = False  # a data connection passed ZAP with this session's token
        self.sink = TcpSink()
        self.nccl: NcclSink | None = None
        self.granted: dict[int, _InXfer] = {}
        # reservations waiting for room, oldest first
        # RESERVEs waiting for room, in the engine's AdmissionQueue
        self.queued: PeerQueue[Reserve] = PeerQueue(owner=self)
        self.expired: set[int] = set()  # grants this end gave up on (late data is dropped)
        self.last_recv = time.monotonic()
        self.dead = False
        self.outbox = Outbox(
            engine._router,
            lambda exc: engine._drop_server(
                self, channel_error(exc, f"reply channel to {self.name}"), lost=True
            ),
            prefix=rid,
            max_frames=MAX_FRAMES_PER_MESSAGE,
        )
        self.suspect = False
        self.fds: list[int] = []  # the connections' descriptors (router monitor events)
        self.gets = 0  # GETs of this peer being served
        self.granted_tensors = 0  # tensors of the granted transfers
        # protocol v2 (the peer offered "credit"): its standing window and what it holds
        self.ledger: CreditLedger | None = None
        self.last_put = 0
        self.credit_held: OrderedDict[str, tuple[int, float]] = OrderedDict()  # tid -> (n, at)
        self.acks: list[int] = []
        self.refused: list[tuple[int, str]] = []
        self.ack_due = False

    @property
    def name(self) -> str:
        return self.peer.address if self.peer else "?"


# --------------------------------------------------------------------------- handle


class _XferWatch:
    """What a PUT_ASYNC handle needs besides the transfer's ``done`` future, which the
    handle hands out as its own: the deadline (one timer), the caller giving up, and
    counting a failure once, whichever way the transfer ended."""

    __slots__ = ("cs", "engine", "gave_up", "t_end", "timer", "to", "x")

    def __init__(self, engine: Engine, cs: _ClientSession, x: _OutXfer, t: float, to: str) -> None:
        loop = engine._loop
        self.engine, self.cs, self.x, self.to = engine, cs, x, to
        self.t_end = loop.time() + t
        self.gave_up = False
        self.timer = loop.call_later(min(t, engine.config.timeouts.negotiate), self.expire)
        x.done.add_done_callback(self.settled)

    def settled(self, f: asyncio.Future[None]) -> None:
        self.timer.cancel()
        if f.cancelled():  # TransferHandle.cancel(), or the awaiting task was cancelled
            self.on_cancel()
        elif f.exception() is not None:  # (reading it also marks it retrieved)
            self.engine._stats.transfers_failed += 1

    def expire(self) -> None:
        x, done = self.x, self.x.done
        if done.done():
            return
        g = x.granted
        if not (g.done() and not g.cancelled() and g.exception() is None):
            exc: BaseException = NegotiateTimeoutError(
                f"{self.to} granted no room within the deadline"
            )
        elif self.engine._loop.time() < self.t_end:  # granted in time: the rest of it
            self.timer = self.engine._loop.call_at(self.t_end, self.expire)
            return
        else:
            exc = TransferTimeoutError(
                f"transfer to {self.to} did not complete within the deadline"
            )
        self.gave_up = True
        done.set_exception(exc)  # first: withdrawing must not turn it into a cancel
        self.cs.abandon(x)

    def on_cancel(self) -> None:
        """The caller gave up (at once: nothing waits a loop pass)."""
        if self.gave_up:
            return
        self.gave_up = True
        self.timer.cancel()
        done = self.x.done
        if not done.done() or done.cancelled():
            self.engine._stats.transfers_failed += 1
            self.cs.abandon(self.x)


class TransferHandle:
    """An in-flight PUT_ASYNC: await it, or poll :meth:`done`; :meth:`cancel` gives up.

    Awaiting the handle tells the outcome. A transfer the receiver had granted
    cannot be recalled, so after a timeout or :meth:`cancel` the engine may still
    be reading the tensor: await :meth:`released` before reusing its memory.
    """

    __slots__ = ("_on_cancel", "_released", "_task")

    def __init__(
        self,
        task: asyncio.Future[None],
        released: asyncio.Future[None],
        on_cancel: Callable[[], None] | None = None,
        *,
        retrieve: bool = True,
    ) -> None:
        self._task = task
        self._released = released
        self._on_cancel = on_cancel
        if retrieve:  # (False: the caller reads the outcome itself)
            task.add_done_callback(_retrieve)

    async def released(self) -> None:
        """Wait until no part of aiokv reads the sent tensor any more (never raises)."""
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait({self._task})
        await asyncio.shield(self._released)

    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> bool:
        ok = self._task.cancel()
        if ok and self._on_cancel is not None:
            self._on_cancel()
        return ok

    def exception(self) -> BaseException | None:
        return self._task.exception()

    def __await__(self) -> Generator[Any, None, None]:
        return self._task.__await__()


# --------------------------------------------------------------------------- engine


class _KeyCheck:
    """ZAP credentials provider: which CURVE client keys may connect."""

    def __init__(self, allowed: frozenset[bytes] | None) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return self.allowed is None or key in self.allowed


class Engine:
    """Moves tensors between processes. Use as ``async with Engine(config) as eng``."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.engine_id = secrets.token_hex(12)
        lim = config.limits
        self._max_id = lim.max_id_length  # (the hot path's check, one attribute away)
        self._codec = Codec(
            WireLimits(
                max_frame_bytes=lim.max_frame_bytes,
                max_tensors=lim.max_tensors_per_transfer,
                max_ndim=lim.max_ndim,
                max_tensor_bytes=lim.max_tensor_bytes,
                max_id_length=lim.max_id_length,
            )
        )
        self._store = ReceiveStore(
            capacity=lim.store_bytes,
            ttl=lim.ttl,
            resolve_peer=self._resolve_peer,
            max_tensors=lim.store_tensors,
        )
        self._ctx: zmq.asyncio.Context = None  # type: ignore[assignment]
        self._sctx: zmq.Context[Any] = None  # type: ignore[assignment]
        self._router: LoopSocket = None  # type: ignore[assignment]
        # data connections: a port of their own, entered only after authentication
        self._data_router: LoopSocket = None  # type: ignore[assignment]
        self._data_mon: zmq.asyncio.Socket = None  # type: ignore[assignment]
        self._data_port = 0
        self._zap: LoopSocket | None = None  # the data port's ZAP handler (no CURVE)
        self._address = ""
        self._clients: dict[str, _ClientSession] = {}
        self._connecting: dict[str, asyncio.Future[_ClientSession]] = {}
        self._servers: dict[bytes, _ServerSession] = {}
        self._data_rids: dict[bytes, _ServerSession] = {}
        self._tokens: dict[bytes, _ServerSession] = {}
        self._fd_sessions: dict[int, _ServerSession] = {}
        self._claims = itertools.count(1)
        self._by_peer: dict[str, _ServerSession] = {}  # live sessions by store identity
        self._starved: set[_ServerSession] = set()  # credit cut short by the budget
        self._gets_serving = 0
        # accepted connections without a session yet: fd -> (accepted at, peer name)
        self._unbound: dict[int, tuple[float, str | None]] = {}
        self._router_mon: zmq.asyncio.Socket = None  # type: ignore[assignment]
        # reservations waiting for room, every session's (see aiokv.protocol.admission)
        self._admission: AdmissionQueue[Reserve] = AdmissionQueue()
        self._ack_now: list[_ServerSession] = []  # sessions whose data awaits an ACK
        lim = self.config.limits
        self._bounds = PeerBounds(
            budget_bytes=lim.store_bytes,
            max_queued=lim.max_pending_reserves,
            max_granted=_MAX_GRANTED_PER_SESSION,
            # one session's share of the store's tensor count (empty tensors cost no bytes)
            max_tensors_in_flight=max(lim.store_tensors // 4, lim.max_tensors_per_transfer),
        )
        self._published: dict[str, torch.Tensor] = {}
        self._stats = EngineStatistics()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._main_tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop  # bound by start()
        self._nccl_ok = False
        self._nccl_why = "not started"
        self._poller: ProgressPoller | None = None
        self._watchdog: LoopWatchdog | None = None
        self._auth: Any = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._closed:
            raise EngineClosedError("engine closed: an Engine cannot be started again")
        if self._started:
            return
        # the loop, once: asyncio.get_running_loop() makes a getpid() system call per
        # call on Python < 3.12, several times per transfer on the hot path
        self._loop = asyncio.get_running_loop()
        self._store.loop = self._loop
        self._granted_now: asyncio.Future[int] = self._loop.create_future()
        self._granted_now.set_result(0)
        dev = self.config.device
        if dev.startswith("cuda"):
            idx = torch.device(dev).index or 0
            if not torch.cuda.is_available() or idx >= torch.cuda.device_count():
                raise ConfigError(
                    f"device={dev!r} but this process has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} "
                    "usable CUDA device(s)"
                )
        self._started = True
        if self.config.gc_freeze:
            gc.freeze()
        if self.config.transport != "tcp":
            from .transport.nccl import nccl_available

            self._nccl_ok, self._nccl_why = nccl_available(self.config.device)
            if self.config.transport == "nccl" and not self._nccl_ok:
                self._started = False
                raise ConfigError(f"transport='nccl' but NCCL cannot be used: {self._nccl_why}")
            if self._nccl_ok:
                from .cuda import preload_copy_kernels
                from .nccl.library import mapped_dtypes

                # before any communicator: a first launch later could wait on NCCL kernels
                preload_copy_kernels(torch.device(self.config.device), mapped_dtypes())
        self._ctx = zmq.asyncio.Context()
        # the hot sockets are plain ones on the same zmq context, run by LoopSocket
        self._sctx = zmq.Context.shadow(self._ctx.underlying)
        lim = self.config.limits
        # The control port carries control messages only: zmq drops (and hangs up) a
        # connection whose frame exceeds one, before reading it. Data arrives on a port
        # of its own that authenticates first, in frames of at most DATA_FRAME_BYTES
        # (1 MiB; a tensor travels as several): zmq applies MAXMSGSIZE to the handshake
        # too, so this bounds what a stranger can make it buffer on either port.
        r = self._router_socket(lim.max_frame_bytes)
        d = self._router_socket(max(lim.max_frame_bytes, DATA_FRAME_BYTES))
        if self.config.curve is not None:
            self._apply_curve_server(r)
            self._apply_curve_server(d)
        else:
            # PLAIN with the session token as password, checked by our own ZAP handler
            # (bound before any connection can start a handshake)
            zap = self._sctx.socket(zmq.ROUTER)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(_ZAP_ENDPOINT)
            self._zap = LoopSocket(zap, self._on_zap)
            d.setsockopt(zmq.PLAIN_SERVER, 1)
            d.setsockopt(zmq.ZAP_DOMAIN, _DATA_DOMAIN)
        host, port = parse_address(self.config.listen)
        try:
            r.bind(f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}")
            dp = self.config.data_port
            d.bind(f"tcp://{host}:{dp}" if ":" not in host else f"tcp://[{host}]:{dp}")
        except zmq.ZMQError as exc:
            r.close(0)
            d.close(0)
            if self._zap is not None:
                self._zap.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise listen_error(exc, self.config.listen) from None
        ep = bytes(r.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self._address = f"{host}:{ep.rsplit(':', 1)[1]}"
        self._data_port = int(bytes(d.getsockopt(zmq.LAST_ENDPOINT)).decode().rsplit(":", 1)[1])
        self._stats.address = self._address
        # Connection events, so a peer whose process died is dropped at once rather
        # than after its heartbeat timeout.
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        self._router_mon = monitor_socket(r, self._ctx, events)
        self._data_mon = monitor_socket(d, self._ctx, events)
        self._router = LoopSocket(r, self._on_router_frames, self._on_router_error)
        self._data_router = LoopSocket(
            d, self._on_data_frames, self._on_router_error, on_drained=self._acks_now
        )
        self._main_tasks = [
            asyncio.create_task(self._housekeeping(), name="aiokv-housekeeping"),
            asyncio.create_task(self._router_watch(self._router_mon), name="aiokv-router-monitor"),
            asyncio.create_task(self._router_watch(self._data_mon), name="aiokv-data-monitor"),
        ]

    def _router_socket(self, max_frame: int) -> zmq.Socket[Any]:
        """A listening ROUTER whose connections may send frames of up to ``max_frame`` bytes."""
        r: zmq.Socket[Any] = self._sctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, int(self.config.timeouts.linger * 1000))
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # per connection: a peer flooding messages waits in TCP, not in this process
        r.setsockopt(zmq.RCVHWM, 10_000)
        r.setsockopt(zmq.SNDHWM, 100_000)
        r.setsockopt(zmq.MAXMSGSIZE, max_frame)
        return r

    @property
    def address(self) -> str:
        """``host:port`` this engine listens on (valid after start)."""
        return self._address

    async def aclose(self) -> None:
        """Close every session, fail every pending operation, release sockets (bounded time)."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        exc = EngineClosedError("engine closed")
        for cs in list(self._clients.values()):
            await cs.bye()
        for f in self._connecting.values():
            if not f.done():
                f.set_exception(exc)
        for ss in list(self._servers.values()):
            if ss.sess.state is SessionState.OPEN:
                with contextlib.suppress(Exception):
                    self._reply(ss, ss.sess.send(Bye()))
            self._drop_server(ss, exc, lost=False)
        self._store.fail_all(exc)
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._poller is not None:
            await self._poller.stop()
        for t in self._main_tasks:
            t.cancel()
        pending = [*self._main_tasks, *self._tasks]
        if pending:
            await asyncio.wait(pending, timeout=self.config.timeouts.linger + 1.0)
        for rs, mon in ((self._router, self._router_mon), (self._data_router, self._data_mon)):
            with contextlib.suppress(zmq.ZMQError):
                rs.sock.disable_monitor()
            mon.close(linger=0)
            rs.close(linger=min(200, int(self.config.timeouts.linger * 1000)))
        if self._zap is not None:
            self._zap.close(0)
        if self._auth is not None:
            self._auth.stop()
        ctx = self._ctx
        # term() waits for lingering sockets (forever if one never flushes): never on
        # the loop, and on a daemon thread of its own (aiokv._blocking says why)
        await asyncio.wait_for(
            _blocking.in_daemon(ctx.term, "aiokv-zmq-term"),
            timeout=self.config.timeouts.linger + 1.0,
        )

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        t: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        t.add_done_callback(_retrieve)
        return t

    def _check_id(self, tensor_id: str) -> None:
        """A tensor id the peer would accept: checked here, never sent to be refused."""
        n = self.config.limits.max_id_length
        if not isinstance(tensor_id, str) or not tensor_id or len(tensor_id) > n:
            raise ConfigError(f"tensor ids are non-empty strings of at most {n} characters")

    def _timeout(self, timeout: float | None) -> float:
        """The caller's timeout (None: the configured transfer deadline), checked."""
        if timeout is None:
            return self.config.timeouts.transfer
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < float("inf")
        ):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    def _check_open(self) -> None:
        if not self._started:
            raise EngineClosedError(
                "engine not started: use 'async with Engine(...)' or await start()"
            )
        if self._closed:
            raise EngineClosedError("engine closed")

    def _capabilities(self) -> tuple[str, ...]:
        return ("tcp", "nccl", "credit") if self._nccl_ok else ("tcp", "credit")

    def _get_poller(self) -> ProgressPoller:
        if self._poller is None:
            from .cuda import ProgressPoller

            # Spin (yielding) for 20 ms after any activity: a sleeping poller on a
            # millisecond-granular loop adds ~1-2 ms to every completion (benchmarks.md).
            self._poller = ProgressPoller(spin_s=0.02)
            from ._watchdog import LoopWatchdog

            poller = self._poller
            self._watchdog = LoopWatchdog(
                asyncio.get_running_loop(),
                limit=self.config.timeouts.nccl_watchdog,
                pending=lambda: poller.pending,
                report=_watchdog_report,
            )
        return self._poller

    # ------------------------------------------------------------------ CURVE hooks
    def _apply_curve_server(self, sock: zmq.Socket[Any]) -> None:
        cc = self.config.curve
        if cc is None:
            return
        if self._auth is None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            auth = AsyncioAuthenticator(self._ctx)
            auth.start()
            auth.configure_curve_callback(
                "aiokv", credentials_provider=_KeyCheck(cc.allowed_clients)
            )
            self._auth = auth
        sock.setsockopt(zmq.ZAP_DOMAIN, b"aiokv")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, cc.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, cc.public_key)

    def _apply_curve_client(self, sock: zmq.Socket[Any], address: str) -> None:
        cc = self.config.curve
        if cc is None:
            return
        server_key = cc.server_keys.get(address, cc.default_server_key)
        if server_key is None:
            raise ConfigError(f"CURVE is on but no server key is configured for {address}")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, cc.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, cc.secret_key)

    # ------------------------------------------------------------------ public API
    async def connect(
        self, peer: str, *, timeout: float | None = None, nccl: bool | None = None
    ) -> None:
        """Open the session to ``peer`` now rather than at the first send (no cold start).

        ``nccl``: also create the pair's NCCL communicator now (default: when this
        engine can use NCCL and the peer offers it), so the first CUDA transfer does
        not pay for communicator set-up.
        """
        self._check_open()
        dl = _Deadline(
            self._timeout(timeout) if timeout is not None else self.config.timeouts.connect
        )
        cs = await self._client(peer, dl)
        can = self._nccl_ok and self.config.transport != "tcp" and "nccl" in cs.peer_caps
        if nccl and not can:
            raise ConfigError(f"NCCL to {peer} is not available ({self._nccl_why})")
        if can and nccl is not False:
            await cs.ensure_nccl(dl.left(self.config.timeouts.connect))

    async def send(
        self, tensor_id: str, tensor: torch.Tensor, *, to: str, timeout: float | None = None
    ) -> None:
        """PUT: return once the peer's engine holds ``tensor`` under ``tensor_id``."""
        t = self._timeout(timeout)
        staged = self._stage_one(tensor_id, tensor)
        cs = self._hot_session(to, staged)
        if cs is not None:
            await self._await_xfer(cs, cs.start(staged.specs, staged.tensors, lean=True), t, to)
            return
        await self._transfer(to, staged, timeout)

    async def _await_xfer(self, cs: _ClientSession, x: _OutXfer, t: float, to: str) -> None:
        """``send``'s wait on a started transfer: its own ``done`` future, watched as a
        PUT_ASYNC handle's is (deadline, cancel, failure count), with no handle around it."""
        _XferWatch(self, cs, x, t, to)  # registered before this task's wake-up: runs first
        await x.done

    def send_nowait(
        self, tensor_id: str, tensor: torch.Tensor, *, to: str, timeout: float | None = None
    ) -> TransferHandle:
        """PUT_ASYNC: start the transfer, return a handle to await (or cancel) later."""
        t = self._timeout(timeout)
        staged = self._stage_one(tensor_id, tensor)
        cs = self._hot_session(to, staged)
        if cs is not None:  # no task: a timer holds the deadline
            return self._handle(cs, cs.start(staged.specs, staged.tensors, watched=True), t, to)
        released: asyncio.Future[None] = self._loop.create_future()
        task = asyncio.create_task(self._transfer(to, staged, timeout, released))
        return TransferHandle(task, released)

    def _hot_session(self, to: str, staged: _Staged) -> _ClientSession | None:
        """The live session a transfer of CPU tensors can start on at once (the hot path:
        no connecting, no NCCL set-up, no copy to host), else None."""
        cs = self._clients.get(to)
        return cs if cs is not None and cs.dead is None and not staged.cuda else None

    def _handle(self, cs: _ClientSession, x: _OutXfer, t: float, to: str) -> TransferHandle:
        """A PUT_ASYNC handle on a started transfer: its own ``done`` future, a watch
        with one timer, no task."""
        w = _XferWatch(self, cs, x, t, to)
        assert x.released is not None
        return TransferHandle(x.done, x.released, w.on_cancel, retrieve=False)

    async def send_many(
        self, tensors: Mapping[str, torch.Tensor], *, to: str, timeout: float | None = None
    ) -> None:
        """PUT many tensors under one negotiation; return once the peer holds all."""
        await self._transfer(to, self._stage(list(tensors.items())), timeout)

    async def recv(
        self, tensor_id: str, *, frm: str | None = None, timeout: float | None = None
    ) -> torch.Tensor:
        """Collect a tensor from the receive store, waiting for it up to ``timeout``."""
        self._check_id(tensor_id)
        return await self._recv(tensor_id, frm, self._timeout(timeout))

    async def _recv(self, tensor_id: str, frm: str | None, t: float) -> torch.Tensor:
        self._check_open()
        got = self._store.take(tensor_id, frm)
        if got is not None:  # landed already (a collector behind its stream): no future
            self._collected(got[0], tensor_id)
            self._pump_queue()
            return got[1]  # type: ignore[no-any-return]
        fut = self._store.wait_future(tensor_id, frm, looked=True)
        try:
            # Not ``wait_for(shield(fut))``: on Python <= 3.11 it returns the result
            # when the cancel and the landing meet in one loop pass, swallowing the
            # cancellation (and a cancelled KV request would then scatter its data).
            await _await_shielded(fut, t)
        except TimeoutError:
            raise TransferTimeoutError(
                f"tensor {tensor_id!r} did not arrive within {t:.3g}s"
            ) from None
        except asyncio.CancelledError:
            # Never lose a tensor to a cancelled collector: if it was handed over, put it back.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                peer, value = fut.result()
                self._store.put_back(tensor_id, peer, value, value.numel() * value.element_size())
            raise
        finally:
            if not fut.done():
                fut.cancel()
            self._store.forget_waiter(tensor_id, fut)
        peer, result = fut.result()
        self._collected(peer, tensor_id)
        self._pump_queue()
        return result  # type: ignore[no-any-return]

    async def recv_many(
        self, tensor_ids: Sequence[str], *, frm: str | None = None, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Collect several tensors under one deadline."""
        self._check_open()
        for tid in tensor_ids:
            self._check_id(tid)
        dl = _Deadline(self._timeout(timeout))
        out: dict[str, torch.Tensor] = {}
        for tid in tensor_ids:
            out[tid] = await self._recv(tid, frm, dl.left())
        return out

    def discard(self, tensor_id_or_prefix: str) -> int:
        """Drop received tensors nobody will collect (an id, or every id starting with a
        prefix that ends in ``"#"``); in-flight ones go when they land. Returns the count."""
        self._check_open()
        n = self._store.discard(tensor_id_or_prefix)
        self._pump_queue()  # the freed room may admit queued reservations
        return n

    def publish(self, tensor_id: str, tensor: torch.Tensor) -> None:
        """GET mode, producer side: make ``tensor`` available to peers' :meth:`get`."""
        self._check_open()
        _prepare([(tensor_id, tensor)], self.config.limits.max_id_length)
        if (
            tensor_id not in self._published
            and len(self._published) >= self.config.limits.max_published
        ):
            raise ConfigError(f"more than {self.config.limits.max_published} published tensors")
        self._published[tensor_id] = tensor

    def unpublish(self, tensor_id: str) -> bool:
        return self._published.pop(tensor_id, None) is not None

    async def get(self, tensor_id: str, *, frm: str, timeout: float | None = None) -> torch.Tensor:
        """GET mode, consumer side: ask ``frm`` for a published tensor and wait for it."""
        self._check_open()
        self._check_id(tensor_id)
        dl = _Deadline(self._timeout(timeout))
        cs = await self._client(frm, dl)
        req = next(cs.get_ids)
        reply: asyncio.Future[GetReply] = asyncio.get_running_loop().create_future()
        reply.add_done_callback(_retrieve)
        cs.gets[req] = reply
        cs._send_ctrl(cs.sess.send(Get(req, (tensor_id,), self._address)))
        peer_id = cs.peer_id
        try:
            r = await _await_shielded(reply, dl.left())
        except TimeoutError:
            cs.gets.pop(req, None)
            raise TransferTimeoutError(f"GET {tensor_id!r} from {frm}: no reply in time") from None
        if r.code == "not_published":
            raise NotPublishedError(f"{frm} does not publish {tensor_id!r}")
        if r.code != "ok":
            raise TransferAbortedError(f"GET {tensor_id!r} from {frm} failed: {r.code}: {r.detail}")
        return await self._recv(tensor_id, peer_id or frm, dl.left())

    def statistics(self) -> EngineStatistics:
        s = dataclasses.replace(self._stats, protocol_errors=dict(self._stats.protocol_errors))
        s.store = self._store.statistics()
        ledgers = [ss.ledger for ss in self._servers.values() if ss.ledger is not None]
        s.credit_bytes = sum(g.credit_bytes for g in ledgers)
        s.credit_tensors = sum(g.credit_tensors for g in ledgers)
        s.store.reserved_bytes -= s.credit_bytes
        s.credit_starved = len(self._starved)
        s.waiting_for_credit = sum(
            1 for cs in self._clients.values() for x in cs.credit_wait if not x.abandoned
        )
        s.client_sessions = len(self._clients)
        s.server_sessions = len(self._servers)
        s.queued_reservations = sum(len(ss.queued) for ss in self._servers.values())
        comms = [cs.nccl.comm for cs in self._clients.values() if cs.nccl is not None]
        comms += [ss.nccl.comm for ss in self._servers.values() if ss.nccl is not None]
        if comms or self._poller is not None:
            n: dict[str, float] = {
                "communicators": len(comms),
                "settles": sum(c.settles for c in comms),
                "settle_s": sum(c.settle_s for c in comms),
                "settle_max_s": max((c.settle_max_s for c in comms), default=0.0),
            }
            if self._poller is not None:
                for k, v in dataclasses.asdict(self._poller.statistics()).items():
                    if isinstance(v, int):
                        n[f"poller_{k}"] = v
            if self._watchdog is not None:
                n["watchdog_fired"] = self._watchdog.fired
            s.nccl = n
        return s

    # ------------------------------------------------------------------ sending
    async def _client(self, address: str, dl: _Deadline) -> _ClientSession:
        cs = self._clients.get(address)
        if cs is not None and cs.dead is None:
            return cs
        fut = self._connecting.get(address)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_retrieve)
            self._connecting[address] = fut
            self._spawn(self._open_client(address, fut, dl.left(self.config.timeouts.connect)))
        try:
            return await _await_shielded(fut, dl.left())  # type: ignore[no-any-return]
        except TimeoutError:
            raise ConnectTimeoutError(f"could not connect to {address} in time") from None

    async def _evict_lru(self) -> None:
        """Keep at most ``max_client_sessions``: close the least recently used idle ones."""
        limit = self.config.limits.max_client_sessions
        while len(self._clients) >= limit:
            idle = [c for c in self._clients.values() if not c.xfers and not c.gets]
            if not idle:
                return  # all busy: allow the overshoot rather than fail a live transfer
            lru = min(idle, key=lambda c: c.last_used)
            await lru.bye(ConnectError(f"session with {lru.address} closed to make room"))

    async def _open_client(
        self, address: str, fut: asyncio.Future[_ClientSession], timeout: float
    ) -> None:
        cs: _ClientSession | None = None
        try:
            parse_address(address)
            await self._evict_lru()
            cs = _ClientSession(self, address)
            await cs.open(timeout)
            self._clients[address] = cs
            self._stats.sessions_opened += 1
            if not fut.done():
                fut.set_result(cs)
        except BaseException as exc:
            if cs is not None:
                cs.fail(exc if isinstance(exc, AiokvError) else ConnectError(str(exc)))
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    fut.set_exception(EngineClosedError("engine closed while connecting"))
                else:
                    fut.set_exception(
                        exc if isinstance(exc, AiokvError) else ConnectError(f"{address}: {exc}")
                    )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._connecting.get(address) is fut:
                del self._connecting[address]

    def _stage_one(self, tensor_id: str, tensor: torch.Tensor) -> _Staged:
        """:meth:`_stage` of one tensor; the common case (a plain, dense, contiguous CPU
        tensor of a wire dtype) without the general path's list, set and checks."""
        if (
            type(tensor) is torch.Tensor
            and type(tensor_id) is str
            and 0 < len(tensor_id) <= self._max_id
            and tensor.is_cpu
            and not tensor.requires_grad
            and tensor.layout is _STRIDED
            and tensor.is_contiguous()
            and self._started
            and not self._closed
        ):
            name = dtype_name(tensor.dtype)
            if name is not None:
                return _Staged(
                    [TensorSpec(tensor_id, name, tuple(tensor.shape))], [tensor], None, False
                )
        return self._stage([(tensor_id, tensor)])

    def _stage(self, items: list[tuple[str, torch.Tensor]]) -> _Staged:
        """Check and prepare tensors at call time (captures the caller's CUDA stream)."""
        self._check_open()
        lim = self.config.limits
        specs, tensors = _prepare(items, lim.max_id_length, lim.max_tensors_per_transfer)
        if not any(t.is_cuda for t in tensors):
            return _Staged(specs, tensors, None, False)
        cuda = [t.is_cuda for t in tensors]
        ready = None
        if any(cuda):
            if not all(cuda):
                raise ConfigError("one transfer cannot mix CPU and CUDA tensors")
            from .transport.nccl import capture_ready

            devs = {t.device for t in tensors}
            if len(devs) != 1:
                raise ConfigError("all CUDA tensors of one transfer must be on one device")
            ready = capture_ready(tensors)
        return _Staged(specs, tensors, ready, any(cuda))

    async def _to_host(self, st: _Staged) -> list[torch.Tensor]:
        """TCP fallback for CUDA tensors: copy into pinned host memory without blocking the loop."""
        from .cuda import record_event

        dev = st.tensors[0].device
        stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        stream.wait_event(st.ready)
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in st.tensors]
        with torch.cuda.stream(stream):
            for h, t in zip(hosts, st.tensors):
                h.copy_(t, non_blocking=True)
        ev = record_event(stream)
        await self._get_poller().wait(ev, keepalive=(st.tensors, hosts))
        return hosts

    async def _transfer(
        self,
        to: str,
        st: _Staged,
        timeout: float | None,
        released: asyncio.Future[None] | None = None,
    ) -> None:
        linked: list[bool] = []
        try:
            await self._transfer_inner(to, st, timeout, released, linked)
        finally:
            if released is not None and not linked and not released.done():
                released.set_result(None)  # nothing was handed to the data plane

    async def _transfer_inner(
        self,
        to: str,
        st: _Staged,
        timeout: float | None,
        released: asyncio.Future[None] | None,
        linked: list[bool],
    ) -> None:
        self._check_open()
        T = self.config.timeouts
        dl = _Deadline(self._timeout(timeout))
        cs = await self._client(to, dl)
        transport = "tcp"
        tensors = st.tensors
        if st.cuda:
            use_nccl = self._nccl_ok and "nccl" in cs.peer_caps and self.config.transport != "tcp"
            if use_nccl:
                if st.tensors[0].device != torch.device(self.config.device):
                    raise ConfigError(
                        f"tensors are on {st.tensors[0].device}, the engine's NCCL device is {self.config.device}"
                    )
                await cs.ensure_nccl(dl.left(T.connect))
                transport = "nccl"
            elif self.config.transport == "nccl":
                raise ConfigError(f"transport='nccl' but {to} cannot receive over NCCL")
            else:
                tensors = await self._to_host(st)
        x = cs.start(st.specs, tensors, transport, st.ready)
        if released is not None and x.released is not None:
            linked.append(True)
            x.released.add_done_callback(lambda _f: _resolve(released))
        try:
            try:
                await _await_shielded(x.granted, dl.left(T.negotiate))
            except TimeoutError:
                raise NegotiateTimeoutError(f"{to} granted no room within the deadline") from None
            try:
                await _await_shielded(x.done, dl.left())
            except TimeoutError:
                raise TransferTimeoutError(
                    f"transfer to {to} did not complete within the deadline"
                ) from None
        except BaseException:
            cs.abandon(x)
            self._stats.transfers_failed += 1
            raise

    # ------------------------------------------------------------------ receiving
    def _resolve_peer(self, addr: str) -> str | None:
        cs = self._clients.get(addr)
        if cs is not None and cs.peer_id:
            return cs.peer_id
        for ss in self._servers.values():
            if ss.peer is not None and ss.peer.address == addr:
                return ss.peer.engine_id
        return None

    def _count_error(self, code: str) -> None:
        pe = self._stats.protocol_errors
        pe[code] = pe.get(code, 0) + 1

    def _reply(self, ss: _ServerSession, data: bytes, now: bool = False) -> None:
        """Queue a control message to ``ss``; one zmq message per session per loop pass
        (``now``: the caller flushes at once)."""
        ss.outbox.put([data], now=now)

    def _reply_raw(self, rid: bytes, msg: Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.send([rid, self._codec.encode(msg)])

    def _on_router_frames(self, parts: list[zmq.Frame]) -> None:
        try:
            self._on_router_message(parts)
        except Exception as exc:  # the loop must survive anything a peer sends
            self._count_error("internal")
            log.exception("aiokv: error handling a message: %s", exc)

    def _on_router_error(self, exc: zmq.ZMQError) -> None:
        if not self._closed:
            log.warning("aiokv: router socket error: %s", exc)

    def _on_router_message(self, parts: list[zmq.Frame]) -> None:
        rid = parts[0].bytes
        if len(parts) < 2:
            self._count_error("malformed")
            return
        ss = self._servers.get(rid)
        frames = parts[1:]
        if ss is None:
            # a new connection: its first message must be one HELLO frame
            if len(frames) != 1:
                self._refuse_connection(
                    rid, frames[0], "malformed", "the first message is one HELLO frame"
                )
                return
            if len(frames[0]) > _MAX_FIRST_FRAME:
                self._refuse_connection(
                    rid, frames[0], "frame_too_large", "a first message over the HELLO limit"
                )
                return
            self._on_new_connection(rid, frames[0])
            return
        if len(frames) > 4 * MAX_FRAMES_PER_MESSAGE:
            self._count_error("malformed")
            self._reply_raw(rid, ErrorMsg("protocol", "too many frames in one message"))
            self._drop_server(ss, RemoteProtocolError("too many frames"), lost=True)
            return
        ss.last_recv = time.monotonic()
        for frame in frames:  # a client sends several control messages as one zmq message
            try:
                msg = ss.sess.receive(frame.buffer)
            except RemoteProtocolError as exc:
                self._count_error(getattr(exc, "code", "protocol"))
                self._reply_raw(rid, ErrorMsg("protocol", str(exc)[:200]))
                self._drop_server(ss, exc, lost=True)
                return
            self._on_server_message(ss, msg)
            if ss.dead:
                return

    # ------------------------------------------------------------------ data port
    def _on_zap(self, parts: list[zmq.Frame]) -> None:
        """Answer one ZAP request (RFC 27) for this engine's sockets (no CURVE).

        A data connection is let in only with the token of a live session whose data
        connection is not open yet; until then zmq has read nothing but the
        handshake from it. Other sockets of this context use NULL and are let in
        (their peers must still say HELLO).
        """
        try:
            f = [p.bytes for p in parts]
            # [routing id, "", version, request id, domain, address, identity, mechanism, *creds]
            if len(f) < 8 or f[1] != b"" or f[2] != b"1.0":
                return  # not a ZAP request: nothing to answer
            code, user = b"400", b""
            if f[7] == b"NULL" and f[4] != _DATA_DOMAIN:
                code = b"200"
            elif f[4] == _DATA_DOMAIN and f[7] == b"PLAIN" and len(f) == 10:
                ss = self._zap_session(f[8], f[9])
                if ss is not None:
                    ss.data_authed = True
                    # the connection's User-Id: its DATA_HELLO must name this session
                    code, user = b"200", ss.token.hex().encode()
            # a refusal is not counted: a dropped session's data socket reconnects by itself
            self._zap_reply(f[0], f[3], code, user)
        except Exception as exc:  # the loop must survive anything
            self._count_error("internal")
            log.exception("aiokv: error answering a ZAP request: %s", exc)

    def _zap_session(self, user: bytes, password: bytes) -> _ServerSession | None:
        if user != _PLAIN_USER or len(password) != 2 * TOKEN_BYTES:
            return None
        try:
            token = bytes.fromhex(password.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        ss = self._tokens.get(token)
        if ss is None or ss.dead or ss.data_authed or ss.data_rid is not None:
            return None
        return ss

    def _zap_reply(self, rid: bytes, request_id: bytes, code: bytes, user: bytes) -> None:
        if self._zap is None:
            return
        text = b"OK" if code == b"200" else b"unknown or used data token"
        with contextlib.suppress(zmq.ZMQError):
            self._zap.send([rid, b"", b"1.0", request_id, code, text, user, b""])

    def _on_data_frames(self, parts: list[zmq.Frame]) -> None:
        try:
            self._on_data_message(parts)
        except Exception as exc:  # the loop must survive anything a peer sends
            self._count_error("internal")
            log.exception("aiokv: error handling a data message: %s", exc)

    def _on_data_message(self, parts: list[zmq.Frame]) -> None:
        """A message on the data port: its connection passed zmq's authentication."""
        rid = parts[0].bytes
        if len(parts) < 2:
            self._count_error("malformed")
            return
        ss = self._data_rids.get(rid)
        if ss is not None:
            self._on_data(ss, parts[1:])
            return
        # a new data connection: its first message is one DATA_HELLO naming its session
        frame = parts[1]
        msg: Message | None = None
        if len(parts) == 2 and len(frame) <= _MAX_FIRST_FRAME:
            with contextlib.suppress(WireError):
                msg = self._codec.decode(frame.buffer)
        user = None
        with contextlib.suppress(zmq.ZMQError):
            uid = frame.get("User-Id")
            user = str(uid) if uid else None
        ss = self._tokens.get(msg.token) if isinstance(msg, DataHello) else None
        if (
            ss is None
            or ss.data_rid is not None
            or ss.dead
            # the token of the handshake (PLAIN) or the key (CURVE) must be the session's
            or (ss.user if self.config.curve is not None else ss.token.hex()) != user
        ):
            self._count_error("bad_token")
            fd = _frame_fd(frame)
            if fd is not None and fd not in self._fd_sessions:
                self._hang_up(fd)
            return
        del self._tokens[ss.token]
        ss.data_rid = rid
        self._data_rids[rid] = ss
        self._bind_fd(ss, frame)

    async def _router_watch(self, mon: zmq.asyncio.Socket) -> None:
        """Drop the session of a connection the moment it closes (peer died or left).

        Events are matched to sessions by the connection's file descriptor. A
        descriptor can be reused at once by a new connection, whose ACCEPTED event
        then follows the DISCONNECTED one in the same batch: such an ambiguous
        close is left to the heartbeat.
        """
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                batch = [parse_monitor_message(await mon.recv_multipart())]
                while True:
                    try:
                        frames = await mon.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batch.append(parse_monitor_message(frames))
                for i, ev in enumerate(batch):
                    if ev["event"] == zmq.EVENT_ACCEPTED:
                        afd = int(ev["value"])
                        self._unbound[afd] = (time.monotonic(), _peer_name(afd))
                        continue
                    if ev["event"] != zmq.EVENT_DISCONNECTED:
                        continue
                    fd = int(ev["value"])
                    self._unbound.pop(fd, None)
                    reused = any(
                        later["event"] == zmq.EVENT_ACCEPTED and int(later["value"]) == fd
                        for later in batch[i + 1 :]
                    )
                    ss = self._fd_sessions.get(fd)
                    if ss is not None and not reused:
                        self._drop_server(
                            ss, PeerLostError(f"connection from {ss.name} closed"), lost=True
                        )
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, ValueError):
            return

    def _bind_fd(self, ss: _ServerSession, frame: zmq.Frame) -> None:
        fd = _frame_fd(frame)
        if fd is None:
            return
        self._unbound.pop(fd, None)
        ss.fds.append(fd)
        self._fd_sessions[fd] = ss

    def _refuse_connection(self, rid: bytes, frame: zmq.Frame, code: str, detail: str) -> None:
        """A connection that did not open a session properly: answer, count, hang up."""
        self._count_error(code)
        self._reply_raw(rid, ErrorMsg("protocol", detail[:200]))
        fd = _frame_fd(frame)
        if fd is not None and fd not in self._fd_sessions:
            self._hang_up(fd, after=0.05)  # let the ERROR leave first

    def _hang_up(self, fd: int, after: float = 0.0) -> None:
        """Shut a connection zmq owns, now or ``after`` seconds; the remote end seen at
        accept (or now) guards against the descriptor naming another connection by then."""
        seen = self._unbound.pop(fd, None)
        name = seen[1] if seen else _peer_name(fd)
        if after:
            asyncio.get_running_loop().call_later(after, _shutdown_fd, fd, name)
        else:
            _shutdown_fd(fd, name)

    def _on_new_connection(self, rid: bytes, frame: zmq.Frame) -> None:
        try:
            msg = self._codec.decode(frame.buffer)
        except WireError as exc:
            self._refuse_connection(rid, frame, exc.code, str(exc))
            return
        user = None
        if self.config.curve is not None:
            with contextlib.suppress(zmq.ZMQError):
                uid = frame.get("User-Id")
                user = str(uid) if uid is not None else None
        if not isinstance(msg, Hello):
            self._refuse_connection(rid, frame, "no_session", f"{msg.NAME} before HELLO")
            return
        ss = _ServerSession(self, rid, user)
        try:
            ss.sess.receive_message(msg)
        except RemoteProtocolError as exc:
            self._count_error("version")
            self._reply_raw(rid, ErrorMsg("version", str(exc)[:200]))
            return
        if self.config.layout is not None and msg.layout is not None:
            err = self._layout_error(msg.layout)
            if err:
                self._count_error("layout_mismatch")
                self._reply_raw(rid, ErrorMsg("layout_mismatch", err))
                return
        # With CURVE the peer is who its authenticated key says, not what it announces.
        ss.peer = self._claim(f"curve:{user}" if user else msg.engine_id, msg.listen)
        ss.trace_id = msg.engine_id
        self._servers[rid] = ss
        self._bind_fd(ss, frame)
        self._tokens[ss.token] = ss
        self._by_peer[ss.peer.engine_id] = ss
        if "credit" in msg.capabilities:
            lim = self.config.limits
            ss.ledger = CreditLedger(
                min(lim.store_bytes // 4, lim.credit_bytes),
                min(lim.store_tensors // 4, lim.credit_tensors),
            )
        w = Welcome(
            PROTOCOL_VERSION,
            self.engine_id,
            self._address,
            (*self._capabilities(), f"{_DATA_CAP}{self._data_port}"),
            self.config.layout,
            ss.token,
        )
        self._reply(ss, ss.sess.send(w))
        if ss.ledger is not None:
            self._send_credit(ss)  # the window travels in the same zmq message as WELCOME

    def _claim(self, engine_id: str, address: str) -> PeerRef:
        """The store identity of a new session from what it claims (or its CURVE key).

        The receive store keys tensors, waiters and a peer's loss by this identity,
        so two live sessions must never share it: a second session claiming an
        engine id or a listen address that a live session already holds gets a
        private one instead (the id with a suffix, the address marked unverified).
        Its tensors then match only ``recv(frm=None)`` and its BYE or loss touches
        only its own transfers. Without CURVE a claim is all there is: the first
        session to make one keeps it (docs/reliability.md, "Identity").
        """
        live_ids = {s.peer.engine_id for s in self._servers.values() if s.peer is not None}
        live_addrs = {s.peer.address for s in self._servers.values() if s.peer is not None}
        n = next(self._claims)
        if engine_id in live_ids:
            self._count_error("identity_in_use")
            engine_id = f"{engine_id}~{n}"
        if address in live_addrs:
            self._count_error("address_in_use")
            address = f"unverified#{n}:{address}"
        return PeerRef(engine_id, address)

    def _layout_error(self, theirs: dict[str, str | int]) -> str | None:
        """The configured check's verdict on a peer's layout (None: compatible).

        The engine carries layouts opaquely: what compatible means is the check's
        business (``EngineConfig.layout_check``, by default the KV layer's). ``theirs``
        is untrusted, so a check that raises refuses the peer instead of failing here.
        """
        check, mine = self.config.layout_check, self.config.layout
        if check is None or mine is None:
            return None
        try:
            err = check(mine, theirs)
        except Exception as exc:
            return f"layout check failed: {type(exc).__name__}: {exc}"[:500]
        return None if err is None else str(err)[:500]

    def _on_server_message(self, ss: _ServerSession, msg: Message) -> None:
        if isinstance(msg, Reserve):
            self._on_reserve(ss, msg)
        elif isinstance(msg, Withdraw):
            if self._admission.withdraw(ss.queued, msg.xfer) is not None:
                self._reply(ss, ss.sess.send(Withdrawn(msg.xfer)))
                self._unpause_credit(ss, msg.xfer)
                self._stats.withdrawn += 1
            elif msg.xfer in ss.granted:
                ss.granted[msg.xfer].discard = True
        elif isinstance(msg, Ping):
            self._reply(ss, ss.sess.send(Pong(msg.nonce)))
        elif isinstance(msg, Get):
            self._on_get(ss, msg)
        elif isinstance(msg, Failed):
            inx = ss.granted.pop(msg.xfer, None)
            if inx is not None:
                ss.granted_tensors -= len(inx.specs)
            if inx is not None and ss.peer is not None:
                self._store.cancel(
                    ss.peer, [s.tensor_id for s in inx.specs], TransferAbortedError(msg.detail)
                )
                self._pump_queue()
        elif isinstance(msg, (Bye, ErrorMsg)):
            self._drop_server(ss, PeerLostError(f"peer {ss.name} closed the session"), lost=False)
        elif isinstance(msg, NcclSetup):
            if not self._nccl_ok or ss.nccl is not None:
                why = (
                    self._nccl_why
                    if not self._nccl_ok
                    else "this session already has a communicator"
                )
                self._reply(ss, ss.sess.send(NcclReady(msg.comm, False, why[:300])))
            else:
                self._spawn(self._setup_server_nccl(ss, msg))

    async def _setup_server_nccl(self, ss: _ServerSession, msg: NcclSetup) -> None:
        from .nccl.comm import Communicator
        from .transport.nccl import NcclSink

        device = torch.device(self.config.device)
        try:
            blocking = self.config.nccl_blocking_ops
            comm = await Communicator.create(
                msg.unique_id,
                1,
                2,
                device,
                timeout=self.config.timeouts.connect,
                max_ctas=self.config.nccl_max_channels,
                blocking_ops=blocking,
            )
            if blocking:
                await comm.warmup(self.config.timeouts.connect)
        except AiokvError as exc:
            if not ss.dead:
                self._reply(ss, ss.sess.send(NcclReady(msg.comm, False, str(exc)[:300])))
            return
        if ss.dead:
            comm.abort()
            return
        ss.nccl = NcclSink(
            comm,
            self._get_poller(),
            device,
            max_batch=self.config.nccl_recv_batch,
            max_batch_bytes=self.config.nccl_recv_batch_bytes,
        )
        self._reply(ss, ss.sess.send(NcclReady(msg.comm, True, "")))

    def _on_reserve(self, ss: _ServerSession, msg: Reserve) -> None:
        assert ss.peer is not None
        if _trace.enabled:
            _trace.mark("reserve", ss.trace_id, msg.xfer)
        code, detail = "", ""
        if self._closed:
            code, detail = "closing", "engine closing"
        elif msg.transport == "nccl" and ss.nccl is None:
            code, detail = "transport", "NCCL is not set up for this session"
        elif (
            why := self._bounds.refusal(
                nbytes=msg.nbytes,
                ntensors=len(msg.specs),
                queued=len(ss.queued),
                granted=len(ss.granted),
                granted_tensors=ss.granted_tensors,
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
        sink: Any = ss.nccl if msg.transport == "nccl" else ss.sink
        fut = sink.expect(seq, msg.xfer, msg.specs)
        # a sink aborted after the session died is not an error to log
        fut.add_done_callback(_retrieve)
        fut.add_done_callback(lambda f: self._on_landed(ss, inx, f))
        self._reply(ss, ss.sess.send(Grant(msg.xfer, seq)))
        if msg.transport == "nccl":
            self._get_poller().touch()  # a granted NCCL receive lands soon: spin for it
        if _trace.enabled:
            _trace.mark("granted", ss.trace_id, msg.xfer)
        return True

    def _cancel_in_slices(self, peer: PeerRef, ids: list[str], err: BaseException) -> None:
        head, rest = ids[:_CANCEL_SLICE], ids[_CANCEL_SLICE:]
        self._store.cancel(peer, head, err)
        if rest:
            asyncio.get_running_loop().call_soon(self._cancel_in_slices, peer, rest, err)
        else:
            self._pump_queue()

    def _pump_queue(self) -> None:
        """Grant queued reservations that fit now, oldest first across sessions.

        A session's oldest reservation that does not fit holds up that session's
        later ones (one order per peer) but never another session's: one peer's
        large reservation waiting for room does not block the others.
        """
        if self._admission.queued:
            self._admission.pump(lambda q, msg: self._try_grant(q.owner, msg))
        if self._starved:
            for ss in sorted(self._starved, key=_share):
                if not ss.ack_due:
                    self._send_credit(ss)

    def _forget_expired_credit(self, ss: _ServerSession, now: float) -> None:
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
            self._send_credit(ss)

    def _expire_grants(self, ss: _ServerSession, now: float) -> None:
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

    def _on_data(self, ss: _ServerSession, frames: list[zmq.Frame]) -> None:
        try:
            header = self._codec.decode(frames[0].buffer)
            if isinstance(header, (Put, Return)):
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
                    else:
                        raise RemoteProtocolError(f"{header.NAME} among PUTs")
                    if i >= len(frames) or ss.dead:
                        break
                    header = self._codec.decode(frames[i].buffer)
                # the ACK leaves as soon as the messages that arrived together are
                # handled (_acks_now), before anything they woke up (a waiting recv)
                # runs: it is the sender's critical path
                if ss.ack_due and not ss.dead:
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
            self._drop_server(ss, exc, lost=True)

    def _on_return(self, ss: _ServerSession, msg: Return) -> None:
        if ss.ledger is None:
            raise RemoteProtocolError("RETURN without credit")
        ss.ledger.give_back(msg.credit_bytes, msg.credit_tensors)
        self._store.reserved -= msg.credit_bytes
        # the RESERVE it makes room for (control connection: it may come before or
        # after) is granted or ends before new credit could take the room
        if msg.xfer in ss.queued or msg.xfer > ss.sess.max_xfer_seen:
            ss.ledger.paused_for = msg.xfer
        self._starved.add(ss)
        self._pump_queue()

    def _on_put(self, ss: _ServerSession, msg: Put, frames: list[zmq.Frame]) -> None:
        """Protocol v2: a transfer on standing credit lands now (raises RemoteProtocolError)."""
        ledger = ss.ledger
        if ledger is None or msg.xfer <= ss.last_put:
            raise RemoteProtocolError(f"PUT {msg.xfer} out of order or without credit")
        ss.last_put = msg.xfer
        n, k = msg.nbytes, len(msg.specs)
        ledger.spend(n, k)
        self._store.reserved -= n  # the session's credit becomes this transfer's room
        tensors = frames_to_tensors(msg.specs, frames)
        assert ss.peer is not None
        items = [(sp.tensor_id, sp.nbytes, t) for sp, t in zip(msg.specs, tensors)]
        why = ""
        try:
            if ss.queued.claims_any(t for t, _, _ in items):
                raise DuplicateTensorError("duplicate")
            if not self._store.try_land(ss.peer, items):
                why = "busy"  # the store's tensor count is full (bytes were credited)
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

    def _send_credit(self, ss: _ServerSession, now: bool = False) -> None:
        """One ACK for everything landed or refused this loop pass, with any new credit
        (``now``: the caller flushes the session's replies itself, at once)."""
        ss.ack_due = False
        ledger = ss.ledger
        if ledger is None or ss.dead:
            return
        store = self._store
        # this session's own RESERVE that its credit was returned for comes first; other
        # sessions' waiting reservations do not stop its credit (one peer's large
        # reservation must not starve every other peer: windows are bounded instead).
        # When room is short, sessions holding less go first (see _pump_queue).
        room = 0 if ledger.paused_for else max(0, store.capacity - store.used)
        if (
            room
            and self._starved
            and any(
                o is not ss and o.ledger is not None and o.ledger.share < ledger.share
                for o in self._starved
            )
        ):
            room = 0
        add_b, add_t = ledger.top_up(room)
        store.reserved += add_b
        if ledger.short:
            self._starved.add(ss)  # the budget is short: retried as room frees
        else:
            self._starved.discard(ss)
        if not (add_b or add_t or ss.acks or ss.refused or not ledger.announced):
            return
        ledger.announced = True
        acks, ss.acks = ss.acks, []
        refused, ss.refused = ss.refused, []
        for i in range(0, max(len(acks), len(refused), 1), MAX_ACKS):
            self._reply(
                ss,
                ss.sess.send(
                    Ack(
                        ledger.window_bytes,
                        ledger.window_tensors,
                        add_b if i == 0 else 0,
                        add_t if i == 0 else 0,
                        tuple(acks[i : i + MAX_ACKS]),
                        tuple(refused[i : i + MAX_ACKS]),
                    )
                ),
                now,
            )

    def _acks_now(self) -> None:
        """The data port read everything that had arrived: one ACK per session that
        landed something (messages read in one run share it)."""
        due, self._ack_now = self._ack_now, []
        for ss in due:
            if ss.ack_due and not ss.dead:
                self._send_credit(ss, now=True)

    def _ack_soon(self, ss: _ServerSession) -> None:
        """One ACK per loop pass: whatever landed, was refused or freed until then
        (a data message sends its ACK itself as soon as it is handled)."""
        if not ss.ack_due:
            ss.ack_due = True
            self._loop.call_soon(self._ack_if_due, ss)

    def _ack_if_due(self, ss: _ServerSession) -> None:
        if ss.ack_due:
            self._send_credit(ss)

    def _unpause_credit(self, ss: _ServerSession, xfer: int) -> None:
        if ss.ledger is not None and ss.ledger.paused_for == xfer:
            ss.ledger.paused_for = 0
            self._ack_soon(ss)

    def _collected(self, peer: PeerRef, tensor_id: str) -> None:
        """A tensor left the store through ``recv``: its session's credit may refill."""
        ss = self._by_peer.get(peer.engine_id)
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
            self._pump_queue()
            return
        if inx.discard:
            self._store.cancel(ss.peer, ids, None)
            self._pump_queue()
        else:
            for spec, t in zip(inx.specs, fut.result()):
                self._store.land(ss.peer, spec.tensor_id, t)
            if _trace.enabled:
                _trace.mark("landed", ss.trace_id, inx.xfer)
            self._stats.transfers_received += 1
            self._stats.tensors_received += len(inx.specs)
            self._stats.bytes_received += inx.nbytes
        self._reply(ss, ss.sess.send(Done(inx.xfer)))

    def _on_get(self, ss: _ServerSession, msg: Get) -> None:
        assert ss.peer is not None
        # The reply travels over this engine's own session to the requester's listen
        # address: only to the address this session holds (never a third host, never
        # another peer's store), and a bounded number at a time.
        if msg.reply_to != ss.peer.address:
            self._count_error("bad_reply_to")
            self._reply(
                ss,
                ss.sess.send(
                    GetReply(msg.req, "bad_reply_to", "GET replies go to the session's own address")
                ),
            )
            return
        if ss.gets >= _MAX_GETS_PER_SESSION or self._gets_serving >= _MAX_GETS_SERVING:
            self._reply(ss, ss.sess.send(GetReply(msg.req, "busy", "too many GETs in flight")))
            return
        missing = [t for t in msg.tensor_ids if t not in self._published]
        if missing:
            self._reply(
                ss,
                ss.sess.send(
                    GetReply(msg.req, "not_published", f"{missing[0]!r} is not published")
                ),
            )
            return
        items = [(t, self._published[t]) for t in msg.tensor_ids]
        self._spawn(self._serve_get(ss, msg, items))

    async def _serve_get(
        self, ss: _ServerSession, msg: Get, items: list[tuple[str, torch.Tensor]]
    ) -> None:
        ss.gets += 1
        self._gets_serving += 1
        try:
            await self._transfer(msg.reply_to, self._stage(items), None)
            code, detail = "ok", ""
            self._stats.gets_served += 1
        except AiokvError as exc:
            code, detail = "internal", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            ss.gets -= 1
            self._gets_serving -= 1
        if not ss.dead and ss.sess.state is SessionState.OPEN:
            self._reply(ss, ss.sess.send(GetReply(msg.req, code, detail)))

    def _drop_server(self, ss: _ServerSession, exc: BaseException, *, lost: bool) -> None:
        if ss.dead:
            return
        ss.dead = True
        self._admission.close(ss.queued)  # before anything below may pump the queue
        if lost:
            self._stats.peers_lost += 1
        self._servers.pop(ss.rid, None)
        self._tokens.pop(ss.token, None)
        self._starved.discard(ss)
        if ss.peer is not None and self._by_peer.get(ss.peer.engine_id) is ss:
            del self._by_peer[ss.peer.engine_id]
        if ss.ledger is not None:
            self._store.reserved -= ss.ledger.credit_bytes  # unspent credit goes back
            ss.ledger.credit_bytes = 0
        if ss.data_rid is not None:
            self._data_rids.pop(ss.data_rid, None)
        for fd in ss.fds:
            if self._fd_sessions.get(fd) is ss:
                del self._fd_sessions[fd]
                if lost and not self._closed:
                    # a peer judged dead or hostile: its connections must not linger
                    # (after a moment, so that an ERROR queued for it still leaves)
                    self._hang_up(fd, after=0.05)
        ss.sink.abort(exc)
        if ss.nccl is not None:
            ss.nccl.abort(exc)
        if ss.peer is not None:
            err = exc if isinstance(exc, AiokvError) else PeerLostError(str(exc))
            if not isinstance(err, PeerLostError):
                err = PeerLostError(f"peer {ss.name} lost: {err}")
            # only this session's own transfers in flight (no scan of the whole store), in
            # slices: a session with tens of thousands pending must not stall the loop
            ids = [s.tensor_id for inx in ss.granted.values() for s in inx.specs]
            self._cancel_in_slices(ss.peer, ids, err)
        ss.granted.clear()
        ss.sess.close()
        self._pump_queue()

    # ------------------------------------------------------------------ upkeep
    async def _housekeeping(self) -> None:
        T = self.config.timeouts
        tick = min(T.heartbeat_interval / 2, 0.25)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            idle = self.config.limits.idle_session
            for cs in list(self._clients.values()):
                if not cs.xfers and not cs.gets and now - cs.last_used > idle:
                    # idle eviction: frees the session and its communicator
                    await cs.bye(ConnectError(f"session with {cs.address} closed after being idle"))
                elif now - cs.last_recv > T.heartbeat_timeout:
                    # Judge on the second look: after a stall of this loop the peer's answers
                    # may be waiting unread, and the readers run before the next tick.
                    if cs.suspect:
                        cs.fail(
                            PeerLostError(
                                f"no heartbeat from {cs.address} for {now - cs.last_recv:.2f}s"
                            )
                        )
                    cs.suspect = True
                else:
                    cs.suspect = False
                    if now - cs.last_ping >= T.heartbeat_interval:
                        cs.ping(now)
            for ss in list(self._servers.values()):
                if ss.granted:
                    self._expire_grants(ss, now)
                if ss.credit_held:
                    self._forget_expired_credit(ss, now)
                if now - ss.last_recv <= T.heartbeat_timeout:
                    ss.suspect = False
                elif ss.suspect:  # second look, as for client sessions
                    self._drop_server(ss, PeerLostError(f"no heartbeat from {ss.name}"), lost=True)
                else:
                    ss.suspect = True
            if self._store.expire(now):
                self._pump_queue()
            self._reclaim_unbound(now)

    def _reclaim_unbound(self, now: float) -> None:
        """Hang up connections that have not opened a session within the connect deadline."""
        limit = self.config.timeouts.connect
        for fd, (at, name) in list(self._unbound.items()):
            if now - at > limit and fd not in self._fd_sessions:
                del self._unbound[fd]
                self._count_error("no_hello")
                _shutdown_fd(fd, name)
