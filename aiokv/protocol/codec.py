"""msgpack encoding of control messages, with hard limits.

:meth:`Codec.decode` treats its input as hostile: the frame size is checked
before msgpack sees it, msgpack's own container limits are set, and every
field is type- and range-checked against the message schema *before* a
message object (or anything sized by the message) exists. Anything wrong
raises :class:`~aiokv.RemoteProtocolError` and nothing else; the ``code``
attribute of that error is a short machine-readable reason.

Wire data is never unpickled, evaluated, or used to look up attributes:
dtype names are checked against :data:`~.messages.ALLOWED_DTYPES`.
"""

from __future__ import annotations

from collections.abc import Callable
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

__all__ = ["Codec", "WireError", "WireLimits"]

MAX_U63 = (1 << 63) - 1
MAX_DIM = 1 << 40
MAX_DETAIL = 2048
MAX_CAPS = 32
MAX_LAYOUT_ITEMS = 32
MAX_ADDR = 256
MAX_ACKS = 4096  # transfers one ACK may settle (the sender splits longer lists)
TOKEN_BYTES = 16
NCCL_ID_BYTES = 128


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


def _specs(v: Any, lim: WireLimits) -> tuple[TensorSpec, ...]:
    if type(v) is not list:
        raise _fail("bad_spec", "specs must be a list")
    if not (0 < len(v) <= lim.max_tensors):
        raise _fail("bad_spec", f"a transfer holds 1..{lim.max_tensors} tensors, got {len(v)}")
    out = []
    seen: set[str] = set()
    for item in v:
        if type(item) is not list or len(item) != 3:
            raise _fail("bad_spec", "a tensor spec is [id, dtype, shape]")
        tid = _ident(item[0], lim)
        if tid in seen:
            raise _fail("bad_spec", f"tensor id {tid!r:.80} repeated in one transfer")
        seen.add(tid)
        dtype, shape = item[1], item[2]
        if type(dtype) is not str or dtype not in ALLOWED_DTYPES:
            raise _fail("bad_spec", f"dtype {dtype!r:.40} is not allowed")
        if type(shape) is not list or len(shape) > lim.max_ndim:
            raise _fail("bad_spec", f"shape must be a list of at most {lim.max_ndim} dims")
        numel = 1
        for d in shape:
            if type(d) is not int or not (0 <= d <= MAX_DIM):
                raise _fail("bad_spec", "shape dims must be integers in 0..2**40")
            numel *= d
            if numel * ALLOWED_DTYPES[dtype] > lim.max_tensor_bytes:
                raise _fail("bad_spec", f"tensor over the {lim.max_tensor_bytes}-byte limit")
        out.append(TensorSpec(tid, dtype, tuple(shape)))
    return tuple(out)


def _xfer_list(v: Any, lim: WireLimits) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_ACKS:
        raise _fail("bad_field", f"a list of at most {MAX_ACKS} transfer numbers expected")
    return tuple(_u63(x, lim) for x in v)


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
    Put: (_u63, _specs),
    Ack: (_u63, _u63, _u63, _u63, _xfer_list, _refusals),
    Return: (_u63, _u63, _u63),
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _to_wire(v: Any) -> Any:
    if isinstance(v, TensorSpec):
        return [v.tensor_id, v.dtype, list(v.shape)]
    if isinstance(v, tuple):
        return [_to_wire(x) for x in v]
    return v


class Codec:
    """Encode messages to bytes and decode bytes to messages under :class:`WireLimits`."""

    __slots__ = ("_pack", "_unpack_kw", "limits")

    def __init__(self, limits: WireLimits | None = None) -> None:
        self.limits = limits or WireLimits()
        # one packer per codec, reused (msgpack.packb makes a new one per call);
        # a codec belongs to one engine, so to one thread
        self._pack = msgpack.Packer(use_bin_type=True).pack
        n = self.limits.max_frame_bytes
        self._unpack_kw: dict[str, Any] = dict(
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=max(64, self.limits.max_tensors),
            max_map_len=MAX_LAYOUT_ITEMS,
            max_ext_len=0,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Codec:
        return Codec(self.limits)  # stateless but for its packer, which cannot be copied

    def encode(self, msg: Message) -> bytes:
        names = _FIELD_NAMES.get(type(msg))
        if names is None:
            names = _FIELD_NAMES[type(msg)] = tuple(f.name for f in fields(msg))  # type: ignore[arg-type]
        body = [msg.KIND]
        for name in names:
            v = getattr(msg, name)
            body.append(_to_wire(v) if type(v) is tuple else v)
        return cast(bytes, self._pack(body))

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        if len(data) > self.limits.max_frame_bytes:
            raise _fail("frame_too_large", f"{len(data)} bytes > {self.limits.max_frame_bytes}")
        try:
            obj = msgpack.unpackb(data, **self._unpack_kw)
        except Exception as exc:  # msgpack raises many types; none may escape
            raise _fail("malformed", f"not valid msgpack ({type(exc).__name__})") from None
        if type(obj) is not list or not obj:
            raise _fail("malformed", "a message is a non-empty array")
        kind = obj[0]
        cls = BY_KIND.get(kind) if type(kind) is int else None
        if cls is None:
            raise _fail("unknown_kind", f"unknown message kind {kind!r:.40}")
        checks = SCHEMA[cls]
        if len(obj) != len(checks) + 1:
            raise _fail("bad_arity", f"{cls.NAME} takes {len(checks)} fields, got {len(obj) - 1}")
        values = [chk(v, self.limits) for chk, v in zip(checks, obj[1:])]
        return cls(*values)
