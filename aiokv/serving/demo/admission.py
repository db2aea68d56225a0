"""What a demo worker refuses and why: bad request parameters (400) and KV-block
admission (a request waits for its blocks, in a bounded queue for a bounded time; beyond
that it is overloaded: 503 with ``Retry-After``, which the router treats as load, not
failure).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

from fastapi.responses import JSONResponse

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
