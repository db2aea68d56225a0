"""A prefill or decode worker serving the demo model over an OpenAI-style API.

    python -m aiokv.serving.demo.worker --role prefill --router http://127.0.0.1:8000
    python -m aiokv.serving.demo.worker --role decode  --router http://127.0.0.1:8000

The app's lifespan starts an :class:`aiokv.Engine` over the model's paged
cache and keeps the worker registered with the router (:mod:`aiokv.serving`;
the router token comes from ``--router-token`` or ``$AIOKV_ROUTER_TOKEN``).

The worker speaks vLLM's disaggregation contract, so the router treats it
like a vLLM instance running NixlConnector. ``kv_transfer_params`` in a
request body select the leg:

``{"do_remote_decode": true, ...}`` (prefill, sent with ``max_tokens: 1``)
    prefill the prompt, keep its KV blocks and hold them for the decode side to
    pull (:meth:`aiokv.kv.KVConnector.serve_request`), and answer with the first
    token and ``kv_transfer_params`` ``{do_remote_prefill: true, do_remote_decode:
    false, remote_engine_id, remote_host, remote_port (the engine's address),
    remote_block_ids, remote_request_id, num_tokens, num_blocks, first_token,
    transfer_bytes, prefill_seconds}``. The blocks are freed once the decode side
    has them, when it declines them (it refused the request: it GETs the
    request's ``"#decline"`` ticket), or after ``kv_timeout`` seconds.
``{"do_remote_prefill": true, "remote_host", "remote_port", ...}`` (decode)
    allocate blocks, fetch the KV from the prefill's engine straight into them
    (:meth:`~aiokv.kv.KVConnector.fetch_request`), decode greedily (SSE when
    ``stream`` is true). The response carries ``x-aiokv-transfer-seconds`` /
    ``x-aiokv-transfer-bytes`` / ``x-aiokv-kv-plane`` (``ipc`` or ``engine``) headers.

On CUDA the connector uses the same-host IPC plane (docs/ipc.md) where it works
(both workers on one host, authenticated engines: ``--kv-secret`` or
``$AIOKV_KV_SECRET``, the same on both), else the engine's transport (NCCL or
TCP). ``--no-ipc`` turns the plane off.

The request id is the ``X-Request-Id`` header (one is made up without it).
Without ``kv_transfer_params`` the worker serves the request on its own.
Every response choice carries ``token_ids`` (the toy tokenizer is lossy).

Admission is by KV blocks: a request takes every block it will need (prompt and
``max_tokens``) before it computes, so a stream never runs out midway. When they are
not free it waits, first come first served, up to ``admit_timeout`` seconds with at
most ``max_waiting`` others, then gets 503 ``out_of_kv_blocks`` with ``Retry-After``
(the router takes that as load, not failure). A request that needs more blocks than
the cache has gets 400. A stream that fails midway ends with an error event and
``[DONE]``.
Model compute runs on one dedicated thread, so the event loop never blocks.
torch is imported only when the worker starts, so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from aiokv import envs
from aiokv._exceptions import AiokvError
from aiokv.envs import engine_overrides
from aiokv.kv._triton import apply_env as apply_process_env
from aiokv.serving.demo.sampling import ParameterError, Sampling

if TYPE_CHECKING:
    from aiokv.serving.demo.model import ModelConfig, TinyTransformer

__all__ = ["DEFAULT_MODEL_NAME", "KV_SECRET_ENV", "WorkerConfig", "create_app", "main"]

#: the environment variable holding the engines' shared CURVE secret
KV_SECRET_ENV = "AIOKV_KV_SECRET"

log = logging.getLogger("aiokv.serving.demo.worker")

DEFAULT_MODEL_NAME = "aiokv-demo"
T = TypeVar("T")
_MAX_BODY = 8 * 1024 * 1024  # above the router's default 4 MiB


def _default_model() -> ModelConfig:
    from aiokv.serving.demo.model import ModelConfig

    return ModelConfig()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Literal["prefill", "decode"]
    router_url: str | None = None
    model_name: str = DEFAULT_MODEL_NAME
    model: ModelConfig = field(default_factory=_default_model)
    device: str = "cpu"
    transport: str = "auto"
    kv_listen: str = "127.0.0.1:0"
    heartbeat_interval: float = 0.5
    kv_timeout: float = 30.0
    default_max_tokens: int = 16
    router_token: str | None = None  # default: $AIOKV_ROUTER_TOKEN
    #: host other machines reach the engine at (when it listens on a wildcard)
    advertise_host: str | None = None
    #: the engines' shared CURVE secret (default: $AIOKV_KV_SECRET; none: no CURVE)
    kv_secret: str | None = None
    #: on CUDA, the same-host IPC plane where it works (docs/ipc.md)
    ipc: bool = True
    #: a request waits this long for its KV blocks, with at most ``max_waiting`` others
    admit_timeout: float = 20.0
    max_waiting: int = 256


#: the ``Retry-After`` (seconds) of an overloaded worker's 503
RETRY_AFTER = 1
#: declines of refused prefilled requests in flight at once (beyond: the prefill's
#: ``kv_timeout`` frees those blocks)
_MAX_DECLINES = 64


def decline_name(request_id: str) -> str:
    """The once-published ticket a decode worker GETs to tell the prefill that it
    refused ``request_id``: the prefill frees the request's blocks at once."""
    return f"{request_id}#decline"


class _Overloaded(Exception):
    """No KV blocks for a request within the admission bounds."""


class _Admission:
    """KV-block admission: requests wait first come first served for their blocks.

    ``take`` runs on the event loop; ``pump`` (after blocks were freed, on the loop)
    hands free blocks to the waiters in order, so a large request is not starved by
    smaller ones behind it.
    """

    def __init__(
        self, allocator: Any, out_of_blocks: type[Exception], max_waiting: int, timeout: float
    ) -> None:
        self.allocator = allocator
        self.out_of_blocks = out_of_blocks
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.waiters: collections.deque[tuple[int, asyncio.Future[list[int]]]] = collections.deque()
        self.refused = 0
        self.waited = 0

    async def take(self, n: int) -> list[int]:
        if n > self.allocator.num_blocks:
            raise _BadRequest(
                400,
                f"the request needs {n} KV blocks; the cache has {self.allocator.num_blocks}",
                "context_length_exceeded",
            )
        if not self.waiters and n <= self.allocator.num_free:
            with contextlib.suppress(self.out_of_blocks):
                return list(self.allocator.allocate(n))
        if len(self.waiters) >= self.max_waiting:
            self.refused += 1
            raise _Overloaded(f"no KV blocks free and {len(self.waiters)} requests waiting")
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self.waiters.append(entry)
        self.waited += 1
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except BaseException as exc:
            # timed out or cancelled: leave the queue; blocks granted meanwhile go back
            with contextlib.suppress(ValueError):
                self.waiters.remove(entry)
            if fut.done() and not fut.cancelled():
                self.allocator.free(fut.result())
            else:
                fut.cancel()
            self.pump()
            if isinstance(exc, TimeoutError):
                self.refused += 1
                raise _Overloaded(f"no {n} KV blocks free within {self.timeout:g}s") from None
            raise

    def pump(self) -> None:
        while self.waiters:
            n, fut = self.waiters[0]
            if fut.done():
                self.waiters.popleft()
                continue
            if n > self.allocator.num_free:
                return
            self.waiters.popleft()
            fut.set_result(list(self.allocator.allocate(n)))


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _err(
    status: int, message: str, code: str, etype: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "code": code}}, status)


def _int(params: dict[str, Any], key: str, lo: int = 0) -> int:
    v = params.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise _BadRequest(
            400, f"kv_transfer_params.{key} must be an integer >= {lo}", "invalid_kv_params"
        )
    return v


def _str(params: dict[str, Any], key: str) -> str:
    v = params.get(key)
    if not isinstance(v, str) or not v:
        raise _BadRequest(
            400, f"kv_transfer_params.{key} must be a non-empty string", "invalid_kv_params"
        )
    return v


class _Worker:
    """State shared by the handlers of one worker app."""

    def __init__(self, cfg: WorkerConfig) -> None:
        from aiokv.serving.demo import model as model_mod

        self.cfg = cfg
        self.mod = model_mod
        self.model: TinyTransformer | None = None
        self.engine: Any = None
        #: the serving helper's PeerWarmer: opens sessions to peers ahead of requests
        self.warmer: Any = None
        self.layout: Any = None
        #: the KVConnector over the model's cache (made once the engine runs)
        self.con: Any = None
        #: the prefill side's serve_request tasks (each frees its blocks at the end)
        self.serving: set[asyncio.Task[None]] = set()
        #: the decode side's declines of prefilled requests it refused (bounded)
        self.declines: set[asyncio.Task[None]] = set()
        self.admission: _Admission | None = None
        self.executor = ThreadPoolExecutor(
            1, thread_name_prefix="aiokv-model", initializer=self._init_thread
        )

    def _init_thread(self) -> None:
        if self.cfg.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self.cfg.device))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @property
    def kv_address(self) -> str:
        """The engine's address as other machines reach it."""
        from aiokv.serving.lifespan import _with_host

        return _with_host(str(self.engine.address), self.cfg.advertise_host)

    @property
    def m(self) -> TinyTransformer:
        assert self.model is not None, "worker not started"
        return self.model

    async def take_blocks(self, num_tokens: int, max_tokens: int) -> list[int]:
        """Every block a request needs: its prompt and the ``max_tokens`` it generates
        (the last one is never fed back). Waits for them (see :class:`_Admission`)."""
        assert self.admission is not None, "worker not started"
        return await self.admission.take(self.m.blocks_for(num_tokens + max_tokens - 1))

    def free_blocks(self, blocks: list[int]) -> None:
        """Free ``blocks`` on the model thread (after any step still using them), then
        hand the room to the requests waiting for blocks."""
        loop = asyncio.get_running_loop()
        adm = self.admission

        def free() -> None:
            self.m.free(blocks)
            if adm is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(adm.pump)

        self.executor.submit(free)

    def decline(self, body: Any) -> None:
        """This decode worker refused a prefilled request: tell its prefill (a GET of the
        request's decline ticket), which frees the request's blocks at once rather than
        after ``kv_timeout``."""
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if (
            self.cfg.role != "decode"
            or self.engine is None
            or not isinstance(kv, dict)
            or kv.get("do_remote_prefill") is not True
            or len(self.declines) >= _MAX_DECLINES
        ):
            return
        try:
            host = _str(kv, "remote_host")
            port = _int(kv, "remote_port", 1)
            request_id = _str(kv, "remote_request_id")
        except _BadRequest:
            return
        if port > 65535 or len(host) > 255 or len(request_id) > 200:
            return
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

        async def send() -> None:
            with contextlib.suppress(AiokvError):
                await self.engine.get(decline_name(request_id), frm=address, timeout=5.0)

        task = asyncio.create_task(send(), name=f"aiokv-demo-decline-{request_id}")
        self.declines.add(task)
        task.add_done_callback(self.declines.discard)

    # -- request parsing ---------------------------------------------------------------

    def parse(self, body: Any, chat: bool) -> tuple[list[int], int, bool, dict[str, Any] | None]:
        if not isinstance(body, dict):
            raise _BadRequest(400, "request body must be a JSON object", "invalid_json")
        model = body.get("model")
        if model != self.cfg.model_name:
            raise _BadRequest(
                404,
                f"model {str(model)[:64]!r} is not served here (serving {self.cfg.model_name!r})",
                "model_not_found",
            )
        mod = self.mod
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise _BadRequest(400, "'messages' must be a list of objects", "invalid_messages")
            tokens = mod.tokenize(mod.chat_prompt(messages))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                tokens = mod.tokenize(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(
                    isinstance(t, int)
                    and not isinstance(t, bool)
                    and 0 <= t < self.m.config.vocab_size
                    for t in prompt
                )
            ):
                tokens = list(prompt)
            else:
                raise _BadRequest(
                    400, "'prompt' must be a string or a list of valid token ids", "invalid_prompt"
                )
        context = self.m.config.max_positions
        if len(tokens) + 1 > context:
            raise _BadRequest(
                400,
                f"the prompt has {len(tokens)} tokens; the model's context is {context} tokens",
                "context_length_exceeded",
            )
        max_tokens = (
            body.get("max_tokens")
            or body.get("max_completion_tokens")
            or self.cfg.default_max_tokens
        )
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _BadRequest(400, "'max_tokens' must be a positive integer", "invalid_max_tokens")
        if len(tokens) + max_tokens > context:
            raise _BadRequest(
                400,
                f"'max_tokens' {max_tokens} plus the prompt's {len(tokens)} tokens exceed the "
                f"model's context of {context} tokens (at most {context - len(tokens)} here)",
                "context_length_exceeded",
            )
        stream = bool(body.get("stream", False))
        kv = body.get("kv_transfer_params")
        if kv is not None and not isinstance(kv, dict):
            raise _BadRequest(400, "'kv_transfer_params' must be an object", "invalid_kv_params")
        return tokens, max_tokens, stream, kv

    # -- responses -----------------------------------------------------------------------

    def completion(
        self,
        rid: str,
        chat: bool,
        toks: list[int],
        n_prompt: int,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        text = self.mod.detokenize(toks)
        choice: dict[str, Any] = {"index": 0, "token_ids": toks, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.cfg.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": len(toks),
                "total_tokens": n_prompt + len(toks),
            },
        }
        if extra is not None:
            out["kv_transfer_params"] = extra
        return out

    def chunk(self, rid: str, chat: bool, tok: int, first: bool, last: bool) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": [tok],
            "finish_reason": "length" if last else None,
        }
        text = self.mod.detokenize([tok])
        if chat:
            # OpenAI's first chat delta names the speaker
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        data = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.cfg.model_name,
            "choices": [choice],
        }
        return f"data: {json.dumps(data)}\n\n".encode()

    def warm_model(self) -> None:
        """On the model thread, before serving: run each path a request takes once.

        The first call of each (prefill, gather, scatter, a decode step) pays one-off
        costs (allocations, torch's first dispatch of each op), which would otherwise
        land on the first request's TTFT.
        """
        from aiokv.kv import gather_blocks, scatter_blocks

        tokens = self.mod.tokenize("warm-up")
        first, blocks = self.m.prefill(tokens)
        try:
            buf = gather_blocks(self.m.kv_caches, self.layout, blocks)
            scatter_blocks(buf, self.m.kv_caches, self.layout, blocks)
            self.m.decode(blocks, len(tokens), first, 2)
        finally:
            self.m.free(blocks)

    # -- the two legs ----------------------------------------------------------------------

    def _prefill(self, tokens: list[int], blocks: list[int]) -> tuple[int, list[int]]:
        """On the model thread: prefill; the KV is in ``blocks`` when this returns."""
        first, blocks = self.m.prefill(tokens, blocks)
        if self.m.device.type == "cuda":
            import torch

            # written before the loop thread's connector reads or exports the blocks
            torch.cuda.current_stream().synchronize()
        return first, blocks

    async def _serve(
        self, request_id: str, blocks: list[int], published: asyncio.Future[None]
    ) -> None:
        """Hold a prefilled request's blocks for the decode side's fetch, or until it
        declines them (see :meth:`decline`); free them after."""
        import torch

        eng = self.engine
        name = decline_name(request_id)

        def on_published() -> None:
            if not published.done():
                published.set_result(None)

        eng.publish(name, torch.empty(0, dtype=torch.uint8), once=True)
        serve = asyncio.ensure_future(
            self.con.serve_request(
                request_id,
                blocks,
                timeout=self.cfg.kv_timeout,
                on_published=on_published,
            )
        )
        declined = asyncio.ensure_future(eng.wait_fetched(name, timeout=self.cfg.kv_timeout))
        try:
            done, _ = await asyncio.wait({serve, declined}, return_when=asyncio.FIRST_COMPLETED)
            if serve not in done and declined.exception() is None:
                serve.cancel()
                await asyncio.wait({serve})
                log.info("KV of %s declined by the decode side; its blocks are free", request_id)
            else:
                to = await serve
                log.debug("KV of %s went to %s", request_id, to)
        except AiokvError as e:
            log.warning("KV of %s was not fetched: %r", request_id, e)
        finally:
            for t in (serve, declined):
                t.cancel()
            await asyncio.wait({serve, declined})
            for t in (serve, declined):
                if not t.cancelled():
                    t.exception()  # retrieved: nothing logs "never retrieved"
            eng.unpublish(name)
            self.free_blocks(blocks)

    async def produce(self, rid: str, request_id: str, chat: bool, tokens: list[int]) -> Response:
        """Prefill leg: compute the KV, hold it for the decode side to pull."""
        t0 = time.perf_counter()
        # the prompt's blocks only: the decode side holds the ones it generates into
        blocks = await self.take_blocks(len(tokens), 1)
        try:
            first, blocks = await self.run(self._prefill, tokens, blocks)
        except BaseException:
            self.free_blocks(blocks)
            raise
        published: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._serve(request_id, blocks, published))
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)
        # answer once the decode side can fetch the KV (with a CPU cache the ticket is
        # published after the blocks were gathered, which takes a while under load)
        try:
            await asyncio.wait({published, task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # nobody will learn where the KV is: free it now
            raise
        if not published.done():
            return _err(500, "the KV could not be held for the decode side", "kv_hold_failed")
        address = self.kv_address
        host, _, port = address.rpartition(":")
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": address,
            "remote_block_ids": blocks,
            "remote_host": host.strip("[]"),
            "remote_port": int(port),
            "remote_request_id": request_id,
            "num_tokens": len(tokens),
            "num_blocks": len(blocks),
            "first_token": first,
            "transfer_bytes": self.layout.request_nbytes(len(blocks)),
            "prefill_seconds": round(time.perf_counter() - t0, 6),
        }
        return JSONResponse(self.completion(rid, chat, [first], len(tokens), params))

    async def consume(
        self,
        rid: str,
        chat: bool,
        tokens: list[int],
        max_tokens: int,
        stream: bool,
        kv: dict[str, Any],
    ) -> Response:
        """Decode leg: pull the KV from the prefill's engine, then decode."""
        host = _str(kv, "remote_host")
        port = _int(kv, "remote_port", 1)
        request_id = _str(kv, "remote_request_id")
        num_tokens = _int(kv, "num_tokens", 1)
        first = _int(kv, "first_token")
        remote_blocks = kv.get("remote_block_ids")
        if port > 65535 or len(host) > 255 or len(request_id) > 200:
            raise _BadRequest(400, "kv_transfer_params: bad remote address", "invalid_kv_params")
        if num_tokens != len(tokens):
            raise _BadRequest(
                400,
                f"the prompt has {len(tokens)} tokens but the KV holds {num_tokens}",
                "kv_prompt_mismatch",
            )
        if first >= self.m.config.vocab_size:
            raise _BadRequest(
                400, "kv_transfer_params.first_token out of range", "invalid_kv_params"
            )
        n_blocks = self.m.blocks_for(num_tokens)
        if not isinstance(remote_blocks, list) or len(remote_blocks) != n_blocks:
            raise _BadRequest(
                400,
                f"kv_transfer_params.remote_block_ids must list {n_blocks} blocks",
                "invalid_kv_params",
            )
        # the prompt's blocks (the KV lands there) and those the tokens are generated into
        blocks = await self.take_blocks(num_tokens, max_tokens)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.warmer is not None:
            # a peer the router has not listed yet (or whose warm-up failed): warm it for
            # the next request; this GET opens the session itself if it is not open yet
            self.warmer.warm([address])
        expected = self.layout.request_nbytes(n_blocks)
        t0 = time.perf_counter()
        try:
            plane = await self.con.fetch_request(
                request_id, blocks[:n_blocks], frm=address, timeout=self.cfg.kv_timeout
            )
            secs = time.perf_counter() - t0
            toks = (
                []
                if stream
                else await self.run(self.m.decode, blocks, num_tokens, first, max_tokens)
            )
        except BaseException as e:
            self.free_blocks(blocks)
            if isinstance(e, AiokvError):
                log.warning("KV fetch of %s from %s failed: %r", request_id, address, e)
                return _err(
                    502,
                    f"KV fetch from {address} failed: {type(e).__name__}: {str(e)[:200]}",
                    "kv_fetch_failed",
                    "server_error",
                )
            raise
        headers = {
            "x-aiokv-transfer-seconds": f"{secs:.6f}",
            "x-aiokv-transfer-bytes": str(expected),
            "x-aiokv-kv-plane": plane,
        }
        params = {**kv, "transfer_seconds": round(secs, 6), "transfer_bytes": expected}
        if not stream:
            self.free_blocks(blocks)
            return JSONResponse(
                self.completion(rid, chat, toks, num_tokens, params), headers=headers
            )
        resp = self.stream_session(rid, chat, blocks, num_tokens, first, max_tokens)
        resp.headers.update(headers)
        return resp

    def stream_session(
        self, rid: str, chat: bool, blocks: list[int], num_tokens: int, first: int, n: int
    ) -> StreamingResponse:
        """Stream ``n`` tokens decoded from ``blocks`` as SSE; the blocks are freed at the end."""
        try:
            session = self.m.decode_session(blocks, num_tokens, first)
        except BaseException:
            self.free_blocks(blocks)
            raise

        async def sse() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    try:
                        tok = await self.run(session.step)
                    except Exception as e:
                        # never a silent end: the client learns why, then the stream ends
                        log.exception("decode step of %s failed", rid)
                        err = {
                            "message": f"{type(e).__name__}: {str(e)[:200]}",
                            "type": "server_error",
                            "code": "decode_failed",
                        }
                        yield f"data: {json.dumps({'error': err})}\n\n".encode()
                        break
                    yield self.chunk(rid, chat, tok, i == 0, i == n - 1)
                yield b"data: [DONE]\n\n"
            finally:
                # on the model thread, after any step still running there (even if we were
                # cancelled); the blocks were all taken up front, so the session owns none
                self.executor.submit(session.close)
                self.free_blocks(blocks)

        return StreamingResponse(
            sse(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )

    async def local(
        self, rid: str, chat: bool, tokens: list[int], max_tokens: int, stream: bool
    ) -> Response:
        """Serve a whole request on this worker (no disaggregation)."""
        blocks = await self.take_blocks(len(tokens), max_tokens)
        try:
            first, blocks = await self.run(self.m.prefill, tokens, blocks)
            if not stream:
                toks = await self.run(self.m.decode, blocks, len(tokens), first, max_tokens)
        except BaseException:
            self.free_blocks(blocks)
            raise
        if not stream:
            self.free_blocks(blocks)
            return JSONResponse(self.completion(rid, chat, toks, len(tokens)))
        return self.stream_session(rid, chat, blocks, len(tokens), first, max_tokens)

    async def handle(self, request: Request, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            resp = await self._handle(request, chat, request_id[:200])
        except _BadRequest as e:
            resp = _err(e.status, e.message, e.code)
        except _Overloaded as e:
            resp = _err(503, str(e), "out_of_kv_blocks", "server_error")
            resp.headers["retry-after"] = str(RETRY_AFTER)
        resp.headers["x-request-id"] = request_id[:200]
        return resp

    async def _handle(self, request: Request, chat: bool, request_id: str) -> Response:
        raw = await request.body()
        if len(raw) > _MAX_BODY:
            raise _BadRequest(413, f"request body exceeds {_MAX_BODY} bytes", "body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise _BadRequest(
                400, f"request body is not valid JSON: {str(e)[:120]}", "invalid_json"
            ) from None
        try:
            return await self._dispatch(body, chat, request_id)
        except (_BadRequest, _Overloaded):
            self.decline(body)  # a prefilled request refused here: its prefill frees it now
            raise

    async def _dispatch(self, body: Any, chat: bool, request_id: str) -> Response:
        tokens, max_tokens, stream, kv = self.parse(body, chat)
        try:
            sampling = Sampling.from_body(body)
        except ParameterError as e:
            raise _BadRequest(400, str(e), e.code) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if not kv:
            resp = await self.local(rid, chat, tokens, max_tokens, stream)
            return _sampled(resp, sampling, chat, len(tokens))
        if kv.get("do_remote_decode") is True:
            if self.cfg.role != "prefill":
                raise _BadRequest(
                    400, "this is a decode worker; it does not prefill for others", "wrong_role"
                )
            return await self.produce(rid, request_id, chat, tokens)
        if kv.get("do_remote_prefill") is True:
            if self.cfg.role != "decode":
                raise _BadRequest(
                    400, "this is a prefill worker; it does not decode for others", "wrong_role"
                )
            resp = await self.consume(rid, chat, tokens, max_tokens, stream, kv)
            return _sampled(resp, sampling, chat, len(tokens))
        raise _BadRequest(
            400,
            "kv_transfer_params must set do_remote_decode (prefill) or do_remote_prefill (decode)",
            "invalid_kv_params",
        )


def _sampled(resp: Response, sampling: Sampling, chat: bool, n_prompt: int) -> Response:
    """A decoded answer with ``stop``, ``n`` and ``include_usage`` applied (sampling.py)."""
    if resp.status_code != 200:
        return resp
    if isinstance(resp, StreamingResponse):
        resp.body_iterator = sampling.stream(resp.body_iterator, n_prompt, chat)
        return resp
    data = sampling.finish(json.loads(bytes(resp.body)), chat)
    headers = {k: v for k, v in resp.headers.items() if k not in ("content-length", "content-type")}
    return JSONResponse(data, headers=headers)


def create_app(cfg: WorkerConfig, url: str = "") -> FastAPI:
    """The worker app; ``url`` is this worker's own base URL as the router should call it."""
    w = _Worker(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import aiokv
        from aiokv.kv import FlashAttentionLayout, IpcOptions, KVConnector
        from aiokv.serving.lifespan import worker_lifespan

        mc = cfg.model
        w.model = await w.run(w.mod.TinyTransformer, mc, cfg.device)
        w.layout = FlashAttentionLayout(
            num_layers=mc.num_layers,
            num_blocks=mc.num_blocks,
            block_size=mc.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype="float32",
        )
        await w.run(w.warm_model)
        w.admission = _Admission(
            w.m.allocator, w.mod.OutOfBlocksError, cfg.max_waiting, cfg.admit_timeout
        )
        # the layout is offered at connection set-up: incompatible peers are refused early
        secret = cfg.kv_secret if cfg.kv_secret is not None else envs.get(KV_SECRET_ENV) or None
        engine_cfg = aiokv.EngineConfig(
            listen=cfg.kv_listen,
            device=cfg.device,
            transport=cfg.transport,
            layout=w.layout.to_wire(),
            curve=aiokv.CurveConfig.from_secret(secret) if secret else None,
            **engine_overrides(),
        )

        use_ipc = cfg.ipc and w.m.device.type == "cuda"

        async def on_engine(engine: Any) -> None:
            w.engine = engine
            w.con = KVConnector(
                engine, w.layout, w.m.kv_caches, ipc=IpcOptions() if use_ipc else None
            )

        async def prepare(peer: str) -> None:
            # a decode worker maps each prefill's cache as soon as the router lists it
            # (IPC plane), so the first request does not wait for that
            if await w.con.prepare(peer):
                log.info("IPC plane: %s's cache mapped ahead", peer)

        try:
            async with worker_lifespan(
                engine_cfg,
                router_url=cfg.router_url,
                role=cfg.role,
                url=url,
                model=cfg.model_name,
                heartbeat_interval=cfg.heartbeat_interval,
                on_engine=on_engine,
                token=cfg.router_token,
                max_model_len=mc.max_positions,
                kv_host=cfg.advertise_host,
                after_connect=prepare if use_ipc and cfg.role == "decode" else None,
            ) as handle:
                w.warmer = handle.warmer
                log.info("%s worker up: http %s, kv %s", cfg.role, url, w.engine.address)
                try:
                    yield
                finally:
                    for t in list(w.serving):
                        t.cancel()
                    await asyncio.gather(*w.serving, return_exceptions=True)
                    await w.con.aclose()
        finally:
            w.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title=f"aiokv demo {cfg.role} worker", lifespan=lifespan)
    app.state.worker = w

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await w.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await w.handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model_name,
                        "object": "model",
                        "owned_by": "aiokv",
                        "max_model_len": cfg.model.max_positions,
                    }
                ],
            }
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "role": cfg.role,
                "kv_address": w.kv_address if w.engine else None,
                "free_blocks": w.m.allocator.num_free,
                "warm_peers": w.warmer.warm_peers if w.warmer is not None else [],
            }
        )

    @app.get("/stats")
    async def stats() -> Response:
        st = w.engine.statistics() if w.engine is not None else None
        data: dict[str, Any] = {}
        if st is not None:
            import dataclasses

            data = {
                k: v for k, v in dataclasses.asdict(st).items() if isinstance(v, (int, float, str))
            }
        adm = w.admission
        kv_blocks = (
            {
                "total": adm.allocator.num_blocks,
                "free": adm.allocator.num_free,
                "waiting": len(adm.waiters),
                "waited": adm.waited,
                "refused": adm.refused,
            }
            if adm is not None
            else {}
        )
        return JSONResponse({"role": cfg.role, "engine": data, "kv_blocks": kv_blocks})

    return app


async def _watch_parent(pid: int) -> None:
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != pid:
            break
    log.warning("parent %d is gone; exiting", pid)


async def _amain(args: argparse.Namespace) -> None:
    from aiokv.serving.lifespan import bind_socket, serve_app, socket_url

    sock = bind_socket(args.host, args.port)
    url = socket_url(sock, args.advertise_host)
    cfg = WorkerConfig(
        role=args.role,
        router_url=args.router,
        model_name=args.model_name,
        device=args.device,
        transport=args.transport,
        kv_listen=args.kv_listen or f"{args.host}:0",
        heartbeat_interval=args.heartbeat_interval,
        router_token=args.router_token,
        advertise_host=args.advertise_host,
        kv_secret=args.kv_secret,
        ipc=not args.no_ipc,
    )

    def on_started() -> None:
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(url)
            os.replace(tmp, args.ready_file)

    tasks = [
        asyncio.create_task(
            serve_app(create_app(cfg, url), sock, log_level=args.log_level, on_started=on_started)
        )
    ]
    if args.parent_pid:
        tasks.append(asyncio.create_task(_watch_parent(args.parent_pid)))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        sock.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aiokv.serving.demo.worker",
        description="A prefill or decode worker of the aiokv demo model: an OpenAI-style "
        "HTTP server (/v1/completions, /v1/chat/completions) with an aiokv engine that "
        "moves the KV cache to the decode side. It registers with the router when "
        "--router is given; the router may also list it with --prefill/--decode.",
    )
    p.add_argument(
        "--role", choices=("prefill", "decode"), required=True, help="which leg this worker serves"
    )
    p.add_argument(
        "--router", default=None, metavar="URL", help="router base URL to register with (optional)"
    )
    p.add_argument(
        "--router-token",
        default=None,
        metavar="TOKEN",
        help="the router's registration token (default $AIOKV_ROUTER_TOKEN)",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free one)")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host other machines reach this worker (HTTP and KV engine) at; needed when "
        "--host is a wildcard such as 0.0.0.0 (default: the listen address; the KV engine "
        "of a wildcard listen announces the host's outward address)",
    )
    p.add_argument(
        "--kv-listen",
        default=None,
        metavar="HOST:PORT",
        help="the engine's listen address for KV transfers (default HOST:0)",
    )
    p.add_argument(
        "--model-name", default=DEFAULT_MODEL_NAME, help="model name served (default %(default)s)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default %(default)s)")
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "tcp", "nccl"),
        help="KV transport: auto picks NCCL for CUDA tensors when both sides can",
    )
    p.add_argument(
        "--kv-secret",
        default=None,
        metavar="SECRET",
        help="shared secret of the KV engines (CURVE authentication and encryption; at least "
        f"16 bytes, the same on every worker; default ${KV_SECRET_ENV}, unset: none). The "
        "same-host IPC plane is used only between authenticated engines",
    )
    p.add_argument(
        "--no-ipc",
        action="store_true",
        help="on CUDA, never use the same-host IPC plane (NCCL or TCP only)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.5,
        help="seconds between heartbeats to the router (default %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 = reproducible)"
    )
    p.add_argument("--ready-file", default=None, help="write this worker's URL here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--log-level",
        default="warning",
        help="debug, info, warning, error (heartbeats are logged at debug)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.log_level.lower() != "debug":
        # httpx logs every request at info, heartbeats included
        logging.getLogger("httpx").setLevel(logging.WARNING)
    import torch

    apply_process_env()
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
