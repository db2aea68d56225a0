"""AiokvConnector's worker side driven directly (``_workers.py``: real CPU caches, a
prefill and a decode worker in this process, no vLLM engine): a step's whole pushes
to one decode travel as ONE step batch, and each request's outcome is its own."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import free_port

with warnings.catch_warnings():  # vLLM's imports warn (deprecations in torch)
    warnings.simplefilter("ignore")
    from _workers import batch_sends, drain, load_of, make_worker, step_loads, step_sends

    from aiokv.vllm import AiokvMetadata
    from aiokv.vllm._protocol import LoadSpec, SendSpec, transfer_key
    from aiokv.vllm._worker import _WorkerSide

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]

LAYERS = 2


@pytest.fixture
def pd() -> Iterator[tuple[_WorkerSide, _WorkerSide, str]]:
    port = free_port()
    p = make_worker(layers=LAYERS, blocks=64)
    d = make_worker(layers=LAYERS, blocks=64, listen=f"127.0.0.1:{port}", timeout=5)
    try:
        assert p.address is not None
        yield p, d, p.address
    finally:
        p.close()
        d.close()


def sends(n: int, to: str, seed: int = 0) -> list[SendSpec]:
    """``n`` whole pushes of 1..3 blocks each, from distinct prefill blocks."""
    out, at = [], 0
    for i in range(n):
        k = 1 + i % 3
        rid = f"req-{seed}-{i}"
        out.append(SendSpec(rid, transfer_key(rid, [seed, i]), list(range(at, at + k)), to))
        at += k
    return out


def blocks(w: _WorkerSide, ids: list[int]) -> list[torch.Tensor]:
    assert w.kv is not None
    return [t[ids].clone() for t in w.kv.caches.tensors]


def pushed_batch(
    p: _WorkerSide, d: _WorkerSide, p_addr: str, n: int, *, seed: int
) -> tuple[list[SendSpec], list[LoadSpec]]:
    """``n`` whole pushes sent by the prefill worker as one step batch (all sent), and
    the decode's loads of them into blocks 40, 43, 46, ..."""
    assert d.address is not None
    step = sends(n, d.address, seed=seed)
    batch_sends(step)
    step_sends(p, step)
    drain(p, {s.req_id for s in step}, sending=True)
    loads = [
        load_of(s, p_addr, range(40 + 3 * i, 40 + 3 * i + len(s.block_ids)))
        for i, s in enumerate(step)
    ]
    return step, loads


def test_a_step_of_whole_pushes_moves_as_one_batch_per_peer(
    pd: tuple[_WorkerSide, _WorkerSide, str],
) -> None:
    p, d, p_addr = pd
    assert d.address is not None
    step = sends(6, d.address)
    batch_sends(step)
    assert {tuple(s.batch or ()) for s in step} == {tuple(step[0].batch or ())}
    assert [s.batch_index for s in step] == list(range(6))
    step_sends(p, step)
    drain(p, {s.req_id for s in step}, sending=True)
    loads, at = [], 40
    for s in step:
        loads.append(load_of(s, p_addr, range(at, at + len(s.block_ids))))
        at += len(s.block_ids)
    step_loads(d, loads)
    assert drain(d, {x.req_id for x in loads}, sending=False) == set()
    for s, x in zip(step, loads, strict=True):
        for a, b in zip(blocks(p, s.block_ids), blocks(d, x.block_ids), strict=True):
            assert torch.equal(a, b), s.req_id
    ps, ds = p.stats(), d.stats()
    assert (ps["batches_sent"], ps["sends"], ps["send_failures"]) == (1, 6, 0)
    assert (ds["batches_received"], ds["loads"], ds["load_failures"]) == (1, 6, 0)
    assert ds["blocks_loaded"] == sum(len(s.block_ids) for s in step)


def test_a_bad_request_of_a_batch_fails_alone_and_the_others_load(
    pd: tuple[_WorkerSide, _WorkerSide, str],
) -> None:
    p, d, p_addr = pd
    assert d.address is not None
    step, loads = pushed_batch(p, d, p_addr, 4, seed=1)
    # the decode's prompt of request 2 differs from the one the prefill computed
    loads[2].key = transfer_key(step[2].req_id, [1, 99])
    untouched = blocks(d, loads[2].block_ids)
    t0 = time.monotonic()
    step_loads(d, loads)
    assert drain(d, {x.req_id for x in loads}, sending=False) == {loads[2].req_id}
    assert time.monotonic() - t0 < 1.5  # its place counts as taken: no grace to wait for
    for i, (s, x) in enumerate(zip(step, loads, strict=True)):
        got = blocks(d, x.block_ids)
        want = untouched if i == 2 else blocks(p, s.block_ids)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), s.req_id
    ds = d.stats()
    assert (ds["batches_received"], ds["loads"], ds["load_failures"]) == (1, 3, 1)


def test_a_request_that_comes_after_its_batch_was_received_fails_at_once(
    pd: tuple[_WorkerSide, _WorkerSide, str],
) -> None:
    p, d, p_addr = pd
    assert d.address is not None
    _, loads = pushed_batch(p, d, p_addr, 3, seed=2)
    # two of the three come in this step; the batch is received after the grace
    step_loads(d, loads[:2])
    assert drain(d, {x.req_id for x in loads[:2]}, sending=False) == set()
    t0 = time.monotonic()
    step_loads(d, loads[2:])
    assert drain(d, {loads[2].req_id}, sending=False) == {loads[2].req_id}
    assert time.monotonic() - t0 < 1.0
    ds = d.stats()
    assert (ds["batches_received"], ds["loads"], ds["load_failures"]) == (1, 2, 1)


def test_a_batch_with_a_local_prefix_hit_writes_only_the_blocks_past_it(
    pd: tuple[_WorkerSide, _WorkerSide, str],
) -> None:
    p, d, p_addr = pd
    assert d.address is not None
    step, loads = pushed_batch(p, d, p_addr, 3, seed=3)  # 1, 2 and 3 blocks
    # the decode holds the first block of the third request: only its last two are written
    hit = loads[2].block_ids[0]
    loads[2].skip, loads[2].block_ids = 1, loads[2].block_ids[1:]
    kept = blocks(d, [hit])
    step_loads(d, loads)
    assert drain(d, {x.req_id for x in loads}, sending=False) == set()
    for s, x in zip(step, loads, strict=True):
        for a, b in zip(blocks(p, s.block_ids[x.skip :]), blocks(d, x.block_ids), strict=True):
            assert torch.equal(a, b), s.req_id
    for a, b in zip(kept, blocks(d, [hit]), strict=True):
        assert torch.equal(a, b)
    ds = d.stats()
    assert (ds["batches_received"], ds["loads"], ds["blocks_loaded"]) == (1, 3, 1 + 2 + 2)


def test_an_aborted_request_does_not_stop_its_batch_until_all_of_it_ended(
    pd: tuple[_WorkerSide, _WorkerSide, str],
) -> None:
    p, d, p_addr = pd
    assert d.address is not None
    step, loads = pushed_batch(p, d, p_addr, 3, seed=4)
    # one of the two that came is aborted while the batch waits for the third: the
    # other one still loads once the batch is received (after the grace)
    step_loads(d, loads[:2])
    d.start_loads(AiokvMetadata(cancel=[loads[0].req_id]))
    assert drain(d, {x.req_id for x in loads[:2]}, sending=False) == set()
    for a, b in zip(blocks(p, step[1].block_ids), blocks(d, loads[1].block_ids), strict=True):
        assert torch.equal(a, b)
    ds = d.stats()
    assert (ds["batches_received"], ds["loads"], ds["loads_cancelled"]) == (1, 2, 0)
    # a batch all of whose requests ended stops at once, before the grace
    _, loads = pushed_batch(p, d, p_addr, 3, seed=5)
    step_loads(d, loads[:2])
    t0 = time.monotonic()
    d.start_loads(AiokvMetadata(cancel=[x.req_id for x in loads[:2]]))
    assert drain(d, {x.req_id for x in loads[:2]}, sending=False) == set()
    assert time.monotonic() - t0 < 1.0
    ds = d.stats()
    assert (ds["batches_received"], ds["loads"], ds["loads_cancelled"]) == (1, 2, 2)


def test_a_load_aborted_in_the_step_it_starts_is_reported(
    pd: tuple[_WorkerSide, _WorkerSide, str],
) -> None:
    """Its task is cancelled before its first step, so it never runs its own
    reporting; vLLM would wait for the request's blocks forever."""
    _, d, p_addr = pd
    assert d.address is not None
    [s] = sends(1, d.address, seed=6)
    spec = load_of(s, p_addr, [40])
    spec.mode = "pull"
    d.start_loads(AiokvMetadata(load=[spec], cancel=[spec.req_id]))
    assert drain(d, {spec.req_id}, sending=False, timeout=5) == set()
    assert (d.stats()["loads_cancelled"], d.stats()["load_failures"]) == (1, 0)


def test_a_step_of_pulls_from_one_prefill_is_one_fetch_and_each_fails_alone(
    pd: tuple[_WorkerSide, _WorkerSide, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokv.kv._request_codec import ticket_name

    p, d, p_addr = pd
    assert p.engine is not None and d.kv is not None
    step = [SendSpec(s.req_id, s.key, s.block_ids) for s in sends(5, "-", seed=7)]
    step_sends(p, step)  # pull: the prefill holds each for a GET
    end = time.monotonic() + 10
    while not all(p.engine._is_published(ticket_name(s.key)) for s in step):
        assert time.monotonic() < end, "the prefill did not publish its tickets"
        time.sleep(0.01)
    calls: list[int] = []
    fetch = d.kv.fetch_requests

    async def counted(requests: Any, **kw: Any) -> Any:
        requests = list(requests)
        calls.append(len(requests))
        return await fetch(requests, **kw)

    monkeypatch.setattr(d.kv, "fetch_requests", counted)
    loads = [
        load_of(s, p_addr, range(40 + 3 * i, 40 + 3 * i + len(s.block_ids)))
        for i, s in enumerate(step)
    ]
    # the decode's prompt of request 3 differs: the prefill holds no such request
    loads[3].key = transfer_key(step[3].req_id, [7, 99])
    untouched = blocks(d, loads[3].block_ids)
    step_loads(d, loads)
    assert drain(d, {x.req_id for x in loads}, sending=False) == {loads[3].req_id}
    assert calls == [5]  # the step's pulls from one prefill: one fetch_requests
    for i, (s, x) in enumerate(zip(step, loads, strict=True)):
        want = untouched if i == 3 else blocks(p, s.block_ids)
        for a, b in zip(want, blocks(d, x.block_ids), strict=True):
            assert torch.equal(a, b), s.req_id
    ds = d.stats()
    assert (ds["loads"], ds["load_failures"]) == (4, 1)
