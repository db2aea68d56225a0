"""An engine's counters: :class:`EngineStatistics` (public as ``aiokv.EngineStatistics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokv.engine.store import StoreStatistics

__all__ = ["EngineStatistics"]


@dataclass(slots=True)
class EngineStatistics:
    """Counters of one engine (a snapshot; see :meth:`Engine.statistics`)."""

    address: str = ""
    transfers_sent: int = 0
    transfers_failed: int = 0
    tensors_sent: int = 0
    bytes_sent: int = 0
    transfers_received: int = 0
    tensors_received: int = 0
    bytes_received: int = 0
    refused_sent: int = 0
    refused_received: int = 0
    withdrawn: int = 0
    queued_reservations: int = 0
    gets_served: int = 0
    peers_lost: int = 0
    sessions_opened: int = 0
    client_sessions: int = 0
    server_sessions: int = 0
    protocol_errors: dict[str, int] = field(default_factory=dict)
    store: StoreStatistics | None = None
    #: protocol v2: standing credit granted to peers and not yet spent (bytes, tensors);
    #: it is held in the receive budget but not counted in ``store.reserved_bytes``
    credit_bytes: int = 0
    credit_tensors: int = 0
    #: protocol v2, sending side: transfers waiting in this engine for the peer's credit
    waiting_for_credit: int = 0
    #: protocol v2, receiving side: peer sessions whose credit the full budget holds back
    credit_starved: int = 0
    #: NCCL data plane: live communicators, enqueues that had to settle (count,
    #: total and max seconds), and the progress poller's counters
    nccl: dict[str, float] = field(default_factory=dict)
