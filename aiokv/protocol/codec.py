"""msgpack encoding of control messages, with hard limits.

:meth:`Codec.decode` treats its input as hostile: the frame size is checked
before msgpack sees it, and the frame is then *walked* against the message
schema with a streaming unpacker: every array or map header is read and its
length checked before any element is, a container is only descended into
where the schema has one (so nesting depth is at most three), and a scalar
is only unpacked after its first byte showed it is not a container. A frame
therefore builds at most as many objects as the largest legal message of its
kind holds, whatever its size: a megabyte of nested empty arrays is refused
after a few bytes instead of becoming a million lists. Every field is then
type- and range-checked *before* a message object (or anything sized by the
message) exists. Anything wrong raises :class:`~aiokv.RemoteProtocolError`
and nothing else; the ``code`` attribute of that error is a short
machine-readable reason.

Before a peer's HELLO was accepted only HELLO (or DATA_HELLO) may come, and
those are small: :data:`PRE_HELLO_MAX_FRAME_BYTES` bounds such frames
(``Codec.decode(data, max_bytes=PRE_HELLO_MAX_FRAME_BYTES)``).

Wire data is never unpickled, evaluated, or used to look up attributes:
dtype names are checked against :data:`~.messages.ALLOWED_DTYPES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import msgpack

from .._exceptions import RemoteProtocolError
from .messages import (
    ALLOWED_DTYPES,
    BY_KIND,
    REFUSE_CODES,
    TRANSPORTS,
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
    shape_problem,
)

__all__ = ["PRE_HELLO_MAX_FRAME_BYTES", "Codec", "WireError", "WireLimits"]

MAX_U63 = (1 << 63) - 1
MAX_DETAIL = 2048
MAX_CAPS = 32
MAX_LAYOUT_ITEMS = 32
MAX_ADDR = 256
MAX_ACKS = 4096  # transfers one ACK may settle (the sender splits longer lists)
TOKEN_BYTES = 16
NCCL_ID_BYTES = 128

#: The largest frame a connection may send before its HELLO was accepted. The largest
#: legal HELLO (512-character id, 256-character address, 32 capabilities of 64
#: characters, a 32-entry layout of 64/128-character strings, all of 4-byte UTF-8
#: characters) is 35,927 bytes; a stranger gets no more than this until it has said
#: who it is (the data connection's DATA_HELLO is 19 bytes).
PRE_HELLO_MAX_FRAME_BYTES = 64 * 1024

#: Frames up to this size are unpacked whole by msgpack's C unpacker and then checked
#: field by field, instead of walked: a frame builds at most one object per byte, so a
#: hostile one costs at most a few tens of microseconds however it nests, and the
#: messages of the hot path (PUT headers, ACKs: tens of bytes) decode ~4x faster.
FAST_DECODE_MAX_BYTES = 1024

# First bytes of msgpack containers: fixmap 0x80-0x8f, fixarray 0x90-0x9f,
# array16/32 0xdc/0xdd, map16/32 0xde/0xdf.
_PUT_KIND = Put.KIND
_ACK_KIND = Ack.KIND

_CONTAINER = bytes(1 if (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF) else 0 for b in range(256))
_IS_MAP = bytes(1 if (0x80 <= b <= 0x8F or b in (0xDE, 0xDF)) else 0 for b in range(256))


class WireError(RemoteProtocolError):
    """A decode failure; ``code`` is the reason (e.g. ``"frame_too_large"``)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


@dataclass(frozen=True, slots=True)
class WireLimits:
    """The limits one codec enforces (taken from :class:`aiokv.Limits`)."""

    max_frame_bytes: int = 1 << 20
    max_tensors: int = 8192
    max_ndim: int = 8
    max_tensor_bytes: int = 16 << 30
    max_id_length: int = 512


def _fail(code: str, detail: str) -> WireError:
    return WireError(code, detail)


Check = Callable[[Any, WireLimits], Any]


def _u63(v: Any, lim: WireLimits) -> int:
    if type(v) is not int or not (0 <= v <= MAX_U63):
        raise _fail("bad_field", f"expected an unsigned integer, got {type(v).__name__}")
    return v


def _bool(v: Any, lim: WireLimits) -> bool:
    if type(v) is not bool:
        raise _fail("bad_field", f"expected a bool, got {type(v).__name__}")
    return v


def _ident(v: Any, lim: WireLimits) -> str:
    if type(v) is not str:
        raise _fail("bad_field", f"expected a string id, got {type(v).__name__}")
    if not v or len(v) > lim.max_id_length:
        raise _fail("bad_field", f"id length {len(v)} outside 1..{lim.max_id_length}")
    return v


def _detail(v: Any, lim: WireLimits) -> str:
    if type(v) is not str:
        raise _fail("bad_field", f"expected a string, got {type(v).__name__}")
    return v[:MAX_DETAIL]


def _addr(v: Any, lim: WireLimits) -> str:
    if type(v) is not str or len(v) > MAX_ADDR:
        raise _fail("bad_field", "expected an address string")
    return v


def _code(v: Any, lim: WireLimits) -> str:
    if type(v) is not str or v not in REFUSE_CODES:
        raise _fail("bad_field", f"unknown reason code {v!r:.40}")
    return v


def _transport(v: Any, lim: WireLimits) -> str:
    if type(v) is not str or v not in TRANSPORTS:
        raise _fail("bad_field", f"unknown transport {v!r:.40}")
    return v


def _bytes_of(n: int) -> Check:
    def check(v: Any, lim: WireLimits) -> bytes:
        if type(v) is not bytes or len(v) != n:
            raise _fail("bad_field", f"expected {n} bytes")
        return v

    return check


def _caps(v: Any, lim: WireLimits) -> tuple[str, ...]:
    if type(v) is not list or len(v) > MAX_CAPS:
        raise _fail("bad_field", "capabilities must be a short list of strings")
    out = []
    for c in v:
        if type(c) is not str or not (0 < len(c) <= 64):
            raise _fail("bad_field", "capabilities must be short strings")
        out.append(c)
    return tuple(out)


def _layout(v: Any, lim: WireLimits) -> dict[str, str | int] | None:
    if v is None:
        return None
    if type(v) is not dict or len(v) > MAX_LAYOUT_ITEMS:
        raise _fail("bad_field", "layout must be a small map")
    out: dict[str, str | int] = {}
    for k, x in v.items():
        if type(k) is not str or len(k) > 64:
            raise _fail("bad_field", "layout keys must be short strings")
        if type(x) is int:
            if not (-MAX_U63 <= x <= MAX_U63):
                raise _fail("bad_field", "layout integer out of range")
        elif type(x) is not str or len(x) > 128:
            raise _fail("bad_field", "layout values must be short strings or integers")
        out[k] = x
    return out


def _spec(item: Any, lim: WireLimits) -> TensorSpec:
    """One ``[id, dtype, shape]`` (the checks of :func:`_specs`, but for repeats)."""
    if type(item) is not list or len(item) != 3:
        raise _fail("bad_spec", "a tensor spec is [id, dtype, shape]")
    tid = _ident(item[0], lim)
    dtype, shape = item[1], item[2]
    if type(dtype) is not str or dtype not in ALLOWED_DTYPES:
        raise _fail("bad_spec", f"dtype {dtype!r:.40} is not allowed")
    if type(shape) is not list:
        raise _fail("bad_spec", "shape must be a list")
    why = shape_problem(
        ALLOWED_DTYPES[dtype], shape, max_ndim=lim.max_ndim, max_bytes=lim.max_tensor_bytes
    )
    if why is not None:
        raise _fail("bad_spec", why)
    return TensorSpec(tid, dtype, tuple(shape))


def _specs(v: Any, lim: WireLimits) -> tuple[TensorSpec, ...]:
    if type(v) is not list:
        raise _fail("bad_spec", "specs must be a list")
    if not (0 < len(v) <= lim.max_tensors):
        raise _fail("bad_spec", f"a transfer holds 1..{lim.max_tensors} tensors, got {len(v)}")
    if len(v) == 1:  # the common case: no repeats to look for
        return (_spec(v[0], lim),)
    out = []
    seen: set[str] = set()
    for item in v:
        spec = _spec(item, lim)
        if spec.tensor_id in seen:
            raise _fail("bad_spec", f"tensor id {spec.tensor_id!r:.80} repeated in one transfer")
        seen.add(spec.tensor_id)
        out.append(spec)
    return tuple(out)


def _xfer_list(v: Any, lim: WireLimits) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_ACKS:
        raise _fail("bad_field", f"a list of at most {MAX_ACKS} transfer numbers expected")
    for x in v:
        if type(x) is not int or not (0 <= x <= MAX_U63):
            raise _fail("bad_field", f"expected an unsigned integer, got {type(x).__name__}")
    return tuple(v)


def _refusals(v: Any, lim: WireLimits) -> tuple[tuple[int, str], ...]:
    if type(v) is not list or len(v) > MAX_ACKS:
        raise _fail("bad_field", f"a list of at most {MAX_ACKS} refusals expected")
    out = []
    for item in v:
        if type(item) is not list or len(item) != 2:
            raise _fail("bad_field", "a refusal is [xfer, code]")
        out.append((_u63(item[0], lim), _code(item[1], lim)))
    return tuple(out)


def _id_list(v: Any, lim: WireLimits) -> tuple[str, ...]:
    if type(v) is not list or not (0 < len(v) <= lim.max_tensors):
        raise _fail("bad_field", "tensor_ids must be a non-empty list")
    return tuple(_ident(x, lim) for x in v)


SCHEMA: dict[type[Message], tuple[Check, ...]] = {
    Hello: (_u63, _ident, _addr, _caps, _layout),
    Welcome: (_u63, _ident, _addr, _caps, _layout, _bytes_of(TOKEN_BYTES)),
    DataHello: (_bytes_of(TOKEN_BYTES),),
    Reserve: (_u63, _transport, _specs),
    Grant: (_u63, _u63),
    Refuse: (_u63, _code, _detail),
    Withdraw: (_u63,),
    Withdrawn: (_u63,),
    DataHeader: (_u63, _u63, _u63),
    Done: (_u63,),
    Failed: (_u63, _code, _detail),
    Get: (_u63, _id_list, _addr),
    GetReply: (_u63, _code, _detail),
    NcclSetup: (_u63, _bytes_of(NCCL_ID_BYTES)),
    NcclReady: (_u63, _bool, _detail),
    Ping: (_u63,),
    Pong: (_u63,),
    ErrorMsg: (_code, _detail),
    Bye: (),
    Put: (_u63, _specs, _bool),
    Ack: (_u63, _u63, _u63, _u63, _xfer_list, _refusals),
    Return: (_u63, _u63, _u63),
    AckReq: (_u63,),
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _to_wire(v: Any) -> Any:
    if isinstance(v, TensorSpec):
        return [v.tensor_id, v.dtype, list(v.shape)]
    if isinstance(v, tuple):
        return [_to_wire(x) for x in v]
    return v


@dataclass(frozen=True, slots=True)
class _Arr:
    """A field that may be an array of at most ``max_len`` items (longer: error ``code``).

    ``items`` gives the shape of each position; the last one repeats.
    """

    max_len: int
    items: tuple[Shape, ...]
    code: str


@dataclass(frozen=True, slots=True)
class _SpecList:
    """RESERVE's list of tensor specs: an array of at most ``max_len`` ``spec`` records.

    The one large field of the protocol, so it has a reader of its own
    (:meth:`_Walk.specs`) that reads the usual encoding without a call per level.
    """

    max_len: int
    spec: _Arr
    code: str


@dataclass(frozen=True, slots=True)
class _Map:
    """A field that may be a map of at most ``max_len`` scalar keys and scalar values."""

    max_len: int
    code: str


#: What a field may hold: a str means "a scalar only" and is the error code when a
#: container comes instead. A scalar is always accepted where a container may be (the
#: field's check then says what is wrong with it).
Shape = _Arr | _SpecList | _Map | str


def _shapes(lim: WireLimits) -> dict[type[Message], tuple[Shape, ...]]:
    """The container structure every message may have: the decoder reads nothing else."""
    scalars = {cls: ("bad_field",) * len(checks) for cls, checks in SCHEMA.items()}
    caps = _Arr(MAX_CAPS, ("bad_field",), "bad_field")
    layout = _Map(MAX_LAYOUT_ITEMS, "bad_field")
    shape = _Arr(lim.max_ndim, ("bad_spec",), "bad_spec")
    spec = _Arr(3, ("bad_spec", "bad_spec", shape), "bad_spec")
    out: dict[type[Message], tuple[Shape, ...]] = dict(scalars)
    out[Hello] = ("bad_field", "bad_field", "bad_field", caps, layout)
    out[Welcome] = ("bad_field", "bad_field", "bad_field", caps, layout, "bad_field")
    out[Reserve] = ("bad_field", "bad_field", _SpecList(lim.max_tensors, spec, "bad_spec"))
    out[Get] = ("bad_field", _Arr(lim.max_tensors, ("bad_field",), "bad_field"), "bad_field")
    out[Put] = ("bad_field", _SpecList(lim.max_tensors, spec, "bad_spec"), "bad_field")
    refusal = _Arr(2, ("bad_field", "bad_field"), "bad_field")
    out[Ack] = (
        *("bad_field",) * 4,
        _Arr(MAX_ACKS, ("bad_field",), "bad_field"),
        _Arr(MAX_ACKS, (refusal,), "bad_field"),
    )
    return out


class _Walk:
    """Reads one frame along a schema shape (see the module docstring)."""

    __slots__ = ("array_limit", "base", "buf", "size", "u")

    def __init__(self, u: msgpack.Unpacker, buf: memoryview, array_limit: int, base: int) -> None:
        self.u = u
        self.base = base  # the frame's first byte in the unpacker's count
        self.buf = buf
        self.size = buf.nbytes
        self.array_limit = array_limit

    def array_header(self, limit: int, code: str) -> int:
        n = cast(int, self.u.read_array_header())
        if n > self.array_limit:  # what msgpack's max_array_len said before
            raise _fail("malformed", f"array of {n} items > {self.array_limit}")
        if n > limit:
            raise _fail(code, f"array of {n} items where at most {limit} may be")
        return n

    def read(self, shape: Shape) -> Any:
        pos = self.u.tell() - self.base
        if pos >= self.size:
            raise _fail("malformed", "frame ends inside a message")
        b = self.buf[pos]
        if not _CONTAINER[b]:
            return self.u.unpack()
        if isinstance(shape, str):
            raise _fail(shape, "a container where a scalar belongs")
        if _IS_MAP[b]:
            if not isinstance(shape, _Map):
                raise _fail(shape.code, "a map where none belongs")
            n = cast(int, self.u.read_map_header())
            if n > MAX_LAYOUT_ITEMS:
                raise _fail("malformed", f"map of {n} entries > {MAX_LAYOUT_ITEMS}")
            if n > shape.max_len:
                raise _fail(shape.code, f"map of {n} entries where at most {shape.max_len} may be")
            out: dict[Any, Any] = {}
            for _ in range(n):
                k = self.read("malformed")
                if type(k) is not str and type(k) is not bytes:  # msgpack's strict_map_key
                    raise _fail("malformed", "map keys must be strings")
                out[k] = self.read(shape.code)
            return out
        if isinstance(shape, _SpecList):
            return self.specs(shape)
        if not isinstance(shape, _Arr):
            raise _fail(shape.code, "an array where none belongs")
        n = self.array_header(shape.max_len, shape.code)
        items = shape.items
        last = len(items) - 1
        u, buf, base, size = self.u, self.buf, self.base, self.size
        arr: list[Any] = []
        for i in range(n):
            pos = u.tell() - base
            if pos < size and not _CONTAINER[buf[pos]]:  # a scalar, inline (the hot case)
                arr.append(u.unpack())
            else:
                arr.append(self.read(items[i if i < last else last]))
        return arr

    def specs(self, shape: _SpecList) -> list[Any]:
        """Read a spec list: what :meth:`read` does, inline for the usual encoding (a
        fixarray of 3: two scalars and a fixarray of at most ``max_ndim`` scalars);
        any other encoding of a spec, or of its shape, goes through :meth:`read`."""
        n = self.array_header(shape.max_len, shape.code)
        spec = shape.spec
        dims_shape = spec.items[2]
        ndim = dims_shape.max_len if isinstance(dims_shape, _Arr) else 0
        u, buf, base, size = self.u, self.buf, self.base, self.size
        tell, unpack = u.tell, u.unpack
        out: list[Any] = []
        for _ in range(n):
            pos = tell() - base
            if pos >= size or buf[pos] != 0x93:  # not a fixarray of 3
                out.append(self.read(spec))
                continue
            u.read_array_header()
            pos += 1
            if pos >= size:
                raise _fail("malformed", "frame ends inside a message")
            if _CONTAINER[buf[pos]]:
                raise _fail("bad_spec", "a container where a tensor id belongs")
            tid = unpack()
            pos = tell() - base
            if pos >= size:
                raise _fail("malformed", "frame ends inside a message")
            if _CONTAINER[buf[pos]]:
                raise _fail("bad_spec", "a container where a dtype belongs")
            dtype = unpack()
            pos = tell() - base
            if pos >= size:
                raise _fail("malformed", "frame ends inside a message")
            b = buf[pos]
            if not 0x90 <= b <= 0x90 + ndim:  # not a short fixarray: the general way
                out.append([tid, dtype, self.read(dims_shape)])
                continue
            u.read_array_header()
            dims: list[Any] = []
            for _ in range(b - 0x90):
                pos = tell() - base
                if pos >= size:
                    raise _fail("malformed", "frame ends inside a message")
                if _CONTAINER[buf[pos]]:
                    raise _fail("bad_spec", "a container where a dim belongs")
                dims.append(unpack())
            out.append([tid, dtype, dims])
        return out


class Codec:
    """Encode messages to bytes and decode bytes to messages under :class:`WireLimits`.

    A codec keeps a packer and a streaming unpacker between calls: use one per thread
    (an engine's lives on its event loop).
    """

    __slots__ = ("_array_limit", "_pack", "_shapes", "_unpacker", "limits")

    def __init__(self, limits: WireLimits | None = None) -> None:
        self.limits = limits or WireLimits()
        # one packer per codec, reused (msgpack.packb makes a new one per call);
        # a codec belongs to one engine, so to one thread
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._array_limit = max(64, self.limits.max_tensors)
        self._shapes = _shapes(self.limits)
        self._unpacker: msgpack.Unpacker | None = None

    def _new_unpacker(self) -> msgpack.Unpacker:
        """A streaming unpacker for one frame at a time (reused while frames decode cleanly)."""
        n = self.limits.max_frame_bytes
        # containers are never unpacked whole: limits of 0 make sure of it
        return msgpack.Unpacker(
            raw=False,
            max_buffer_size=n,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=0,
            max_map_len=0,
            max_ext_len=0,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Codec:
        return Codec(self.limits)  # stateless but for its packer, which cannot be copied

    def encode_put(self, xfer: int, specs: Sequence[TensorSpec], ack_now: bool = True) -> bytes:
        """``encode(Put(xfer, tuple(specs), ack_now))`` without building the message: the
        hot path's header, the same bytes."""
        if len(specs) == 1:
            sp = specs[0]
            body = [[sp.tensor_id, sp.dtype, list(sp.shape)]]
        else:
            body = [[sp.tensor_id, sp.dtype, list(sp.shape)] for sp in specs]
        return cast(bytes, self._pack([_PUT_KIND, xfer, body, ack_now]))

    def encode_ack(
        self,
        window_bytes: int,
        window_tensors: int,
        add_bytes: int,
        add_tensors: int,
        done: Sequence[int],
        refused: Sequence[tuple[int, str]],
    ) -> bytes:
        """``encode(Ack(...))`` without building the message (the same bytes)."""
        return cast(
            bytes,
            self._pack(
                [_ACK_KIND, window_bytes, window_tensors, add_bytes, add_tensors, done, refused]
            ),
        )

    def encode(self, msg: Message) -> bytes:
        if type(msg) is Put:
            return self.encode_put(msg.xfer, msg.specs, msg.ack_now)
        if type(msg) is Ack:
            return self.encode_ack(
                msg.window_bytes,
                msg.window_tensors,
                msg.add_bytes,
                msg.add_tensors,
                msg.done,
                msg.refused,
            )
        names = _FIELD_NAMES.get(type(msg))
        if names is None:
            names = _FIELD_NAMES[type(msg)] = tuple(f.name for f in fields(msg))  # type: ignore[arg-type]
        body = [msg.KIND]
        for name in names:
            v = getattr(msg, name)
            body.append(_to_wire(v) if type(v) is tuple else v)
        return cast(bytes, self._pack(body))

    def decode(
        self, data: bytes | bytearray | memoryview, *, max_bytes: int | None = None
    ) -> Message:
        """Decode one frame. ``max_bytes`` lowers the frame limit (e.g. before HELLO:
        :data:`PRE_HELLO_MAX_FRAME_BYTES`)."""
        limit = self.limits.max_frame_bytes
        if max_bytes is not None:
            limit = min(limit, max_bytes)
        buf = memoryview(data)
        if buf.format != "B" or buf.ndim != 1:
            buf = memoryview(buf.tobytes())
        if buf.nbytes > limit:
            raise _fail("frame_too_large", f"{buf.nbytes} bytes > {limit}")
        if buf.nbytes <= FAST_DECODE_MAX_BYTES:
            return self._decode_small(buf)
        u = self._unpacker
        self._unpacker = None  # back only once this frame was read to its end
        if u is None:
            u = self._new_unpacker()
        try:
            u.feed(buf)
            cls, obj = self._walk(u, buf)
        except WireError:
            raise
        except Exception as exc:  # msgpack raises many types; none may escape
            raise _fail("malformed", f"not valid msgpack ({type(exc).__name__})") from None
        self._unpacker = u
        return self._build(cls, obj)

    def _build(self, cls: type[Message], obj: list[Any]) -> Message:
        checks = SCHEMA[cls]
        if len(obj) != len(checks):
            raise _fail("bad_arity", f"{cls.NAME} takes {len(checks)} fields, got {len(obj)}")
        lim = self.limits
        return cls(*[chk(v, lim) for chk, v in zip(checks, obj)])

    def _decode_small(self, buf: memoryview) -> Message:
        """A frame of at most :data:`FAST_DECODE_MAX_BYTES`: unpacked whole, then checked.

        Every field check tests exact types, so a container where a scalar belongs (or
        the reverse) fails there; the walk's finer error codes are not needed for a
        frame this small, its bounded cost is what the walk exists for.
        """
        if buf.nbytes == 0:
            raise _fail("malformed", "empty frame")
        try:
            obj = msgpack.unpackb(buf, raw=False, max_ext_len=0)
        except Exception as exc:  # msgpack raises many types; none may escape
            raise _fail("malformed", f"not valid msgpack ({type(exc).__name__})") from None
        if type(obj) is not list or not obj:
            raise _fail("malformed", "a message is a non-empty array")
        kind = obj[0]
        # the hot path's two messages, checked as SCHEMA says without its generic loop
        if kind == _PUT_KIND and type(kind) is int and len(obj) == 4:
            lim = self.limits
            return Put(_u63(obj[1], lim), _specs(obj[2], lim), _bool(obj[3], lim))
        if kind == _ACK_KIND and type(kind) is int and len(obj) == 7:
            lim = self.limits
            return Ack(
                _u63(obj[1], lim),
                _u63(obj[2], lim),
                _u63(obj[3], lim),
                _u63(obj[4], lim),
                _xfer_list(obj[5], lim),
                _refusals(obj[6], lim),
            )
        cls = BY_KIND.get(kind) if type(kind) is int else None
        if cls is None:
            raise _fail("unknown_kind", f"unknown message kind {kind!r:.40}")
        return self._build(cls, obj[1:])

    def _walk(self, u: msgpack.Unpacker, buf: memoryview) -> tuple[type[Message], list[Any]]:
        """The message class and its raw fields, read along the class's shape."""
        size = buf.nbytes
        if size == 0:
            raise _fail("malformed", "empty frame")
        b = buf[0]
        if not _CONTAINER[b] or _IS_MAP[b]:
            raise _fail("malformed", "a message is a non-empty array")
        base = u.tell()  # the unpacker counts bytes over all frames it was fed
        n = cast(int, u.read_array_header())
        if n > self._array_limit:
            raise _fail("malformed", f"array of {n} items > {self._array_limit}")
        if n == 0:
            raise _fail("malformed", "a message is a non-empty array")
        pos = u.tell() - base
        if pos >= size:
            raise _fail("malformed", "frame ends inside a message")
        if _CONTAINER[buf[pos]]:
            raise _fail("unknown_kind", "the message kind is a container")
        kind = u.unpack()
        cls = BY_KIND.get(kind) if type(kind) is int else None
        if cls is None:
            raise _fail("unknown_kind", f"unknown message kind {kind!r:.40}")
        shapes = self._shapes[cls]
        if n - 1 > len(shapes):
            raise _fail("bad_arity", f"{cls.NAME} takes {len(shapes)} fields, got {n - 1}")
        obj: list[Any] = []
        w: _Walk | None = None  # only a field that is a container needs the walker
        for i in range(n - 1):
            pos = u.tell() - base
            # the common case inline: a scalar (what most fields are)
            if pos < size and not _CONTAINER[buf[pos]]:
                obj.append(u.unpack())
            else:
                if w is None:
                    w = _Walk(u, buf, self._array_limit, base)
                obj.append(w.read(shapes[i]))
        if u.tell() - base != size:
            raise _fail("malformed", "bytes after the message")
        return cls, obj
