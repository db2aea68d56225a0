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
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from aiokv import envs
from aiokv._exceptions import ConfigError
from aiokv.serving.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from aiokv.serving.router.registry import (
    ANY_MODEL,
    POLICIES,
    IdentityError,
    Instance,
    NoInstanceError,
    Policy,
    Registry,
    RegistryFullError,
    Role,
    UnknownModelError,
)
from aiokv.serving.router.urls import UrlPolicy, UrlPolicyError, is_loopback_host

__all__ = ["TOKEN_ENV", "RouterConfig", "RouterState", "create_app", "prefill_kv_params"]

log = logging.getLogger("aiokv.serving.router")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
#: the environment variable the router (and the workers) read the shared token from
TOKEN_ENV = "AIOKV_ROUTER_TOKEN"
#: header that marks requests the router sent; a request carrying our own mark is a loop
HOP_HEADER = "x-aiokv-router-hop"
_MAX_HOPS = 8
_MAX_ERROR_PASSTHROUGH = 16 * 1024
_MAX_INT_DIGITS = 30
_MAX_NAME = 256


def prefill_kv_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill request, as vLLM's toy proxy sends them."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Settings of one router app.

    ``max_prompt_length`` counts characters of text prompts (all messages of a
    chat) or token ids of pre-tokenised prompts.

    ``token``: the shared secret workers present as ``Authorization: Bearer``
    on ``/register``, ``/heartbeat``, ``/deregister`` and ``/instances``.
    Without one, those endpoints answer loopback clients only.

    ``prefill`` / ``decode``: static worker base URLs (vLLM's toy-proxy style).
    ``discovery``: ``host:port`` to bind a ZMQ ROUTER socket on for vLLM-style
    discovery; messages from non-loopback peers are accepted only with
    ``discovery_allow_remote`` or a ``"token"`` field equal to ``token``.
    """

    policy: Policy = "round_robin"
    evict_after: float = 3.0
    eviction_interval: float | None = None  # default: evict_after / 4
    unhealthy_cooldown: float | None = None  # default: evict_after
    max_attempts: int = 3
    #: how long a request waits, retrying, while every instance it may use answers
    #: "overloaded" (429, or 503 with ``out_of_kv_blocks`` or ``Retry-After``); then 503
    overload_wait: float = 30.0
    max_prompt_length: int = 32_768
    max_tokens_limit: int = 32_768
    max_body_bytes: int = 4 * 1024 * 1024
    connect_timeout: float = 2.0
    upstream_timeout: float = 120.0
    token: str | None = field(default=None, repr=False)
    allow_link_local: bool = False
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    discovery: str | None = None
    discovery_ttl: float = 5.0
    discovery_allow_remote: bool = False
    probe_interval: float = 2.0
    max_json_depth: int = 64
    max_concurrent_per_client: int = 64
    max_instances: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    expose_topology: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in (
            "evict_after",
            "connect_timeout",
            "upstream_timeout",
            "discovery_ttl",
            "probe_interval",
            "header_timeout",
            "body_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"RouterConfig.{name} must be positive")
        for name in (
            "max_attempts",
            "max_prompt_length",
            "max_tokens_limit",
            "max_body_bytes",
            "max_json_depth",
            "max_concurrent_per_client",
            "max_instances",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"RouterConfig.{name} must be >= 1")
        if self.eviction_interval is not None and self.eviction_interval <= 0:
            raise ConfigError("RouterConfig.eviction_interval must be positive")
        if self.token is not None and len(self.token) < 16:
            raise ConfigError("the router token must be at least 16 characters")
        policy = UrlPolicy(self.allow_link_local)
        for url in (*self.prefill, *self.decode):
            try:
                policy.check_url(url)
            except UrlPolicyError as e:
                raise ConfigError(f"worker URL {url!r}: {e}") from None
        if self.discovery is not None:
            try:
                policy.check_kv_address(self.discovery)
            except UrlPolicyError as e:
                raise ConfigError(f"discovery address: {e}") from None

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
            max_instances=config.max_instances,
        )
        self.metrics = RouterMetrics()
        self.policy = UrlPolicy(config.allow_link_local)
        self.hop_id = secrets.token_hex(8)
        self.per_client: dict[str, int] = {}
        #: the router's own listening address (host, port), when known (set by serve)
        self.own_address: tuple[str, int] | None = None
        self._client: httpx.AsyncClient | None = None
        #: connections being opened to newly registered workers (see warm_connection)
        self._warming: dict[str, asyncio.Task[None]] = {}
        for role, urls in (("prefill", config.prefill), ("decode", config.decode)):
            for url in urls:
                self.registry.register(
                    "prefill" if role == "prefill" else "decode",
                    self.policy.check_url(url),
                    "",
                    ANY_MODEL,
                    source="static",
                )

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router app is not running (lifespan not entered)")
        return self._client

    def warm_connection(self, url: str) -> None:
        """Open the HTTP connection to a newly registered worker now, in the background.

        One ``GET /v1/models`` (its answer is not used): the connection then waits in
        the client's keep-alive pool, so the first request routed to the worker does
        not pay for connecting. Best effort, errors ignored; at most 64 at a time.
        """
        if self._client is None or url in self._warming or len(self._warming) >= 64:
            return
        task = asyncio.create_task(self._warm(url), name="aiokv-router-warm")
        self._warming[url] = task
        task.add_done_callback(lambda _t: self._warming.pop(url, None))

    async def _warm(self, url: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.get(url + "/v1/models", timeout=httpx.Timeout(2.0, connect=1.0))

    async def run_eviction(self) -> None:
        cfg = self.config
        interval = cfg.eviction_interval or cfg.evict_after / 4
        while True:
            await asyncio.sleep(interval)
            for inst in self.registry.evict_stale():
                log.warning(
                    "evicted %s instance %s (%s): no sign of life for %.1fs",
                    inst.role,
                    inst.url,
                    inst.instance_id,
                    inst.ttl or cfg.evict_after,
                )
                self.metrics.evictions.labels(inst.role).inc()
            self.metrics.refresh_instances(self.registry)

    async def probe_static(self) -> None:
        """Health of static workers: ``GET /v1/models`` every ``probe_interval`` seconds.

        A 200 is a sign of life (the instance becomes selectable, after the
        cool-down when it had failed); a one-model answer also tells the model
        name and its ``max_model_len``. A failed probe marks it unhealthy.
        """
        timeout = httpx.Timeout(max(1.0, self.config.probe_interval), connect=1.0)
        while True:
            for inst in [i for i in self.registry if i.source == "static"]:
                try:
                    r = await self.client.get(inst.url + "/v1/models", timeout=timeout)
                    if r.status_code != 200:
                        raise ValueError(f"HTTP {r.status_code}")
                    _learn_models(inst, r.content[:65536])
                    was = inst.healthy
                    self.registry.touch(inst)
                    inst.probe_error = None
                    if inst.healthy and not was:
                        log.info("static %s instance %s is up", inst.role, inst.url)
                except (httpx.HTTPError, ValueError) as e:
                    why = f"{type(e).__name__}: {e}"[:200]
                    if why != inst.probe_error:  # once per reason, also before the first success
                        log.warning(
                            "static %s instance %s is unreachable: %s", inst.role, inst.url, why
                        )
                    inst.probe_error = why
                    if inst.healthy:
                        self.registry.mark_unhealthy(inst)
            self.metrics.refresh_instances(self.registry)
            await asyncio.sleep(self.config.probe_interval)


def _learn_models(inst: Instance, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        return
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or len(models) != 1 or not isinstance(models[0], dict):
        return
    mid, mlen = models[0].get("id"), models[0].get("max_model_len")
    if isinstance(mid, str) and 0 < len(mid) <= _MAX_NAME:
        inst.model = mid
    if isinstance(mlen, int) and not isinstance(mlen, bool) and mlen > 0:
        inst.max_model_len = mlen


# -- errors -------------------------------------------------------------------


class _HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        etype: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.etype = etype
        self.headers = headers

    def response(self) -> JSONResponse:
        return _error(self.status, self.message, self.code, self.etype, self.headers)


def _error(
    status: int,
    message: str,
    code: str,
    etype: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error; the message is capped so an error body stays small."""
    if len(message) > 500:
        message = message[:497] + "..."
    return JSONResponse(
        {"error": {"message": message, "type": etype, "code": code}},
        status_code=status,
        headers=dict(headers) if headers else None,
    )


def _short(value: object, n: int = 64) -> str:
    """``repr`` of a client-supplied value, capped: errors never echo a large input."""
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


# -- reading bodies -------------------------------------------------------------


class _NumberTooLarge(ValueError):
    pass


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > _MAX_INT_DIGITS:
        raise _NumberTooLarge(f"an integer of {len(s)} digits")
    return int(s)


def _parse_constant(s: str) -> float:
    raise _NumberTooLarge(f"{s} is not a JSON number")


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a decoded JSON value (iterative; stops past ``limit``)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """Read the body, counting while reading: 413 as soon as it passes ``max_bytes``."""
    too_large = _HTTPError(
        413,
        f"request body exceeds {max_bytes} bytes",
        "body_too_large",
        headers={"connection": "close"},
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _HTTPError(400, "bad Content-Length", "bad_request")
        if int(declared) > max_bytes:
            raise too_large
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > max_bytes:
                raise too_large
    except ClientDisconnect:
        # the client left (or missed the body deadline): nobody reads the answer
        peer = request.client.host if request.client else "a client"
        log.debug("%s disconnected while sending the request body", peer)
        raise _HTTPError(499, "client disconnected", "client_disconnected") from None
    return bytes(buf)


async def _read_json_object(request: Request, max_bytes: int, max_depth: int) -> dict[str, Any]:
    raw = await _read_body(request, max_bytes)
    if not raw.strip():
        raise _HTTPError(400, "request body is empty; expected a JSON object", "invalid_json")
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except RecursionError:
        raise _HTTPError(400, "request body is nested too deeply", "invalid_json") from None
    except _NumberTooLarge as e:
        raise _HTTPError(
            400, f"request body holds an unusable number: {e}", "invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _HTTPError(
            400, f"request body is not valid JSON: {str(e)[:120]}", "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise _HTTPError(400, "request body must be a JSON object", "invalid_json")
    if _depth(body, max_depth) > max_depth:
        raise _HTTPError(
            400, f"request body is nested deeper than {max_depth} levels", "invalid_json"
        )
    return body


# -- request validation -------------------------------------------------------


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


def _token_ids(prompt: object) -> int | None:
    """The longest prompt's token count when the prompt is token ids, else None (text:
    only the model's tokenizer can count it)."""
    if isinstance(prompt, list) and prompt:
        if all(_is_int(p) for p in prompt):
            return len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return max(len(p) for p in prompt)
    return None


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


def _validate(
    body: dict[str, Any], endpoint: str, cfg: RouterConfig, reg: Registry
) -> tuple[str, bool]:
    model = body.get("model")
    if "model" not in body:
        raise _HTTPError(400, "missing required field 'model'", "missing_field")
    if not isinstance(model, str) or not model or len(model) > _MAX_NAME:
        raise _HTTPError(
            400,
            f"'model' must be a non-empty string of at most {_MAX_NAME} characters",
            "invalid_model",
        )
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
    context = reg.max_model_len(model)
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and body[key] is not None:
            v = body[key]
            if not _is_int(v) or v < 1:
                raise _HTTPError(400, f"'{key}' must be a positive integer", "invalid_max_tokens")
            if context is not None and v > context:
                raise _HTTPError(
                    400,
                    f"'{key}' {v} exceeds the model's context length of {context} tokens",
                    "context_length_exceeded",
                )
            ids = _token_ids(body.get("prompt")) if endpoint == COMPLETIONS else None
            if context is not None and ids is not None and ids + v > context:
                # counted exactly (token ids): refused before any prefill is spent on it
                raise _HTTPError(
                    400,
                    f"'{key}' {v} plus the prompt's {ids} tokens exceed the model's context "
                    f"length of {context} tokens",
                    "context_length_exceeded",
                )
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
    _validate_sampling(body, stream)
    return model, stream


_MAX_N = 16
_MAX_STOP = 4
_MAX_STOP_CHARS = 256


def _validate_sampling(body: dict[str, Any], stream: bool) -> None:
    """The shapes of ``n``, ``stop`` and ``stream_options`` (the worker honours them or
    answers ``unsupported_parameter``; the router only bounds them)."""
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= _MAX_N):
        raise _HTTPError(400, f"'n' must be an integer from 1 to {_MAX_N}", "invalid_n")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOP
        or not all(isinstance(x, str) and 0 < len(x) <= _MAX_STOP_CHARS for x in stops)
    ):
        raise _HTTPError(
            400,
            f"'stop' must be a string or a list of at most {_MAX_STOP} non-empty strings "
            f"of at most {_MAX_STOP_CHARS} characters",
            "invalid_stop",
        )
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _HTTPError(
                400, "'stream_options' is only allowed when 'stream' is true", "invalid_stream"
            )
        if not isinstance(opts, dict) or not all(
            k == "include_usage" and isinstance(v, bool) for k, v in opts.items()
        ):
            raise _HTTPError(
                400,
                "'stream_options' may hold 'include_usage' (a boolean) only",
                "unsupported_parameter",
            )


def _upstream_error_code(content: bytes) -> str | None:
    try:
        data = json.loads(content[:_MAX_ERROR_PASSTHROUGH])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("code"), str):
            return str(err["code"])
    return None


def _upstream_reason(status: int, content: bytes) -> str:
    """A worker's error answer summed up in one line: its OpenAI error message when it
    has one, else its text; never a piece of a JSON document cut in the middle."""
    try:
        data = json.loads(content[:_MAX_ERROR_PASSTHROUGH])
    except (ValueError, UnicodeDecodeError, RecursionError):
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        code = err.get("code")
        tag = f" {code}" if isinstance(code, str) and len(code) <= 64 else ""
        return f"HTTP {status}{tag}: {_clip(err['message'])}"
    if data is None and content.lstrip()[:1] not in (b"{", b"["):
        text = content.decode("utf-8", errors="replace").strip()
        if text.isprintable():
            return f"HTTP {status}: {_clip(text)}"
    return f"HTTP {status} ({len(content)} bytes)"


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _passthrough_error(content: bytes, status: int, content_type: str | None) -> Response:
    """An upstream 4xx for the client, unless it is too large to pass on."""
    if len(content) > _MAX_ERROR_PASSTHROUGH:
        return _error(
            status, f"the worker rejected the request (HTTP {status})", "upstream_rejected"
        )
    return Response(content, status_code=status, media_type=content_type or "application/json")


# -- the proxy ----------------------------------------------------------------


class _Attempt:
    """Book-keeping of the retry loop."""

    def __init__(self, overload_wait: float) -> None:
        self.failed: set[str] = set()
        #: instances that answered "overloaded" since the last wait: skipped, not failed
        self.busy: set[str] = set()
        self.retry_after = 0.0
        self.wait_until = time.monotonic() + overload_wait
        self.count = 0
        self.last_error = ""
        self.upstream_tried = False

    def excluded(self) -> set[str]:
        return self.failed | self.busy


def _overloaded(status: int, content: bytes, headers: httpx.Headers) -> bool:
    """An upstream that is out of capacity, not broken: 429, or 503 saying so."""
    if status == 429:
        return True
    return status == 503 and (
        "retry-after" in headers or _upstream_error_code(content) == "out_of_kv_blocks"
    )


def _busy(state: RouterState, att: _Attempt, inst: Instance, headers: httpx.Headers) -> None:
    """``inst`` is overloaded: try the others, and this one again after a pause. It stays
    healthy (overload is load, not failure) and the attempt is not counted."""
    log.info("%s instance %s is overloaded", inst.role, inst.url)
    att.busy.add(inst.instance_id)
    att.count -= 1
    ra = 1.0
    with contextlib.suppress(ValueError):
        ra = float(headers.get("retry-after", "1"))
    att.retry_after = max(att.retry_after, min(max(ra, 0.05), 5.0))
    att.last_error = f"{inst.role} {inst.url}: overloaded"
    state.metrics.errors.labels("overloaded").inc()


def _fail(state: RouterState, att: _Attempt, inst: Instance, why: str) -> None:
    log.warning("%s instance %s failed: %s", inst.role, inst.url, why)
    state.registry.mark_unhealthy(inst)
    att.failed.add(inst.instance_id)
    where = f"{inst.role} {inst.url}" if state.config.expose_topology else inst.role
    att.last_error = f"{where}: {why[:200]}"
    state.metrics.errors.labels("upstream").inc()
    state.metrics.retries.labels(inst.role).inc()
    state.metrics.refresh_instances(state.registry)


def _request_id(prefill: Instance, decode: Instance) -> str:
    """The X-Request-Id of one prefill/decode pair.

    For ZMQ-discovered pairs it has the form vLLM's P2P NCCL connector reads
    the peers' ZMQ addresses from; otherwise a plain random id.
    """
    if prefill.source == "zmq" and decode.source == "zmq":
        return (
            f"___prefill_addr_{prefill.kv_address}___decode_addr_{decode.kv_address}_"
            f"{uuid.uuid4().hex}"
        )
    return f"aiokv-{uuid.uuid4().hex}"


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = prefill_kv_params()
    return p


def _decode_body(body: dict[str, Any], produced: object) -> dict[str, Any]:
    d = dict(body)
    d.pop("kv_transfer_params", None)  # never a client's own
    if isinstance(produced, dict):
        d["kv_transfer_params"] = produced
    return d


def _without_kv_params(content: bytes) -> bytes:
    """A decode's JSON answer without ``kv_transfer_params`` (where the KV came from:
    engine ids, hosts, ports, block ids), unchanged when it holds none."""
    if b'"kv_transfer_params"' not in content:
        return content
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return content
    if not isinstance(data, dict) or data.pop("kv_transfer_params", None) is None:
        return content
    return json.dumps(data, separators=(",", ":")).encode()


def _num(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v)
    return None


def _transfer_report(
    produced: Mapping[str, Any], decode_headers: httpx.Headers
) -> dict[str, float]:
    """KV transfer size and time: from the decode's response headers (pulling workers
    measure there) or else from the prefill's ``kv_transfer_params`` (pushing workers)."""
    out: dict[str, float] = {}
    for key in ("transfer_seconds", "transfer_bytes", "num_tokens", "num_blocks"):
        v: float | None = None
        h = decode_headers.get(f"x-aiokv-{key.replace('_', '-')}")
        if h is not None:
            with contextlib.suppress(ValueError):
                v = _num(float(h))
        if v is None:
            v = _num(produced.get(key))
        if v is not None:
            out[key] = v
    return out


#: the KV planes a decode worker may name in ``x-aiokv-kv-plane`` (passed on as is)
_PLANES = frozenset({"ipc", "engine"})


def _trace_headers(
    request_id: str,
    prefill: Instance,
    decode: Instance,
    report: Mapping[str, float],
    attempts: int,
    decode_headers: httpx.Headers,
    expose_topology: bool = False,
) -> dict[str, str]:
    h = {
        "x-request-id": request_id,
        "x-aiokv-request-id": request_id,
        "x-aiokv-attempts": str(attempts),
    }
    if expose_topology:
        h["x-aiokv-prefill-url"] = prefill.url
        h["x-aiokv-decode-url"] = decode.url
    for key, v in report.items():
        h[f"x-aiokv-{key.replace('_', '-')}"] = (
            str(int(v)) if key != "transfer_seconds" and v.is_integer() else str(v)
        )
    plane = decode_headers.get("x-aiokv-kv-plane")
    if plane in _PLANES:
        h["x-aiokv-kv-plane"] = plane
    return h


class _UpstreamStatus(Exception):
    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = code


def _blame(prefill: Instance, decode: Instance, code: str | None) -> Instance:
    """Which side a failed decode leg is blamed on: a decode that could not pull the
    KV from the prefill's engine (``kv_fetch_failed``) points at the prefill."""
    return prefill if code == "kv_fetch_failed" else decode


async def _proxy(state: RouterState, request: Request, endpoint: str) -> Response:
    cfg = state.config
    m = state.metrics
    client_key = request.client.host if request.client else "unknown"
    if state.per_client.get(client_key, 0) >= cfg.max_concurrent_per_client:
        m.errors.labels("client_limit").inc()
        m.requests.labels(endpoint, "429").inc()
        return _error(
            429,
            f"too many concurrent requests from this client "
            f"(at most {cfg.max_concurrent_per_client})",
            "too_many_requests",
            headers={"retry-after": "1"},
        )
    state.per_client[client_key] = state.per_client.get(client_key, 0) + 1
    handed_off = False

    def release() -> None:
        n = state.per_client.get(client_key, 1) - 1
        if n <= 0:
            state.per_client.pop(client_key, None)
        else:
            state.per_client[client_key] = n

    try:
        resp = await _proxy_inner(state, request, endpoint, release)
        handed_off = isinstance(resp, StreamingResponse)
        return resp
    finally:
        if not handed_off:
            release()


async def _proxy_inner(
    state: RouterState, request: Request, endpoint: str, release: Any
) -> Response:
    cfg = state.config
    reg = state.registry
    m = state.metrics
    start = time.perf_counter()
    status = 500
    streaming_handed_off = False
    try:
        hops = [h for h in request.headers.get(HOP_HEADER, "").split(",") if h]
        if state.hop_id in hops or len(hops) >= _MAX_HOPS:
            m.errors.labels("loop").inc()
            status = 508
            return _error(508, "request loop: this router is its own upstream", "loop_detected")
        hop_value = ",".join([*hops, state.hop_id])
        try:
            body = await _read_json_object(request, cfg.max_body_bytes, cfg.max_json_depth)
            model, stream = _validate(body, endpoint, cfg, reg)
        except _HTTPError as e:
            m.errors.labels("client_gone" if e.status == 499 else "bad_request").inc()
            status = e.status
            return e.response()

        att = _Attempt(cfg.overload_wait)
        while att.count < cfg.max_attempts:
            att.count += 1
            try:
                try:
                    prefill = reg.select("prefill", model, exclude=att.excluded())
                    decode = reg.select("decode", model, exclude=att.excluded())
                except NoInstanceError:
                    if not att.busy:
                        raise
                    # every usable instance is overloaded: wait for room (bounded), then
                    # try them again
                    pause = min(att.retry_after, att.wait_until - time.monotonic())
                    if pause <= 0:
                        status = 503
                        return _error(
                            503,
                            f"every instance is overloaded ({att.last_error})",
                            "overloaded",
                            "server_error",
                            headers={"retry-after": "1"},
                        )
                    await asyncio.sleep(pause)
                    att.busy.clear()
                    att.retry_after = 0.0
                    att.count -= 1
                    continue
            except UnknownModelError:
                m.errors.labels("unknown_model").inc()
                status = 404
                return _error(
                    404,
                    f"model {_short(model)} is not served here (see GET /v1/models)",
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
                return _error(503, str(e)[:200], "no_instance", "server_error")
            att.upstream_tried = True
            request_id = _request_id(prefill, decode)
            up_headers = {"x-request-id": request_id, HOP_HEADER: hop_value}

            # (1) prefill leg
            prefill.outstanding += 1
            t_prefill = time.perf_counter()
            try:
                presp = await state.client.post(
                    prefill.url + endpoint, json=_prefill_body(body), headers=up_headers
                )
            except httpx.HTTPError as e:
                _fail(state, att, prefill, f"{type(e).__name__}: {e}")
                continue
            finally:
                prefill.outstanding -= 1
            if _overloaded(presp.status_code, presp.content, presp.headers):
                _busy(state, att, prefill, presp.headers)
                continue
            if presp.status_code >= 500:
                if _upstream_error_code(presp.content) == "kv_transfer_failed":
                    # a pushing producer could not reach the consumer: blame the decode side
                    _fail(state, att, decode, f"KV transfer from {prefill.url} failed")
                else:
                    _fail(state, att, prefill, _upstream_reason(presp.status_code, presp.content))
                continue
            if presp.status_code >= 400:
                status = presp.status_code
                m.errors.labels("upstream_rejected").inc()
                return _passthrough_error(
                    presp.content, presp.status_code, presp.headers.get("content-type")
                )
            try:
                pdata = presp.json()
            except (ValueError, UnicodeDecodeError, RecursionError):
                _fail(state, att, prefill, "prefill answered with invalid JSON")
                continue
            produced = pdata.get("kv_transfer_params") if isinstance(pdata, dict) else None
            prefill.served += 1
            m.prefill_seconds.observe(time.perf_counter() - t_prefill)
            dbody = _decode_body(body, produced)
            pparams: Mapping[str, Any] = produced if isinstance(produced, dict) else {}

            # (2) decode leg
            if not stream:
                decode.outstanding += 1
                try:
                    dresp = await state.client.post(
                        decode.url + endpoint, json=dbody, headers=up_headers
                    )
                except httpx.HTTPError as e:
                    _fail(state, att, decode, f"{type(e).__name__}: {e}")
                    continue
                finally:
                    decode.outstanding -= 1
                if _overloaded(dresp.status_code, dresp.content, dresp.headers):
                    _busy(state, att, decode, dresp.headers)
                    continue
                if dresp.status_code >= 500:
                    code = _upstream_error_code(dresp.content)
                    _fail(
                        state,
                        att,
                        _blame(prefill, decode, code),
                        _upstream_reason(dresp.status_code, dresp.content),
                    )
                    continue
                status = dresp.status_code
                if status >= 400:
                    m.errors.labels("upstream_rejected").inc()
                    return _passthrough_error(
                        dresp.content, status, dresp.headers.get("content-type")
                    )
                decode.served += 1
                report = _transfer_report(pparams, dresp.headers)
                m.report_transfer(report)
                m.ttft.observe(time.perf_counter() - start)
                return Response(
                    dresp.content if cfg.expose_topology else _without_kv_params(dresp.content),
                    status_code=dresp.status_code,
                    headers=_trace_headers(
                        request_id,
                        prefill,
                        decode,
                        report,
                        att.count,
                        dresp.headers,
                        cfg.expose_topology,
                    ),
                    media_type=dresp.headers.get("content-type", "application/json"),
                )

            decode.outstanding += 1
            dresp_s: httpx.Response | None = None
            try:
                dresp_s = await state.client.send(
                    state.client.build_request(
                        "POST", decode.url + endpoint, json=dbody, headers=up_headers
                    ),
                    stream=True,
                )
                if dresp_s.status_code in (429, 503):
                    content = await dresp_s.aread()
                    if _overloaded(dresp_s.status_code, content, dresp_s.headers):
                        await dresp_s.aclose()
                        decode.outstanding -= 1
                        _busy(state, att, decode, dresp_s.headers)
                        continue
                if dresp_s.status_code >= 500:
                    content = await dresp_s.aread()
                    raise _UpstreamStatus(
                        _upstream_reason(dresp_s.status_code, content),
                        _upstream_error_code(content),
                    )
                if dresp_s.status_code >= 400:
                    content = await dresp_s.aread()
                    await dresp_s.aclose()
                    decode.outstanding -= 1
                    status = dresp_s.status_code
                    m.errors.labels("upstream_rejected").inc()
                    return _passthrough_error(content, status, dresp_s.headers.get("content-type"))
                chunks = dresp_s.aiter_raw()
                # read the first chunk before committing: a failure here can still be retried
                first = await chunks.__anext__()
            except (httpx.HTTPError, _UpstreamStatus, StopAsyncIteration) as e:
                decode.outstanding -= 1
                if dresp_s is not None:
                    await dresp_s.aclose()
                if isinstance(e, StopAsyncIteration):
                    why, code = "empty stream", None
                else:
                    why = f"{type(e).__name__}: {e}"
                    code = e.code if isinstance(e, _UpstreamStatus) else None
                _fail(state, att, _blame(prefill, decode, code), why)
                continue
            except BaseException:
                decode.outstanding -= 1
                if dresp_s is not None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await dresp_s.aclose()
                raise
            status = dresp_s.status_code
            report = _transfer_report(pparams, dresp_s.headers)
            m.report_transfer(report)
            streaming_handed_off = True
            m.ttft.observe(time.perf_counter() - start)
            return _RelayResponse(
                _Relay(state, decode, dresp_s, first, chunks, start, endpoint, release),
                status_code=dresp_s.status_code,
                headers={
                    **_trace_headers(
                        request_id,
                        prefill,
                        decode,
                        report,
                        att.count,
                        dresp_s.headers,
                        cfg.expose_topology,
                    ),
                    "cache-control": "no-cache",
                },
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


class _Relay:
    """The decode's stream on its way to the client, and the book-keeping that must
    happen exactly once when it ends: also when the client left before the first
    byte (the body generator then never starts, so its ``finally`` never runs)."""

    def __init__(
        self,
        state: RouterState,
        decode: Instance,
        resp: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
        start: float,
        endpoint: str,
        release: Any,
    ) -> None:
        self.state, self.decode, self.resp = state, decode, resp
        self.first, self.chunks, self.start = first, chunks, start
        self.endpoint, self.release = endpoint, release
        self.status = str(resp.status_code)
        self.closed = False

    async def body(self) -> AsyncIterator[bytes]:
        try:
            yield self.first
            try:
                async for chunk in self.chunks:
                    yield chunk
            except httpx.HTTPError as e:
                # too late to retry: tell the client in-band and end the stream
                self.status = "stream_error"
                self.state.metrics.errors.labels("stream").inc()
                log.warning("decode %s failed mid-stream: %s", self.decode.url, e)
                err = {
                    "error": {
                        "message": f"decode instance failed mid-stream: {type(e).__name__}",
                        "type": "server_error",
                        "code": "upstream_stream_error",
                    }
                }
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            else:
                self.decode.served += 1
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.decode.outstanding -= 1
        self.release()
        m = self.state.metrics
        m.requests.labels(self.endpoint, self.status).inc()
        m.latency.labels(self.endpoint).observe(time.perf_counter() - self.start)
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await self.resp.aclose()


class _RelayResponse(StreamingResponse):
    def __init__(self, relay: _Relay, **kw: Any) -> None:
        super().__init__(relay.body(), **kw)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


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


def _warn_open(cfg: RouterConfig) -> None:
    if cfg.token:
        log.info("registration needs the router token (Authorization: Bearer)")
    else:
        log.warning(
            "no router token configured: /register, /heartbeat, /deregister and /instances "
            "answer loopback clients only (set --token or $%s for remote workers)",
            TOKEN_ENV,
        )


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


def token_from_env() -> str | None:
    """The router token from ``$AIOKV_ROUTER_TOKEN`` (``None`` when unset or empty)."""
    return envs.get(TOKEN_ENV) or None
