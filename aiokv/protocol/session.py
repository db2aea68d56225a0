"""Per-peer session state machine, sans-IO.

One :class:`Session` is one end of one control connection. The application
hands it every message it wants to send (:meth:`Session.send`, which checks
the transition and returns the bytes) and every frame that arrives
(:meth:`Session.receive`, which decodes, checks the transition and returns
the message). Illegal moves raise :class:`~aiokv.LocalProtocolError` on the
way out and :class:`~aiokv.RemoteProtocolError` on the way in; the state is
left unchanged when either is raised.

The transitions are data (:data:`CONN_TRANSITIONS`, :data:`XFER_TRANSITIONS`),
drawn here as a table. ``c`` is the client (data source), ``s`` the server
(data sink); each row is *who sends* · *message* · *state before* -> *after*.

Connection::

    c  HELLO       IDLE        -> HELLO_SENT   (client)   IDLE -> OPEN (server, on receipt,
    s  WELCOME     (server sends it while OPEN; client HELLO_SENT -> OPEN)      after WELCOME)
    *  BYE/ERROR   any         -> CLOSED

Transfer (keyed by ``xfer``, numbered by the client)::

    c  RESERVE     (new)                 -> RESERVED
    s  GRANT       RESERVED              -> GRANTED      seq = server's next grant number
    s  GRANT       WITHDRAWING           -> GRANTED      (grant crossed the withdraw:
                                                          the transfer is committed)
    s  REFUSE      RESERVED|WITHDRAWING  -> (end)
    c  WITHDRAW    RESERVED              -> WITHDRAWING
    s  WITHDRAWN   WITHDRAWING           -> (end)
    c  DATA        GRANTED               -> SENT         only in seq order (per data plane)
    s  DONE        SENT                  -> (end)
    *  FAILED      any live state        -> (end)

The server keeps the mirror image: a WITHDRAW that meets a GRANTED transfer
leaves it GRANTED (its data will still come, in order, and is discarded by
the engine); one that meets RESERVED ends it with WITHDRAWN.

A client FAILED ends a GRANTED or SENT transfer (the sender gave up on it: the
server drops its data, late or not). It may cross the server's DONE or FAILED
for the same transfer: the server ignores a FAILED for a transfer it ended, and
the client one DONE or FAILED for a transfer it ended with FAILED.

The *one order per peer* rule lives here: the server numbers grants
0, 1, 2, ... and the client may post DATA only for the next number, so both
ends post their halves of the data plane in the same order whatever the
concurrency above them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .._exceptions import LocalProtocolError, RemoteProtocolError
from .codec import Codec, WireError
from .messages import (
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
    Refuse,
    Reserve,
    Welcome,
    Withdraw,
    Withdrawn,
)

__all__ = ["CONN_TRANSITIONS", "XFER_TRANSITIONS", "Role", "Session", "SessionState", "XferState"]


class _FastEnum(enum.Enum):
    # Members are singletons compared by identity: hash them by identity too.
    # Enum's own __hash__ runs Python code on every transition-table lookup
    # (~10 % of the engine's CPU per small transfer, profiled).
    __hash__ = object.__hash__


class Role(_FastEnum):
    CLIENT = "client"
    SERVER = "server"


class SessionState(_FastEnum):
    IDLE = "IDLE"
    HELLO_SENT = "HELLO_SENT"
    OPEN = "OPEN"
    CLOSED = "CLOSED"


class XferState(_FastEnum):
    RESERVED = "RESERVED"
    WITHDRAWING = "WITHDRAWING"
    GRANTED = "GRANTED"
    SENT = "SENT"
    END = "END"  # not stored: the transfer is forgotten


C, S = Role.CLIENT, Role.SERVER
IDLE, HS, OPEN = SessionState.IDLE, SessionState.HELLO_SENT, SessionState.OPEN

# (role of the sender, message type, role of this end is implied by direction)
# -> {state before: state after}, from the point of view of BOTH ends.
CONN_TRANSITIONS: dict[tuple[Role, type[Message]], dict[Role, dict[SessionState, SessionState]]] = {
    (C, Hello): {C: {IDLE: HS}, S: {IDLE: OPEN}},
    (S, Welcome): {C: {HS: OPEN}, S: {OPEN: OPEN}},
}

R, W, G, SE, E = (
    XferState.RESERVED,
    XferState.WITHDRAWING,
    XferState.GRANTED,
    XferState.SENT,
    XferState.END,
)

# Message types that act on one transfer: (sender role, type) -> {before: after}.
# ``None`` as "before" means the transfer must not exist yet.
XFER_TRANSITIONS: dict[tuple[Role, type[Message]], dict[XferState | None, XferState]] = {
    (C, Reserve): {None: R},
    (S, Grant): {R: G, W: G},
    (S, Refuse): {R: E, W: E},
    (C, Withdraw): {R: W, G: G},
    (S, Withdrawn): {W: E},
    (C, DataHeader): {G: SE},
    (S, Done): {SE: E},
    (C, Failed): {R: E, W: E, G: E, SE: E},
    (S, Failed): {R: E, W: E, G: E, SE: E},
}

# Session-level messages allowed while OPEN, by sender role.
OPEN_MESSAGES: dict[Role, frozenset[type[Message]]] = {
    C: frozenset({Get, NcclSetup, Ping, Bye, ErrorMsg}),
    S: frozenset({GetReply, NcclReady, Pong, Bye, ErrorMsg, Ack}),
}
#: open-session messages that change no state of the session: only who may send them
#: is checked (the same rule as OPEN_MESSAGES, on a shorter path; ACK is per transfer)
_PLAIN: dict[type[Message], Role] = {Ack: S, Ping: C, Pong: S}


@dataclass(slots=True)
class _Xfer:
    state: XferState
    nbytes: int = 0
    seq: int = -1
    transport: str = "tcp"


@dataclass(slots=True)
class Session:
    """One end of a control session. ``role`` is this end's role."""

    role: Role
    codec: Codec = field(default_factory=Codec)
    state: SessionState = SessionState.IDLE
    peer_hello: Hello | None = None
    peer_welcome: Welcome | None = None
    next_xfer: int = 0  # client: next transfer number to hand out
    next_grant_seq: int = 0  # server: next sequence number to grant
    # both ends: the last DATA sequence number per transport. Each data plane
    # must carry its transfers in grant order; grants are numbered across
    # transports, so each plane sees an increasing subsequence.
    last_data_seq: dict[str, int] = field(default_factory=dict)
    max_xfer_seen: int = 0  # highest transfer number RESERVEd in this session
    _xfers: dict[int, _Xfer] = field(default_factory=dict)
    # client: transfers it ended with FAILED after their GRANT (a DONE or FAILED of the
    # server's may cross it: one is expected)
    _failed_granted: set[int] = field(default_factory=set)
    _gets: set[int] = field(default_factory=set)
    _ncclsetups: set[int] = field(default_factory=set)

    # ------------------------------------------------------------------ queries
    def xfer_state(self, xfer: int) -> XferState:
        x = self._xfers.get(xfer)
        return x.state if x else XferState.END

    @property
    def live_transfers(self) -> int:
        return len(self._xfers)

    def new_xfer_id(self) -> int:
        if self.role is not Role.CLIENT:
            raise LocalProtocolError("only the client numbers transfers")
        self.next_xfer += 1
        return self.next_xfer

    # --------------------------------------------------------------- transitions
    def send(self, msg: Message) -> bytes:
        """Check that this end may send ``msg`` now, apply it, return its bytes."""
        self._apply(self.role, msg, LocalProtocolError)
        return self.codec.encode(msg)

    def note_sent(self, msg: Message) -> None:
        """Like :meth:`send` for a message that travels another way (an NCCL DATA
        header is implied by posting order): check and apply it, encode nothing."""
        self._apply(self.role, msg, LocalProtocolError)

    def receive(self, data: bytes | bytearray | memoryview) -> Message:
        """Decode a frame from the peer, check and apply it, return the message."""
        try:
            msg = self.codec.decode(data)
        except WireError:
            raise
        peer = Role.SERVER if self.role is Role.CLIENT else Role.CLIENT
        self._apply(peer, msg, RemoteProtocolError)
        return msg

    def receive_message(self, msg: Message) -> Message:
        """Apply an already-decoded message from the peer (e.g. a DATA header)."""
        peer = Role.SERVER if self.role is Role.CLIENT else Role.CLIENT
        self._apply(peer, msg, RemoteProtocolError)
        return msg

    def close(self) -> None:
        self.state = SessionState.CLOSED
        self._xfers.clear()
        self._failed_granted.clear()
        self._gets.clear()
        self._ncclsetups.clear()

    # ---------------------------------------------------------------- internals
    def _apply(
        self,
        sender: Role,
        msg: Message,
        err: type[LocalProtocolError] | type[RemoteProtocolError],
    ) -> None:
        t = type(msg)
        if t in _PLAIN and self.state is SessionState.OPEN and _PLAIN[t] is sender:
            return  # the hot path: PUT/ACK/RETURN carry no per-session state here
        if self.state is SessionState.CLOSED:
            raise err(f"{msg.NAME} on a closed session")
        if t is Bye or t is ErrorMsg:
            self.state = SessionState.CLOSED
            return
        conn = CONN_TRANSITIONS.get((sender, t))
        if conn is not None:
            after = conn[self.role].get(self.state)
            if after is None:
                raise err(f"{msg.NAME} not allowed in state {self.state.value}")
            if isinstance(msg, Hello):
                if msg.version != PROTOCOL_VERSION:
                    raise err(f"protocol version {msg.version} not supported")
                self.peer_hello = msg
            elif isinstance(msg, Welcome):
                if msg.version != PROTOCOL_VERSION:
                    raise err(f"protocol version {msg.version} not supported")
                self.peer_welcome = msg
            self.state = after
            return
        if t is DataHello:
            raise err("DATA_HELLO belongs on the data connection")
        if self.state is not SessionState.OPEN:
            raise err(f"{msg.NAME} before the session is open")
        xt = XFER_TRANSITIONS.get((sender, t))
        if xt is not None:
            self._apply_xfer(sender, msg, xt, err)
            return
        if t not in OPEN_MESSAGES[sender]:
            raise err(f"{msg.NAME} may not be sent by the {sender.value}")
        if isinstance(msg, Get):
            if msg.req in self._gets:
                raise err(f"GET {msg.req} repeated")
            self._gets.add(msg.req)
        elif isinstance(msg, GetReply):
            if msg.req not in self._gets:
                raise err(f"GET_REPLY for unknown request {msg.req}")
            self._gets.discard(msg.req)
        elif isinstance(msg, NcclSetup):
            if msg.comm in self._ncclsetups:
                raise err(f"NCCL_SETUP {msg.comm} repeated")
            self._ncclsetups.add(msg.comm)
        elif isinstance(msg, NcclReady):
            if msg.comm not in self._ncclsetups:
                raise err(f"NCCL_READY for unknown communicator {msg.comm}")
            self._ncclsetups.discard(msg.comm)

    def _apply_xfer(
        self,
        sender: Role,
        msg: Message,
        table: dict[XferState | None, XferState],
        err: type[LocalProtocolError] | type[RemoteProtocolError],
    ) -> None:
        xfer_id: int = msg.xfer  # type: ignore[attr-defined]
        x = self._xfers.get(xfer_id)
        before = x.state if x else None
        if x is None and 0 < xfer_id:
            if (
                sender is Role.CLIENT
                and isinstance(msg, (Withdraw, Failed))
                and xfer_id <= self.max_xfer_seen
            ):
                return  # it crossed this end's REFUSE/FAILED/DONE: the transfer is gone
            if sender is Role.SERVER and isinstance(msg, (Done, Failed)):
                if xfer_id in self._failed_granted:
                    self._failed_granted.discard(xfer_id)
                    return  # it crossed this end's FAILED
        if (
            sender is self.role is Role.CLIENT
            and isinstance(msg, Failed)
            and before in (XferState.GRANTED, XferState.SENT)
        ):
            if len(self._failed_granted) >= 4096:
                self._failed_granted.clear()
            self._failed_granted.add(xfer_id)
        after = table.get(before)
        if after is None:
            where = before.value if before else "no such transfer"
            raise err(f"{msg.NAME} for transfer {xfer_id} not allowed ({where})")
        if isinstance(msg, Grant):
            if msg.seq != self.next_grant_seq:
                raise err(f"GRANT seq {msg.seq}, expected {self.next_grant_seq}")
            self.next_grant_seq += 1
            assert x is not None
            x.seq = msg.seq
        elif isinstance(msg, DataHeader):
            assert x is not None
            last = self.last_data_seq.get(x.transport, -1)
            if msg.seq != x.seq or msg.seq <= last:
                raise err(
                    f"DATA for transfer {xfer_id} with seq {msg.seq}; "
                    f"granted {x.seq}, last {x.transport} data was {last}"
                )
            self.last_data_seq[x.transport] = msg.seq
        if after is XferState.END:
            del self._xfers[xfer_id]
        elif x is None:
            assert isinstance(msg, Reserve)
            self._xfers[xfer_id] = _Xfer(after, nbytes=msg.nbytes, transport=msg.transport)
            self.max_xfer_seen = max(self.max_xfer_seen, xfer_id)
        else:
            x.state = after
