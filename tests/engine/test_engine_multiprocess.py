"""Engines in separate processes on 127.0.0.1, on asyncio (debug) and uvloop.

The test process is the consumer; producers are ``tests/support/procs.py`` roles
spawned with ``sys.executable`` (killed in ``finally`` by the ``spawn``
fixture). Producers derive every tensor from a seed; the consumer regenerates
the expected tensor from the same seed and compares bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import pytest
import torch
from support.procs import backend_name, make_case, random_tensor, same_bytes

import aiokv

pytestmark = [pytest.mark.anyio]
MiB = 1024 * 1024
TIMINGS = os.environ.get("AIOKV_TIMINGS_LOG")  # figures are kept only where this names a file


def record(name: str, **vals: Any) -> None:
    if not TIMINGS:
        return
    with open(TIMINGS, "a") as f:
        f.write(json.dumps({"test": name, **vals}) + "\n")


@pytest.mark.timeout(120)
async def test_1000_concurrent_mixed_sends_from_two_producers(
    anyio_backend: Any, spawn: Any
) -> None:
    seed, per = 20260, 500
    be = backend_name(anyio_backend)
    async with aiokv.Engine(aiokv.EngineConfig()) as cons:
        prods = [
            spawn(
                "producer",
                to=cons.address,
                seed=seed,
                pid=pid,
                n=per,
                profile="mixed",
                backend=be,
                mode="send" if pid == 1 else "send_nowait",
            )
            for pid in (1, 2)
        ]
        ready = [await p.wait_event("ready", 60) for p in prods]
        total = sum(r["nbytes"] for r in ready)
        t0 = time.monotonic()
        for p in prods:
            p.tell("go")
        bad: list[str] = []

        def check(pid: int, k: int, got: torch.Tensor) -> bool:
            _, want = make_case(seed, pid, k, "mixed")  # regenerated from the seed
            return same_bytes(got, want)

        async def collect(pid: int) -> list[BaseException]:
            errs: list[BaseException] = []
            for k in range(per):  # in id order; the sends themselves race in any order
                tid = f"p{pid}/{k}"
                try:
                    got = await cons.recv(tid, timeout=90)
                except aiokv.AiokvError as exc:
                    errs.append(exc)
                    continue
                # compare off the loop: a consumer that blocks its loop for seconds starves heartbeats
                if not await asyncio.to_thread(check, pid, k, got):
                    bad.append(tid)
            return errs

        results = [e for errs in await asyncio.gather(collect(1), collect(2)) for e in errs]
        t_all = time.monotonic() - t0
        dones = [await p.wait_event("done", 60) for p in prods]
        errors = [repr(r) for r in results if r is not None]
        assert not errors, f"{len(errors)} recv failed, e.g. {errors[:3]}; producers: {dones}"
        for p in prods:
            p.tell("quit")
        st = cons.statistics()
        record(
            "mixed_1000",
            backend=be,
            total_bytes=total,
            seconds=t_all,
            peak=st.store.peak_bytes if st.store else None,
        )
        assert not bad, f"{len(bad)} tensors differ: {bad[:10]}"
        assert all(d["n_errors"] == 0 for d in dones), dones
        assert st.tensors_received == 2 * per
        assert st.store is not None and st.store.held_bytes == 0 and st.store.reserved_bytes == 0
        assert st.protocol_errors == {}


@pytest.mark.timeout(60)
async def test_put_put_async_get_across_processes(anyio_backend: Any, spawn: Any) -> None:
    async with aiokv.Engine(aiokv.EngineConfig()) as cons:
        p = spawn("putget", to=cons.address, backend=backend_name(anyio_backend))
        ev = await p.wait_event("ready", 60)
        got = await cons.recv("pg-put", timeout=10)
        assert same_bytes(got, random_tensor(4096, torch.bfloat16, 1, 1))
        got = await cons.recv("pg-async", frm=ev["address"], timeout=10)
        assert same_bytes(got, random_tensor(100_000, torch.int32, 2, 2))
        got = await cons.get("pg-pub", frm=ev["address"], timeout=10)
        assert same_bytes(got, random_tensor(50_000, torch.float8_e5m2, 3, 3))
        with pytest.raises(aiokv.NotPublishedError):
            await cons.get("pg-nope", frm=ev["address"], timeout=10)
        p.tell("quit")
        st = await p.wait_event("stats", 20)
        assert st["gets_served"] == 1


@pytest.mark.timeout(90)
async def test_slow_consumer_stays_under_budget(anyio_backend: Any, spawn: Any) -> None:
    budget, seed, n = 4 * MiB, 7, 150
    async with aiokv.Engine(aiokv.EngineConfig(limits=aiokv.Limits(store_bytes=budget))) as cons:
        p = spawn(
            "producer",
            to=cons.address,
            seed=seed,
            pid=3,
            n=n,
            profile="small",
            backend=backend_name(anyio_backend),
        )
        await p.wait_event("ready", 60)
        p.tell("go")
        max_used = max_queued = 0
        bad = []
        for k in range(n):  # collect in order, slowly
            await asyncio.sleep(0.01)
            s = cons.statistics()
            assert s.store is not None
            max_used = max(max_used, s.store.reserved_bytes + s.store.held_bytes)
            max_queued = max(max_queued, s.queued_reservations + s.credit_starved)
            tid, want = make_case(seed, 3, k, "small")
            got = await cons.recv(tid, timeout=30)
            if not same_bytes(got, want):
                bad.append(tid)
        done = await p.wait_event("done", 30)
        p.tell("quit")
        st = cons.statistics()
        assert st.store is not None
        record(
            "slow_consumer_multiproc",
            budget=budget,
            peak=st.store.peak_bytes,
            max_used_sampled=max_used,
            max_queued=max_queued,
        )
        assert not bad and done["n_errors"] == 0
        assert st.store.peak_bytes <= budget and max_used <= budget
        assert max_queued > 0  # the producer waited for credit


@pytest.mark.timeout(60)
async def test_kill9_producer_mid_transfer_fails_recv_fast(anyio_backend: Any, spawn: Any) -> None:
    nbytes = 1024 * MiB
    async with aiokv.Engine(aiokv.EngineConfig()) as cons:
        p = spawn("big", to=cons.address, nbytes=nbytes, backend=backend_name(anyio_backend))
        await p.wait_event("ready", 60)
        waiter = asyncio.ensure_future(cons.recv("big", timeout=30))
        p.tell("go")
        # wait until the RESERVE arrived and was granted: the data is now streaming
        dl = time.monotonic() + 20
        while cons.statistics().store.reserved_bytes < nbytes:  # type: ignore[union-attr]
            assert time.monotonic() < dl and not waiter.done(), "no grant for the big transfer"
            await asyncio.sleep(0.001)
        p.kill9()
        t_kill = time.monotonic()
        with pytest.raises(aiokv.PeerLostError):
            await waiter
        took = time.monotonic() - t_kill
        st = cons.statistics()
        record(
            "kill9_detection",
            backend=backend_name(anyio_backend),
            nbytes=nbytes,
            seconds=took,
            landed=st.tensors_received,
            heartbeat_timeout=cons.config.timeouts.heartbeat_timeout,
        )
        assert took < 5.0, took
        assert st.tensors_received == 0, "the transfer finished before the kill: not mid-transfer"
        assert (
            st.store is not None and st.store.reserved_bytes == 0 and st.store.pending_tensors == 0
        )
        assert st.peers_lost >= 1
        # the engine keeps serving other peers
        async with aiokv.Engine(aiokv.EngineConfig()) as other:
            await other.send("after", torch.arange(5), to=cons.address, timeout=10)
        assert same_bytes(await cons.recv("after", timeout=5), torch.arange(5))
