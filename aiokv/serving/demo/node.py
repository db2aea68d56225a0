"""A demo worker's engine side: the model, its KV blocks, the aiokv connector, and the
prefill / decode work behind the HTTP routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from aiokv._exceptions import AiokvError
from aiokv.serving.demo.admission import (
    _MAX_DECLINES,
    RETRY_AFTER,
    _Admission,
    _BadRequest,
    _err,
    _int,
    _Overloaded,
    _str,
    decline_name,
)
from aiokv.serving.demo.config import _MAX_BODY, WorkerConfig
from aiokv.serving.demo.sampling import ParameterError, Sampling

if TYPE_CHECKING:
    from aiokv.serving.demo.model import TinyTransformer

log = logging.getLogger("aiokv.serving.demo.worker")

T = TypeVar("T")


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
