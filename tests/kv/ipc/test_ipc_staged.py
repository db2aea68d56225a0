"""Staged launches: the consumer prepares a whole request's copy when ``recv_request``
is called, and the doorbell's poll launches it as the descriptor arrives (on CPU).

CUDA is faked as in test_ipc_plane.py; on top of that the driver path is faked: a
"launch" queues the copy, which runs when its completion event is next queried (the
GPU runs it later) and honours the abort word then, as the kernel does. What is
checked: the copy lands and is counted as a ring launch; a descriptor that fails any
check is not launched there and fails (or falls back) exactly as without staging; a
request cancelled between the ring's launch and its task resuming aborts the copy,
writes nothing, and releases the producer's blocks with a failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.kvutil import filled, make_layout
from test_ipc_plane import FakeBackend, FakeEvent, connectors, landed, pair

from aiokv import NotPublishedError, RemoteProtocolError, TransferAbortedError
from aiokv.kv.ipc import Descriptor, IpcPlane
from aiokv.kv.ipc import _kernel as _ipc_kernel

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or sys.platform != "linux", reason="needs /dev/shm"
)


class FakeDone:
    """A slot's completion event: querying it runs the copies queued before it."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []
        self.cuda_event = self

    def query(self) -> bool:
        run, self.pending = self.pending, []
        for f in run:
            f()
        return True


class FakeDriver:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append("upload")  # on CPU the slot's "device" buffer is the pinned one

    def event_record(self, event: Any, stream: int) -> None:
        self.calls.append("record")


class FakeRaw:
    """The mapping's raw launch: queues the copy on the slot's completion event."""

    def __init__(self, plane: IpcPlane, m: Any) -> None:
        self.plane, self.m = plane, m
        self.launched = 0

    def params(self, args: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(args)

    def launch_with(self, programs: int, stream: int, args: tuple[int, ...]) -> None:
        plane, m = self.plane, self.m
        sb = next(b for b in plane.consumer.copier.slotbufs.values() if b.dev.data_ptr() == args[2])
        ab = next(t for t in plane.state.words.blocks.values() if t.data_ptr() == args[3])
        slot, n = args[5], args[6]
        self.launched += 1

        def run() -> None:
            if int(ab[slot]):  # the kernel's check: aborted, nothing written
                return
            ids = sb.pin[: 2 * n].view(2, n)
            dst = plane.port.caches.raw(m.word)
            _ipc_kernel.torch_pair_copy(m.src_layers, dst, plane.layout.block_dim, ids[0], ids[1])

        sb.done.pending.append(run)

    launch = launch_with  # the ordinary path's call: the arguments as a tuple


def fake_driver(plane: IpcPlane) -> tuple[FakeDriver, FakeRaw]:
    """Turn the driver path on for ``plane``, a consumer on CPU with a faked CUDA whose
    one mapping the first request made: the driver, the verified raw launch."""
    (m,) = plane.state.maps.values()
    assert m.bell is not None
    plane.state.mapper.use_triton = lambda: True  # type: ignore[method-assign]
    m.raw = raw = FakeRaw(plane, m)  # type: ignore[assignment]
    drv = FakeDriver()
    plane.state.drv = drv  # type: ignore[assignment]
    plane.state.raw_stream = lambda: 7  # type: ignore[method-assign]
    plane.state.on_device = lambda: True  # type: ignore[method-assign]
    slot_bufs = plane.consumer.copier._slot_bufs

    def with_done(slot: int, n: int) -> Any:
        sb = slot_bufs(slot, n)
        if sb.done is None:
            sb.done = FakeDone()
        return sb

    plane.consumer.copier._slot_bufs = with_done  # type: ignore[method-assign]
    return drv, raw


def untouched(before: list[torch.Tensor], now: list[torch.Tensor]) -> bool:
    """Bit for bit (random bf16 bits include NaNs, which never compare equal)."""
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(before, now, strict=True)
    )


async def first_request(prod: Any, cons: Any, a: Any, b: Any) -> None:
    """The offer's request (by the engine), so that the ring is mapped."""
    recv = asyncio.create_task(cons.recv_request("r0", [3, 4], frm=a.address, timeout=10))
    await asyncio.sleep(0.02)
    await prod.send_request("r0", [1, 2], to=b.address, timeout=10)
    await recv


@asynccontextmanager
async def staged_pair(opts: Any = None) -> AsyncIterator[Any]:
    """Two engines and IPC connectors (FlashAttention, bf16, 24 blocks) whose first
    request mapped the producer's export and ring, with the consumer's driver path
    faked; closed afterwards. Yields a namespace: layout ``pl``, caches ``p``/``c``,
    engines ``a``/``b``, connectors ``prod``/``cons``, the consumer's ``plane``,
    ``drv``, ``raw``."""
    pl = make_layout("fa", "bfloat16", 24)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, **({"opts": opts} if opts else {}))
        plane = cons._ipc
        await first_request(prod, cons, a, b)
        drv, raw = fake_driver(plane)
        yield SimpleNamespace(
            pl=pl, p=p, c=c, a=a, b=b, prod=prod, cons=cons, plane=plane, drv=drv, raw=raw
        )
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_ring_launches_the_staged_copy() -> None:
    async with staged_pair() as t:
        pl, p, c, a, b, prod, cons, plane = t.pl, t.p, t.c, t.a, t.b, t.prod, t.cons, t.plane
        drv, raw = t.drv, t.raw
        for i in range(1, 4):
            src, dst = [5 + i, 9 + i, 13], [10 + i, 14 + i, 20]
            recv = asyncio.create_task(cons.recv_request(f"r{i}", dst, frm=a.address, timeout=10))
            await asyncio.sleep(0.02)
            assert (
                len(plane.consumer.inbox.waiting[f"r{i}"]) == 3
                and plane.consumer.inbox.waiting[f"r{i}"][2] is not None
            )
            await prod.send_request(f"r{i}", src, to=b.address, timeout=10)
            assert await recv == "ipc"
            assert landed(pl, p, src, c, dst)
        st = plane.statistics()
        assert st.ring_launches == st.staged_launches == 3 and raw.launched == 3
        assert st.aborted == 0
        assert drv.calls == ["upload", "record"] * 3
        assert prod.finished_sending() == {"r0", "r1", "r2", "r3"}
        assert not plane.consumer.inbox.waiting


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_hostile_ids_are_not_launched_by_the_ring() -> None:
    """A rung descriptor whose source ids are out of range: not launched by the poll;
    the request fails as it does without staging, and nothing was written."""
    async with staged_pair() as t:
        pl, c, a, b, prod, cons, plane = t.pl, t.c, t.a, t.b, t.prod, t.cons, t.plane
        raw = t.raw
        before = [x.clone() for x in c]
        real, real_ring = Descriptor.to_wire, Descriptor.to_ring

        def hostile(self: Descriptor) -> dict[str, Any]:
            w = real(self)
            w["src"] = struct.pack(f"<{self.n}I", *[pl.num_blocks + 5] * self.n)
            return w

        def hostile_ring(self: Descriptor, *, solo: bool) -> bytes:
            bad = dataclasses.replace(self, src=(pl.num_blocks + 5,) * self.n)
            return real_ring(bad, solo=solo)

        Descriptor.to_wire = hostile  # type: ignore[method-assign]
        Descriptor.to_ring = hostile_ring  # type: ignore[method-assign]
        try:
            recv = asyncio.create_task(cons.recv_request("h", [7, 8], frm=a.address, timeout=5))
            await asyncio.sleep(0.02)
            send = asyncio.create_task(prod.send_request("h", [1, 2], to=b.address, timeout=5))
            with pytest.raises(RemoteProtocolError):
                await recv
            with pytest.raises(TransferAbortedError, match="source block id out of range"):
                await send
        finally:
            Descriptor.to_wire = real  # type: ignore[method-assign]
            Descriptor.to_ring = real_ring  # type: ignore[method-assign]
        assert raw.launched == 0 and plane.statistics().ring_launches == 0
        assert untouched(before, c)
        assert "h" not in prod.finished_sending()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cancelled_after_the_ring_launched_writes_nothing() -> None:
    """The ring's poll launched the copy; the request's task is cancelled before it
    resumed: the abort word is set before the (faked) GPU runs the copy, so nothing is
    written, the slot is never reused, and the producer gets a failed release."""
    async with staged_pair() as t:
        c, a, b, prod, cons, plane = t.c, t.a, t.b, t.prod, t.cons, t.plane
        raw = t.raw
        before = [x.clone() for x in c]
        recv = asyncio.create_task(cons.recv_request("x", [7, 8], frm=a.address, timeout=5))
        launch = plane.consumer.copier.launch_staged

        def launch_then_cancel(st: Any, desc: Descriptor) -> None:
            launch(st, desc)
            assert st.launched
            recv.cancel()

        plane.consumer.copier.launch_staged = launch_then_cancel  # type: ignore[method-assign]
        await asyncio.sleep(0.02)
        staged = plane.consumer.inbox.waiting["x"][2]
        assert staged is not None
        with pytest.raises(TransferAbortedError, match="cancelled"):
            await prod.send_request("x", [1, 2], to=b.address, timeout=5)
        with pytest.raises(asyncio.CancelledError):
            await recv
        assert raw.launched == 1
        staged.sb.done.query()  # the GPU runs whatever was queued, sooner or later
        st = plane.statistics()
        assert st.ring_launches == 1 and st.aborted == 1
        assert untouched(before, c)
        assert staged.g not in plane.state.words.free  # an aborted slot never serves again
        assert "x" not in prod.finished_sending()
        assert cons.statistics().recv_failures == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancel", [False, True])
async def test_validated_by_the_ring_before_the_producer_is_ready(cancel: bool) -> None:
    """The ring's poll validates the descriptor but the producer's event has not fired:
    the request's task waits for it and launches the staged copy (no second decode);
    cancelled while it waits, nothing is launched, the slot serves again and the
    producer hears "cancelled" at once instead of running into its lease."""
    async with staged_pair() as t:
        pl, p, c, a, b, prod, cons, plane = t.pl, t.p, t.c, t.a, t.b, t.prod, t.cons, t.plane
        raw = t.raw
        before = [x.clone() for x in c]
        FakeEvent.fire_after = None if cancel else 0.1
        try:
            recv = asyncio.create_task(cons.recv_request("w", [7, 8], frm=a.address, timeout=5))
            await asyncio.sleep(0.02)
            staged = plane.consumer.inbox.waiting["w"][2]
            assert staged is not None
            send = asyncio.create_task(prod.send_request("w", [1, 2], to=b.address, timeout=5))
            for _ in range(200):
                await asyncio.sleep(0.005)
                if staged.desc is not None:
                    break
            assert staged.desc is not None and not staged.launched
            if cancel:
                recv.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await recv
                with pytest.raises(TransferAbortedError, match="cancelled"):
                    await send
                assert raw.launched == 0 and untouched(before, c)
                assert staged.g in plane.state.words.free
                assert cons.statistics().recv_failures == 1
            else:
                assert await recv == "ipc"
                await send
                assert raw.launched == 1 and landed(pl, p, [1, 2], c, [7, 8])
                assert "w" in prod.finished_sending()
            st = plane.statistics()
            assert st.ring_launches == 0  # (launched by the task, if at all)
            assert st.staged_launches == (0 if cancel else 1)
        finally:
            FakeEvent.fire_after = 0.0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pull_mode_stages_beside_the_ticket() -> None:
    """fetch_request from a producer whose ring is mapped: the receive starts beside
    the ticket's GET, staged, and the ring's poll launches the copy; a fetch of a
    ticket nobody serves fails at once and leaves no staging or waiter behind."""
    async with staged_pair() as t:
        pl, p, c, a, b, prod, cons, plane = t.pl, t.p, t.c, t.a, t.b, t.prod, t.cons, t.plane
        raw = t.raw
        assert plane.stages_for(a.address) and not plane.stages_for(b.address)
        for r, (src, dst) in enumerate([([3, 1, 4], [5, 9, 2]), ([7], [0])]):
            serving = asyncio.ensure_future(prod.serve_request(f"p{r}", src, timeout=20))
            await asyncio.sleep(0.01)
            assert await cons.fetch_request(f"p{r}", dst, frm=a.address, timeout=20) == "ipc"
            assert await serving == b.address
            assert landed(pl, p, src, c, dst)
        st = plane.statistics()
        assert st.staged_launches == raw.launched == 2
        free = sorted(plane.state.words.free)
        with pytest.raises(NotPublishedError):
            await cons.fetch_request("nobody", [1], frm=a.address, timeout=5)
        assert not plane.consumer.inbox.waiting and sorted(plane.state.words.free) == free
        assert cons.statistics().recv_failures == 1  # counted once
        assert plane.statistics().staged_launches == 2


def _desc(plane: IpcPlane, rid: str, over: dict[str, Any] | None = None) -> Descriptor:
    """A ring descriptor the staging for ``rid`` (2 blocks) accepts, with ``over``."""
    (m,) = plane.state.maps.values()
    handle = secrets.token_bytes(64)
    FakeBackend.events[handle] = FakeEvent()
    d = Descriptor(
        rid=rid,
        plane="ipc",
        n=2,
        reply_to=m.reply_to,
        token=m.token,
        src=(1, 2),
        event=handle,
        event_slot=0,
        lease=time.monotonic() + 10,
    )
    return dataclasses.replace(d, **(over or {}))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_poll_launches_only_what_the_task_would() -> None:
    """Each way a ring descriptor can be wrong for its staging -- the other request's,
    another block count, layer-wise, an inline offer, another export, a source id out
    of range, a lease already over, an event nobody exported -- and the poll launches
    nothing and keeps nothing (the task then checks it the ordinary way, raising as
    without staging); the one right descriptor launches. (Records that do not decode
    never reach it: test_ipc_doorbell.py.)"""
    async with staged_pair() as t:
        plane, a = t.plane, t.a
        nb = t.pl.num_blocks
        bad: dict[str, dict[str, Any]] = {
            "rid": {"rid": "other"},
            "n": {"n": 3, "src": (1, 2, 3)},
            "plane": {"plane": "ipc-layers", "event": b"", "event_slot": 0},
            "token": {"token": 12345},
            "offer": {"offer": t.prod._ipc.producer.make_export().offer},
            "src": {"src": (1, nb)},
            "lease": {"lease": time.monotonic() - 1},
            "event": {"event": secrets.token_bytes(64)},
        }
        for what, over in bad.items():
            st = plane.consumer.copier.stage(f"s-{what}", (7, 8), a.address, time.monotonic() + 10)
            assert st is not None
            plane.consumer.copier.launch_staged(st, _desc(plane, f"s-{what}", over))
            assert not st.launched and st.desc is None, what
            plane.consumer.copier.unstage(st)
        st = plane.consumer.copier.stage("s-ok", (7, 8), a.address, time.monotonic() + 10)
        assert st is not None
        plane.consumer.copier.launch_staged(st, _desc(plane, "s-ok"))
        assert st.launched and st.desc is not None and t.raw.launched == 1
        await plane.consumer.copier.pull_staged(st, time.monotonic() + 10, True, None)
        assert landed(t.pl, t.p, [1, 2], t.c, [7, 8])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_error_inside_the_poll_leaves_the_request_to_its_task() -> None:
    """Whatever goes wrong while the ring's poll looks at a staged request (here the
    device check raises) stays out of the poll: it launches nothing, keeps polling,
    and the request's task copies it the ordinary way."""
    async with staged_pair() as t:
        plane, a, b = t.plane, t.a, t.b

        def broken() -> bool:
            raise RuntimeError("CUDA went away (faked)")

        plane.state.on_device = broken  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        failed: list[Any] = []  # the waiter reports a poll that raised (it drops that poll)
        loop.set_exception_handler(lambda _loop, ctx: failed.append(ctx))
        recv = asyncio.create_task(t.cons.recv_request("e", [7, 8], frm=a.address, timeout=5))
        await asyncio.sleep(0.02)
        assert plane.consumer.inbox.waiting["e"][2] is not None  # staged
        await t.prod.send_request("e", [1, 2], to=b.address, timeout=5)
        assert await recv == "ipc"
        assert landed(t.pl, t.p, [1, 2], t.c, [7, 8])
        st = plane.statistics()
        assert st.staged_launches == st.ring_launches == 0 and t.raw.launched == 1
        loop.set_exception_handler(None)
        assert not failed, failed  # (the ring's poll ends once nothing waits; never by an error)
