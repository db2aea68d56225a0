"""The server side of sessions: this engine receives.

:class:`_Server` owns the listening sockets (the control ROUTER, the data ROUTER
and, without CURVE, the data port's ZAP handler), every peer's
:class:`~aiokv.engine.server_state._ServerSession` and their indexes, the admission
queue and per-peer bounds, standing credit and its ACKs, landing, GET serving, and
the server half of housekeeping. It owns three parts, one concern each, as plain
objects: ``state``, the one :class:`~aiokv.engine.server_state._ServerState` they all
work on; ``connections``, a :class:`~aiokv.engine.server_connections._Connections`
(who may connect, hang-ups, the caps on connections without a session); ``granting``,
a :class:`~aiokv.engine.server_granting._Granting` (admission, grants, credit, ACKs,
landing, teardown slices). The parts see the server as a
:class:`~aiokv.engine.server_state.SessionDropper` and the connections see the
granting part as a :class:`~aiokv.engine.server_connections.Landing`. This module
holds the lifecycle, the control port, NCCL set-up, GET serving and dropping a
session. The engine hands it what it needs (config, codec, store, statistics; the
loop and zmq contexts at start), and the server holds the engine as a
:class:`~aiokv.engine.interfaces.ServerOwner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import zmq
import zmq.asyncio

from aiokv._config import EngineConfig, parse_address
from aiokv._exceptions import AiokvError, PeerLostError, RemoteProtocolError
from aiokv._runtime.deadlines import MAX_FRAMES_PER_MESSAGE
from aiokv._runtime.zsock import LoopSocket, max_msg_size, monitor_socket
from aiokv.engine.interfaces import ServerOwner
from aiokv.engine.server_connections import _DATA_DOMAIN, _MAX_FIRST_FRAME, _Connections
from aiokv.engine.server_granting import _CANCEL_SLICE, _Granting
from aiokv.engine.server_state import _ServerSession, _ServerState
from aiokv.engine.statistics import EngineStatistics
from aiokv.engine.store import ReceiveStore
from aiokv.protocol.codec import Codec
from aiokv.protocol.messages import (
    DATA_FRAME_BYTES,
    Bye,
    ErrorMsg,
    Failed,
    Get,
    GetReply,
    Message,
    NcclReady,
    NcclSetup,
    Ping,
    Pong,
    Reserve,
    Withdraw,
)
from aiokv.protocol.session import SessionState

__all__: list[str] = []

log = logging.getLogger("aiokv")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_MAX_GETS_PER_SESSION = 16
_MAX_GETS_SERVING = 64
# Control frames (docs/reliability.md, "Floods"): one session's frames are handled for at
# most _SLICE_S at a time; what is left waits in its inbox and sessions with a backlog take
# turns (at most _TURNS_S per loop pass), so one message of thousands of frames -- or ten
# sessions sending one each -- never holds the loop, and an established peer's frames
# wait for one turn of each other session, not for their whole backlog.
_SLICE_S = 0.001
_TURNS_S = 0.002
#: a session with more control frames (or bytes of them) than this waiting to be
#: handled is flooding
_MAX_INBOX_FRAMES = 64 * MAX_FRAMES_PER_MESSAGE
_MAX_INBOX_BYTES = 16 << 20


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
        owner: ServerOwner,
        config: EngineConfig,
        codec: Codec,
        store: ReceiveStore,
        stats: EngineStatistics,
    ) -> None:
        # the parts: one state object, the connections, admission and granting
        self.state = st = _ServerState(owner, config, codec, store, stats)
        self.granting = _Granting(st, self)
        self.connections = _Connections(st, self, self.granting)
        self._owner = owner
        self.config = config
        self._store = store
        self._stats = stats
        self._reply = st.reply
        self._reply_raw = st.reply_raw
        self._count_error = owner._count_error
        self._spawn = owner._spawn
        self._get_poller = owner._get_poller
        self._ctx: zmq.asyncio.Context = None  # type: ignore[assignment]
        self._sctx: zmq.Context[Any] = None  # type: ignore[assignment]
        # data connections: a port of their own, entered only after authentication
        self._data_router: LoopSocket = None  # type: ignore[assignment]
        self._data_mon: zmq.asyncio.Socket = None  # type: ignore[assignment]
        self._router_mon: zmq.asyncio.Socket = None  # type: ignore[assignment]
        self._auth: Any = None
        self._gets_serving = 0
        self._turns: deque[_ServerSession] = deque()  # sessions with an inbox, in turn
        self._turns_due = False  # _take_turns is scheduled
        # what each control message a session lets through does: one look-up per message.
        # (HELLO opens a session in _on_new_connection; a DATA header that came on the
        # control connection has no data with it and is ignored, as it always was.)
        self._handlers: dict[type[Message], Callable[[_ServerSession, Any], None]] = {
            Reserve: self.granting.on_reserve,
            Withdraw: self.granting.on_withdraw,
            Ping: self._on_ping,
            Get: self._on_get,
            Failed: self.granting.on_failed,
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
        self.state.loop, self._ctx, self._sctx = loop, ctx, sctx
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
            self.state.zap = LoopSocket(zap, self.connections.on_zap)
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
            if self.state.zap is not None:
                self.state.zap.close(0)
            if self._auth is not None:
                self._auth.stop()
            raise
        ep = bytes(r.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self.state.data_port = int(bytes(d.getsockopt(zmq.LAST_ENDPOINT)).decode().rsplit(":", 1)[1])
        # Connection events, so a peer whose process died is dropped at once rather
        # than after its heartbeat timeout.
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        self._router_mon = monitor_socket(r, self._ctx, events)
        self._data_mon = monitor_socket(d, self._ctx, events)
        self.state.router = LoopSocket(r, self._on_router_frames, self._on_router_error)
        self._data_router = LoopSocket(
            d, self.connections.on_data_frames, self._on_router_error, on_drained=self.granting.acks_now
        )
        return f"{host}:{ep.rsplit(':', 1)[1]}"

    def tasks(self) -> list[asyncio.Task[None]]:
        """The connection monitors of both ports (the engine cancels them at close)."""
        return [
            asyncio.create_task(self.connections.router_watch(self._router_mon), name="aiokv-router-monitor"),
            asyncio.create_task(self.connections.router_watch(self._data_mon), name="aiokv-data-monitor"),
        ]

    def close_sessions(self, exc: BaseException) -> None:
        """Say BYE to every peer and drop its session (the engine is closing)."""
        for ss in list(self.state.servers.values()):
            if ss.sess.state is SessionState.OPEN:
                with contextlib.suppress(Exception):
                    self._reply(ss, ss.sess.send(Bye()))
            self.drop_server(ss, exc, lost=False)

    def close_sockets(self) -> None:
        """Close the listening sockets (after the monitor tasks ended)."""
        for rs, mon in ((self.state.router, self._router_mon), (self._data_router, self._data_mon)):
            with contextlib.suppress(zmq.ZMQError):
                rs.sock.disable_monitor()
            mon.close(linger=0)
            rs.close(linger=min(200, int(self.config.timeouts.linger * 1000)))
        if self.state.zap is not None:
            self.state.zap.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.connections.stop()

    def statistics(self, s: EngineStatistics) -> list[Any]:
        """Fill the server side's figures into ``s``; the sessions' NCCL communicators."""
        servers = self.state.servers.values()
        ledgers = [ss.ledger for ss in servers if ss.ledger is not None]
        s.credit_bytes = sum(g.credit_bytes for g in ledgers)
        s.credit_tensors = sum(g.credit_tensors for g in ledgers)
        if s.store is not None:
            s.store.reserved_bytes -= s.credit_bytes
        s.credit_starved = len(self.state.starved)
        s.server_sessions = len(self.state.servers)
        s.queued_reservations = sum(len(ss.queued) for ss in servers)
        return [ss.nccl.comm for ss in servers if ss.nccl is not None]

    def resolve_peer(self, addr: str) -> str | None:
        """The store identity of the live session that holds listen address ``addr``."""
        for ss in self.state.servers.values():
            if ss.peer is not None and ss.peer.address == addr:
                return ss.peer.engine_id
        return None

    def housekeep(self, now: float) -> None:
        """The server half of the engine's housekeeping tick."""
        T = self.config.timeouts
        for ss in list(self.state.servers.values()):
            if ss.granted:
                self.granting.expire_grants(ss, now)
            if ss.credit_held:
                self.granting.forget_expired_credit(ss, now)
            # frames of its still wait in the inbox: this end is behind, the peer is not silent
            if ss.inbox or now - ss.last_recv <= T.heartbeat_timeout:
                ss.suspect = False
            elif ss.suspect:  # second look, as for client sessions
                self.drop_server(ss, PeerLostError(f"no heartbeat from {ss.name}"), lost=True)
            else:
                ss.suspect = True
        if self._store.expire(now):
            self.granting.pump_queue()
        self.connections.reclaim_unbound(now)

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

    def _on_router_frames(self, parts: list[zmq.Frame]) -> None:
        try:
            self._on_router_message(parts)
        except Exception as exc:  # the loop must survive anything a peer sends
            self._count_error("internal")
            log.exception("aiokv: error handling a message: %s", exc)

    def _on_router_error(self, exc: zmq.ZMQError) -> None:
        if not self._owner._closed:
            log.warning("aiokv: router socket error: %s", exc)

    def _on_router_message(self, parts: list[zmq.Frame]) -> None:
        rid = parts[0].bytes
        if len(parts) < 2:
            self._count_error("malformed")
            return
        ss = self.state.servers.get(rid)
        frames = parts[1:]
        if ss is None:
            # a new connection: its first message must be one HELLO frame
            if len(frames) != 1:
                self.connections.refuse_connection(
                    rid, frames[0], "malformed", "the first message is one HELLO frame"
                )
                return
            if len(frames[0]) > _MAX_FIRST_FRAME:
                self.connections.refuse_connection(
                    rid, frames[0], "frame_too_large", "a first message over the HELLO limit"
                )
                return
            self.connections.on_new_connection(rid, frames[0])
            return
        if len(frames) > 4 * MAX_FRAMES_PER_MESSAGE:
            self._count_error("malformed")
            self._reply_raw(rid, ErrorMsg("protocol", "too many frames in one message"))
            self.drop_server(ss, RemoteProtocolError("too many frames"), lost=True)
            return
        ss.last_recv = time.monotonic()
        if ss.inbox:  # earlier frames still wait for their turn: these go behind them
            ss.inbox_bytes += sum(len(f) for f in frames)
            if len(ss.inbox) + len(frames) > _MAX_INBOX_FRAMES or ss.inbox_bytes > _MAX_INBOX_BYTES:
                self._count_error("flood")
                self._reply_raw(rid, ErrorMsg("protocol", "too many control frames waiting"))
                self.drop_server(ss, RemoteProtocolError("control frame flood"), lost=True)
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
            self.drop_server(ss, exc, lost=True)
            return
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(ss, msg)

    def _wait_turn(self, ss: _ServerSession) -> None:
        self._turns.append(ss)
        if not self._turns_due:
            self._turns_due = True
            self.state.loop.call_soon(self._take_turns)

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
            self.state.loop.call_soon(self._take_turns)

    def _on_ping(self, ss: _ServerSession, msg: Ping) -> None:
        self._reply(ss, ss.sess.send(Pong(msg.nonce)))

    def _on_bye(self, ss: _ServerSession, msg: Bye | ErrorMsg) -> None:
        self.drop_server(ss, PeerLostError(f"peer {ss.name} closed the session"), lost=False)

    def _on_nccl_setup(self, ss: _ServerSession, msg: NcclSetup) -> None:
        if not self._owner._nccl_ok or ss.nccl is not None:
            why = (
                self._owner._nccl_why
                if not self._owner._nccl_ok
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

    # ------------------------------------------------------------------ GET serving

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
        missing = [t for t in msg.tensor_ids if not self._owner._is_published(t)]
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
        to = self._owner._session_address(ss.trace_id) or msg.reply_to
        items = self._owner._claim_published(msg.tensor_ids, to)
        self._spawn(self._serve_get(ss, msg, to, items))

    async def _serve_get(
        self, ss: _ServerSession, msg: Get, to: str, items: list[tuple[str, torch.Tensor]]
    ) -> None:
        ss.gets += 1
        self._gets_serving += 1
        try:
            await self._owner._transfer(to, self._owner._stage(items), None)
            code, detail = "ok", ""
            self._stats.gets_served += 1
        except AiokvError as exc:
            code, detail = "internal", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            ss.gets -= 1
            self._gets_serving -= 1
        if not ss.dead and ss.sess.state is SessionState.OPEN:
            self._reply(ss, ss.sess.send(GetReply(msg.req, code, detail)))

    # ------------------------------------------------------------------ dropping a session

    def drop_server(self, ss: _ServerSession, exc: BaseException, *, lost: bool) -> None:
        if ss.dead:
            return
        ss.dead = True
        if ss.ack_timer is not None:
            ss.ack_timer.cancel()
            ss.ack_timer = None
        self.state.admission.close(ss.queued)  # before anything below may pump the queue
        ss.inbox.clear()
        if lost:
            self._stats.peers_lost += 1
        self.state.servers.pop(ss.rid, None)
        self.state.tokens.pop(ss.token, None)
        self.state.starved.discard(ss)
        if ss.peer is not None and self.state.by_peer.get(ss.peer.engine_id) is ss:
            del self.state.by_peer[ss.peer.engine_id]
        if ss.ledger is not None:
            self._store.reserved -= ss.ledger.credit_bytes  # unspent credit goes back
            self._store.credit_n -= ss.ledger.credit_tensors
            ss.ledger.credit_bytes = ss.ledger.credit_tensors = 0
        if ss.data_rid is not None:
            self.state.data_rids.pop(ss.data_rid, None)
        for fd in ss.fds:
            if self.state.fd_sessions.get(fd) is ss:
                del self.state.fd_sessions[fd]
                if lost and not self._owner._closed:
                    # a peer judged dead or hostile: its connections must not linger
                    # (after a moment, so that an ERROR queued for it still leaves)
                    self.connections.hang_up(fd, after=0.05)
        sink = ss.sink
        self.granting.cleanup(lambda: sink.abort(exc, _CANCEL_SLICE // 4))
        if ss.nccl is not None:
            ss.nccl.abort(exc)
        if ss.peer is not None:
            err = exc if isinstance(exc, AiokvError) else PeerLostError(str(exc))
            if not isinstance(err, PeerLostError):
                err = PeerLostError(f"peer {ss.name} lost: {err}")
            # only this session's own transfers in flight (no scan of the whole store), in
            # slices: a session with tens of thousands pending must not stall the loop
            ids = [s.tensor_id for inx in ss.granted.values() for s in inx.specs]
            self.granting.cancel_in_slices(ss.peer, ids, err)
        ss.granted.clear()
        ss.sess.close()
        self.granting.pump_queue()
