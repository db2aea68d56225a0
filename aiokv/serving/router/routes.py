"""FastAPI app factory of the disaggregated prefill/decode router.

The router speaks vLLM's disaggregation protocol (the one of vLLM's toy proxy
for NixlConnector / MooncakeConnector), so the same router fronts vLLM
instances and aiokv workers. One OpenAI request (``/v1/completions`` or
``/v1/chat/completions``)::

    client ──► router ──(1) the request with max_tokens=1, stream=false and
                │          kv_transfer_params = {do_remote_decode: true,
                │          do_remote_prefill: false, remote_engine_id: null,
                │          remote_block_ids: null, remote_host: null,
                │          remote_port: null}; header X-Request-Id ──► prefill P
                │       P computes the prompt's KV, keeps it for the decode side
                │       and answers with its own kv_transfer_params (where the KV
                │       is: engine id, host, port, block ids)
                └─(2) the original request, kv_transfer_params = P's, verbatim;
                           the same X-Request-Id ─────────────────────────► decode D
                   D pulls the KV from P, decodes, answers / streams ──► client

Instances come from three sources (see :mod:`aiokv.serving.router.registry`):
registration over HTTP (authenticated, see :class:`RouterConfig`), static
``--prefill`` / ``--decode`` URLs (health-probed with ``GET /v1/models``), and
vLLM-style ZMQ discovery (:mod:`aiokv.serving.router.discovery`).

A connection error or 5xx from either leg *before anything was streamed to the
client* marks the instance unhealthy and retries the whole pair (fresh request
id) on other instances, up to ``max_attempts``. Addresses always come from the
registry, never from requests; a client's own ``kv_transfer_params`` are
dropped. An *overloaded* instance (429, or 503 with ``out_of_kv_blocks`` or
``Retry-After``) is load, not failure: it stays healthy, the pair is tried on
other instances, and when all are overloaded the request waits ``Retry-After``
and tries again, for up to ``overload_wait`` seconds (then 503 ``overloaded``
with ``Retry-After``).

Everything a client sends is bounded: the body is counted while it is read
(413 as soon as it passes the limit), JSON nesting and integer sizes are
checked (400), a client has at most ``max_concurrent_per_client`` requests in
flight (429), error bodies are short, and upstream calls have timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiokv.serving.router.config import (
    _MAX_NAME,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    TOKEN_ENV,
    RouterConfig,
    _warn_open,
)
from aiokv.serving.router.metrics import CONTENT_TYPE_LATEST
from aiokv.serving.router.proxy import _proxy
from aiokv.serving.router.registry import (
    ANY_MODEL,
    IdentityError,
    RegistryFullError,
    Role,
)
from aiokv.serving.router.state import RouterState
from aiokv.serving.router.urls import UrlPolicyError, is_loopback_host
from aiokv.serving.router.validation import _error, _HTTPError, _is_int, _read_json_object, _short

__all__ = ["create_app"]

log = logging.getLogger("aiokv.serving.router")

# -- registration ---------------------------------------------------------------


def _field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if name not in body:
        raise _HTTPError(400, f"missing required field {name!r}", "missing_field")
    if not isinstance(v, str) or not v:
        raise _HTTPError(400, f"{name!r} must be a non-empty string", "invalid_field")
    return v


def _authorize(state: RouterState, request: Request, count: bool = True) -> None:
    """Admin endpoints: the bearer token when one is configured, else loopback only."""
    token = state.config.token
    if token:
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            cred.strip().encode(), token.encode()
        ):
            if count:
                state.metrics.errors.labels("unauthorized").inc()
            raise _HTTPError(
                401,
                "a valid 'Authorization: Bearer <token>' header is required",
                "unauthorized",
                headers={"www-authenticate": "Bearer"},
            )
        return
    host = request.client.host if request.client else ""
    if not is_loopback_host(host):
        if count:
            state.metrics.errors.labels("unauthorized").inc()
        raise _HTTPError(
            403,
            "this router has no token and accepts registrations from loopback only "
            f"(start it with --token or ${TOKEN_ENV})",
            "forbidden",
        )


def _may_administer(state: RouterState, request: Request) -> bool:
    """Whether :func:`_authorize` lets this request through (without raising)."""
    try:
        _authorize(state, request, count=False)
    except _HTTPError:
        return False
    return True


def _own_address(state: RouterState, request: Request) -> tuple[str, int] | None:
    server = request.scope.get("server")
    if isinstance(server, (tuple, list)) and len(server) == 2 and isinstance(server[1], int):
        return (str(server[0]), server[1])
    return state.own_address


def create_app(config: RouterConfig | None = None) -> FastAPI:
    """Build a router app. Its background tasks (eviction, static probes, ZMQ
    discovery) run in the app's lifespan."""
    cfg = config or RouterConfig()
    state = RouterState(cfg)
    admin_body = 64 * 1024

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _warn_open(cfg)
        timeout = httpx.Timeout(cfg.upstream_timeout, connect=cfg.connect_timeout)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=128)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            state._client = client
            tasks = [asyncio.create_task(state.run_eviction(), name="aiokv-router-eviction")]
            if cfg.prefill or cfg.decode:
                tasks.append(asyncio.create_task(state.probe_static(), name="aiokv-router-probe"))
            if cfg.discovery is not None:
                from aiokv.serving.router.discovery import Discovery

                disc = Discovery(state, cfg.discovery)
                disc.bind()
                tasks.append(asyncio.create_task(disc.run(), name="aiokv-router-discovery"))
            try:
                yield
            finally:
                tasks.extend(state._warming.values())
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
                state._client = None

    app = FastAPI(title="aiokv router", lifespan=lifespan)
    app.state.router = state

    @app.exception_handler(_HTTPError)
    async def _on_http_error(request: Request, exc: _HTTPError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
        # unknown routes and wrong methods: OpenAI's error shape, like every other answer
        if exc.status_code == 404:
            return _error(404, f"no route {request.url.path[:100]!r}", "not_found")
        if exc.status_code == 405:
            allow = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
            return _error(
                405,
                f"{request.method} is not allowed on {request.url.path[:100]!r}"
                + (f" (allowed: {allow})" if allow else ""),
                "method_not_allowed",
                headers={"allow": allow} if allow else None,
            )
        return _error(exc.status_code, str(exc.detail)[:200], "http_error")

    @app.post("/register")
    async def register(request: Request) -> Response:
        _authorize(state, request)
        body = await _read_json_object(request, admin_body, 4)
        role = _field(body, "role")
        if role not in ("prefill", "decode"):
            raise _HTTPError(
                400, f"'role' must be 'prefill' or 'decode', got {_short(role)}", "invalid_role"
            )
        try:
            url = state.policy.check_url(_field(body, "url"), own=_own_address(state, request))
        except UrlPolicyError as e:
            raise _HTTPError(400, str(e), "invalid_url") from None
        try:
            kv_address = state.policy.check_kv_address(_field(body, "kv_address"))
        except UrlPolicyError as e:
            raise _HTTPError(400, str(e), "invalid_kv_address") from None
        model = _field(body, "model")
        if len(model) > _MAX_NAME or model == ANY_MODEL or not model.isprintable():
            raise _HTTPError(400, "'model' must be a printable name", "invalid_model")
        max_len = body.get("max_model_len")
        if max_len is not None and (not _is_int(max_len) or max_len < 1):
            raise _HTTPError(400, "'max_model_len' must be a positive integer", "invalid_field")
        secret = body.get("instance_secret")
        r: Role = "prefill" if role == "prefill" else "decode"
        try:
            inst = state.registry.register(
                r,
                url,
                kv_address,
                model,
                secret=secret if isinstance(secret, str) else None,
                max_model_len=max_len,
            )
        except IdentityError as e:
            state.metrics.errors.labels("identity").inc()
            raise _HTTPError(409, f"{e}; it cannot be registered again", "conflict") from None
        except RegistryFullError as e:
            raise _HTTPError(503, str(e), "registry_full", "server_error") from None
        state.metrics.refresh_instances(state.registry)
        state.warm_connection(url)
        log.info("registered %s instance %s (kv %s, model %s)", role, url, kv_address, model)
        return JSONResponse(
            {
                "instance_id": inst.instance_id,
                "instance_secret": inst.secret,
                "evict_after": cfg.evict_after,
                "heartbeat_interval": cfg.heartbeat_interval,
            }
        )

    def _identity(body: dict[str, Any]) -> tuple[str, str | None]:
        secret = body.get("instance_secret")
        return _field(body, "instance_id"), secret if isinstance(secret, str) else None

    @app.post("/heartbeat")
    async def heartbeat(request: Request) -> Response:
        _authorize(state, request)
        body = await _read_json_object(request, admin_body, 4)
        try:
            inst = state.registry.heartbeat(*_identity(body))
        except IdentityError:
            state.metrics.errors.labels("identity").inc()
            return _error(403, "wrong instance secret", "forbidden")
        if inst is None:
            return _error(404, "unknown instance; register again", "unknown_instance")
        return JSONResponse({"ok": True, "healthy": inst.healthy})

    @app.post("/deregister")
    async def deregister(request: Request) -> Response:
        _authorize(state, request)
        body = await _read_json_object(request, admin_body, 4)
        try:
            inst = state.registry.deregister(*_identity(body))
        except IdentityError:
            state.metrics.errors.labels("identity").inc()
            return _error(403, "wrong instance secret", "forbidden")
        state.metrics.refresh_instances(state.registry)
        return JSONResponse({"ok": inst is not None})

    @app.get("/instances")
    async def instances(request: Request) -> Response:
        _authorize(state, request)
        now = time.monotonic()
        return JSONResponse(
            {
                "policy": cfg.policy,
                "instances": [i.to_json(now) for i in state.registry],
            }
        )

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        reg = state.registry
        n_p, n_d = len(reg.live("prefill")), len(reg.live("decode"))
        ready = n_p > 0 and n_d > 0
        # static workers the probe cannot reach, and why (their URLs to admins only)
        show_urls = _may_administer(state, request)
        down = [
            {"role": i.role, **({"url": i.url} if show_urls else {}), "error": i.probe_error}
            for i in reg
            if i.source == "static" and i.probe_error is not None
        ]
        answer: dict[str, Any] = {
            "status": "ok" if ready else "not_ready",
            "ready": ready,
            "prefill": n_p,
            "decode": n_d,
            "models": reg.models(),
        }
        if down:
            answer["unreachable"] = down
        return JSONResponse(answer, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        data: list[dict[str, Any]] = []
        for name in state.registry.models():
            entry: dict[str, Any] = {"id": name, "object": "model", "owned_by": "aiokv"}
            mlen = state.registry.max_model_len(name)
            if mlen is not None:
                entry["max_model_len"] = mlen
            data.append(entry)
        return JSONResponse({"object": "list", "data": data})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # the per-instance series are labelled with worker URLs: admins only
        state.metrics.refresh_instances(state.registry)
        text = state.metrics.render(with_instances=_may_administer(state, request))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await _proxy(state, request, COMPLETIONS)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await _proxy(state, request, CHAT_COMPLETIONS)

    return app
