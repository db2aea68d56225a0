"""CPU tensors over zmq frames of bounded size, zero-copy on the sending end.

The sender hands zmq buffers that *are* the tensor's memory (``copy=False``):
a tensor of ``n`` bytes leaves as ``max(1, ceil(n / DATA_FRAME_BYTES))``
memoryview slices of it, every one ``DATA_FRAME_BYTES`` (1 MiB) long but the
last. A data message is one multipart zmq message on the session's own data
connection: ``[DATA header, frames of tensor 1, frames of tensor 2, ...]``.
Because data travels on a connection of its own, a large transfer never holds
up control messages (grants, heartbeats) of any session.

Why bounded frames: zmq buffers a whole frame before anyone sees it, the
handshake's frames included, up to the socket's ``MAXMSGSIZE``. With one frame
per tensor that limit had to be the largest tensor (2 GiB by default), so a
stranger who never authenticated could make the engine hold that much. With
1 MiB frames the data port's limit is the control port's. With CURVE each frame
grows on the wire (zmq checks the encrypted frame), so both ports' limits then add
:data:`aiokv._runtime.zsock.CURVE_FRAME_OVERHEAD`.

The receiver checks the frame count and every frame's length against the
granted specs before it allocates anything. A one-frame tensor is wrapped with
``torch.frombuffer`` (no copy). A larger one is reassembled: allocated once,
each frame copied in and dropped. Up to :data:`INLINE_ASSEMBLY_BYTES` per
message that happens on the event loop; a larger message is copied on aiokv's one
ordered copy thread (:func:`aiokv._runtime.threads.in_order`; ``ctypes.memmove`` releases
the GIL) and lands when it is done.

Why not receive into preallocated tensors? libzmq always receives into a
message buffer of its own; ``recv_into`` would add a copy for every tensor,
one-frame ones included. The receive store's byte budget bounds that memory,
because nothing is sent before it is granted.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from aiokv._runtime.threads import in_order
from aiokv._runtime.zsock import LoopSocket

from .._exceptions import RemoteProtocolError, TransferAbortedError
from ..protocol.messages import ALLOWED_DTYPES, DATA_FRAME_BYTES, DataHeader, TensorSpec

__all__ = [
    "INLINE_ASSEMBLY_BYTES",
    "PUT_MAX_TENSOR_BYTES",
    "TcpSink",
    "TcpSource",
    "assemble",
    "check_frames",
    "fits_put",
    "frame_count",
    "frames_to_tensors",
    "put_frame_count",
    "tensor_buffer",
    "tensor_frames",
    "torch_dtype",
]

#: A data message whose multi-frame tensors hold at most this many bytes is reassembled
#: on the event loop: about 1 ms at the 2 GB/s a cold destination was filled at on the
#: shared 2-core VM (10+ GB/s warm). A larger one is copied by a worker thread.
INLINE_ASSEMBLY_BYTES = 2 << 20

_F = DATA_FRAME_BYTES

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


def frame_count(nbytes: int) -> int:
    """How many data frames a tensor of ``nbytes`` bytes travels as (an empty one: 1)."""
    return max(1, -(-nbytes // _F))


def tensor_frames(t: torch.Tensor) -> list[memoryview]:
    """A contiguous CPU tensor's bytes as its wire frames: zero-copy slices of its memory."""
    buf = tensor_buffer(t)
    n = len(buf)
    if n <= _F:
        return [buf]
    return [buf[i : i + _F] for i in range(0, n, _F)]


#: The largest tensor a PUT (standing credit) may carry. A PUT lands on the receiver's
#: loop at once, so a tensor of several frames is reassembled there: at most this many
#: bytes each (a few hundred microseconds of copying); larger tensors take the RESERVE
#: path, whose landing copies in a worker thread. Both ends apply it: a receiver refuses
#: a PUT with a larger tensor as a protocol error.
PUT_MAX_TENSOR_BYTES = 4 * DATA_FRAME_BYTES


def fits_put(specs: Sequence[TensorSpec], nbytes: int) -> bool:
    """May these tensors travel in a PUT? ``nbytes`` is their sum."""
    return nbytes <= PUT_MAX_TENSOR_BYTES or all(s.nbytes <= PUT_MAX_TENSOR_BYTES for s in specs)


def put_frame_count(specs: Sequence[TensorSpec]) -> int:
    """How many data frames follow a PUT header with these specs."""
    if len(specs) == 1:
        return frame_count(specs[0].nbytes)
    return sum(frame_count(s.nbytes) for s in specs)


def check_frames(specs: Sequence[TensorSpec], frames: Sequence[zmq.Frame]) -> None:
    """Check the frame count and every frame's length against ``specs``, allocating nothing.

    Raises RemoteProtocolError on the first mismatch.
    """
    want = sum(frame_count(s.nbytes) for s in specs)
    if len(frames) != want:
        raise RemoteProtocolError(f"{len(frames)} frames for {len(specs)} tensors, expected {want}")
    i = 0
    for spec in specs:
        left = spec.nbytes
        while True:
            n = min(left, _F)
            if len(frames[i]) != n:
                raise RemoteProtocolError(
                    f"tensor {spec.tensor_id!r}: frame of {len(frames[i])} bytes, expected {n}"
                )
            i += 1
            left -= n
            if left <= 0:
                break


def wrap_frame(spec: TensorSpec, frame: zmq.Frame) -> torch.Tensor:
    """The tensor of ``spec`` over one frame whose length was checked (no copy; an empty
    tensor for an empty one)."""
    dt = _DTYPES[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dt)
    t = torch.frombuffer(frame.buffer, dtype=dt)
    return t if len(spec.shape) == 1 else t.view(spec.shape)


def assemble(specs: Sequence[TensorSpec], frames: list[Any]) -> list[torch.Tensor]:
    """Tensors of ``specs`` from frames that :func:`check_frames` accepted.

    A one-frame tensor wraps its frame (no copy). A larger one is allocated once and
    its frames are copied in; each frame's slot in ``frames`` is cleared after its copy,
    so the message's memory goes back as the copy proceeds. ``ctypes.memmove`` releases
    the GIL, so a worker thread running this leaves the event loop free.
    """
    out = []
    i = 0
    for spec in specs:
        n = spec.nbytes
        if n <= _F:
            out.append(wrap_frame(spec, frames[i]))
            i += 1
        else:
            t = torch.empty(spec.shape, dtype=_DTYPES[spec.dtype])
            dst = t.data_ptr()
            for off in range(0, n, _F):
                fr = frames[i]
                frames[i] = None
                src = torch.frombuffer(fr.buffer, dtype=torch.uint8)
                ctypes.memmove(dst + off, src.data_ptr(), src.numel())
                del src, fr
                i += 1
            out.append(t)
    return out


class TcpSource:
    """Sends granted transfers on the session's data socket, in sequence order."""

    name = "tcp"

    def __init__(self, sock: LoopSocket) -> None:
        self._sock = sock
        self._dead: BaseException | None = None

    def post_nowait(self, header_bytes: bytes, tensors: Sequence[torch.Tensor]) -> None:
        """Queue one data message now, zero-copy (zmq keeps call order). Raises ZMQError."""
        if self._dead is not None:
            raise TransferAbortedError(f"TCP link aborted: {self._dead}")
        frames: list[Any] = [header_bytes]
        for t in tensors:
            frames.extend(tensor_frames(t))
        self._sock.send(frames, copy=False)

    def abort(self, exc: BaseException) -> None:
        self._dead = exc


class FrameTensor:
    """A one-frame tensor of a PUT, landed as its (length-checked) zmq frame: whoever
    collects it makes it a tensor (:meth:`tensor`: ``frombuffer``, no copy). That call
    costs microseconds on a cold loop, and the receiver's ACK -- the sender's critical
    path -- leaves before the collector runs."""

    __slots__ = ("frame", "spec")

    def __init__(self, frame: zmq.Frame, spec: TensorSpec) -> None:
        self.frame = frame
        self.spec = spec

    def tensor(self) -> torch.Tensor:
        return wrap_frame(self.spec, self.frame)


def as_tensor(value: Any) -> Any:
    """A landed value as the tensor the collector gets (a :class:`FrameTensor` made one)."""
    return value.tensor() if type(value) is FrameTensor else value


def frames_to_tensors(
    specs: Sequence[TensorSpec], frames: Sequence[zmq.Frame]
) -> list[torch.Tensor]:
    """Arriving frames as tensors of ``specs``: a one-frame tensor wraps its frame, a
    larger one (at most :data:`PUT_MAX_TENSOR_BYTES`) is reassembled here.

    The PUT path. Sizes are checked first; raises RemoteProtocolError when the frames
    do not match the specs or a tensor is too large for a PUT.
    """
    if len(frames) != len(specs):
        for spec in specs:
            if spec.nbytes > PUT_MAX_TENSOR_BYTES:
                raise RemoteProtocolError(
                    f"tensor {spec.tensor_id!r}: {spec.nbytes} bytes in a PUT, over "
                    f"{PUT_MAX_TENSOR_BYTES} (larger tensors take the RESERVE path)"
                )
        check_frames(specs, frames)
        return assemble(specs, list(frames))
    for spec, fr in zip(specs, frames):
        if len(fr) != spec.nbytes or spec.nbytes > _F:
            raise RemoteProtocolError(
                f"tensor {spec.tensor_id!r}: {len(fr)} bytes, expected {spec.nbytes}"
            )
    return [wrap_frame(spec, fr) for spec, fr in zip(specs, frames)]


class TcpSink:
    """Matches arriving data messages to granted transfers and wraps them as tensors."""

    name = "tcp"

    def __init__(self) -> None:
        self._expected: dict[
            int, tuple[Sequence[TensorSpec], asyncio.Future[list[torch.Tensor]]]
        ] = {}
        self._assembling: set[asyncio.Future[list[torch.Tensor]]] = set()

    def expect(
        self, header_seq: int, xfer: int, specs: Sequence[TensorSpec]
    ) -> asyncio.Future[list[torch.Tensor]]:
        fut: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
        self._expected[xfer] = (specs, fut)
        return fut

    def feed(
        self, header: DataHeader, frames: Sequence[zmq.Frame]
    ) -> asyncio.Future[list[torch.Tensor]]:
        """Land one data message and return its future: resolved now, or -- when its
        multi-frame tensors hold more than INLINE_ASSEMBLY_BYTES -- once a worker thread
        has copied them together (the grant's done-callbacks land it then).

        Raises RemoteProtocolError, before anything is allocated, if the message does
        not match its grant (tensor count, frame count, any frame's length).
        """
        entry = self._expected.get(header.xfer)
        if entry is None:
            raise RemoteProtocolError(f"data for transfer {header.xfer} that was not granted")
        specs, fut = entry
        if header.count != len(specs):
            raise RemoteProtocolError(
                f"transfer {header.xfer}: DATA of {header.count} tensors, {len(specs)} granted"
            )
        check_frames(specs, frames)
        del self._expected[header.xfer]
        copy = sum(s.nbytes for s in specs if s.nbytes > _F)
        if copy <= INLINE_ASSEMBLY_BYTES:
            out = assemble(specs, list(frames))
            if not fut.done():
                fut.set_result(out)
            return fut
        self._assembling.add(fut)
        work = in_order(functools.partial(assemble, specs, list(frames)))
        work.add_done_callback(functools.partial(self._assembled, fut))
        return fut

    def _assembled(
        self, fut: asyncio.Future[list[torch.Tensor]], work: asyncio.Future[list[torch.Tensor]]
    ) -> None:
        self._assembling.discard(fut)
        if fut.done():  # aborted meanwhile
            return
        if work.cancelled():
            fut.cancel()
        elif (exc := work.exception()) is not None:
            fut.set_exception(TransferAbortedError(f"reassembling the data failed: {exc!r}"))
        else:
            fut.set_result(work.result())

    def cancel(self, xfer: int) -> bool:
        """Stop expecting ``xfer`` (its grant expired or its sender withdrew it); its
        future is cancelled. Whether its data was still expected."""
        entry = self._expected.pop(xfer, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()
        return entry is not None

    def abort(self, exc: BaseException, limit: int | None = None) -> bool:
        """Fail every expected transfer with ``exc`` -- at most ``limit`` of them now (each
        failed future schedules its callbacks: a session with thousands granted is failed
        over several loop passes). True if some are left for another call."""
        n = 0
        while self._assembling and (limit is None or n < limit):
            fut = self._assembling.pop()
            if not fut.done():
                fut.set_exception(exc)
                n += 1
        while self._expected and (limit is None or n < limit):
            _, (_, fut) = self._expected.popitem()
            if not fut.done():
                fut.set_exception(exc)
                n += 1
        return bool(self._expected or self._assembling)
