"""The IPC plane's common pieces (:mod:`aiokv.kv.ipc` re-exports the public ones): the
decisions taken before any handshake, the CUDA backend and the control channel, the
per-request trace, the wait for a peer's answer (:class:`AnswerWait`). The state the
plane's parts share is :mod:`aiokv.kv.ipc._state`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from aiokv import envs

from ..._exceptions import (
    ConnectError,
    ConnectTimeoutError,
    IpcUnavailableError,
    NegotiateTimeoutError,
    RefusedError,
)
from ._wire import (
    Offer,
    StorageExport,
    encode_message,
)
from .lease import Lease
from .options import IpcOptions

log = logging.getLogger("aiokv.kv.ipc")

# a producer's "now" more than this far from ours means another clock (host, VM, sandbox)
_MAX_CLOCK_SKEW_S = 30.0
#: an ok release's ``reason`` when the consumer took the descriptor from the doorbell
RING = "ring"
#: a fallback release's reason when the consumer has no offer for the export (it
#: restarted since it acknowledged one): the producer offers it again next time
NO_OFFER = "no_offer"
#: the tensor a producer's plane publishes for consumers that map its export ahead
#: (:meth:`IpcPlane.prepare`): a GET of it makes the producer send its offer
HELLO = "aiokv#ipc-hello"
#: the request id of that offer-only request (no blocks)
PREPARE_RID = "aiokv#ipc-prepare"


#: per-request timestamps, ``(request id, stage, time.perf_counter())``, kept only when
#: ``AIOKV_IPC_TRACE`` is set (``aiokv bench kv --transport ipc`` reports them):
#: ``perf_counter`` is ``CLOCK_MONOTONIC``, so the two processes' stamps compare.
_trace: list[tuple[str, str, float]] | None = [] if envs.flag("AIOKV_IPC_TRACE") else None


def _mark(rid: str, stage: str) -> None:
    if _trace is not None and len(_trace) < 1_000_000:
        _trace.append((rid, stage, time.perf_counter()))


def take_trace() -> list[tuple[str, str, float]]:
    """The stamps recorded so far (and forget them); empty unless ``AIOKV_IPC_TRACE``."""
    if _trace is None:
        return []
    out = list(_trace)
    _trace.clear()
    return out


def _on(stream: Any, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.stream(stream)``, or nothing when it is already current (the common
    case: the copy runs on the caller's stream; a switch costs several CUDA calls)."""
    if torch.cuda.current_stream(device) == stream:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def _layer_id(rid: str, lo: int) -> str:
    """Tensor id of the :class:`LayerReady` message of the chunk starting at layer ``lo``."""
    return f"{rid}#ipcL{lo}"


# --------------------------------------------------------------------------- decisions


def allocator_conf() -> str:
    """The caching allocator settings torch reads at start (env)."""
    return (
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        + ","
        + os.environ.get("PYTORCH_ALLOC_CONF", "")
    )


def unsupported_reason(
    device: torch.device,
    *,
    authenticated: bool,
    options: IpcOptions,
    alloc_conf: str | None = None,
    hip: str | None = None,
) -> str | None:
    """Why this process cannot offer or use the IPC plane at all (None: it can).

    Checked on each side before any handshake; each reason is also a fallback
    counter's name.
    """
    if device.type != "cuda":
        return "not_cuda"
    if hip if hip is not None else getattr(torch.version, "hip", None):
        return "rocm"
    conf = (alloc_conf if alloc_conf is not None else allocator_conf()).replace(" ", "").lower()
    if "expandable_segments:true" in conf:
        return "expandable_segments"
    if not (authenticated or options.trust_unauthenticated):
        return "unauthenticated"
    return None


def boot_id() -> str:
    """This host's boot id (same for every process and container of one kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:64]
    except OSError:
        return ""


def check_same_host(offer: Offer, *, my_boot_id: str, now: float) -> None:
    """Raise :class:`IpcUnavailableError` when the offer comes from another host or clock."""
    if not offer.boot_id or offer.boot_id != my_boot_id:
        raise IpcUnavailableError("other_host", f"boot id {offer.boot_id!r} != {my_boot_id!r}")
    if abs(now - offer.mono) > _MAX_CLOCK_SKEW_S:
        raise IpcUnavailableError(
            "other_clock", f"the producer's monotonic clock is {offer.mono - now:+.1f} s off"
        )


# --------------------------------------------------------------------------- backend


class Backend(Protocol):
    """What the plane needs of CUDA. :class:`CudaBackend` is the real one; the CPU
    tests give a fake one (same process, no IPC) to test the protocol and the rules."""

    def export(self, storage: torch.UntypedStorage) -> StorageExport: ...

    def open(self, e: StorageExport, device: torch.device) -> torch.Tensor: ...

    def new_event(self, device: torch.device) -> tuple[Any, bytes]: ...

    def open_event(self, handle: bytes, device: torch.device) -> Any: ...

    def new_stream(self, device: torch.device) -> Any: ...


class CudaBackend:
    """CUDA IPC through torch: ``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``
    (what ``torch.multiprocessing`` uses) and interprocess events."""

    def export(self, storage: torch.UntypedStorage) -> StorageExport:
        st: Any = storage  # torch's private sharing API is untyped and varies by version
        (_dev, handle, size, offset, rc, rc_off, ev, _sync) = st._share_cuda_()
        return StorageExport(
            handle=bytes(handle),
            size=int(size),
            offset=int(offset),
            rc_handle=bytes(rc) if rc else b"",
            rc_offset=int(rc_off or 0),
            event=bytes(ev) if ev else b"",
        )

    def open(self, e: StorageExport, device: torch.device) -> torch.Tensor:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        cls: Any = torch.UntypedStorage
        st = cls._new_shared_cuda(
            idx, e.handle, e.size, e.offset, e.rc_handle, e.rc_offset, e.event, False
        )
        t: Any = torch.empty(0, dtype=torch.uint8, device=device)
        t.set_(st)
        out: torch.Tensor = t
        return out

    def new_event(self, device: torch.device) -> tuple[Any, bytes]:
        with torch.cuda.device(device):
            ev: Any = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            ev.record()  # an event must be recorded once before it can be exported
            return ev, bytes(ev.ipc_handle())

    def open_event(self, handle: bytes, device: torch.device) -> Any:
        return torch.cuda.Event.from_ipc_handle(device, handle)  # type: ignore[no-untyped-call]

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- control channel


class ControlChannel(Protocol):
    """How the plane's two messages travel (docs/ipc.md, "Control interface").

    ``send`` starts sending one message (a plain msgpack-able dict) and returns an
    awaitable that settles when it was delivered (or failed); ``recv`` returns the
    message received under ``tensor_id`` as the raw uint8 tensor/bytes, which the
    plane decodes and validates itself. :class:`EngineChannel` carries them as
    small CPU tensors through an engine's public ``send_nowait`` / ``recv``; the
    one-message control protocol can carry the same dicts instead.
    """

    def send(self, tensor_id: str, msg: Mapping[str, Any], *, to: str, timeout: float) -> Any: ...

    async def recv(self, tensor_id: str, *, frm: str | None, timeout: float) -> Any: ...

    def recv_nowait(self, tensor_id: str, *, frm: str | None) -> Any: ...


class EngineChannel:
    """:class:`ControlChannel` over an engine: msgpack bytes in a uint8 CPU tensor."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def send(self, tensor_id: str, msg: Mapping[str, Any], *, to: str, timeout: float) -> Any:
        t = encode_message(msg)
        rid, _, what = tensor_id.partition("#")
        _mark(rid, "encoded:" + what)
        return self.engine.send_nowait(tensor_id, t, to=to, timeout=timeout)

    async def recv(self, tensor_id: str, *, frm: str | None, timeout: float) -> Any:
        return await self.engine.recv(tensor_id, frm=frm, timeout=timeout)

    def recv_nowait(self, tensor_id: str, *, frm: str | None) -> Any:
        """The message if it has landed already, else None (push mode's grants)."""
        return self.engine.recv_nowait(tensor_id, frm=frm)


#: failures of a control message's send that prove the peer's engine never took it:
#: the caller waiting on the peer's answer fails with it at once
UNDELIVERED: tuple[type[BaseException], ...] = (
    RefusedError,  # the peer refused the session (LayoutMismatchError ...) or the message
    ConnectError,
    ConnectTimeoutError,
    NegotiateTimeoutError,
)


class AnswerWait:
    """A caller's wait for the peer's answer to a request's control messages (the
    producer's wait for a lease's release): ``fut`` settles with the answer; a message
    of the request whose send failed settles it with that failure at once when the
    peer surely never took the message (:data:`UNDELIVERED`), else is kept in
    ``lost`` (the message may have landed, so the wait goes on; its end names it).
    ``lease`` is the request's lease (:mod:`aiokv.kv.ipc.lease`), which the wait's
    outcome drives."""

    __slots__ = ("fut", "lease", "lost")

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut = fut
        self.lost: BaseException | None = None
        self.lease = Lease()

    def message_failed(self, exc: BaseException) -> None:
        if self.fut.done():
            return
        if isinstance(exc, UNDELIVERED):
            self.fut.set_exception(exc)
        elif self.lost is None:
            self.lost = exc


def _retrieve(t: asyncio.Future[Any]) -> None:
    if not t.cancelled():
        t.exception()


@dataclasses.dataclass(slots=True, eq=False)
class _Export:
    """What the producer exported to consumers (one per plane)."""

    offer: Offer
    probe: torch.Tensor
    storages: list[torch.UntypedStorage]
