"""Request validation: bounded body reading, JSON limits, and the OpenAI parameter policy."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from aiokv.serving.router.config import _MAX_INT_DIGITS, _MAX_NAME, COMPLETIONS, RouterConfig
from aiokv.serving.router.registry import (
    Registry,
)

log = logging.getLogger("aiokv.serving.router")

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
