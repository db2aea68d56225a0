"""The router probed from outside: who may register, which addresses it takes,
and what a hostile request costs it. Every test runs real uvicorn servers on
loopback (one uses an in-memory transport to pose as a remote client).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from test_router import MODEL, FakeWorker, cluster, completion, running

from aiokv.serving.lifespan import WorkerRegistration, register_with_router
from aiokv.serving.router import RouterConfig, create_app

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def reg_body(
    url: str, kv: str = "127.0.0.1:7000", role: str = "decode", **kw: Any
) -> dict[str, Any]:
    return {"role": role, "url": url, "kv_address": kv, "model": MODEL, **kw}


@contextlib.asynccontextmanager
async def router(config: RouterConfig) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    async with running(create_app(config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield url, client


# -- who may register ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_token_guards_registration_and_instance_list() -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with router(RouterConfig(token=TOKEN)) as (_, client):
        for headers in (
            {},
            {"authorization": "Bearer wrong-token-wrong-token"},
            {"authorization": TOKEN},
        ):
            r = await client.post(
                "/register", json=reg_body("http://127.0.0.1:9001"), headers=headers
            )
            assert r.status_code == 401, r.text
            assert r.headers["www-authenticate"] == "Bearer"
            assert (await client.get("/instances", headers=headers)).status_code == 401
        r = await client.post("/register", json=reg_body("http://127.0.0.1:9001"), headers=auth)
        assert r.status_code == 200, r.text
        ident = {k: r.json()[k] for k in ("instance_id", "instance_secret")}
        # heartbeat and deregister need the token too, and then the instance's secret
        assert (await client.post("/heartbeat", json=ident)).status_code == 401
        assert (await client.post("/deregister", json=ident)).status_code == 401
        stolen = {"instance_id": ident["instance_id"], "instance_secret": "guess"}
        assert (await client.post("/deregister", json=stolen, headers=auth)).status_code == 403
        assert (await client.post("/heartbeat", json=stolen, headers=auth)).status_code == 403
        assert (await client.post("/heartbeat", json=ident, headers=auth)).status_code == 200
        listed = (await client.get("/instances", headers=auth)).json()["instances"]
        assert [i["instance_id"] for i in listed] == [ident["instance_id"]]
        assert "instance_secret" not in json.dumps(listed) and ident[
            "instance_secret"
        ] not in json.dumps(listed)
        assert (await client.post("/deregister", json=ident, headers=auth)).json() == {"ok": True}


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_worker_helper_uses_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOKV_ROUTER_TOKEN", TOKEN)
    async with router(RouterConfig(token=TOKEN)) as (url, _client):
        reg = WorkerRegistration(url, "decode", "http://127.0.0.1:9002", "127.0.0.1:7", MODEL, 0.1)
        task = asyncio.create_task(register_with_router(reg))
        try:
            await asyncio.wait_for(reg.registered.wait(), 5)
            while reg.heartbeats < 2:
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert reg.instance_secret


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_without_token_only_loopback_may_register(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiokv.serving.router")
    app = create_app(RouterConfig())
    async with running(app):  # the start-up says registration is loopback-only
        pass
    assert any("loopback" in r.getMessage() and "token" in r.getMessage() for r in caplog.records)
    for i, (host, status) in enumerate(
        (("203.0.113.9", 403), ("10.1.2.3", 403), ("127.0.0.1", 200), ("::1", 200))
    ):
        transport = httpx.ASGITransport(app=app, client=(host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.post("/register", json=reg_body(f"http://127.0.0.1:{9100 + i}"))
            assert r.status_code == status, (host, r.text)
            assert (await c.get("/instances")).status_code == status
            if status == 403:
                assert "--token" in r.json()["error"]["message"]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_identity_of_a_registered_url_cannot_be_taken_over() -> None:
    legit = FakeWorker("decode", "legit", "127.0.0.1:6100")
    p = FakeWorker("prefill", "p", "127.0.0.1:6200")
    async with cluster(RouterConfig(), [p, legit]) as (_, client, urls):
        d_url = urls[1]
        # a rogue local process re-registers the decode's URL: new KV address, other model, other role
        for body in (
            reg_body(d_url, kv="127.0.0.1:6666"),
            reg_body(d_url, kv="127.0.0.1:6100") | {"model": "other"},
            reg_body(d_url, kv="127.0.0.1:6666", role="prefill"),
            reg_body(d_url, kv="127.0.0.1:6666", instance_secret="guessed"),
        ):
            r = await client.post("/register", json=body)
            assert r.status_code == 409, r.text
        inst = [
            i for i in (await client.get("/instances")).json()["instances"] if i["url"] == d_url
        ]
        assert len(inst) == 1
        assert inst[0]["kv_address"] == "127.0.0.1:6100" and inst[0]["model"] == MODEL
        # nor can it deregister the worker by id
        r = await client.post("/deregister", json={"instance_id": inst[0]["instance_id"]})
        assert r.status_code == 403
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 200 and r.json()["served_by"] == "legit"
        assert legit.calls[-1]["kv_transfer_params"]["remote_host"] == "127.0.0.1"


# -- the URL policy -------------------------------------------------------------------------

HOSTILE_URLS = [
    "http://169.254.169.254",
    "http://169.254.169.254/latest/meta-data/",
    "http://metadata.google.internal",
    "http://metadata.google.internal./computeMetadata/v1/",
    "http://100.100.100.200",
    "http://[fe80::1]:80",
    "http://[::ffff:169.254.169.254]:80",
    "http://[fd00:ec2::254]",
    "http://x y:80",
    "http://x%20y:80",
    "http://user:pw@127.0.0.1:9",
    "http://127.0.0.1:9/v1/internal?x=1",
    "http://127.0.0.1:9?x=1",
    "http://127.0.0.1:9#frag",
    "gopher://127.0.0.1:9",
    "file:///etc/passwd",
    "http://0.0.0.0:9",
    "http://224.0.0.1:9",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://\\127.0.0.1:9",
    "http://127.0.0.1:9\n",
]
HOSTILE_KV = [
    "169.254.169.254:80",
    "metadata.google.internal:80",
    "[fe80::1]:5",
    "x y:80",
    "127.0.0.1",
    "127.0.0.1:0",
    "127.0.0.1:70000",
    "::1:5",
    "0.0.0.0:5",
    "a/b:5",
]


def test_url_policy_unit() -> None:
    from aiokv.serving.router import UrlPolicy, UrlPolicyError

    pol = UrlPolicy()
    for url in HOSTILE_URLS:
        with pytest.raises(UrlPolicyError):
            pol.check_url(url)
    for kv in HOSTILE_KV:
        with pytest.raises(UrlPolicyError):
            pol.check_kv_address(kv)
    assert pol.check_url("http://127.0.0.1:9/") == "http://127.0.0.1:9"
    assert pol.check_url("https://Worker-1.example.com") == "https://worker-1.example.com:443"
    assert pol.check_url("http://[::1]:8000") == "http://[::1]:8000"
    assert pol.check_kv_address("[::1]:5") == "[::1]:5"
    assert pol.check_kv_address("gpu-node-3:5555") == "gpu-node-3:5555"
    # the router's own address, also through a loopback name when it listens on a wildcard
    with pytest.raises(UrlPolicyError, match="own"):
        pol.check_url("http://127.0.0.1:8000", own=("127.0.0.1", 8000))
    with pytest.raises(UrlPolicyError, match="own"):
        pol.check_url("http://localhost:8000", own=("0.0.0.0", 8000))
    assert pol.check_url("http://127.0.0.1:8001", own=("127.0.0.1", 8000))
    # numeric aliases of an address are that address, for every rule
    for alias in ("127.1", "0x7f000001", "2130706433", "0177.0.0.1", "0x7f.1", "127.0.1"):
        with pytest.raises(UrlPolicyError, match="own"):
            pol.check_url(f"http://{alias}:8000", own=("127.0.0.1", 8000))
        with pytest.raises(UrlPolicyError, match="own"):
            pol.check_url(f"http://{alias}:8000", own=("0.0.0.0", 8000))
    assert pol.check_url("http://0x7f000001:8001") == "http://127.0.0.1:8001"
    assert pol.check_kv_address("2130706433:5") == "127.0.0.1:5"
    for alias in ("0", "0x0", "0xa9fea9fe", "2852039166", "169.254.43518", "0xffffffff"):
        with pytest.raises(UrlPolicyError):
            pol.check_url(f"http://{alias}:80")
    assert pol.check_url("http://0x-node:80") == "http://0x-node:80"  # a name, not a number
    # link-local only when asked for
    open_pol = UrlPolicy(allow_link_local=True)
    assert open_pol.check_url("http://169.254.1.2:80") == "http://169.254.1.2:80"
    assert open_pol.check_kv_address("[fe80::1]:5") == "[fe80::1]:5"
    with pytest.raises(UrlPolicyError):
        open_pol.check_url("http://0.0.0.0:80")


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_hostile_addresses_are_refused_at_registration() -> None:
    async with router(RouterConfig()) as (url, client):
        aliases = [url.replace("127.0.0.1", h) for h in ("localhost", "127.1", "0x7f000001")]
        for bad in [*HOSTILE_URLS, url, *aliases, url.replace("127.0.0.1", "2130706433")]:
            r = await client.post("/register", json=reg_body(bad))
            assert r.status_code == 400, (bad, r.text)
            assert len(r.content) < 1024
        for bad in HOSTILE_KV:
            r = await client.post("/register", json=reg_body("http://127.0.0.1:9", kv=bad))
            assert r.status_code == 400, (bad, r.text)
        assert (await client.get("/instances")).json()["instances"] == []
    async with router(RouterConfig(allow_link_local=True)) as (_, client):
        r = await client.post(
            "/register", json=reg_body("http://169.254.10.10:80", kv="169.254.10.10:9")
        )
        assert r.status_code == 200, r.text


def _bouncer(target: str) -> FastAPI:
    """A worker stand-in that forwards requests back to the router (a loop the URL
    policy cannot see: the bouncer's own address is a fine worker URL)."""
    app = FastAPI()

    async def bounce(request: Request) -> Response:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(
                target + request.url.path,
                content=await request.body(),
                headers=dict(request.headers),
            )
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    app.add_api_route("/v1/completions", bounce, methods=["POST"])
    return app


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_request_loop_through_the_router_ends_at_once() -> None:
    async with router(RouterConfig(max_attempts=2)) as (url, client):
        async with running(_bouncer(url)) as bouncer_url:
            # one server in both roles: the second registration proves it is the same worker
            secret: dict[str, str] = {}
            for role, kv in (("prefill", "127.0.0.1:7001"), ("decode", "127.0.0.1:7002")):
                r = await client.post(
                    "/register", json=reg_body(bouncer_url, kv=kv, role=role, **secret)
                )
                assert r.status_code == 200, r.text
                secret = {"instance_secret": r.json().get("instance_secret", "")}
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json=completion(), timeout=5)
            assert time.monotonic() - t0 < 3
            assert r.status_code == 502, r.text
            assert "HTTP 508" in r.json()["error"]["message"]
            # a request that already went through 8 routers is refused as well
            hops = ",".join(f"hop{i}" for i in range(8))
            r = await client.post(
                "/v1/completions", json=completion(), headers={"x-aiokv-router-hop": hops}
            )
            assert r.status_code == 508


# -- bounded --------------------------------------------------------------------------------


async def _post_raw(port: int, head: bytes, chunks: int, chunk: bytes) -> tuple[int, int]:
    """Send a request body chunk by chunk; return (status, body bytes written when the
    response arrived). Stops writing as soon as any response bytes are readable."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    written = 0
    try:
        writer.write(head)
        await writer.drain()
        read = asyncio.create_task(reader.readline())
        for _ in range(chunks):
            if read.done():
                break
            try:
                writer.write(chunk)
                await writer.drain()
            except (ConnectionError, OSError):
                break
            written += len(chunk)
            await asyncio.sleep(0)
        line = await asyncio.wait_for(read, 30)
        return int(line.split()[1]), written
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_body_limit_is_enforced_while_reading() -> None:
    limit = 1 << 20
    async with router(RouterConfig(max_body_bytes=limit)) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        total_chunks, chunk = 512, b"x" * 65536  # 32 MiB offered
        # chunked transfer encoding: the size is known only while reading
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
        status, written = await _post_raw(port, head, total_chunks, framed)
        assert status == 413
        assert written < 8 * limit, f"{written} bytes were read before the 413"
        # a declared Content-Length above the limit is refused before any body byte is read
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (total_chunks * len(chunk))
        )
        status, written = await _post_raw(port, head, total_chunks, chunk)
        assert status == 413
        assert written < 8 * limit


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_hostile_json_gets_400_never_500() -> None:
    workers = [FakeWorker("prefill", "p"), FakeWorker("decode", "d")]
    async with cluster(RouterConfig(), workers) as (_, client, _u):
        bodies: list[bytes] = [
            b"[" * 100_000 + b"]" * 100_000,
            b'{"model": "%s", "prompt": "x", "x": ' % MODEL.encode()
            + b"[" * 5000
            + b"]" * 5000
            + b"}",
            b'{"model": "%s", "prompt": "x", "max_tokens": 1%s}' % (MODEL.encode(), b"0" * 5000),
            b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000),
            b'{"model": "%s", "prompt": "x", "max_tokens": 99999999999999999999999999999999}'
            % MODEL.encode(),
            b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
            b'{"model": "%s", "prompt": "x", "n": Infinity}' % MODEL.encode(),
            json.dumps({"model": MODEL, "prompt": "x", "deep": nested(80)}).encode(),
            b'{"model": "\xff"}',
        ]
        for body in bodies:
            r = await client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (body[:60], r.status_code, r.text[:200])
            assert len(r.content) < 1024
        for path in ("/register", "/heartbeat", "/deregister"):
            r = await client.post(
                path, content=b"[" * 50_000, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (path, r.text[:200])
        assert (await client.post("/v1/completions", json=completion())).status_code == 200


def nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = {"a": v}
    return v


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_error_bodies_stay_short_however_many_models() -> None:
    async with router(RouterConfig()) as (_, client):
        for i in range(200):
            body = reg_body(f"http://127.0.0.1:{20000 + i}") | {"model": f"m{i:03d}-" + "x" * 200}
            assert (await client.post("/register", json=body)).status_code == 200
        r = await client.post(
            "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}
        )
        assert r.status_code == 404
        assert len(r.content) < 512, len(r.content)
        r = await client.post(
            "/v1/completions", json={"model": "n" * 100_000, "prompt": "x", "max_tokens": 1}
        )
        assert r.status_code == 400 and len(r.content) < 512
        # registrations are bounded too
    async with router(RouterConfig(max_instances=3)) as (_, client):
        codes = [
            (
                await client.post("/register", json=reg_body(f"http://127.0.0.1:{21000 + i}"))
            ).status_code
            for i in range(5)
        ]
        assert codes == [200, 200, 200, 503, 503]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_per_client_concurrency_is_bounded() -> None:
    p, d = FakeWorker("prefill", "p"), FakeWorker("decode", "d")
    d.gate = asyncio.Event()
    async with cluster(RouterConfig(max_concurrent_per_client=2), [p, d]) as (_, client, _u):
        held = [
            asyncio.create_task(client.post("/v1/completions", json=completion())) for _ in range(2)
        ]
        while len(d.calls) < 2:
            await asyncio.sleep(0.02)
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        d.gate.set()
        assert [(await t).status_code for t in held] == [200, 200]
        # the slots are given back, streamed responses included
        for stream in (True, False, True):
            r = await client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200
        again = await asyncio.gather(
            *(client.post("/v1/completions", json=completion(stream=True)) for _ in range(2))
        )
        assert [r.status_code for r in again] == [200, 200]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_upstream_timeout_bounds_a_hung_worker() -> None:
    p, d = FakeWorker("prefill", "p"), FakeWorker("decode", "d")
    d.gate = asyncio.Event()  # never set: the decode hangs
    async with cluster(RouterConfig(upstream_timeout=0.5, max_attempts=1), [p, d]) as (
        _,
        client,
        _u,
    ):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 502 and "ReadTimeout" in r.text
        assert time.monotonic() - t0 < 3
        d.gate.set()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_clients_leaving_mid_stream_give_their_slot_back() -> None:
    p, d = FakeWorker("prefill", "p"), FakeWorker("decode", "d")
    async with cluster(RouterConfig(max_concurrent_per_client=1), [p, d]) as (_, client, _u):
        for _ in range(5):
            async with client.stream(
                "POST", "/v1/completions", json=completion(stream=True, max_tokens=200)
            ) as r:
                assert r.status_code == 200
                async for _line in r.aiter_lines():
                    break  # leave after the first line
            deadline = time.monotonic() + 5
            while True:  # the router notices the disconnect and frees the slot
                inst = (await client.get("/instances")).json()["instances"]
                if all(i["outstanding"] == 0 for i in inst):
                    break
                assert time.monotonic() < deadline, inst
                await asyncio.sleep(0.02)
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 200, r.text


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_restarted_worker_registers_again_once_its_old_entry_is_evicted() -> None:
    cfg = RouterConfig(evict_after=0.6, eviction_interval=0.05)
    async with router(cfg) as (url, client):
        regs = []
        took = []
        for _ in range(2):  # the same worker URL, twice: a crash without deregistration
            reg = WorkerRegistration(
                url, "decode", "http://127.0.0.1:9003", "127.0.0.1:7", MODEL, 0.1
            )
            t0 = time.monotonic()
            task = asyncio.create_task(register_with_router(reg))
            regs.append(reg)
            try:
                await asyncio.wait_for(reg.registered.wait(), 5)
                took.append(time.monotonic() - t0)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        first, second = regs
        # refused (409) while the old entry lived, accepted once it was evicted
        assert took[1] > 0.3 > took[0], took
        assert second.instance_id != first.instance_id
        assert second.instance_secret != first.instance_secret
        inst = (await client.get("/instances")).json()["instances"]
        assert [i["instance_id"] for i in inst] == [second.instance_id]
