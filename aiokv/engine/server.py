"""The server side of sessions: this engine receives.

:class:`_Server` owns the listening sockets (the control ROUTER, the data ROUTER
and, without CURVE, the data port's ZAP handler), every peer's
:class:`_ServerSession` and their indexes, the admission queue and per-peer
bounds, standing credit and its ACKs, landing, GET serving, and the server half
of housekeeping. The engine hands it what it needs (config, codec, store,
statistics; the loop and zmq contexts at start) and keeps the public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import zmq
import zmq.asyncio

from aiokv._config import EngineConfig, parse_address
from aiokv._exceptions import (
    AiokvError,
    DuplicateTensorError,
    PeerLostError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
)
from aiokv._runtime import trace as _trace
from aiokv._runtime.deadlines import (
    _DATA_CAP,
    _PLAIN_USER,
    MAX_FRAMES_PER_MESSAGE,
    _retrieve,
)
from aiokv._runtime.zmqerr import channel_error
from aiokv._runtime.zsock import LoopSocket, Outbox, max_msg_size, monitor_socket
from aiokv.engine.store import PeerRef, ReceiveStore
from aiokv.protocol.admission import AdmissionQueue, PeerBounds, PeerQueue
from aiokv.protocol.codec import MAX_ACKS, TOKEN_BYTES, Codec, WireError
from aiokv.protocol.credit import CreditLedger
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
from aiokv.protocol.session import Role, Session, SessionState
from aiokv.transport.tcp import (
    FrameTensor,
    TcpSink,
    frames_to_tensors,
    put_frame_count,
)

if TYPE_CHECKING:
    from aiokv.engine.engine import Engine, EngineStatistics
    from aiokv.transport.nccl import NcclSink

log = logging.getLogger("aiokv")

#: a new connection's first message is one HELLO: anything larger is refused (and hung up)
_MAX_FIRST_FRAME = 64 * 1024
#: ZAP domain of the data port without CURVE (this engine's own ZAP handler answers it)
_DATA_DOMAIN = b"aiokv-data"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_MAX_GETS_PER_SESSION = 16
_CANCEL_SLICE = 256  # pending tensors of a lost session released per step
_CLEANUP_S = 0.002  # lost sessions' teardown per loop pass (_run_cleanups)
#: granted, not yet landed transfers of one session (zero-byte ones cost no budget)
_MAX_GRANTED_PER_SESSION = 16384
_MAX_GETS_SERVING = 64
_OPEN = SessionState.OPEN
# Control frames (docs/reliability.md, "Floods"): one session's frames are handled for at
# most _SLICE_S at a time; what is left waits in its inbox and sessions with a backlog take
# turns (at most _TURNS_S per loop pass), so one message of thousands of frames -- or ten
# sessions sending one each -- never holds the loop, and an established peer's frames
# wait for one turn of each other session, not for their whole backlog.
_SLICE_S = 0.001
#: at most this many accepted connections without a session (less under a low fd limit),
#: hung up oldest first once they had _UNBOUND_GRACE_S to say HELLO (_cap_unbound)
_MAX_UNBOUND = 512
_UNBOUND_GRACE_S = 0.05
_TURNS_S = 0.002
#: a session with more control frames (or bytes of them) than this waiting to be
#: handled is flooding
_MAX_INBOX_FRAMES = 64 * MAX_FRAMES_PER_MESSAGE
_MAX_INBOX_BYTES = 16 << 20
#: granting queued reservations runs at most this long per call (then again next pass)
_PUMP_S = 0.004
# ACK timing (docs/design.md, "ACK timing"): PUTs nobody waits for yet are acknowledged
# in groups of this many, or when credit runs low, or after _ACK_DELAY_S at the latest
_ACK_EVERY = 8
_ACK_DELAY_S = 0.001


def _share(ss: _ServerSession) -> int:
    return ss.ledger.share if ss.ledger is not None else 0


def _frame_fd(frame: zmq.Frame) -> int | None:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def _peer_name(fd: int) -> str | None:
    """The remote end of a connection's descriptor (zmq owns it: wrapped, never closed
    here, and without a new descriptor -- the table may be full)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return repr(s.getpeername())
    except OSError:
        return None
    finally:
        s.detach()


def _host_of(name: str | None) -> str:
    """The source address in a :func:`_peer_name` (``"('10.0.0.5', 4711)"``)."""
    return name.split(",", 1)[0] if name else ""


def _unbound_caps() -> tuple[int, int]:
    """How many accepted connections may be without a session, in all and per source
    address: an eighth of the descriptor limit (at most _MAX_UNBOUND), so that idle
    connections can never take the descriptors that sessions need."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = 1024
    if soft < 0:  # RLIM_INFINITY
        soft = 1 << 20
    total = max(8, min(_MAX_UNBOUND, soft // 8))
    return total, max(4, total // 4)


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
        s = socket.socket(fileno=fd)  # no new descriptor (see _peer_name)
    except OSError:
        return
    try:
        if repr(s.getpeername()) == expect:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()


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

    def __init__(self, server: _Server, rid: bytes, user: str | None) -> None:
        self.rid = rid
        self.user = user  # CURVE public key of the peer, when CURVE is on
        self.trace_id = ""  # the engine id the peer announced (aiokv._runtime.trace joins on it)
        self.sess = Session(Role.SERVER, server._codec)
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
            server._router,
            lambda exc: server._drop_server(
                self, channel_error(exc, f"reply channel to {self.name}"), lost=True
            ),
            prefix=rid,
            max_frames=MAX_FRAMES_PER_MESSAGE,
        )
        self.suspect = False
        self.inbox: deque[zmq.Frame] = deque()  # control frames not handled yet, in order
        self.inbox_bytes = 0  # (their bytes: counted as they arrive, not as they go)
        self.fds: list[int] = []  # the connections' descriptors (router monitor events)
        self.gets = 0  # GETs of this peer being served
        self.granted_tensors = 0  # tensors of the granted transfers
        # protocol v2 (the peer offered "credit"): its standing window and what it holds
        self.ledger: CreditLedger | None = None
        self.last_put = 0
        self.credit_held: OrderedDict[str, tuple[int, float]] = OrderedDict()  # tid -> (n, at)
        self.acks: list[int] = []
        self.refused: list[tuple[int, str]] = []
        self.ack_due = False  # an ACK is owed (landed, refused, or credit to give)
        self.ack_force = False  # ... and the peer waits for it (ack_now PUT, ACK_REQ)
        self.ack_timer: asyncio.TimerHandle | None = None  # a deferred ACK's deadline

    @property
    def name(self) -> str:
        return self.peer.address if self.peer else "?"


class _KeyCheck:
    """ZAP credentials provider: which CURVE client keys may connect."""

    def __init__(self, allowed: frozenset[bytes] | None) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return self.allowed is None or key in self.allowed


class _Server:
    """This engine's receiving half: the listening sockets and every peer's session."""

    def __init__(
        self,
        engine: Engine,
        config: EngineConfig,
        codec: Codec,
        store: ReceiveStore,
        stats: EngineStatistics,
    ) -> None:
        self.engine = engine  # lifecycle state, published tensors, sending a GET's reply
        self.config = config
        self._codec = codec
        self._store = store
        self._stats = stats
        self._count_error = engine._count_error
        self._spawn = engine._spawn
        self._get_poller = engine._get_poller
        self._loop: asyncio.AbstractEventLoop  # bound by bind()
        self._ctx: zmq.asyncio.Context = None  # type: ignore[assignment]
        self._sctx: zmq.Context[Any] = None  # type: ignore[assignment]
        self._router: LoopSocket = None  # type: ignore[assignment]
        # data connections: a port of their own, entered only after authentication
        self._data_router: LoopSocket = None  # type: ignore[assignment]
        self._data_mon: zmq.asyncio.Socket = None  # type: ignore[assignment]
        self._data_port = 0
        self._zap: LoopSocket | None = None  # the data port's ZAP handler (no CURVE)
        self._auth: Any = None
        self._servers: dict[bytes, _ServerSession] = {}
        self._data_rids: dict[bytes, _ServerSession] = {}
        self._tokens: dict[bytes, _ServerSession] = {}
        self._fd_sessions: dict[int, _ServerSession] = {}
        self._claims = itertools.count(1)
        self._by_peer: dict[str, _ServerSession] = {}  # live sessions by store identity
        self._starved: set[_ServerSession] = set()  # credit cut short by the budget
        self._gets_serving = 0
        # accepted connections without a session yet, oldest first: fd -> (accepted at,
        # peer name); how many per source address; the caps (see _on_accepted)
        self._unbound: dict[int, tuple[float, str | None]] = {}
        self._unbound_hosts: dict[str, int] = {}
        self._max_unbound, self._max_unbound_host = _unbound_caps()
        self._cap_timer: asyncio.TimerHandle | None = None  # _cap_unbound looks again
        self._router_mon: zmq.asyncio.Socket = None  # type: ignore[assignment]
        # reservations waiting for room, every session's (see aiokv.protocol.admission)
        self._admission: AdmissionQueue[Reserve] = AdmissionQueue()
        self._ack_now: list[_ServerSession] = []  # sessions whose data awaits an ACK
        self._turns: deque[_ServerSession] = deque()  # sessions with an inbox, in turn
        self._turns_due = False  # _take_turns is scheduled
        self._pump_due = False  # pump_queue ran out of time and is scheduled again
        self._cleanups: deque[Callable[[], bool]] = deque()  # lost sessions' teardown
        self._cleanup_due = False
        lim = config.limits
        self._bounds = PeerBounds(
            budget_bytes=lim.store_bytes,
            max_queued=lim.max_pending_reserves,
            max_granted=_MAX_GRANTED_PER_SESSION,
            # one session's share of the store's tensor count (empty tensors cost no bytes)
            max_tensors_in_flight=max(lim.store_tensors // 4, lim.max_tensors_per_transfer),
            max_queued_tensors=max(lim.store_tensors // 4, lim.max_tensors_per_transfer),
            own_queued_tensors=lim.max_tensors_per_transfer,
        )
        # what each control message a session lets through does: one look-up per message.
        # (HELLO opens a session in _on_new_connection; a DATA header that came on the
        # control connection has no data with it and is ignored, as it always was.)
        self._handlers: dict[type[Message], Callable[[_ServerSession, Any], None]] = {
            Reserve: self._on_reserve,
            Withdraw: self._on_withdraw,
            Ping: self._on_ping,
            Get: self._on_get,
            Failed: self._on_failed,
            Bye: self._on_bye,
            ErrorMsg: self._on_bye,
            NcclSetup: self._on_nccl_setup,
        }

    # ------------------------------------------------------------------ lifecycle
    def bind(
        self, loop: asyncio.AbstractEventLoop, ctx: zmq.asyncio.Context, sctx: zmq.Context[Any]
    ) -> str:
        """Bind the control and data ports; the ``host:port`` it listens on.

        Raises zmq.ZMQError (its own sockets closed) if a port cannot be bound.
        """
        self._loop, self._ctx, self._sctx = loop, ctx, sctx
        lim = self.config.limits
        # The control port carries control messages only: zmq drops (and hangs up) a
        # connection whose frame exceeds one, before reading it. Data arrives on a port
        # of its own that authenticates first, in frames of at most DATA_FRAME_BYTES
        # (1 MiB; a tensor travels as several): zmq applies MAXMSGSIZE to the handshake
        # too, so this bounds what a stranger can make it buffer on either port. (With
        # CURVE, zmq measures the encrypted frame: the limit covers CURVE's overhead.)
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
        except zmq.ZMQError:
            r.close(0)
            d.close(0)
            if self._zap is not None:
                self._zap.close(0)
            if self._auth is not None:
                self._auth.stop()
            raise
        ep = bytes(r.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self._data_port = int(bytes(d.getsockopt(zmq.LAST_ENDPOINT)).decode().rsplit(":", 1)[1])
        # Connection events, so a peer whose process died is dropped at once rather
        # than after its heartbeat timeout.
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        self._router_mon = monitor_socket(r, self._ctx, events)
        self._data_mon = monitor_socket(d, self._ctx, events)
        self._router = LoopSocket(r, self._on_router_frames, self._on_router_error)
        self._data_router = LoopSocket(
            d, self._on_data_frames, self._on_router_error, on_drained=self._acks_now
        )
        return f"{host}:{ep.rsplit(':', 1)[1]}"

    def tasks(self) -> list[asyncio.Task[None]]:
        """The connection monitors of both ports (the engine cancels them at close)."""
        return [
            asyncio.create_task(self._router_watch(self._router_mon), name="aiokv-router-monitor"),
            asyncio.create_task(self._router_watch(self._data_mon), name="aiokv-data-monitor"),
        ]

    def close_sessions(self, exc: BaseException) -> None:
        """Say BYE to every peer and drop its session (the engine is closing)."""
        for ss in list(self._servers.values()):
            if ss.sess.state is SessionState.OPEN:
                with contextlib.suppress(Exception):
                    self._reply(ss, ss.sess.send(Bye()))
            self._drop_server(ss, exc, lost=False)

    def close_sockets(self) -> None:
        """Close the listening sockets (after the monitor tasks ended)."""
        for rs, mon in ((self._router, self._router_mon), (self._data_router, self._data_mon)):
            with contextlib.suppress(zmq.ZMQError):
                rs.sock.disable_monitor()
            mon.close(linger=0)
            rs.close(linger=min(200, int(self.config.timeouts.linger * 1000)))
        if self._zap is not None:
            self._zap.close(0)
        if self._auth is not None:
            self._auth.stop()
        if self._cap_timer is not None:
            self._cap_timer.cancel()

    def statistics(self, s: EngineStatistics) -> list[Any]:
        """Fill the server side's figures into ``s``; the sessions' NCCL communicators."""
        servers = self._servers.values()
        ledgers = [ss.ledger for ss in servers if ss.ledger is not None]
        s.credit_bytes = sum(g.credit_bytes for g in ledgers)
        s.credit_tensors = sum(g.credit_tensors for g in ledgers)
        if s.store is not None:
            s.store.reserved_bytes -= s.credit_bytes
        s.credit_starved = len(self._starved)
        s.server_sessions = len(self._servers)
        s.queued_reservations = sum(len(ss.queued) for ss in servers)
        return [ss.nccl.comm for ss in servers if ss.nccl is not None]

    def resolve_peer(self, addr: str) -> str | None:
        """The store identity of the live session that holds listen address ``addr``."""
        for ss in self._servers.values():
            if ss.peer is not None and ss.peer.address == addr:
                return ss.peer.engine_id
        return None

    def housekeep(self, now: float) -> None:
        """The server half of the engine's housekeeping tick."""
        T = self.config.timeouts
        for ss in list(self._servers.values()):
            if ss.granted:
                self._expire_grants(ss, now)
            if ss.credit_held:
                self._forget_expired_credit(ss, now)
            # frames of its still wait in the inbox: this end is behind, the peer is not silent
            if ss.inbox or now - ss.last_recv <= T.heartbeat_timeout:
                ss.suspect = False
            elif ss.suspect:  # second look, as for client sessions
                self._drop_server(ss, PeerLostError(f"no heartbeat from {ss.name}"), lost=True)
            else:
                ss.suspect = True
        if self._store.expire(now):
            self.pump_queue()
        self._reclaim_unbound(now)

    # ------------------------------------------------------------------ sockets

    def _router_socket(self, max_frame: int) -> zmq.Socket[Any]:
        """A listening ROUTER whose connections may send frames of up to ``max_frame`` bytes."""
        r: zmq.Socket[Any] = self._sctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, int(self.config.timeouts.linger * 1000))
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # per connection: a peer flooding messages waits in TCP, not in this process
        r.setsockopt(zmq.RCVHWM, 10_000)
        r.setsockopt(zmq.SNDHWM, 100_000)
        r.setsockopt(zmq.MAXMSGSIZE, max_msg_size(max_frame, self.config.curve is not None))
        return r

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

    # ------------------------------------------------------------------ control port

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
        if not self.engine._closed:
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
        if ss.inbox:  # earlier frames still wait for their turn: these go behind them
            ss.inbox_bytes += sum(len(f) for f in frames)
            if len(ss.inbox) + len(frames) > _MAX_INBOX_FRAMES or ss.inbox_bytes > _MAX_INBOX_BYTES:
                self._count_error("flood")
                self._reply_raw(rid, ErrorMsg("protocol", "too many control frames waiting"))
                self._drop_server(ss, RemoteProtocolError("control frame flood"), lost=True)
                return
            ss.inbox.extend(frames)
            return
        # a client sends several control messages as one zmq message: handled now for
        # at most _SLICE_S, the rest in turns with other sessions' (_take_turns)
        until = time.perf_counter() + _SLICE_S
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            self._on_control(ss, frame)
            if ss.dead:
                return
            if i < last and time.perf_counter() > until:
                ss.inbox.extend(frames[i + 1 :])
                ss.inbox_bytes = sum(len(f) for f in ss.inbox)
                self._wait_turn(ss)
                return

    def _on_control(self, ss: _ServerSession, frame: zmq.Frame) -> None:
        """One control message of a session (a protocol error drops the session)."""
        try:
            msg = ss.sess.receive(frame.buffer)
        except RemoteProtocolError as exc:
            self._count_error(getattr(exc, "code", "protocol"))
            self._reply_raw(ss.rid, ErrorMsg("protocol", str(exc)[:200]))
            self._drop_server(ss, exc, lost=True)
            return
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(ss, msg)

    def _wait_turn(self, ss: _ServerSession) -> None:
        self._turns.append(ss)
        if not self._turns_due:
            self._turns_due = True
            self._loop.call_soon(self._take_turns)

    def _take_turns(self) -> None:
        """Sessions with control frames waiting take turns of at most _SLICE_S each, for
        at most _TURNS_S in all; the rest goes on in the next loop pass."""
        self._turns_due = False
        turns = self._turns
        end = time.perf_counter() + _TURNS_S
        for _ in range(len(turns)):
            ss = turns.popleft()
            inbox = ss.inbox
            until = min(end, time.perf_counter() + _SLICE_S)
            try:
                while inbox and not ss.dead:
                    self._on_control(ss, inbox.popleft())
                    if time.perf_counter() > until:
                        break
            except Exception as exc:  # the loop must survive anything a peer sends
                self._count_error("internal")
                log.exception("aiokv: error handling a message: %s", exc)
            if ss.dead:
                inbox.clear()
            elif inbox:
                turns.append(ss)
            else:
                ss.inbox_bytes = 0
            if time.perf_counter() > end:
                break
        if turns and not self._turns_due:
            self._turns_due = True
            self._loop.call_soon(self._take_turns)

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
                accepted = False
                while len(batch) < 64:  # a burst of connections: a batch per loop pass
                    try:
                        frames = await mon.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batch.append(parse_monitor_message(frames))
                for i, ev in enumerate(batch):
                    if ev["event"] == zmq.EVENT_ACCEPTED:
                        self._on_accepted(int(ev["value"]))
                        accepted = True
                        continue
                    if ev["event"] != zmq.EVENT_DISCONNECTED:
                        continue
                    fd = int(ev["value"])
                    self._unbind(fd)
                    reused = any(
                        later["event"] == zmq.EVENT_ACCEPTED and int(later["value"]) == fd
                        for later in batch[i + 1 :]
                    )
                    ss = self._fd_sessions.get(fd)
                    if ss is not None and not reused:
                        self._drop_server(
                            ss, PeerLostError(f"connection from {ss.name} closed"), lost=True
                        )
                        await asyncio.sleep(0)  # many sessions closing: one per loop pass
                if accepted and self._cap_timer is None:
                    self._cap_unbound()
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, ValueError):
            return

    def _on_accepted(self, fd: int) -> None:
        """A connection was accepted: it has no session until its HELLO (DATA_HELLO)."""
        if fd in self._fd_sessions:
            return  # its HELLO was handled before this event
        name = _peer_name(fd)
        self._unbind(fd)  # a number reused before its DISCONNECTED was seen
        self._unbound[fd] = (time.monotonic(), name)
        host = _host_of(name)
        self._unbound_hosts[host] = self._unbound_hosts.get(host, 0) + 1

    def _cap_unbound(self) -> None:
        """Connections without a session are capped, in all and per source address
        (_unbound_caps): past a cap the oldest -- of that address, else of all -- are hung
        up, once they had _UNBOUND_GRACE_S to say HELLO (a peer does within a round trip
        of connecting). So new connections, an engine's among them, always get in, and
        idle ones never hold more than an eighth of the descriptors. (zmq cannot refuse
        a connection before accepting it, and ZAP sees only those that finish a
        handshake and would refuse the newest, not the idle: docs/design.md.)
        """
        self._cap_timer = None
        if self.engine._closed:
            return
        unbound, hosts = self._unbound, self._unbound_hosts
        cap, cap_host = self._max_unbound, self._max_unbound_host
        over = {h for h, n in hosts.items() if n > cap_host}
        if not over and len(unbound) <= cap:
            return
        edge = time.monotonic() - _UNBOUND_GRACE_S
        for fd, (at, name) in list(unbound.items()):  # oldest first
            if at > edge:  # the rest are new: looked at again once their grace is over
                self._cap_timer = self._loop.call_later(at - edge + 0.001, self._cap_unbound)
                return
            host = _host_of(name)
            if host in over or len(unbound) > cap:
                self._count_error("unbound_cap")
                self._unbind(fd)
                _shutdown_fd(fd, name)
                if hosts.get(host, 0) <= cap_host:
                    over.discard(host)
                if not over and len(unbound) <= cap:
                    return

    def _unbind(self, fd: int) -> tuple[float, str | None] | None:
        """``fd`` is no longer a connection without a session; what was recorded of it."""
        seen = self._unbound.pop(fd, None)
        if seen is not None:
            host = _host_of(seen[1])
            left = self._unbound_hosts.get(host, 1) - 1
            if left > 0:
                self._unbound_hosts[host] = left
            else:
                self._unbound_hosts.pop(host, None)
        return seen

    def _bind_fd(self, ss: _ServerSession, frame: zmq.Frame) -> None:
        fd = _frame_fd(frame)
        if fd is None:
            return
        self._unbind(fd)
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
        seen = self._unbind(fd)
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
            self.engine.engine_id,
            self.engine._address,
            (*self.engine._capabilities(), f"{_DATA_CAP}{self._data_port}"),
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

    def _on_withdraw(self, ss: _ServerSession, msg: Withdraw) -> None:
        if self._admission.withdraw(ss.queued, msg.xfer) is not None:
            self._reply(ss, ss.sess.send(Withdrawn(msg.xfer)))
            self._unpause_credit(ss, msg.xfer)
            self._stats.withdrawn += 1
        elif msg.xfer in ss.granted:
            ss.granted[msg.xfer].discard = True

    def _on_ping(self, ss: _ServerSession, msg: Ping) -> None:
        self._reply(ss, ss.sess.send(Pong(msg.nonce)))

    def _on_failed(self, ss: _ServerSession, msg: Failed) -> None:
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

    def _on_bye(self, ss: _ServerSession, msg: Bye | ErrorMsg) -> None:
        self._drop_server(ss, PeerLostError(f"peer {ss.name} closed the session"), lost=False)

    def _on_nccl_setup(self, ss: _ServerSession, msg: NcclSetup) -> None:
        if not self.engine._nccl_ok or ss.nccl is not None:
            why = (
                self.engine._nccl_why
                if not self.engine._nccl_ok
                else "this session already has a communicator"
            )
            self._reply(ss, ss.sess.send(NcclReady(msg.comm, False, why[:300])))
        else:
            self._spawn(self._setup_server_nccl(ss, msg))

    async def _setup_server_nccl(self, ss: _ServerSession, msg: NcclSetup) -> None:
        from aiokv.gpu.nccl.comm import Communicator
        from aiokv.transport.nccl import NcclSink

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
        if self.engine._closed:
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
        sink: Any = ss.nccl if msg.transport == "nccl" else ss.sink
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

    def _cleanup(self, step: Callable[[], bool]) -> None:
        """Queue a lost session's teardown: ``step()`` does a slice of it and answers
        whether some is left. Every session's steps share one budget per loop pass
        (_CLEANUP_S), so ten sessions lost together cost no more per pass than one."""
        self._cleanups.append(step)
        if not self._cleanup_due:
            self._cleanup_due = True
            self._loop.call_soon(self._run_cleanups)

    def _run_cleanups(self) -> None:
        self._cleanup_due = False
        steps = self._cleanups
        end = time.perf_counter() + _CLEANUP_S
        while steps and time.perf_counter() < end:
            if not steps[0]():
                steps.popleft()
        if steps:
            self._cleanup_due = True
            self._loop.call_soon(self._run_cleanups)

    def _cancel_in_slices(self, peer: PeerRef, ids: list[str], err: BaseException) -> None:
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

        self._cleanup(step)

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
                self._loop.call_soon(self._pump_later)
        if self._starved:
            for ss in sorted(self._starved, key=_share):
                if not ss.ack_due:
                    self._send_credit(ss)

    def _pump_later(self) -> None:
        self._pump_due = False
        self.pump_queue()

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
                        self._send_credit(ss, now=True)
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
            self._drop_server(ss, exc, lost=True)

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
        self._starved.add(ss)
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

    def _send_credit(self, ss: _ServerSession, now: bool = False) -> None:
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
            and self._starved
            and any(
                o is not ss and o.ledger is not None and o.ledger.share < ledger.share
                for o in self._starved
            )
        ):
            room = room_t = 0
        add_b, add_t = ledger.top_up(room, room_t)
        store.reserved += add_b
        store.credit_n += add_t
        if ledger.short:
            self._starved.add(ss)  # the budget is short: retried as room frees
        else:
            self._starved.discard(ss)
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

    def _acks_now(self) -> None:
        """The data port read everything that had arrived: one ACK per session that
        landed something (messages read in one run share it)."""
        due, self._ack_now = self._ack_now, []
        for ss in due:
            if ss.ack_due and not ss.dead:
                self._send_credit(ss, now=True)

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
                self._loop.call_soon(self._ack_if_due, ss)

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
            ss.ack_timer = self._loop.call_later(_ACK_DELAY_S, self._ack_if_due, ss)

    def _ack_if_due(self, ss: _ServerSession) -> None:
        ss.ack_timer = None
        if ss.ack_due:
            self._send_credit(ss)

    def _unpause_credit(self, ss: _ServerSession, xfer: int) -> None:
        if ss.ledger is not None and ss.ledger.paused_for == xfer:
            ss.ledger.paused_for = 0
            self._ack_soon(ss)

    def collected(self, peer: PeerRef, tensor_id: str) -> None:
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
        missing = [t for t in msg.tensor_ids if t not in self.engine._published]
        if missing:
            self._reply(
                ss,
                ss.sess.send(
                    GetReply(msg.req, "not_published", f"{missing[0]!r} is not published")
                ),
            )
            return
        # the reply goes over this engine's open session to the requester when there is
        # one (keyed by the engine id it announced, not by the address it was reached
        # at): a second session would get a private identity there, and the tensor
        # would land where the requester's GET never looks
        to = self.engine._session_address(ss.trace_id) or msg.reply_to
        items = self.engine._claim_published(msg.tensor_ids, to)
        self._spawn(self._serve_get(ss, msg, to, items))

    async def _serve_get(
        self, ss: _ServerSession, msg: Get, to: str, items: list[tuple[str, torch.Tensor]]
    ) -> None:
        ss.gets += 1
        self._gets_serving += 1
        try:
            await self.engine._transfer(to, self.engine._stage(items), None)
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
        if ss.ack_timer is not None:
            ss.ack_timer.cancel()
            ss.ack_timer = None
        self._admission.close(ss.queued)  # before anything below may pump the queue
        ss.inbox.clear()
        if lost:
            self._stats.peers_lost += 1
        self._servers.pop(ss.rid, None)
        self._tokens.pop(ss.token, None)
        self._starved.discard(ss)
        if ss.peer is not None and self._by_peer.get(ss.peer.engine_id) is ss:
            del self._by_peer[ss.peer.engine_id]
        if ss.ledger is not None:
            self._store.reserved -= ss.ledger.credit_bytes  # unspent credit goes back
            self._store.credit_n -= ss.ledger.credit_tensors
            ss.ledger.credit_bytes = ss.ledger.credit_tensors = 0
        if ss.data_rid is not None:
            self._data_rids.pop(ss.data_rid, None)
        for fd in ss.fds:
            if self._fd_sessions.get(fd) is ss:
                del self._fd_sessions[fd]
                if lost and not self.engine._closed:
                    # a peer judged dead or hostile: its connections must not linger
                    # (after a moment, so that an ERROR queued for it still leaves)
                    self._hang_up(fd, after=0.05)
        sink = ss.sink
        self._cleanup(lambda: sink.abort(exc, _CANCEL_SLICE // 4))
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
        self.pump_queue()

    def _reclaim_unbound(self, now: float) -> None:
        """Hang up connections that have not opened a session within the connect deadline."""
        limit = self.config.timeouts.connect
        for fd, (at, name) in list(self._unbound.items()):
            if now - at > limit and fd not in self._fd_sessions:
                self._unbind(fd)
                self._count_error("no_hello")
                _shutdown_fd(fd, name)
