"""The interface every data plane implements: what a session holds and calls.

A session's data moves client -> server. The client session holds a
:class:`MessageSource` (TCP: data messages queued on the session's data socket) and,
once the pair has a communicator, a :class:`DeviceSource` (NCCL: sends enqueued on a
device stream); the server session holds a :class:`MessageSink` and, with NCCL, a
:class:`DeviceSink`. The engine posts strictly in grant-sequence order (the *one
order per peer* rule) and expects in the same order, as it grants. No call blocks
the event loop: a post returns once the data is handed to the transport (queued on
a socket, enqueued on a stream), and the future ``expect`` returns resolves when the
tensors have landed and may be handed out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import torch
import zmq

from ..protocol.messages import DataHeader, TensorSpec

__all__ = [
    "DeviceSink",
    "DeviceSource",
    "MessageSink",
    "MessageSource",
    "SettleCounters",
    "SinkLink",
    "SourceLink",
]


class SettleCounters(Protocol):
    """A device plane's communicator, as the engine's statistics read it: enqueues
    that had to settle (count, total and longest, in seconds)."""

    @property
    def settles(self) -> int: ...

    @property
    def settle_s(self) -> float: ...

    @property
    def settle_max_s(self) -> float: ...


class SourceLink(Protocol):
    """Client end of one session's data plane."""

    name: str

    def abort(self, exc: BaseException) -> None:
        """Fail everything in flight; the link is unusable afterwards."""
        ...


class MessageSource(SourceLink, Protocol):
    """A source whose transfers travel as messages on the session's data socket."""

    def post_nowait(self, header_bytes: bytes, tensors: Sequence[torch.Tensor]) -> None:
        """Queue one granted transfer's data message now (the socket keeps call order)."""
        ...


class DeviceSource(SourceLink, Protocol):
    """A source whose transfers are sends enqueued on a device stream."""

    @property
    def comm(self) -> SettleCounters: ...

    async def post_many(
        self, items: Sequence[tuple[Sequence[torch.Tensor], torch.cuda.Event | None]]
    ) -> asyncio.Future[None]:
        """Enqueue consecutive granted transfers (each with the event its tensors are
        ready at) as one group; the future resolves once the sends have read them."""
        ...


class SinkLink(Protocol):
    """Server end of one session's data plane."""

    name: str

    def expect(
        self, header_seq: int, xfer: int, specs: Sequence[TensorSpec]
    ) -> asyncio.Future[list[torch.Tensor]]:
        """Arrange for transfer ``xfer`` (granted as ``header_seq``) to land."""
        ...


class MessageSink(SinkLink, Protocol):
    """A sink fed the data messages that arrive on the session's data connection."""

    def feed(
        self, header: DataHeader, frames: Sequence[zmq.Frame]
    ) -> asyncio.Future[list[torch.Tensor]]:
        """Land one data message (checked against its grant first); its grant's future."""
        ...

    def cancel(self, xfer: int) -> bool:
        """Stop expecting ``xfer``; whether its data was still expected."""
        ...

    def abort(self, exc: BaseException, limit: int | None = None) -> bool:
        """Fail expected transfers with ``exc``, at most ``limit`` now; whether some are left."""
        ...


class DeviceSink(SinkLink, Protocol):
    """A sink whose receives are posted on a device stream, in grant order."""

    @property
    def comm(self) -> SettleCounters: ...

    def abort(self, exc: BaseException) -> None:
        """Fail every expected transfer with ``exc``."""
        ...
