"""The streaming relay: the decode's answer streamed to the client, ending with an error event and ``[DONE]`` when the decode breaks."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi.responses import StreamingResponse

from aiokv.serving.router.registry import (
    Instance,
)
from aiokv.serving.router.state import RouterState

log = logging.getLogger("aiokv.serving.router")


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
