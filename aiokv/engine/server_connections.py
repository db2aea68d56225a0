"""The server side's connections: who may connect, and hanging up those that may not.

:class:`_Connections` is a part :class:`~aiokv.engine.server._Server` owns: the data
port's ZAP handler and its DATA_HELLO (a data connection enters only with its session's
token or key), a new control connection's HELLO (identity claims, the layout check,
WELCOME), the connection monitors' events (a session is dropped the moment its
connection closes), and the caps on accepted connections that have no session yet
(hung up, oldest first, by their file descriptors). It works on the server's
:class:`~aiokv.engine.server_state._ServerState`, sees the server as a
:class:`~aiokv.engine.server_state.SessionDropper` and the granting part as a
:class:`Landing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from typing import Protocol

import zmq
import zmq.asyncio

from aiokv._exceptions import PeerLostError, RemoteProtocolError
from aiokv._runtime.deadlines import _DATA_CAP, _PLAIN_USER
from aiokv.engine.server_state import SessionDropper, _ServerSession, _ServerState
from aiokv.engine.store import PeerRef
from aiokv.protocol.codec import TOKEN_BYTES, WireError
from aiokv.protocol.credit import CreditLedger
from aiokv.protocol.messages import PROTOCOL_VERSION, DataHello, ErrorMsg, Hello, Message, Welcome

__all__: list[str] = []

log = logging.getLogger("aiokv")

#: a new connection's first message is one HELLO: anything larger is refused (and hung up)
_MAX_FIRST_FRAME = 64 * 1024
#: ZAP domain of the data port without CURVE (this engine's own ZAP handler answers it)
_DATA_DOMAIN = b"aiokv-data"
#: at most this many accepted connections without a session (less under a low fd limit),
#: hung up oldest first once they had _UNBOUND_GRACE_S to say HELLO (_cap_unbound)
_MAX_UNBOUND = 512
_UNBOUND_GRACE_S = 0.05


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


class Landing(Protocol):
    """What the connections part uses of the granting part: a data connection's
    messages land there, and a new session's credit window leaves with its WELCOME."""

    def on_data(self, ss: _ServerSession, frames: list[zmq.Frame]) -> None: ...

    def send_credit(self, ss: _ServerSession, now: bool = False) -> None: ...


class _Connections:
    """Connections, their descriptors and their first messages (see the module)."""

    def __init__(self, st: _ServerState, server: SessionDropper, landing: Landing) -> None:
        self._st = st  # the sessions' indexes, the sockets, the loop (shared with the other parts)
        self._server = server
        self._landing = landing
        self._on_data = landing.on_data  # (a data message's path: bound once)
        self._owner = st.owner
        self.config = st.config
        self._codec = st.codec
        self._reply = st.reply
        self._reply_raw = st.reply_raw
        self._count_error = st.owner._count_error
        self._claims = itertools.count(1)
        # accepted connections without a session yet, oldest first: fd -> (accepted at,
        # peer name); how many per source address; the caps (see _on_accepted)
        self._unbound: dict[int, tuple[float, str | None]] = {}
        self._unbound_hosts: dict[str, int] = {}
        self._cap_timer: asyncio.TimerHandle | None = None  # _cap_unbound looks again
        self._max_unbound, self._max_unbound_host = _unbound_caps()

    def stop(self) -> None:
        """The server closes: the caps look no more."""
        if self._cap_timer is not None:
            self._cap_timer.cancel()

    # ------------------------------------------------------------------ data port

    def on_zap(self, parts: list[zmq.Frame]) -> None:
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
        ss = self._st.tokens.get(token)
        if ss is None or ss.dead or ss.data_authed or ss.data_rid is not None:
            return None
        return ss

    def _zap_reply(self, rid: bytes, request_id: bytes, code: bytes, user: bytes) -> None:
        if self._st.zap is None:
            return
        text = b"OK" if code == b"200" else b"unknown or used data token"
        with contextlib.suppress(zmq.ZMQError):
            self._st.zap.send([rid, b"", b"1.0", request_id, code, text, user, b""])

    def on_data_frames(self, parts: list[zmq.Frame]) -> None:
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
        ss = self._st.data_rids.get(rid)
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
        ss = self._st.tokens.get(msg.token) if isinstance(msg, DataHello) else None
        if (
            ss is None
            or ss.data_rid is not None
            or ss.dead
            # the token of the handshake (PLAIN) or the key (CURVE) must be the session's
            or (ss.user if self.config.curve is not None else ss.token.hex()) != user
        ):
            self._count_error("bad_token")
            fd = _frame_fd(frame)
            if fd is not None and fd not in self._st.fd_sessions:
                self.hang_up(fd)
            return
        del self._st.tokens[ss.token]
        ss.data_rid = rid
        self._st.data_rids[rid] = ss
        self._bind_fd(ss, frame)

    # ------------------------------------------------------------------ connections

    async def router_watch(self, mon: zmq.asyncio.Socket) -> None:
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
                    ss = self._st.fd_sessions.get(fd)
                    if ss is not None and not reused:
                        self._server.drop_server(
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
        if fd in self._st.fd_sessions:
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
        if self._owner._closed:
            return
        unbound, hosts = self._unbound, self._unbound_hosts
        cap, cap_host = self._max_unbound, self._max_unbound_host
        over = {h for h, n in hosts.items() if n > cap_host}
        if not over and len(unbound) <= cap:
            return
        edge = time.monotonic() - _UNBOUND_GRACE_S
        for fd, (at, name) in list(unbound.items()):  # oldest first
            if at > edge:  # the rest are new: looked at again once their grace is over
                self._cap_timer = self._st.loop.call_later(at - edge + 0.001, self._cap_unbound)
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
        self._st.fd_sessions[fd] = ss

    def refuse_connection(self, rid: bytes, frame: zmq.Frame, code: str, detail: str) -> None:
        """A connection that did not open a session properly: answer, count, hang up."""
        self._count_error(code)
        self._reply_raw(rid, ErrorMsg("protocol", detail[:200]))
        fd = _frame_fd(frame)
        if fd is not None and fd not in self._st.fd_sessions:
            self.hang_up(fd, after=0.05)  # let the ERROR leave first

    def hang_up(self, fd: int, after: float = 0.0) -> None:
        """Shut a connection zmq owns, now or ``after`` seconds; the remote end seen at
        accept (or now) guards against the descriptor naming another connection by then."""
        seen = self._unbind(fd)
        name = seen[1] if seen else _peer_name(fd)
        if after:
            asyncio.get_running_loop().call_later(after, _shutdown_fd, fd, name)
        else:
            _shutdown_fd(fd, name)

    # ------------------------------------------------------------------ HELLO

    def on_new_connection(self, rid: bytes, frame: zmq.Frame) -> None:
        try:
            msg = self._codec.decode(frame.buffer)
        except WireError as exc:
            self.refuse_connection(rid, frame, exc.code, str(exc))
            return
        user = None
        if self.config.curve is not None:
            with contextlib.suppress(zmq.ZMQError):
                uid = frame.get("User-Id")
                user = str(uid) if uid is not None else None
        if not isinstance(msg, Hello):
            self.refuse_connection(rid, frame, "no_session", f"{msg.NAME} before HELLO")
            return
        ss = _ServerSession(self._st, self._server, rid, user)
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
        self._st.servers[rid] = ss
        self._bind_fd(ss, frame)
        self._st.tokens[ss.token] = ss
        self._st.by_peer[ss.peer.engine_id] = ss
        if "credit" in msg.capabilities:
            lim = self.config.limits
            ss.ledger = CreditLedger(
                min(lim.store_bytes // 4, lim.credit_bytes),
                min(lim.store_tensors // 4, lim.credit_tensors),
            )
        w = Welcome(
            PROTOCOL_VERSION,
            self._owner.engine_id,
            self._owner.address,
            (*self._owner._capabilities(), f"{_DATA_CAP}{self._st.data_port}"),
            self.config.layout,
            ss.token,
        )
        self._reply(ss, ss.sess.send(w))
        if ss.ledger is not None:
            self._landing.send_credit(ss)  # the window travels in the same zmq message as WELCOME

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
        live_ids = {s.peer.engine_id for s in self._st.servers.values() if s.peer is not None}
        live_addrs = {s.peer.address for s in self._st.servers.values() if s.peer is not None}
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

    # ------------------------------------------------------------------ upkeep

    def reclaim_unbound(self, now: float) -> None:
        """Hang up connections that have not opened a session within the connect deadline."""
        limit = self.config.timeouts.connect
        for fd, (at, name) in list(self._unbound.items()):
            if now - at > limit and fd not in self._st.fd_sessions:
                self._unbind(fd)
                self._count_error("no_hello")
                _shutdown_fd(fd, name)
