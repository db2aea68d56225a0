"""Helpers for running any async model server as a prefill or decode worker.

A worker owns an :class:`aiokv.Engine` (its KV data plane) and keeps itself
registered with the router by heartbeating::

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with worker_lifespan(
            aiokv.EngineConfig(listen="0.0.0.0:0", device="cuda:0"),
            router_url="http://router:8000", role="prefill",
            url="http://this-host:8100", model="my-model",
        ) as worker:
            app.state.engine = worker.engine
            yield

:func:`register_with_router` is the heartbeat loop on its own, for servers
that already manage an engine. It registers, heartbeats every ``interval``
seconds, re-registers when the router forgot the instance (router restart,
eviction) and survives the router being down. Cancelling it is clean; the
lifespan helper then deregisters with a short, shielded time limit.

Router contract (see docs/serving.md): every call sends the router token as
``Authorization: Bearer`` (``$AIOKV_ROUTER_TOKEN`` unless given); ``/register``
answers an ``instance_id`` and an ``instance_secret`` that heartbeats,
deregistration and re-registration of the same URL must carry. The worker's
HTTP server must speak vLLM's ``kv_transfer_params`` contract: a prefill
request carries ``{"do_remote_decode": true, ...}`` and the answer's
``kv_transfer_params`` reach the decode request unchanged (the demo worker,
:mod:`aiokv.demo.worker`, is a complete example). Heartbeats are logged at
debug level only.

:func:`bind_socket` and :func:`serve_app` run an ASGI app under uvicorn on a
socket bound beforehand, so port 0 works and the real port is known before
serving starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import httpx

if TYPE_CHECKING:
    from aiokv import Engine, EngineConfig

__all__ = [
    "TOKEN_ENV",
    "WorkerHandle",
    "WorkerRegistration",
    "bind_socket",
    "deregister",
    "register_with_router",
    "serve_app",
    "worker_lifespan",
]

log = logging.getLogger("aiokv.serving")

Role = Literal["prefill", "decode"]

#: the environment variable holding the router's shared registration token
TOKEN_ENV = "AIOKV_ROUTER_TOKEN"


@dataclass(slots=True)
class WorkerRegistration:
    """What a worker tells the router, and what the router answered."""

    router_url: str
    role: Role
    url: str
    kv_address: str
    model: str
    interval: float = 1.0
    instance_id: str | None = None
    registrations: int = 0
    heartbeats: int = 0
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    #: the router's shared token (``Authorization: Bearer``); default ``$AIOKV_ROUTER_TOKEN``
    token: str | None = field(default_factory=lambda: os.environ.get(TOKEN_ENV) or None)
    #: the per-instance secret the router issued at the first registration: it proves
    #: this worker's identity on heartbeats, deregistration and re-registration
    instance_secret: str | None = None
    #: the model's context length in tokens; the router refuses longer ``max_tokens``
    max_model_len: int | None = None

    def payload(self) -> dict[str, str | int]:
        p: dict[str, str | int] = {
            "role": self.role,
            "url": self.url,
            "kv_address": self.kv_address,
            "model": self.model,
        }
        if self.max_model_len is not None:
            p["max_model_len"] = self.max_model_len
        if self.instance_secret is not None:
            p["instance_secret"] = self.instance_secret
        return p

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def identity(self) -> dict[str, str]:
        return {
            "instance_id": self.instance_id or "",
            "instance_secret": self.instance_secret or "",
        }


async def _register_once(client: httpx.AsyncClient, reg: WorkerRegistration) -> None:
    resp = await client.post(
        reg.router_url.rstrip("/") + "/register", json=reg.payload(), headers=reg.headers()
    )
    if resp.status_code in (400, 401, 403, 409):
        # refused for a reason retrying as-is cannot fix soon: say why, once per attempt
        raise _Refused(f"HTTP {resp.status_code}: {resp.text[:300]}")
    resp.raise_for_status()
    data = resp.json()
    reg.instance_id = str(data["instance_id"])
    secret = data.get("instance_secret")
    reg.instance_secret = str(secret) if isinstance(secret, str) else None
    reg.registrations += 1
    reg.registered.set()
    log.info("registered with %s as %s %s", reg.router_url, reg.role, reg.instance_id)


class _Refused(Exception):
    """The router refused the registration (bad token, URL policy, identity conflict)."""


async def register_with_router(
    router_url: str | WorkerRegistration,
    role: Role = "prefill",
    url: str = "",
    kv_address: str = "",
    model: str = "",
    interval: float = 1.0,
    *,
    client: httpx.AsyncClient | None = None,
) -> None:
    """Register with the router and heartbeat until cancelled.

    Pass either the fields or a ready :class:`WorkerRegistration` (whose
    ``registered`` event and ``instance_id`` the caller can watch). Errors
    talking to the router are logged and retried every ``interval``; this
    coroutine only ends by cancellation.
    """
    if isinstance(router_url, WorkerRegistration):
        reg = router_url
    else:
        reg = WorkerRegistration(router_url, role, url, kv_address, model, interval)
    own_client = client is None
    http = client or httpx.AsyncClient(
        timeout=httpx.Timeout(max(1.0, reg.interval * 2)), trust_env=False
    )
    try:
        while True:
            try:
                if reg.instance_id is None:
                    await _register_once(http, reg)
                else:
                    resp = await http.post(
                        reg.router_url.rstrip("/") + "/heartbeat",
                        json=reg.identity(),
                        headers=reg.headers(),
                    )
                    if resp.status_code == 404:
                        log.warning("router forgot this instance; registering again")
                        reg.instance_id = None
                        reg.instance_secret = None
                        continue
                    resp.raise_for_status()
                    reg.heartbeats += 1
                    log.debug("heartbeat %d to %s ok", reg.heartbeats, reg.router_url)
            except _Refused as e:
                log.warning("router %s refused the registration: %s", reg.router_url, e)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                log.warning("router %s unreachable: %s", reg.router_url, e)
            await asyncio.sleep(reg.interval)
    finally:
        if own_client:
            with _shielded(1.0):
                await http.aclose()


@contextlib.contextmanager
def _shielded(seconds: float) -> Iterator[anyio.CancelScope]:
    with anyio.CancelScope(shield=True) as scope:
        scope.deadline = anyio.current_time() + seconds
        yield scope


async def deregister(reg: WorkerRegistration, grace: float = 1.0) -> bool:
    """Tell the router this instance is leaving. Best effort, bounded by ``grace`` seconds."""
    if reg.instance_id is None:
        return False
    try:
        async with httpx.AsyncClient(timeout=grace, trust_env=False) as c:
            resp = await c.post(
                reg.router_url.rstrip("/") + "/deregister",
                json=reg.identity(),
                headers=reg.headers(),
            )
            return resp.status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(slots=True)
class WorkerHandle:
    """What :func:`worker_lifespan` yields."""

    engine: Engine
    registration: WorkerRegistration | None
    task: asyncio.Task[None] | None


@contextlib.asynccontextmanager
async def worker_lifespan(
    engine_config: EngineConfig,
    *,
    router_url: str | None = None,
    role: Role = "prefill",
    url: str = "",
    model: str = "",
    heartbeat_interval: float = 1.0,
    kv_address: str | None = None,
    on_engine: Callable[[Engine], Awaitable[None]] | None = None,
    wait_registered: float | None = None,
    token: str | None = None,
    max_model_len: int | None = None,
    kv_host: str | None = None,
) -> AsyncIterator[WorkerHandle]:
    """Start an engine and (when ``router_url`` is given) the heartbeat task.

    ``kv_address`` defaults to the engine's bound address; pass the address
    other hosts should use when the engine listens on a wildcard (or just
    ``kv_host``: that host with the engine's port). ``on_engine``
    runs after the engine started and before registration (set up a KV
    connector there, so no request arrives before it exists).
    ``wait_registered`` waits up to that many seconds for the first
    registration. ``token``: the router's shared token (default
    ``$AIOKV_ROUTER_TOKEN``). ``max_model_len``: the model's context in tokens,
    told to the router so it refuses longer ``max_tokens`` up front. On exit the
    heartbeat is cancelled, the instance deregistered (bounded) and the engine
    closed.
    """
    from aiokv import Engine

    async with Engine(engine_config) as engine:
        if on_engine is not None:
            await on_engine(engine)
        reg: WorkerRegistration | None = None
        task: asyncio.Task[None] | None = None
        if router_url is not None:
            reg = WorkerRegistration(
                router_url,
                role,
                url,
                kv_address or _with_host(engine.address, kv_host),
                model,
                heartbeat_interval,
                max_model_len=max_model_len,
            )
            if token is not None:
                reg.token = token
            task = asyncio.create_task(register_with_router(reg), name=f"aiokv-heartbeat-{role}")
            if wait_registered is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(reg.registered.wait(), wait_registered)
        try:
            yield WorkerHandle(engine, reg, task)
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if reg is not None:
                with _shielded(1.5):
                    await deregister(reg)


def _with_host(address: str, host: str | None) -> str:
    """``address`` (``host:port``) with its host replaced by ``host`` when given."""
    if not host:
        return address
    port = address.rpartition(":")[2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free port (see ``getsockname()``).

    Made with ``proto=IPPROTO_TCP`` and ``TCP_NODELAY`` set: asyncio only sets
    ``TCP_NODELAY`` on accepted connections whose socket says ``IPPROTO_TCP``
    (a ``proto=0`` socket's connections keep Nagle's algorithm, and a small
    response then waits ~40 ms for the peer's delayed ACK), and on Linux the
    accepted connections inherit the option from the listener as well.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def socket_url(sock: socket.socket, host: str | None = None) -> str:
    """``http://host:port`` of a bound socket (``host`` overrides a wildcard address)."""
    addr = sock.getsockname()
    h = host or str(addr[0])
    if ":" in h:
        h = f"[{h}]"
    return f"http://{h}:{addr[1]}"


async def serve_app(
    app: Any,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    on_started: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until cancelled or signalled.

    ``on_started`` is called once uvicorn accepts connections (lifespan startup done).
    """
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        ws="none",
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)

    async def _watch() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.01)
        if on_started is not None:
            on_started()

    watcher = asyncio.create_task(_watch())

    async def _serve() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit as e:  # uvicorn exits the process when the lifespan startup fails
            raise RuntimeError(f"server failed to start (uvicorn exit status {e.code})") from None

    serving = asyncio.ensure_future(_serve())
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        # graceful: let uvicorn run the lifespan shutdown, bounded
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(serving, 5.0)
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
