"""The NCCL transport's receive side on CPU, with CUDA streams/events and NCCL faked.

``aiokv.transport.nccl.NcclSink`` decides how granted receives are grouped, in
which order batches land, and how long buffers live after a post is cut short;
none of that needs a GPU to check. Streams and events are fakes, the
communicator records the groups it was given, the buffers are CPU tensors, and
the progress poller is the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiokv
import aiokv.transport.nccl as nccl_mod
from aiokv import TransferAbortedError
from aiokv.envs import engine_overrides, parse_recv_batch
from aiokv.gpu.cuda import ProgressPoller
from aiokv.protocol.messages import TensorSpec

MiB = 1 << 20


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeStream:
    cuda_stream = 0

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def wait_event(self, _ev: Any) -> None:
        pass


class FakeComm:
    """Records each group's receives (as weak references); optionally never settles."""

    def __init__(self, *, settles: bool = True) -> None:
        self.groups: list[list[weakref.ref[torch.Tensor]]] = []
        self.aborted = False
        self.settles = settles
        self.pending = False

    @property
    def closed(self) -> bool:
        return self.aborted

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self.groups.append([])
        yield
        self.pending = not self.settles

    def recv(self, t: torch.Tensor, peer: int, stream: Any) -> int:
        self.groups[-1].append(weakref.ref(t))
        return 0

    async def wait_ready(self) -> None:
        await asyncio.Event().wait()  # an enqueue that never settles

    def abort(self) -> None:
        self.aborted = True

    def async_error(self) -> int:
        return 0


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[FakeEvent]:
    recorded: list[FakeEvent] = []

    def record_event(_stream: Any = None) -> FakeEvent:
        ev = FakeEvent()
        recorded.append(ev)
        return ev

    monkeypatch.setattr(nccl_mod, "record_event", record_event)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_a, **_k: FakeStream())
    monkeypatch.setattr(torch.cuda, "device", lambda *_a, **_k: contextlib.nullcontext())
    return recorded


def spec(i: int, nbytes: int) -> TensorSpec:
    return TensorSpec(f"t{i}", "uint8", (nbytes,))


async def settle(poller: ProgressPoller, until: Any, limit: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not until() and loop.time() < end:
        await asyncio.sleep(0.001)


@pytest.mark.anyio
async def test_receive_batches_are_capped_by_count_and_bytes(
    events: list[FakeEvent],
) -> None:
    poller = ProgressPoller(spin_s=0.0)
    comm = FakeComm()
    sink = nccl_mod.NcclSink(  # small caps, small tensors
        comm,  # type: ignore[arg-type]
        poller,
        torch.device("cpu"),
        max_batch=4,
        max_batch_bytes=8 * MiB,
    )
    small = [sink.expect(i, i, [spec(i, MiB)]) for i in range(10)]
    await settle(poller, lambda: len(events) >= 3)
    assert [len(g) for g in comm.groups] == [4, 4, 2]  # 1 MiB each: at most 4 a group
    big = [sink.expect(10 + i, 10 + i, [spec(10 + i, 3 * MiB)]) for i in range(4)]
    await settle(poller, lambda: len(events) >= 5)
    # 3 MiB each: a group closes once it holds >= 8 MiB
    assert [len(g) for g in comm.groups] == [4, 4, 2, 3, 1]
    for ev in events:
        ev.done = True
    await settle(poller, lambda: all(f.done() for f in small + big))
    assert [f.result()[0].numel() for f in small + big] == [MiB] * 10 + [3 * MiB] * 4
    sink.abort(RuntimeError("test over"))
    await poller.stop()


@pytest.mark.anyio
async def test_batches_land_in_posting_order_whatever_order_events_fire(
    events: list[FakeEvent],
) -> None:
    poller = ProgressPoller(spin_s=0.0)
    comm = FakeComm()
    sink = nccl_mod.NcclSink(
        comm,  # type: ignore[arg-type]
        poller,
        torch.device("cpu"),
        max_batch=4,
        max_batch_bytes=8 * MiB,
    )
    futs = [sink.expect(i, i, [spec(i, MiB)]) for i in range(12)]  # three batches of four
    await settle(poller, lambda: len(events) == 3)
    assert len(events) == 3
    events[2].done = True  # the last batch's event is seen first
    await asyncio.sleep(0.05)
    assert not any(f.done() for f in futs)
    events[0].done = True
    await settle(poller, lambda: all(f.done() for f in futs[:4]))
    await asyncio.sleep(0.05)
    assert all(f.done() for f in futs[:4]) and not any(f.done() for f in futs[4:])
    events[1].done = True
    await settle(poller, lambda: all(f.done() for f in futs))
    assert all(f.done() and not f.exception() for f in futs)
    sink.abort(RuntimeError("test over"))
    await poller.stop()


@pytest.mark.anyio
async def test_cut_short_post_keeps_buffers_until_the_stream_passed_them(
    events: list[FakeEvent],
) -> None:
    poller = ProgressPoller(spin_s=0.0)
    comm = FakeComm(settles=False)  # the receive is posted, its enqueue never settles
    sink = nccl_mod.NcclSink(comm, poller, torch.device("cpu"))  # type: ignore[arg-type]
    fut = sink.expect(0, 0, [spec(0, MiB)])
    await settle(poller, lambda: bool(comm.groups))
    await asyncio.sleep(0.01)
    buf = comm.groups[0][0]
    assert buf() is not None
    sink.abort(RuntimeError("peer lost"))  # cancels the sink's task inside wait_ready
    await settle(poller, fut.done)
    assert isinstance(fut.exception(), TransferAbortedError)
    await asyncio.sleep(0.05)
    # the stream may still write into it: held by the poller, not freed
    assert buf() is not None
    assert poller.statistics().pending == 1
    events[-1].done = True  # the stream passed the aborted receive
    await settle(poller, lambda: buf() is None)
    # freed as soon as the poller let go: no frame kept by the cancelled task holds it
    assert buf() is None
    await poller.stop()


def test_recv_batch_caps_default_and_override() -> None:
    # the sink's defaults are the config's; the CLI turns AIOKV_NCCL_RECV_BATCH into them
    cfg = aiokv.EngineConfig()
    assert (cfg.nccl_recv_batch, cfg.nccl_recv_batch_bytes) == (8, 128 * MiB)
    assert engine_overrides({"AIOKV_NCCL_RECV_BATCH": "16, 64"}) == {
        "nccl_recv_batch": 16,
        "nccl_recv_batch_bytes": 64 * MiB,
    }
    assert parse_recv_batch("2,0.5") == (2, MiB // 2)
    for bad in ("8", "x,1", "0,8", "4,-1", "4,8,1"):
        with pytest.raises(aiokv.ConfigError, match="AIOKV_NCCL_RECV_BATCH"):
            engine_overrides({"AIOKV_NCCL_RECV_BATCH": bad})
    for field in ("nccl_recv_batch", "nccl_recv_batch_bytes"):
        for value in (0, -1, 1.5, True):
            with pytest.raises(aiokv.ConfigError, match=field):
                aiokv.EngineConfig(**{field: value})
