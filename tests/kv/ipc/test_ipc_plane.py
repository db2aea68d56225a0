"""The IPC plane's protocol, validation, rules and fallbacks, on CPU.

CUDA is faked: :class:`FakeBackend` "exports" a storage by registering it under
random handle bytes and "maps" it by looking it up (both connectors run in this
process), events are always fired. Everything else -- the descriptor/release
messages over real engines (loopback TCP), the offer's validation, the
verification probe, the lease, the fallback to the ordinary path with its
counters -- is the real code. The GPU tests (tests/gpu/test_ipc_gpu.py) cover the
real CUDA IPC, the kernel, cancellation and a killed peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import msgpack
import pytest
from support.kvutil import blocks, filled, make_layout, rand_ids

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import (
    ConfigError,
    Engine,
    EngineConfig,
    LayoutMismatchError,
    RemoteProtocolError,
    Timeouts,
    TransferAbortedError,
    TransferTimeoutError,
)
from aiokv._runtime.waiter import waiter_for
from aiokv.kv import (
    FlashAttentionLayout,
    IpcOptions,
    KVConnector,
    KVLayout,
)
from aiokv.kv import ipc as ipcmod
from aiokv.kv.ipc import (
    Descriptor,
    IpcPlane,
    IpcUnavailableError,
    Offer,
    Release,
    StorageExport,
    check_same_host,
    decode_message,
    encode_message,
    unsupported_reason,
)
from aiokv.kv.ipc import _state as ipc_state
from aiokv.kv.ipc._wire import MAX_MESSAGE_BYTES

OPTS = IpcOptions(trust_unauthenticated=True, grace_s=0.3)


class FakeEvent:
    """Fires at once, or ``fire_after`` seconds after each record (None: never)."""

    fire_after: float | None = 0.0

    def __init__(self) -> None:
        self.recorded = 0
        self.at = 0.0
        self.delay = FakeEvent.fire_after

    def record(self, stream: object = None) -> None:
        self.recorded += 1
        self.at = time.monotonic()
        self.delay = FakeEvent.fire_after

    def query(self) -> bool:
        return self.delay is not None and time.monotonic() >= self.at + self.delay


class FakeBackend:
    """Same-process stand-in for CUDA IPC (see the module docstring)."""

    registry: dict[bytes, torch.UntypedStorage] = {}
    events: dict[bytes, FakeEvent] = {}

    def __init__(self, *, fail_open: bool = False, corrupt_probe: bool = False) -> None:
        self.fail_open = fail_open
        self.corrupt_probe = corrupt_probe
        self.opened = 0

    def export(self, storage: torch.UntypedStorage) -> StorageExport:
        h = secrets.token_bytes(64)
        self.registry[h] = storage
        return StorageExport(h, storage.nbytes(), 0, b"", 0, b"")

    def open(self, e: StorageExport, device: torch.device) -> torch.Tensor:
        if self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context (faked)")
        self.opened += 1
        st = self.registry[e.handle]
        t: Any = torch.empty(0, dtype=torch.uint8)
        t.set_(st)
        if self.corrupt_probe and st.nbytes() == e.size and self.opened > 1:
            return torch.zeros(e.size, dtype=torch.uint8)  # "mapped", but other memory
        out: torch.Tensor = t
        return out

    def new_event(self, device: torch.device) -> tuple[Any, bytes]:
        h = secrets.token_bytes(64)
        ev = FakeEvent()
        self.events[h] = ev
        return ev, h

    def open_event(self, handle: bytes, device: torch.device) -> Any:
        return self.events[handle]

    def new_stream(self, device: torch.device) -> Any:
        return None


def landed(
    pl: KVLayout, p: list[torch.Tensor], src: list[int], c: list[torch.Tensor], dst: list[int]
) -> bool:
    return all(
        torch.equal(blocks(p[i], pl, src), blocks(c[i], pl, dst)) for i in range(pl.num_layers)
    )


@asynccontextmanager
async def pair(la: KVLayout, lb: KVLayout) -> AsyncIterator[tuple[Engine, Engine]]:
    def cfg(lay: KVLayout) -> EngineConfig:
        return EngineConfig(timeouts=Timeouts(transfer=20.0), layout=lay.to_wire())

    async with Engine(cfg(la)) as a, Engine(cfg(lb)) as b:
        yield a, b


def connectors(
    a: Engine,
    b: Engine,
    pl: KVLayout,
    p: list[torch.Tensor],
    cl: KVLayout,
    c: list[torch.Tensor],
    *,
    pb: Any = None,
    cb: Any = None,
    opts: IpcOptions = OPTS,
) -> tuple[KVConnector, KVConnector]:
    prod = KVConnector(a, pl, p, ipc=opts)
    cons = KVConnector(b, cl, c, ipc=opts)
    prod._ipc = IpcPlane(prod._port, opts, backend=pb or FakeBackend())
    cons._ipc = IpcPlane(cons._port, opts, backend=cb or FakeBackend())
    return prod, cons


async def move(
    prod: KVConnector,
    cons: KVConnector,
    a: Engine,
    b: Engine,
    rid: str,
    src: list[int],
    dst: list[int],
    timeout: float = 20,
) -> None:
    recv = asyncio.create_task(cons.recv_request(rid, dst, frm=a.address, timeout=timeout))
    await prod.send_request(rid, src, to=b.address, timeout=timeout)
    await recv


@asynccontextmanager
async def plane_pair(
    kind: str = "fa",
    dtype: str = "bfloat16",
    num_blocks: int = 20,
    *,
    cb: Any = None,
    opts: IpcOptions = OPTS,
) -> AsyncIterator[
    tuple[
        KVLayout, list[torch.Tensor], list[torch.Tensor], Engine, Engine, KVConnector, KVConnector
    ]
]:
    """Two engines and IPC connectors over a cache of ``kind``/``dtype`` (``cb``: the
    consumer's backend), closed afterwards; yields ``(layout, producer caches, consumer
    caches, a, b, producer, consumer)``."""
    pl = make_layout(kind, dtype, num_blocks)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, cb=cb, opts=opts)
        yield pl, p, c, a, b, prod, cons
        await prod.aclose()
        await cons.aclose()


# --------------------------------------------------------------------------- end to end


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32", "int8"])
async def test_pull_every_layout_and_dtype(kind: str, dtype: str) -> None:
    pl = make_layout(kind, dtype, num_blocks=41)
    cl = make_layout(kind, dtype, num_blocks=29)  # num_blocks may differ (FA part strides)
    p = filled(pl, 1, stacked=True)
    c = filled(cl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, cl) as (a, b):
        prod, cons = connectors(a, b, pl, p, cl, c)
        sent = []
        for r, n in enumerate([1, 3, 17]):  # odd lengths
            src, dst = rand_ids(n, 41, 10 + r), rand_ids(n, 29, 20 + r)
            await move(prod, cons, a, b, f"r{r}", src, dst)
            assert landed(pl, p, src, c, dst)
            sent.append(dst)
        touched = {i for d in sent for i in d}
        others = [i for i in range(29) if i not in touched]
        for li in range(cl.num_layers):
            assert torch.equal(blocks(c[li], cl, others), blocks(before[li], cl, others))
        assert prod.finished_sending() == {"r0", "r1", "r2"}
        assert cons.finished_receiving() == {"r0", "r1", "r2"}
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.requests_sent == 3 and cs.ipc.requests_received == 3
        assert cs.ipc.mappings_verified == 1  # mapped and verified once per export
        assert not ps.ipc.fallbacks and not cs.ipc.fallbacks
        assert ps.chunks_sent == 0  # nothing went the ordinary way
        assert cs.bytes_received == pl.request_nbytes(21)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_pull_mode_goes_through_the_plane() -> None:
    # serve_request / fetch_request: the producer learns its consumer from the ticket's
    # GET and then sends over the plane (what the demo's workers do)
    async with plane_pair("fa", "bfloat16", 20) as (pl, p, c, a, b, prod, cons):
        for r, (src, dst) in enumerate([([3, 1, 4], [5, 9, 2]), ([7], [0])]):
            serving = asyncio.ensure_future(prod.serve_request(f"r{r}", src, timeout=20))
            await asyncio.sleep(0.01)
            await cons.fetch_request(f"r{r}", dst, frm=a.address, timeout=20)
            assert await serving == b.address
            assert landed(pl, p, src, c, dst)
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and cs.ipc is not None
        assert ps.ipc.requests_sent == 2 and cs.ipc.requests_received == 2
        assert ps.chunks_sent == 0 and not ps.ipc.fallbacks  # nothing the ordinary way


@contextmanager
def offers_seen() -> Iterator[list[bool]]:
    """Whether each descriptor validated meanwhile carried the producer's offer."""
    seen: list[bool] = []
    orig, orig_ring = Descriptor.from_wire, Descriptor.from_ring

    def spy(d: Any) -> Any:
        seen.append(d.get("offer") is not None)
        return orig(d)

    def spy_ring(b: bytes, reply_to: str) -> Any:
        got = orig_ring(b, reply_to)
        seen.append(got[0].offer is not None)
        return got

    ipcmod.Descriptor.from_wire = spy  # type: ignore[method-assign]
    ipcmod.Descriptor.from_ring = spy_ring  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ipcmod.Descriptor.from_wire = orig  # type: ignore[method-assign]
        ipcmod.Descriptor.from_ring = orig_ring  # type: ignore[method-assign]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_prepare_maps_the_export_ahead_of_the_first_request() -> None:
    async with plane_pair("fa", "bfloat16", 20) as (pl, p, c, a, b, prod, cons):
        assert cons._ipc is not None and prod._ipc is not None
        # concurrent calls share one attempt; the producer learns the consumer from the
        # GET of its hello and sends an offer-only request
        assert await asyncio.gather(
            cons.prepare(a.address, timeout=10), cons.prepare(a.address, timeout=10)
        ) == [True, True]
        st = cons.statistics().ipc
        assert st is not None and st.mappings_verified == 1 and st.requests_received == 0
        for _ in range(200):  # the producer takes the consumer's release a moment later
            if b.address in prod._ipc.producer.acked:
                break
            await asyncio.sleep(0.005)
        assert b.address in prod._ipc.producer.acked  # the offer was acknowledged
        assert await cons.prepare(a.address, timeout=10)  # mapped already: no round trip
        with offers_seen() as seen:
            await move(prod, cons, a, b, "r1", [3, 1, 4], [5, 9, 2])
        assert seen and not any(seen)  # the first request carried no offer
        assert landed(pl, p, [3, 1, 4], c, [5, 9, 2])
        st = cons.statistics().ipc
        assert st is not None and st.mappings_verified == 1 and st.requests_received == 1
        ps = prod.statistics().ipc
        assert ps is not None and ps.requests_sent == 1  # the offer alone is not a request
        assert prod.finished_sending() == {"r1"}
        assert cons.finished_receiving() == {"r1"}


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_open", [True, False])
async def test_a_prepare_that_falls_back_reports_nothing_as_sent(fail_open: bool) -> None:
    """The offer-only request of prepare() is not a request: when the consumer cannot map
    the export (fallback release) -- and when the producer already knows it cannot (a
    second prepare) -- prepare() is False at once, and the producer reports nothing in
    finished_sending() and counts no request (regression: the fallback sent it the
    ordinary way as an empty request, which reported "aiokv#ipc-prepare" finished)."""
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    cb = FakeBackend(fail_open=True) if fail_open else FakeBackend(corrupt_probe=True)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, cb=cb)
        for _ in range(2):
            t0 = time.monotonic()
            assert not await cons.prepare(a.address, timeout=10)
            assert time.monotonic() - t0 < 5
        await asyncio.sleep(0.05)  # the producer's side of the fallback settles
        assert prod.finished_sending() == set()
        ps = prod.statistics()
        assert ps.requests_sent == 0 and ps.ipc is not None and ps.ipc.requests_sent == 0
        await move(prod, cons, a, b, "r1", [1, 2], [3, 4])  # requests go the ordinary way
        assert landed(pl, p, [1, 2], c, [3, 4])
        assert prod.finished_sending() == {"r1"}
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_prepare_against_a_producer_without_the_plane_is_false_at_once() -> None:
    pl = make_layout("fa", "bfloat16", 20)
    async with pair(pl, pl) as (a, b):
        prod = KVConnector(a, pl, filled(pl, 1))  # no IPC plane: no hello published
        cons = KVConnector(b, pl, filled(pl, 2), ipc=OPTS)
        cons._ipc = IpcPlane(cons._port, OPTS, backend=FakeBackend())
        t0 = time.monotonic()
        assert not await cons.prepare(a.address, timeout=10)
        assert time.monotonic() - t0 < 5
        assert not await KVConnector(b, pl, filled(pl, 3)).prepare(a.address)  # no plane here
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_offer_sent_until_acknowledged() -> None:
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        with offers_seen() as seen:
            await move(prod, cons, a, b, "x0", [1, 2], [3, 4])
            await move(prod, cons, a, b, "x1", [5], [6])
        assert seen == [True, False]
        await prod.aclose()
        await cons.aclose()


# --------------------------------------------------------------------------- fallbacks


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_map_failure_falls_back_with_counter(caplog: pytest.LogCaptureFixture) -> None:
    pl = make_layout("mla", "float16", 30)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, cb=FakeBackend(fail_open=True))
        with caplog.at_level("WARNING", logger="aiokv.kv.ipc"):
            await move(prod, cons, a, b, "f0", [0, 7, 9], [1, 2, 3])
            await move(prod, cons, a, b, "f1", [4, 5], [6, 8])
        assert landed(pl, p, [0, 7, 9], c, [1, 2, 3])
        assert landed(pl, p, [4, 5], c, [6, 8])
        ps, cs = prod.statistics(), cons.statistics()
        assert cs.ipc is not None and ps.ipc is not None
        assert cs.ipc.fallbacks == {"map_failed": 1}
        assert cs.ipc.mapping_failures == 1
        # the producer learnt it from the release and sends the second one plainly at once
        assert ps.ipc.fallbacks == {"map_failed": 2}
        assert ps.chunks_sent == 2 and ps.requests_sent == 2
        assert any("falling back" in r.getMessage() for r in caplog.records)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_failed_verification_falls_back() -> None:
    pl = make_layout("fi", "bfloat16", 16)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, cb=FakeBackend(corrupt_probe=True))
        await move(prod, cons, a, b, "v0", [3, 1], [0, 2])
        assert landed(pl, p, [3, 1], c, [0, 2])
        cs = cons.statistics()
        assert cs.ipc is not None and cs.ipc.fallbacks == {"verify_failed": 1}
        assert cs.ipc.mappings_verified == 0
        await prod.aclose()
        await cons.aclose()


class _NoExport(FakeBackend):
    def export(self, storage: torch.UntypedStorage) -> StorageExport:
        raise RuntimeError("pidfd-backed expandable segment (faked)")


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_export_failure_counts_one_fallback_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A producer whose cache cannot be exported sends every request the ordinary way;
    ``fallbacks`` counts requests (as for every other reason), the first one included
    once, and says why in the log."""
    pl = make_layout("mla", "float16", 30)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c, pb=_NoExport())
        with caplog.at_level("WARNING", logger="aiokv.kv.ipc"):
            await move(prod, cons, a, b, "e0", [0, 7, 9], [1, 2, 3])
            await move(prod, cons, a, b, "e1", [4, 5], [6, 8])
        assert landed(pl, p, [0, 7, 9], c, [1, 2, 3])
        assert landed(pl, p, [4, 5], c, [6, 8])
        ps = prod.statistics()
        assert ps.ipc is not None and ps.ipc.fallbacks == {"export_failed": 2}
        assert ps.chunks_sent == 2 and ps.requests_sent == 2
        assert any("export_failed" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cpu_caches_fall_back_by_themselves() -> None:
    """The real backend on CPU caches: the plane says why it is off and the data
    still moves (both sides agree through the "chunks" descriptor)."""
    pl = make_layout("fa", "float32", 12)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod = KVConnector(a, pl, p, ipc=OPTS)
        cons = KVConnector(b, pl, c, ipc=OPTS)
        await move(prod, cons, a, b, "c0", [1, 2, 3], [4, 5, 6])
        assert landed(pl, p, [1, 2, 3], c, [4, 5, 6])
        ps = prod.statistics()
        assert ps.ipc is not None and ps.ipc.fallbacks == {"not_cuda": 1}
        assert ps.chunks_sent == 1
        await prod.aclose()
        await cons.aclose()


def test_unsupported_reasons() -> None:
    cuda = torch.device("cuda", 0)
    ok = IpcOptions()
    trust = IpcOptions(trust_unauthenticated=True)
    kw: dict[str, Any] = {"alloc_conf": "", "hip": ""}
    assert unsupported_reason(torch.device("cpu"), authenticated=True, options=ok, **kw) == (
        "not_cuda"
    )
    assert unsupported_reason(cuda, authenticated=True, options=ok, **kw) is None
    assert unsupported_reason(cuda, authenticated=False, options=ok, **kw) == "unauthenticated"
    assert unsupported_reason(cuda, authenticated=False, options=trust, **kw) is None
    assert (
        unsupported_reason(
            cuda, authenticated=True, options=ok, alloc_conf="expandable_segments:True", hip=""
        )
        == "expandable_segments"
    )
    assert (
        unsupported_reason(
            cuda,
            authenticated=True,
            options=ok,
            alloc_conf="max_split_size_mb:128, expandable_segments: True",
            hip="",
        )
        == "expandable_segments"
    )
    assert (
        unsupported_reason(
            cuda, authenticated=True, options=ok, alloc_conf="expandable_segments:False", hip=""
        )
        is None
    )
    assert unsupported_reason(cuda, authenticated=True, options=ok, alloc_conf="", hip="6.1") == (
        "rocm"
    )


def _offer(**over: Any) -> Offer:
    lay = make_layout("fa", "bfloat16", 8)
    st = StorageExport(b"h" * 64, lay.layer_nbytes() * 3, 0, b"", 0, b"")
    base = dict(
        token=5,
        boot_id="abc",
        pid=1,
        mono=100.0,
        layout=lay.to_wire(),
        storages=(st,),
        layers=((0, 0), (0, lay.layer_nbytes()), (0, 2 * lay.layer_nbytes())),
        word=8,
        probe=StorageExport(b"p" * 64, 2 * lay.block_nbytes(), 0, b"", 0, b""),
        nonce=3,
    )
    base.update(over)
    return Offer(**base)


def test_same_host_checks() -> None:
    check_same_host(_offer(), my_boot_id="abc", now=101.0)
    with pytest.raises(IpcUnavailableError) as ei:
        check_same_host(_offer(), my_boot_id="xyz", now=101.0)
    assert ei.value.reason == "other_host"
    with pytest.raises(IpcUnavailableError) as ei:
        check_same_host(_offer(boot_id=""), my_boot_id="", now=101.0)
    assert ei.value.reason == "other_host"
    with pytest.raises(IpcUnavailableError) as ei:
        check_same_host(_offer(), my_boot_id="abc", now=1e6)
    assert ei.value.reason == "other_clock"


# --------------------------------------------------------------------------- wire validation


def _desc_wire(**over: Any) -> dict[str, Any]:
    d = Descriptor(
        rid="r",
        plane="ipc",
        n=2,
        reply_to="127.0.0.1:5",
        token=5,
        src=(1, 2),
        event=b"e" * 64,
        event_slot=0,
        lease=1.0,
        offer=_offer(),
    ).to_wire()
    d.update(over)
    return d


def test_descriptor_roundtrip() -> None:
    d = decode_message(encode_message(_desc_wire()))
    desc, lay = Descriptor.from_wire(d)
    assert desc.src == (1, 2) and desc.offer is not None and lay is not None
    assert desc.offer == _offer()
    ch, none = Descriptor.from_wire(
        decode_message(encode_message(Descriptor("r", "chunks", 4).to_wire()))
    )
    assert ch.plane == "chunks" and ch.n == 4 and none is None


@pytest.mark.parametrize(
    "over",
    [
        {"plane": "rdma"},
        {"n": 3},  # src holds 2 ids
        {"n": -1},
        {"src": b"\x00" * 7},
        {"reply_to": "no-port"},
        {"reply_to": 5},
        {"token": 0},
        {"token": 6},  # differs from the offer's
        {"event": b""},
        {"event_slot": -1},
        {"lease": float("nan")},
        {"lease": "soon"},
        {"lease": True},
        {"extra": 1},
        {"rid": b"r"},
    ],
)
def test_descriptor_rejects(over: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        Descriptor.from_wire(_desc_wire(**over))


def _offer_wire(**over: Any) -> dict[str, Any]:
    d = _offer().to_wire()
    d.update(over)
    return d


@pytest.mark.parametrize(
    "over",
    [
        {"layout": {"kind": "paged"}},
        {"storages": []},
        {"storages": "x"},
        {"layers": [[0, 0]]},  # 3 layers expected
        {"layers": [[0, 0], [0, 0], [1, 0]]},  # no storage 1
        {"layers": [[0, 0], [0, 0], [0, 1 << 40]]},  # beyond the storage
        {"layers": [[0, 0], [0, 0], [0, 4]]},  # not word-aligned
        {"layers": [[0, 0], [0, 0], [0, -8]]},
        {"word": 3},
        {"word": 16},
        {"pid": -1},
        {"boot_id": "x" * 65},
        {"nonce": "n"},
        {"unknown": 1},
    ],
)
def test_offer_rejects(over: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        Offer.from_wire(_offer_wire(**over))


@pytest.mark.parametrize(
    "over",
    [
        {"handle": b""},
        {"handle": b"x" * 300},
        {"size": 0},
        {"offset": -1},
        {"rc_handle": b"/etc/passwd"},
        {"rc_handle": b"/torch_1_2/../x"},
        {"more": 1},
    ],
)
def test_storage_export_rejects(over: dict[str, Any]) -> None:
    d = StorageExport(b"h" * 64, 100, 0, b"/torch_12_34_0", 0, b"").to_wire()
    assert StorageExport.from_wire(dict(d)).rc_handle == b"/torch_12_34_0"
    d.update(over)
    with pytest.raises(RemoteProtocolError):
        StorageExport.from_wire(d)


def test_probe_smaller_than_two_segments_rejected() -> None:
    lay = make_layout("fa", "bfloat16", 8)
    small = StorageExport(b"p" * 64, lay.block_nbytes() - 1, 0, b"", 0, b"")
    with pytest.raises(RemoteProtocolError):
        Offer.from_wire(_offer(probe=small).to_wire())


def test_release_rules() -> None:
    r = Release.from_wire(decode_message(encode_message(Release("r", True).to_wire())))
    assert r.ok and not r.fallback
    for bad in (
        {"v": 1, "rid": "r", "ok": True, "fallback": True, "reason": ""},
        {"v": 1, "rid": "r", "ok": 1, "fallback": False, "reason": ""},
        {"v": 1, "rid": "r", "ok": False, "fallback": False, "reason": "x" * 300},
        {"v": 1, "rid": "r", "ok": False, "fallback": False, "reason": "", "more": 0},
    ):
        with pytest.raises(RemoteProtocolError):
            Release.from_wire(bad)


def test_decode_message_accepts_bytes_from_a_channel() -> None:
    b = msgpack.packb(Release("r", False, reason="x").to_wire())
    assert Release.from_wire(decode_message(b)).reason == "x"
    with pytest.raises(RemoteProtocolError):
        decode_message(b"")
    with pytest.raises(RemoteProtocolError):
        decode_message(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_decode_message_rejects() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_message(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RemoteProtocolError):
        decode_message(torch.zeros((2, 2), dtype=torch.uint8))
    with pytest.raises(RemoteProtocolError):
        decode_message(torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(RemoteProtocolError):
        decode_message(torch.zeros(MAX_MESSAGE_BYTES + 1, dtype=torch.uint8))
    for payload in (
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 2}),
        msgpack.packb({1: 2}),
        msgpack.packb({"v": 1, "x": msgpack.ExtType(1, b"z")}),
        b"\xc1",  # never-used msgpack byte
    ):
        with pytest.raises(RemoteProtocolError):
            decode_message(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


# --------------------------------------------------------------------------- rules


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_block_count_mismatch_fails_both_sides_untouched() -> None:
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        recv = asyncio.create_task(cons.recv_request("m", [1, 2], frm=a.address, timeout=10))
        with pytest.raises(TransferAbortedError):
            await prod.send_request("m", [1, 2, 3], to=b.address, timeout=10)
        with pytest.raises(LayoutMismatchError) as ei:
            await recv
        assert ei.value.code == "kv_size_mismatch"
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(c, before))
        assert prod.finished_sending() == set()
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layout_mismatch_is_an_error_not_a_fallback() -> None:
    pl = make_layout("fa", "bfloat16", 20)
    cl = FlashAttentionLayout(3, 20, 4, 2, 16, "bfloat16")  # other head_dim
    p, c = filled(pl, 1), filled(cl, 2)
    # engines without a layout, so only the IPC offer can catch it
    async with Engine(EngineConfig()) as a, Engine(EngineConfig()) as b:
        prod, cons = connectors(a, b, pl, p, cl, c)
        recv = asyncio.create_task(cons.recv_request("l", [1], frm=a.address, timeout=10))
        with pytest.raises(TransferAbortedError):
            await prod.send_request("l", [2], to=b.address, timeout=10)
        with pytest.raises(LayoutMismatchError):
            await recv
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("layerwise", [False, True])
async def test_session_refused_for_layouts_fails_both_sides_at_once(layerwise: bool) -> None:
    """Engines that check layouts at set-up, head_dim 8 against 4: the consumer's engine
    refuses the producer's session, so the descriptor never lands. The producer's
    send_request (or wait_saved) and the consumer's recv_request fail at once with
    LayoutMismatchError -- not at the lease's end with a timeout -- and nothing is
    written."""
    pl = make_layout("fa", "bfloat16", 20)
    cl = FlashAttentionLayout(pl.num_layers, 20, 4, 2, 4, "bfloat16")
    p, c = filled(pl, 1), filled(cl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, cl) as (a, b):
        prod, cons = connectors(a, b, pl, p, cl, c)
        t0 = time.monotonic()
        recv = asyncio.create_task(
            cons.recv_request("lm", [1, 2], frm=a.address, timeout=20, layerwise=layerwise)
        )
        with pytest.raises(LayoutMismatchError, match="field 'head_dim'"):
            if layerwise:
                for li in range(pl.num_layers):
                    prod.save_layer("lm", li, [3, 4], to=b.address, timeout=20)
                await prod.wait_saved("lm")
            else:
                await prod.send_request("lm", [3, 4], to=b.address, timeout=20)
        with pytest.raises(LayoutMismatchError, match="field 'head_dim'"):
            await recv
        assert time.monotonic() - t0 < 5
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(c, before))
        assert prod.finished_sending() == set()
        assert cons.finished_receiving() == set()
        assert prod.statistics().send_failures == 1
        assert b.statistics().bytes_received == 0
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_hostile_source_ids_never_copied() -> None:
    pl = make_layout("mla", "bfloat16", 10)
    p, c = filled(pl, 1), filled(pl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        assert prod._ipc is not None
        export = prod._ipc.producer.make_export()
        desc = Descriptor(
            rid="h",
            plane="ipc",
            n=2,
            reply_to=a.address,
            token=export.offer.token,
            src=(3, 10),
            event=secrets.token_bytes(64),
            event_slot=0,
            lease=time.monotonic() + 10,
            offer=export.offer,
        )
        FakeBackend.events[desc.event] = FakeEvent()
        await a.send("h#ipc", encode_message(desc.to_wire()), to=b.address)
        with pytest.raises(RemoteProtocolError):
            await cons.recv_request("h", [0, 1], frm=a.address, timeout=10)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(c, before))
        rel = Release.from_wire(decode_message(await a.recv("h#ipcrel", timeout=10)))
        assert not rel.ok and not rel.fallback
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_lease_over_on_arrival() -> None:
    """The consumer asks after the producer's lease ran out: no copy, both fail, and the
    producer raises only once lease + grace are over (its blocks are free then)."""
    pl = make_layout("fa", "float16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TransferTimeoutError):
            await prod.send_request("late", [1, 2], to=b.address, timeout=0.3)
        assert loop.time() - t0 >= 0.3 + OPTS.grace_s - 0.05
        with pytest.raises(TransferTimeoutError):
            await cons.recv_request("late", [3, 4], frm=a.address, timeout=5)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(c, before))
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.ipc is not None and ps.ipc.lease_expired == 1
        assert cs.ipc is not None and cs.ipc.lease_expired == 1
        assert prod.finished_sending() == set() and cons.finished_receiving() == set()
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cancelled_send_frees_blocks_only_after_release() -> None:
    """A producer cancelled while the consumer has not answered: its blocks show up in
    finished_sending() only once the consumer's release arrives."""
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        send = asyncio.create_task(prod.send_request("k", [1, 2], to=b.address, timeout=10))
        await asyncio.sleep(0.2)  # descriptor delivered, consumer not asking yet
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert prod.finished_sending() == set()  # the consumer may still read
        await cons.recv_request("k", [5, 6], frm=a.address, timeout=10)
        assert landed(pl, p, [1, 2], c, [5, 6])
        for _ in range(100):
            if "k" in prod._st.finished_sent:
                break
            await asyncio.sleep(0.02)
        assert prod.finished_sending() == {"k"}
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_consumer_waits_for_the_producers_event() -> None:
    """The copy starts only once the producer's ready event fired (polled, not queued)."""
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "w0", [1], [1])  # offer mapped
        FakeEvent.fire_after = 0.3
        try:
            t0 = time.monotonic()
            await move(prod, cons, a, b, "w1", [2, 3], [4, 5])
            assert time.monotonic() - t0 >= 0.3
            assert landed(pl, p, [2, 3], c, [4, 5])
        finally:
            FakeEvent.fire_after = 0.0
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_producer_never_ready_fails_both_sides_untouched() -> None:
    """A producer whose event never fires (it died): the consumer gives up at the lease
    without launching anything, the producer after lease + grace."""
    pl = make_layout("mla", "float16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    before = [t.clone() for t in c]
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "n0", [1], [19])
        before = [t.clone() for t in c]
        FakeEvent.fire_after = None
        try:
            recv = asyncio.create_task(cons.recv_request("n1", [4, 5], frm=a.address, timeout=9))
            t0 = time.monotonic()
            # the consumer's release (nothing launched, "producer not ready") ends it
            with pytest.raises(TransferAbortedError, match="producer not ready"):
                await prod.send_request("n1", [2, 3], to=b.address, timeout=0.5)
            with pytest.raises(TransferTimeoutError):
                await recv
            assert time.monotonic() - t0 < 5  # at the lease, not the consumer's 9 s
        finally:
            FakeEvent.fire_after = 0.0
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(c, before))
        cs = cons.statistics()
        assert cs.ipc is not None and cs.ipc.lease_expired == 1 and cs.ipc.aborted == 0
        assert cons.finished_receiving() == {"n0"}
        await prod.aclose()
        await cons.aclose()


@pytest.mark.timeout(60)
def test_abort_words_are_never_shared_across_a_rollover() -> None:
    """Aborted words are never reused, so the plane moves to a new block of abort words
    once the 4096 of one are used up. A request in flight across that move must not
    share its word (or its ids buffers, keyed the same) with a request started after
    it: an abort of one would make the other's copy write nothing while it reports the
    blocks landed. Regression: the free list kept bare word indices, which after the
    move named words of the new block that were also handed out fresh."""
    pl = make_layout("fa", "bfloat16", 8)
    con = KVConnector(_NoEngine(), pl, filled(pl, 0), ipc=OPTS)
    plane = IpcPlane(con._port, OPTS, backend=FakeBackend())

    def word(x: Any) -> tuple[int, int]:  # (block of words, index)
        t, i = plane.state.words.word(x) if isinstance(x, int) else x
        return id(t), i

    def give_back(x: Any) -> None:  # what a request that finished does with its slot
        plane.state.words.free.append(x if isinstance(x, int) else x[1])

    in_flight = plane.state.words.slot()  # a request that is still copying
    spent = [plane.state.words.slot() for _ in range(4096)]  # aborted ones: never given back
    assert len({word(x)[0] for x in [in_flight, *spent]}) == 2  # moved to a new block
    give_back(in_flight)  # ... and now the first request finished
    held = [plane.state.words.slot() for _ in range(4096)]
    words = [word(x) for x in held + spent[-100:]]
    assert len(set(words)) == len(words), "two requests were given the same abort word"


class _NoEngine:
    """An engine stand-in for a plane used without transfers."""

    address = "127.0.0.1:1"
    config = None


class _SlowOpen(FakeBackend):
    """Mapping an export takes a while (CUDA IPC opens): ``delay`` s per open."""

    def __init__(self, delay: float = 0.2) -> None:
        super().__init__()
        self.delay = delay

    def open(self, e: StorageExport, device: torch.device) -> torch.Tensor:
        time.sleep(self.delay)
        return super().open(e, device)


@asynccontextmanager
async def loop_gaps() -> AsyncIterator[list[float]]:
    """The event loop's gaps between 10 ms ticks while the body runs (a stall shows as
    one long gap)."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        yield gaps
    finally:
        stop.set()
        await ticker


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_verifying_a_mapping_does_not_stall_the_loop() -> None:
    """The verification copies the probe with the real kernel: in a fresh process that
    compiles and loads it, seconds (the consumer's loop stalled 1.1-2.4 s).
    It runs off the event loop with the opens (regression: it ran on the loop)."""
    async with plane_pair() as (pl, p, c, a, b, prod, cons):
        assert cons._ipc is not None
        plane = cons._ipc
        verify = plane.state.mapper._verify
        threads: list[str] = []

        def slow_verify(*args: Any) -> None:
            threads.append(threading.current_thread().name)
            time.sleep(0.4)
            verify(*args)

        plane.state.mapper._verify = slow_verify  # type: ignore[method-assign]
        async with loop_gaps() as gaps:
            await move(prod, cons, a, b, "v1", [1, 2], [3, 4])
        assert landed(pl, p, [1, 2], c, [3, 4])
        assert threads == ["aiokv-ipc-map"]
        st = cons.statistics().ipc
        assert st is not None and st.mappings_verified == 1 and st.requests_received == 1
        assert max(gaps) < 0.3, f"the loop stalled for {max(gaps):.3f} s"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_mapping_an_export_does_not_stall_the_loop() -> None:
    """The first request from a producer maps its export: a CUDA IPC open per
    allocation, milliseconds each. Those run off the event loop; other tasks keep
    running, and a second request of the same export waits for the one mapping
    (regression: they ran on the loop and stalled it)."""
    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        slow = _SlowOpen()
        prod, cons = connectors(a, b, pl, p, pl, c, cb=slow)
        async with loop_gaps() as gaps:
            await asyncio.gather(
                move(prod, cons, a, b, "s1", [1, 2], [3, 4]),
                move(prod, cons, a, b, "s2", [5], [6]),
            )
        assert landed(pl, p, [1, 2, 5], c, [3, 4, 6])
        st = cons.statistics().ipc
        assert st is not None and st.mappings_verified == 1 and st.requests_received == 2
        assert slow.opened >= 2  # it really took >= 0.4 s
        # (a blocking mapping stalls it >= 0.4 s: two opens of 0.2 s)
        assert max(gaps) < 0.3, f"the loop stalled for {max(gaps):.3f} s"
        await prod.aclose()
        await cons.aclose()


def test_copy_geometry_is_in_the_mappings_words() -> None:
    """The kernel's strides are in the mapping's word size, the source's part stride from
    the producer's block count and the destination's from the consumer's."""
    from aiokv.kv.ipc._mapping import _Mapping

    mine = make_layout("fa", "bfloat16", 8)
    theirs = make_layout("fa", "bfloat16", 13)
    con = KVConnector(_NoEngine(), mine, filled(mine, 0), ipc=OPTS)
    plane = IpcPlane(con._port, OPTS, backend=FakeBackend())
    seg = mine.segment_numel() * mine.itemsize
    m = _Mapping(1, theirs, [], [], torch.empty(0), 4, None, align=16)
    g = plane.state.mapper.geometry(m, n_pairs=3, n_layers=2, parts=2)
    assert g == {
        "n_pairs": 3,
        "word": 4,
        "n_layers": 2,
        "parts": 2,
        "seg_words": seg // 4,
        "src_part_stride": 13 * seg // 4,
        "dst_part_stride": 8 * seg // 4,
        "block_stride": seg // 4,
        "base_align": 16,
    }


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_mapping_of_a_producer_that_is_gone_is_dropped() -> None:
    """A mapping keeps the producer's whole cache allocation alive on its GPU. When the
    producer process is gone (a prefill that restarted, offering a new export), the
    consumer drops that mapping at its next new mapping instead of keeping the dead
    producer's memory allocated until it closes (regression: kept for ever)."""
    import os
    import sys

    pl = make_layout("fa", "bfloat16", 20)
    p, c = filled(pl, 1), filled(pl, 2)
    async with pair(pl, pl) as (a, b):
        prod, cons = connectors(a, b, pl, p, pl, c)
        await move(prod, cons, a, b, "g0", [1], [2])
        (old,) = cons._ipc.state.maps.values()
        assert old.pid == os.getpid()  # watched: this process could see the producer
        dead = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await dead.wait()
        old.pid = dead.pid  # the producer process has exited ...
        prod2 = KVConnector(a, pl, p, ipc=OPTS)  # ... and a new one offers its export
        prod2._ipc = IpcPlane(prod2._port, OPTS, backend=FakeBackend())
        await move(prod2, cons, a, b, "g1", [3], [4])
        assert landed(pl, p, [3], c, [4])
        assert list(cons._ipc.state.maps) != [old.token] and old.token not in cons._ipc.state.maps
        st = cons.statistics().ipc
        assert st is not None and st.mappings_dropped == 1 and st.mappings_verified == 2
        await prod.aclose()
        await prod2.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_mapping_slower_than_the_deadline_ends_the_request_at_it() -> None:
    """A request waits for its export's mapping only until its own deadline (then
    ``map_timeout``, the ordinary path with what is left, which here is nothing); the
    mapping goes on and serves later requests."""
    async with plane_pair(cb=_SlowOpen(0.6)) as (_pl, _p, _c, a, b, prod, cons):
        recv = asyncio.create_task(cons.recv_request("t1", [3], frm=a.address, timeout=0.5))
        send = asyncio.create_task(prod.send_request("t1", [1], to=b.address, timeout=0.5))
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            await recv
        assert time.monotonic() - t0 < 1.0  # not the 1.2 s of the two opens
        with contextlib.suppress(Exception):
            await send
        st = cons.statistics().ipc
        assert st is not None and st.fallbacks.get("map_timeout") == 1
        for _ in range(200):  # the mapping itself finishes in the background
            if cons._ipc.state.maps:
                break
            await asyncio.sleep(0.01)
        assert len(cons._ipc.state.maps) == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_deadline_already_over_is_a_timeout_on_the_plane_too() -> None:
    async with plane_pair() as (_pl, _p, _c, a, b, prod, cons):
        await move(prod, cons, a, b, "o0", [1], [2])  # mapped
        with pytest.raises(TransferTimeoutError):
            await prod.send_request("o1", [1], to=b.address, timeout=0)
        with pytest.raises(TransferTimeoutError):
            await cons.recv_request("o2", [1], frm=a.address, timeout=0)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_block_ids_as_tensors_are_checked_as_lists() -> None:
    """The plane takes a CPU integer tensor's ids by ``tolist()`` and checks them in
    Python, with the connector's rules and errors; anything else goes the connector's
    way (its torch checks)."""
    async with plane_pair("fa", "bfloat16", 20) as (_pl, _p, _c, _a, _b, prod, _cons):
        plane = prod._ipc
        assert plane is not None
        for dt in (torch.int64, torch.int32, torch.int16, torch.uint8):
            assert plane.state.ids(torch.tensor([3, 1, 4], dtype=dt), unique=True, what="x") == (
                3,
                1,
                4,
            )
        assert plane.state.ids(torch.tensor([], dtype=torch.int64), unique=True, what="x") == ()
        assert plane.state.ids(torch.tensor([5, 5]), unique=False, what="x") == (5, 5)
        bad: list[tuple[Any, str]] = [
            (torch.tensor([1, 20]), r"block ids must be in \[0, 20\), got \[1, 20\]"),
            (torch.tensor([-1, 2], dtype=torch.int8), r"must be in \[0, 20\), got \[-1, 2\]"),
            (torch.tensor([2, 2]), "duplicate block ids"),
            (torch.tensor([[1, 2]]), "1-D integer tensor"),
            (torch.tensor([1.0, 2.0]), "1-D integer tensor"),
        ]
        for ids, match in bad:
            with pytest.raises(ConfigError, match=match):
                plane.state.ids(ids, unique=True, what="x")


class _FiresAt:
    """Fires ``after`` seconds from now (None: never), or at its ``on_query``-th query."""

    def __init__(self, after: float | None, on_query: int = 0) -> None:
        self.at = None if after is None else time.monotonic() + after
        self.on_query = on_query
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.on_query:
            return self.queries >= self.on_query
        return self.at is not None and time.monotonic() >= self.at


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_copys_end_is_waited_for_by_spinning_then_by_the_fine_poll() -> None:
    """``_wait_done``: an end within the first 2 ms is seen by the request's own spin, a
    later one by the plane's fine poll (after the spin hands over; not the progress
    poller, whose sleeps end on the loop's whole milliseconds), one that never comes
    raises ``TimeoutError`` at the timeout, and an end already there costs no wait even
    with no time left."""
    async with plane_pair("fa", "bfloat16", 20) as (_pl, _p, _c, _a, b, _prod, cons):
        plane = cons._ipc
        assert plane is not None
        poller = b._get_poller()  # (the engine's: the plane makes none of its own)
        waiter = waiter_for()  # the loop's: the plane's waits are its waits
        asked: list[dict[str, Any]] = []
        wait_until = waiter.wait_until

        async def spy(query: Any, deadline: float, **kw: Any) -> bool:
            asked.append(kw)
            return await wait_until(query, deadline, **kw)

        waiter.wait_until = spy  # type: ignore[method-assign]
        soon = _FiresAt(None, on_query=3)
        # three loop passes within the spin: on a loaded machine three passes can take
        # longer than the 2 ms spin, so the spin is made long for this one check
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ipc_state, "_READY_SPIN_S", 1.0)
            await plane.state.wait_done(soon, 5.0)
        assert soon.queries == 3 and asked == []  # spun (the waiter was not asked)
        later = _FiresAt(0.05)
        t = time.monotonic()
        await plane.state.wait_done(later, 5.0)
        assert 0.05 <= time.monotonic() - t < 1.0
        # handed over after the spin: one wait, asked every event_poll_s on its timer
        assert len(asked) == 1 and asked[0]["interval"] == plane.options.event_poll_s
        assert poller.statistics().registered == 0 and waiter.futures_of(None) == []
        never = _FiresAt(None)
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            await plane.state.wait_done(never, 0.1)
        assert 0.1 <= time.monotonic() - t < 1.0
        await plane.state.wait_done(_FiresAt(0.0), 0.0)
        with pytest.raises(TimeoutError):
            await plane.state.wait_done(_FiresAt(None), 0.0)
