"""A client session's NCCL data plane: its communicator's set-up and its poster.

:class:`_NcclPlane` is a part each :class:`~aiokv.engine.client._ClientSession` owns
(its ``nccl_plane``): it creates the pair's communicator once (rank 0 here, rank 1 at
the peer, agreed over NCCL_SETUP / NCCL_READY) and posts the session's granted NCCL
transfers from one task, in grant order. It sees its session as an
:class:`NcclSession`. The TCP plane needs none of this: its transfers leave from the
GRANT.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch
import zmq

from aiokv._exceptions import AiokvError, ConnectError, ConnectTimeoutError, PeerLostError
from aiokv._runtime import trace as _trace
from aiokv._runtime.deadlines import _await_shielded, _retrieve
from aiokv._runtime.zmqerr import channel_error
from aiokv.engine.interfaces import ClientOwner
from aiokv.engine.outgoing import _OutXfer
from aiokv.protocol.messages import DataHeader, NcclReady, NcclSetup
from aiokv.protocol.session import Session
from aiokv.transport.base import DeviceSource

__all__: list[str] = []


class NcclSession(Protocol):
    """What the NCCL plane uses of the client session that owns it: who it talks to,
    its protocol state, its control channel, and failing it."""

    @property
    def owner(self) -> ClientOwner: ...

    @property
    def address(self) -> str: ...

    @property
    def trace_id(self) -> str: ...

    @property
    def sess(self) -> Session: ...

    @property
    def dead(self) -> BaseException | None: ...

    def _send_ctrl(self, data: bytes) -> None:
        """Queue a control message to the peer."""
        ...

    def fail(self, exc: BaseException) -> None:
        """Tear the session down and fail everything waiting on it."""
        ...


class _NcclPlane:
    """The NCCL half of a client session (see the module)."""

    def __init__(self, session: NcclSession) -> None:
        self.session = session
        self.owner = session.owner
        self.address = session.address
        self.nccl: DeviceSource | None = None
        self.nccl_setup: asyncio.Future[None] | None = None
        self.nccl_ready: asyncio.Future[NcclReady] | None = None
        self.post_queue: asyncio.Queue[_OutXfer] = asyncio.Queue()

    def abort(self, exc: BaseException) -> None:
        """The session failed with ``exc``: the communicator and its set-up end."""
        if self.nccl is not None:
            self.nccl.abort(exc)
        if self.nccl_ready is not None and not self.nccl_ready.done():
            self.nccl_ready.set_exception(exc)

    async def ensure_nccl(self, timeout: float) -> None:
        """Create this session's communicator (rank 0 here, rank 1 at the peer) once."""
        if self.nccl is not None:
            return
        if self.nccl_setup is None:
            self.nccl_setup = asyncio.get_running_loop().create_future()
            self.nccl_setup.add_done_callback(_retrieve)
            self.owner._spawn(self._setup_nccl(self.nccl_setup, timeout))
        try:
            await _await_shielded(self.nccl_setup, timeout)
        except TimeoutError:
            raise ConnectTimeoutError(f"NCCL set-up with {self.address} timed out") from None

    async def _setup_nccl(self, fut: asyncio.Future[None], timeout: float) -> None:
        from aiokv.gpu.nccl.comm import Communicator, get_unique_id
        from aiokv.transport.nccl import NcclSource

        e = self.owner
        try:
            uid = get_unique_id()
            self.nccl_ready = asyncio.get_running_loop().create_future()
            self.nccl_ready.add_done_callback(_retrieve)
            self.session._send_ctrl(self.session.sess.send(NcclSetup(1, uid)))
            device = torch.device(e.config.device)
            blocking = e.config.nccl_blocking_ops
            comm = await Communicator.create(
                uid,
                0,
                2,
                device,
                timeout=timeout,
                max_ctas=e.config.nccl_max_channels,
                blocking_ops=blocking,
            )
            if blocking:
                await comm.warmup(timeout)
            try:
                ready = await _await_shielded(self.nccl_ready, timeout)
            except BaseException:
                comm.abort()
                raise
            if not ready.ok:
                comm.abort()
                raise ConnectError(f"{self.address} could not set up NCCL: {ready.detail}")
            if self.session.dead is not None:
                comm.abort()
                raise PeerLostError(f"session with {self.address} is gone")
            self.nccl = NcclSource(comm, e._get_poller(), device)
            fut.set_result(None)
        except BaseException as exc:
            self.nccl_setup = None
            if not fut.done():
                fut.set_exception(
                    exc
                    if isinstance(exc, AiokvError)
                    else ConnectError(f"NCCL set-up failed: {exc}")
                )
            if isinstance(exc, asyncio.CancelledError):
                raise

    def on_nccl_ready(self, msg: NcclReady) -> None:
        if self.nccl_ready is not None and not self.nccl_ready.done():
            self.nccl_ready.set_result(msg)

    async def poster(self) -> None:
        """Posts granted NCCL transfers (TCP ones leave straight from the GRANT).

        Everything granted meanwhile goes out as one NCCL group, in grant order.
        """
        try:
            while True:
                batch = [await self.post_queue.get()]
                while not self.post_queue.empty() and len(batch) < 64:
                    batch.append(self.post_queue.get_nowait())
                for b in batch:
                    self.session.sess.note_sent(DataHeader(b.xfer, b.seq, len(b.specs)))
                assert self.nccl is not None
                sent = await self.nccl.post_many([(b.tensors, b.ready) for b in batch])
                sent.add_done_callback(_retrieve)
                for b in batch:
                    b.sent = sent
                    if _trace.enabled:
                        _trace.mark("posted", self.session.trace_id, b.xfer)
                batch = []  # while waiting for the next grant this frame holds no tensors
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, AiokvError) as exc:
            self.session.fail(channel_error(exc, f"data channel to {self.address}"))
