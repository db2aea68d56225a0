"""The engine as a careful user meets it from outside: a send that timed out, a call
from the wrong event loop, a huge expanded view, concurrent GETs of one id, and a
peer address where nothing listens."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from support.procs import engines, free_port, same_bytes

import aiokv

pytestmark = [pytest.mark.anyio]
MiB = 1024 * 1024


def cfg(**limits: Any) -> aiokv.EngineConfig:
    return aiokv.EngineConfig(limits=aiokv.Limits(**limits)) if limits else aiokv.EngineConfig()


# --------------------------------------------------------------------------- another loop


@pytest.mark.timeout(60)
async def test_a_call_from_another_loop_is_refused_and_the_engine_stays_whole() -> None:
    """Every public call made from another thread's loop (or from a thread without one)
    raises UsageError at once and touches nothing: the engine still sends, receives,
    serves and closes cleanly on its own loop."""
    async with engines(cfg(), cfg()) as (a, b):
        t = torch.arange(1024, dtype=torch.float32)
        a.publish("pub", t * 3)
        await a.send("warm", t, to=b.address, timeout=5)  # a live session to reuse
        assert same_bytes(await b.recv("warm", timeout=5), t)

        coros: dict[str, Callable[[], Awaitable[Any]]] = {
            "send": lambda: a.send("x", t, to=b.address, timeout=2),
            "send_many": lambda: a.send_many({"y": t}, to=b.address, timeout=2),
            "recv": lambda: b.recv("x", timeout=0.5),
            "recv_many": lambda: b.recv_many(["x"], timeout=0.5),
            "get": lambda: b.get("pub", frm=a.address, timeout=2),
            "connect": lambda: b.connect(a.address, timeout=2),
            "wait_fetched": lambda: a.wait_fetched("pub", timeout=0.5),
            "start": lambda: a.start(),
            "aclose": lambda: a.aclose(),
        }
        plain: dict[str, Callable[[], Any]] = {
            "send_nowait": lambda: a.send_nowait("z", t, to=b.address, timeout=2),
            "publish": lambda: a.publish("pub2", t),
            "unpublish": lambda: a.unpublish("pub"),
            "discard": lambda: b.discard("warm"),
            "recv_nowait": lambda: b.recv_nowait("warm"),
        }

        def elsewhere() -> dict[str, BaseException | None]:
            out: dict[str, BaseException | None] = {}

            async def main() -> None:
                for name, mk in coros.items():
                    try:
                        await asyncio.wait_for(mk(), 5)
                        out[name] = None
                    except BaseException as exc:
                        out[name] = exc
                for name, fn in plain.items():
                    try:
                        fn()
                        out[name] = None
                    except BaseException as exc:
                        out[name] = exc

            asyncio.run(main())
            try:  # a thread with no loop at all
                a.publish("pub3", t)
                out["publish (no loop)"] = None
            except BaseException as exc:
                out["publish (no loop)"] = exc
            return out

        for _ in range(3):
            got = await asyncio.to_thread(elsewhere)
            wrong = {k: repr(v) for k, v in got.items() if not isinstance(v, aiokv.UsageError)}
            assert not wrong, wrong
            assert all(isinstance(v, RuntimeError) for v in got.values())
        # the engine is whole on its own loop: send, GET, publish, close (below)
        t0 = time.monotonic()
        await a.send("x", t + 1, to=b.address, timeout=5)
        assert same_bytes(await b.recv("x", timeout=5), t + 1)
        assert same_bytes(await b.get("pub", frm=a.address, timeout=5), t * 3)
        await b.send("back", t, to=a.address, timeout=5)
        assert same_bytes(await a.recv("back", timeout=5), t)
        assert a.unpublish("pub") and not a.unpublish("pub2")
        assert time.monotonic() - t0 < 5
        assert threading.current_thread() is threading.main_thread()
    assert a.statistics().transfers_failed == 0


# --------------------------------------------------------------------------- size before copy


@pytest.mark.timeout(60)
async def test_an_expanded_view_over_budget_is_refused_before_any_copy() -> None:
    """A 3 GiB stride-0 view (4 bytes of memory) sent to a receiver with a 2 GiB budget
    is refused ``too_large`` from its size (numel * element_size, in the RESERVE),
    within a round trip: nothing makes it contiguous first (seconds and 3 GiB)."""
    async with engines(cfg(), cfg()) as (a, b):
        await a.connect(b.address, timeout=5)
        huge = torch.zeros(1).expand((3 << 30) // 4)
        for attempt in ("send", "send_nowait", "send_many"):
            t0 = time.monotonic()
            with pytest.raises(aiokv.RefusedError) as ei:
                if attempt == "send":
                    await a.send("huge", huge, to=b.address, timeout=30)
                elif attempt == "send_nowait":
                    await a.send_nowait("huge", huge, to=b.address, timeout=30)
                else:
                    await a.send_many({"huge": huge}, to=b.address, timeout=30)
            took = time.monotonic() - t0
            assert ei.value.code == "too_large", (attempt, ei.value)
            assert took < 0.5, (attempt, took)
        a.publish("huge", huge)  # checked, not copied
        assert a.unpublish("huge")


@pytest.mark.timeout(60)
async def test_strided_views_within_budget_arrive_as_their_dense_values() -> None:
    """Strided CPU views (transposed, expanded, sliced), on credit and by RESERVE, on a
    fresh session and a live one, arrive with the bytes of their contiguous copies."""
    async with engines(cfg(), cfg()) as (a, b):
        small = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # PUT size
        big = torch.randn(1024, 1024)[:, ::2]  # 2 MiB of a 4 MiB tensor
        wide = torch.arange(7, dtype=torch.float64).expand(100_000, 7)  # 5.3 MiB, RESERVE
        views = {"small": small, "big": big, "wide": wide}
        assert not any(v.is_contiguous() for v in views.values())
        for k, v in views.items():  # the first send opens the session; the rest reuse it
            await a.send(k, v, to=b.address, timeout=10)
            assert same_bytes(await b.recv(k, timeout=10), v.contiguous()), k
        await asyncio.gather(*(a.send_nowait(k + "2", v, to=b.address) for k, v in views.items()))
        await a.send_many({k + "3": v for k, v in views.items()}, to=b.address, timeout=10)
        for k, v in views.items():
            for suffix in ("2", "3"):
                got = await b.recv(k + suffix, timeout=10)
                assert got.shape == v.shape and same_bytes(got, v.contiguous()), k + suffix


# --------------------------------------------------------------------------- concurrent GETs


@pytest.mark.timeout(60)
async def test_concurrent_gets_of_one_id_share_one_transfer() -> None:
    """Twenty concurrent gets of one id from one producer: all twenty return the tensor
    (one GET, one transfer), none fails with an internal DuplicateTensorError; a later
    get asks again; other ids and other consumers are not joined."""
    async with engines(cfg(), cfg(), cfg()) as (p, c, d):
        t = torch.randn(256, 256)
        p.publish("kv", t)
        p.publish("other", t * 2)
        got = await asyncio.wait_for(
            asyncio.gather(
                *(c.get("kv", frm=p.address, timeout=10) for _ in range(20)),
                c.get("other", frm=p.address, timeout=10),
                d.get("kv", frm=p.address, timeout=10),
            ),
            20,
        )
        assert all(same_bytes(g, t) for g in got[:20])
        assert same_bytes(got[20], t * 2) and same_bytes(got[21], t)
        assert p.statistics().gets_served == 3  # kv to c once, other to c, kv to d
        assert same_bytes(await c.get("kv", frm=p.address, timeout=10), t)  # a new GET
        assert p.statistics().gets_served == 4
        st = c.statistics().store
        assert st is not None and st.held_bytes == st.reserved_bytes == 0


@pytest.mark.timeout(60)
async def test_a_get_that_leaves_a_shared_get_does_not_end_it_for_the_others() -> None:
    """Three concurrent gets of one id wait while the consumer's store is full: the
    first is cancelled, the third times out early, the second still gets the tensor
    once room is made. Concurrent gets of an unpublished id all fail NotPublishedError."""
    async with engines(cfg(), cfg(store_bytes=4 * MiB)) as (p, c):
        filler = torch.zeros(3 * MiB, dtype=torch.uint8)
        await p.send("filler", filler, to=c.address, timeout=10)  # c's budget is now full
        t = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: waits for room
        p.publish("kv", t)
        first = asyncio.ensure_future(c.get("kv", frm=p.address, timeout=20))
        second = asyncio.ensure_future(c.get("kv", frm=p.address, timeout=20))
        third = asyncio.ensure_future(c.get("kv", frm=p.address, timeout=0.2))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(aiokv.TransferTimeoutError):
            await third
        assert not second.done()
        assert same_bytes(await c.recv("filler", timeout=5), filler)  # room for kv now
        assert same_bytes(await asyncio.wait_for(second, 10), t)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert p.statistics().gets_served == 1
        with pytest.raises(aiokv.NotPublishedError):
            await asyncio.gather(*(c.get("nope", frm=p.address, timeout=5) for _ in range(5)))


# --------------------------------------------------------------------------- refused connect


def tcfg(**timeouts: Any) -> aiokv.EngineConfig:
    return aiokv.EngineConfig(timeouts=aiokv.Timeouts(**timeouts))


@pytest.mark.timeout(60)
async def test_a_refused_connection_fails_fast_with_connect_error() -> None:
    """Nothing listens at the address: send, send_nowait, connect and get fail with
    ConnectError after the retry window (Timeouts.connect_retry), far within the
    10 s connect timeout; the engine then works with a live peer."""
    async with engines(tcfg(connect=10.0), cfg()) as (a, b):
        t = torch.ones(16)
        calls: dict[str, Callable[[str], Awaitable[Any]]] = {
            "send": lambda to: a.send("x", t, to=to, timeout=30),
            "send_nowait": lambda to: a.send_nowait("x", t, to=to, timeout=30),
            "connect": lambda to: a.connect(to),
            "get": lambda to: a.get("x", frm=to, timeout=30),
        }
        for name, call in calls.items():
            for to in ("127.0.0.1:1", f"127.0.0.1:{free_port()}"):
                t0 = time.monotonic()
                with pytest.raises(aiokv.ConnectError) as ei:
                    await call(to)
                took = time.monotonic() - t0
                assert not isinstance(ei.value, aiokv.ConnectTimeoutError), (name, ei.value)
                assert "refused" in str(ei.value), (name, ei.value)
                assert 0.4 < took < 2.0, (name, to, took)
        await a.send("x", t, to=b.address, timeout=5)
        assert same_bytes(await b.recv("x", timeout=5), t)


@pytest.mark.timeout(60)
async def test_a_peer_that_comes_up_within_the_retry_window_is_reached() -> None:
    """The peer starts listening 0.6 s after the send began, inside a 2 s retry window
    (and with the default window, 0.3 s after): the send connects and lands."""
    for window, late in ((2.0, 0.6), (None, 0.3)):
        port = free_port()
        ta = tcfg(connect=10.0) if window is None else tcfg(connect=10.0, connect_retry=window)
        async with engines(ta) as (a,):
            t = torch.arange(100.0)
            send = asyncio.ensure_future(a.send("late", t, to=f"127.0.0.1:{port}", timeout=10))
            await asyncio.sleep(late)
            assert not send.done()
            async with engines(aiokv.EngineConfig(listen=f"127.0.0.1:{port}")) as (b,):
                await asyncio.wait_for(send, 10)
                assert same_bytes(await b.recv("late", timeout=5), t)


# --------------------------------------------------------------------------- failed sends


def _assert_no_trace(b: aiokv.Engine) -> None:
    st = b.statistics().store
    assert st is not None
    assert st.held_bytes == st.reserved_bytes == 0, st
    assert st.held_tensors == st.pending_tensors == 0, st


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["send", "send_nowait", "send_many"])
async def test_a_send_that_timed_out_is_not_delivered(how: str) -> None:
    """A 128 MiB send whose deadline passes after the grant, while its data is on the
    way: the sender withdraws it (FAILED), the receiver frees its room and the id and
    drops the data when it comes; recv never returns it; a retry with the same id,
    at once, lands; the sender counts one failure and one transfer sent (the retry)."""
    async with engines(cfg(), cfg()) as (a, b):
        await a.connect(b.address, timeout=5)
        big = torch.randn(32 * MiB)  # 128 MiB
        retried = big + 1
        with pytest.raises(aiokv.TransferTimeoutError):
            if how == "send":
                await a.send("big", big, to=b.address, timeout=0.05)
            elif how == "send_nowait":
                await a.send_nowait("big", big, to=b.address, timeout=0.05)
            else:
                await a.send_many({"big": big, "tag": torch.ones(3)}, to=b.address, timeout=0.05)
        # retry at once, under the same id (the late data must not take its place)
        await a.send("big", retried, to=b.address, timeout=30)
        got = await b.recv("big", timeout=10)
        assert same_bytes(got, retried)
        del got
        with pytest.raises(aiokv.TransferTimeoutError):  # the first never shows up
            await b.recv("big", timeout=1.5)
        if how == "send_many":
            with pytest.raises(aiokv.TransferTimeoutError):
                await b.recv("tag", timeout=0.1)
        _assert_no_trace(b)
        sa, sb = a.statistics(), b.statistics()
        assert sa.transfers_failed == 1 and sa.transfers_sent == 1, sa
        assert sb.transfers_received == 1, sb
        assert set(sb.protocol_errors) <= {"late_data"}, sb.protocol_errors
        assert sa.peers_lost == sb.peers_lost == 0
        # the session is whole: a small send goes through
        await a.send("after", torch.ones(5), to=b.address, timeout=5)
        assert same_bytes(await b.recv("after", timeout=5), torch.ones(5))


@pytest.mark.timeout(90)
async def test_a_timed_out_send_leaves_a_waiting_recv_for_the_retry() -> None:
    """A recv waiting while the first attempt timed out is not failed by the withdrawal:
    it gets the retry's tensor; the late data of the first is dropped."""
    async with engines(cfg(), cfg()) as (a, b):
        await a.connect(b.address, timeout=5)
        waiter = asyncio.ensure_future(b.recv("big", frm=a.address, timeout=30))
        big = torch.randn(32 * MiB)
        with pytest.raises(aiokv.TransferTimeoutError):
            await a.send("big", big, to=b.address, timeout=0.05)
        await asyncio.sleep(1.0)  # the first attempt's data has come (and gone)
        assert not waiter.done()
        retried = torch.arange(10.0)
        await a.send("big", retried, to=b.address, timeout=30)
        assert same_bytes(await asyncio.wait_for(waiter, 10), retried)
        _assert_no_trace(b)
        assert a.statistics().transfers_sent == 1


def test_a_senders_failed_may_cross_the_servers_answer_once() -> None:
    """Session rules of a withdrawn granted transfer: the client's FAILED ends it from
    GRANTED or SENT; one DONE or FAILED of the server's that crossed it is accepted,
    a second is a protocol error; the server ignores a FAILED for a transfer it ended."""
    from aiokv.protocol import messages as m
    from aiokv.protocol.codec import Codec
    from aiokv.protocol.session import Role, Session, XferState

    codec = Codec()
    spec = (m.TensorSpec("t", "float32", (4,)),)

    def pair() -> tuple[Session, Session]:
        c, s = Session(Role.CLIENT, codec), Session(Role.SERVER, codec)
        s.receive(c.send(m.Hello(m.PROTOCOL_VERSION, "c", "127.0.0.1:1", ("tcp",), None)))
        c.receive(
            s.send(m.Welcome(m.PROTOCOL_VERSION, "s", "127.0.0.1:2", ("tcp",), None, b"k" * 16))
        )
        return c, s

    for answer in (m.Done(1), m.Failed(1, "timeout", "late")):
        c, s = pair()
        s.receive(c.send(m.Reserve(1, "tcp", spec)))
        c.receive(s.send(m.Grant(1, 0)))
        header = m.DataHeader(1, 0, 1)
        c.note_sent(header)
        s.receive_message(header)
        out = s.send(answer)  # the server ends it ...
        failed = c.send(m.Failed(1, "withdrawn", "gave up"))  # ... as the client gives up
        assert c.xfer_state(1) is XferState.END
        c.receive(out)  # crossed: accepted once
        s.receive(failed)  # crossed: ignored
        with pytest.raises(aiokv.RemoteProtocolError):
            c.receive(out)
    c, s = pair()  # from GRANTED, the server still waiting for data: it ends there
    s.receive(c.send(m.Reserve(1, "tcp", spec)))
    c.receive(s.send(m.Grant(1, 0)))
    s.receive(c.send(m.Failed(1, "withdrawn", "gave up")))
    assert s.xfer_state(1) is XferState.END and c.xfer_state(1) is XferState.END
    with pytest.raises(aiokv.RemoteProtocolError):  # a FAILED for a transfer never reserved
        s.receive(codec.encode(m.Failed(7, "withdrawn", "")))
