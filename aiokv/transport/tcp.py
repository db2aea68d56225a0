"""CPU tensors over zmq frames, zero-copy on both ends.

The sender hands zmq a buffer that *is* the tensor's memory (``copy=False``);
the receiver wraps the arriving frame in a tensor with ``torch.frombuffer``,
so the bytes are never copied in Python. A data message is one multipart
zmq message on the session's own data connection: ``[DATA header, frame per
tensor]``. Because data travels on a connection of its own, a large transfer
never holds up control messages (grants, heartbeats) of any session.

Why not receive into preallocated tensors? libzmq always receives into a
message buffer of its own; ``recv_into`` would add a copy. The receive store's
byte budget still bounds that memory, because nothing is sent before it is
granted.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from .._exceptions import RemoteProtocolError, TransferAbortedError
from .._zsock import LoopSocket
from ..protocol.messages import ALLOWED_DTYPES, DataHeader, TensorSpec

__all__ = ["TcpSink", "TcpSource", "frames_to_tensors", "tensor_buffer", "torch_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}
assert set(_DTYPES) == set(ALLOWED_DTYPES)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an allow-listed wire name (KeyError otherwise)."""
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str | None:
    """The wire name of a torch dtype, or None if it cannot travel."""
    return _NAMES.get(dtype)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes that keeps it alive."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    arr: Any = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr.keep = t  # the view holds the tensor, so zmq may outlive the caller's reference
    return memoryview(arr)


class TcpSource:
    """Sends granted transfers on the session's data socket, in sequence order."""

    name = "tcp"

    def __init__(self, sock: LoopSocket) -> None:
        self._sock = sock
        self._dead: BaseException | None = None

    async def post(
        self, header: DataHeader, header_bytes: bytes, tensors: Sequence[torch.Tensor]
    ) -> None:
        self.post_nowait(header_bytes, tensors)

    def post_nowait(self, header_bytes: bytes, tensors: Sequence[torch.Tensor]) -> None:
        """Queue one data message now, zero-copy (zmq keeps call order). Raises ZMQError."""
        if self._dead is not None:
            raise TransferAbortedError(f"TCP link aborted: {self._dead}")
        frames: list[Any] = [header_bytes]
        frames.extend(tensor_buffer(t) for t in tensors)
        self._sock.send(frames, copy=False)

    def abort(self, exc: BaseException) -> None:
        self._dead = exc

    async def aclose(self) -> None:
        self._dead = self._dead or TransferAbortedError("closed")


def frames_to_tensors(
    specs: Sequence[TensorSpec], frames: Sequence[zmq.Frame]
) -> list[torch.Tensor]:
    """Wrap arriving frames as tensors of ``specs``, zero-copy; sizes checked first.

    Raises RemoteProtocolError when the frames do not match the specs.
    """
    if len(frames) != len(specs):
        raise RemoteProtocolError(f"{len(frames)} frames for {len(specs)} tensors")
    for spec, fr in zip(specs, frames):
        if len(fr) != spec.nbytes:
            raise RemoteProtocolError(
                f"tensor {spec.tensor_id!r}: {len(fr)} bytes, expected {spec.nbytes}"
            )
    out = []
    for spec, fr in zip(specs, frames):
        dt = _DTYPES[spec.dtype]
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=dt))
        else:
            t = torch.frombuffer(fr.buffer, dtype=dt)
            out.append(t if len(spec.shape) == 1 else t.view(spec.shape))
    return out


class TcpSink:
    """Matches arriving data messages to granted transfers and wraps them as tensors."""

    name = "tcp"

    def __init__(self) -> None:
        self._expected: dict[
            int, tuple[Sequence[TensorSpec], asyncio.Future[list[torch.Tensor]]]
        ] = {}

    def expect(
        self, header_seq: int, xfer: int, specs: Sequence[TensorSpec]
    ) -> asyncio.Future[list[torch.Tensor]]:
        fut: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
        self._expected[xfer] = (specs, fut)
        return fut

    def feed(
        self, header: DataHeader, frames: Sequence[zmq.Frame]
    ) -> asyncio.Future[list[torch.Tensor]]:
        """Land one data message and return its (resolved) future.

        Raises RemoteProtocolError if it does not match its grant.
        """
        entry = self._expected.get(header.xfer)
        if entry is None:
            raise RemoteProtocolError(f"data for transfer {header.xfer} that was not granted")
        specs, fut = entry
        if header.count != len(specs) or len(frames) != len(specs):
            raise RemoteProtocolError(
                f"transfer {header.xfer}: {len(frames)} frames for {len(specs)} tensors"
            )
        out = frames_to_tensors(specs, frames)
        del self._expected[header.xfer]
        if not fut.done():
            fut.set_result(out)
        return fut

    def cancel(self, xfer: int) -> None:
        """Stop expecting ``xfer`` (its grant expired); its future is cancelled."""
        entry = self._expected.pop(xfer, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()

    def abort(self, exc: BaseException) -> None:
        for _, fut in self._expected.values():
            if not fut.done():
                fut.set_exception(exc)
        self._expected.clear()
