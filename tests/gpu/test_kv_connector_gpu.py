"""KVConnector between two GPUs over the engine's NCCL transport (needs 2 CUDA GPUs)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import Engine, EngineConfig, LayoutMismatchError, Timeouts
from aiokv.kv import FlashAttentionLayout, FlashInferLayout, KVConnector, KVLayout, MLALayout

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(180)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def anyio_backend() -> Any:
    return "asyncio"


def make_layout(kind: str, dtype: str, num_blocks: int, num_layers: int = 6) -> KVLayout:
    if kind == "fa":
        return FlashAttentionLayout(num_layers, num_blocks, 16, 8, 128, dtype)
    if kind == "fi":
        return FlashInferLayout(num_layers, num_blocks, 16, 8, 128, dtype)
    return MLALayout(num_layers, num_blocks, 16, 576, dtype)


def filled(layout: KVLayout, device: str, seed: int) -> list[torch.Tensor]:
    caches = layout.allocate(device, stacked=True)
    g = torch.Generator(device=device).manual_seed(seed)
    for t in caches:
        t.view(torch.uint8).random_(0, 256, generator=g)
    return caches


def rand_ids(n: int, num_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(num_blocks, generator=g)[:n]]


def same(
    pl: KVLayout, p: list[torch.Tensor], src: list[int], c: list[torch.Tensor], dst: list[int]
) -> bool:
    for li in range(pl.num_layers):
        a = (
            p[li]
            .view(torch.uint8)
            .index_select(pl.block_dim, torch.tensor(src, device=p[li].device))
        )
        b = (
            c[li]
            .view(torch.uint8)
            .index_select(pl.block_dim, torch.tensor(dst, device=c[li].device))
        )
        if not torch.equal(a.cpu(), b.cpu()):
            return False
    return True


def cfg(layout: KVLayout, device: str) -> EngineConfig:
    return EngineConfig(
        device=device, transport="nccl", layout=layout.to_wire(), timeouts=Timeouts(transfer=60.0)
    )


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["fa", "fi", "mla"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("chunk_mib", [64, 1])
async def test_gpu_bit_exact(kind: str, dtype: str, chunk_mib: int) -> None:
    pl = make_layout(kind, dtype, 300)
    cl = make_layout(kind, dtype, 257)
    p = filled(pl, "cuda:0", 1)
    c = cl.allocate("cuda:1", zero=True)
    reqs = [(rand_ids(16, 300, 10 + r), rand_ids(16, 257, 20 + r)) for r in range(8)]
    # distinct destination blocks across requests
    used: set[int] = set()
    dsts = []
    perm = rand_ids(257, 257, 99)
    for _ in reqs:
        d = [x for x in perm if x not in used][:16]
        used.update(d)
        dsts.append(d)
    async with Engine(cfg(pl, "cuda:0")) as a, Engine(cfg(cl, "cuda:1")) as b:
        prod = KVConnector(a, pl, p, chunk_bytes=chunk_mib << 20)
        cons = KVConnector(b, cl, c, chunk_bytes=chunk_mib << 20)
        await asyncio.gather(
            *(prod.send_request(f"g{r}", s, to=b.address) for r, (s, _) in enumerate(reqs)),
            *(cons.recv_request(f"g{r}", dsts[r], frm=a.address) for r in range(len(reqs))),
        )
        torch.cuda.synchronize("cuda:1")
        assert cons.finished_receiving() == {f"g{r}" for r in range(len(reqs))}
        for r, (s, _) in enumerate(reqs):
            assert same(pl, p, s, c, dsts[r]), f"request {r} differs"
        # layer-wise
        src = reqs[0][0]
        dst = dsts[1]
        recv = asyncio.ensure_future(cons.recv_request("lw", dst, frm=a.address, layerwise=True))
        for layer in range(pl.num_layers):
            prod.save_layer("lw", layer, src, to=b.address)
        await prod.wait_saved("lw")
        await recv
        torch.cuda.synchronize("cuda:1")
        assert same(pl, p, src, c, dst)


@pytest.mark.anyio
async def test_gpu_size_mismatch_scatters_nothing() -> None:
    lay = make_layout("fa", "bfloat16", 64)
    p = filled(lay, "cuda:0", 3)
    c = lay.allocate("cuda:1", zero=True)
    async with Engine(cfg(lay, "cuda:0")) as a, Engine(cfg(lay, "cuda:1")) as b:
        prod, cons = KVConnector(a, lay, p), KVConnector(b, lay, c)
        await prod.send_request("m", [1, 2, 3], to=b.address)
        with pytest.raises(LayoutMismatchError):
            await cons.recv_request("m", [1, 2, 3, 4], timeout=10)
        torch.cuda.synchronize("cuda:1")
        assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for t in c)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["fa", "mla"])
@pytest.mark.parametrize("chunk_mib", [64, 1])
async def test_gpu_batch_bit_exact(kind: str, chunk_mib: int) -> None:
    """A step batch over NCCL: the header a CPU transfer, the blocks on the GPUs; one
    request with another block count on the consumer fails alone (the others are picked
    out of each chunk on the device)."""
    pl = make_layout(kind, "bfloat16", 300)
    cl = make_layout(kind, "bfloat16", 257)
    p = filled(pl, "cuda:0", 5)
    c = cl.allocate("cuda:1", zero=True)
    perm = rand_ids(257, 257, 7)
    sizes = [16, 3, 9, 16, 1, 12, 7, 16]
    srcs = [rand_ids(n, 300, 30 + r) for r, n in enumerate(sizes)]
    dsts, at = [], 0
    for n in sizes:
        dsts.append(perm[at : at + n])
        at += n
    dsts[2] = dsts[2][:8]  # the consumer expects 8 blocks of request 2, the producer sends 9
    async with Engine(cfg(pl, "cuda:0")) as a, Engine(cfg(cl, "cuda:1")) as b:
        prod = KVConnector(a, pl, p, chunk_bytes=chunk_mib << 20)
        cons = KVConnector(b, cl, c, chunk_bytes=chunk_mib << 20)
        recv = asyncio.ensure_future(
            cons.recv_requests([(f"b{r}", d) for r, d in enumerate(dsts)], frm=a.address)
        )
        sent = await prod.send_requests([(f"b{r}", s) for r, s in enumerate(srcs)], to=b.address)
        got = await recv
        torch.cuda.synchronize("cuda:1")
        assert set(sent.values()) == {None}
        assert isinstance(got.pop("b2"), LayoutMismatchError) and set(got.values()) == {None}
        for r in range(len(sizes)):
            if r != 2:
                assert same(pl, p, srcs[r], c, dsts[r]), f"request {r} differs"
        untouched = torch.tensor(dsts[2], device="cuda:1")
        for t in c:  # nothing of the refused request was written
            assert (
                int(t.view(torch.uint8).index_select(cl.block_dim, untouched).count_nonzero()) == 0
            )


def test_gpu_bench_tiny() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiokv.cli.bench.kv",
            "--transport",
            "nccl",
            "--workload",
            "tiny",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["ok"] is True and rec["aiokv_gbps"] > 0
