"""AiokvConnector's scheduler side inside vLLM's real ``Scheduler`` (no engine, no
worker): the worker's reports are given by hand, as the model runner would.

The lifecycle a connector owes the scheduler: a prefill keeps its blocks while
they are handed on and frees them once the worker says so, also when the request
is aborted meanwhile; a decode waits for its KV, runs on it, and an aborted or
failed load frees its blocks (or recomputes) -- and nothing leaks.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]

with warnings.catch_warnings():  # vLLM's imports warn (deprecations in torch)
    warnings.simplefilter("ignore")
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager


from aiokv.vllm import AiokvHandshake, AiokvMetadata  # noqa: E402

BS = 32
NUM_BLOCKS = 64
P_ADDR = "127.0.0.1:45001"

init_none_hash(sha256)


def make_scheduler(model: str, role: str) -> Scheduler:
    cfg = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="AiokvConnector",
            kv_connector_module_path="aiokv.vllm",
            kv_role=role,
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32),
            )
        ],
    )
    s = Scheduler(
        vllm_config=cfg,
        kv_cache_config=kcc,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BS,
    )
    conn = s.get_kv_connector()
    assert conn is not None
    conn.set_xfer_handshake_metadata({0: AiokvHandshake(P_ADDR, {})})
    return s


@pytest.fixture(scope="module")
def model(tiny_model: str) -> str:
    return tiny_model


def request(rid: str, n: int, max_tokens: int, params: dict[str, Any] | None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if params is not None:
        sp.extra_args = {"kv_transfer_params": params}
    return Request(
        request_id=rid,
        prompt_token_ids=[(i * 7 + len(rid)) % 500 + 3 for i in range(n)],
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def step(
    s: Scheduler,
    *,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    failed: set[str] | None = None,
) -> tuple[Any, AiokvMetadata, dict[str, Any]]:
    """One scheduler step; the model samples token 7 for every request whose prompt
    is done. Returns the scheduler output, the connector metadata and the finished
    requests' kv_transfer_params."""
    so = s.schedule()
    meta = so.kv_connector_metadata
    assert isinstance(meta, AiokvMetadata)
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.requests[rid]
        done = r.num_computed_tokens >= r.num_prompt_tokens  # (after this step's update)
        sampled.append([7] if done else [])
    kvo = None
    if sending or recving or failed:
        kvo = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=(recving or set()) | (failed or set()),
            failed_recving=failed or set(),
        )
    out = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kvo,
    )
    produced: dict[str, Any] = {}
    for eco in s.update_from_output(so, out).values():
        for o in eco.outputs:
            if o.finished:
                produced[o.request_id] = o.kv_transfer_params
    return so, meta, produced


def held_blocks(s: Scheduler) -> int:
    return NUM_BLOCKS - 1 - s.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_empty(s: Scheduler) -> None:
    assert not s.requests and not s.running and not s.waiting
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    assert held_blocks(s) == 0
    assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks)


def remote_params(n_tokens: int, rid: str = "p-1") -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": rid,
        "remote_block_ids": list(range(10, 10 + -(-n_tokens // BS))),
        "remote_num_tokens": n_tokens,
        "aiokv": 1,
        "aiokv_mode": "pull",
        "aiokv_addresses": [P_ADDR],
    }


# ----------------------------------------------------------------------------- prefill


def test_prefill_hands_on_its_prompt_and_frees_the_blocks_once_sent(model: str) -> None:
    s = make_scheduler(model, "kv_producer")
    s.add_request(request("a", 70, 1, {"do_remote_decode": True}))
    so, meta, produced = step(s)
    # the step that computes the prompt hands it on (the worker starts after the forward)
    [spec] = meta.send
    assert spec.req_id == "a" and len(spec.block_ids) == 3 and spec.push_to is None
    assert spec.key.startswith("a@")
    params = produced["a"]
    assert params["remote_request_id"] == "a" and params["remote_num_tokens"] == 70
    assert params["remote_block_ids"] == spec.block_ids
    assert params["aiokv_addresses"] == [P_ADDR] and params["aiokv_mode"] == "pull"
    assert params["aiokv_layerwise"] is False and not spec.layerwise
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 45001)
    # finished, but the blocks stay until the worker reports them sent
    assert held_blocks(s) == 3 and "a" in s.requests
    so, meta, _ = step(s)
    assert "a" in so.finished_req_ids and not meta.send
    assert held_blocks(s) == 3
    step(s, sending={"a"})
    assert_empty(s)


def test_prefill_push_target_from_params_or_request_id(model: str) -> None:
    s = make_scheduler(model, "kv_producer")
    s.add_request(request("a", 40, 1, {"do_remote_decode": True, "aiokv_decode": "10.1.2.3:9000"}))
    s.add_request(request("x___decode_addr_10.9.9.9:7000_y", 40, 1, {"do_remote_decode": True}))
    _, meta, produced = step(s)
    assert {m.req_id: m.push_to for m in meta.send} == {
        "a": "10.1.2.3:9000",
        "x___decode_addr_10.9.9.9:7000_y": "10.9.9.9:7000",
    }
    assert {p["aiokv_mode"] for p in produced.values()} == {"push"}
    # pushed layer by layer, as the forward saves each layer
    assert all(m.layerwise for m in meta.send)
    assert {p["aiokv_layerwise"] for p in produced.values()} == {True}
    step(s, sending={m.req_id for m in meta.send})
    assert_empty(s)


def test_prefill_aborted_while_handed_on_keeps_its_blocks_until_the_worker_lets_go(
    model: str,
) -> None:
    s = make_scheduler(model, "kv_producer")
    s.add_request(request("a", 70, 5, {"do_remote_decode": True}))  # decodes on after the prompt
    _, meta, produced = step(s)
    assert [m.req_id for m in meta.send] == ["a"] and not produced
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert held_blocks(s) == 3  # the worker may be reading them
    _, meta, produced = step(s)
    assert meta.cancel == ["a"] and not produced
    step(s, sending={"a"})
    assert_empty(s)


def test_prefill_aborted_before_its_prompt_ran_frees_at_once(model: str) -> None:
    s = make_scheduler(model, "kv_producer")
    s.add_request(request("a", 70, 1, {"do_remote_decode": True}))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    _, meta, _ = step(s)
    assert not meta.send and not meta.cancel
    assert_empty(s)


# ----------------------------------------------------------------------------- decode


def test_decode_waits_for_its_kv_then_computes_only_the_last_token(model: str) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("d", 70, 3, remote_params(70)))
    so, meta, _ = step(s)
    [spec] = meta.load
    assert spec.req_id == "d" and spec.skip == 0 and spec.n_remote == 3
    assert len(spec.block_ids) == 3 and spec.addresses == [P_ADDR] and spec.mode == "pull"
    assert spec.key.startswith("p-1@")
    assert so.num_scheduled_tokens == {}
    assert s.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, recving={"d"})
    so, meta, _ = step(s)
    assert so.num_scheduled_tokens == {"d": 1} and not meta.load  # loaded once
    while s.requests:
        step(s)
    assert_empty(s)


def test_decode_aborted_while_loading_frees_its_blocks_once_the_worker_lets_go(
    model: str,
) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("d", 70, 3, remote_params(70)))
    step(s)
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert held_blocks(s) == 3  # the load may still write them
    so, _, _ = step(s)
    assert "d" in so.finished_req_ids  # how the worker learns to stop the load
    assert held_blocks(s) == 3
    step(s, recving={"d"})
    assert_empty(s)


def test_a_failed_load_recomputes_the_whole_prompt(model: str) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("d", 70, 2, remote_params(70)))
    step(s)
    step(s, failed={"d"})
    so, meta, _ = step(s)
    assert so.num_scheduled_tokens == {"d": 70} and not meta.load
    while s.requests:
        step(s)
    assert_empty(s)


@pytest.mark.parametrize(
    "bad",
    [
        {"aiokv_addresses": "127.0.0.1:1"},
        {"aiokv_addresses": [P_ADDR, P_ADDR]},  # another tensor-parallel size
        {"remote_num_tokens": 71},  # more than the prompt
        {"remote_block_ids": [1, 2]},  # too few blocks for 70 tokens
        {"remote_request_id": "a#b"},
        {"aiokv_mode": "carrier-pigeon"},
        {"aiokv": None},  # not an aiokv prefill
    ],
)
def test_unusable_params_recompute_at_once(model: str, bad: dict[str, Any]) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("d", 70, 2, remote_params(70) | bad))
    so, meta, _ = step(s)
    assert so.num_scheduled_tokens == {"d": 70} and not meta.load
    while s.requests:
        step(s)
    assert_empty(s)


def test_a_local_prefix_hit_loads_only_the_rest(model: str) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("warm", 70, 1, None))  # same prompt (same length, same rule)
    while s.requests:
        step(s)
    s.add_request(request("wxyz", 70, 2, remote_params(70)))  # len(rid) is the same: same tokens
    _, meta, _ = step(s)
    [spec] = meta.load
    assert spec.skip == 2 and spec.n_remote == 3 and len(spec.block_ids) == 1
    step(s, recving={"wxyz"})
    while s.requests:
        step(s)
    assert_empty(s)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_decode_its_own_cache_serves_declines_what_the_prefill_holds(
    model: str, mode: str
) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("warm", 70, 1, None))  # the cache holds the first two blocks
    while s.requests:
        step(s)
    # the prefill computed those 64 tokens only: this cache holds every one of them
    s.add_request(request("wxyz", 70, 2, remote_params(64) | {"aiokv_mode": mode}))
    so, meta, _ = step(s)
    assert not meta.load and so.num_scheduled_tokens == {"wxyz": 6}
    if mode == "pull":  # a pull prefill holds them for a GET: it is told to let go
        [d] = meta.decline
        assert d.req_id == "wxyz" and d.addresses == [P_ADDR] and d.key.startswith("p-1@")
    else:  # a push prefill let go once it sent them
        assert not meta.decline
    while s.requests:
        _, meta, _ = step(s)
        assert not meta.decline  # once
    assert_empty(s)


def test_a_decode_aborted_before_its_blocks_declines_what_the_prefill_holds(
    model: str,
) -> None:
    s = make_scheduler(model, "kv_consumer")
    s.add_request(request("d", 70, 3, remote_params(70)))
    s.add_request(request("e", 70, 3, remote_params(70) | {"aiokv": None}))  # unusable
    s.finish_requests(["d", "e"], RequestStatus.FINISHED_ABORTED)
    _, meta, _ = step(s)
    assert [d.req_id for d in meta.decline] == ["d"] and not meta.load
    assert meta.decline[0].key.startswith("p-1@")
    _, meta, _ = step(s)
    assert not meta.decline
    assert_empty(s)
