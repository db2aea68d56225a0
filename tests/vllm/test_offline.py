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
from conftest import LLMProc, free_port

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
