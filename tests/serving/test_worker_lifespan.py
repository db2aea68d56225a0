"""``aiokv.serving.worker_lifespan`` at start-up: registered before the body runs, and
a refusal that no retry fixes fails the start instead of being logged while the worker
serves unregistered. Real router (uvicorn on loopback), real engine.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from test_router import running

import aiokv
from aiokv.serving.lifespan import worker_lifespan
from aiokv.serving.router import RouterConfig, create_app

TOKEN = "worker-lifespan-token-0123456789"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _args(router_url: str, **kw: object) -> dict[str, object]:
    return {
        "router_url": router_url,
        "token": TOKEN,
        "role": "prefill",
        "url": "http://127.0.0.1:8100",
        "model": "m",
        "warm_peers": False,
        **kw,
    }


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("listen", "kw", "status"),
    [
        ("127.0.0.1:0", {"token": "wrong-token-of-enough-length"}, "HTTP 401"),
        ("127.0.0.1:0", {"url": "http://169.254.169.254"}, "HTTP 400"),  # link-local URL
    ],
)
async def test_refused_registration_fails_the_start(
    listen: str, kw: dict[str, object], status: str
) -> None:
    entered = False
    async with running(create_app(RouterConfig(token=TOKEN))) as url:
        with pytest.raises(aiokv.ConfigError, match=f"refused the registration: {status}"):
            async with worker_lifespan(aiokv.EngineConfig(listen=listen), **_args(url, **kw)):
                entered = True
        assert not entered
        async with httpx.AsyncClient(base_url=url) as c:
            listed = await c.get("/instances", headers={"authorization": f"Bearer {TOKEN}"})
        assert listed.json()["instances"] == []


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_wildcard_listen_without_kv_host_registers_a_concrete_address() -> None:
    # the engine announces its outward address, never the wildcard it listens on, so the
    # router's policy (which refuses a wildcard KV address) accepts the registration
    async with running(create_app(RouterConfig(token=TOKEN))) as url:
        async with worker_lifespan(aiokv.EngineConfig(listen="0.0.0.0:0"), **_args(url)) as w:
            reg = w.registration
            assert reg is not None and reg.instance_id is not None
            host = reg.kv_address.rpartition(":")[0]
            assert host not in ("0.0.0.0", "::", "") and reg.kv_address == w.engine.address


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_registered_before_the_body_runs_and_kv_host_names_the_engine() -> None:
    async with running(create_app(RouterConfig(token=TOKEN))) as url:
        async with worker_lifespan(
            aiokv.EngineConfig(listen="0.0.0.0:0"), **_args(url, kv_host="127.0.0.1")
        ) as worker:
            reg = worker.registration
            assert reg is not None and reg.instance_id is not None and reg.registrations == 1
            port = worker.engine.address.rpartition(":")[2]
            assert reg.kv_address == f"127.0.0.1:{port}"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_url_held_by_a_previous_registration_is_retried_not_fatal() -> None:
    # a restarted worker whose old entry is not evicted yet: 409, retried in the background
    async with running(create_app(RouterConfig(token=TOKEN, evict_after=60))) as url:
        async with worker_lifespan(aiokv.EngineConfig(), **_args(url)) as first:
            assert first.registration is not None and first.registration.instance_id
            async with worker_lifespan(aiokv.EngineConfig(), **_args(url)) as second:
                assert second.registration is not None
                assert second.registration.instance_id is None


def test_subpackages_are_reachable_after_import_aiokv() -> None:
    code = (
        "import aiokv; aiokv.serving.PeerWarmer; aiokv.kv.KVConnector; aiokv.serving.router.create_app"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
