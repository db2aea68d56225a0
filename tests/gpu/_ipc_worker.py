"""One role (producer or consumer) of one IPC-plane GPU scenario (run by test_ipc_gpu.py).

    python _ipc_worker.py ROLE SCENARIO DIR

Both roles run on ``cuda:0`` (CUDA IPC between two processes on one GPU) unless
``AIOKV_IPC_TWO_GPUS=1`` puts the consumer on ``cuda:1``. The two processes find
each other through files in DIR (their engine addresses). The last stdout line is
a JSON object with the role's findings; the test asserts on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any

import torch

import aiokv
from aiokv.kv import (
    FlashAttentionLayout,
    FlashInferLayout,
    IpcOptions,
    KVConnector,
    KVLayout,
    MLALayout,
)
from aiokv.kv.ipc._mapping import _pid_alive

OPTS = IpcOptions(trust_unauthenticated=True, grace_s=1.0)
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]
KINDS = ["fa", "fi", "mla", "odd"]


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def device(role: str) -> torch.device:
    two = os.environ.get("AIOKV_IPC_TWO_GPUS") == "1" and torch.cuda.device_count() >= 2
    return torch.device("cuda:1" if role == "consumer" and two else "cuda:0")


def make_layout(kind: str, dtype: str, num_blocks: int, num_layers: int = 4) -> KVLayout:
    if kind == "fa":
        return FlashAttentionLayout(num_layers, num_blocks, 16, 2, 64, dtype)
    if kind == "fi":
        return FlashInferLayout(num_layers, num_blocks, 16, 2, 64, dtype)
    if kind == "mla":
        return MLALayout(num_layers, num_blocks, 16, 576, dtype)
    # odd geometry: 15-element segments, so 1- or 2-byte words
    return FlashAttentionLayout(num_layers, num_blocks, 5, 1, 3, dtype)


def fill(layout: KVLayout, dev: torch.device, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    big = torch.empty(
        (layout.num_layers, *layout.layer_shape()), dtype=layout.torch_dtype, device=dev
    )
    g = torch.Generator(device=dev).manual_seed(seed)
    big.view(torch.uint8).random_(0, 256, generator=g)
    return big, list(big.unbind(0))


def zeroed(layout: KVLayout, dev: torch.device) -> torch.Tensor:
    """A consumer's cache of ``layout``, all layers in one zeroed tensor."""
    return torch.zeros(
        (layout.num_layers, *layout.layer_shape()), dtype=layout.torch_dtype, device=dev
    )


def ids(n: int, num_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(num_blocks, generator=g)[:n]]


def blocks(big: torch.Tensor, layout: KVLayout, b: list[int]) -> torch.Tensor:
    return big.view(torch.uint8).index_select(
        layout.block_dim + 1, torch.tensor(b, device=big.device)
    )


def _publish(d: str, role: str, address: str) -> None:
    with open(os.path.join(d, role + ".tmp"), "w") as f:
        f.write(address)
    os.replace(os.path.join(d, role + ".tmp"), os.path.join(d, role + ".addr"))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


async def addresses(d: str, role: str, eng: aiokv.Engine) -> str:
    """Publish this engine's address in DIR and wait for the other role's."""
    _publish(d, role, eng.address)
    return await _wait_for(d, "consumer" if role == "producer" else "producer")


async def _wait_for(d: str, name: str) -> str:
    """What ``name`` published in DIR (an address, or any mark), once it is there."""
    for _ in range(600):
        got = _read(os.path.join(d, name + ".addr"))
        if got:
            return got
        await asyncio.sleep(0.05)
    raise TimeoutError("no address from the other role")


def engine(dev: torch.device) -> aiokv.Engine:
    return aiokv.Engine(
        aiokv.EngineConfig(
            device=str(dev), transport="auto", timeouts=aiokv.Timeouts(transfer=60.0)
        )
    )


def stats(con: KVConnector) -> dict[str, Any]:
    s = con.statistics().ipc
    assert s is not None
    return {
        "sent": s.requests_sent,
        "received": s.requests_received,
        "verified": s.mappings_verified,
        "map_failures": s.mapping_failures,
        "aborted": s.aborted,
        "lease_expired": s.lease_expired,
        "stuck": s.stuck_streams,
        "fallbacks": s.fallbacks,
        "dropped": s.mappings_dropped,
        "ring_launches": s.ring_launches,
        "staged_launches": s.staged_launches,
        "raw": con._ipc is not None
        and any(m.raw is not None for m in con._ipc.state.maps.values()),
    }


# --------------------------------------------------------------------------- scenarios

LENGTHS = [1, 3, 17]
PB, CB = 37, 29  # producer / consumer num_blocks (they may differ)


async def matrix(role: str, d: str) -> dict[str, Any]:
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {"combos": []}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        for ci, (kind, dtype) in enumerate((k, t) for k in KINDS for t in DTYPES):
            seed = 1000 + ci
            if role == "producer":
                lay = make_layout(kind, dtype, PB)
                big, caches = fill(lay, dev, seed)
                con = KVConnector(eng, lay, caches, ipc=OPTS)
                for r, n in enumerate(LENGTHS):
                    await con.send_request(f"m{ci}r{r}", ids(n, PB, seed + r), to=peer, timeout=30)
                if ci == 0:
                    # the kernel must wait for the producer's stream, not the host: queue
                    # ~0.5 s of GPU sleep, then rewrite the cache, then send at once
                    torch.cuda._sleep(1_000_000_000)
                    g = torch.Generator(device=dev).manual_seed(seed + 77)
                    big.view(torch.uint8).random_(0, 256, generator=g)
                    await con.send_request(f"m{ci}ord", ids(5, PB, seed + 9), to=peer, timeout=30)
                if ci == 0 and con._ipc is not None and con._ipc.producer.export is not None:
                    st = con._ipc.producer.export.offer.storages[0]  # for the docs: torch's format
                    out["handle_len"] = len(st.handle)
                    out["rc_handle"] = st.rc_handle.decode(errors="replace")
                out["combos"].append({"kind": kind, "dtype": dtype, **stats(con)})
                await con.aclose()
            else:
                lay = make_layout(kind, dtype, CB)
                plays = make_layout(kind, dtype, PB)
                big = zeroed(lay, dev)
                # every other combo makes its CUDA calls through torch and Triton
                opts = OPTS if ci % 2 == 0 else dataclasses.replace(OPTS, driver_calls=False)
                con = KVConnector(eng, lay, list(big.unbind(0)), ipc=opts)
                src_big, _ = fill(plays, dev, seed)
                ok = True
                touched: set[int] = set()
                for r, n in enumerate(LENGTHS):
                    dst = ids(n, CB, seed + 50 + r)
                    await con.recv_request(f"m{ci}r{r}", dst, frm=peer, timeout=30)
                    ok = ok and torch.equal(
                        blocks(src_big, plays, ids(n, PB, seed + r)), blocks(big, lay, dst)
                    )
                    touched |= set(dst)
                ordered = None
                if ci == 0:
                    dst = [b for b in range(CB) if b not in touched][:5]
                    await con.recv_request(f"m{ci}ord", dst, frm=peer, timeout=30)
                    src2, _ = fill(plays, dev, seed + 77)
                    ordered = torch.equal(
                        blocks(src2, plays, ids(5, PB, seed + 9)), blocks(big, lay, dst)
                    )
                    touched |= set(dst)
                rest = [b for b in range(CB) if b not in touched]
                untouched = not bool(blocks(big, lay, rest).any())
                out["combos"].append(
                    {
                        "kind": kind,
                        "dtype": dtype,
                        "ok": ok,
                        "untouched": untouched,
                        "ordered": ordered,
                        **stats(con),
                    }
                )
                await con.aclose()
    return out


BIG = FlashAttentionLayout(32, 256, 16, 8, 128, "bfloat16")
SLEEP_2S = 4_000_000_000  # torch.cuda._sleep cycles, ~2 s at 1.98 GHz


async def cancel(role: str, d: str) -> dict[str, Any]:
    """Cancellation of a copy whose producer is not ready yet (~2 s of GPU sleep queued
    before its event): ``c1`` with the GPU-side wait (the launch is queued and must
    write nothing when it runs), ``c2`` with the default host wait (nothing launched)."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        src = ids(64, 256, 1)
        if role == "producer":
            _, caches = fill(BIG, dev, 5)
            con = KVConnector(eng, BIG, caches, ipc=OPTS)
            await con.send_request("warm", [0], to=peer, timeout=30)  # map + verify first
            for rid, cycles in (("c1", SLEEP_2S), ("c2", 4 * SLEEP_2S)):
                torch.cuda._sleep(cycles)
                t0 = time.monotonic()
                try:
                    await con.send_request(rid, src, to=peer, timeout=30)
                    out[rid] = "ok"
                except Exception as exc:
                    out[rid] = type(exc).__name__
                out[rid + "_s"] = time.monotonic() - t0
                torch.cuda.synchronize()
            out.update(stats(con))
            await con.aclose()
        else:
            big = zeroed(BIG, dev)
            con = KVConnector(eng, BIG, list(big.unbind(0)), ipc=OPTS)
            await con.recv_request("warm", [0], frm=peer, timeout=30)
            assert con._ipc is not None
            for rid, opts, later in (
                ("c1", IpcOptions(trust_unauthenticated=True, grace_s=3.0, gpu_wait=True), 2.5),
                ("c2", OPTS, 8.5),
            ):
                con._ipc.options = opts
                dst = list(range(128, 192))
                task = asyncio.ensure_future(con.recv_request(rid, dst, frm=peer, timeout=30))
                await asyncio.sleep(0.6)
                out[rid + "_done_before_cancel"] = task.done()
                task.cancel()
                t0 = time.monotonic()
                try:
                    await task
                    out[rid] = "ok"
                except asyncio.CancelledError:
                    out[rid] = "cancelled"
                out[rid + "_cancel_s"] = time.monotonic() - t0
                out[rid + "_untouched_at_return"] = not bool(blocks(big, BIG, dst).any())
                await asyncio.sleep(later)  # the producer's event has fired by now
                torch.cuda.synchronize()
                out[rid + "_untouched_later"] = not bool(blocks(big, BIG, dst).any())
            out["finished"] = sorted(con.finished_receiving())
            out.update(stats(con))
            await con.aclose()
    return out


# --------------------------------------------------------------------------- layer-wise

LAYER_COMBOS = [
    ("fa", "bfloat16"),
    ("fi", "bfloat16"),
    ("mla", "bfloat16"),
    ("odd", "bfloat16"),
    ("fa", "float8_e4m3fn"),
    ("mla", "float32"),
]
LAYER_SLEEP = 20_000_000  # torch.cuda._sleep cycles (~10 ms) before each layer is written


def layer_block(big: torch.Tensor, layout: KVLayout, layer: int, b: list[int]) -> torch.Tensor:
    return blocks(big[layer : layer + 1], layout, b)


async def layers(role: str, d: str) -> dict[str, Any]:
    """save_layer / recv_request(layerwise=True) over the plane. The producer writes
    each layer on its stream only after ~10 ms of GPU sleep and saves it at once (the
    host runs ahead), so a copy that did not wait for that layer's event would read the
    previous request's bytes."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {"combos": []}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        for ci, (kind, dtype) in enumerate(LAYER_COMBOS):
            seed = 3000 + 10 * ci
            if role == "producer":
                lay = make_layout(kind, dtype, PB)
                big, caches = fill(lay, dev, seed)
                con = KVConnector(eng, lay, caches, ipc=OPTS)
                for r, n in enumerate(LENGTHS):
                    ref, _ = fill(lay, dev, seed + 1 + r)  # this request's KV
                    rid = f"L{ci}r{r}"
                    src = ids(n, PB, seed + r)
                    for li in range(lay.num_layers):
                        torch.cuda._sleep(LAYER_SLEEP)
                        big[li].copy_(ref[li])  # the layer's "forward"
                        con.save_layer(rid, li, src, to=peer, timeout=30)
                    await con.wait_saved(rid)
                out["combos"].append({"kind": kind, "dtype": dtype, **stats(con)})
                await con.aclose()
            else:
                lay = make_layout(kind, dtype, CB)
                plays = make_layout(kind, dtype, PB)
                big = zeroed(lay, dev)
                con = KVConnector(eng, lay, list(big.unbind(0)), ipc=OPTS)
                ok = True
                touched: set[int] = set()
                for r, n in enumerate(LENGTHS):
                    ref, _ = fill(plays, dev, seed + 1 + r)
                    dst = ids(n, CB, seed + 50 + r)
                    await con.recv_request(f"L{ci}r{r}", dst, frm=peer, timeout=30, layerwise=True)
                    ok = ok and torch.equal(
                        blocks(ref, plays, ids(n, PB, seed + r)), blocks(big, lay, dst)
                    )
                    touched |= set(dst)
                rest = [b for b in range(CB) if b not in touched]
                cs = con.statistics()
                out["combos"].append(
                    {
                        "kind": kind,
                        "dtype": dtype,
                        "ok": ok,
                        "untouched": not bool(blocks(big, lay, rest).any()),
                        "ordinary_chunks": cs.chunks_received,
                        **stats(con),
                    }
                )
                await con.aclose()
    return out


LBIG = FlashAttentionLayout(8, 256, 16, 8, 128, "bfloat16")


async def layers_cancel(role: str, d: str) -> dict[str, Any]:
    """Cancellation mid-stream: layers 0-1 are written and saved at once, layers 2-7
    only after ~2 s of GPU sleep (saved at once on the host: their events are pending).
    The consumer cancels after ~0.6 s: layers 0-1 are in place, 2-7 must never be
    written (also after their events fired), the producer's wait_saved fails, and the
    same destination blocks take the next request at once."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    src = ids(64, 256, 7)
    dst = list(range(64, 128))
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            big, caches = fill(LBIG, dev, 11)
            con = KVConnector(eng, LBIG, caches, ipc=OPTS)
            await con.send_request("warm", [0], to=peer, timeout=30)
            ref, _ = fill(LBIG, dev, 12)
            for li in range(LBIG.num_layers):
                if li == 2:
                    torch.cuda._sleep(SLEEP_2S)
                big[li].copy_(ref[li])
                con.save_layer("lc", li, src, to=peer, timeout=30)
            t0 = time.monotonic()
            try:
                await con.wait_saved("lc")
                out["lc"] = "ok"
            except Exception as exc:
                out["lc"] = type(exc).__name__
            out["lc_s"] = time.monotonic() - t0
            torch.cuda.synchronize()
            await con.send_request("after", src, to=peer, timeout=30)
            out["finished"] = sorted(con.finished_sending())
            out.update(stats(con))
            await con.aclose()
        else:
            big = zeroed(LBIG, dev)
            con = KVConnector(eng, LBIG, list(big.unbind(0)), ipc=OPTS)
            await con.recv_request("warm", [0], frm=peer, timeout=30)
            want, _ = fill(LBIG, dev, 12)
            task = asyncio.ensure_future(
                con.recv_request("lc", dst, frm=peer, timeout=30, layerwise=True)
            )
            await asyncio.sleep(0.6)
            out["done_before_cancel"] = task.done()
            task.cancel()
            t0 = time.monotonic()
            try:
                await task
                out["lc"] = "ok"
            except asyncio.CancelledError:
                out["lc"] = "cancelled"
            out["cancel_s"] = time.monotonic() - t0
            torch.cuda.current_stream().synchronize()
            w = blocks(want, LBIG, src)
            out["first_layers_landed"] = all(
                torch.equal(layer_block(big, LBIG, li, dst), w[li : li + 1]) for li in (0, 1)
            )
            out["untouched_at_return"] = not bool(blocks(big[2:], LBIG, dst).any())
            await asyncio.sleep(2.5)  # the producer's later events have fired by now
            torch.cuda.synchronize()
            out["untouched_later"] = not bool(blocks(big[2:], LBIG, dst).any())
            await con.recv_request("after", dst, frm=peer, timeout=30)
            out["after_ok"] = bool(torch.equal(blocks(big, LBIG, dst), w))  # all layers now
            out["finished"] = sorted(con.finished_receiving())
            out.update(stats(con))
            await con.aclose()
    return out


def _sync_returns(seconds: float) -> bool:
    """Whether a device-wide synchronize returns within ``seconds`` (run on a thread)."""
    import threading

    t = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


async def kill_producer(role: str, d: str, gpu_wait: bool = False) -> dict[str, Any]:
    """The producer dies (SIGKILL) before its ready event fires."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {"gpu_wait": gpu_wait}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        src = ids(16, 256, 1)
        if role == "producer":
            _, caches = fill(BIG, dev, 5)
            con = KVConnector(eng, BIG, caches, ipc=OPTS)
            await con.send_request("warm", [0], to=peer, timeout=30)
            torch.cuda._sleep(3 * SLEEP_2S)
            task = asyncio.ensure_future(con.send_request("k1", src, to=peer, timeout=3))
            await asyncio.sleep(0.5)
            say(event="killing myself", pending=not task.done())
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            big = zeroed(BIG, dev)
            opts = IpcOptions(trust_unauthenticated=True, grace_s=1.0, gpu_wait=gpu_wait)
            con = KVConnector(eng, BIG, list(big.unbind(0)), ipc=opts)
            await con.recv_request("warm", [0], frm=peer, timeout=30)
            dst = list(range(100, 116))
            # Launch once, now, every kernel used below: under lazy module loading a
            # kernel's first launch waits for an idle GPU, which a stream stuck behind
            # a dead producer's event (gpu_wait) never becomes.
            bool(blocks(big, BIG, dst).any())
            float(torch.ones(1000, device=dev).sum().item())
            assert con._ipc is not None
            m0 = next(iter(con._ipc.state.maps.values()))
            int(m0.src_layers[0].reshape(-1)[:64].clone().view(torch.uint8).sum())
            torch.cuda.synchronize()
            t0 = time.monotonic()
            try:
                await con.recv_request("k1", dst, frm=peer, timeout=30)
                out["recv"] = "ok"
            except Exception as exc:
                out["recv"] = type(exc).__name__
            out["recv_s"] = time.monotonic() - t0
            out["untouched_at_return"] = not bool(blocks(big, BIG, dst).any())
            say(step="returned", **out)
            await asyncio.sleep(8.0)  # past the dead producer's sleep
            plane = con._ipc
            assert plane is not None
            m = next(iter(plane.state.maps.values()))
            try:
                out["event_fired_after_death"] = [bool(e.query()) for (_h, e) in m.events.values()]
            except Exception as exc:
                out["event_fired_after_death"] = f"{type(exc).__name__}: {exc}"
            out["copy_stream_idle"] = bool(m.stream.query())
            out["untouched_later"] = not bool(blocks(big, BIG, dst).any())
            out["healthy"] = float(torch.ones(1000, device=dev).sum().item()) == 1000.0
            out.update(stats(con))
            say(step="before device sync", **out)
            out["device_sync_returns"] = _sync_returns(8.0)
            say(step="after device sync", **out)
            if out["device_sync_returns"]:
                # a fault here would poison this context, so it comes last
                try:
                    v = m.src_layers[0].reshape(-1)[:64].clone()
                    torch.cuda.synchronize()
                    out["read_dead_mapping"] = f"ok (byte sum {int(v.view(torch.uint8).sum())})"
                except Exception as exc:
                    out["read_dead_mapping"] = f"{type(exc).__name__}: {exc}"[:300]
            say(role=role, **out)
            os._exit(0)  # no teardown against a dead peer's mapping or a stuck stream
    return out


async def kill_producer_gpu_wait(role: str, d: str) -> dict[str, Any]:
    return await kill_producer(role, d, gpu_wait=True)


async def kill_consumer(role: str, d: str) -> dict[str, Any]:
    """The consumer dies right after launching the copy: the producer must keep its blocks
    until lease + grace, then fail, and stay healthy."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            _, caches = fill(BIG, dev, 5)
            con = KVConnector(eng, BIG, caches, ipc=OPTS)
            await con.send_request("warm", [0], to=peer, timeout=30)
            t0 = time.monotonic()
            try:
                await con.send_request("q1", ids(64, 256, 1), to=peer, timeout=3)
                out["send"] = "ok"
            except Exception as exc:
                out["send"] = type(exc).__name__
            out["send_s"] = time.monotonic() - t0
            out["healthy"] = float(torch.ones(1000, device=dev).sum().item()) == 1000.0
            out["finished"] = sorted(con.finished_sending())
            out.update(stats(con))
            await con.aclose()
        else:
            big = zeroed(BIG, dev)
            con = KVConnector(eng, BIG, list(big.unbind(0)), ipc=OPTS)
            await con.recv_request("warm", [0], frm=peer, timeout=30)
            plane = con._ipc
            assert plane is not None
            launch = plane.consumer.copier._launch

            def launch_and_die(*a: Any, **k: Any) -> Any:
                r = launch(*a, **k)
                os.kill(os.getpid(), signal.SIGKILL)
                return r

            plane.consumer.copier._launch = launch_and_die  # type: ignore[method-assign]
            await con.recv_request("q1", ids(64, 256, 2), frm=peer, timeout=30)
    return out


def expandable(role: str, d: str) -> dict[str, Any]:
    """With expandable segments the plane says so and stays off (checked in a process
    whose allocator was configured that way)."""
    dev = device(role)
    torch.cuda.set_device(dev)

    async def run() -> dict[str, Any]:
        async with engine(dev) as eng:
            lay = make_layout("fa", "bfloat16", 8)
            _, caches = fill(lay, dev, 1)
            con = KVConnector(eng, lay, caches, ipc=OPTS)
            assert con._ipc is not None
            r: dict[str, Any] = {"disabled": con._ipc.disabled}
            try:  # what torch itself does with such a storage (for the docs)
                caches[0].untyped_storage()._share_cuda_()
                r["share_cuda"] = "ok"
            except Exception as exc:
                r["share_cuda"] = f"{type(exc).__name__}: {exc}"[:200]
            await con.aclose()
            return r

    return asyncio.run(run())


async def restart_producer(role: str, d: str) -> dict[str, Any]:
    """A producer process exits after one request and a new one takes over (a prefill
    that restarted). The consumer's mapping of the first producer's cache keeps that
    allocation alive after its process is gone; the consumer drops it when it maps the
    new producer's export, and the memory comes back."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    if role == "producer1":  # the first producer: a child of the producer process
        async with engine(dev) as eng:
            _publish(d, "producer1", eng.address)
            peer = await _wait_for(d, "consumer")
            _, caches = fill(BIG, dev, 5)
            con = KVConnector(eng, BIG, caches, ipc=OPTS)
            await con.send_request("first", [1, 2, 3], to=peer, timeout=60)
            say(role=role, sent=True)
            os._exit(0)  # gone; its cache stays allocated while the consumer maps it
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            child = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "producer1", "restart_producer", d
            )
            out["first_exit"] = await child.wait()
            _, caches = fill(BIG, dev, 6)
            torch.cuda.synchronize()
            _publish(d, "producer2", "allocated")
            con = KVConnector(eng, BIG, caches, ipc=OPTS)
            await con.send_request("second", [4, 5], to=peer, timeout=60)
            out.update(stats(con))
            await con.aclose()
        else:
            big = zeroed(BIG, dev)
            con = KVConnector(eng, BIG, list(big.unbind(0)), ipc=OPTS)
            first = await _wait_for(d, "producer1")
            await con.recv_request("first", [10, 11, 12], frm=first, timeout=60)
            assert con._ipc is not None
            pid = next(iter(con._ipc.state.maps.values())).pid
            out["watched"] = pid != 0
            for _ in range(600):  # until the first producer's process is gone
                if not _pid_alive(pid):
                    break
                await asyncio.sleep(0.05)
            await _wait_for(d, "producer2")  # the second one's cache is allocated
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info(dev)[0]
            await con.recv_request("second", [13, 14], frm=peer, timeout=60)
            torch.cuda.synchronize()
            out["freed"] = torch.cuda.mem_get_info(dev)[0] - free_before
            out["cache_bytes"] = BIG.num_layers * BIG.layer_nbytes()
            out.update(stats(con))
            await con.aclose()
    return out


HD_PRODUCER = FlashAttentionLayout(4, 64, 16, 8, 128, "bfloat16")
HD_CONSUMER = FlashAttentionLayout(4, 64, 16, 8, 64, "bfloat16")  # other head_dim


async def layout_refused(role: str, d: str) -> dict[str, Any]:
    """Engines that check layouts at set-up (``EngineConfig(layout=...)``), a producer of
    head_dim 128 and a consumer of head_dim 64, IPC on both: each side's request fails at
    once with LayoutMismatchError (the consumer's engine refuses the producer's session,
    the producer's refuses the consumer's), and nothing lands in the consumer's cache."""
    dev = device(role)
    torch.cuda.set_device(dev)
    lay = HD_PRODUCER if role == "producer" else HD_CONSUMER
    cfg = aiokv.EngineConfig(
        device=str(dev),
        transport="auto",
        timeouts=aiokv.Timeouts(transfer=60.0),
        layout=lay.to_wire(),
    )
    out: dict[str, Any] = {}
    async with aiokv.Engine(cfg) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            _, caches = fill(lay, dev, 21)
            con = KVConnector(eng, lay, caches, ipc=OPTS)
            await _wait_for(d, "consumer_waits")
            t0 = time.monotonic()
            try:
                await con.send_request("hd", [1, 2, 3], to=peer, timeout=120)
                out["send"] = "ok"
            except Exception as exc:
                out["send"], out["send_msg"] = type(exc).__name__, str(exc)
            out["send_s"] = time.monotonic() - t0
            out["finished"] = sorted(con.finished_sending())
            out["send_failures"] = con.statistics().send_failures
        else:
            big = zeroed(lay, dev)
            con = KVConnector(eng, lay, list(big.unbind(0)), ipc=OPTS)
            t0 = time.monotonic()
            task = asyncio.ensure_future(con.recv_request("hd", [4, 5, 6], frm=peer, timeout=120))
            _publish(d, "consumer_waits", "1")
            try:
                await task
                out["recv"] = "ok"
            except Exception as exc:
                out["recv"], out["recv_msg"] = type(exc).__name__, str(exc)
            out["recv_s"] = time.monotonic() - t0
            await asyncio.sleep(1.0)  # anything late would have landed by now
            torch.cuda.synchronize()
            out["untouched"] = not bool(big.any())
            out["finished"] = sorted(con.finished_receiving())
        out.update(stats(con))
        await con.aclose()
    return out


def main() -> None:
    role, scenario, d = sys.argv[1:4]
    if scenario == "expandable":
        out = expandable(role, d)
    else:
        fn = {
            "matrix": matrix,
            "cancel": cancel,
            "kill_producer": kill_producer,
            "kill_producer_gpuwait": kill_producer_gpu_wait,
            "kill_consumer": kill_consumer,
            "layers": layers,
            "layers_cancel": layers_cancel,
            "restart_producer": restart_producer,
            "layout_refused": layout_refused,
        }[scenario]
        out = asyncio.run(fn(role, d))
    say(role=role, **out)


if __name__ == "__main__":
    main()
