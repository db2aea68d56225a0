"""Message types of the aiokv control protocol (version 2: bounded data frames).

Every message is a frozen, slotted dataclass. On the wire a message is a
msgpack array ``[kind, field1, field2, ...]`` in the field order below; the
codec checks every field's type before a message object exists.

A session has two ends: the *client* (it connected; it is the source of the
data that flows in this session) and the *server* (the listening engine; it
is the sink). Data flows only client -> server inside one session; an engine
sends to a peer through its own client session to that peer. ``GET`` asks
the server to send the named tensors back through *its* client session to
the address in ``reply_to``.

===========  =========  ==============================================
kind         direction  meaning
===========  =========  ==============================================
HELLO        c -> s     version, engine id, listen address, capabilities, KV layout
WELCOME      s -> c     the same for the server, plus the data-connection token
DATA_HELLO   c -> s     first message on the data connection: the token
RESERVE      c -> s     ask room for a transfer of ``specs`` over ``transport``
GRANT        s -> c     room reserved; post the data as number ``seq``
REFUSE       s -> c     the transfer is refused; ``code`` says why
WITHDRAW     c -> s     the sender gives up a reservation
WITHDRAWN    s -> c     the reservation is gone (it had not been granted)
DATA         c -> s     header of a data message (TCP), followed by tensor frames
DONE         s -> c     all tensors of the transfer landed in the receive store
FAILED       both       the transfer failed; ``code`` says why
GET          c -> s     please send these published tensors to ``reply_to``
GET_REPLY    s -> c     outcome of a GET
NCCL_SETUP   c -> s     NCCL unique id for this session's communicator
NCCL_READY   s -> c     the server's side of the communicator is initialised (or not)
PUT          c -> s     v2: header of a transfer sent on standing credit (TCP), tensor frames follow
ACK          s -> c     v2: credit top-up, transfers landed (coalesced DONE), transfers refused
RETURN       c -> s     v2: unspent credit given back (data connection), before a RESERVE
PING / PONG  c <-> s    heartbeat
ERROR        both       a protocol error; the session is closed after it
BYE          both       orderly close
===========  =========  ==============================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: 2: tensors travel in frames of at most :data:`DATA_FRAME_BYTES` (1 was one frame per
#: tensor). 3: a PUT says whether its sender waits for it (``ack_now``), and ACK_REQ asks
#: for the ACK of what arrived (coalesced ACKs while streaming). A peer of another
#: version is refused at HELLO/WELCOME ("version").
PROTOCOL_VERSION = 3

#: The largest data frame on the wire. A tensor of ``n`` bytes travels as
#: ``max(1, ceil(n / DATA_FRAME_BYTES))`` frames, every one ``DATA_FRAME_BYTES`` long but
#: the last; both ends derive the count from the specs. It bounds the data port's
#: ``MAXMSGSIZE`` -- what zmq buffers for a connection that has not authenticated yet --
#: to the control port's 1 MiB; a 1 MiB tensor (the ``stream1m`` benchmark, a typical KV
#: block run) is still one frame, received zero-copy. A PUT carries only one-frame
#: tensors (docs/design.md, "Bounded data frames").
DATA_FRAME_BYTES = 1 << 20

# dtype names allowed on the wire -> bytes per element. Nothing outside this
# table is ever turned into a dtype.
ALLOWED_DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

TRANSPORTS = ("tcp", "nccl")

#: The largest single dimension a peer may declare (every dim is also < 2**48).
MAX_DIM = 1 << 40


def shape_problem(
    itemsize: int, shape: Sequence[Any], *, max_ndim: int, max_bytes: int
) -> str | None:
    """Why a tensor of this element size and shape may not be allocated, or None if it may.

    Every dim must be an int in ``0..MAX_DIM``, there may be at most ``max_ndim`` of
    them, and the *extent* -- the product of the dims with a 0 counted as 1 -- times
    ``itemsize`` must be at most ``max_bytes``. The extent is what bounds the strides
    of a contiguous tensor (torch computes them with zero dims counted as 1), so a
    shape like ``[0, 2**40, 2**40]`` is refused here although it holds no element:
    allocating it would overflow the stride computation. Numel and byte count are
    bounded by the same product.
    """
    if len(shape) > max_ndim:
        return f"shape has {len(shape)} dims, more than {max_ndim}"
    extent = itemsize
    for d in shape:
        if type(d) is not int or not (0 <= d <= MAX_DIM):
            return "shape dims must be integers in 0..2**40"
        if d:
            extent *= d
            if extent > max_bytes:  # checked per dim: the product never grows past 2**88
                break
    if extent > max_bytes:
        return f"tensor extent over the {max_bytes}-byte limit (zero dims count as 1)"
    return None


# Reason codes carried by REFUSE / FAILED / ERROR / GET_REPLY.
REFUSE_CODES = (
    "too_large",  # larger than the receiver's whole budget or a limit
    "duplicate",  # tensor id already held or in flight from this peer
    "busy",  # too many queued reservations
    "bad_spec",  # dtype/shape/byte count not acceptable
    "transport",  # the transport is not available here
    "layout_mismatch",
    "closing",  # the engine is shutting down
    "not_published",
    "peer_lost",
    "aborted",
    "timeout",
    "internal",
    "bad_reply_to",  # a GET whose reply address is not the requester's own
    "protocol",
    "version",
    "ok",
    "withdrawn",  # FAILED from the sender: it gave up on a granted transfer
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one tensor; ``nbytes`` is derived (once), never trusted."""

    tensor_id: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # computed once: the hot path asks for it several times per transfer
        object.__setattr__(self, "nbytes", self.numel * ALLOWED_DTYPES.get(self.dtype, 0))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Message:
    """Base of all messages. ``KIND`` is the wire tag."""

    __slots__ = ()
    KIND: ClassVar[int] = 0
    NAME: ClassVar[str] = "?"


@dataclass(frozen=True, slots=True)
class Hello(Message):
    KIND: ClassVar[int] = 1
    NAME: ClassVar[str] = "HELLO"
    version: int
    engine_id: str
    listen: str
    capabilities: tuple[str, ...]
    layout: dict[str, str | int] | None


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    KIND: ClassVar[int] = 2
    NAME: ClassVar[str] = "WELCOME"
    version: int
    engine_id: str
    listen: str
    capabilities: tuple[str, ...]
    layout: dict[str, str | int] | None
    token: bytes


@dataclass(frozen=True, slots=True)
class DataHello(Message):
    KIND: ClassVar[int] = 3
    NAME: ClassVar[str] = "DATA_HELLO"
    token: bytes


@dataclass(frozen=True, slots=True)
class Reserve(Message):
    KIND: ClassVar[int] = 4
    NAME: ClassVar[str] = "RESERVE"
    xfer: int
    transport: str
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass(frozen=True, slots=True)
class Grant(Message):
    KIND: ClassVar[int] = 5
    NAME: ClassVar[str] = "GRANT"
    xfer: int
    seq: int


@dataclass(frozen=True, slots=True)
class Refuse(Message):
    KIND: ClassVar[int] = 6
    NAME: ClassVar[str] = "REFUSE"
    xfer: int
    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class Withdraw(Message):
    KIND: ClassVar[int] = 7
    NAME: ClassVar[str] = "WITHDRAW"
    xfer: int


@dataclass(frozen=True, slots=True)
class Withdrawn(Message):
    KIND: ClassVar[int] = 8
    NAME: ClassVar[str] = "WITHDRAWN"
    xfer: int


@dataclass(frozen=True, slots=True)
class DataHeader(Message):
    KIND: ClassVar[int] = 9
    NAME: ClassVar[str] = "DATA"
    xfer: int
    seq: int
    count: int  # number of tensors; their frames follow (see DATA_FRAME_BYTES)


@dataclass(frozen=True, slots=True)
class Done(Message):
    KIND: ClassVar[int] = 10
    NAME: ClassVar[str] = "DONE"
    xfer: int


@dataclass(frozen=True, slots=True)
class Failed(Message):
    KIND: ClassVar[int] = 11
    NAME: ClassVar[str] = "FAILED"
    xfer: int
    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class Get(Message):
    KIND: ClassVar[int] = 12
    NAME: ClassVar[str] = "GET"
    req: int
    tensor_ids: tuple[str, ...]
    reply_to: str


@dataclass(frozen=True, slots=True)
class GetReply(Message):
    KIND: ClassVar[int] = 13
    NAME: ClassVar[str] = "GET_REPLY"
    req: int
    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class NcclSetup(Message):
    KIND: ClassVar[int] = 14
    NAME: ClassVar[str] = "NCCL_SETUP"
    comm: int
    unique_id: bytes


@dataclass(frozen=True, slots=True)
class NcclReady(Message):
    KIND: ClassVar[int] = 15
    NAME: ClassVar[str] = "NCCL_READY"
    comm: int
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Ping(Message):
    KIND: ClassVar[int] = 16
    NAME: ClassVar[str] = "PING"
    nonce: int


@dataclass(frozen=True, slots=True)
class Pong(Message):
    KIND: ClassVar[int] = 17
    NAME: ClassVar[str] = "PONG"
    nonce: int


@dataclass(frozen=True, slots=True)
class ErrorMsg(Message):
    KIND: ClassVar[int] = 18
    NAME: ClassVar[str] = "ERROR"
    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class Bye(Message):
    KIND: ClassVar[int] = 19
    NAME: ClassVar[str] = "BYE"


@dataclass(frozen=True, slots=True)
class Put(Message):
    """Protocol v2 (capability ``credit``): a transfer spent from standing credit.

    Sent on the data connection as the first frame of one zmq message whose other
    frames are the tensors: the whole transfer is one message, no round trip. Every
    tensor of a PUT fits one frame (``nbytes <= DATA_FRAME_BYTES``); a larger one takes
    the RESERVE path, whose landing may copy off the event loop.
    """

    KIND: ClassVar[int] = 20
    NAME: ClassVar[str] = "PUT"
    xfer: int
    specs: tuple[TensorSpec, ...]
    #: the sender waits for this PUT's ACK (a ``send``, or nothing else in flight):
    #: the receiver acknowledges at once. Otherwise it may gather ACKs (see
    #: docs/design.md, "ACK timing") until ACK_REQ, a count, or a short timer.
    ack_now: bool = True

    @property
    def nbytes(self) -> int:
        specs = self.specs
        return specs[0].nbytes if len(specs) == 1 else sum(s.nbytes for s in specs)


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """Protocol v2: the receiver's credit message, coalescing many transfers.

    ``window_bytes``/``window_tensors`` is the standing window of the session (a
    transfer larger than it takes the RESERVE path); ``add_*`` is new credit;
    ``done`` lists PUTs that landed, ``refused`` PUTs refused (``[xfer, code]``).
    """

    KIND: ClassVar[int] = 21
    NAME: ClassVar[str] = "ACK"
    window_bytes: int
    window_tensors: int
    add_bytes: int
    add_tensors: int
    done: tuple[int, ...]
    refused: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class Return(Message):
    """Protocol v2: the sender gives back unspent credit (on the data connection, so
    after every PUT that spent the rest) before it asks for a transfer larger than
    its window: the receiver's whole budget is then free for that reservation."""

    KIND: ClassVar[int] = 22
    NAME: ClassVar[str] = "RETURN"
    xfer: int  # the RESERVE this return makes room for
    credit_bytes: int
    credit_tensors: int


@dataclass(frozen=True, slots=True)
class AckReq(Message):
    """Protocol v3: "acknowledge what you have of mine now" -- sent on the data
    connection (so after the PUTs it concerns) when the sender starts waiting for a
    PUT it had sent without ``ack_now``, or runs out of credit."""

    KIND: ClassVar[int] = 23
    NAME: ClassVar[str] = "ACK_REQ"
    xfer: int  # the newest PUT the sender waits for


ALL_MESSAGES: tuple[type[Message], ...] = (
    Hello,
    Welcome,
    DataHello,
    Reserve,
    Grant,
    Refuse,
    Withdraw,
    Withdrawn,
    DataHeader,
    Done,
    Failed,
    Get,
    GetReply,
    NcclSetup,
    NcclReady,
    Ping,
    Pong,
    ErrorMsg,
    Bye,
    Put,
    Ack,
    Return,
    AckReq,
)
BY_KIND: dict[int, type[Message]] = {m.KIND: m for m in ALL_MESSAGES}
