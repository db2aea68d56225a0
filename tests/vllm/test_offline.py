"""Two real vLLM engines on CPU, a prefill and a decode, with AiokvConnector.

The decode's output must be token-exact with the prefill engine computing the
whole request alone, and the prompt's KV must have come through aiokv (the
decode's ``num_cached_tokens`` and its connector's counters) -- or, when the
parameters are wrong or the prefill is gone, the decode must recompute and still
be exact. Each module starts two engines (about 20-45 s each here).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import LLMProc, free_port, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BS = 32
MAX_TOKENS = 12


def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def pd(tiny_model: str, procs: list[LLMProc]) -> Iterator[dict[str, Any]]:
    port = free_port()
    # the prefill computes every reference too: no prefix cache, so it always recomputes
    p = LLMProc("prefill", model=tiny_model, role="kv_producer", prefix_caching=False)
    procs.append(p)
    d = LLMProc(
        "decode",
        model=tiny_model,
        role="kv_consumer",
        extra={"listen": f"127.0.0.1:{port}", "timeout": 5},
        failure_policy="recompute",
    )
    procs.append(d)
    p.ready()
    d.ready()
    yield {"p": p, "d": d, "decode_addr": f"127.0.0.1:{port}"}


def reference(p: LLMProc, prompts: list[list[int]]) -> list[list[int]]:
    return [o["tokens"] for o in p.generate(prompts, MAX_TOKENS)]


def prefill(p: LLMProc, prompts: list[list[int]], **extra: Any) -> list[dict[str, Any]]:
    outs = p.generate(prompts, 1, [{"do_remote_decode": True, **extra} for _ in prompts])
    for o in outs:
        assert o["kv_transfer_params"]["do_remote_prefill"] is True
    return [o["kv_transfer_params"] for o in outs]


def test_pull_decode_is_token_exact_and_loads_the_prompt_through_aiokv(pd: dict[str, Any]) -> None:
    p, d = pd["p"], pd["d"]
    prompts = [prompt(1, 77), prompt(2, 64), prompt(3, 5)]  # partial block, whole blocks, < 1 block
    params = prefill(p, prompts)
    assert [x["aiokv_mode"] for x in params] == ["pull"] * 3
    assert [x["remote_num_tokens"] for x in params] == [77, 64, 5]
    assert [len(x["remote_block_ids"]) for x in params] == [3, 2, 1]
    before = d.call(op="state")
    outs = d.generate(prompts, MAX_TOKENS, params)
    assert [o["tokens"] for o in outs] == reference(p, prompts)
    # nothing came from the decode's own prefix cache: the prompts' KV came through aiokv
    assert [o["num_cached_tokens"] for o in outs] == [0, 0, 0]
    after = d.call(op="state")
    assert after["connector"]["loads"] - before["connector"]["loads"] == 3
    assert after["connector"]["blocks_loaded"] - before["connector"]["blocks_loaded"] == 6
    assert after["connector"]["load_failures"] == before["connector"]["load_failures"]
    assert after["requests"] == 0 and after["free_blocks"] == before["free_blocks"]


def test_push_decode_is_token_exact(pd: dict[str, Any]) -> None:
    p, d = pd["p"], pd["d"]
    prompts = [prompt(11, 100), prompt(12, 33)]
    sent = p.call(op="state")["connector"]
    params = prefill(p, prompts, aiokv_decode=pd["decode_addr"])
    assert [x["aiokv_mode"] for x in params] == ["push", "push"]
    assert [x["aiokv_layerwise"] for x in params] == [True, True]
    # each layer (2) of each request left as the forward saved it, none after it
    saved = p.call(op="state")["connector"]
    assert saved["layers_saved"] - sent["layers_saved"] == 2 * 2
    assert saved["layers_saved_after"] == sent["layers_saved_after"]
    before = d.call(op="state")["connector"]
    outs = d.generate(prompts, MAX_TOKENS, params)
    assert [o["tokens"] for o in outs] == reference(p, prompts)
    after = d.call(op="state")["connector"]
    assert after["loads"] - before["loads"] == 2
    assert after["blocks_loaded"] - before["blocks_loaded"] == 4 + 2


@pytest.fixture(scope="module")
def whole(tiny_model: str, procs: list[LLMProc]) -> LLMProc:
    """A prefill that pushes each request whole after the forward (no layer-wise)."""
    p = LLMProc(
        "prefill-whole",
        model=tiny_model,
        role="kv_producer",
        prefix_caching=False,
        extra={"layerwise": False},
    )
    procs.append(p)
    p.ready()
    return p


def test_push_without_layerwise_sends_the_request_whole_after_the_forward(
    whole: LLMProc, pd: dict[str, Any]
) -> None:
    p, d = whole, pd["d"]
    prompts = [prompt(13, 70), prompt(14, 20)]
    params = prefill(p, prompts, aiokv_decode=pd["decode_addr"])
    assert [(x["aiokv_mode"], x["aiokv_layerwise"]) for x in params] == [("push", False)] * 2
    assert p.call(op="state")["connector"]["layers_saved"] == 0
    before = d.call(op="state")["connector"]
    outs = d.generate(prompts, MAX_TOKENS, params)
    assert [o["tokens"] for o in outs] == reference(pd["p"], prompts)
    after = d.call(op="state")["connector"]
    assert after["loads"] - before["loads"] == 2
    assert after["blocks_loaded"] - before["blocks_loaded"] == 3 + 1


def test_a_step_of_whole_pushes_loads_token_exact_as_one_batch(
    whole: LLMProc, pd: dict[str, Any]
) -> None:
    p, d = whole, pd["d"]
    prompts = [prompt(71, 70), prompt(72, 40), prompt(73, 100), prompt(74, 33)]
    sent = p.call(op="state")["connector"]
    params = prefill(p, prompts, aiokv_decode=pd["decode_addr"])
    # the prefill computed the four prompts in one step: one batch, each in its place
    assert len({tuple(x["aiokv_batch"]) for x in params}) == 1
    assert [x["aiokv_batch_index"] for x in params] == [0, 1, 2, 3]
    # counted once the decode's engine held the batch (asynchronously: the prefill
    # answered when its forward was done)
    assert wait_until(lambda: p.call(op="state")["connector"]["sends"] - sent["sends"] == 4, 10)
    assert p.call(op="state")["connector"]["batches_sent"] - sent["batches_sent"] == 1
    before = d.call(op="state")
    outs = d.generate(prompts, MAX_TOKENS, params)
    assert [o["tokens"] for o in outs] == reference(pd["p"], prompts)
    assert [o["num_cached_tokens"] for o in outs] == [0, 0, 0, 0]
    after = d.call(op="state")
    c0, c1 = before["connector"], after["connector"]
    assert c1["batches_received"] - c0["batches_received"] == 1
    assert c1["loads"] - c0["loads"] == 4
    assert c1["blocks_loaded"] - c0["blocks_loaded"] == 3 + 2 + 4 + 2
    assert c1["load_failures"] == c0["load_failures"]
    assert after["requests"] == 0 and after["free_blocks"] == before["free_blocks"]


def test_a_bad_request_of_a_batch_recomputes_alone_while_the_others_load(
    whole: LLMProc, pd: dict[str, Any]
) -> None:
    p, d = whole, pd["d"]
    prompts = [prompt(81, 70), prompt(82, 40), prompt(83, 100), prompt(84, 33)]
    params = prefill(p, prompts, aiokv_decode=pd["decode_addr"])
    assert len({tuple(x["aiokv_batch"]) for x in params}) == 1
    # the decode's third prompt differs from the prefill's in its last token
    asked = [*prompts]
    asked[2] = [*prompts[2][:-1], (prompts[2][-1] + 1) % 500 + 3]
    before = d.call(op="state")
    outs = d.generate(asked, MAX_TOKENS, params)
    assert [o["tokens"] for o in outs] == reference(pd["p"], asked)
    after = d.call(op="state")
    c0, c1 = before["connector"], after["connector"]
    assert c1["batches_received"] - c0["batches_received"] == 1
    assert c1["loads"] - c0["loads"] == 3
    assert c1["blocks_loaded"] - c0["blocks_loaded"] == 3 + 2 + 2
    assert c1["load_failures"] - c0["load_failures"] == 1
    assert after["requests"] == 0 and after["free_blocks"] == before["free_blocks"]


def test_a_local_prefix_hit_loads_only_the_blocks_past_it(pd: dict[str, Any]) -> None:
    p, d = pd["p"], pd["d"]
    x = prompt(21, 77)
    # the decode computes a prompt sharing x's first two blocks: its prefix cache holds them
    d.generate([x[:64] + prompt(22, 10)], 1)
    [params] = prefill(p, [x])
    before = d.call(op="state")["connector"]
    [out] = d.generate([x], MAX_TOKENS, [params])
    assert out["tokens"] == reference(p, [x])[0]
    after = d.call(op="state")["connector"]
    assert after["loads"] - before["loads"] == 1
    assert after["blocks_loaded"] - before["blocks_loaded"] == 1  # the third block only


def test_wrong_params_recompute_and_never_load_other_tokens(pd: dict[str, Any]) -> None:
    p, d = pd["p"], pd["d"]
    a, b = prompt(31, 70), prompt(32, 70)
    pa, pb = prefill(p, [a, b])
    a2 = [*a[:-1], (a[-1] + 1) % 500 + 3]  # the prompt of a, but for its last token
    garbage = {"do_remote_prefill": True, "aiokv": 1, "aiokv_addresses": "127.0.0.1:1"}
    foreign = {k: v for k, v in pa.items() if not k.startswith("aiokv")}  # not an aiokv prefill
    before = d.call(op="state")
    outs = d.generate([a, a2, a, a], MAX_TOKENS, [pb, pa, garbage, foreign])
    ref = reference(p, [a, a2])
    assert [o["tokens"] for o in outs] == [ref[0], ref[1], ref[0], ref[0]]
    after = d.call(op="state")
    # b's and a's KV were asked for under this side's own prompts: nothing matched
    assert after["connector"]["loads"] == before["connector"]["loads"]
    assert after["connector"]["load_failures"] - before["connector"]["load_failures"] == 2
    assert after["requests"] == 0 and after["free_blocks"] == before["free_blocks"]
    # the wrong attempts took nothing away: b and a still load with their own params
    outs = d.generate([b, a], MAX_TOKENS, [pb, pa])
    assert [o["tokens"] for o in outs] == reference(p, [b, a])
    assert d.call(op="state")["connector"]["loads"] - after["connector"]["loads"] == 2


def test_an_aborted_load_stops_and_frees_its_blocks(pd: dict[str, Any]) -> None:
    d = pd["d"]
    x = prompt(41, 90)
    # a "prefill" that accepts the connection and never answers: the load hangs
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        addr = f"127.0.0.1:{hole.getsockname()[1]}"
        params = {
            "do_remote_prefill": True,
            "remote_request_id": "nobody",
            "remote_block_ids": [0, 1, 2],
            "remote_num_tokens": 90,
            "aiokv": 1,
            "aiokv_mode": "pull",
            "aiokv_addresses": [addr],
        }
        before = d.call(op="state")
        r = d.call(
            timeout=60, op="abort_while_loading", prompt=x, params=params, max_tokens=4, after=1.0
        )
    assert r["held_while_loading"] == 1
    assert r["drain_seconds"] < 3  # stopped at the abort, not at the 5 s timeout
    st = r["state"]
    assert st["requests"] == 0 and st["free_blocks"] == before["free_blocks"]
    assert st["connector"]["loads_cancelled"] - before["connector"]["loads_cancelled"] == 1
    # the engine goes on serving
    assert d.generate([x], 4)[0]["tokens"] == pd["p"].generate([x], 4)[0]["tokens"]


def test_a_decode_its_own_cache_serves_frees_the_prefill_blocks_at_once(pd: dict[str, Any]) -> None:
    p, d = pd["p"], pd["d"]
    x = prompt(61, 64)  # two whole blocks: all the prefill computes
    # the decode computes a prompt starting with x: its prefix cache holds x's blocks
    d.generate([x + prompt(62, 20)], 1)
    base = p.call(op="state")
    [params] = prefill(p, [x])
    assert p.call(op="state")["free_blocks"] == base["free_blocks"] - 2  # held for the decode
    y = x + prompt(63, 30)  # the decode's prompt: x, then more
    before = d.call(op="state")["connector"]
    [out] = d.generate([y], MAX_TOKENS, [params])
    after = d.call(op="state")["connector"]
    assert after["loads"] == before["loads"]  # x came from its own cache: nothing to load
    # the prefill frees x's blocks now, not when its lease (120 s) ends
    st = p.call(op="step_until_free", free=base["free_blocks"], seconds=10)
    assert st["free_blocks"] == base["free_blocks"] and st["requests"] == 0
    assert st["seconds"] < 5
    # the decode's decline (asynchronous: counted once the prefill answered it)
    assert wait_until(
        lambda: d.call(op="state")["connector"]["declines"] - before["declines"] == 1, 5
    )
    assert st["connector"]["sends_declined"] - base["connector"]["sends_declined"] == 1
    assert out["tokens"] == reference(p, [y])[0]


def test_a_dead_prefill_means_recompute(pd: dict[str, Any]) -> None:
    """Last in the module: it kills the prefill."""
    p, d = pd["p"], pd["d"]
    x = prompt(51, 80)
    ref = reference(p, [x])
    [params] = prefill(p, [x])
    p.kill()
    before = d.call(op="state")
    [out] = d.generate([x], MAX_TOKENS, [params], timeout=60)
    assert out["tokens"] == ref[0]
    after = d.call(op="state")
    assert after["connector"]["load_failures"] - before["connector"]["load_failures"] == 1
    assert after["requests"] == 0 and after["free_blocks"] == before["free_blocks"]
