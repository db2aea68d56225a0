"""Property-based fuzzing of everything that reads wire data (reliability row 11).

* ``Codec.decode``: structure-aware frames (valid kinds, mutated fields) and raw bytes;
* ``Session.receive`` from every connection and transfer state, both roles;
* a live engine fed garbage zmq messages, as new connections and inside an open session.

The property everywhere: only :class:`aiokv.RemoteProtocolError` comes out of a decoder or a
session; a live engine's loop records no exception (a loop exception handler is installed and
must see nothing), the engine counts the errors and keeps serving.

CI runs a short budget. ``AIOKV_FUZZ_SECONDS=300 pytest tests/test_fuzz.py`` runs each test for
that many seconds (new random seeds until the time is up) and prints the example count.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import warnings
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

import zmq
import zmq.asyncio

import aiokv
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec, WireLimits
from aiokv.protocol.session import Role, Session, SessionState

LONG = float(os.environ.get("AIOKV_FUZZ_SECONDS", "0"))
CI_EXAMPLES = 150
pytestmark = pytest.mark.timeout(120 if not LONG else LONG * 3 + 120)
FIGURES = os.environ.get("AIOKV_RELIABILITY_LOG")  # figures are kept only where this names a file
LIM = WireLimits(
    max_frame_bytes=64 * 1024,
    max_tensors=16,
    max_ndim=4,
    max_tensor_bytes=1 << 20,
    max_id_length=32,
)
CODEC = Codec(LIM)


def run_budget(name: str, test: Any) -> int:
    """Run a @given test: once with CI_EXAMPLES, or repeatedly with fresh seeds for LONG seconds."""
    count = [0]
    if not LONG:
        inner = test(count)
        n = CI_EXAMPLES if name != "live_engine" else CI_EXAMPLES // 3
        settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck))(inner)()
        return count[0]
    t_end = time.monotonic() + LONG
    rounds = 0
    while time.monotonic() < t_end:
        settings(
            max_examples=2000,
            deadline=None,
            derandomize=False,
            database=None,
            suppress_health_check=list(HealthCheck),
        )(test(count))()  # a fresh @given each round
        rounds += 1
    if FIGURES:
        with open(FIGURES, "a") as f:
            row = {"test": f"fuzz_long::{name}", "seconds": LONG, "examples": count[0]}
            f.write(json.dumps({**row, "rounds": rounds}) + "\n")
    print(f"{name}: {count[0]} examples in {LONG:.0f}s, 0 failures")
    return count[0]


# --------------------------------------------------------------------------- strategies

scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=200)
)
anyobj = st.recursive(
    scalar,
    lambda ch: (
        st.lists(ch, max_size=6)
        | st.dictionaries(
            scalar.filter(lambda x: x is not None and not isinstance(x, float)), ch, max_size=4
        )
    ),
    max_leaves=20,
)
tid = (
    st.text(min_size=1, max_size=40)
    | st.integers(-(2**63), 2**63)
    | st.binary(max_size=8)
    | st.none()
)
dtypes = (
    st.sampled_from(sorted(m.ALLOWED_DTYPES))
    | st.sampled_from(["object", "complex64", "float128", "", "__class__"])
    | st.integers(-5, 5)
)
shape = st.lists(st.integers(-3, 1 << 62) | st.floats() | st.text(max_size=3), max_size=10)
spec = st.lists(st.one_of(tid, dtypes, shape), min_size=0, max_size=4) | st.tuples(
    tid, dtypes, shape
).map(list)


def field_for(i: int) -> Any:
    return st.one_of(
        st.integers(-1, 2**64 - 1),
        st.text(max_size=30),
        st.binary(max_size=140),
        st.booleans(),
        st.none(),
        st.lists(spec, max_size=20),
        st.sampled_from(m.REFUSE_CODES),
        st.sampled_from(m.TRANSPORTS),
        st.binary(min_size=16, max_size=16),
        st.binary(min_size=128, max_size=128),
        anyobj,
    )


@st.composite
def structured_frame(draw: Any) -> bytes:
    kind = draw(st.sampled_from(sorted(m.BY_KIND)) | st.integers(-5, 300))
    n = draw(st.integers(0, 8))
    body = [kind, *(draw(field_for(i)) for i in range(n))]
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


@st.composite
def valid_frame(draw: Any) -> bytes:
    """A well-formed message of a random kind (legal or not for the state it meets)."""
    x = draw(st.integers(0, 4))
    v = m.PROTOCOL_VERSION
    choices = [
        m.Hello(draw(st.sampled_from([v, v, v - 1])), "peer", "127.0.0.1:1", ("tcp",), None),
        m.Welcome(m.PROTOCOL_VERSION, "srv", "127.0.0.1:2", ("tcp",), None, b"\x01" * 16),
        m.DataHello(b"\x02" * 16),
        m.Reserve(x, "tcp", (m.TensorSpec(f"t{x}", "float32", (4,)),)),
        m.Grant(x, draw(st.integers(0, 3))),
        m.Refuse(x, "busy", ""),
        m.Withdraw(x),
        m.Withdrawn(x),
        m.DataHeader(x, draw(st.integers(0, 3)), 1),
        m.Done(x),
        m.Failed(x, "aborted", ""),
        m.Get(x, ("a",), "127.0.0.1:3"),
        m.GetReply(x, "ok", ""),
        m.NcclSetup(x, b"\x00" * 128),
        m.NcclReady(x, True, ""),
        m.Ping(x),
        m.Pong(x),
        m.ErrorMsg("protocol", "x"),
        m.Bye(),
    ]
    return CODEC.encode(draw(st.sampled_from(choices)))


frames = st.binary(max_size=300) | structured_frame() | valid_frame()


# --------------------------------------------------------------------------- codec


@pytest.mark.timeout(120 if not LONG else LONG + 120)
def test_fuzz_codec_decode() -> None:
    def make(count: list[int]) -> Any:
        @given(frames)
        def inner(data: bytes) -> None:
            count[0] += 1
            try:
                msg = CODEC.decode(data)
            except aiokv.RemoteProtocolError:
                return
            assert CODEC.decode(CODEC.encode(msg)) == msg  # what decodes, round-trips

        return inner

    assert run_budget("codec_decode", make) > 0


# --------------------------------------------------------------------------- session from every state


def sessions_in_every_state() -> list[tuple[str, Session]]:
    """(name, session) for every connection state x role, and open sessions with transfers
    in every transfer state."""
    out: list[tuple[str, Session]] = []
    out += [
        ("client-IDLE", Session(Role.CLIENT, CODEC)),
        ("server-IDLE", Session(Role.SERVER, CODEC)),
    ]
    c, s = Session(Role.CLIENT, CODEC), Session(Role.SERVER, CODEC)
    s.receive(c.send(m.Hello(m.PROTOCOL_VERSION, "c", "127.0.0.1:1", ("tcp",), None)))
    out.append(("client-HELLO_SENT", c.__copy__() if hasattr(c, "__copy__") else _clone(c)))
    c.receive(
        s.send(m.Welcome(m.PROTOCOL_VERSION, "s", "127.0.0.1:2", ("tcp",), None, b"\x01" * 16))
    )
    out += [("client-OPEN", _clone(c)), ("server-OPEN", _clone(s))]
    # transfers: 1 RESERVED, 2 WITHDRAWING, 3 GRANTED, 4 SENT (client); mirrored on the server
    spec = (m.TensorSpec("t", "float32", (4,)),)
    for x in (1, 2, 3, 4):
        s.receive(
            c.send(m.Reserve(c.new_xfer_id(), "tcp", (m.TensorSpec(f"t{x}", "float32", (4,)),)))
        )
    c.send(m.Withdraw(2))
    s.receive(c.codec.encode(m.Withdraw(2)))
    for x in (3, 4):
        c.receive(s.send(m.Grant(x, s.next_grant_seq)))
    s.receive(c.send(m.DataHeader(4, 1, 1)))
    del spec
    out += [("client-OPEN-xfers", _clone(c)), ("server-OPEN-xfers", _clone(s))]
    cc, sc = _clone(c), _clone(s)
    cc.close()
    sc.close()
    out += [("client-CLOSED", cc), ("server-CLOSED", sc)]
    return out


def _clone(s: Session) -> Session:
    import copy

    return copy.deepcopy(s)


@pytest.mark.timeout(120 if not LONG else LONG + 120)
def test_fuzz_session_receive_from_every_state() -> None:
    bases = sessions_in_every_state()
    assert {n.split("-")[1] for n, _ in bases} >= {st_.value for st_ in SessionState}

    def make(count: list[int]) -> Any:
        @given(st.sampled_from(range(len(bases))), st.lists(frames, min_size=1, max_size=8))
        def inner(i: int, seq: list[bytes]) -> None:
            _name, base = bases[i]
            s = _clone(base)
            for fr in seq:
                count[0] += 1
                was_closed = s.state is SessionState.CLOSED
                try:
                    s.receive(fr)
                except aiokv.RemoteProtocolError:
                    pass
                else:
                    assert not was_closed, "a closed session accepted a message"
                # invariants hold after anything
                assert s.state in SessionState
                assert s.live_transfers >= 0

        return inner

    assert run_budget("session_receive", make) > 0


# --------------------------------------------------------------------------- live engine


class LoopErrors:
    """A loop exception handler that records every call (nothing may reach it)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.calls.append(context)


@pytest.mark.timeout(180 if not LONG else LONG + 180)
def test_fuzz_garbage_frames_to_a_live_engine() -> None:
    loop = asyncio.new_event_loop()
    errors = LoopErrors()
    loop.set_exception_handler(errors)
    limits = aiokv.Limits(
        max_frame_bytes=64 * 1024,
        max_tensors_per_transfer=16,
        max_ndim=4,
        max_tensor_bytes=1 << 20,
        max_id_length=32,
        store_bytes=8 << 20,
    )
    eng = aiokv.Engine(aiokv.EngineConfig(limits=limits))
    ctx = zmq.asyncio.Context()
    rng = random.Random(1)
    good = aiokv.Engine(aiokv.EngineConfig())
    try:
        loop.run_until_complete(eng.start())
        loop.run_until_complete(good.start())
        ep = f"tcp://{eng.address}"
        hello = CODEC.encode(m.Hello(m.PROTOCOL_VERSION, "fuzzer", "127.0.0.1:9", ("tcp",), None))

        async def one(msgs: list[list[bytes]], in_session: bool) -> None:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(ep)
            try:
                if in_session:
                    await d.send(hello)
                    await asyncio.wait_for(d.recv_multipart(), 5)  # WELCOME
                for parts in msgs:
                    await d.send_multipart(parts)
                # whatever comes back must be well-formed messages (ERROR, REFUSE, GRANT, ...)
                while await d.poll(20):
                    for fr in await d.recv_multipart():
                        CODEC.decode(fr)
            finally:
                d.close(0)

        def make(count: list[int]) -> Any:
            @given(
                st.lists(st.lists(frames, min_size=1, max_size=4), min_size=1, max_size=4),
                st.booleans(),
            )
            def inner(msgs: list[list[bytes]], in_session: bool) -> None:
                count[0] += 1
                loop.run_until_complete(one(msgs, in_session))
                assert not errors.calls, errors.calls[:3]
                assert not eng._main_tasks[0].done(), "the engine's router loop died"

            return inner

        n = run_budget("live_engine", make)

        # the engine is unharmed: a real transfer works, and it counted the garbage
        async def check() -> None:
            t = torch.arange(rng.randrange(1, 100), dtype=torch.int32)
            await good.send("after-fuzz", t, to=eng.address, timeout=10)
            assert torch.equal(await eng.recv("after-fuzz", timeout=10), t)

        loop.run_until_complete(check())
        st_ = eng.statistics()
        assert sum(st_.protocol_errors.values()) > 0
        assert "internal" not in st_.protocol_errors, st_.protocol_errors
        assert not errors.calls, errors.calls[:3]
        assert n > 0
    finally:
        ctx.destroy(0)
        loop.run_until_complete(good.aclose())
        loop.run_until_complete(eng.aclose())
        loop.close()
