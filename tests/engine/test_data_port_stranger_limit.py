"""Hostile input 15: a stranger's first frame is bounded by the control-message limit.

Data frames (up to a tensor) arrive on a port of their own that lets a connection in
only after zmq's handshake authenticated it (PLAIN with the session token, checked by
the engine's ZAP handler; CURVE when configured). The control port's ``MAXMSGSIZE``
is therefore ``Limits.max_frame_bytes``: zmq drops a connection announcing a larger
frame before reading it. Before, both shared one port whose ``MAXMSGSIZE`` was
``max_tensor_bytes`` (16 GiB), and zmq read such a frame whole before the engine could
refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from support.procs import same_bytes
from zmq.utils.monitor import parse_monitor_message

import aiokv
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
CODEC = Codec()
MiB = 1 << 20


@pytest.fixture
async def zctx() -> Any:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def _welcome(ctx: zmq.asyncio.Context, addr: str) -> tuple[zmq.asyncio.Socket, m.Welcome]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{addr}")
    await s.send(CODEC.encode(m.Hello(m.PROTOCOL_VERSION, "t", "127.0.0.1:9", ("tcp",), None)))
    w = CODEC.decode((await asyncio.wait_for(s.recv_multipart(), 3))[0])
    assert isinstance(w, m.Welcome)
    return s, w


def _data_port(w: m.Welcome) -> int:
    ports = [int(c[5:]) for c in w.capabilities if c.startswith("data:")]
    assert len(ports) == 1, w.capabilities  # the engine announces its data port
    return ports[0]


async def _events(mon: zmq.asyncio.Socket, until: set[int], timeout: float) -> set[int]:
    """Monitor events of one socket until one of ``until`` shows (or the timeout)."""
    seen: set[int] = set()

    async def read() -> None:
        while not seen & until:
            seen.add(int(parse_monitor_message(await mon.recv_multipart())["event"]))

    try:
        await asyncio.wait_for(read(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        pass
    return seen


async def test_an_oversized_frame_on_the_control_port_is_dropped_unread(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    async with aiokv.Engine() as eng:
        before = dict(eng.statistics().protocol_errors)
        d = zctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RECONNECT_IVL, 60_000)  # one connection: its close is the verdict
        mon = d.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        d.connect(f"tcp://{eng.address}")
        await d.send(b"\x91" + b"\x00" * (8 * MiB))
        seen = await _events(mon, {zmq.EVENT_DISCONNECTED}, 3.0)
        assert zmq.EVENT_DISCONNECTED in seen  # zmq at the engine closed the connection
        assert not await d.poll(200)  # no reply: the engine itself never saw the frame
        assert eng.statistics().protocol_errors == before
        d.disable_monitor()
        mon.close(0)
        d.close(0)
        async with aiokv.Engine() as good:  # still serving, large tensors included
            t = torch.randn(2 * MiB)  # 8 MiB: over max_frame_bytes, on the data port
            await good.send("big", t, to=eng.address, timeout=10)
            assert same_bytes(await eng.recv("big", timeout=10), t)


def _stream_frame(port: int, claimed: int) -> int:
    """Speak ZMTP 3.0 (NULL) as a DEALER, announce one ``claimed``-byte frame and stream it;
    returns how many bytes of it the other end accepted before hanging up."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        s.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
        s.sendall(b"\x02" + struct.pack(">Q", claimed))
        chunk = b"\x00" * (256 * 1024)
        sent = 0
        try:
            while sent < claimed:
                sent += s.send(chunk[: claimed - sent])
        except OSError:  # reset / broken pipe / the peer stopped reading (timeout)
            pass
        return sent


async def test_the_control_port_hangs_up_before_reading_a_large_frame(
    anyio_backend: Any,
) -> None:
    """Raw TCP: how much of a frame announced as 64 MiB the engine's process takes in.

    Before: all of it (zmq read the whole frame, then the engine refused it).
    Now: zmq hangs up on the frame's header; only what the kernel buffers took is "sent".
    """
    async with aiokv.Engine() as eng:
        port = int(eng.address.rsplit(":", 1)[1])
        sent = await asyncio.to_thread(_stream_frame, port, 64 * MiB)
        assert sent < 16 * MiB, sent
        assert eng.statistics().protocol_errors == {}


async def test_the_data_port_lets_in_only_a_session_token(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    async with aiokv.Engine() as eng:
        ctrl, w = await _welcome(zctx, eng.address)
        port = _data_port(w)
        before = dict(eng.statistics().protocol_errors)
        failed = {
            zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            zmq.EVENT_DISCONNECTED,
        }
        strangers = []
        for password in (None, b"0" * 32, b"not hex", w.token.hex().upper().encode() + b"x"):
            d = zctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            if password is not None:
                d.setsockopt(zmq.PLAIN_USERNAME, b"aiokv")
                d.setsockopt(zmq.PLAIN_PASSWORD, password)
            mon = d.get_monitor_socket()
            d.connect(f"tcp://127.0.0.1:{port}")
            # a refused handshake may already have torn the pipe down: then a send has
            # nowhere to go (Again), which is the point; the checks below still apply
            # (zmq.asyncio: the Again of a NOBLOCK send arrives through the awaited future)
            with contextlib.suppress(zmq.Again):
                await d.send(CODEC.encode(m.DataHello(w.token)), zmq.NOBLOCK)
                await d.send(b"\x91" + b"\x00" * (8 * MiB), zmq.NOBLOCK)
            strangers.append((d, mon))
        for _d, mon in strangers:
            seen = await _events(mon, failed, 3.0)
            assert seen & failed, seen  # the handshake failed: nothing was delivered
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in seen
        await asyncio.sleep(0.1)
        assert eng.statistics().protocol_errors == before  # no frame of theirs reached it
        # the session's own token opens its data connection, once
        good = zctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        good.setsockopt(zmq.PLAIN_USERNAME, b"aiokv")
        good.setsockopt(zmq.PLAIN_PASSWORD, w.token.hex().encode())
        good.connect(f"tcp://127.0.0.1:{port}")
        await good.send(CODEC.encode(m.DataHello(w.token)))
        await ctrl.send(CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("a", "uint8", (4,)),))))
        (g,) = [CODEC.decode(f) for f in await asyncio.wait_for(ctrl.recv_multipart(), 3)]
        assert isinstance(g, m.Grant)
        await good.send_multipart([CODEC.encode(m.DataHeader(1, g.seq, 1)), b"abcd"])
        got = await eng.recv("a", timeout=3)
        assert bytes(got.numpy()) == b"abcd"
        for d, mon in strangers:
            d.disable_monitor()
            mon.close(0)
            d.close(0)
        good.close(0)
        ctrl.close(0)


async def test_a_fixed_data_port_is_used_and_announced(anyio_backend: Any) -> None:
    import socket as _socket

    with _socket.socket() as probe:  # a port free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with aiokv.Engine(aiokv.EngineConfig(data_port=port)) as b, aiokv.Engine() as a:
        assert b._server.state.data_port == port
        t = torch.arange(5.0)
        await a.send("x", t, to=b.address, timeout=5)
        assert torch.equal(await b.recv("x", timeout=5), t)
    with pytest.raises(aiokv.ConfigError):
        aiokv.EngineConfig(data_port=70000)
