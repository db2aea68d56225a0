"""The server side's shared state: its sessions, their indexes, its sockets and bounds.

:class:`_ServerBase` is what every part of :class:`~aiokv.engine.server._Server` works
on: the constructor that sets up the sessions' indexes (by routing id, data routing id,
token, descriptor, peer), the admission queue and per-peer bounds, and the reply path.
The parts are :mod:`aiokv.engine.server_connections` (connections and their
descriptors), :mod:`aiokv.engine.server_granting` (admission, grants, credit, ACKs,
landing) and :mod:`aiokv.engine.server` (lifecycle, control messages, GET serving,
dropping a session). :class:`_ServerSession` is one peer's session, :class:`_InXfer`
one transfer it was granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    def __init__(self, server: _ServerBase, rid: bytes, user: str | None) -> None:
        self.rid = rid
        self.user = user  # CURVE public key of the peer, when CURVE is on
        self.trace_id = ""  # the engine id the peer announced (aiokv._runtime.trace joins on it)
        self.sess = Session(Role.SERVER, server._codec)
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


class _ServerBase:
    """The receiving half's state and reply path (see the module)."""

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
        self._codec = codec
        self._store = store
        self._stats = stats
        self._count_error = owner._count_error
        self._spawn = owner._spawn
        self._get_poller = owner._get_poller
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

    def _reply(self, ss: _ServerSession, data: bytes, now: bool = False) -> None:
        """Queue a control message to ``ss``; one zmq message per session per loop pass
        (``now``: the caller flushes at once)."""
        ss.outbox.put([data], now=now)

    def _reply_raw(self, rid: bytes, msg: Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.send([rid, self._codec.encode(msg)])

    # the parts' calls into each other (defined by the classes that make up _Server)
    @abstractmethod
    def _drop_server(self, ss: _ServerSession, exc: BaseException, *, lost: bool) -> None: ...

    @abstractmethod
    def _on_data(self, ss: _ServerSession, frames: list[zmq.Frame]) -> None: ...

    @abstractmethod
    def _send_credit(self, ss: _ServerSession, now: bool = False) -> None: ...
