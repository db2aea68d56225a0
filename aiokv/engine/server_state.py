"""The server side's shared state: its sessions, their indexes, its sockets and bounds.

:class:`_ServerState` is the one state object every part of
:class:`~aiokv.engine.server._Server` works on: the sessions' indexes (by routing id,
data routing id, token, descriptor, peer), the sessions starved of credit, the
admission queue and per-peer bounds, the control ROUTER, the data port and its ZAP
handler, and the reply path. The parts are :mod:`aiokv.engine.server_connections`
(connections and their descriptors), :mod:`aiokv.engine.server_granting` (admission,
grants, credit, ACKs, landing) and :mod:`aiokv.engine.server` (lifecycle, control
messages, GET serving, dropping a session); each sees the server only as a
:class:`SessionDropper`. :class:`_ServerSession` is one peer's session, :class:`_InXfer`
one transfer it was granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from aiokv._config import EngineConfig
from aiokv._runtime.deadlines import MAX_FRAMES_PER_MESSAGE
from aiokv._runtime.zmqerr import channel_error
from aiokv._runtime.zsock import LoopSocket, Outbox
from aiokv.engine.interfaces import ServerOwner
from aiokv.engine.statistics import EngineStatistics
from aiokv.engine.store import PeerRef, ReceiveStore
from aiokv.protocol.admission import AdmissionQueue, PeerBounds, PeerQueue
from aiokv.protocol.codec import Codec
from aiokv.protocol.credit import CreditLedger
from aiokv.protocol.messages import Message, Reserve, TensorSpec
from aiokv.protocol.session import Role, Session
from aiokv.transport.base import DeviceSink, MessageSink
from aiokv.transport.tcp import TcpSink

__all__: list[str] = []

#: granted, not yet landed transfers of one session (zero-byte ones cost no budget)
_MAX_GRANTED_PER_SESSION = 16384


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

    def __init__(
        self, st: _ServerState, server: SessionDropper, rid: bytes, user: str | None
    ) -> None:
        self.rid = rid
        self.user = user  # CURVE public key of the peer, when CURVE is on
        self.trace_id = ""  # the engine id the peer announced (aiokv._runtime.trace joins on it)
        self.sess = Session(Role.SERVER, st.codec)
        self.peer: PeerRef | None = None
        self.token = secrets.token_bytes(16)
        self.data_rid: bytes | None = None
        self.data_authed = False  # a data connection passed ZAP with this session's token
        self.sink: MessageSink = TcpSink()
        self.nccl: DeviceSink | None = None
        self.granted: dict[int, _InXfer] = {}
        # reservations waiting for room, oldest first
        # RESERVEs waiting for room, in the engine's AdmissionQueue
        self.queued: PeerQueue[Reserve] = PeerQueue(owner=self)
        self.expired: set[int] = set()  # grants this end gave up on (late data is dropped)
        self.last_recv = time.monotonic()
        self.dead = False
        self.outbox = Outbox(
            st.router,
            lambda exc: server.drop_server(
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


class SessionDropper(Protocol):
    """What the server's parts use of the server itself: dropping a session (its
    indexes, its transfers in flight, its connections)."""

    def drop_server(self, ss: _ServerSession, exc: BaseException, *, lost: bool) -> None: ...


class _ServerState:
    """The state the server's parts share, and its reply path (see the module)."""

    def __init__(
        self,
        owner: ServerOwner,
        config: EngineConfig,
        codec: Codec,
        store: ReceiveStore,
        stats: EngineStatistics,
    ) -> None:
        self.owner = owner  # lifecycle state, published tensors, sending a GET's reply
        self.config = config
        self.codec = codec
        self.store = store
        self.stats = stats
        self.loop: asyncio.AbstractEventLoop  # bound by the server's bind()
        self.router: LoopSocket = None  # type: ignore[assignment]
        self.data_port = 0
        self.zap: LoopSocket | None = None  # the data port's ZAP handler (no CURVE)
        self.servers: dict[bytes, _ServerSession] = {}
        self.data_rids: dict[bytes, _ServerSession] = {}
        self.tokens: dict[bytes, _ServerSession] = {}
        self.fd_sessions: dict[int, _ServerSession] = {}
        self.by_peer: dict[str, _ServerSession] = {}  # live sessions by store identity
        self.starved: set[_ServerSession] = set()  # credit cut short by the budget
        # reservations waiting for room, every session's (see aiokv.protocol.admission)
        self.admission: AdmissionQueue[Reserve] = AdmissionQueue()
        lim = config.limits
        self.bounds = PeerBounds(
            budget_bytes=lim.store_bytes,
            max_queued=lim.max_pending_reserves,
            max_granted=_MAX_GRANTED_PER_SESSION,
            # one session's share of the store's tensor count (empty tensors cost no bytes)
            max_tensors_in_flight=max(lim.store_tensors // 4, lim.max_tensors_per_transfer),
            max_queued_tensors=max(lim.store_tensors // 4, lim.max_tensors_per_transfer),
            own_queued_tensors=lim.max_tensors_per_transfer,
        )

    def reply(self, ss: _ServerSession, data: bytes, now: bool = False) -> None:
        """Queue a control message to ``ss``; one zmq message per session per loop pass
        (``now``: the caller flushes at once)."""
        ss.outbox.put([data], now=now)

    def reply_raw(self, rid: bytes, msg: Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.router.send([rid, self.codec.encode(msg)])
