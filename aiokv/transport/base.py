"""The interface every data plane implements.

A session's data moves client -> server. On the client the engine calls
:meth:`SourceLink.post` strictly in grant-sequence order (the *one order per
peer* rule); on the server it calls :meth:`SinkLink.expect` in the same
order, as it grants. Neither call may block the event loop: ``post`` returns
once the data is handed to the transport (enqueued on a stream, queued on a
socket), and the future returned by ``expect`` resolves when the tensors have
landed and may be handed out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import torch

from ..protocol.messages import DataHeader, TensorSpec

__all__ = ["SinkLink", "SourceLink"]


class SourceLink(Protocol):
    """Client end of one session's data plane."""

    name: str

    async def post(
        self, header: DataHeader, header_bytes: bytes, tensors: Sequence[torch.Tensor]
    ) -> None:
        """Hand the tensors of one granted transfer to the wire, in sequence order."""

    def abort(self, exc: BaseException) -> None:
        """Fail everything in flight; the link is unusable afterwards."""

    async def aclose(self) -> None:
        """Release the link's resources."""


class SinkLink(Protocol):
    """Server end of one session's data plane."""

    name: str

    def expect(
        self, header_seq: int, xfer: int, specs: Sequence[TensorSpec]
    ) -> asyncio.Future[list[torch.Tensor]]:
        """Arrange for transfer ``xfer`` (granted as ``header_seq``) to land."""

    def abort(self, exc: BaseException) -> None:
        """Fail every expected transfer with ``exc``."""
