"""Online: two vLLM OpenAI servers with AiokvConnector and ``aiokv router`` in front.

The prefill server (``kv_producer``) and the decode server (``kv_consumer``) are
started as docs/vllm.md's recipe starts them (``python -m
vllm.entrypoints.openai.api_server``), the router as ``python -m aiokv router``, and
a client with the ``openai`` package asks the router. Every completion must equal,
token for token, the one a single server computes alone (greedy), and the decode
server's Prometheus counters (``vllm:prompt_tokens_by_source``) must show that
the prompt came through the connector, not computed there. (Its
``usage.prompt_tokens_details.cached_tokens`` counts local prefix-cache hits only:
vLLM leaves KV loaded asynchronously by a connector out of it.) The servers' output goes to files, attached to a failing test's report.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import REPO, Server, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

MODEL = "tiny"
MAX_TOKENS = 12
START_TIMEOUT = 180.0  # both vLLM servers start at once (about 25 s each on an idle 2-core host)


def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 500) for _ in range(n)]


def vllm_server_argv(model: str, port: int, kv: dict[str, Any], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(16 << 20),
        "--seed",
        "0",
        "--disable-uvicorn-access-log",
        "--kv-transfer-config",
        json.dumps(kv),
        *extra,
    ]


def wait_serving(server: Server, url: str, deadline: float) -> None:
    """Until ``GET url`` answers 200; fails at once when the server exited."""
    while True:
        if not server.alive():
            raise server.fail(f"exited with {server.proc.returncode} before serving")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise server.fail(f"not serving {url} after {START_TIMEOUT:.0f} s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("online-logs")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        # vLLM's CPU worker pins its threads ("auto": the first cores); two servers on
        # one host then share core 0, where a prefill's worker steps without pause
        # while it holds KV for its decode, and the decode's worker and aiokv thread
        # pinned to the same core starve (its loads time out connecting)
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONWARNINGS="ignore",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    kv = {"kv_connector": "AiokvConnector", "kv_connector_module_path": "aiokv.vllm"}
    p_port, d_port = free_port(), free_port()
    servers: list[Server] = []
    try:
        # the prefill also computes the references: no prefix cache, it always computes
        prefill = Server(
            "prefill",
            vllm_server_argv(
                tiny_model,
                p_port,
                {**kv, "kv_role": "kv_producer"},
                "--no-enable-prefix-caching",
            ),
            logs,
            env,
        )
        servers.append(prefill)
        decode = Server(
            "decode",
            vllm_server_argv(
                tiny_model,
                d_port,
                {**kv, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"},
            ),
            logs,
            env,
        )
        servers.append(decode)
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        ready_file = logs / "router.url"
        router = Server(
            "router",
            [
                sys.executable,
                "-m",
                "aiokv",
                "router",
                "--port",
                "0",
                "--prefill",
                p_url,
                "--decode",
                d_url,
                "--ready-file",
                str(ready_file),
            ],
            logs,
            env,
        )
        servers.append(router)
        deadline = time.monotonic() + START_TIMEOUT
        wait_serving(prefill, p_url + "/v1/models", deadline)
        wait_serving(decode, d_url + "/v1/models", deadline)
        while not ready_file.exists():
            if not router.alive() or time.monotonic() > deadline:
                raise router.fail("did not write its ready file")
            time.sleep(0.1)
        r_url = ready_file.read_text().strip()
        # ready once its probes found both workers healthy
        while True:
            h = httpx.get(r_url + "/healthz", timeout=2.0).json()
            if h.get("ready") and MODEL in h.get("models", ()):
                break
            if time.monotonic() > deadline:
                raise router.fail(f"not ready: {h}")
            time.sleep(0.2)
        yield {"prefill": p_url, "decode": d_url, "router": r_url, "servers": servers}
    finally:
        for s in servers:
            s.kill()


def client(base: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def complete(base: str, ids: list[int], **extra: Any) -> Any:
    return client(base).completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )


def tokens(c: Any) -> list[int]:
    [choice] = c.choices
    ids = (choice.model_extra or {}).get("token_ids")
    assert isinstance(ids, list) and len(ids) == MAX_TOKENS, choice
    return ids


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$")


def prompt_tokens_by_source(base: str) -> dict[str, float]:
    """The server's ``vllm:prompt_tokens_by_source_total`` by source."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10.0).text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == "vllm:prompt_tokens_by_source_total":
            src = re.search(r'source="([a-z_]+)"', m.group(2))
            assert src is not None, line
            out[src.group(1)] = out.get(src.group(1), 0.0) + float(m.group(3))
    assert set(out) >= {"local_compute", "local_cache_hit", "external_kv_transfer"}, out
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def test_completions_through_the_router_are_token_exact_and_the_decode_loads_the_prompt(
    cluster: dict[str, Any],
) -> None:
    prompts = [prompt(1, 77), prompt(2, 64), prompt(3, 5)]  # partial block, whole blocks, < 1
    # the single-server result: the prefill server computes each request alone
    ref = [tokens(complete(cluster["prefill"], x)) for x in prompts]
    before = prompt_tokens_by_source(cluster["decode"])
    for x, want in zip(prompts, ref):
        c = complete(cluster["router"], x)
        assert tokens(c) == want
        assert c.usage.prompt_tokens == len(x)
    got = delta(prompt_tokens_by_source(cluster["decode"]), before)
    # ... from the connector: nothing computed, nothing from its own prefix cache
    assert got == {
        "external_kv_transfer": sum(map(len, prompts)),
        "local_compute": 0,
        "local_cache_hit": 0,
    }
    # the decode server alone (a salt keeps its prefix cache out) computes the same
    before = prompt_tokens_by_source(cluster["decode"])
    for i, (x, want) in enumerate(zip(prompts, ref)):
        assert tokens(complete(cluster["decode"], x, cache_salt=f"alone-{i}")) == want
    got = delta(prompt_tokens_by_source(cluster["decode"]), before)
    assert got["local_compute"] == sum(map(len, prompts)) and got["external_kv_transfer"] == 0


def test_streamed_and_concurrent_completions_through_the_router_are_token_exact(
    cluster: dict[str, Any],
) -> None:
    from openai import AsyncOpenAI

    prompts = [prompt(10 + i, n) for i, n in enumerate((40, 96, 33, 70))]
    ref = [tokens(complete(cluster["prefill"], x)) for x in prompts]
    before = prompt_tokens_by_source(cluster["decode"])

    async def stream(c: AsyncOpenAI, x: list[int]) -> list[int]:
        out: list[int] = []
        s = await c.completions.create(
            model=MODEL,
            prompt=x,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        async for chunk in s:
            for choice in chunk.choices:
                out += (choice.model_extra or {}).get("token_ids") or []
        return out

    async def main() -> list[list[int]]:
        c = AsyncOpenAI(
            base_url=cluster["router"] + "/v1", api_key="unused", max_retries=0, timeout=60.0
        )
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(stream(c, x) for x in prompts)), timeout=120
            )
        finally:
            await c.close()

    assert asyncio.run(main()) == ref
    got = delta(prompt_tokens_by_source(cluster["decode"]), before)
    assert got == {
        "external_kv_transfer": sum(map(len, prompts)),
        "local_compute": 0,
        "local_cache_hit": 0,
    }
