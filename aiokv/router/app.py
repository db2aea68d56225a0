"""FastAPI app factory of the disaggregated prefill/decode router.

Flow of one OpenAI request (``/v1/completions`` or ``/v1/chat/completions``)::

    client ──► router ──(1) max_tokens=1, kv_transfer_params{role: producer,
                │          consumer_kv_address: D.kv_address}──────────► prefill P
                │       P computes the prompt's KV and sends it to D's engine,
                │       which buffers it in its receive store; P answers with
                │       kv_transfer_params {num_tokens, first_token, ...}
                └─(2) original request, kv_transfer_params{role: consumer,
                           producer_kv_address: P.kv_address, + P's params}──► decode D
                   D collects the KV from its store, decodes, streams ──► client

Instances are chosen per role by the registry's policy. A connection error or
5xx from either leg *before anything was streamed to the client* marks the
instance unhealthy and retries the whole pair (fresh request id) on other
instances, up to ``max_attempts``. Addresses always come from the registry,
never from request ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .._config import parse_address
from .._exceptions import ConfigError
from .metrics import CONTENT_TYPE_LATEST, RouterMetrics
from .registry import POLICIES, Instance, NoInstanceError, Policy, Registry, Role, UnknownModelError

__all__ = ["RouterConfig", "RouterState", "create_app"]

log = logging.getLogger("aiokv.router")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Settings of one router app.

    ``max_prompt_length`` counts characters of text prompts (all messages of a
    chat) or token ids of pre-tokenised prompts.
    """

    policy: Policy = "round_robin"
    evict_after: float = 3.0
    eviction_interval: float | None = None  # default: evict_after / 4
    unhealthy_cooldown: float | None = None  # default: evict_after
    max_attempts: int = 3
    max_prompt_length: int = 32_768
    max_tokens_limit: int = 32_768
    max_body_bytes: int = 4 * 1024 * 1024
    connect_timeout: float = 2.0
    upstream_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("evict_after", "connect_timeout", "upstream_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"RouterConfig.{name} must be positive")
        for name in ("max_attempts", "max_prompt_length", "max_tokens_limit", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RouterConfig.{name} must be >= 1")
        if self.eviction_interval is not None and self.eviction_interval <= 0:
            raise ConfigError("RouterConfig.eviction_interval must be positive")

    @property
    def heartbeat_interval(self) -> float:
        """The interval the router asks workers to heartbeat at."""
        return self.evict_after / 3


class RouterState:
    """Everything one router app owns: registry, metrics, HTTP client."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = Registry(
            evict_after=config.evict_after,
            policy=config.policy,
            unhealthy_cooldown=config.unhealthy_cooldown,
        )
        self.metrics = RouterMetrics()
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router app is not running (lifespan not entered)")
        return self._client

    async def run_eviction(self) -> None:
        cfg = self.config
        interval = cfg.eviction_interval or cfg.evict_after / 4
        while True:
            await asyncio.sleep(interval)
            for inst in self.registry.evict_stale():
                log.warning(
                    "evicted %s instance %s (%s): no heartbeat for %.1fs",
                    inst.role,
                    inst.url,
                    inst.instance_id,
                    cfg.evict_after,
                )
                self.metrics.evictions.labels(inst.role).inc()
            self.metrics.refresh_instances(self.registry)


# -- errors -------------------------------------------------------------------


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str, etype: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.etype = etype

    def response(self) -> JSONResponse:
        return _error(self.status, self.message, self.code, self.etype)


def _error(
    status: int,
    message: str,
    code: str,
    etype: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": etype, "code": code}},
        status_code=status,
        headers=dict(headers) if headers else None,
    )


# -- request validation -------------------------------------------------------


async def _read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > max_bytes:
        raise _HTTPError(
            413, f"request body of {len(raw)} bytes exceeds {max_bytes}", "body_too_large"
        )
    if not raw.strip():
        raise _HTTPError(400, "request body is empty; expected a JSON object", "invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _HTTPError(400, f"request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _HTTPError(400, "request body must be a JSON object", "invalid_json")
    return body


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompt_length(prompt: object) -> int:
    """Characters of a text prompt or count of token ids; raises on a bad shape."""
    bad = _HTTPError(
        400,
        "'prompt' must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
        "invalid_prompt",
    )
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt)
        if all(_is_int(p) for p in prompt):
            return len(prompt)
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise bad


def _messages_length(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise _HTTPError(400, "'messages' must be a non-empty list", "invalid_messages")
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _HTTPError(
                400, f"messages[{i}] must be an object with a string 'role'", "invalid_messages"
            )
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"])
        elif content is not None:
            raise _HTTPError(
                400,
                f"messages[{i}].content must be a string or a list of parts",
                "invalid_messages",
            )
    return total


def _validate(body: dict[str, Any], endpoint: str, cfg: RouterConfig) -> tuple[str, bool]:
    model = body.get("model")
    if "model" not in body:
        raise _HTTPError(400, "missing required field 'model'", "missing_field")
    if not isinstance(model, str) or not model:
        raise _HTTPError(400, "'model' must be a non-empty string", "invalid_model")
    if endpoint == COMPLETIONS:
        if "prompt" not in body:
            raise _HTTPError(400, "missing required field 'prompt'", "missing_field")
        length = _prompt_length(body["prompt"])
    else:
        if "messages" not in body:
            raise _HTTPError(400, "missing required field 'messages'", "missing_field")
        length = _messages_length(body["messages"])
    if length > cfg.max_prompt_length:
        raise _HTTPError(
            400,
            f"prompt length {length} exceeds the maximum of {cfg.max_prompt_length}",
            "prompt_too_long",
        )
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and body[key] is not None:
            v = body[key]
            if not _is_int(v) or v < 1:
                raise _HTTPError(400, f"'{key}' must be a positive integer", "invalid_max_tokens")
            if v > cfg.max_tokens_limit:
                raise _HTTPError(
                    400,
                    f"'{key}' {v} exceeds the maximum of {cfg.max_tokens_limit}",
                    "invalid_max_tokens",
                )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _HTTPError(400, "'stream' must be a boolean", "invalid_stream")
    return model, stream


def _upstream_error_code(resp: httpx.Response) -> str | None:
    try:
        data = resp.json()
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("code"), str):
            return str(err["code"])
    return None


# -- the proxy ----------------------------------------------------------------


class _Attempt:
    """Book-keeping of the retry loop."""

    def __init__(self) -> None:
        self.failed: set[str] = set()
        self.count = 0
        self.last_error = ""
        self.upstream_tried = False


def _fail(state: RouterState, att: _Attempt, inst: Instance, why: str) -> None:
    log.warning("%s instance %s failed: %s", inst.role, inst.url, why)
    state.registry.mark_unhealthy(inst)
    att.failed.add(inst.instance_id)
    att.last_error = f"{inst.role} {inst.url}: {why}"
    state.metrics.errors.labels("upstream").inc()
    state.metrics.retries.labels(inst.role).inc()
    state.metrics.refresh_instances(state.registry)


def _prefill_body(body: dict[str, Any], request_id: str, decode: Instance) -> dict[str, Any]:
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = {
        "request_id": request_id,
        "role": "producer",
        "consumer_kv_address": decode.kv_address,
    }
    return p


def _decode_body(
    body: dict[str, Any], request_id: str, prefill: Instance, produced: dict[str, Any]
) -> dict[str, Any]:
    d = dict(body)
    params = dict(produced)
    params.update(request_id=request_id, role="consumer", producer_kv_address=prefill.kv_address)
    params.pop("consumer_kv_address", None)
    d["kv_transfer_params"] = params
    return d


def _trace_headers(
    request_id: str, prefill: Instance, decode: Instance, produced: dict[str, Any], attempts: int
) -> dict[str, str]:
    h = {
        "x-aiokv-request-id": request_id,
        "x-aiokv-prefill-url": prefill.url,
        "x-aiokv-decode-url": decode.url,
        "x-aiokv-attempts": str(attempts),
    }
    for key in ("transfer_seconds", "transfer_bytes", "num_tokens", "num_blocks"):
        v = produced.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            h[f"x-aiokv-{key.replace('_', '-')}"] = str(v)
    return h


async def _proxy(state: RouterState, request: Request, endpoint: str) -> Response:
    cfg = state.config
    reg = state.registry
    m = state.metrics
    start = time.perf_counter()
    status = 500
    streaming_handed_off = False
    try:
        try:
            body = await _read_json_object(request, cfg.max_body_bytes)
            model, stream = _validate(body, endpoint, cfg)
        except _HTTPError as e:
            m.errors.labels("bad_request").inc()
            status = e.status
            return e.response()

        att = _Attempt()
        while att.count < cfg.max_attempts:
            att.count += 1
            try:
                decode = reg.select("decode", model, exclude=att.failed)
                prefill = reg.select("prefill", model, exclude=att.failed)
            except UnknownModelError:
                m.errors.labels("unknown_model").inc()
                status = 404
                served = ", ".join(reg.models()) or "none"
                return _error(
                    404,
                    f"model {model!r} is not served by any instance (served: {served})",
                    "model_not_found",
                )
            except NoInstanceError as e:
                m.errors.labels("no_instance").inc()
                if att.upstream_tried:
                    status = 502
                    return _error(
                        502,
                        f"upstream failed after {att.count - 1} attempt(s): {att.last_error}",
                        "upstream_failed",
                        "server_error",
                    )
                status = 503
                return _error(503, str(e), "no_instance", "server_error")
            att.upstream_tried = True
            request_id = f"aiokv-{uuid.uuid4().hex}"

            # (1) prefill leg
            prefill.outstanding += 1
            t_prefill = time.perf_counter()
            try:
                presp = await state.client.post(
                    prefill.url + endpoint, json=_prefill_body(body, request_id, decode)
                )
            except httpx.HTTPError as e:
                _fail(state, att, prefill, f"{type(e).__name__}: {e}")
                continue
            finally:
                prefill.outstanding -= 1
            if presp.status_code >= 500:
                code = _upstream_error_code(presp)
                if code == "kv_transfer_failed":
                    # the producer could not reach the consumer's engine: blame the decode side
                    _fail(
                        state,
                        att,
                        decode,
                        f"KV transfer from {prefill.url} failed: {presp.text[:200]}",
                    )
                else:
                    _fail(state, att, prefill, f"HTTP {presp.status_code}: {presp.text[:200]}")
                continue
            if presp.status_code >= 400:
                status = presp.status_code
                m.errors.labels("upstream_rejected").inc()
                return Response(
                    presp.content,
                    status_code=presp.status_code,
                    media_type=presp.headers.get("content-type", "application/json"),
                )
            try:
                pdata = presp.json()
            except (ValueError, UnicodeDecodeError):
                _fail(state, att, prefill, "prefill answered with invalid JSON")
                continue
            produced = pdata.get("kv_transfer_params") if isinstance(pdata, dict) else None
            if not isinstance(produced, dict):
                produced = {}
            prefill.served += 1
            m.prefill_seconds.observe(time.perf_counter() - t_prefill)
            m.report_transfer(produced)
            headers = _trace_headers(request_id, prefill, decode, produced, att.count)
            dbody = _decode_body(body, request_id, prefill, produced)

            # (2) decode leg
            if not stream:
                m.ttft.observe(time.perf_counter() - start)
                decode.outstanding += 1
                try:
                    dresp = await state.client.post(decode.url + endpoint, json=dbody)
                except httpx.HTTPError as e:
                    _fail(state, att, decode, f"{type(e).__name__}: {e}")
                    continue
                finally:
                    decode.outstanding -= 1
                if dresp.status_code >= 500:
                    _fail(state, att, decode, f"HTTP {dresp.status_code}: {dresp.text[:200]}")
                    continue
                decode.served += 1
                status = dresp.status_code
                return Response(
                    dresp.content,
                    status_code=dresp.status_code,
                    headers=headers,
                    media_type=dresp.headers.get("content-type", "application/json"),
                )

            decode.outstanding += 1
            dresp_s: httpx.Response | None = None
            try:
                dresp_s = await state.client.send(
                    state.client.build_request("POST", decode.url + endpoint, json=dbody),
                    stream=True,
                )
                if dresp_s.status_code >= 500:
                    await dresp_s.aread()
                    raise _UpstreamStatus(f"HTTP {dresp_s.status_code}: {dresp_s.text[:200]}")
                if dresp_s.status_code >= 400:
                    content = await dresp_s.aread()
                    await dresp_s.aclose()
                    decode.outstanding -= 1
                    status = dresp_s.status_code
                    m.errors.labels("upstream_rejected").inc()
                    return Response(
                        content,
                        status_code=dresp_s.status_code,
                        media_type=dresp_s.headers.get("content-type", "application/json"),
                    )
                chunks = dresp_s.aiter_raw()
                # read the first chunk before committing: a failure here can still be retried
                first = await chunks.__anext__()
            except (httpx.HTTPError, _UpstreamStatus, StopAsyncIteration) as e:
                decode.outstanding -= 1
                if dresp_s is not None:
                    await dresp_s.aclose()
                why = (
                    "empty stream"
                    if isinstance(e, StopAsyncIteration)
                    else f"{type(e).__name__}: {e}"
                )
                _fail(state, att, decode, why)
                continue
            except BaseException:
                decode.outstanding -= 1
                if dresp_s is not None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await dresp_s.aclose()
                raise
            status = dresp_s.status_code
            streaming_handed_off = True
            m.ttft.observe(time.perf_counter() - start)
            return StreamingResponse(
                _relay(state, decode, dresp_s, first, chunks, start, endpoint),
                status_code=dresp_s.status_code,
                headers={**headers, "cache-control": "no-cache"},
                media_type=dresp_s.headers.get("content-type", "text/event-stream"),
            )

        status = 502
        return _error(
            502,
            f"upstream failed after {att.count} attempt(s): {att.last_error}",
            "upstream_failed",
            "server_error",
        )
    finally:
        if not streaming_handed_off:
            m.requests.labels(endpoint, str(status)).inc()
            m.latency.labels(endpoint).observe(time.perf_counter() - start)


class _UpstreamStatus(Exception):
    pass


async def _relay(
    state: RouterState,
    decode: Instance,
    resp: httpx.Response,
    first: bytes,
    chunks: AsyncIterator[bytes],
    start: float,
    endpoint: str,
) -> AsyncIterator[bytes]:
    status = str(resp.status_code)
    try:
        yield first
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            # too late to retry: tell the client in-band and end the stream
            status = "stream_error"
            state.metrics.errors.labels("stream").inc()
            log.warning("decode %s failed mid-stream: %s", decode.url, e)
            err = {
                "error": {
                    "message": f"decode instance failed mid-stream: {e}",
                    "type": "server_error",
                    "code": "upstream_stream_error",
                }
            }
            yield f"data: {json.dumps(err)}\n\n".encode()
        else:
            decode.served += 1
    finally:
        decode.outstanding -= 1
        state.metrics.requests.labels(endpoint, status).inc()
        state.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await resp.aclose()


# -- the app ------------------------------------------------------------------


def _field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if name not in body:
        raise _HTTPError(400, f"missing required field {name!r}", "missing_field")
    if not isinstance(v, str) or not v:
        raise _HTTPError(400, f"{name!r} must be a non-empty string", "invalid_field")
    return v


def create_app(config: RouterConfig | None = None) -> FastAPI:
    """Build a router app. Its background eviction task runs in the app's lifespan."""
    cfg = config or RouterConfig()
    state = RouterState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(cfg.upstream_timeout, connect=cfg.connect_timeout)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=128)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            state._client = client
            task = asyncio.create_task(state.run_eviction(), name="aiokv-router-eviction")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                state._client = None

    app = FastAPI(title="aiokv router", lifespan=lifespan)
    app.state.router = state

    @app.exception_handler(_HTTPError)
    async def _on_http_error(request: Request, exc: _HTTPError) -> Response:
        return exc.response()

    @app.post("/register")
    async def register(request: Request) -> Response:
        body = await _read_json_object(request, 64 * 1024)
        role = _field(body, "role")
        if role not in ("prefill", "decode"):
            raise _HTTPError(
                400, f"'role' must be 'prefill' or 'decode', got {role!r}", "invalid_role"
            )
        url = _field(body, "url").rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise _HTTPError(400, f"'url' must be an http(s) URL, got {url!r}", "invalid_url")
        kv_address = _field(body, "kv_address")
        try:
            parse_address(kv_address)
        except ConfigError as e:
            raise _HTTPError(400, f"'kv_address': {e}", "invalid_kv_address") from None
        model = _field(body, "model")
        r: Role = "prefill" if role == "prefill" else "decode"
        inst = state.registry.register(r, url, kv_address, model)
        state.metrics.refresh_instances(state.registry)
        log.info("registered %s instance %s (kv %s, model %s)", role, url, kv_address, model)
        return JSONResponse(
            {
                "instance_id": inst.instance_id,
                "evict_after": cfg.evict_after,
                "heartbeat_interval": cfg.heartbeat_interval,
            }
        )

    @app.post("/heartbeat")
    async def heartbeat(request: Request) -> Response:
        body = await _read_json_object(request, 64 * 1024)
        inst = state.registry.heartbeat(_field(body, "instance_id"))
        if inst is None:
            return _error(404, "unknown instance; register again", "unknown_instance")
        return JSONResponse({"ok": True, "healthy": inst.healthy})

    @app.post("/deregister")
    async def deregister(request: Request) -> Response:
        body = await _read_json_object(request, 64 * 1024)
        inst = state.registry.deregister(_field(body, "instance_id"))
        state.metrics.refresh_instances(state.registry)
        return JSONResponse({"ok": inst is not None})

    @app.get("/instances")
    async def instances() -> Response:
        now = time.monotonic()
        return JSONResponse(
            {
                "policy": cfg.policy,
                "instances": [i.to_json(now) for i in state.registry],
            }
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        reg = state.registry
        n_p, n_d = len(reg.live("prefill")), len(reg.live("decode"))
        return JSONResponse(
            {
                "status": "ok",
                "ready": n_p > 0 and n_d > 0,
                "prefill": n_p,
                "decode": n_d,
                "models": reg.models(),
            }
        )

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "owned_by": "aiokv"}
                    for m in state.registry.models()
                ],
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.refresh_instances(state.registry)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await _proxy(state, request, COMPLETIONS)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await _proxy(state, request, CHAT_COMPLETIONS)

    return app
