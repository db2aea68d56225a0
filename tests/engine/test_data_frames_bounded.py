"""Hostile input 15, the data-frame part: bounded data frames on the data port.

zmq applies a socket's ``MAXMSGSIZE`` to every frame, the handshake's included, so a
stranger who never authenticates could make the data port buffer one frame as large as
the limit -- which was the largest tensor (``min(max_tensor_bytes, store_bytes)``, 2 GiB
by default). Tensors now travel in frames of at most ``DATA_FRAME_BYTES`` (1 MiB) and
the data port's limit is ``max(max_frame_bytes, DATA_FRAME_BYTES)``.

Here: the stranger (fails on the old code), the framing rule over real engines (PUT and
RESERVE paths, inline and worker reassembly), forged frame counts and lengths on an
authenticated data connection, and the loop's stall while a 256 MiB tensor is
reassembled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import threading
import time
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from support.procs import same_bytes

import aiokv
import aiokv.engine.client as client_mod
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec
from aiokv.transport import tcp

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
CODEC = Codec()
F = m.DATA_FRAME_BYTES
PUT_MAX = tcp.PUT_MAX_TENSOR_BYTES
MiB = 1 << 20
SIZES = [0, 1, F - 1, F, F + 1, 3 * F + 5]


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture
async def zctx() -> Any:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


# ---------------------------------------------------------------- the rule itself


def test_frame_rule_and_zero_copy_split() -> None:
    assert F == 1 << 20  # a 1 MiB tensor (bench control stream1m) is one frame
    for n in SIZES:
        t = _bytes(n, n)
        frames = tcp.tensor_frames(t)
        want = max(1, -(-n // F))
        assert len(frames) == tcp.frame_count(n) == want
        assert [len(f) for f in frames[:-1]] == [F] * (want - 1)
        assert len(frames[-1]) == n - F * (want - 1)
        assert b"".join(bytes(f) for f in frames) == bytes(tcp.tensor_buffer(t))
        if n:  # slices of the tensor's own memory: a later write shows through
            t[-1] ^= 0xFF
            assert bytes(frames[-1])[-1] == int(t[-1])


# ---------------------------------------------------------------- a stranger's frame


def _plain_stranger(
    port: int, claimed: int, streamed: threading.Event, hold: threading.Event
) -> tuple[int, bool]:
    """Speak ZMTP 3.0 with mechanism PLAIN (what the data port expects) and announce the
    handshake's first command as ``claimed`` bytes; stream all but its last byte, so a zmq
    that accepts the frame still holds it. Returns (bytes accepted, connection closed)."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"PLAIN".ljust(20, b"\x00") + b"\x00" * 32
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        try:
            s.sendall(greeting)
            s.sendall(b"\x06" + struct.pack(">Q", claimed))  # command frame, 8-byte size
            chunk = b"\x00" * (256 * 1024)
            while sent < claimed - 1:
                sent += s.send(chunk[: claimed - 1 - sent])
        except OSError:  # reset / broken pipe / the peer stopped reading (timeout)
            pass
        streamed.set()
        hold.wait(10)
        closed = False
        s.settimeout(2.0)
        try:
            while s.recv(65536):  # the engine's greeting, then EOF once it hung up
                pass
            closed = True
        except ConnectionError:
            closed = True
        except OSError:  # still open after 2 s
            pass
        return sent, closed


async def test_a_stranger_cannot_make_the_data_port_buffer_a_large_handshake_frame(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    """Before: the data port's MAXMSGSIZE was 2 GiB, so the whole 128 MiB command was read
    into the engine's process (RSS +128 MiB) while the connection stayed open. Now zmq hangs
    up on the frame's header. A legitimate peer streams multi-frame tensors all along."""
    claimed = 128 * MiB
    async with aiokv.Engine() as eng, aiokv.Engine() as good:
        stop = asyncio.Event()
        checked: list[int] = []
        bad: list[int] = []

        async def legit() -> None:
            k = 0
            while not stop.is_set():
                t = _bytes((64 * 1024, F, 3 * F + 5)[k % 3], k)
                await good.send(f"s{k}", t, to=eng.address, timeout=20)
                if not same_bytes(await eng.recv(f"s{k}", timeout=20), t):
                    bad.append(k)
                checked.append(k)
                k += 1

        stream = asyncio.ensure_future(legit())
        try:
            while len(checked) < 30:  # warmed up: the allocators hold their working set
                await asyncio.sleep(0.02)
            before = _rss()
            streamed, hold = threading.Event(), threading.Event()
            attack = asyncio.ensure_future(
                asyncio.to_thread(_plain_stranger, eng._server.state.data_port, claimed, streamed, hold)
            )
            while not streamed.is_set():
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # whatever zmq took is in its buffer now
            grown = _rss() - before
            hold.set()
            sent, closed = await attack
            n_during = len(checked)
            while len(checked) < n_during + 6:  # still streaming after the attack
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await stream
    assert sent < 16 * MiB, f"the data port took {sent} bytes of a stranger's frame"
    assert grown < 48 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    assert closed, "the stranger's connection is still open"
    assert not bad and len(checked) > 36


# ---------------------------------------------------------------- framing over real engines


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of transfers the sender put on credit (PUT) and reserved (RESERVE)."""
    seen = {"put": 0, "reserve": 0}
    cs = client_mod._ClientSession
    put, reserve = cs._post_put, cs._reserve

    def spy_put(self: Any, x: Any, *args: Any, **kwargs: Any) -> None:
        seen["put"] += 1
        put(self, x, *args, **kwargs)

    def spy_reserve(self: Any, x: Any, *args: Any, **kwargs: Any) -> None:
        seen["reserve"] += 1
        reserve(self, x, *args, **kwargs)

    monkeypatch.setattr(cs, "_post_put", spy_put)
    monkeypatch.setattr(cs, "_reserve", spy_reserve)
    return seen


def _curve_pair(keys: str) -> tuple[aiokv.EngineConfig, aiokv.EngineConfig]:
    """Two engines' configurations with CURVE on: ``secret`` (one shared secret) or
    ``keypairs`` (a key pair each, every side allowing only the other's key)."""
    if keys == "secret":
        c = aiokv.CurveConfig.from_secret("the cluster's shared secret, long enough")
        return aiokv.EngineConfig(curve=c), aiokv.EngineConfig(curve=c)
    assert keys == "keypairs"
    (pa, sa), (pb, sb) = zmq.curve_keypair(), zmq.curve_keypair()
    ca = aiokv.CurveConfig(pa, sa, frozenset({pb}), default_server_key=pb)
    cb = aiokv.CurveConfig(pb, sb, frozenset({pa}), default_server_key=pa)
    return aiokv.EngineConfig(curve=ca), aiokv.EngineConfig(curve=cb)


def _pair(mode: str) -> tuple[aiokv.EngineConfig, aiokv.EngineConfig]:
    return (aiokv.EngineConfig(), aiokv.EngineConfig()) if mode == "clear" else _curve_pair(mode)


MODES = ["clear", "secret", "keypairs"]
#: around one data frame (CURVE adds its overhead to each on the wire), several, and large
CURVE_SIZES = [1, F - 64, F - 34, F - 33, F - 1, F, F + 1, 3 * F, 64 * MiB]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keys", ["secret", "keypairs"])
@pytest.mark.parametrize("n", CURVE_SIZES)
async def test_curve_carries_every_size_bit_exact(anyio_backend: Any, keys: str, n: int) -> None:
    """CURVE encrypts each frame into a larger one on the wire: a full 1 MiB data frame
    must still fit the data port's limit (it was hung up: every tensor of about 1 MiB
    or more was lost)."""
    ca, cb = _curve_pair(keys)
    async with aiokv.Engine(ca) as a, aiokv.Engine(cb) as b:
        t = _bytes(n, n % 997)
        await a.send("t", t, to=b.address, timeout=30)
        assert same_bytes(await b.recv("t", frm=a.address, timeout=30), t), n
        # and the other way, in the same run (each side is the other's client)
        u = _bytes(n, n % 991 + 1)
        await b.send("u", u, to=a.address, timeout=30)
        assert same_bytes(await a.recv("u", timeout=30), u), n
        assert a.statistics().peers_lost == b.statistics().peers_lost == 0


@pytest.mark.parametrize("mode", MODES)
async def test_sizes_round_trip_on_credit_and_tensors_over_the_put_limit_reserve(
    anyio_backend: Any, paths: dict[str, int], mode: str
) -> None:
    ca, cb = _pair(mode)
    async with aiokv.Engine(ca) as a, aiokv.Engine(cb) as b:
        for i, n in enumerate([*SIZES, PUT_MAX + 1]):
            t = _bytes(n, 100 + i)
            await a.send(f"one{i}", t, to=b.address, timeout=20)
            assert same_bytes(await b.recv(f"one{i}", timeout=20), t), n
        # up to PUT_MAX_TENSOR_BYTES (several frames, reassembled on landing): PUT;
        # one byte more: RESERVE
        assert paths == {"put": 6, "reserve": 1}
        small = {f"m{i}": _bytes(n, 200 + i) for i, n in enumerate(SIZES[:4])}
        small["f32"] = torch.randn(F // 4)  # exactly one frame, float32
        await a.send_many(small, to=b.address, timeout=20)
        for k, t in small.items():
            assert same_bytes(await b.recv(k, timeout=20), t), k
        assert paths == {"put": 7, "reserve": 1}


@pytest.mark.parametrize("mode", MODES)
async def test_sizes_round_trip_on_the_reserve_path_inline_and_in_a_worker(
    anyio_backend: Any, paths: dict[str, int], mode: str
) -> None:
    # a one-byte window: everything from 2 bytes up is reserved
    ca, cb = _pair(mode)
    rx = dataclasses.replace(cb, limits=aiokv.Limits(credit_bytes=1))
    async with aiokv.Engine(ca) as a, aiokv.Engine(rx) as b:
        for i, n in enumerate(SIZES[2:]):  # F+1: inline (<= 2 MiB); 3F+5: worker thread
            t = _bytes(n, 300 + i)
            await a.send(f"one{i}", t, to=b.address, timeout=20)
            assert same_bytes(await b.recv(f"one{i}", timeout=20), t), n
        assert paths == {"put": 0, "reserve": 4}
        # one DATA message: every size, several dtypes and shapes, frames back to back
        many = {f"m{i}": _bytes(n, 400 + i) for i, n in enumerate(SIZES)}
        many["f32"] = torch.randn(3, F // 4 + 7)  # 3F + 84 bytes
        many["i16"] = torch.randint(-(2**15), 2**15, (F // 2 + 1,), dtype=torch.int16)
        many["bool"] = torch.rand(F + 3) > 0.5
        many["empty2d"] = torch.empty(0, 5, dtype=torch.float64)
        await a.send_many(many, to=b.address, timeout=20)
        for k, t in many.items():
            assert same_bytes(await b.recv(k, timeout=20), t), k
        assert paths == {"put": 0, "reserve": 5}
        # the same over credit for what fits one frame, reserved for the rest, in flight
        # together (the worker's landing and later inline ones interleave)
        hs = [
            a.send_nowait(f"x{i}", _bytes(n, 500 + i), to=b.address, timeout=20)
            for i, n in enumerate(SIZES * 3)
        ]
        for h in hs:
            await h
        for i, n in enumerate(SIZES * 3):
            assert same_bytes(await b.recv(f"x{i}", timeout=20), _bytes(n, 500 + i)), i


# ---------------------------------------------------------------- forged frames


async def _session(
    ctx: zmq.asyncio.Context, eng: aiokv.Engine, credit: bool
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, m.Welcome]:
    """A hand-made peer: control connection after HELLO, authenticated data connection."""
    ctrl = ctx.socket(zmq.DEALER)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.connect(f"tcp://{eng.address}")
    caps = ("tcp", "credit") if credit else ("tcp",)
    await ctrl.send(CODEC.encode(m.Hello(m.PROTOCOL_VERSION, "forger", "127.0.0.1:9", caps, None)))
    msgs = [CODEC.decode(f) for f in await asyncio.wait_for(ctrl.recv_multipart(), 5)]
    w = msgs[0]
    assert isinstance(w, m.Welcome)
    if credit:
        assert any(isinstance(x, m.Ack) and x.add_bytes > 4 * F for x in msgs), msgs
    data = ctx.socket(zmq.DEALER)
    data.setsockopt(zmq.LINGER, 0)
    data.setsockopt(zmq.PLAIN_USERNAME, b"aiokv")
    data.setsockopt(zmq.PLAIN_PASSWORD, w.token.hex().encode())
    data.connect(f"tcp://127.0.0.1:{eng._server.state.data_port}")
    await data.send(CODEC.encode(m.DataHello(w.token)))
    return ctrl, data, w


def _spec(n: int) -> tuple[m.TensorSpec, ...]:
    return (m.TensorSpec("x", "uint8", (n,)),)


# (name, PUT?, tensor bytes, DATA header count, frame lengths sent)
FORGED = [
    ("one frame short", False, 3 * F + 5, 1, [F, F, F]),
    ("one frame too many", False, 3 * F + 5, 1, [F, F, F, 5, 1]),
    ("a short frame in the middle", False, 3 * F + 5, 1, [F, F, F - 1, 6]),
    ("a long last frame", False, F + 1, 1, [F, 2]),
    ("a one-frame tensor split", False, F - 1, 1, [F // 2, F // 2 - 1]),
    ("an empty tensor without its frame", False, 0, 1, []),
    ("header counts two tensors", False, F + 1, 2, [F, 1]),
    ("PUT of a tensor over the PUT limit", True, PUT_MAX + 1, 1, [F, F, F, F, 1]),
    ("PUT of a multi-frame tensor, a frame short", True, 2 * F + 1, 1, [F, F]),
    ("PUT of a multi-frame tensor, a short first frame", True, F + 1, 1, [F - 1, 2]),
    ("PUT with a short frame", True, F - 1, 1, [F - 2]),
]


@pytest.mark.parametrize("case", FORGED, ids=[c[0] for c in FORGED])
async def test_a_wrong_frame_count_or_length_is_a_protocol_error_and_nothing_lands(
    anyio_backend: Any,
    zctx: zmq.asyncio.Context,
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[str, bool, int, int, list[int]],
) -> None:
    _name, put, n, count, lengths = case
    allocated: list[int] = []
    real = tcp.assemble

    def spy(specs: Any, frames: list[Any]) -> list[torch.Tensor]:
        allocated.append(len(frames))
        return real(specs, frames)

    monkeypatch.setattr(tcp, "assemble", spy)
    async with aiokv.Engine() as eng:
        ctrl, data, _w = await _session(zctx, eng, credit=put)
        frames = [b"\x5a" * k for k in lengths]
        if put:
            await data.send_multipart([CODEC.encode(m.Put(1, _spec(n))), *frames])
        else:
            await ctrl.send(CODEC.encode(m.Reserve(1, "tcp", _spec(n))))
            (g,) = [CODEC.decode(f) for f in await asyncio.wait_for(ctrl.recv_multipart(), 5)]
            assert isinstance(g, m.Grant)
            await data.send_multipart([CODEC.encode(m.DataHeader(1, g.seq, count)), *frames])
        msgs = [CODEC.decode(f) for f in await asyncio.wait_for(ctrl.recv_multipart(), 5)]
        ctrl.close(0)  # (a zmq DEALER would reconnect, with nothing to say, and be hung up)
        data.close(0)
        assert any(isinstance(x, m.ErrorMsg) and x.code == "protocol" for x in msgs), msgs
        st = eng.statistics()
        assert st.transfers_received == 0 and st.tensors_received == 0
        assert sum(st.protocol_errors.values()) >= 1
        assert not allocated  # checked before anything was allocated
        with pytest.raises(aiokv.AiokvTimeoutError):
            await eng.recv("x", timeout=0.2)
        # the engine still serves a well-formed peer, multi-frame tensors included
        async with aiokv.Engine() as good:
            t = _bytes(3 * F + 5, 9)
            await good.send("ok", t, to=eng.address, timeout=10)
            assert same_bytes(await eng.recv("ok", timeout=10), t)


async def test_forged_but_correct_frames_land(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    """The hand-made peer of the test above, sending what the rule says: it lands (so the
    refusals above are about the frames, not about the forger)."""
    async with aiokv.Engine() as eng:
        ctrl, data, _w = await _session(zctx, eng, credit=True)
        t = _bytes(3 * F + 5, 1)
        await ctrl.send(CODEC.encode(m.Reserve(1, "tcp", _spec(3 * F + 5))))
        (g,) = [CODEC.decode(f) for f in await asyncio.wait_for(ctrl.recv_multipart(), 5)]
        assert isinstance(g, m.Grant)
        await data.send_multipart(
            [CODEC.encode(m.DataHeader(1, g.seq, 1)), *tcp.tensor_frames(t)], copy=False
        )
        assert same_bytes(await eng.recv("x", timeout=5), t)
        u = _bytes(F, 2)
        spec = (m.TensorSpec("y", "uint8", (F,)),)
        await data.send_multipart([CODEC.encode(m.Put(2, spec)), *tcp.tensor_frames(u)])
        assert same_bytes(await eng.recv("y", timeout=5), u)
        v = _bytes(2 * F + 3, 3)  # several frames, on credit: reassembled as it lands
        spec = (m.TensorSpec("z", "uint8", (2 * F + 3,)),)
        await data.send_multipart([CODEC.encode(m.Put(3, spec)), *tcp.tensor_frames(v)])
        assert same_bytes(await eng.recv("z", timeout=5), v)
        ctrl.close(0)
        data.close(0)


# ---------------------------------------------------------------- the loop while reassembling


async def test_reassembling_256_mib_does_not_stall_the_loop(anyio_backend: Any) -> None:
    """256 frames copied together off the loop: the loop thread's CPU time between two
    2 ms ticks stays under 50 ms (copied on the loop it took ~130-400 ms here)."""
    n = 256 * MiB
    t = torch.empty(n, dtype=torch.uint8)
    t[::4096] = torch.arange(n // 4096, dtype=torch.int64).to(torch.uint8)  # pages differ
    t[-1] = 7
    busy: list[float] = []
    wall: list[float] = []
    stop = False

    async def ticker() -> None:
        while not stop:
            c, w = time.thread_time(), time.perf_counter()
            await asyncio.sleep(0.002)
            busy.append(time.thread_time() - c)
            wall.append(time.perf_counter() - w)

    async with aiokv.Engine() as a, aiokv.Engine() as b:
        await a.send("warm", torch.ones(4), to=b.address, timeout=10)
        await b.recv("warm", timeout=10)
        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        await a.send("big", t, to=b.address, timeout=30)
        got = await b.recv("big", timeout=30)
        await asyncio.sleep(0.05)
        stop = True
        await tick
    print(f"256 MiB: loop busy at most {max(busy) * 1e3:.1f} ms, late {max(wall) * 1e3:.1f} ms")
    assert max(busy) <= 0.050, f"the loop was busy {max(busy) * 1e3:.1f} ms at a stretch"
    assert same_bytes(got, t)
