"""Session lifetime limits: idle eviction and the LRU cap on client sessions."""

from __future__ import annotations

import asyncio

import pytest
import torch

import aiokv


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_idle_session_is_closed_and_reopened_on_next_use() -> None:
    cfg = aiokv.EngineConfig(limits=aiokv.Limits(idle_session=0.3))
    async with aiokv.Engine(cfg) as a, aiokv.Engine() as b:
        await a.send("x", torch.ones(4), to=b.address)
        assert a.statistics().client_sessions == 1
        for _ in range(40):  # housekeeping runs every ≤ 0.25 s
            await asyncio.sleep(0.05)
            if a.statistics().client_sessions == 0:
                break
        assert a.statistics().client_sessions == 0
        for _ in range(40):  # the peer saw the orderly BYE
            if b.statistics().server_sessions == 0:
                break
            await asyncio.sleep(0.05)
        assert b.statistics().server_sessions == 0
        await a.send("y", torch.ones(4), to=b.address)  # a fresh session
        assert a.statistics().sessions_opened == 2
        assert torch.equal(await b.recv("y"), torch.ones(4))
        assert torch.equal(await b.recv("x"), torch.ones(4))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_lru_cap_closes_least_recently_used_idle_session() -> None:
    cfg = aiokv.EngineConfig(limits=aiokv.Limits(max_client_sessions=2))
    async with (
        aiokv.Engine(cfg) as a,
        aiokv.Engine() as p1,
        aiokv.Engine() as p2,
        aiokv.Engine() as p3,
    ):
        await a.send("1", torch.ones(2), to=p1.address)
        await a.send("2", torch.ones(2), to=p2.address)
        await a.send("1b", torch.ones(2), to=p1.address)  # p1 is now the most recently used
        await a.send("3", torch.ones(2), to=p3.address)  # evicts p2's session
        st = a.statistics()
        assert st.client_sessions == 2
        assert set(a._clients) == {p1.address, p3.address}
        await a.send("2b", torch.ones(2), to=p2.address)  # reopens, evicting p1
        assert set(a._clients) == {p3.address, p2.address}
        for eng, ids in ((p1, ["1", "1b"]), (p2, ["2", "2b"]), (p3, ["3"])):
            for tid in ids:
                assert torch.equal(await eng.recv(tid, timeout=5), torch.ones(2))
