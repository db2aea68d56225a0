"""Engines on wildcard addresses: what they announce, and GETs answered over the session
the producer already has to the consumer; docs/serving.md's recipe (router and two
workers on 0.0.0.0) run as written, through the official ``openai`` client."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from support.procs import free_port

import aiokv
from aiokv.serving.demo.model import TinyTransformer, chat_prompt, tokenize
from aiokv.serving.demo.worker import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _loopback(address: str) -> str:
    return "127.0.0.1:" + address.rpartition(":")[2]


def test_advertise_is_checked() -> None:
    for bad in ("0.0.0.0", "::", "[::]", "", "host:80", "a b"):
        with pytest.raises(aiokv.ConfigError):
            aiokv.EngineConfig(listen="0.0.0.0:0", advertise=bad)
    assert aiokv.EngineConfig(advertise="10.1.2.3").advertise == "10.1.2.3"
    assert aiokv.EngineConfig(advertise="fd00::7").advertise == "fd00::7"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_wildcard_engine_announces_a_concrete_address() -> None:
    async with aiokv.Engine(aiokv.EngineConfig(listen="0.0.0.0:0")) as e:
        host = e.address.rpartition(":")[0].strip("[]")
        assert not ipaddress.ip_address(host).is_unspecified, e.address
    async with aiokv.Engine(aiokv.EngineConfig(listen="0.0.0.0:0", advertise="127.0.0.1")) as e:
        assert e.address.startswith("127.0.0.1:"), e.address
        assert e.statistics().address == e.address


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_get_reply_reuses_the_producers_session_to_the_consumer() -> None:
    """The producer already has a session to the consumer (opened by another alias of
    its address, as a warmer does); the consumer's GET is answered over that session,
    not a second one that would get a private identity there (the tensor would land
    and never be delivered)."""
    cfg = aiokv.EngineConfig(listen="0.0.0.0:0", limits=aiokv.Limits(ttl=5))
    async with aiokv.Engine(cfg) as prod, aiokv.Engine(cfg) as cons:
        await prod.connect(_loopback(cons.address))
        for i in range(3):
            prod.publish(f"t{i}", torch.arange(4.0) + i)
            got = await cons.get(f"t{i}", frm=_loopback(prod.address), timeout=3)
            assert torch.equal(got, torch.arange(4.0) + i)
        st = cons.statistics()
        assert st.store is not None and st.store.held_tensors == 0
        assert st.server_sessions == 1  # the producer's one session
        assert st.protocol_errors.get("identity_in_use", 0) == 0


# -- docs/serving.md's recipe, as written ----------------------------------------------


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


@contextlib.contextmanager
def _recipe(tmp: Path) -> Iterator[str]:
    """``aiokv router --host 0.0.0.0`` and a prefill and a decode worker with ``--host
    0.0.0.0 --advertise-host 127.0.0.1``, registering with a token; the router's URL."""
    env = {
        **os.environ,
        "AIOKV_ROUTER_TOKEN": "recipe-token-0123456789abcdef",
        "PYTHONPATH": str(ROOT),
    }
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    py = sys.executable
    procs = [
        _spawn(
            [py, "-m", "aiokv", "router", "--host", "0.0.0.0", "--port", str(port)],
            tmp / "router.log",
            env,
        )
    ]
    try:
        for role in ("prefill", "decode"):
            procs.append(
                _spawn(
                    [
                        *(py, "-m", "aiokv.serving.demo.worker", "--role", role, "--router", router),
                        *("--host", "0.0.0.0", "--advertise-host", "127.0.0.1"),
                    ],
                    tmp / f"{role}.log",
                    env,
                )
            )
        deadline = time.monotonic() + 90
        while True:
            for p in procs:
                assert p.poll() is None, "a process of the recipe exited: " + "".join(
                    (tmp / f).read_text() for f in ("router.log", "prefill.log", "decode.log")
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(router + "/healthz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the recipe did not become ready"
            time.sleep(0.2)
        yield router
    finally:
        _stop(procs)


@pytest.mark.timeout(150)
def test_serving_recipe_with_the_openai_client(tmp_path: Path) -> None:
    model = TinyTransformer()
    with _recipe(tmp_path) as router:
        client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=20)
        prompt = "Every real deployment listens on a wildcard."
        want = model.generate(tokenize(prompt), 8)
        r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=8)
        assert r.model_extra is not None
        assert r.choices[0].model_extra is not None
        assert r.choices[0].model_extra["token_ids"] == want
        assert r.usage is not None and r.usage.completion_tokens == 8

        got: list[int] = []
        for chunk in client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=8, stream=True
        ):
            assert chunk.choices[0].model_extra is not None
            got += chunk.choices[0].model_extra["token_ids"]
        assert got == want

        messages = [{"role": "user", "content": "and the KV still moves"}]
        want_chat = model.generate(tokenize(chat_prompt(messages)), 6)
        c = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
        )
        assert c.choices[0].model_extra is not None
        assert c.choices[0].model_extra["token_ids"] == want_chat
        assert c.choices[0].message.content

        got = []
        text = ""
        for ch in client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
        ):
            assert ch.choices[0].model_extra is not None
            got += ch.choices[0].model_extra["token_ids"]
            text += ch.choices[0].delta.content or ""
        assert got == want_chat and text == c.choices[0].message.content

        # the engines announced the advertised host, never 0.0.0.0
        listing = httpx.get(
            router + "/instances",
            headers={"Authorization": "Bearer recipe-token-0123456789abcdef"},
            timeout=5,
        ).json()["instances"]
        kv_hosts = {i["kv_address"].rsplit(":", 1)[0] for i in listing}
        assert len(listing) == 2 and kv_hosts == {"127.0.0.1"}, listing
