"""Hostile peers: raw zmq DEALERs and raw TCP sockets throw garbage at an engine's port.

Each bad input gets an ERROR reply where a reply is possible and a counter
bump in ``statistics().protocol_errors``; the engine keeps serving (a normal
send afterwards succeeds).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from support.procs import same_bytes

import aiokv
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
CODEC = Codec()


async def _dealer(ctx: zmq.asyncio.Context, addr: str) -> zmq.asyncio.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{addr}")
    return s


def _data_port(w: m.Welcome) -> int:
    """The data port a WELCOME announced (capability ``data:<port>``)."""
    return next(int(c[5:]) for c in w.capabilities if c.startswith("data:"))


async def _data_dealer(
    ctx: zmq.asyncio.Context, addr: str, w: m.Welcome, token: bytes | None
) -> zmq.asyncio.Socket:
    """A DEALER to the engine's data port; ``token``: PLAIN password (None: no credentials)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if token is not None:
        s.setsockopt(zmq.PLAIN_USERNAME, b"aiokv")
        s.setsockopt(zmq.PLAIN_PASSWORD, token.hex().encode())
    s.connect(f"tcp://{addr.rsplit(':', 1)[0]}:{_data_port(w)}")
    return s


async def _reply(s: zmq.asyncio.Socket, timeout: float = 3.0) -> m.Message:
    frames = await asyncio.wait_for(s.recv_multipart(), timeout)
    return CODEC.decode(frames[-1])


async def _healthy(eng: aiokv.Engine) -> None:
    async with aiokv.Engine(aiokv.EngineConfig()) as good:
        t = torch.randn(100)
        await good.send("after-attack", t, to=eng.address, timeout=10)
        assert same_bytes(await eng.recv("after-attack", timeout=5), t)


def _errors(eng: aiokv.Engine) -> int:
    return sum(eng.statistics().protocol_errors.values())


async def test_garbage_frames_from_raw_dealer_get_errors(anyio_backend: Any) -> None:
    ctx = zmq.asyncio.Context()
    try:
        async with aiokv.Engine(aiokv.EngineConfig()) as eng:
            cases: list[tuple[list[bytes], str]] = [
                ([b"\xc1\xc1garbage"], "malformed"),
                ([msgpack.packb({"a": 1})], "malformed"),
                ([msgpack.packb([99, 1, 2])], "unknown_kind"),
                ([msgpack.packb([m.Grant.KIND, "x", 1])], "bad_field"),
                (
                    [b"\x91" + b"\x00" * (512 << 10)],
                    "frame_too_large",
                ),  # over the pre-HELLO limit (64 KiB); over 1 MiB zmq drops it unread
                (
                    [CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("a", "uint8", (1,)),)))],
                    "no_session",
                ),
                # DATA_HELLO belongs on the data port: here it is a message before HELLO
                ([CODEC.encode(m.DataHello(b"\x00" * 16))], "no_session"),
                ([msgpack.packb([m.Reserve.KIND, 1, "tcp", [["a", "object", [1]]]])], "bad_spec"),
                ([msgpack.packb([m.Hello.KIND, 1, 5, "x:1", [], None])], "bad_field"),
            ]
            for frames, code in cases:
                s = await _dealer(ctx, eng.address)
                before = eng.statistics().protocol_errors.get(code, 0)
                await s.send_multipart(frames)
                reply = await _reply(s)
                assert isinstance(reply, m.ErrorMsg), (code, reply)
                assert eng.statistics().protocol_errors.get(code, 0) == before + 1, (
                    code,
                    eng.statistics().protocol_errors,
                )
                s.close()
            # a HELLO with the wrong version
            s = await _dealer(ctx, eng.address)
            await s.send(CODEC.encode(m.Hello(99, "evil", "127.0.0.1:1", (), None)))
            assert isinstance(await _reply(s), m.ErrorMsg)
            s.close()
            # random bytes, many connections
            for i in range(50):
                s = await _dealer(ctx, eng.address)
                await s.send(os.urandom(1 + i * 7))
                assert isinstance(await _reply(s), m.ErrorMsg)
                s.close()
            assert _errors(eng) >= len(cases) + 50
            assert eng.statistics().server_sessions == 0
            await _healthy(eng)
    finally:
        ctx.destroy(linger=0)


async def test_hostile_peer_after_handshake_is_dropped_alone(anyio_backend: Any) -> None:
    ctx = zmq.asyncio.Context()
    try:
        async with aiokv.Engine(
            aiokv.EngineConfig(limits=aiokv.Limits(store_bytes=1 << 20))
        ) as eng:
            async with aiokv.Engine(aiokv.EngineConfig()) as good:
                await good.connect(eng.address)  # an honest session that must survive
                for attack in (
                    "grant_from_client",
                    "data_without_grant",
                    "dup_reserve_xfer",
                    "huge_shape",
                    "garbage",
                ):
                    s = await _dealer(ctx, eng.address)
                    await s.send(
                        CODEC.encode(
                            m.Hello(
                                m.PROTOCOL_VERSION, f"evil-{attack}", "127.0.0.1:9", ("tcp",), None
                            )
                        )
                    )
                    w = await _reply(s)
                    assert isinstance(w, m.Welcome)
                    spec = (m.TensorSpec("a", "uint8", (16,)),)
                    if attack == "grant_from_client":
                        await s.send(CODEC.encode(m.Grant(1, 0)))
                    elif attack == "data_without_grant":
                        await s.send(CODEC.encode(m.DataHeader(1, 0, 1)))
                    elif attack == "dup_reserve_xfer":
                        await s.send(CODEC.encode(m.Reserve(1, "tcp", spec)))
                        assert isinstance(await _reply(s), m.Grant)
                        await s.send(
                            CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("b", "uint8", (1,)),)))
                        )
                    elif attack == "huge_shape":
                        await s.send(
                            msgpack.packb(
                                [m.Reserve.KIND, 1, "tcp", [["a", "float64", [1 << 40, 1 << 40]]]]
                            )
                        )
                    else:
                        await s.send(os.urandom(100))
                    reply = await _reply(s)
                    assert isinstance(reply, m.ErrorMsg), (attack, reply)
                    s.close()
                # over the budget but within the limits: a clean REFUSE, not an error
                s = await _dealer(ctx, eng.address)
                await s.send(
                    CODEC.encode(
                        m.Hello(m.PROTOCOL_VERSION, "greedy", "127.0.0.1:9", ("tcp",), None)
                    )
                )
                assert isinstance(await _reply(s), m.Welcome)
                await s.send(
                    CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("a", "uint8", (2 << 20,)),)))
                )
                r = await _reply(s)
                assert isinstance(r, m.Refuse) and r.code == "too_large"
                s.close()
                st = eng.statistics()
                assert (
                    st.store is not None and st.store.reserved_bytes == 0
                )  # the dropped sessions' grants were released
                t = torch.arange(10)
                await good.send("still-fine", t, to=eng.address, timeout=10)
                assert same_bytes(await eng.recv("still-fine", timeout=5), t)
                assert good.statistics().peers_lost == 0
            await _healthy(eng)
    finally:
        ctx.destroy(linger=0)


async def test_data_connection_attacks(anyio_backend: Any) -> None:
    ctx = zmq.asyncio.Context()
    try:
        async with aiokv.Engine(aiokv.EngineConfig()) as eng:
            s = await _dealer(ctx, eng.address)
            await s.send(
                CODEC.encode(m.Hello(m.PROTOCOL_VERSION, "evil", "127.0.0.1:9", ("tcp",), None))
            )
            w = await _reply(s)
            assert isinstance(w, m.Welcome)
            d = await _data_dealer(ctx, eng.address, w, w.token)
            await d.send(CODEC.encode(m.DataHello(w.token)))
            await s.send(CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("a", "float32", (4,)),))))
            g = await _reply(s)
            assert isinstance(g, m.Grant)
            before = _errors(eng)
            # the granted transfer, but 3 bytes instead of 16
            await d.send_multipart([CODEC.encode(m.DataHeader(1, g.seq, 1)), b"abc"])
            await asyncio.sleep(0.3)
            assert _errors(eng) == before + 1, eng.statistics().protocol_errors
            assert eng.statistics().server_sessions == 0
            with pytest.raises(aiokv.TransferTimeoutError):
                await eng.recv("a", timeout=0.2)
            # a second data connection with a used token (of a session now gone), and one
            # without credentials: zmq's handshake fails, nothing of theirs reaches the engine
            before = dict(eng.statistics().protocol_errors)
            d2 = await _data_dealer(ctx, eng.address, w, w.token)
            d3 = await _data_dealer(ctx, eng.address, w, None)
            for x in (d2, d3):
                x.send(CODEC.encode(m.DataHello(w.token)))
                x.send_multipart([CODEC.encode(m.DataHeader(1, g.seq, 1)), b"x" * 16])
            await asyncio.sleep(0.3)
            after = dict(eng.statistics().protocol_errors)
            assert after == before
            for x in (d2, d3):
                assert not await x.poll(100)
            for x in (s, d, d2, d3):
                x.close()
            await _healthy(eng)
    finally:
        ctx.destroy(linger=0)


async def test_raw_tcp_garbage_and_stalled_handshakes(anyio_backend: Any) -> None:
    async with aiokv.Engine(aiokv.EngineConfig()) as eng:
        host, port = eng.address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        socks = []
        for i in range(20):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, (host, int(port)))
            if i % 4 == 0:
                pass  # connect and say nothing
            elif i % 4 == 1:
                await loop.sock_sendall(s, os.urandom(4096))
            elif i % 4 == 2:  # a ZMTP-looking greeting, then nonsense
                await loop.sock_sendall(
                    s, b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 16 + os.urandom(512)
                )
            else:  # claims a huge frame
                await loop.sock_sendall(
                    s,
                    b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x00NULL"
                    + b"\x00" * 48
                    + b"\x02\xff" * 8,
                )
            socks.append(s)
        await asyncio.sleep(0.2)
        await _healthy(eng)  # served while the junk connections are still open
        for s in socks:
            s.close()
        await asyncio.sleep(0.1)
        await _healthy(eng)


@pytest.mark.timeout(90)
async def test_strangers_flooding_reservations_never_fail_an_established_peers_sends(
    anyio_backend: Any,
) -> None:
    """Ten sessions that never authenticated each send ONE zmq message of 1,000 RESERVEs of
    64 zero-byte tensors (no bytes: only the store's tensor count bounds them). A peer whose
    session was open before must still send: its standing credit -- bytes and tensors -- is
    set aside for it, so nothing the strangers hoard is refused to it as "busy"; and what
    they may queue is bounded by each session's share (granted and queued tensors)."""
    flood = [
        CODEC.encode(
            m.Reserve(i, "tcp", tuple(m.TensorSpec(f"s{i}.{j}", "uint8", (0,)) for j in range(64)))
        )
        for i in range(1, 1001)
    ]
    ctx = zmq.asyncio.Context()
    try:
        async with aiokv.Engine() as eng, aiokv.Engine() as legit:
            await legit.send("warm", torch.ones(4), to=eng.address, timeout=10)
            await eng.recv("warm", timeout=5)
            share = eng.config.limits.store_tensors // 4
            socks = []
            for k in range(10):
                s = await _dealer(ctx, eng.address)
                await s.send(
                    CODEC.encode(
                        m.Hello(m.PROTOCOL_VERSION, f"f{k}", "127.0.0.1:9", ("tcp",), None)
                    )
                )
                assert isinstance(await _reply(s), m.Welcome)
                socks.append(s)
            for s in socks:
                await s.send_multipart(flood, copy=False)
            cap = eng.config.limits.store_tensors
            window = eng.config.limits.credit_tensors

            def hoarded() -> bool:
                st = eng.statistics()
                assert st.store is not None
                return st.store.pending_tensors + 64 > cap - window

            deadline = asyncio.get_running_loop().time() + 30
            while not hoarded():
                assert asyncio.get_running_loop().time() < deadline, eng.statistics()
                await asyncio.sleep(0.02)
            st = eng.statistics()
            # what strangers queue is bounded: all sessions' queue (a quarter of the count)
            # plus one transfer's allowance each, whatever their number
            own = eng.config.limits.max_tensors_per_transfer
            assert st.queued_reservations * 64 <= share + 10 * own, st.queued_reservations
            tensors = {
                f"x{i}": torch.randint(0, 256, (1000 + i,), dtype=torch.uint8) for i in range(300)
            }
            await asyncio.gather(
                *(legit.send(k, t, to=eng.address, timeout=20) for k, t in tensors.items())
            )
            for k, t in tensors.items():
                assert same_bytes(await eng.recv(k, timeout=10), t), k
            assert legit.statistics().peers_lost == 0
            for s in socks:
                s.close()
    finally:
        ctx.destroy(0)
