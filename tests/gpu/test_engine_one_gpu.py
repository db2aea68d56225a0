"""The engine with CUDA tensors on ONE GPU: the TCP path (protocol v2 PUTs of pinned host copies),
the per-request KV header, and GET, between two engines on ``cuda:0``."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv import Engine, EngineConfig, LayoutMismatchError, Limits, Timeouts
from aiokv.kv import FlashAttentionLayout, KVConnector

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.fixture
def anyio_backend() -> Any:
    return "asyncio"


def cfg(**limits: Any) -> EngineConfig:
    return EngineConfig(
        device="cuda:0",
        transport="tcp",
        timeouts=Timeouts(transfer=30.0),
        limits=Limits(**limits) if limits else Limits(),
    )


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["credit", "reserve"])
async def test_cuda_tensors_over_tcp_bit_exact(path: str) -> None:
    extra = {"credit_bytes": 1} if path == "reserve" else {}
    g = torch.Generator(device="cuda:0").manual_seed(5)
    xs = [torch.randn(n, device="cuda:0", generator=g) for n in (1, 1000, 300_000)]
    async with Engine(cfg()) as a, Engine(cfg(**extra)) as b:
        for i, x in enumerate(xs):
            y = x * 2  # produced on the current stream just before the send
            await a.send(f"s{i}", y, to=b.address)
            got = await b.recv(f"s{i}", timeout=10)
            assert torch.equal(got.to("cuda:0"), y)
        hs = [a.send_nowait(f"n{i}", x, to=b.address) for i, x in enumerate(xs)]
        for h in hs:
            await h
        for i, x in enumerate(xs):
            assert torch.equal((await b.recv(f"n{i}", timeout=10)).to("cuda:0"), x)
        b.publish("pub", xs[1])
        assert torch.equal((await a.get("pub", frm=b.address, timeout=10)).to("cuda:0"), xs[1])
        st = b.statistics()
        assert st.protocol_errors == {} and a.statistics().protocol_errors == {}


@pytest.mark.anyio
async def test_kv_connector_one_gpu_over_tcp_and_layout_header() -> None:
    lay = FlashAttentionLayout(4, 32, 16, 8, 64, "bfloat16")
    other = FlashAttentionLayout(4, 32, 16, 4, 128, "bfloat16")  # same bytes per block
    p = lay.allocate("cuda:0", stacked=True)
    for t in p:
        t.view(torch.uint8).random_(0, 256)
    c = lay.allocate("cuda:0", zero=True)
    c2 = other.allocate("cuda:0", zero=True)
    async with Engine(cfg()) as a, Engine(cfg()) as b:
        prod, cons = KVConnector(a, lay, p), KVConnector(b, lay, c)
        await prod.send_request("r1", [3, 1, 4, 5], to=b.address)
        await cons.recv_request("r1", [7, 8, 9, 10], timeout=20)
        torch.cuda.synchronize()
        for li in range(lay.num_layers):
            src = p[li].view(torch.uint8)[:, [3, 1, 4, 5]]
            dst = c[li].view(torch.uint8)[:, [7, 8, 9, 10]]
            assert torch.equal(src, dst)
        wrong = KVConnector(b, other, c2)
        await prod.send_request("r2", [1, 2], to=b.address)
        with pytest.raises(LayoutMismatchError):
            await wrong.recv_request("r2", [1, 2], timeout=20)
        torch.cuda.synchronize()
        assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for t in c2)
