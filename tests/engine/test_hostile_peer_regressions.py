"""Regression tests for the engine-side findings of the outside probes (hostile inputs).

Each test reproduces one finding against a real engine on loopback (raw zmq
DEALERs or raw TCP sockets play the hostile peer) and failed before its fix.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from support.procs import same_bytes

import aiokv
import aiokv.engine.server_state
from aiokv.engine.store import PeerRef
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
CODEC = Codec()
KiB = 1024


async def _dealer(ctx: zmq.asyncio.Context, addr: str) -> zmq.asyncio.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{addr}")
    return s


async def _next(s: zmq.asyncio.Socket, timeout: float = 3.0) -> list[m.Message]:
    frames = await asyncio.wait_for(s.recv_multipart(), timeout)
    return [CODEC.decode(f) for f in frames]


async def _hello(
    ctx: zmq.asyncio.Context, addr: str, engine_id: str, listen: str
) -> tuple[zmq.asyncio.Socket, m.Welcome]:
    s = await _dealer(ctx, addr)
    await s.send(CODEC.encode(m.Hello(m.PROTOCOL_VERSION, engine_id, listen, ("tcp",), None)))
    (w,) = await _next(s)
    assert isinstance(w, m.Welcome)
    return s, w


@pytest.fixture
async def zctx() -> Any:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


# ---------------------------------------------------------------- 1: cancellation


async def test_cancelled_recv_raises_even_when_the_data_lands_in_the_same_pass(
    anyio_backend: Any,
) -> None:
    """Python <= 3.11 ``wait_for(shield(...))`` returned the tensor to a cancelled caller."""
    async with aiokv.Engine() as eng:
        peer = PeerRef("someone", "127.0.0.1:1")
        for i in range(30):
            tid = f"t{i}"
            task = asyncio.create_task(eng.recv(tid, timeout=5))
            await asyncio.sleep(0)  # the waiter is registered
            value = torch.full((1,), float(i))
            if i % 2:  # RESERVE path: reserved, then landed
                assert eng._store.try_reserve(peer, [(tid, 4)])
                eng._store.land(peer, tid, value)
            else:  # PUT path: reserved and landed in one step
                assert eng._store.try_land(peer, [(tid, 4, value)])
            task.cancel()  # same loop pass as the landing
            with pytest.raises(asyncio.CancelledError):
                await task
            # nothing is lost: the tensor went back to the store
            assert (await eng.recv(tid, timeout=1)).item() == float(i)


# ---------------------------------------------------------------- 4-8: careless callers


async def test_meta_tensors_are_refused_up_front(anyio_backend: Any) -> None:
    async with aiokv.Engine() as a, aiokv.Engine() as b:
        meta = torch.empty(1000, device="meta")
        with pytest.raises(aiokv.ConfigError, match="dense CPU or CUDA"):
            await a.send("x", meta, to=b.address)
        with pytest.raises(aiokv.ConfigError):
            a.send_nowait("x", meta, to=b.address)
        with pytest.raises(aiokv.ConfigError):
            a.publish("x", meta)
        # the engine still works
        await a.send("y", torch.ones(3), to=b.address, timeout=5)
        assert same_bytes(await b.recv("y", timeout=5), torch.ones(3))


async def test_bad_ids_and_timeouts_fail_locally_and_harm_no_other_transfer(
    anyio_backend: Any,
) -> None:
    async with aiokv.Engine() as a, aiokv.Engine() as b:
        await a.connect(b.address)
        t = torch.randn(1000)
        h = a.send_nowait("inflight", t, to=b.address, timeout=10)
        with pytest.raises(aiokv.ConfigError):
            await a.get("x" * 600, frm=b.address, timeout=5)
        t0 = time.monotonic()
        with pytest.raises(aiokv.ConfigError):
            await a.recv("y" * 100_000, timeout=5)
        assert time.monotonic() - t0 < 1.0  # refused at once, not waited out
        for bad in (-1, 0, float("nan"), float("inf")):
            with pytest.raises(aiokv.ConfigError):
                await a.recv("z", timeout=bad)
            with pytest.raises(aiokv.ConfigError):
                await a.send("z", t, to=b.address, timeout=bad)
        await h  # the unrelated transfer was not touched
        assert same_bytes(await b.recv("inflight", timeout=5), t)
        assert a.statistics().protocol_errors == {}
        assert b.statistics().protocol_errors == {}


async def test_start_after_aclose_is_an_error(anyio_backend: Any) -> None:
    eng = aiokv.Engine()
    await eng.start()
    await eng.aclose()
    with pytest.raises(aiokv.EngineClosedError):
        await eng.start()


async def test_cuda_device_without_cuda_is_refused(anyio_backend: Any) -> None:
    devices = ["cuda:99"]
    if not torch.cuda.is_available():
        devices.append("cuda:0")
    for dev in devices:
        eng = aiokv.Engine(aiokv.EngineConfig(device=dev, transport="tcp"))
        with pytest.raises(aiokv.ConfigError, match="CUDA"):
            await eng.start()


@pytest.mark.parametrize("path", ["reserve", "credit"])
async def test_thousands_of_send_nowait_in_one_pass(anyio_backend: Any, path: str) -> None:
    """4,097+ RESERVEs in one loop pass once made one zmq message the peer refused."""
    # both engines share one (debug-mode, slow) loop here: no heartbeat verdicts
    slow = aiokv.Timeouts(heartbeat_interval=1, heartbeat_timeout=60)
    # credit_bytes=1: every transfer takes the RESERVE path (protocol v1 messages)
    lim = aiokv.Limits(credit_bytes=1) if path == "reserve" else aiokv.Limits()
    async with (
        aiokv.Engine(aiokv.EngineConfig(timeouts=slow)) as a,
        aiokv.Engine(aiokv.EngineConfig(timeouts=slow, limits=lim)) as b,
    ):
        await a.connect(b.address)
        n = 4200  # over the peer's frames-per-message limit if sent as one message
        handles = [a.send_nowait(f"s{i}", torch.tensor([i]), to=b.address) for i in range(n)]
        got = await b.recv_many([f"s{i}" for i in range(n)], timeout=30)
        await asyncio.wait_for(asyncio.gather(*handles), 30)
        assert [int(v.item()) for v in got.values()] == list(range(n))
        assert b.statistics().protocol_errors == {}


# ---------------------------------------------------------------- 11: grants and quotas


async def test_granted_but_never_sent_reservation_expires(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    cfg = aiokv.EngineConfig(
        timeouts=aiokv.Timeouts(transfer=0.5), limits=aiokv.Limits(store_bytes=1 << 20)
    )
    async with aiokv.Engine(cfg) as eng:
        s, _ = await _hello(zctx, eng.address, "hoarder", "127.0.0.1:9")
        await s.send(CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("a", "uint8", (900 * KiB,)),))))
        (g,) = await _next(s)
        assert isinstance(g, m.Grant)
        assert eng.statistics().store.reserved_bytes == 900 * KiB  # type: ignore[union-attr]
        deadline = time.monotonic() + 5
        failed = None
        while failed is None and time.monotonic() < deadline:
            for msg in await _next(s, 5):
                if isinstance(msg, m.Failed):
                    failed = msg
        assert failed is not None and failed.xfer == 1 and failed.code == "timeout"
        assert eng.statistics().store.reserved_bytes == 0  # type: ignore[union-attr]
        # late data of the expired grant is dropped, the session survives
        data = await _dealer(zctx, eng.address)
        s.close()
        data.close()
        async with aiokv.Engine() as good:
            t = torch.randn(200_000)  # 800 KB: fits only because the hoard was released
            await good.send("ok", t, to=eng.address, timeout=5)
            assert same_bytes(await eng.recv("ok", timeout=5), t)


async def test_reservations_per_session_are_bounded_granted_included(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    """Zero-byte tensors cost no budget: grants in flight are capped per session."""
    cap = aiokv.engine.server_state._MAX_GRANTED_PER_SESSION
    async with aiokv.Engine() as eng:
        s, _ = await _hello(zctx, eng.address, "hoarder", "127.0.0.1:9")
        n = cap + 500
        for lo in range(1, n + 1, 1000):
            await s.send_multipart(
                [
                    CODEC.encode(m.Reserve(i, "tcp", (m.TensorSpec(f"e{i}", "uint8", (0,)),)))
                    for i in range(lo, min(lo + 1000, n + 1))
                ]
            )
        got: list[m.Message] = []
        while len(got) < n:
            got += await _next(s, 10)
        assert sum(isinstance(x, m.Grant) for x in got) == cap
        refused = [x for x in got if isinstance(x, m.Refuse)]
        assert len(refused) == 500 and all(r.code == "busy" for r in refused)


@pytest.mark.timeout(30)
async def test_a_session_with_frames_waiting_in_its_inbox_is_not_judged_silent(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    """A peer that sent a backlog and waits for the replies is live while this end is
    still handling its frames, however long past the heartbeat timeout that takes."""
    async with aiokv.Engine() as eng:
        s, _ = await _hello(zctx, eng.address, "backlog", "127.0.0.1:9")
        (ss,) = eng._server.state.servers.values()
        # a frame that arrived and waits for its turn
        ss.inbox.append(
            zmq.Frame(CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("b", "uint8", (0,)),))))
        )
        later = time.monotonic() + 10 * eng.config.timeouts.heartbeat_timeout
        eng._server.housekeep(later)
        eng._server.housekeep(later + 1)  # the second look drops a silent session
        assert eng._server.state.servers.get(ss.rid) is ss
        assert eng.statistics().peers_lost == 0
        eng._server._wait_turn(ss)
        (g,) = await _next(s)
        assert isinstance(g, m.Grant) and g.xfer == 1


# ---------------------------------------------------------------- 12: identity claims


async def test_stranger_claiming_a_peers_engine_id_cannot_cancel_its_transfers(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    async with aiokv.Engine() as victim, aiokv.Engine() as legit:
        await legit.send("warm", torch.ones(1), to=victim.address, timeout=5)
        await victim.recv("warm", timeout=5)
        (ss,) = victim._server.state.servers.values()
        assert ss.peer is not None
        waiter = asyncio.create_task(victim.recv("x", frm=legit.address, timeout=10))
        await asyncio.sleep(0.01)
        # a granted, not yet landed transfer of the legit peer
        assert victim._store.try_reserve(ss.peer, [("x", 4)])
        s, _ = await _hello(zctx, victim.address, legit.engine_id, legit.address)
        await s.send(CODEC.encode(m.Bye()))
        await asyncio.sleep(0.3)
        assert not waiter.done(), waiter
        victim._store.land(ss.peer, "x", torch.tensor([7.0]))
        assert (await waiter).item() == 7.0
        assert victim.statistics().protocol_errors.get("identity_in_use") == 1


async def test_stranger_claiming_a_peers_address_cannot_inject_its_data(
    anyio_backend: Any,
) -> None:
    async with aiokv.Engine() as victim, aiokv.Engine() as legit, aiokv.Engine() as evil:
        await legit.connect(victim.address)
        evil._address = legit.address  # it announces the legit peer's listen address
        await evil.send("y", torch.full((4,), 66.0), to=victim.address, timeout=5)
        with pytest.raises(aiokv.TransferTimeoutError):
            await victim.recv("y", frm=legit.address, timeout=0.5)
        # the legit peer's own tensor under the same id is the one frm= selects
        await legit.send("y", torch.full((4,), 1.0), to=victim.address, timeout=5)
        assert (await victim.recv("y", frm=legit.address, timeout=5))[0].item() == 1.0
        # the stranger's tensor is still there for a caller who takes any peer's
        assert (await victim.recv("y", timeout=5))[0].item() == 66.0


# ---------------------------------------------------------------- 13: GET reply_to


async def test_get_reply_goes_only_to_the_requesting_session(anyio_backend: Any) -> None:
    async with (
        aiokv.Engine() as pub,
        aiokv.Engine() as third,
        aiokv.Engine() as evil,
    ):
        pub.publish("secret", torch.arange(10.0))
        cs = await evil._client(pub.address, aiokv.engine.engine._Deadline(5))
        replies = []
        for req in range(1, 301):
            fut: asyncio.Future[m.GetReply] = asyncio.get_running_loop().create_future()
            cs.gets[req] = fut
            target = third.address if req == 1 else f"127.0.0.1:{20000 + req}"
            cs._send_ctrl(cs.sess.send(m.Get(req, ("secret",), target)))
            replies.append(fut)
        done = await asyncio.wait_for(asyncio.gather(*replies), 10)
        assert {r.code for r in done} == {"bad_reply_to"}
        with pytest.raises(aiokv.TransferTimeoutError):
            await third.recv("secret", timeout=0.5)
        assert pub.statistics().client_sessions == 0  # no outbound session opened
        # an honest GET still works
        assert same_bytes(await evil.get("secret", frm=pub.address, timeout=5), torch.arange(10.0))


# ---------------------------------------------------------------- 14: fairness


async def test_a_queued_large_reservation_does_not_block_other_peers(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    cfg = aiokv.EngineConfig(limits=aiokv.Limits(store_bytes=1 << 20))
    async with aiokv.Engine(cfg) as eng:
        s, _ = await _hello(zctx, eng.address, "big", "127.0.0.1:9")

        async def keep_alive() -> None:  # the hostile session answers heartbeats
            for n in range(1, 1000):
                await s.send(CODEC.encode(m.Ping(n)))
                await asyncio.sleep(0.2)

        spec = (m.TensorSpec("big1", "uint8", (600 * KiB,)),)
        await s.send(CODEC.encode(m.Reserve(1, "tcp", spec)))
        (g,) = await _next(s)
        assert isinstance(g, m.Grant)
        pinger = asyncio.create_task(keep_alive())
        spec2 = (m.TensorSpec("big2", "uint8", (600 * KiB,)),)
        await s.send(CODEC.encode(m.Reserve(2, "tcp", spec2)))  # queued: does not fit
        await asyncio.sleep(0.1)
        async with aiokv.Engine() as good:
            for i in range(5):
                t = torch.randn(10_000)
                await good.send(f"small{i}", t, to=eng.address, timeout=1.5)
                assert same_bytes(await eng.recv(f"small{i}", timeout=3), t)
        pinger.cancel()
        s.close()


async def test_withdrawing_many_queued_reservations_is_linear(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    cfg = aiokv.EngineConfig(
        limits=aiokv.Limits(store_bytes=1 << 20, max_pending_reserves=20_000),
        timeouts=aiokv.Timeouts(heartbeat_interval=1, heartbeat_timeout=60),
    )
    async with aiokv.Engine(cfg) as eng:
        s, _ = await _hello(zctx, eng.address, "many", "127.0.0.1:9")
        big = (m.TensorSpec("hold", "uint8", (1 << 20,)),)
        await s.send(CODEC.encode(m.Reserve(1, "tcp", big)))
        assert isinstance((await _next(s))[0], m.Grant)
        n = 12_000
        for lo in range(2, n + 2, 1000):
            await s.send_multipart(
                [
                    CODEC.encode(m.Reserve(i, "tcp", (m.TensorSpec(f"q{i}", "uint8", (1,)),)))
                    for i in range(lo, lo + 1000)
                ]
            )
        while eng.statistics().queued_reservations < n:
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        for lo in range(2, n + 2, 1000):
            await s.send_multipart([CODEC.encode(m.Withdraw(i)) for i in range(lo, lo + 1000)])
        got = 0
        while got < n:
            got += sum(isinstance(x, m.Withdrawn) for x in await _next(s, 10))
        assert time.perf_counter() - t0 < 2.0  # was one deque rebuild per WITHDRAW: ~7 s


# ---------------------------------------------------------------- 15: unauthenticated


async def test_connections_that_never_say_hello_are_hung_up(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    cfg = aiokv.EngineConfig(timeouts=aiokv.Timeouts(connect=0.3))
    async with aiokv.Engine(cfg) as eng:
        host, port = eng.address.rsplit(":", 1)
        # (its session stays until the end: a closed one's descriptor could be reused below)
        s, w = await _hello(zctx, eng.address, "x", "127.0.0.1:9")
        (data_port,) = (int(c[5:]) for c in w.capabilities if c.startswith("data:"))
        # on the control port, and on the data port (that never finish zmq's handshake)
        socks = [socket.create_connection((host, int(port))) for _ in range(50)]
        socks += [socket.create_connection((host, data_port)) for _ in range(10)]
        try:
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + 5

            async def eof(sk: socket.socket) -> bool:
                sk.setblocking(False)
                while time.monotonic() < deadline:
                    try:
                        data = await asyncio.wait_for(loop.sock_recv(sk, 4096), 0.5)
                    except (TimeoutError, asyncio.TimeoutError):
                        continue
                    except OSError:
                        return True
                    if not data:
                        return True
                return False

            assert all(await asyncio.gather(*(eof(sk) for sk in socks)))
        finally:
            for sk in socks:
                sk.close()
            s.close()
        assert eng.statistics().protocol_errors.get("no_hello", 0) >= 60
        async with aiokv.Engine() as good:  # still serving
            await good.send("after", torch.ones(2), to=eng.address, timeout=5)


async def test_a_large_first_frame_is_refused_and_hung_up(
    anyio_backend: Any, zctx: zmq.asyncio.Context
) -> None:
    async with aiokv.Engine() as eng:
        s = await _dealer(zctx, eng.address)
        mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        await s.send(b"\x00" * (1 << 20))
        (err,) = await _next(s)
        assert isinstance(err, m.ErrorMsg)
        await asyncio.wait_for(mon.recv_multipart(), 3)  # the engine hung up
        assert eng.statistics().protocol_errors.get("frame_too_large") == 1
        s.disable_monitor()
        mon.close(0)
        s.close()


# ---------------------------------------------------------------- 12: one setting for CURVE


async def test_one_shared_secret_authenticates_a_cluster(anyio_backend: Any) -> None:
    secret = "a cluster secret of enough length"
    sec = aiokv.CurveConfig.from_secret(secret)
    assert sec.allowed_clients == frozenset({sec.public_key})
    with pytest.raises(aiokv.ConfigError):
        aiokv.CurveConfig.from_secret("short")
    fast = aiokv.Timeouts(connect=1.0)
    async with (
        aiokv.Engine(aiokv.EngineConfig(curve=sec)) as a,
        aiokv.Engine(aiokv.EngineConfig(curve=aiokv.CurveConfig.from_secret(secret))) as b,
        aiokv.Engine(
            aiokv.EngineConfig(curve=aiokv.CurveConfig.from_secret(secret + "!"), timeouts=fast)
        ) as stranger,
    ):
        t = torch.randn(100)
        await a.send("x", t, to=b.address, timeout=5)
        assert same_bytes(await b.recv("x", frm=a.address, timeout=5), t)
        with pytest.raises((aiokv.ConnectError, aiokv.ConnectTimeoutError)):
            await stranger.send("y", t, to=b.address, timeout=2)
        with pytest.raises(aiokv.TransferTimeoutError):
            await b.recv("y", timeout=0.3)


@pytest.mark.parametrize(
    "secret", [12345, 10**30, None, 1.5, ["a" * 16], "", "fifteen chars!!", b"x" * 15]
)
def test_from_secret_takes_only_text_or_bytes_of_16_bytes(secret: Any) -> None:
    # bytes(12345) would be 12,345 zero bytes: an int is refused, not turned into a secret
    with pytest.raises(aiokv.ConfigError, match="str or bytes secret of at least 16 bytes"):
        aiokv.CurveConfig.from_secret(secret)
    a = aiokv.CurveConfig.from_secret(b"s" * 16)
    assert (
        a
        == aiokv.CurveConfig.from_secret("s" * 16)
        == aiokv.CurveConfig.from_secret(bytearray(b"s" * 16))
    )


@pytest.mark.timeout(30)
async def test_a_delayed_hang_up_never_shuts_a_reused_descriptor() -> None:
    """A hang-up scheduled for a connection that was already gone (no remote end seen)
    must not shut whatever connection reuses its descriptor number by then (seen once
    in a full run: a fresh engine's connection closed after a hostile one was dropped)."""
    import socket as _socket

    async with aiokv.Engine() as eng:
        lsn = _socket.socket()
        lsn.bind(("127.0.0.1", 0))
        lsn.listen()
        gone = _socket.create_connection(lsn.getsockname())
        gone_peer, _ = lsn.accept()
        fd = gone.fileno()
        gone.close()  # the hostile connection is gone when its hang-up is scheduled
        gone_peer.close()
        eng._server.connections.hang_up(fd, after=0.05)
        fresh = _socket.create_connection(lsn.getsockname())  # reuses the number
        peer, _ = lsn.accept()
        try:
            assert fresh.fileno() == fd, "the OS did not reuse the descriptor number"
            await asyncio.sleep(0.2)
            fresh.sendall(b"ping")
            peer.settimeout(2)
            assert peer.recv(4) == b"ping"
            peer.sendall(b"pong")
            fresh.settimeout(2)
            assert fresh.recv(4) == b"pong"  # not shut down
        finally:
            fresh.close()
            peer.close()
            lsn.close()
