"""KVConnector over real engines on loopback TCP (CPU), on asyncio and uvloop."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from support.kvutil import blocks, filled, make_layout, rand_ids

with warnings.catch_warnings():  # this CPU torch build warns at import when numpy is absent
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import (
    ConfigError,
    Engine,
    EngineConfig,
    LayoutMismatchError,
    RemoteProtocolError,
    Timeouts,
    TransferError,
    TransferTimeoutError,
)
from aiokv.kv import (
    FlashAttentionLayout,
    KVConnector,
    KVLayout,
    LayerChunker,
)

DTYPE_NAMES = ["bfloat16", "float16", "float8_e4m3fn", "float32"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# anyio_backend (asyncio in debug mode, and uvloop) comes from tests/conftest.py


def assert_landed(
    pl: KVLayout,
    p: list[torch.Tensor],
    src: list[int],
    cl: KVLayout,
    c: list[torch.Tensor],
    dst: list[int],
) -> None:
    for li in range(pl.num_layers):
        assert torch.equal(blocks(p[li], pl, src), blocks(c[li], cl, dst)), f"layer {li} differs"


def cfg(layout: KVLayout | None = None, **kw: Any) -> EngineConfig:
    return EngineConfig(
        timeouts=Timeouts(transfer=20.0),
        layout=layout.to_wire() if layout is not None else None,
        **kw,
    )


@asynccontextmanager
async def pair(
    la: KVLayout | None, lb: KVLayout | None, **kw: Any
) -> AsyncIterator[tuple[Engine, Engine]]:
    async with Engine(cfg(la, **kw)) as a, Engine(cfg(lb, **kw)) as b:
        yield a, b


# --------------------------------------------------------------------------- bit-exact


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
async def test_bit_exact_every_layout_and_dtype(kind: str, dtype: str) -> None:
    pl = make_layout(kind, dtype, num_blocks=41)
    cl = make_layout(kind, dtype, num_blocks=29)  # num_blocks may differ
    p = filled(pl, 1)
    c = filled(cl, 2, stacked=True)
    before = [t.clone() for t in c]
    src = rand_ids(11, pl.num_blocks, 3)
    dst = rand_ids(11, cl.num_blocks, 4)
    async with pair(pl, cl) as (a, b):
        prod = KVConnector(a, pl, p)
        cons = KVConnector(b, cl, c)
        recv = asyncio.create_task(cons.recv_request("r1", dst, frm=a.address, timeout=20))
        await prod.send_request("r1", src, to=b.address, timeout=20)
        await recv
        assert prod.finished_sending() == {"r1"}
        assert prod.finished_sending() == set()  # cleared
        assert cons.finished_receiving() == {"r1"}
        assert_landed(pl, p, src, cl, c, dst)
        others = [i for i in range(cl.num_blocks) if i not in dst]
        for li in range(cl.num_layers):
            assert torch.equal(blocks(c[li], cl, others), blocks(before[li], cl, others))
        ps, cs = prod.statistics(), cons.statistics()
        assert ps.requests_sent == 1 and ps.chunks_sent == 1
        assert ps.bytes_sent == pl.request_nbytes(11) == cs.bytes_received
        assert cs.requests_received == 1 and cs.recv_failures == 0
        assert ps.staging is not None and ps.staging.in_use == 0 and ps.staging.leases == 0
        await prod.aclose()
        await cons.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
async def test_multi_chunk_request(kind: str) -> None:
    pl = make_layout(kind, "bfloat16", num_blocks=64, num_layers=7)
    cl = make_layout(kind, "bfloat16", num_blocks=50, num_layers=7)
    n = 13
    layer_bytes = n * pl.block_nbytes()
    chunk_bytes = 2 * layer_bytes + 1  # two layers a chunk -> 4 chunks (2, 2, 2, 1 layers)
    plan = LayerChunker(pl, n).chunks(max_bytes=chunk_bytes)
    assert [len(s.layers) for s in plan] == [2, 2, 2, 1]
    p, c = filled(pl, 5), filled(cl, 6)
    src, dst = rand_ids(n, pl.num_blocks, 7), rand_ids(n, cl.num_blocks, 8)
    async with pair(pl, cl) as (a, b):
        # a staging pool of 3 chunks forces the pipeline to wait for staging
        prod = KVConnector(
            a,
            pl,
            p,
            chunk_bytes=chunk_bytes,
            staging_bytes=3 * 2 * layer_bytes + 4096,
            max_inflight=2,
        )
        cons = KVConnector(b, cl, c, chunk_bytes=chunk_bytes)
        assert [s.layers for s in prod.chunk_plan(n)] == [s.layers for s in plan]
        await asyncio.gather(
            prod.send_request("big", src, to=b.address),
            cons.recv_request("big", dst, frm=a.address),
        )
        assert_landed(pl, p, src, cl, c, dst)
        assert prod.statistics().chunks_sent == 4 == cons.statistics().chunks_received
        st = prod.statistics().staging
        assert st is not None and st.in_use == 0 and st.peak <= st.capacity


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_chunk_larger_than_staging_pool() -> None:
    lay = make_layout("fa", "float32", num_blocks=40)
    p, c = filled(lay, 1), filled(lay, 2)
    src, dst = rand_ids(20, 40, 3), rand_ids(20, 40, 4)
    async with pair(lay, lay) as (a, b):
        prod = KVConnector(a, lay, p, staging_bytes=4096)  # far smaller than one request
        cons = KVConnector(b, lay, c)
        await asyncio.gather(prod.send_request("x", src, to=b.address), cons.recv_request("x", dst))
        assert_landed(lay, p, src, lay, c, dst)


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_many_concurrent_requests_both_directions() -> None:
    lay = make_layout("fa", "bfloat16", num_blocks=400, num_layers=4)
    n_req, per = 24, 8
    a_cache, b_cache = filled(lay, 11), filled(lay, 12)
    # each side sends out of its blocks [0, 200) and receives into its [200, 400), so the
    # two directions never write blocks the other direction reads
    perm_a = rand_ids(400, 400, 13)
    perm_b = rand_ids(400, 400, 14)
    a_src = [x for x in perm_a if x < 200][: n_req * per]
    b_dst = [x for x in perm_a if x >= 200][: n_req * per]  # in A's cache
    b_src = [x for x in perm_b if x < 200][: n_req * per]
    a_dst = [x for x in perm_b if x >= 200][: n_req * per]  # in B's cache
    a_orig = [t.clone() for t in a_cache]
    b_orig = [t.clone() for t in b_cache]
    chunk = 2 * per * lay.block_nbytes()  # 2 chunks per request
    async with pair(lay, lay) as (a, b):
        ca = KVConnector(a, lay, a_cache, chunk_bytes=chunk, staging_bytes=6 * chunk + 4096)
        cb = KVConnector(b, lay, b_cache, chunk_bytes=chunk, staging_bytes=6 * chunk + 4096)
        jobs = []
        for r in range(n_req):
            s = slice(r * per, (r + 1) * per)
            jobs.append(ca.send_request(f"ab{r}", a_src[s], to=b.address))
            jobs.append(cb.recv_request(f"ab{r}", a_dst[s], frm=a.address))
            jobs.append(cb.send_request(f"ba{r}", b_src[s], to=a.address))
            jobs.append(ca.recv_request(f"ba{r}", b_dst[s], frm=b.address))
        await asyncio.gather(*jobs)
        want = {f"ab{r}" for r in range(n_req)}
        assert ca.finished_sending() == want and cb.finished_receiving() == want
        want = {f"ba{r}" for r in range(n_req)}
        assert cb.finished_sending() == want and ca.finished_receiving() == want
    k = n_req * per
    assert_landed(lay, a_orig, a_src[:k], lay, b_cache, a_dst[:k])
    assert_landed(lay, b_orig, b_src[:k], lay, a_cache, b_dst[:k])


# --------------------------------------------------------------------------- layer-wise


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fa", "mla"])
async def test_layerwise_save_and_wait(kind: str) -> None:
    pl = make_layout(kind, "float8_e4m3fn", num_blocks=30, num_layers=5)
    cl = make_layout(kind, "float8_e4m3fn", num_blocks=33, num_layers=5)
    p, c = filled(pl, 21), filled(cl, 22)
    src, dst = rand_ids(9, 30, 23), rand_ids(9, 33, 24)
    async with pair(pl, cl) as (a, b):
        prod = KVConnector(a, pl, p, staging_bytes=2 * 9 * pl.block_nbytes() + 1024)
        cons = KVConnector(b, cl, c)
        recv = asyncio.create_task(cons.recv_request("lw", dst, frm=a.address, layerwise=True))
        for layer in range(pl.num_layers):  # "the forward pass": one layer at a time
            prod.save_layer("lw", layer, src, to=b.address)
            await asyncio.sleep(0)
        with pytest.raises(ConfigError):
            prod.save_layer("lw", 0, src, to=b.address)  # saved twice
        await prod.wait_saved("lw")
        await recv
        assert prod.finished_sending() == {"lw"}
        assert cons.finished_receiving() == {"lw"}
        assert_landed(pl, p, src, cl, c, dst)
        assert prod.statistics().chunks_sent == pl.num_layers
        with pytest.raises(ConfigError):
            await prod.wait_saved("lw")  # nothing pending any more


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_wait_saved_reports_missing_layers() -> None:
    lay = make_layout("fa", "float16", num_blocks=16, num_layers=4)
    p = filled(lay, 1)
    async with pair(lay, lay) as (a, b):
        prod = KVConnector(a, lay, p)
        prod.save_layer("part", 0, [1, 2], to=b.address)
        with pytest.raises(ConfigError, match="never saved"):
            await prod.wait_saved("part")
        assert prod.finished_sending() == set()


# --------------------------------------------------------------------------- failures


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_timeout_on_missing_request_marks_nothing() -> None:
    lay = make_layout("fa", "float32", num_blocks=16)
    c = filled(lay, 1)
    async with pair(lay, lay) as (_a, b):
        cons = KVConnector(b, lay, c)
        with pytest.raises(TransferTimeoutError):
            await cons.recv_request("ghost", [1, 2, 3], timeout=0.3)
        assert cons.finished_receiving() == set()
        assert cons.statistics().recv_failures == 1
        assert cons.statistics().requests_received == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_half_received_request_is_not_finished() -> None:
    lay = make_layout("fi", "bfloat16", num_blocks=20, num_layers=4)
    p, c = filled(lay, 1), filled(lay, 2)
    n = 5
    chunk = 2 * n * lay.block_nbytes()  # 2 chunks
    async with pair(lay, lay) as (a, b):
        prod = KVConnector(a, lay, p, chunk_bytes=chunk)
        cons = KVConnector(b, lay, c, chunk_bytes=chunk)
        # only the first chunk ever arrives
        first = torch.zeros(2, n * lay.block_nbytes(), dtype=torch.uint8)
        await a.send(prod.chunk_name("half", 0), first, to=b.address)
        with pytest.raises(TransferTimeoutError):
            await cons.recv_request("half", [1, 2, 3, 4, 5], timeout=0.5)
        assert cons.finished_receiving() == set()
        # cancellation: same story
        task = asyncio.create_task(cons.recv_request("half2", [6, 7, 8, 9, 10], timeout=10))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cons.finished_receiving() == set()
        # the connector is still usable for the same ids afterwards
        await asyncio.gather(
            prod.send_request("again", [0, 1, 2, 3, 4], to=b.address),
            cons.recv_request("again", [6, 7, 8, 9, 10]),
        )
        assert cons.finished_receiving() == {"again"}
        assert_landed(lay, p, [0, 1, 2, 3, 4], lay, c, [6, 7, 8, 9, 10])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_block_count_mismatch_is_a_clear_error_and_scatters_nothing() -> None:
    lay = make_layout("fa", "bfloat16", num_blocks=20)
    p, c = filled(lay, 1), filled(lay, 2)
    before = [t.clone() for t in c]
    async with pair(lay, lay) as (a, b):
        prod = KVConnector(a, lay, p)
        cons = KVConnector(b, lay, c)
        await prod.send_request("m", [1, 2, 3, 4, 5], to=b.address)
        with pytest.raises(LayoutMismatchError, match="blocks") as ei:
            await cons.recv_request("m", [1, 2, 3, 4, 5, 6], timeout=5)
        assert isinstance(ei.value, TransferError)
        assert ei.value.code == "kv_size_mismatch"
        assert cons.finished_receiving() == set()
        for x, y in zip(c, before):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_chunk_bytes_disagreement_is_detected() -> None:
    lay = make_layout("fa", "float32", num_blocks=20, num_layers=4)
    p, c = filled(lay, 1), filled(lay, 2)
    before = [t.clone() for t in c]
    n = 4
    async with pair(lay, lay) as (a, b):
        # 2 chunks of 2 layers vs 4 chunks of 1 layer
        prod = KVConnector(a, lay, p, chunk_bytes=2 * n * lay.block_nbytes())
        cons = KVConnector(b, lay, c, chunk_bytes=n * lay.block_nbytes())
        await prod.send_request("cb", [0, 1, 2, 3], to=b.address)
        with pytest.raises(LayoutMismatchError, match="chunk_bytes"):
            await cons.recv_request("cb", [4, 5, 6, 7], timeout=5)
        for x, y in zip(c, before):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_layout_mismatch_refused_at_connection() -> None:
    pl = make_layout("fa", "bfloat16", num_blocks=20)
    cl = make_layout("fa", "float16", num_blocks=20)  # dtype differs
    p, c = filled(pl, 1), filled(cl, 2)
    async with pair(pl, cl) as (a, b):
        prod = KVConnector(a, pl, p)
        KVConnector(b, cl, c)
        # the engine answers HELLO with ERROR(layout_mismatch) and the client session fails:
        # today that surfaces as RemoteProtocolError (LayoutMismatchError would be clearer)
        with pytest.raises((LayoutMismatchError, RemoteProtocolError)) as ei:
            await prod.send_request("lm", [1, 2], to=b.address, timeout=5)
        assert "layout mismatch in field 'dtype'" in str(ei.value).lower()
        assert b.statistics().bytes_received == 0
        assert prod.finished_sending() == set()
        assert prod.statistics().send_failures == 1


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_argument_validation() -> None:
    lay = make_layout("mla", "float32", num_blocks=8)
    c = filled(lay, 1)
    async with pair(lay, lay) as (a, b):
        con = KVConnector(a, lay, c)
        with pytest.raises(ConfigError):
            await con.recv_request("v", [1, 1])  # duplicates on the receiving side
        with pytest.raises(ConfigError):
            await con.recv_request("v", [8])  # out of range
        with pytest.raises(ConfigError):
            await con.send_request("", [1], to=b.address)
        with pytest.raises(ConfigError):
            con.save_layer("v", 3, [1], to=b.address)  # no layer 3
        with pytest.raises(ConfigError):
            KVConnector(a, lay, c, chunk_bytes=0)
        # an empty request moves nothing and completes at once on both sides
        await con.send_request("empty", [], to=b.address)
        await con.recv_request("empty", [])
        assert con.finished_sending() == {"empty"} == con.finished_receiving()


# --------------------------------------------------------------------------- two processes

_PRODUCER = textwrap.dedent(
    """
    import asyncio, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from aiokv import Engine, EngineConfig
    from aiokv.kv import FlashAttentionLayout, KVConnector

    async def main(to):
        lay = FlashAttentionLayout(4, 64, 16, 2, 32, "bfloat16")
        caches = lay.allocate()
        g = torch.Generator().manual_seed(99)
        for t in caches:
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
        async with Engine(EngineConfig(layout=lay.to_wire())) as eng:
            con = KVConnector(eng, lay, caches, chunk_bytes=2 * 10 * lay.block_nbytes())
            src = [int(i) for i in torch.randperm(64, generator=torch.Generator().manual_seed(5))[:40]]
            await asyncio.gather(*(
                con.send_request(f"p{r}", src[r * 10:(r + 1) * 10], to=to, timeout=30)
                for r in range(4)
            ))
            print("sent", sorted(con.finished_sending()), flush=True)
            await con.aclose()

    asyncio.run(main(sys.argv[1]))
    """
)


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_two_processes() -> None:
    lay = FlashAttentionLayout(4, 64, 16, 2, 32, "bfloat16")
    g = torch.Generator().manual_seed(99)
    expected = lay.allocate()
    for t in expected:
        bb = t.view(torch.uint8)
        bb.copy_(torch.randint(0, 256, bb.shape, dtype=torch.uint8, generator=g))
    src = rand_ids(40, 64, 5)
    dst = rand_ids(40, 64, 6)
    caches = lay.allocate(zero=True)
    async with Engine(cfg(lay)) as eng:
        con = KVConnector(eng, lay, caches, chunk_bytes=2 * 10 * lay.block_nbytes())
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _PRODUCER,
            eng.address,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            await asyncio.gather(
                *(
                    con.recv_request(f"p{r}", dst[r * 10 : (r + 1) * 10], timeout=60)
                    for r in range(4)
                )
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, out.decode()
        assert "sent ['p0', 'p1', 'p2', 'p3']" in out.decode()
        assert con.finished_receiving() == {f"p{r}" for r in range(4)}
    assert_landed(lay, expected, src, lay, caches, dst)


@pytest.mark.timeout(120)
def test_bench_tiny_tcp_json() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiokv.cli.bench.kv",
            "--transport",
            "tcp",
            "--workload",
            "tiny",
            "--json",
            "--latency-gap-ms",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines, r.stderr
    rec = json.loads(lines[-1])
    for k in ("workload", "transport", "aiokv_gbps", "raw_gbps", "ratio", "ok"):
        assert k in rec, rec
    assert rec["workload"] == "tiny" and rec["transport"] == "tcp"
    assert rec["ok"] is True, rec
    assert rec["aiokv_gbps"] > 0 and rec["raw_gbps"] > 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_deadline_already_over_is_a_timeout_not_a_config_error() -> None:
    """``timeout=0`` (allowed: "no time left") and a deadline that runs out between
    steps must end the call with TransferTimeoutError. Regression: the remaining time,
    0, went to the engine, whose calls refuse a zero timeout as a ConfigError."""
    lay = make_layout("fa", "bfloat16", 8)
    async with pair(lay, lay) as (a, b):
        prod = KVConnector(a, lay, filled(lay, 1))
        cons = KVConnector(b, lay, filled(lay, 2))
        with pytest.raises(TransferTimeoutError):
            await cons.recv_request("z1", [1], frm=a.address, timeout=0)
        with pytest.raises(TransferTimeoutError):
            await prod.send_request("z2", [1], to=b.address, timeout=0)
        await prod.aclose()
        await cons.aclose()


@pytest.mark.timeout(120)
def test_bench_layerwise_latency_requests_tcp() -> None:
    """``--layerwise``: the throughput and the latency requests go layer by layer (here
    over the engine), and land bit-exact."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-m", "aiokv.cli.bench.kv", "--transport", "tcp", "--workload", "tiny",
         "--json", "--iters", "1", "--latency-n", "5", "--layerwise"],
        capture_output=True, text=True, timeout=110, env=env, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["ok"] is True and rec["latency_layerwise"] is True and rec["latency_n"] == 5
    assert rec["throughput_layerwise"] is True and rec["aiokv_gbps"] > 0
    assert rec["p50_ms"] > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [
        ["--transport", "tcp", "--gpu-lead-us", "500"],  # no GPU stream to lead
        ["--transport", "ipc", "--gpu-lead-us", "-1"],
        ["--transport", "ipc", "--gpu-lead-us", "2000000"],
    ],
)
def test_bench_refuses_a_gpu_lead_it_cannot_use(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from aiokv.cli.bench import kv as bench
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2 and "--gpu-lead-us" in capsys.readouterr().err
