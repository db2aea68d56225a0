"""Layer-wise streaming over the IPC plane, and the release sent off the critical path,
on CPU (CUDA faked as in tests/kv/ipc/test_ipc_plane.py: same process, events that fire when
told). The GPU side is tests/gpu/test_ipc_layers_gpu.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kvutil import blocks, filled, make_layout, rand_ids
from test_ipc_plane import FakeBackend, FakeEvent, _desc_wire, connectors, landed, move, pair

from aiokv import LayoutMismatchError, RemoteProtocolError, TransferAbortedError
from aiokv.kv import KVConnector, KVLayout
from aiokv.kv.ipc import LAYERS, Descriptor, LayerReady, decode_message, encode_message
from aiokv.kv.ipc._wire_layers import layer_messages

L = 4


def layout(kind: str = "fa", dtype: str = "bfloat16", nb: int = 24) -> KVLayout:
    return make_layout(kind, dtype, nb, num_layers=L)


def layer_landed(pl: KVLayout, p: Any, src: list[int], c: Any, dst: list[int], layer: int) -> bool:
    import torch

    return torch.equal(blocks(p[layer], pl, src), blocks(c[layer], pl, dst))


async def save_all(prod: KVConnector, rid: str, src: list[int], to: str, order: list[int]) -> None:
    for li in order:
        prod.save_layer(rid, li, src, to=to, timeout=10)
        await asyncio.sleep(0)  # the layers' messages go out at the end of each pass
    await prod.wait_saved(rid)


# --------------------------------------------------------------------------- end to end


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
async def test_layerwise_over_the_plane_every_layout(kind: str, dtype: str) -> None:
    pl = make_layout(kind, dtype, 31, num_layers=L)
    cl = make_layout(kind, dtype, 23, num_layers=L)
    p, c = filled(pl, 1), filled(cl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, cl) as (a, b):
        prod, cons = connectors(a, b, pl, p, cl, c)
        sent: list[int] = []
        for r, (n, order) in enumerate([(1, [0, 1, 2, 3]), (5, [2, 0, 3, 1]), (9, [3, 2, 1, 0])]):
            src, dst = rand_ids(n, 31, 30 + r), rand_ids(n, 23, 40 + r)
            recv = asyncio.create_task(
                cons.recv_request(f"l{r}", dst, frm=a.address, timeout=10, layerwise=True)
            )
            await save_all(prod, f"l{r}", src, b.address, order)
            await recv
            assert landed(pl, p, src, c, dst)
            sent += dst
        others = [i for i in range(23) if i not in sent]
        for li in range(L):
            assert torch_equal(blocks(c[li], cl, others), blocks(before[li], cl, others))
        assert prod.finished_sending() == {"l0", "l1", "l2"}
        assert cons.finished_receiving() == {"l0", "l1", "l2"}
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.requests_sent == 3 and cs.ipc.requests_received == 3
        assert cs.ipc.mappings_verified == 1 and not ps.ipc.fallbacks and not cs.ipc.fallbacks
        assert ps.chunks_sent == 0 and cs.chunks_received == 0  # nothing the ordinary way
        await prod.aclose()
        await cons.aclose()


def torch_equal(x: Any, y: Any) -> bool:
    """Bit-exact (random bytes include NaNs, which ``torch.equal`` calls unequal)."""
    import torch

    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layer_copied_only_after_its_event() -> None:
    """Each layer is copied once ITS event fired: a layer whose event has not fired yet
    is not in place while the earlier ones are."""
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])  # offer mapped
        src, dst = [3, 4], [7, 8]
        before = [t.clone() for t in c]
        recv = asyncio.create_task(
            cons.recv_request("s", dst, frm=a.address, timeout=10, layerwise=True)
        )
        prod.save_layer("s", 0, src, to=b.address)
        FakeEvent.fire_after = 0.4
        try:
            prod.save_layer("s", 1, src, to=b.address)
        finally:
            FakeEvent.fire_after = 0.0
        for li in (2, 3):
            prod.save_layer("s", li, src, to=b.address)
        t0 = time.monotonic()
        while not layer_landed(pl, p, src, c, dst, 0):
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        for li in (1, 2, 3):  # layer 1 waits for its event; 2 and 3 queue behind it
            assert torch_equal(blocks(c[li], pl, dst), blocks(before[li], pl, dst))
        await prod.wait_saved("s")
        await recv
        assert time.monotonic() - t0 >= 0.25
        assert landed(pl, p, src, c, dst)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layers_already_written_are_copied_in_one_launch() -> None:
    """A consumer that comes after the producer's forward (every layer's event fired)
    copies the request in ONE launch, not one per layer: on one H200 the per-layer
    launches made layer-wise throughput 25 GB/s against 150 for whole requests. While a later layer is not written yet, layers still go one by one."""
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        plane: Any = cons._ipc
        launch = plane.consumer.copier._launch
        chunks: list[tuple[int, int]] = []

        def spy(*args: Any, **kw: Any) -> Any:
            chunks.append((args[7], args[8]))
            return launch(*args, **kw)

        plane.consumer.copier._launch = spy
        for rid, src, dst, late in [("all", [3, 4], [7, 8], 0.0), ("tail", [5, 6], [9, 10], 0.3)]:
            for li in range(L):
                FakeEvent.fire_after = late if li == L - 1 else 0.0
                try:
                    prod.save_layer(rid, li, src, to=b.address)
                finally:
                    FakeEvent.fire_after = 0.0
            await asyncio.sleep(0.05)  # the message is with the consumer before it asks
            recv = asyncio.create_task(
                cons.recv_request(rid, dst, frm=a.address, timeout=10, layerwise=True)
            )
            await prod.wait_saved(rid)
            await recv
            assert landed(pl, p, src, c, dst)
        assert chunks == [(0, L), *((i, i + 1) for i in range(L))], chunks
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_later_layers_must_name_the_first_layers_blocks() -> None:
    """The layers after the first are compared with the first's (checked) ids, not
    checked again (~10 µs a layer on 256 ids): the same ids as a list, tuple or CPU
    tensor pass; other ids, another count or invalid ids are refused, and the request
    still completes with its first ids."""
    import torch

    from aiokv import ConfigError

    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        src, dst = [3, 4], [7, 8]
        recv = asyncio.create_task(
            cons.recv_request("s", dst, frm=a.address, timeout=10, layerwise=True)
        )
        prod.save_layer("s", 0, src, to=b.address)
        for bad in ([3, 5], [3], [3, 4, 5], [3, -1], (4, 3), torch.tensor([3, 5])):
            with pytest.raises(ConfigError):
                prod.save_layer("s", 1, bad, to=b.address)
        prod.save_layer("s", 1, (3, 4), to=b.address)
        prod.save_layer("s", 2, torch.tensor([3, 4]), to=b.address)
        prod.save_layer("s", 3, [3, 4], to=b.address)
        await prod.wait_saved("s")
        await recv
        assert landed(pl, p, src, c, dst)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cancel_mid_stream_copies_nothing_more() -> None:
    """The consumer cancelled after two layers: the later layers are never written (even
    once their events fire), the producer learns it failed, and the layer messages it
    sends afterwards are dropped on the consumer."""
    pl = layout("mla", "float16")
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        src, dst = [5, 6, 9], [2, 3, 4]
        before = [t.clone() for t in c]
        recv = asyncio.create_task(
            cons.recv_request("x", dst, frm=a.address, timeout=10, layerwise=True)
        )
        prod.save_layer("x", 0, src, to=b.address)
        prod.save_layer("x", 1, src, to=b.address)
        FakeEvent.fire_after = 0.5
        try:
            prod.save_layer("x", 2, src, to=b.address)  # not ready for 0.5 s
        finally:
            FakeEvent.fire_after = 0.0
        t0 = time.monotonic()
        while not layer_landed(pl, p, src, c, dst, 1):
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.01)
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        prod.save_layer("x", 3, src, to=b.address)  # after the cancel
        with pytest.raises(TransferAbortedError, match="cancelled"):
            await prod.wait_saved("x")
        await asyncio.sleep(0.8)  # layer 2's event has fired by now
        assert layer_landed(pl, p, src, c, dst, 0) and layer_landed(pl, p, src, c, dst, 1)
        for li in (2, 3):
            assert torch_equal(blocks(c[li], pl, dst), blocks(before[li], pl, dst))
        cs = cons.statistics()
        assert cs.ipc is not None and cs.ipc.aborted == 1
        assert "x" not in cons.finished_receiving()
        held = [*b._store._entries, *b._store._pending]
        assert not any(str(k).startswith("x#") for k in held)  # messages dropped
        # the next request reuses the same destination blocks at once
        await move(prod, cons, a, b, "y", [10, 11, 12], dst)
        assert landed(pl, p, [10, 11, 12], c, dst)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_mode_mismatch_both_ways() -> None:
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        before = [t.clone() for t in c]
        recv = asyncio.create_task(cons.recv_request("m1", [4, 5], frm=a.address, timeout=10))
        with pytest.raises(TransferAbortedError, match="mode mismatch"):
            await save_all(prod, "m1", [2, 3], b.address, list(range(L)))
        with pytest.raises(LayoutMismatchError) as ei:
            await recv
        assert ei.value.code == "kv_mode_mismatch"
        recv = asyncio.create_task(
            cons.recv_request("m2", [4, 5], frm=a.address, timeout=10, layerwise=True)
        )
        with pytest.raises(TransferAbortedError, match="mode mismatch"):
            await prod.send_request("m2", [2, 3], to=b.address, timeout=10)
        with pytest.raises(LayoutMismatchError) as ei:
            await recv
        assert ei.value.code == "kv_mode_mismatch"
        assert all(torch_equal(x, y) for x, y in zip(c, before))
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layerwise_falls_back_when_mapping_fails() -> None:
    pl = layout("fi", "float32")
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, cb=FakeBackend(fail_open=True))
        for r in range(2):  # the first discovers it, the second goes the ordinary way at once
            src, dst = [1 + r, 9], [3 + r, 12]
            recv = asyncio.create_task(
                cons.recv_request(f"f{r}", dst, frm=a.address, timeout=10, layerwise=True)
            )
            await save_all(prod, f"f{r}", src, b.address, list(range(L)))
            await recv
            assert landed(pl, p, src, c, dst)
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert cs.ipc.fallbacks == {"map_failed": 1} and ps.ipc.fallbacks["map_failed"] == 2
        assert ps.chunks_sent == 2 * L and cs.requests_received == 2
        assert prod.finished_sending() == {"f0", "f1"}
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_hostile_layer_message_copies_nothing() -> None:
    """A layer message that names layers the request does not have is refused before
    anything is copied; the producer hears the request failed."""
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        before = [t.clone() for t in c]
        assert prod._ipc is not None
        send = prod._ipc.state.send_msg

        def evil(tid: str, msg: Any, to: str, timeout: float, *wait: Any) -> None:
            if "#ipcL" in tid:
                msg = dict(msg, marks=[[L + 7, *msg["marks"][0][1:]]])
            send(tid, msg, to, timeout, *wait)

        prod._ipc.state.send_msg = evil  # type: ignore[method-assign]
        recv = asyncio.create_task(
            cons.recv_request("h", [4, 5], frm=a.address, timeout=10, layerwise=True)
        )
        with pytest.raises(TransferAbortedError):
            await save_all(prod, "h", [2, 3], b.address, list(range(L)))
        with pytest.raises(RemoteProtocolError):
            await recv
        assert all(torch_equal(x, y) for x, y in zip(c, before))
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_release_reaches_the_producer_when_the_consumer_closes_at_once() -> None:
    """The release of a finished copy is sent after the caller resumed (off the critical
    path); a consumer that closes its connector and engine right after the call still
    sends it (aclose flushes it), so the producer's send succeeds."""
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        send = asyncio.create_task(prod.send_request("z", [2, 3], to=b.address, timeout=3))
        await cons.recv_request("z", [4, 5], frm=a.address, timeout=3)
        await cons.aclose()
        await b.aclose()
        await send  # not TransferTimeoutError at lease + grace
        assert prod.finished_sending() == {"w", "z"}
        await prod.aclose()


# --------------------------------------------------------------------------- wire


def test_layer_ready_roundtrip() -> None:
    lr = LayerReady("r", 1, ((2, b"e" * 64, 7), (4, b"f" * 64, 8)))
    assert lr.hi == 4
    assert LayerReady.from_wire(decode_message(encode_message(lr.to_wire())), 4) == lr


def _lr_wire(**over: Any) -> dict[str, Any]:
    d = LayerReady("r", 1, ((2, b"e" * 64, 7),)).to_wire()
    d.update(over)
    return d


def _mk(hi: Any = 2, event: Any = b"e" * 64, slot: Any = 7) -> list[Any]:
    return [hi, event, slot]


@pytest.mark.parametrize(
    "over",
    [
        {"lo": -1},
        {"lo": 4},  # the consumer has 4 layers
        {"lo": True},
        {"marks": []},
        {"marks": "x"},
        {"marks": (_mk(),)},  # (msgpack gives lists; a tuple is not what came off the wire)
        {"marks": [_mk(1)]},  # empty chunk
        {"marks": [_mk(5)]},
        {"marks": [_mk(2.0)]},
        {"marks": [_mk(True)]},
        {"marks": [_mk(3), _mk(3)]},  # not rising
        {"marks": [_mk(3), _mk(2)]},
        {"marks": [_mk(2), _mk(3), _mk(4), _mk(4)]},  # more marks than layers from lo
        {"marks": [[2, b"e" * 64]]},
        {"marks": [[2, b"e" * 64, 7, 0]]},
        {"marks": [_mk(event=b"")]},
        {"marks": [_mk(event=b"e" * 257)]},
        {"marks": [_mk(event="e")]},
        {"marks": [_mk(slot=-1)]},
        {"marks": [_mk(slot=1 << 21)]},
        {"rid": 5},
        {"extra": 1},
        {"hi": 2},  # the one-chunk form of earlier releases
    ],
)
def test_layer_ready_rejects(over: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        LayerReady.from_wire(_lr_wire(**over), 4)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_layer_messages_one_per_run_each_layer_its_own_mark(data: Any) -> None:
    """A loop pass's saved layers, in any order, become one message per run of
    consecutive layers; every layer keeps its own event; the messages round-trip."""
    n = data.draw(st.integers(1, 80), label="layers")
    layers = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1), label="saved")
    saved = [(li, f"ev{li}".encode(), 1000 + li) for li in layers]
    msgs = layer_messages("r", saved)
    runs = 1 + sum(1 for x, y in zip(sorted(layers), sorted(layers)[1:]) if y != x + 1)
    assert len(msgs) == runs
    seen = []
    for lr in msgs:
        assert LayerReady.from_wire(decode_message(encode_message(lr.to_wire())), n) == lr
        prev = lr.lo
        for hi, ev, slot in lr.marks:
            assert hi == prev + 1 and ev == f"ev{prev}".encode() and slot == 1000 + prev
            seen.append(prev)
            prev = hi
    assert seen == sorted(layers)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layers_saved_in_one_pass_go_in_one_message() -> None:
    """A forward that saves all its layers without yielding sends ONE layer message
    (each layer its own event inside), not one per layer: per message the engine's
    send costs ~19 µs here and ~33 µs on an H200 host (32 layers'
    messages took 1.06 ms to send). Layers saved in later passes come in messages of
    their own, starting where they start; the consumer asks for them in order."""
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        assert prod._ipc is not None
        send = prod._ipc.state.send_msg
        tids: list[str] = []

        def spy(tid: str, msg: Any, to: str, timeout: float, *wait: Any) -> None:
            if "#ipcL" in tid:
                tids.append(tid)
            send(tid, msg, to, timeout, *wait)

        prod._ipc.state.send_msg = spy  # type: ignore[method-assign]
        for rid, passes in [("one", [[0, 1, 2, 3]]), ("two", [[3, 0, 1], [2]])]:
            src, dst = [3, 4], [7, 8]
            recv = asyncio.create_task(
                cons.recv_request(rid, dst, frm=a.address, timeout=10, layerwise=True)
            )
            for layers in passes:
                for li in layers:
                    prod.save_layer(rid, li, src, to=b.address)
                await asyncio.sleep(0)
            await prod.wait_saved(rid)
            await recv
            assert landed(pl, p, src, c, dst)
        assert tids == ["one#ipcL0", "two#ipcL0", "two#ipcL3", "two#ipcL2"]
        cs = cons.statistics()
        assert cs.ipc is not None and cs.ipc.requests_received == 3 and not cs.ipc.fallbacks
        await prod.aclose()
        await cons.aclose()


def test_layers_descriptor() -> None:
    d = _desc_wire(plane=LAYERS, event=b"", event_slot=0)
    desc, lay = Descriptor.from_wire(decode_message(encode_message(d)))
    assert desc.plane == LAYERS and desc.src == (1, 2) and lay is not None
    for bad in ({"event": b"e" * 64}, {"event_slot": 3}, {"plane": "ipc-layer"}):
        with pytest.raises(RemoteProtocolError):
            Descriptor.from_wire({**d, **bad})


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layer_tables_are_the_layers_addresses_in_aligned_allocations() -> None:
    """The kernel's tables for a chunk of layers: the producer's and the consumer's
    base addresses of exactly those layers, each table its own 16-byte aligned
    allocation (a slice of the whole table at an odd layer would be 8-byte aligned and
    make Triton compile another variant mid-request), made once per chunk."""
    pl = layout()
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w", [1], [1])
        plane = cons._ipc
        assert plane is not None
        (m,) = plane.state.maps.values()
        for lo, hi in ((1, 2), (1, 3), (0, L), (3, 4)):
            st, dt = plane.state.tables(m, lo, hi)
            assert st.tolist() == [m.src_layers[i].data_ptr() for i in range(lo, hi)]
            assert dt.tolist() == [c[i].data_ptr() for i in range(lo, hi)]
            assert st.data_ptr() % 16 == 0 and dt.data_ptr() % 16 == 0
            assert plane.state.tables(m, lo, hi)[0] is st  # cached
        # the producer's layers, as the consumer maps them: the same bytes
        assert all(torch_equal(m.src_layers[i], p[i].view(m.src_layers[i].dtype)) for i in range(L))
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_block_ids_checked_in_python_as_the_connector_does() -> None:
    """The plane checks list block ids itself (no torch calls): the connector's rules
    hold, and nothing is sent for a call it refuses."""
    from aiokv import ConfigError

    pl = layout(nb=24)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        for bad in ([-1], [24], [1, True], [1.0], "12"):
            with pytest.raises(ConfigError):
                await prod.send_request("b", bad, to=b.address, timeout=1)  # type: ignore[arg-type]
            with pytest.raises(ConfigError):
                prod.save_layer("b", 0, bad, to=b.address)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="duplicate"):
            await cons.recv_request("b", [3, 3], frm=a.address, timeout=1)
        assert prod._ipc is not None and not prod._ipc.producer.saves
        # tuples and tensors take the same path as lists
        import torch

        recv = asyncio.create_task(
            cons.recv_request("t", torch.tensor([4, 5]), frm=a.address, timeout=10)
        )
        await prod.send_request("t", (2, 3), to=b.address, timeout=10)
        await recv
        assert landed(pl, p, [2, 3], c, [4, 5])
        await prod.aclose()
        await cons.aclose()


def test_trace_summary() -> None:
    from aiokv.cli.bench.kv import _trace_summary

    prod = [("lat0", "send", 1.0), ("lat0", "sent", 1.0002), ("lat1", "send", 2.0)]
    cons = [("lat0", "desc", 1.0005), ("lat1", "desc", 2.0007), ("x", "desc", 0.0)]
    out = _trace_summary(prod, cons, [1.0, 2.0], [1.001, 2.003])
    assert list(out) == ["send", "sent", "desc", "end"]  # ordered by time
    assert out["desc"] == pytest.approx(0.6) and out["end"] == pytest.approx(2.0)
