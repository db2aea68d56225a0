"""Helpers for running any async model server as a prefill or decode worker.

A worker owns an :class:`aiokv.Engine` (its KV data plane) and keeps itself
registered with the router by heartbeating::

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with worker_lifespan(
            aiokv.EngineConfig(listen="0.0.0.0:0", device="cuda:0"),
            kv_host="this-host",  # what peers dial: the engine listens on a wildcard
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
:mod:`aiokv.serving.demo.worker`, is a complete example). Heartbeats are logged at
debug level only.

:func:`bind_socket` and :func:`serve_app` run an ASGI app under uvicorn on a
socket bound beforehand, so port 0 works and the real port is known before
serving starts.

No cold start: :class:`PeerWarmer` opens this engine's sessions (and, where
NCCL applies, their communicators) to its peers in the background as soon as
they are known, so the first request does not pay for them.
:func:`worker_lifespan` runs one by default and feeds it the router's
``/instances`` listing (the instances of the other role serving the same
model); a server also hands it the peers its requests name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import httpx

from aiokv import envs
from aiokv._exceptions import AiokvError, ConfigError

if TYPE_CHECKING:
    from aiokv import Engine, EngineConfig

__all__ = [
    "TOKEN_ENV",
    "PeerWarmer",
    "WorkerHandle",
    "WorkerRegistration",
    "bind_socket",
    "deregister",
    "register_with_router",
    "serve_app",
    "socket_url",
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
    token: str | None = field(default_factory=lambda: envs.get(TOKEN_ENV) or None)
    #: the per-instance secret the router issued at the first registration: it proves
    #: this worker's identity on heartbeats, deregistration and re-registration
    instance_secret: str | None = None
    #: the model's context length in tokens; the router refuses longer ``max_tokens``
    max_model_len: int | None = None
    #: called with the KV addresses of the live instances of the other role serving the
    #: same model, as listed by the router's ``/instances`` (None: the listing is not read)
    on_peers: Callable[[list[str]], None] | None = None
    #: seconds between two ``/instances`` readings once a peer is known (until then they
    #: come sooner: 50 ms after registering, doubling up to this)
    peers_interval: float = 5.0

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
        raise _Refused(resp.status_code, f"HTTP {resp.status_code}: {resp.text[:300]}")
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

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _register_at_start(reg: WorkerRegistration) -> None:
    """The first registration, before the worker serves.

    A refusal that no retry fixes (400: URL policy or a bad field, 401: wrong token,
    403: a router without a token and a caller not on loopback) raises
    :class:`ConfigError`. An identity conflict (409: the URL's previous registration
    is not evicted yet) and an unreachable router are logged and left to the
    heartbeat loop, which retries.
    """
    timeout = httpx.Timeout(max(1.0, reg.interval * 2))
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        try:
            await _register_once(http, reg)
        except _Refused as e:
            if e.status != 409:
                raise ConfigError(f"router {reg.router_url} refused the registration: {e}") from None
            log.warning("router %s refused the registration: %s", reg.router_url, e)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.warning("router %s unreachable: %s", reg.router_url, e)


def _peer_addresses(reg: WorkerRegistration, listing: object) -> list[str]:
    """The KV addresses, in ``/instances``'s answer, of the live instances this worker pairs with.

    Instances of the other role serving this model (or any model), healthy, other than
    this worker itself. Anything malformed is skipped: the answer is only a hint.
    """
    other = "decode" if reg.role == "prefill" else "prefill"
    items = listing.get("instances") if isinstance(listing, dict) else None
    out: list[str] = []
    for inst in items if isinstance(items, list) else ():
        if not isinstance(inst, dict) or inst.get("role") != other:
            continue
        addr, model = inst.get("kv_address"), inst.get("model")
        if not isinstance(addr, str) or not addr or addr == reg.kv_address or len(addr) > 300:
            continue
        if model not in (reg.model, "*") or inst.get("healthy") is False:
            continue
        out.append(addr)
    return out


async def _read_peers(client: httpx.AsyncClient, reg: WorkerRegistration) -> list[str] | None:
    """The router's listing of this worker's peers, or None when it cannot be read."""
    try:
        resp = await client.get(reg.router_url.rstrip("/") + "/instances", headers=reg.headers())
        if resp.status_code != 200:
            log.debug("router %s /instances answered HTTP %d", reg.router_url, resp.status_code)
            return None
        return _peer_addresses(reg, resp.json())
    except (httpx.HTTPError, ValueError) as e:
        log.debug("router %s /instances unreadable: %s", reg.router_url, e)
        return None


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
    coroutine only ends by cancellation. With ``reg.on_peers`` set it also reads
    the router's ``/instances`` once registered (soon and often while no peer is
    listed, every ``reg.peers_interval`` seconds once one is) and hands the
    peers' KV addresses to it.
    """
    if isinstance(router_url, WorkerRegistration):
        reg = router_url
    else:
        reg = WorkerRegistration(router_url, role, url, kv_address, model, interval)
    own_client = client is None
    http = client or httpx.AsyncClient(
        timeout=httpx.Timeout(max(1.0, reg.interval * 2)), trust_env=False
    )
    beat_due = 0.0  # monotonic time of the next registration or heartbeat
    # /instances: read right after registering, then again after 50 ms, 100 ms, ...
    # (doubling up to peers_interval) while no peer is listed, every peers_interval once
    # one is: a peer that registers just after this worker is warmed within ~100 ms
    peers_due, peers_wait = 0.0, 0.05
    try:
        while True:
            if time.monotonic() >= beat_due:
                beat_due = time.monotonic() + reg.interval
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
                            beat_due = 0.0
                            continue
                        resp.raise_for_status()
                        reg.heartbeats += 1
                        log.debug("heartbeat %d to %s ok", reg.heartbeats, reg.router_url)
                except _Refused as e:
                    log.warning("router %s refused the registration: %s", reg.router_url, e)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    log.warning("router %s unreachable: %s", reg.router_url, e)
            wake = beat_due
            if reg.on_peers is not None and reg.instance_id is not None:
                if time.monotonic() >= peers_due:
                    peers = await _read_peers(http, reg)
                    if peers:
                        peers_wait = reg.peers_interval
                        try:
                            reg.on_peers(peers)
                        except Exception:  # the heartbeat must outlive a faulty callback
                            log.exception("on_peers callback failed")
                    else:
                        peers_wait = min(peers_wait * 2, reg.peers_interval)
                    peers_due = time.monotonic() + peers_wait
                wake = min(wake, peers_due)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
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
    #: warms the engine's sessions to the peers (None when ``warm_peers=False``)
    warmer: PeerWarmer | None = None


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
    warm_peers: bool = True,
    after_connect: Callable[[str], Awaitable[object]] | None = None,
) -> AsyncIterator[WorkerHandle]:
    """Start an engine and (when ``router_url`` is given) the heartbeat task.

    ``kv_address`` defaults to the engine's address (:attr:`aiokv.EngineConfig.advertise`
    names the host it announces); ``kv_host`` is that host with the engine's port,
    and the engine then announces it too (unless its config sets ``advertise``). ``on_engine``
    runs after the engine started and before registration (set up a KV
    connector there, so no request arrives before it exists). The first
    registration is tried before the body runs: a refusal that retrying cannot
    fix (a wrong token, a URL or KV address the router's policy refuses) raises
    :class:`aiokv.ConfigError` and the engine is closed; an unreachable router or
    a URL still held by this worker's previous registration is retried in the
    background.
    ``wait_registered`` waits up to that many seconds for the first
    registration. ``token``: the router's shared token (default
    ``$AIOKV_ROUTER_TOKEN``). ``max_model_len``: the model's context in tokens,
    told to the router so it refuses longer ``max_tokens`` up front.
    ``warm_peers``: run a :class:`PeerWarmer` (the handle's ``warmer``) fed with the
    router's listing of this worker's peers, so their sessions are open before the
    first request; ``after_connect`` (its :class:`PeerWarmer` argument) runs after
    each peer's session opened, e.g. a decode worker's
    :meth:`aiokv.kv.KVConnector.prepare` (the IPC plane's mapping of a prefill's
    cache). On exit the warmer and the heartbeat are stopped, the instance
    deregistered (bounded) and the engine closed.
    """
    from aiokv import Engine

    if kv_host and engine_config.advertise is None:
        # the engine announces the same host to its peers as the router lists
        engine_config = dataclasses.replace(engine_config, advertise=kv_host)
    async with Engine(engine_config) as engine:
        if on_engine is not None:
            await on_engine(engine)
        warmer = PeerWarmer(engine, after_connect=after_connect) if warm_peers else None
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
            if warmer is not None:
                reg.on_peers = warmer.warm
            if token is not None:
                reg.token = token
            await _register_at_start(reg)
            task = asyncio.create_task(register_with_router(reg), name=f"aiokv-heartbeat-{role}")
            if wait_registered is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(reg.registered.wait(), wait_registered)
        try:
            yield WorkerHandle(engine, reg, task, warmer)
        finally:
            if warmer is not None:
                await warmer.aclose()
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if reg is not None:
                with _shielded(1.5):
                    await deregister(reg)


class PeerWarmer:
    """Opens an engine's sessions to its peers in the background, ahead of their traffic.

    :meth:`warm` takes the peers' addresses and returns at once: each one not yet warm
    gets :meth:`aiokv.Engine.connect` (the session, and the NCCL communicator where NCCL
    applies) on a background task, so a request never waits for it and the first one
    finds the session open. A failed connect is logged and forgotten, so the next
    :meth:`warm` naming that peer (the next request, or the next router listing) tries
    again. A warm peer is checked again (a cheap ``connect`` that finds the session open,
    or re-opens one the engine closed since) only when named after ``recheck`` seconds.

    Bounded whatever the churn of peers: at most ``concurrency`` connects run at once,
    at most ``max_peers`` peers wait for one (more are left to a later call), and at most
    ``max_peers`` warm peers are remembered (the oldest forgotten first). Use it from
    the engine's event loop.

    ``after_connect``: awaited with the peer's address after each successful connect,
    before the peer counts as warm (what else the first request would wait for, e.g.
    :meth:`aiokv.kv.KVConnector.prepare`); an error it raises is logged, and the peer
    still counts as warm (its session is open).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        concurrency: int = 4,
        max_peers: int = 256,
        recheck: float = 5.0,
        timeout: float | None = None,
        after_connect: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        if concurrency < 1 or max_peers < 1 or recheck < 0:
            raise ValueError("concurrency and max_peers must be >= 1, recheck >= 0")
        self.engine = engine
        self.concurrency = concurrency
        self.max_peers = max_peers
        self.recheck = recheck
        self.timeout = timeout
        self.after_connect = after_connect
        self._warm: OrderedDict[str, float] = OrderedDict()  # address -> when confirmed
        self._waiting: OrderedDict[str, None] = OrderedDict()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        #: connects that succeeded / failed so far
        self.connected = 0
        self.failures = 0

    def warm(self, peers: Iterable[str]) -> None:
        """Open the sessions to ``peers`` in the background; returns at once."""
        if self._closed:
            return
        now = time.monotonic()
        for peer in peers:
            if peer in self._tasks or peer in self._waiting:
                continue
            seen = self._warm.get(peer)
            if seen is not None and now - seen < self.recheck:
                continue
            if len(self._waiting) >= self.max_peers:
                break  # bounded: the rest are named again by a later call
            self._waiting[peer] = None
        self._pump()

    def is_warm(self, peer: str) -> bool:
        """Whether the last connect to ``peer`` succeeded."""
        return peer in self._warm

    @property
    def warm_peers(self) -> list[str]:
        """The peers whose last connect succeeded, oldest first."""
        return list(self._warm)

    @property
    def pending(self) -> int:
        """Connects running or waiting for a slot."""
        return len(self._tasks) + len(self._waiting)

    def _pump(self) -> None:
        while self._waiting and len(self._tasks) < self.concurrency and not self._closed:
            peer, _ = self._waiting.popitem(last=False)
            self._tasks[peer] = asyncio.get_running_loop().create_task(
                self._connect(peer), name=f"aiokv-warm-{peer}"
            )

    async def _connect(self, peer: str) -> None:
        try:
            await self.engine.connect(peer, timeout=self.timeout)
        except Exception as e:  # whatever it is: logged, and tried again when next named
            self.failures += 1
            self._warm.pop(peer, None)
            level = logging.WARNING if isinstance(e, AiokvError) else logging.ERROR
            log.log(level, "warming the session to %s failed (tried again when named): %r", peer, e)
        else:
            self.connected += 1
            if self.after_connect is not None:
                try:
                    await self.after_connect(peer)
                except Exception as e:
                    log.warning("after connecting to %s: %r", peer, e)
            self._warm[peer] = time.monotonic()
            self._warm.move_to_end(peer)
            while len(self._warm) > self.max_peers:
                self._warm.popitem(last=False)
        finally:
            self._tasks.pop(peer, None)
            if not self._closed:
                self._pump()

    async def aclose(self) -> None:
        """Stop: cancel the connects in progress and wait for them."""
        self._closed = True
        self._waiting.clear()
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()  # a task cancelled before it ran never reached its finally


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
    **uvicorn_options: Any,
) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until cancelled or signalled.

    ``on_started`` is called once uvicorn accepts connections (lifespan startup done).
    ``uvicorn_options`` go to ``uvicorn.Config`` as they are (e.g. ``http=``).
    """
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        ws="none",
        access_log=False,
        timeout_graceful_shutdown=3,
        **uvicorn_options,
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
