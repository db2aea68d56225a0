"""A prefill or decode worker serving the demo model over an OpenAI-style API.

    python -m aiokv.demo.worker --role prefill --router http://127.0.0.1:8000
    python -m aiokv.demo.worker --role decode  --router http://127.0.0.1:8000

The app's lifespan starts an :class:`aiokv.Engine` and a
:class:`aiokv.kv.KVConnector` over the model's paged cache, and keeps the
worker registered with the router (:mod:`aiokv.serving`).

``kv_transfer_params`` in a request body select the leg:

``{"role": "producer", "request_id", "consumer_kv_address"}`` (prefill)
    prefill the prompt, send its KV blocks to the consumer's engine
    (returns when that engine holds them), free the blocks, answer with the
    first token and ``kv_transfer_params`` ``{num_tokens, num_blocks,
    first_token, transfer_seconds, transfer_bytes, prefill_seconds}``.
``{"role": "consumer", "request_id", "producer_kv_address", "num_tokens", "first_token", ...}``
    allocate blocks, collect the KV into them, decode greedily (SSE when
    ``stream`` is true).

Without ``kv_transfer_params`` the worker serves the request on its own.
Every response choice carries ``token_ids`` (the toy tokenizer is lossy).
Model compute runs on one dedicated thread, so the event loop never blocks.
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Any, Literal, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .._exceptions import AiokvError
from .model import ModelConfig, OutOfBlocksError, TinyTransformer, chat_prompt, detokenize, tokenize

__all__ = ["DEFAULT_MODEL_NAME", "WorkerConfig", "create_app", "main"]

log = logging.getLogger("aiokv.demo.worker")

DEFAULT_MODEL_NAME = "aiokv-demo"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Literal["prefill", "decode"]
    router_url: str | None = None
    model_name: str = DEFAULT_MODEL_NAME
    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "cpu"
    transport: str = "auto"
    kv_listen: str = "127.0.0.1:0"
    heartbeat_interval: float = 0.5
    kv_timeout: float = 30.0
    default_max_tokens: int = 16


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
        self.cfg = cfg
        self.model: TinyTransformer | None = None
        self.connector: Any = None
        self.engine: Any = None
        self.layout: Any = None
        self.executor = ThreadPoolExecutor(
            1, thread_name_prefix="aiokv-model", initializer=self._init_thread
        )

    def _init_thread(self) -> None:
        if self.cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.cfg.device))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @property
    def m(self) -> TinyTransformer:
        assert self.model is not None, "worker not started"
        return self.model

    # -- request parsing ---------------------------------------------------------------

    def parse(self, body: Any, chat: bool) -> tuple[list[int], int, bool, dict[str, Any] | None]:
        if not isinstance(body, dict):
            raise _BadRequest(400, "request body must be a JSON object", "invalid_json")
        model = body.get("model")
        if model != self.cfg.model_name:
            raise _BadRequest(
                404,
                f"model {model!r} is not served here (serving {self.cfg.model_name!r})",
                "model_not_found",
            )
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise _BadRequest(400, "'messages' must be a list of objects", "invalid_messages")
            tokens = tokenize(chat_prompt(messages))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                tokens = tokenize(prompt)
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
        if len(tokens) + 1 > self.m.config.max_positions:
            raise _BadRequest(400, "prompt too long for the model", "prompt_too_long")
        max_tokens = (
            body.get("max_tokens")
            or body.get("max_completion_tokens")
            or self.cfg.default_max_tokens
        )
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _BadRequest(400, "'max_tokens' must be a positive integer", "invalid_max_tokens")
        max_tokens = min(max_tokens, self.m.config.max_positions - len(tokens))
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
        text = detokenize(toks)
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

    def chunk(self, rid: str, chat: bool, tok: int, last: bool) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": [tok],
            "finish_reason": "length" if last else None,
        }
        if chat:
            choice["delta"] = {"content": detokenize([tok])}
        else:
            choice["text"] = detokenize([tok])
        data = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.cfg.model_name,
            "choices": [choice],
        }
        return f"data: {json.dumps(data)}\n\n".encode()

    # -- the two legs ----------------------------------------------------------------------

    async def produce(
        self, rid: str, chat: bool, tokens: list[int], kv: dict[str, Any]
    ) -> Response:
        request_id = _str(kv, "request_id")
        consumer = _str(kv, "consumer_kv_address")
        t0 = time.perf_counter()
        try:
            first, blocks = await self.run(self.m.prefill, tokens)
        except OutOfBlocksError as e:
            return _err(503, str(e), "out_of_kv_blocks", "server_error")
        t1 = time.perf_counter()
        try:
            await self.connector.send_request(
                request_id, blocks, to=consumer, timeout=self.cfg.kv_timeout
            )
        except AiokvError as e:
            log.warning("KV send of %s to %s failed: %r", request_id, consumer, e)
            return _err(
                502,
                f"KV transfer to {consumer} failed: {type(e).__name__}: {e}",
                "kv_transfer_failed",
                "server_error",
            )
        finally:
            self.executor.submit(self.m.free, blocks)  # ordered after any compute on the thread
        t2 = time.perf_counter()
        params = {
            "num_tokens": len(tokens),
            "num_blocks": len(blocks),
            "first_token": first,
            "prefill_seconds": round(t1 - t0, 6),
            "transfer_seconds": round(t2 - t1, 6),
            "transfer_bytes": int(self.layout.request_nbytes(len(blocks))),
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
        request_id = _str(kv, "request_id")
        producer = _str(kv, "producer_kv_address")
        num_tokens = _int(kv, "num_tokens", 1)
        first = _int(kv, "first_token")
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
        try:
            blocks = self.m.allocator.allocate(self.m.blocks_for(num_tokens))
        except OutOfBlocksError as e:
            return _err(503, str(e), "out_of_kv_blocks", "server_error")
        t0 = time.perf_counter()
        try:
            await self.connector.recv_request(
                request_id, blocks, frm=producer, timeout=self.cfg.kv_timeout
            )
        except BaseException as e:
            self.executor.submit(self.m.free, blocks)
            if isinstance(e, AiokvError):
                log.warning("KV recv of %s from %s failed: %r", request_id, producer, e)
                return _err(
                    500,
                    f"KV receive from {producer} failed: {type(e).__name__}: {e}",
                    "kv_recv_failed",
                    "server_error",
                )
            raise
        params = {**kv, "recv_seconds": round(time.perf_counter() - t0, 6)}
        if not stream:
            try:
                toks = await self.run(self.m.decode, blocks, num_tokens, first, max_tokens)
            finally:
                self.executor.submit(self.m.free, blocks)
            return JSONResponse(self.completion(rid, chat, toks, num_tokens, params))
        return self.stream_session(rid, chat, blocks, num_tokens, first, max_tokens)

    def stream_session(
        self, rid: str, chat: bool, blocks: list[int], num_tokens: int, first: int, n: int
    ) -> StreamingResponse:
        """Stream ``n`` tokens decoded from ``blocks`` as SSE; the blocks are freed at the end."""
        try:
            session = self.m.decode_session(blocks, num_tokens, first)
        except BaseException:
            self.executor.submit(self.m.free, blocks)
            raise

        def cleanup() -> None:
            session.close()
            self.m.free(blocks)

        async def sse() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    tok = await self.run(session.step)
                    yield self.chunk(rid, chat, tok, i == n - 1)
                yield b"data: [DONE]\n\n"
            finally:
                # on the model thread, after any step still running there (even if we were cancelled)
                self.executor.submit(cleanup)

        return StreamingResponse(
            sse(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )

    async def local(
        self, rid: str, chat: bool, tokens: list[int], max_tokens: int, stream: bool
    ) -> Response:
        """Serve a whole request on this worker (no disaggregation)."""
        try:
            first, blocks = await self.run(self.m.prefill, tokens)
        except OutOfBlocksError as e:
            return _err(503, str(e), "out_of_kv_blocks", "server_error")
        if not stream:
            try:
                toks = await self.run(self.m.decode, blocks, len(tokens), first, max_tokens)
            finally:
                self.executor.submit(self.m.free, blocks)
            return JSONResponse(self.completion(rid, chat, toks, len(tokens)))
        return self.stream_session(rid, chat, blocks, len(tokens), first, max_tokens)

    async def handle(self, request: Request, chat: bool) -> Response:
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _BadRequest(
                    400, f"request body is not valid JSON: {e}", "invalid_json"
                ) from None
            tokens, max_tokens, stream, kv = self.parse(body, chat)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if kv is None:
                return await self.local(rid, chat, tokens, max_tokens, stream)
            role = kv.get("role")
            if role == "producer":
                if self.cfg.role != "prefill":
                    raise _BadRequest(
                        400, "this is a decode worker; it cannot produce KV", "wrong_role"
                    )
                return await self.produce(rid, chat, tokens, kv)
            if role == "consumer":
                if self.cfg.role != "decode":
                    raise _BadRequest(
                        400, "this is a prefill worker; it cannot consume KV", "wrong_role"
                    )
                return await self.consume(rid, chat, tokens, max_tokens, stream, kv)
            raise _BadRequest(
                400, "kv_transfer_params.role must be 'producer' or 'consumer'", "invalid_kv_params"
            )
        except _BadRequest as e:
            return _err(e.status, e.message, e.code)


def create_app(cfg: WorkerConfig, url: str = "") -> FastAPI:
    """The worker app; ``url`` is this worker's own base URL as the router should call it."""
    w = _Worker(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import aiokv
        from aiokv.kv import FlashAttentionLayout, KVConnector

        from ..serving import worker_lifespan

        mc = cfg.model
        w.model = await w.run(TinyTransformer, mc, cfg.device)
        w.layout = FlashAttentionLayout(
            num_layers=mc.num_layers,
            num_blocks=mc.num_blocks,
            block_size=mc.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype="float32",
        )
        # the layout is offered at connection set-up: incompatible peers are refused early
        engine_cfg = aiokv.EngineConfig(
            listen=cfg.kv_listen,
            device=cfg.device,
            transport=cfg.transport,
            layout=w.layout.to_wire(),
        )

        async def on_engine(engine: Any) -> None:
            w.engine = engine
            w.connector = KVConnector(engine, w.layout, w.m.kv_caches)

        try:
            async with worker_lifespan(
                engine_cfg,
                router_url=cfg.router_url,
                role=cfg.role,
                url=url,
                model=cfg.model_name,
                heartbeat_interval=cfg.heartbeat_interval,
                on_engine=on_engine,
            ):
                log.info("%s worker up: http %s, kv %s", cfg.role, url, w.engine.address)
                yield
        finally:
            closer = getattr(w.connector, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            w.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title=f"aiokv demo {cfg.role} worker", lifespan=lifespan)
    app.state.worker = w

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await w.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await w.handle(request, chat=True)

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "role": cfg.role,
                "kv_address": w.engine.address if w.engine else None,
                "free_blocks": w.m.allocator.num_free,
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
        return JSONResponse({"role": cfg.role, "engine": data})

    return app


async def _watch_parent(pid: int) -> None:
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != pid:
            break
    log.warning("parent %d is gone; exiting", pid)


async def _amain(args: argparse.Namespace) -> None:
    from ..serving import bind_socket, serve_app, socket_url

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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiokv.demo.worker", description="aiokv demo worker")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--router", default=None, help="router base URL to register with")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--advertise-host", default=None, help="host in the URL given to the router")
    p.add_argument("--kv-listen", default=None, help="engine listen address (default HOST:0)")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    p.add_argument("--device", default="cpu")
    p.add_argument("--transport", default="auto", choices=("auto", "tcp", "nccl"))
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 = reproducible)"
    )
    p.add_argument("--ready-file", default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
