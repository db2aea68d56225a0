"""What each part of the engine may use of the :class:`~aiokv.engine.engine.Engine` that owns it.

The engine's parts never hold the engine itself: a client session
(:mod:`aiokv.engine.client`) holds a :class:`ClientOwner`, the server side
(:mod:`aiokv.engine.server`) a :class:`ServerOwner`, GET mode
(:mod:`aiokv.engine.getmode`) a :class:`GetModeOwner`, a PUT_ASYNC's watch
(:mod:`aiokv.engine.handle`) a :class:`WatchOwner`. Each protocol lists exactly the
members that part calls; the engine satisfies them all, and nothing else of its
state is in reach. The members keep the engine's leading underscore: they are the
engine's side of its parts' interface, not the user API (the engine's public names
stay those of docs/api.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import zmq
import zmq.asyncio

from aiokv._config import EngineConfig
from aiokv.engine.staging import _Staged
from aiokv.engine.statistics import EngineStatistics
from aiokv.protocol.codec import Codec

if TYPE_CHECKING:
    from aiokv._runtime.deadlines import _Deadline
    from aiokv.engine.client import _ClientSession
    from aiokv.gpu.cuda import ProgressPoller

__all__ = ["ClientOwner", "GetModeOwner", "PeerOwner", "ServerOwner", "WatchOwner"]


class WatchOwner(Protocol):
    """What a PUT_ASYNC's deadline watch uses: the loop its timers run on, the
    configured deadlines, the failure count."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def _loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def _stats(self) -> EngineStatistics: ...


class PeerOwner(Protocol):
    """What both session sides use: who this engine is, its configuration, and its
    task, poller and protocol-error bookkeeping."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def engine_id(self) -> str: ...

    @property
    def address(self) -> str: ...

    def _capabilities(self) -> tuple[str, ...]:
        """What this engine offers a peer (HELLO, WELCOME)."""
        ...

    def _count_error(self, code: str) -> None:
        """Count one protocol error under ``code`` (statistics' ``protocol_errors``)."""
        ...

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as one of the engine's tasks (awaited at close)."""
        ...

    def _get_poller(self) -> ProgressPoller:
        """The loop's CUDA/NCCL progress poller (made on first use)."""
        ...


class ClientOwner(PeerOwner, Protocol):
    """What a client session uses of the engine that opened it: what its per-transfer
    path binds once (loop, codec, counters, the resolved "granted" future), the zmq
    contexts and CURVE keys for its sockets, and the table it leaves when it ends."""

    @property
    def _loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def _codec(self) -> Codec: ...

    @property
    def _stats(self) -> EngineStatistics: ...

    @property
    def _granted_now(self) -> asyncio.Future[int]: ...

    @property
    def _ctx(self) -> zmq.asyncio.Context: ...

    @property
    def _sctx(self) -> zmq.Context[Any]: ...

    def _apply_curve_client(self, sock: zmq.Socket[Any], address: str) -> None:
        """Set the CURVE keys for a socket connecting to ``address`` (CURVE on)."""
        ...

    def _forget_client(self, address: str, session: object) -> None:
        """The session to ``address`` ended: it leaves the engine's table of sessions."""
        ...


class ServerOwner(PeerOwner, Protocol):
    """What the server side uses of its engine beyond what it is handed at
    construction (config, codec, store, statistics): the engine's lifecycle and
    NCCL state, and its published tensors and sending path for serving a GET."""

    @property
    def _closed(self) -> bool: ...

    @property
    def _nccl_ok(self) -> bool: ...

    @property
    def _nccl_why(self) -> str: ...

    def _is_published(self, tensor_id: str) -> bool:
        """Whether a GET of ``tensor_id`` finds it published now."""
        ...

    def _claim_published(
        self, tensor_ids: Sequence[str], address: str
    ) -> list[tuple[str, torch.Tensor]]:
        """A GET of these published tensors for the peer at ``address`` starts."""
        ...

    def _session_address(self, engine_id: str) -> str | None:
        """The address of this engine's live session to the engine ``engine_id``."""
        ...

    def _stage(self, items: list[tuple[str, torch.Tensor]]) -> _Staged:
        """Check and describe tensors to send (see :mod:`aiokv.engine.staging`)."""
        ...

    async def _transfer(self, to: str, st: _Staged, timeout: float | None) -> None:
        """Send staged tensors to ``to`` over this engine's own client session."""
        ...


class GetModeOwner(Protocol):
    """What GET mode uses of its engine: its configuration, loop and address, its
    checks of a call, its client sessions (a GET goes out over one) and ``recv``."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def address(self) -> str: ...

    @property
    def _loop(self) -> asyncio.AbstractEventLoop: ...

    def _check_loop(self) -> None:
        """Refuse a call from a loop other than the engine's."""
        ...

    def _check_open(self) -> None:
        """Refuse a call unless the engine is started and not closed."""
        ...

    def _check_id(self, tensor_id: str) -> None:
        """Refuse a tensor id the peer would not accept."""
        ...

    def _timeout(self, timeout: float | None) -> float:
        """The caller's timeout (None: the configured transfer deadline), checked."""
        ...

    async def _client(self, address: str, dl: _Deadline) -> _ClientSession:
        """The live client session to ``address``, opened if need be within ``dl``."""
        ...

    async def _recv(self, tensor_id: str, frm: str | None, t: float) -> torch.Tensor:
        """Collect ``tensor_id`` (from ``frm``) from the receive store within ``t`` seconds."""
        ...
