"""Codec: round trips of every message type, hostile bytes, and the hard limits."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiokv
from aiokv.protocol import messages as m
from aiokv.protocol.codec import (
    MAX_DETAIL,
    NCCL_ID_BYTES,
    TOKEN_BYTES,
    Codec,
    WireError,
    WireLimits,
)

pytestmark = pytest.mark.timeout(120)

LIM = WireLimits()
CODEC = Codec(LIM)

u63 = st.integers(0, (1 << 63) - 1)
ident = st.text(min_size=1, max_size=40)
detail = st.text(max_size=100)
code = st.sampled_from(m.REFUSE_CODES)
addr = st.text(max_size=60)
caps = st.lists(st.text(min_size=1, max_size=20), max_size=5).map(tuple)
layout = st.none() | st.dictionaries(
    st.text(max_size=20), st.integers(-(2**63) + 1, 2**63 - 1) | st.text(max_size=40), max_size=6
)
dtype = st.sampled_from(sorted(m.ALLOWED_DTYPES))
shape = st.lists(st.integers(0, 8), max_size=LIM.max_ndim).map(tuple)  # 8**8 * 8 B < 16 GiB
specs = st.lists(
    st.tuples(ident, dtype, shape), min_size=1, max_size=8, unique_by=lambda s: s[0]
).map(lambda xs: tuple(m.TensorSpec(*x) for x in xs))

MESSAGES = {
    m.Hello: st.builds(m.Hello, u63, ident, addr, caps, layout),
    m.Welcome: st.builds(
        m.Welcome, u63, ident, addr, caps, layout, st.binary(min_size=16, max_size=16)
    ),
    m.DataHello: st.builds(m.DataHello, st.binary(min_size=TOKEN_BYTES, max_size=TOKEN_BYTES)),
    m.Reserve: st.builds(m.Reserve, u63, st.sampled_from(m.TRANSPORTS), specs),
    m.Grant: st.builds(m.Grant, u63, u63),
    m.Refuse: st.builds(m.Refuse, u63, code, detail),
    m.Withdraw: st.builds(m.Withdraw, u63),
    m.Withdrawn: st.builds(m.Withdrawn, u63),
    m.DataHeader: st.builds(m.DataHeader, u63, u63, u63),
    m.Done: st.builds(m.Done, u63),
    m.Failed: st.builds(m.Failed, u63, code, detail),
    m.Get: st.builds(m.Get, u63, st.lists(ident, min_size=1, max_size=5).map(tuple), addr),
    m.GetReply: st.builds(m.GetReply, u63, code, detail),
    m.NcclSetup: st.builds(
        m.NcclSetup, u63, st.binary(min_size=NCCL_ID_BYTES, max_size=NCCL_ID_BYTES)
    ),
    m.NcclReady: st.builds(m.NcclReady, u63, st.booleans(), detail),
    m.Ping: st.builds(m.Ping, u63),
    m.Pong: st.builds(m.Pong, u63),
    m.ErrorMsg: st.builds(m.ErrorMsg, code, detail),
    m.Bye: st.just(m.Bye()),
    m.Put: st.builds(m.Put, u63, specs, st.booleans()),
    m.Ack: st.builds(
        m.Ack,
        u63,
        u63,
        u63,
        u63,
        st.lists(u63, max_size=20).map(tuple),
        st.lists(st.tuples(u63, code), max_size=5).map(tuple),
    ),
    m.Return: st.builds(m.Return, u63, u63, u63),
    m.AckReq: st.builds(m.AckReq, u63),
}
any_message = st.one_of(*MESSAGES.values())


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGES) == set(m.ALL_MESSAGES)
    assert len({c.KIND for c in m.ALL_MESSAGES}) == len(m.ALL_MESSAGES)


@pytest.mark.parametrize("cls", m.ALL_MESSAGES, ids=lambda c: c.NAME)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls: type[m.Message], data: st.DataObject) -> None:
    msg = data.draw(MESSAGES[cls])
    wire = CODEC.encode(msg)
    back = CODEC.decode(wire)
    assert type(back) is cls
    assert back == msg
    assert CODEC.encode(back) == wire


def _reason(raw: bytes, codec: Codec = CODEC) -> str:
    with pytest.raises(aiokv.RemoteProtocolError) as ei:
        codec.decode(raw)
    return getattr(ei.value, "code", "")


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- hostile input


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_raise_only_remote_protocol_error(raw: bytes) -> None:
    try:
        CODEC.decode(raw)
    except aiokv.RemoteProtocolError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=8) | st.integers(), children, max_size=4)
    ),
    max_leaves=12,
)
# arrays that start with a real kind: they reach the per-field checks
near_messages = st.builds(
    lambda kind, rest: [kind, *rest],
    st.sampled_from(sorted(m.BY_KIND)),
    st.lists(msgpack_values, max_size=7),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values | near_messages)
def test_garbage_structures_raise_only_remote_protocol_error(obj: object) -> None:
    try:
        raw = _pack(obj)
    except (
        TypeError,
        ValueError,
        OverflowError,
    ):  # not expressible in msgpack (e.g. int dict keys are fine)
        return
    try:
        msg = CODEC.decode(raw)
    except aiokv.RemoteProtocolError as exc:
        assert isinstance(exc, WireError) and exc.code
        return
    # a structure that happens to be valid must round-trip
    assert CODEC.decode(CODEC.encode(msg)) == msg


@settings(max_examples=400, deadline=None)
@given(any_message, st.data())
def test_mutated_valid_frames_raise_only_remote_protocol_error(
    msg: m.Message, data: st.DataObject
) -> None:
    wire = bytearray(CODEC.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(wire)))
    for raw in (bytes(wire), bytes(wire[:cut])):
        try:
            CODEC.decode(raw)
        except aiokv.RemoteProtocolError:
            pass


def test_malformed_and_unknown() -> None:
    assert _reason(b"") == "malformed"
    assert _reason(b"\xc1") == "malformed"  # never-used msgpack byte
    assert _reason(_pack({"kind": 1})) == "malformed"
    assert _reason(_pack([])) == "malformed"
    assert _reason(_pack(7)) == "malformed"
    assert _reason(_pack([99, 1])) == "unknown_kind"
    assert _reason(_pack(["HELLO"])) == "unknown_kind"
    assert _reason(_pack([True])) == "unknown_kind"  # bool is not an int kind
    assert _reason(_pack([m.Grant.KIND, 1])) == "bad_arity"
    assert _reason(_pack([m.Grant.KIND, 1, 2, 3])) == "bad_arity"
    assert _reason(_pack([m.Grant.KIND, -1, 0])) == "bad_field"
    assert _reason(_pack([m.Grant.KIND, 1.0, 0])) == "bad_field"
    assert _reason(_pack([m.Grant.KIND, True, 0])) == "bad_field"
    assert _reason(_pack([m.Refuse.KIND, 1, "no-such-code", ""])) == "bad_field"
    assert (
        _reason(_pack([m.Reserve.KIND, 1, "carrier-pigeon", [["a", "uint8", [1]]]])) == "bad_field"
    )
    assert _reason(_pack([m.DataHello.KIND, b"short"])) == "bad_field"
    assert _reason(_pack([m.NcclSetup.KIND, 1, b"x" * (NCCL_ID_BYTES + 1)])) == "bad_field"
    # ext types are refused by msgpack's limits
    assert _reason(msgpack.packb([m.Ping.KIND, msgpack.ExtType(1, b"abc")])) == "malformed"


def test_detail_is_truncated_not_refused() -> None:
    msg = CODEC.decode(_pack([m.Failed.KIND, 1, "timeout", "x" * (MAX_DETAIL * 2)]))
    assert isinstance(msg, m.Failed) and len(msg.detail) == MAX_DETAIL


# --------------------------------------------------------------------------- limits


def _reserve(*spec: object, xfer: int = 1) -> bytes:
    return _pack([m.Reserve.KIND, xfer, "tcp", list(spec)])


def test_oversized_frame_rejected_before_msgpack() -> None:
    small = Codec(WireLimits(max_frame_bytes=1024))
    ok = small.encode(m.Failed(1, "timeout", "x" * 900))
    assert isinstance(small.decode(ok), m.Failed)
    big = small.encode(m.Failed(1, "timeout", "x" * 1100))
    assert len(big) > 1024
    assert _reason(big, small) == "frame_too_large"
    assert _reason(b"\x00" * 1025, small) == "frame_too_large"


def test_too_many_tensors() -> None:
    c = Codec(WireLimits(max_tensors=4))
    four = [[f"t{i}", "uint8", [1]] for i in range(4)]
    assert isinstance(c.decode(_reserve(*four)), m.Reserve)
    assert _reason(_reserve(*four, ["t4", "uint8", [1]]), c) in ("bad_spec", "malformed")
    assert _reason(_reserve(), c) == "bad_spec"  # zero tensors
    assert _reason(_pack([m.Get.KIND, 1, [f"t{i}" for i in range(5)], "a:1"]), c) in (
        "bad_field",
        "malformed",
    )


def test_ndim_over_limit() -> None:
    c = Codec(WireLimits(max_ndim=3))
    assert isinstance(c.decode(_reserve(["a", "uint8", [1, 1, 1]])), m.Reserve)
    assert _reason(_reserve(["a", "uint8", [1, 1, 1, 1]]), c) == "bad_spec"


def test_byte_counts_over_limit() -> None:
    c = Codec(WireLimits(max_tensor_bytes=1 << 20))
    assert isinstance(c.decode(_reserve(["a", "float32", [256, 1024]])), m.Reserve)  # exactly 1 MiB
    assert _reason(_reserve(["a", "float32", [256, 1025]]), c) == "bad_spec"
    assert _reason(_reserve(["a", "uint8", [1 << 40, 1 << 40]]), c) == "bad_spec"
    assert _reason(_reserve(["a", "uint8", [(1 << 40) + 1]]), c) == "bad_spec"  # dim over 2**40
    assert _reason(_reserve(["a", "uint8", [-1]]), c) == "bad_spec"
    assert _reason(_reserve(["a", "uint8", [1.5]]), c) == "bad_spec"
    assert _reason(_reserve(["a", "uint8", [True]]), c) == "bad_spec"
    # a zero dim does not let a later huge dim through unchecked: the strides of [0, 2**40]
    # would still span 2**40 bytes (hostile input 10), so it is refused like [1, 2**40]
    assert _reason(_reserve(["a", "uint8", [0, 1 << 40]]), c) == "bad_spec"
    z = c.decode(_reserve(["a", "uint8", [0, 1 << 20]]))
    assert isinstance(z, m.Reserve) and z.nbytes == 0


@pytest.mark.parametrize(
    "dt", ["float4", "object", "complex64", "torch.float32", "", "__class__", "uint16", 5, None]
)
def test_dtype_not_in_allow_list(dt: object) -> None:
    assert _reason(_reserve(["a", dt, [1]])) == "bad_spec"


@pytest.mark.parametrize("tid", [5, b"bytes", None, ["a"], {"a": 1}, "", "x" * 513, 1.0])
def test_non_string_or_bad_ids(tid: object) -> None:
    assert _reason(_reserve([tid, "uint8", [1]])) in ("bad_spec", "bad_field")
    assert _reason(_pack([m.Get.KIND, 1, [tid], "a:1"])) in ("bad_field",)
    assert _reason(_pack([m.Hello.KIND, 1, tid, "a:1", [], None])) == "bad_field"


def test_repeated_id_in_one_transfer() -> None:
    assert _reason(_reserve(["a", "uint8", [1]], ["a", "int8", [1]])) == "bad_spec"


def test_spec_shape_errors() -> None:
    assert _reason(_reserve(["a", "uint8"])) == "bad_spec"
    assert _reason(_reserve(["a", "uint8", 5])) == "bad_spec"
    assert _reason(_reserve("abc")) == "bad_spec"
    assert _reason(_pack([m.Reserve.KIND, 1, "tcp", {"a": 1}])) == "bad_spec"


def test_layout_and_caps_limits() -> None:
    assert _reason(_pack([m.Hello.KIND, 1, "e", "a:1", ["x" * 65], None])) == "bad_field"
    assert _reason(_pack([m.Hello.KIND, 1, "e", "a:1", ["c"] * 33, None])) == "bad_field"
    assert _reason(_pack([m.Hello.KIND, 1, "e", "a:1", [], {"k": 1.5}])) == "bad_field"
    assert _reason(_pack([m.Hello.KIND, 1, "e", "a:1", [], {"k": [1]}])) == "bad_field"
    assert _reason(_pack([m.Hello.KIND, 1, "e", "x" * 300, [], None])) == "bad_field"
    assert _reason(_pack([m.Hello.KIND, 1, "e", "a:1", [], {str(i): i for i in range(40)}])) in (
        "bad_field",
        "malformed",
    )


def test_messages_are_frozen_and_slotted() -> None:
    for cls in m.ALL_MESSAGES:
        assert dataclasses.is_dataclass(cls)
        assert (
            "__dict__" not in dir(cls)
            or not hasattr(cls, "__dict__")
            or "__slots__" in cls.__dict__
        )
    g = m.Grant(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.seq = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- two decoders

WALK_ONLY = Codec(LIM)


def _outcome(codec: Codec, raw: bytes, walk: bool) -> object:
    """What one decoder makes of ``raw``: the message, or "error" (codes may differ)."""
    try:
        if walk:
            import aiokv.protocol.codec as codec_mod

            saved = codec_mod.FAST_DECODE_MAX_BYTES
            codec_mod.FAST_DECODE_MAX_BYTES = -1  # every frame is walked
            try:
                return codec.decode(raw)
            finally:
                codec_mod.FAST_DECODE_MAX_BYTES = saved
        return codec._decode_small(memoryview(raw))
    except aiokv.RemoteProtocolError as exc:
        assert isinstance(exc, WireError) and exc.code
        return "error"


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message | msgpack_values | near_messages, st.data())
def test_small_frame_fast_path_agrees_with_the_schema_walk(
    obj: object, data: st.DataObject
) -> None:
    """Frames up to FAST_DECODE_MAX_BYTES are unpacked whole and then checked; larger ones
    are walked. Both must accept exactly the same frames, as the same messages."""
    try:
        raw = CODEC.encode(obj) if isinstance(obj, m.Message) else _pack(obj)
    except (TypeError, ValueError, OverflowError):
        return
    if data.draw(st.booleans()) and raw:  # and a mutated copy
        wire = bytearray(raw)
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
        raw = bytes(wire[: data.draw(st.integers(0, len(wire)))])
    assert _outcome(WALK_ONLY, raw, walk=True) == _outcome(WALK_ONLY, raw, walk=False)


def test_small_hostile_frame_is_cheap() -> None:
    """The worst a fast-path frame can do: build one object per byte, then fail."""
    import time

    from aiokv.protocol.codec import FAST_DECODE_MAX_BYTES

    nested = b"\x91" * (FAST_DECODE_MAX_BYTES // 2) + b"\x90" * (FAST_DECODE_MAX_BYTES // 2)
    flat = (
        b"\xdc"
        + (FAST_DECODE_MAX_BYTES - 3).to_bytes(2, "big")
        + b"\x90" * (FAST_DECODE_MAX_BYTES - 3)
    )
    for raw in (nested[:FAST_DECODE_MAX_BYTES], flat):
        assert len(raw) <= FAST_DECODE_MAX_BYTES
        t0 = time.thread_time()
        for _ in range(100):
            assert _reason(raw) in ("malformed", "unknown_kind", "bad_arity")
        assert (time.thread_time() - t0) / 100 < 0.002  # well under 2 ms each


# --------------------------------------------------------------------------- one-spec PUT

_dims = st.one_of(
    st.integers(-2, 70), st.just(m.MAX_DIM), st.just(m.MAX_DIM + 1), st.floats(0, 4), st.none()
)


@settings(max_examples=800, deadline=None)
@given(
    xfer=st.one_of(
        st.integers(-1, 5), st.just((1 << 63) - 1), st.just(1 << 63), st.text(max_size=2)
    ),
    tid=st.one_of(st.text(max_size=6), st.integers(-3, 3), st.binary(max_size=3)),
    dtype=st.sampled_from([*m.ALLOWED_DTYPES, "complex64", "", 3]),
    shape=st.one_of(st.lists(_dims, max_size=6), st.integers(-3, 3)),
    max_bytes=st.one_of(st.integers(1, 16), st.integers(1, 4096)),
    max_ndim=st.integers(0, 5),
    max_id=st.integers(1, 5),
    ack_now=st.sampled_from([True, False, 0, 1, None]),
)
def test_a_put_decodes_as_its_schema_says(
    xfer: object,
    tid: object,
    dtype: object,
    shape: object,
    max_bytes: int,
    max_ndim: int,
    max_id: int,
    ack_now: object,
) -> None:
    """The decoder's PUT branch (the hot path's, without the generic field loop) accepts
    exactly what SCHEMA[Put] accepts, as the same message, under any limits (a 0-d tensor
    larger than the byte limit included)."""
    lim = WireLimits(max_tensor_bytes=max_bytes, max_ndim=max_ndim, max_id_length=max_id)
    obj = [m.Put.KIND, xfer, [[tid, dtype, shape]], ack_now]
    codec = Codec(lim)
    try:
        general: object = codec._build(m.Put, obj[1:])
    except WireError:
        general = "error"
    try:
        got: object = codec.decode(msgpack.packb(obj))
    except WireError:
        got = "error"
    assert got == general
