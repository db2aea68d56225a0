"""Engine in one process, on asyncio (debug) and uvloop: the public API and its promises."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import pytest
import torch
from support.hooks import after_landing
from support.procs import DTYPES, engines, free_port, random_tensor, same_bytes, wait_until

import aiokv

pytestmark = [pytest.mark.anyio]
KiB, MiB = 1024, 1024 * 1024
TIMINGS = os.environ.get("AIOKV_TIMINGS_LOG")  # figures are kept only where this names a file


def record(name: str, **vals: Any) -> None:
    if not TIMINGS:
        return
    with open(TIMINGS, "a") as f:
        f.write(json.dumps({"test": name, **vals}) + "\n")


def cfg(**limits: Any) -> aiokv.EngineConfig:
    return aiokv.EngineConfig(limits=aiokv.Limits(**limits)) if limits else aiokv.EngineConfig()


# --------------------------------------------------------------------------- API basics


@pytest.mark.timeout(30)
async def test_put_put_async_send_many_recv_many() -> None:
    async with engines(cfg(), cfg()) as (a, b):
        t = torch.randn(64, 33)
        await a.send("put", t, to=b.address)
        assert same_bytes(await b.recv("put", timeout=5), t)
        h = a.send_nowait("async", t * 2, to=b.address)
        await h
        assert h.done() and h.exception() is None
        assert same_bytes(await b.recv("async", frm=a.address, timeout=5), t * 2)
        many = {f"m{i}": torch.full((i + 1,), i, dtype=torch.int16) for i in range(20)}
        await a.send_many(many, to=b.address)
        got = await b.recv_many(list(many), timeout=5)
        assert all(same_bytes(got[k], v) for k, v in many.items())
        sa, sb = a.statistics(), b.statistics()
        assert sa.transfers_sent == 3 and sa.tensors_sent == 22
        assert sb.transfers_received == 3 and sb.tensors_received == 22
        assert sb.store is not None and sb.store.held_bytes == sb.store.reserved_bytes == 0


@pytest.mark.timeout(30)
async def test_recv_nowait_takes_only_what_has_landed() -> None:
    async with engines(cfg(), cfg(), cfg()) as (a, b, c):
        assert b.recv_nowait("x") is None  # nothing: no waiting, nothing registered
        t = torch.arange(10)
        await a.send("x", t, to=b.address)
        assert b.recv_nowait("x", frm=c.address) is None  # another sender's only
        assert same_bytes(b.recv_nowait("x", frm=a.address), t)
        assert b.recv_nowait("x") is None  # collected once
        await a.send("x", t, to=b.address)  # the id is free again
        assert same_bytes(await b.recv("x", timeout=5), t)
        with pytest.raises(aiokv.ConfigError):
            b.recv_nowait("")
    with pytest.raises(aiokv.AiokvError):
        b.recv_nowait("x")  # closed


@pytest.mark.timeout(30)
async def test_get_and_not_published() -> None:
    async with engines(cfg(), cfg()) as (prod, cons):
        t = random_tensor(10_000, torch.bfloat16, 1, 5)
        prod.publish("pub", t)
        assert same_bytes(await cons.get("pub", frm=prod.address, timeout=5), t)
        # published tensors stay published: a second GET works too
        assert same_bytes(await cons.get("pub", frm=prod.address, timeout=5), t)
        with pytest.raises(aiokv.NotPublishedError):
            await cons.get("nope", frm=prod.address, timeout=5)
        assert prod.unpublish("pub")
        with pytest.raises(aiokv.NotPublishedError):
            await cons.get("pub", frm=prod.address, timeout=5)
        assert prod.statistics().gets_served == 2


@pytest.mark.timeout(30)
async def test_recv_timeout_at_its_deadline() -> None:
    async with engines(cfg()) as (a,):
        for deadline in (0.2, 1.0):
            t0 = time.monotonic()
            with pytest.raises(aiokv.TransferTimeoutError):
                await a.recv("never", timeout=deadline)
            took = time.monotonic() - t0
            assert deadline <= took + 0.01 and took < deadline + 0.5, took
            record("recv_timeout", deadline=deadline, took=took)
        t0 = time.monotonic()
        with pytest.raises(aiokv.TransferTimeoutError):
            await a.recv_many(["x", "y"], timeout=0.3)
        assert time.monotonic() - t0 < 0.8
        assert isinstance(aiokv.TransferTimeoutError("x"), TimeoutError)


def _odd_tensors() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).removeprefix("torch.")
        for flavor in range(4):
            out[f"{name}-f{flavor}"] = random_tensor(3000 + 7 * i, dt, flavor, 100 * i + flavor)
        out[f"{name}-0d"] = random_tensor(1, dt, 0, i).reshape(())
        out[f"{name}-empty"] = torch.empty((3, 0, 5), dtype=dt)
        out[f"{name}-sliced"] = random_tensor(4096, dt, 0, i + 50).view(64, -1)[3:40:3, 1::2]
    out["expanded"] = torch.arange(5, dtype=torch.float32).expand(4, 5)  # stride 0
    out["neg-nan-bits"] = (
        torch.tensor([float("nan"), -0.0, float("inf")])
        .view(torch.int32)
        .add(1)
        .view(torch.float32)
    )
    return out


@pytest.mark.timeout(60)
async def test_non_contiguous_and_odd_tensors_land_bit_exact() -> None:
    odd = _odd_tensors()
    assert sum(not t.is_contiguous() for t in odd.values()) >= 3 * len(DTYPES)
    async with engines(cfg(), cfg()) as (a, b):
        items = list(odd.items())
        # singly (PUT) and all in one transfer (send_many)
        await asyncio.gather(*(a.send(k, v, to=b.address) for k, v in items[: len(items) // 2]))
        await a.send_many(dict(items[len(items) // 2 :]), to=b.address)
        got = await b.recv_many(list(odd), timeout=10)
        bad = [k for k, v in odd.items() if not same_bytes(got[k], v)]
        assert not bad, bad
        assert all(got[k].is_contiguous() and got[k].device.type == "cpu" for k in odd)


@pytest.mark.timeout(30)
async def test_bad_arguments_are_config_errors() -> None:
    async with engines(cfg(), cfg()) as (a, b):
        with pytest.raises(aiokv.ConfigError):
            await a.send("", torch.zeros(1), to=b.address)
        with pytest.raises(aiokv.ConfigError):
            await a.send("c", torch.zeros(1, dtype=torch.complex64), to=b.address)
        with pytest.raises(aiokv.ConfigError):
            await a.send("x", [1, 2], to=b.address)  # type: ignore[arg-type]
        with pytest.raises(aiokv.ConfigError):
            await a.send_many({}, to=b.address)
        with pytest.raises(aiokv.ConfigError):
            await a.send("x", torch.zeros(1), to="no-port")
        await a.send("ok", torch.zeros(1), to=b.address)  # the engine is unharmed
        assert same_bytes(await b.recv("ok", timeout=5), torch.zeros(1))


@pytest.mark.timeout(30)
async def test_duplicate_id_refused_while_uncollected() -> None:
    async with engines(cfg(), cfg(), cfg()) as (a, b, c):
        await a.send("dup", torch.ones(4), to=c.address)
        with pytest.raises(aiokv.DuplicateTensorError) as ei:
            await a.send("dup", torch.zeros(4), to=c.address)
        assert ei.value.code == "duplicate"
        with pytest.raises(aiokv.DuplicateTensorError):  # one id of many
            await a.send_many({"fresh": torch.ones(1), "dup": torch.ones(1)}, to=c.address)
        # ids are per peer: b may use the same id
        await b.send("dup", torch.full((4,), 2.0), to=c.address)
        assert same_bytes(
            await c.recv("dup", frm=a.address, timeout=5), torch.ones(4)
        )  # never overwritten
        assert same_bytes(await c.recv("dup", frm=b.address, timeout=5), torch.full((4,), 2.0))
        with pytest.raises(aiokv.TransferTimeoutError):  # the refused send_many delivered nothing
            await c.recv("fresh", timeout=0.2)
        await a.send("dup", torch.zeros(4), to=c.address)  # collected: the id is free again
        assert same_bytes(await c.recv("dup", timeout=5), torch.zeros(4))
        assert c.statistics().refused_sent == 2 and a.statistics().refused_received == 2


@pytest.mark.timeout(30)
async def test_ttl_expiry() -> None:
    async with engines(cfg(), cfg(ttl=0.3)) as (a, b):
        await a.send("old", torch.ones(1000), to=b.address)
        assert b.statistics().store.held_bytes == 4000  # type: ignore[union-attr]
        await asyncio.sleep(0.9)
        s = b.statistics().store
        assert s is not None and s.held_bytes == 0 and s.expired == 1
        t0 = time.monotonic()
        with pytest.raises(aiokv.ExpiredError):
            await b.recv("old", timeout=5)
        with pytest.raises(aiokv.ExpiredError):
            await b.recv("old", frm=a.address, timeout=5)
        assert time.monotonic() - t0 < 1.0  # at once, not at the deadline
        # the id can be sent again and the new data arrives, never the stale one
        await a.send("old", torch.zeros(10), to=b.address)
        assert same_bytes(await b.recv("old", timeout=5), torch.zeros(10))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["reserve", "credit"])
async def test_back_pressure_keeps_store_under_budget(path: str) -> None:
    budget = 1 * MiB
    n, size = 48, 160 * KiB
    # "reserve": a window too small for any tensor, every transfer asks (RESERVE path);
    # "credit": protocol v2, credit refills as PUTs land while the budget has room
    extra = {"credit_bytes": 1} if path == "reserve" else {}
    async with engines(cfg(), cfg(store_bytes=budget, **extra)) as (a, b):
        data = {f"bp{i}": random_tensor(size, torch.float16, i % 4, i) for i in range(n)}
        sends = [
            asyncio.ensure_future(a.send(k, v, to=b.address, timeout=30)) for k, v in data.items()
        ]
        max_queued = 0
        bad = []
        for k, v in data.items():  # a collector slower than the producer
            await asyncio.sleep(0.01)
            st = b.statistics()
            max_queued = max(max_queued, st.queued_reservations + a.statistics().waiting_for_credit)
            assert st.store is not None and st.store.reserved_bytes + st.store.held_bytes <= budget
            got = await b.recv(k, timeout=20)
            if not same_bytes(got, v):
                bad.append(k)
        await asyncio.gather(*sends)
        st = b.statistics()
        assert st.store is not None
        record(
            "back_pressure_1proc",
            budget=budget,
            peak=st.store.peak_bytes,
            max_queued=max_queued,
            n=n,
            size=size,
        )
        assert not bad
        assert st.store.peak_bytes <= budget
        assert st.store.peak_bytes >= budget - 2 * size  # the budget was actually used
        assert max_queued > 0  # producers really waited for credit
        assert st.tensors_received == n and st.refused_sent == 0


@pytest.mark.timeout(30)
async def test_too_large_for_budget_is_refused() -> None:
    async with engines(cfg(), cfg(store_bytes=1000)) as (a, b):
        with pytest.raises(aiokv.RefusedError) as ei:
            await a.send("huge", torch.zeros(1000), to=b.address)
        assert ei.value.code == "too_large"
        await a.send("small", torch.zeros(10), to=b.address)
        assert (await b.recv("small", timeout=5)).numel() == 10


# --------------------------------------------------------------------------- cancellation


@pytest.mark.timeout(30)
async def test_cancel_send_waiting_for_credit_withdraws_it() -> None:
    async with engines(cfg(), cfg(store_bytes=1 * MiB)) as (a, b):
        await a.send("fill", torch.zeros(MiB, dtype=torch.uint8), to=b.address)  # budget full
        # a small send waits for standing credit (protocol v2) in the sending engine
        task = asyncio.ensure_future(a.send("waits", torch.ones(1000), to=b.address, timeout=20))
        await wait_until(lambda: a.statistics().waiting_for_credit == 1, 5, "waiting for credit")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert a.statistics().waiting_for_credit == 0 and a.statistics().withdrawn == 1
        # a larger one waits as a reservation queued at the receiver (RESERVE path)
        big = torch.ones(MiB // 2, dtype=torch.uint8)
        task = asyncio.ensure_future(a.send("waits2", big, to=b.address, timeout=20))
        await wait_until(lambda: b.statistics().queued_reservations == 1, 5, "queued reservation")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: b.statistics().queued_reservations == 0, 5, "withdrawal")
        await wait_until(lambda: a.statistics().withdrawn == 2, 5, "WITHDRAWN")
        assert b.statistics().withdrawn == 1
        await b.recv("fill", timeout=5)  # room again; the withdrawn send must not come
        for tid in ("waits", "waits2"):
            with pytest.raises(aiokv.TransferTimeoutError):
                await b.recv(tid, timeout=0.5)
        assert b.statistics().store.used if False else True
        s = b.statistics().store
        assert s is not None and s.reserved_bytes == 0 and s.pending_tensors == 0
        # the session is healthy and the id is free
        await a.send("waits", torch.full((3,), 9.0), to=b.address, timeout=5)
        assert same_bytes(await b.recv("waits", timeout=5), torch.full((3,), 9.0))
        assert a.statistics().peers_lost == b.statistics().peers_lost == 0


@pytest.mark.timeout(30)
async def test_send_deadline_on_the_hot_path() -> None:
    """``await send()`` on a live session waits on its transfer directly (no handle): a
    deadline still ends it with the right error, counts one failure, and withdraws it."""
    async with engines(cfg(), cfg(store_bytes=1000)) as (a, b):
        await a.send("fill", torch.zeros(250), to=b.address)  # the whole budget is held
        t0 = time.monotonic()
        with pytest.raises(aiokv.NegotiateTimeoutError):
            await a.send("late", torch.ones(10), to=b.address, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 3
        st = a.statistics()
        assert st.transfers_failed == 1 and st.waiting_for_credit == 0 and st.withdrawn == 1
        await b.recv("fill", timeout=5)
        with pytest.raises(aiokv.TransferTimeoutError):
            await b.recv("late", timeout=0.3)
        # the session is healthy: the next send goes on standing credit again
        await a.send("late", torch.full((2,), 7.0), to=b.address, timeout=5)
        assert same_bytes(await b.recv("late", timeout=5), torch.full((2,), 7.0))
        assert a.statistics().transfers_failed == 1 and a.statistics().peers_lost == 0


@pytest.mark.timeout(30)
async def test_send_nowait_handle_deadline_and_cancel_count_once() -> None:
    """A PUT_ASYNC handle hands out its transfer's own future: a deadline must still
    surface as NegotiateTimeoutError (not as the cancel that withdrawing makes), and every
    way of giving up counts one failure."""
    async with engines(cfg(), cfg(store_bytes=1000)) as (a, b):
        await a.send("fill", torch.zeros(250), to=b.address)  # the budget is held
        h = a.send_nowait("late", torch.ones(10), to=b.address, timeout=0.3)
        with pytest.raises(aiokv.NegotiateTimeoutError):
            await h
        st = a.statistics()
        assert st.transfers_failed == 1 and st.withdrawn == 1 and st.waiting_for_credit == 0
        await h.released()
        h2 = a.send_nowait("late2", torch.ones(10), to=b.address, timeout=20)
        assert h2.cancel() and not h2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await h2
        h3 = a.send_nowait("late3", torch.ones(10), to=b.address, timeout=20)
        task = asyncio.ensure_future(_await(h3))
        await asyncio.sleep(0.05)
        task.cancel()  # the task awaiting the handle is cancelled: the transfer goes too
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        st = a.statistics()
        assert st.transfers_failed == 3 and st.withdrawn == 3 and st.waiting_for_credit == 0
        await b.recv("fill", timeout=5)
        for tid in ("late", "late2", "late3"):
            with pytest.raises(aiokv.TransferTimeoutError):
                await b.recv(tid, timeout=0.2)
        await a.send("ok", torch.ones(2), to=b.address, timeout=5)  # the session is fine
        assert a.statistics().transfers_failed == 3


@pytest.mark.timeout(30)
async def test_send_cancelled_after_its_ack_counts_no_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel that reaches ``send()`` after its transfer completed (same loop pass as the
    ACK) propagates as asyncio does, but the transfer is not called failed or withdrawn."""
    import aiokv.engine.client as client_mod

    async with engines(cfg(), cfg()) as (a, b):
        await a.connect(b.address)
        task: asyncio.Future[None] | None = None
        orig_end = client_mod._ClientSession._end

        def end_then_cancel(self: Any, x: Any, exc: BaseException | None) -> None:
            orig_end(self, x, exc)
            assert task is not None
            task.cancel()

        monkeypatch.setattr(client_mod._ClientSession, "_end", end_then_cancel)
        task = asyncio.ensure_future(a.send("x", torch.arange(5), to=b.address, timeout=5))
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.undo()
        st = a.statistics()
        assert st.transfers_sent == 1 and st.transfers_failed == 0 and st.withdrawn == 0
        assert same_bytes(await b.recv("x", timeout=5), torch.arange(5))
        await a.send("y", torch.ones(2), to=b.address, timeout=5)  # the session is fine


@pytest.mark.timeout(30)
async def test_an_unawaited_failed_handle_logs_nothing() -> None:
    """A PUT_ASYNC whose outcome nobody reads (refused, then dropped) must not make asyncio
    log "exception was never retrieved": its watch reads the outcome."""
    import gc

    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: logged.append(ctx))
    try:
        async with engines(cfg(), cfg(store_bytes=1000)) as (a, b):
            await a.connect(b.address)
            for i in range(20):
                a.send_nowait(f"big{i}", torch.zeros(300), to=b.address)  # refused: too_large
                a.send_nowait(f"ok{i}", torch.zeros(2), to=b.address)  # lands
            await wait_until(lambda: a.statistics().transfers_failed == 20, 10, "refusals")
            await wait_until(lambda: a.statistics().transfers_sent == 20, 10, "landings")
            gc.collect()
            await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(old)
    assert not [c for c in logged if "never retrieved" in str(c.get("message", ""))], logged


async def _await(h: Any) -> None:
    await h


@pytest.mark.timeout(30)
async def test_cancel_send_nowait_handle() -> None:
    async with engines(cfg(), cfg(store_bytes=1000)) as (a, b):
        await a.send("fill", torch.zeros(250), to=b.address)
        h = a.send_nowait("later", torch.ones(10), to=b.address)
        await wait_until(lambda: a.statistics().waiting_for_credit == 1, 5)
        assert h.cancel()
        with pytest.raises(asyncio.CancelledError):
            await h
        assert a.statistics().waiting_for_credit == 0
        await b.recv("fill", timeout=5)
        with pytest.raises(aiokv.TransferTimeoutError):
            await b.recv("later", timeout=0.3)


@pytest.mark.timeout(30)
async def test_cancel_right_after_refusal_crosses_cleanly() -> None:
    """WITHDRAW crossing the receiver's REFUSE must not be called a protocol error."""
    async with engines(cfg(), cfg(store_bytes=1024)) as (a, b):
        await a.connect(b.address)
        for i in range(5):
            h = a.send_nowait(
                f"big{i}", torch.zeros(4096), to=b.address
            )  # will be refused: too_large
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            h.cancel()
            await asyncio.sleep(0.05)
        assert a.statistics().protocol_errors == {} and b.statistics().protocol_errors == {}
        assert a.statistics().peers_lost == b.statistics().peers_lost == 0
        assert a.statistics().sessions_opened == 1
        await a.send("ok", torch.ones(2), to=b.address)
        assert same_bytes(await b.recv("ok", timeout=5), torch.ones(2))


@pytest.mark.timeout(30)
async def test_cancelled_recv_does_not_lose_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:

    async with engines(cfg(), cfg()) as (a, b):
        # cancelled before arrival
        r = asyncio.ensure_future(b.recv("c1", timeout=10))
        await asyncio.sleep(0.05)
        r.cancel()
        with pytest.raises(asyncio.CancelledError):
            await r
        await a.send("c1", torch.arange(7), to=b.address)
        assert same_bytes(await b.recv("c1", timeout=5), torch.arange(7))
        # cancelled in the same step as the tensor is handed over (the put_back path)
        r2 = asyncio.ensure_future(b.recv("c2", timeout=10))
        await asyncio.sleep(0.05)
        after_landing(monkeypatch, lambda store, _tid: r2.cancel() if store is b._store else None)
        await a.send("c2", torch.arange(9), to=b.address)
        monkeypatch.undo()
        try:
            got = await r2  # the cancel may lose the race to the result: then we have it here
        except asyncio.CancelledError:
            got = await b.recv("c2", timeout=5)  # ...otherwise it was put back
        assert same_bytes(got, torch.arange(9))
        with pytest.raises(aiokv.TransferTimeoutError):
            await b.recv("c2", timeout=0.2)  # delivered exactly once
        s = b.statistics().store
        assert s is not None and s.held_bytes == 0 and s.collected == 2


# --------------------------------------------------------------------------- shutdown, connect


@pytest.mark.timeout(30)
async def test_aclose_with_transfers_in_flight() -> None:
    a = aiokv.Engine(cfg())
    b = aiokv.Engine(cfg(store_bytes=2 * MiB))
    c = aiokv.Engine(cfg())
    for e in (a, b, c):
        await e.start()
    try:
        await a.send("fill", torch.zeros(2 * MiB, dtype=torch.uint8), to=b.address)
        queued = [
            asyncio.ensure_future(a.send(f"q{i}", torch.ones(MiB // 4), to=b.address, timeout=20))
            for i in range(4)
        ]
        big = asyncio.ensure_future(
            c.send("big", torch.zeros(256 * MiB, dtype=torch.uint8), to=a.address, timeout=20)
        )
        b_recvs = [asyncio.ensure_future(b.recv(f"r{i}", timeout=20)) for i in range(3)]
        a_recv = asyncio.ensure_future(a.recv("big", timeout=20))
        a_recv2 = asyncio.ensure_future(a.recv("never", timeout=20))
        await wait_until(
            lambda: b.statistics().queued_reservations == 4, 5, "4 queued reservations on b"
        )
        await wait_until(
            lambda: big.done() or a.statistics().store.reserved_bytes > 0, 5, "big granted"
        )  # type: ignore[union-attr]
        # close the receiver b: its own waiters fail at once; a's sends to it fail (BYE) soon
        t0 = time.monotonic()
        await b.aclose()
        t_b = time.monotonic() - t0
        assert all(f.done() for f in b_recvs), "b's own recv() futures unresolved after its aclose"
        # close a: the target of c's big transfer, the sender of `queued`
        t0 = time.monotonic()
        await a.aclose()
        t_a = time.monotonic() - t0
        await asyncio.sleep(0)
        own = [*queued, a_recv, a_recv2]
        own_left = [f for f in own if not f.done()]
        peer_fut = [big]  # c learns of a's close by BYE, at worst by heartbeat
        _, not_done = await asyncio.wait(
            peer_fut, timeout=c.config.timeouts.heartbeat_timeout + 1.0
        )
        t_peer = time.monotonic() - t0
        record(
            "aclose_in_flight",
            close_receiver_s=t_b,
            close_sender_s=t_a,
            peer_future_resolved_s=t_peer,
        )
        assert t_b < 2.0 and t_a < 2.0
        assert not own_left, f"{len(own_left)} of a's futures unresolved after its aclose returned"
        assert not not_done, "c's send to a closed peer did not resolve"
        for f in [*own, *b_recvs, *peer_fut]:
            exc = f.exception()
            assert isinstance(
                exc, (aiokv.EngineClosedError, aiokv.PeerLostError, aiokv.TransferAbortedError)
            ), repr(exc)
        for f in [*b_recvs, a_recv2]:  # nothing in flight: the engine's own close is the reason
            assert isinstance(f.exception(), aiokv.EngineClosedError)
        # a_recv waited on a tensor in flight from c: it reports PeerLostError("... lost: engine closed")
        assert isinstance(a_recv.exception(), (aiokv.EngineClosedError, aiokv.PeerLostError))
        with pytest.raises(aiokv.EngineClosedError):
            await a.send("x", torch.ones(1), to=c.address)
        with pytest.raises(aiokv.EngineClosedError):
            await b.recv("x", timeout=1)
        await a.aclose()  # idempotent
    finally:
        for e in (a, b, c):
            await asyncio.wait_for(e.aclose(), 5)


@pytest.mark.timeout(30)
async def test_connect_to_nothing_times_out() -> None:
    port = free_port()
    timeouts = aiokv.Timeouts(connect=0.5)
    async with engines(aiokv.EngineConfig(timeouts=timeouts)) as (a,):
        for op in ("send", "connect", "get"):
            t0 = time.monotonic()
            with pytest.raises(aiokv.ConnectTimeoutError):
                if op == "send":
                    await a.send("x", torch.ones(1), to=f"127.0.0.1:{port}")
                elif op == "connect":
                    await a.connect(f"127.0.0.1:{port}")
                else:
                    await a.get("x", frm=f"127.0.0.1:{port}")
            took = time.monotonic() - t0
            record("connect_timeout", op=op, connect=0.5, took=took)
            assert took < 0.5 + 0.5, took
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0  # no stuck HELLO delays aclose


@pytest.mark.timeout(60)
async def test_head_of_line_small_send_not_stuck_behind_big_one() -> None:
    big_n = 256 * MiB
    async with engines(cfg(), cfg(), cfg()) as (a, b, c):
        await a.connect(c.address)
        await b.connect(c.address)
        big = torch.empty(big_n, dtype=torch.uint8)
        big[::4096] = 7
        small = torch.arange(256, dtype=torch.int32)  # 1 KiB
        t0 = time.monotonic()
        ta = asyncio.ensure_future(a.send("big", big, to=c.address, timeout=50))
        # wait until A's transfer is granted (on the wire), then send B's
        await wait_until(lambda: c.statistics().store.reserved_bytes >= big_n, 10)  # type: ignore[union-attr]
        t_b0 = time.monotonic()
        await b.send("small", small, to=c.address, timeout=50)
        t_b = time.monotonic() - t_b0
        b_done_at = time.monotonic() - t0
        a_was_done = ta.done()
        await ta
        t_a = time.monotonic() - t0
        record(
            "head_of_line",
            big_bytes=big_n,
            a_total_s=t_a,
            b_send_s=t_b,
            b_done_at_s=b_done_at,
            a_done_before_b=a_was_done,
        )
        assert same_bytes(await c.recv("small", timeout=5), small)
        got = await c.recv("big", timeout=5)
        assert got.numel() == big_n and torch.equal(got[::4096], big[::4096])
        assert not a_was_done, (
            f"A ({t_a:.3f}s) finished before B ({b_done_at:.3f}s): no overlap measured"
        )
        assert t_b < t_a / 4, (t_b, t_a)


@pytest.mark.timeout(60)
async def test_many_concurrent_sends_between_two_engines_both_ways() -> None:
    async with engines(cfg(), cfg()) as (a, b):
        data = {
            f"t{i}": random_tensor(1024 + 37 * i, DTYPES[i % len(DTYPES)], i % 4, i)
            for i in range(300)
        }
        await asyncio.gather(
            *(a.send(k, v, to=b.address) for k, v in data.items()),
            *(b.send(k, v, to=a.address) for k, v in data.items()),
        )
        got_b = await b.recv_many(list(data), timeout=10)
        got_a = await a.recv_many(list(data), frm=b.address, timeout=10)
        assert all(same_bytes(got_b[k], v) and same_bytes(got_a[k], v) for k, v in data.items())


@pytest.mark.timeout(30)
async def test_connect_warms_the_session_and_refuses_nccl_where_there_is_none() -> None:
    async with engines(cfg(), cfg()) as (a, b):
        await a.connect(b.address)  # nccl=None: only what the pair can use (TCP here)
        assert a.statistics().client_sessions == 1
        with pytest.raises(aiokv.ConfigError, match="NCCL"):
            await a.connect(b.address, nccl=True)
        await a.send("x", torch.ones(3), to=b.address, timeout=5)
        assert a.statistics().sessions_opened == 1  # the warmed session carried the send
