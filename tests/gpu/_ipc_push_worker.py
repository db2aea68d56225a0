"""One role of one push-mode IPC scenario (run by test_ipc_push_gpu.py); same
conventions as ``_ipc_worker.py`` (whose helpers it uses): ``python
_ipc_push_worker.py ROLE SCENARIO DIR``, the last stdout line is a JSON object.

Push mode needs a first pulled request (the consumer's export rides on its release)
and the producer's verified mapping of that export before the consumer grants; each
scenario starts with :func:`handshake`. The producer then sends a granted request
only after a pause, so that the grant has landed (a grant that comes late is void and
the request is pulled: also correct, but not what these tests are about).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import torch
from _ipc_worker import (
    BIG,
    CB,
    KINDS,
    LENGTHS,
    PB,
    SLEEP_2S,
    _publish,
    _wait_for,
    addresses,
    blocks,
    device,
    engine,
    fill,
    ids,
    make_layout,
    say,
    stats,
    zeroed,
)

from aiokv.kv import IpcOptions, KVConnector

POPTS = IpcOptions(trust_unauthenticated=True, grace_s=1.0, push=True)
DTYPES = ["bfloat16", "float32", "float8_e4m3fn", "uint8"]
GRANT_LANDS_S = 0.2  # the producer's pause before a granted request


def pstats(con: KVConnector) -> dict[str, Any]:
    s = con.statistics().ipc
    assert s is not None
    return {
        **stats(con),
        "grants": s.grants,
        "pushed": s.pushed,
        "pushes_received": s.pushes_received,
        "push_unsettled": s.push_unsettled,
        "push_raw": con._ipc is not None
        and bool(con._ipc.pusher.maps)
        and all(m.raw is not None for m in con._ipc.pusher.maps.values()),
    }


async def handshake(con: KVConnector, role: str, peer: str, tag: str) -> None:
    """Two pulled requests: the first carries the consumer's export to the producer,
    which maps it (waited for here) and says so in the second's descriptor."""
    assert con._ipc is not None
    if role == "producer":
        await con.send_request(f"{tag}h0", [0], to=peer, timeout=60)
        for _ in range(1200):
            if peer in con._ipc.pusher.maps or con._ipc.pusher.failed:
                break
            await asyncio.sleep(0.05)
        await con.send_request(f"{tag}h1", [1], to=peer, timeout=60)
    else:
        await con.recv_request(f"{tag}h0", [0], frm=peer, timeout=60)
        await con.recv_request(f"{tag}h1", [1], frm=peer, timeout=60)


async def send(con: KVConnector, rid: str, src: list[int], peer: str, layerwise: bool) -> None:
    """The whole request, or (``layerwise``) every layer saved -- the producer's forward
    would write each one just before -- and the wait for the consumer's release."""
    if not layerwise:
        await con.send_request(rid, src, to=peer, timeout=30)
        return
    for li in range(con.layout.num_layers):
        con.save_layer(rid, li, src, to=peer, timeout=30)
        await asyncio.sleep(0)
    await con.wait_saved(rid)


async def push_layers_matrix(role: str, d: str) -> dict[str, Any]:
    """:func:`push_matrix` with the requests saved layer by layer (``save_layer``) and
    received with ``layerwise=True``: one push launch per layer, one descriptor."""
    return await push_matrix(role, d, layerwise=True)


async def push_matrix(role: str, d: str, *, layerwise: bool = False) -> dict[str, Any]:
    """Every layout with several dtypes: pushed requests bit-exact, neighbours untouched,
    and (first combo) the push ordered after the producer's own stream."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {"combos": []}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        for ci, (kind, dtype) in enumerate((k, t) for k in KINDS for t in DTYPES):
            seed = 5000 + ci
            tag = f"p{ci}"
            if role == "producer":
                lay = make_layout(kind, dtype, PB)
                big, caches = fill(lay, dev, seed)
                con = KVConnector(eng, lay, caches, ipc=POPTS)
                await handshake(con, role, peer, tag)
                for r, n in enumerate(LENGTHS):
                    await asyncio.sleep(GRANT_LANDS_S)
                    await send(con, f"{tag}r{r}", ids(n, PB, seed + r), peer, layerwise)
                if ci == 0:
                    await asyncio.sleep(GRANT_LANDS_S)
                    # the copy must follow the producer's stream: ~0.5 s of GPU sleep, then
                    # the cache rewritten, then the send at once
                    torch.cuda._sleep(1_000_000_000)
                    g = torch.Generator(device=dev).manual_seed(seed + 77)
                    big.view(torch.uint8).random_(0, 256, generator=g)
                    await send(con, f"{tag}ord", ids(5, PB, seed + 9), peer, layerwise)
                out["combos"].append({"kind": kind, "dtype": dtype, **pstats(con)})
                await con.aclose()
            else:
                lay = make_layout(kind, dtype, CB)
                plays = make_layout(kind, dtype, PB)
                big = zeroed(lay, dev)
                con = KVConnector(eng, lay, list(big.unbind(0)), ipc=POPTS)
                await handshake(con, role, peer, tag)
                src_big, _ = fill(plays, dev, seed)
                ok = True
                touched: set[int] = {0, 1}
                for r, n in enumerate(LENGTHS):
                    dst = [b for b in ids(n + 2, CB, seed + 50 + r) if b > 1][:n]
                    await con.recv_request(
                        f"{tag}r{r}", dst, frm=peer, timeout=30, layerwise=layerwise
                    )
                    ok = ok and torch.equal(
                        blocks(src_big, plays, ids(n, PB, seed + r)), blocks(big, lay, dst)
                    )
                    touched |= set(dst)
                ordered = None
                if ci == 0:
                    dst = [b for b in range(CB) if b not in touched][:5]
                    await con.recv_request(
                        f"{tag}ord", dst, frm=peer, timeout=30, layerwise=layerwise
                    )
                    src2, _ = fill(plays, dev, seed + 77)
                    ordered = torch.equal(
                        blocks(src2, plays, ids(5, PB, seed + 9)), blocks(big, lay, dst)
                    )
                    touched |= set(dst)
                rest = [b for b in range(CB) if b not in touched]
                out["combos"].append(
                    {
                        "kind": kind,
                        "dtype": dtype,
                        "ok": ok,
                        "untouched": not bool(blocks(big, lay, rest).any()),
                        "ordered": ordered,
                        **pstats(con),
                    }
                )
                await con.aclose()
    return out


async def push_cancel(role: str, d: str) -> dict[str, Any]:
    """``k1``: the consumer cancels a granted request before the producer sends; the
    producer then takes the (stale) grant and pushes: the kernel must write nothing.
    ``k2``: the push is launched behind ~2 s of GPU sleep and the consumer cancels while
    it waits for it: nothing may be written then either, also after the sleep. (Marks
    in DIR order the two processes.)"""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    src = ids(64, 256, 1)
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            _, caches = fill(BIG, dev, 5)
            con = KVConnector(eng, BIG, caches, ipc=POPTS)
            await handshake(con, role, peer, "k")
            for rid, mark, cycles in (("k1", "k1_cancelled", 0), ("k2", "k2_granted", SLEEP_2S)):
                await _wait_for(d, mark)
                await asyncio.sleep(GRANT_LANDS_S)
                if cycles:
                    torch.cuda._sleep(cycles)
                t0 = time.monotonic()
                try:
                    await con.send_request(rid, src, to=peer, timeout=2)
                    out[rid] = "ok"
                except Exception as exc:
                    out[rid] = type(exc).__name__
                out[rid + "_s"] = time.monotonic() - t0
                torch.cuda.synchronize()
            out.update(pstats(con))
            await con.aclose()
        else:
            big = zeroed(BIG, dev)
            con = KVConnector(eng, BIG, list(big.unbind(0)), ipc=POPTS)
            await handshake(con, role, peer, "k")
            for rid, before, later in (("k1", 0.3, 2.0), ("k2", 0.8, 3.0)):
                dst = list(range(128, 192))
                task = asyncio.ensure_future(con.recv_request(rid, dst, frm=peer, timeout=30))
                await asyncio.sleep(0.05)
                if rid == "k2":
                    _publish(d, "k2_granted", "1")
                await asyncio.sleep(before)
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
                if rid == "k1":
                    _publish(d, "k1_cancelled", "1")
                await asyncio.sleep(later)
                torch.cuda.synchronize()
                out[rid + "_untouched_later"] = not bool(blocks(big, BIG, dst).any())
            out.update(pstats(con))
            await con.aclose()
    return out


async def push_kill_consumer(role: str, d: str) -> dict[str, Any]:
    """The consumer grants a request and dies (SIGKILL) before the producer sends: the
    producer takes the grant and launches its copy into the dead process's memory (it
    still maps it). That must not fault the producer's context: its send fails at the
    lease, and its device keeps working."""
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    src = ids(64, 256, 2)
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            big, caches = fill(BIG, dev, 7)
            con = KVConnector(eng, BIG, caches, ipc=POPTS)
            await handshake(con, role, peer, "q")
            await _wait_for(d, "consumer_dead")
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            try:
                await con.send_request("q1", src, to=peer, timeout=3)
                out["send"] = "ok"
            except Exception as exc:
                out["send"] = type(exc).__name__
            out["send_s"] = time.monotonic() - t0
            torch.cuda.synchronize()
            x = torch.ones(1 << 20, device=dev)
            raw = big.view(torch.uint8)
            out["healthy"] = float(x.sum()) == float(1 << 20) and bool(
                torch.equal(raw[0].clone(), raw[0])
            )
            out.update(pstats(con))
            await con.aclose()
        else:
            big = zeroed(BIG, dev)
            con = KVConnector(eng, BIG, list(big.unbind(0)), ipc=POPTS)
            await handshake(con, role, peer, "q")
            task = asyncio.ensure_future(
                con.recv_request("q1", list(range(64)), frm=peer, timeout=30)
            )
            await asyncio.sleep(0.3)  # the grant is out
            out["granted_in_time"] = not task.done()
            _publish(d, "consumer_dead", "1")
            os.kill(os.getpid(), signal.SIGKILL)
    return out


def main() -> None:
    role, scenario, d = sys.argv[1:4]
    fn = {
        "push_matrix": push_matrix,
        "push_layers_matrix": push_layers_matrix,
        "push_cancel": push_cancel,
        "push_kill_consumer": push_kill_consumer,
    }[scenario]
    say(role=role, **asyncio.run(fn(role, d)))


if __name__ == "__main__":
    main()
