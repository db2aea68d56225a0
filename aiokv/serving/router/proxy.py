"""The upstream legs: prefill then decode over HTTP, retries, overload back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from aiokv.serving.router.config import (
    _MAX_ERROR_PASSTHROUGH,
    _MAX_HOPS,
    HOP_HEADER,
    prefill_kv_params,
)
from aiokv.serving.router.registry import (
    Instance,
    NoInstanceError,
    UnknownModelError,
)
from aiokv.serving.router.relay import _Relay, _RelayResponse
from aiokv.serving.router.state import RouterState
from aiokv.serving.router.validation import _error, _HTTPError, _read_json_object, _short, _validate

log = logging.getLogger("aiokv.serving.router")


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
