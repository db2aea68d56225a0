"""The OpenAI request parameters of the demo worker: which it honours, which it refuses.

The demo model decodes greedily, one character per token. Honoured:

``stop``
    a string or up to 4 strings; the text ends before the first one found
    (``finish_reason: "stop"``), also across streamed chunks (text that may
    begin a stop string is held back until it is clear).
``n``
    1 to 16 choices. Greedy decoding gives every choice the same text, as any
    OpenAI-compatible server does at temperature 0.
``stream_options.include_usage``
    a last chunk with empty ``choices`` and the ``usage``; the others carry
    ``"usage": null``.
``seed``
    accepted: greedy output is the same for every seed.

Refused with 400 ``unsupported_parameter`` unless left out or at their neutral
value: ``temperature`` (0), ``top_p`` (1), ``echo``, ``logprobs``,
``top_logprobs``, ``best_of`` (1), ``presence_penalty`` / ``frequency_penalty``
(0), ``logit_bias`` ({}), ``suffix``, ``response_format`` (``{"type":
"text"}``), ``tools`` / ``tool_choice`` / ``functions`` / ``function_call``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_N", "ParameterError", "Sampling"]

MAX_N = 16
_MAX_STOP = 4
_MAX_STOP_CHARS = 256

#: parameter -> the values that ask for nothing this worker does not do
_NEUTRAL: Mapping[str, tuple[object, ...]] = {
    "temperature": (None, 0, 0.0),
    "top_p": (None, 1, 1.0),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class ParameterError(ValueError):
    """A parameter the worker cannot honour (``code``: the OpenAI error code)."""

    def __init__(self, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.code = code


def _neutral(value: object, allowed: tuple[object, ...]) -> bool:
    # bool is an int: True must not pass for 1, nor False for 0
    return any(value == a and type(value) is type(a) for a in allowed if a is not None) or (
        value is None and None in allowed
    )


@dataclass(frozen=True, slots=True)
class Sampling:
    """What one request asks of the decoding besides the prompt and ``max_tokens``."""

    n: int = 1
    stop: tuple[str, ...] = ()
    include_usage: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Sampling:
        for name, allowed in _NEUTRAL.items():
            if name in body and not _neutral(body[name], allowed):
                raise ParameterError(
                    f"'{name}' is not supported: this worker decodes greedily and honours "
                    f"only n, stop, seed and stream_options.include_usage "
                    f"(leave '{name}' out or set it to {allowed[1]!r})"
                )
        n = body.get("n")
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise ParameterError(f"'n' must be an integer from 1 to {MAX_N}", "invalid_n")
        stop = body.get("stop")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > _MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= _MAX_STOP_CHARS for s in stops)
        ):
            raise ParameterError(
                f"'stop' must be a string or a list of at most {_MAX_STOP} non-empty strings",
                "invalid_stop",
            )
        opts = body.get("stream_options")
        include_usage = False
        if opts is not None:
            if not isinstance(opts, dict) or not all(
                k == "include_usage" and isinstance(v, bool) for k, v in opts.items()
            ):
                raise ParameterError("'stream_options' may hold 'include_usage' (a boolean) only")
            include_usage = bool(opts.get("include_usage", False))
        return cls(n=n, stop=tuple(stops), include_usage=include_usage)

    # -- whole answers ---------------------------------------------------------------------

    def finish(self, data: dict[str, Any], chat: bool) -> dict[str, Any]:
        """A non-streamed answer (one choice) with ``stop`` and ``n`` applied."""
        choice = data["choices"][0]
        text = _text(choice, chat)
        cut = self._first_stop(text)
        if cut is not None:
            idx, s = cut
            _set_text(choice, chat, text[:idx])
            # one token per character: the tokens up to the one completing the stop string
            choice["token_ids"] = choice["token_ids"][: idx + len(s)]
            choice["finish_reason"] = "stop"
        data["choices"] = [{**choice, "index": i} for i in range(self.n)]
        usage = data.get("usage")
        if isinstance(usage, dict):
            produced = len(choice["token_ids"]) * self.n
            usage["completion_tokens"] = produced
            usage["total_tokens"] = usage["prompt_tokens"] + produced
        return data

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        hits = [(text.find(s), s) for s in self.stop if s in text]
        return min(hits) if hits else None

    # -- streams ---------------------------------------------------------------------------

    async def stream(
        self, chunks: AsyncIterable[str | bytes | memoryview], n_prompt: int, chat: bool
    ) -> AsyncIterator[bytes]:
        """The worker's SSE stream (one event per chunk, one choice each) with ``stop``,
        ``n`` and ``include_usage`` applied; a stop closes the stream underneath."""
        pending = ""
        produced = 0
        last: dict[str, Any] | None = None
        try:
            async for part in chunks:
                raw = part.encode() if isinstance(part, str) else bytes(part)
                if raw.startswith(b"data: [DONE]"):
                    break
                data = json.loads(raw.removeprefix(b"data: "))
                if not data.get("choices"):  # an error event: passed on as it is
                    yield _event(data)
                    continue
                choice = data["choices"][0]
                produced += len(choice.get("token_ids") or [])
                buf = pending + _text(choice, chat)
                cut = self._first_stop(buf)
                if cut is not None:
                    out, pending = buf[: cut[0]], ""
                    choice["finish_reason"] = "stop"
                elif choice.get("finish_reason") is not None:
                    out, pending = buf, ""
                else:
                    keep = self._held(buf)
                    out, pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
                _set_text(choice, chat, out)
                data["choices"] = [{**choice, "index": i} for i in range(self.n)]
                if self.include_usage:
                    data["usage"] = None
                last = data
                yield _event(data)
                if cut is not None:
                    break
        finally:
            if isinstance(chunks, AsyncGenerator):
                await chunks.aclose()
        if self.include_usage and last is not None:
            produced *= self.n
            usage = {
                "prompt_tokens": n_prompt,
                "completion_tokens": produced,
                "total_tokens": n_prompt + produced,
            }
            yield _event({**last, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def _held(self, text: str) -> int:
        """How many characters at the end of ``text`` may begin a stop string."""
        return max(
            (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )


def _text(choice: Mapping[str, Any], chat: bool) -> str:
    if not chat:
        return str(choice.get("text") or "")
    part = choice.get("message") or choice.get("delta") or {}
    return str(part.get("content") or "")


def _set_text(choice: dict[str, Any], chat: bool, text: str) -> None:
    if not chat:
        choice["text"] = text
    elif "message" in choice:
        choice["message"] = {**choice["message"], "content": text}
    else:
        choice["delta"] = {**choice.get("delta", {}), "content": text}


def _event(data: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
