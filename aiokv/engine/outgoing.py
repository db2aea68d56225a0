"""One transfer a client session sends: :class:`_OutXfer`, from its start to its end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from aiokv.gpu.cuda import _resolve
from aiokv.protocol.messages import TensorSpec

__all__: list[str] = []


@dataclass(slots=True, eq=False)
class _OutXfer:
    xfer: int
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    granted: asyncio.Future[int]
    done: asyncio.Future[None]
    seq: int = -1
    transport: str = "tcp"
    ready: Any = None  # CUDA event: the producer's stream reached the send
    sent: Any = None  # NCCL: future of the send's completion on this side
    released: asyncio.Future[None] | None = None  # set once nothing reads the tensors any more
    put: bool = False  # protocol v2: sent on standing credit (PUT), settled by an ACK
    waited: bool = True  # its caller awaits it now (send, send_many): ACK at once
    ack_now: bool = True  # the PUT asked for its ACK at once (else ACK_REQ may follow)
    posted: bool = False
    abandoned: bool = False
    nbytes: int = 0
    strided: bool = False  # a tensor is a non-contiguous CPU view: made dense when posted

    def dense(self) -> list[torch.Tensor]:
        """The tensors as posted: a strided view is copied now, after the grant (or
        with the credit in hand), never for a transfer the receiver refuses."""
        if self.strided:
            self.tensors = [t if t.is_contiguous() else t.contiguous() for t in self.tensors]
            self.strided = False
        return self.tensors

    def release_when_idle(self) -> None:
        """Resolve ``released`` once the data plane is done with the source buffers."""
        rel = self.released
        if rel is None or rel.done():
            return
        sent = self.sent
        if sent is not None and not sent.done():
            sent.add_done_callback(lambda _f: _resolve(rel))
        else:
            rel.set_result(None)
