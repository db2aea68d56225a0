"""How a :class:`~aiokv.kv.KVConnector` uses the IPC plane (:class:`IpcOptions`) and
what it counts (:class:`IpcStatistics`); both are exported from :mod:`aiokv.kv`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..._exceptions import ConfigError

__all__ = ["IpcOptions", "IpcStatistics"]


@dataclass(frozen=True, slots=True)
class IpcOptions:
    """How a :class:`~aiokv.kv.KVConnector` uses the IPC plane (give both sides the same).

    ``trust_unauthenticated``: IPC exposes the producer's cache allocation to the
    consumer, so by default it is offered only when the engine authenticates its
    peers (CURVE); set True only where every process that can reach the engine is
    trusted (one host, one tenant). ``grace_s``: how long after a lease's deadline
    the producer still keeps the blocks (a copy that started before the deadline
    finishes within it). ``force_torch``: use the torch-ops copy instead of the
    Triton kernel (see :mod:`aiokv.kv.ipc._kernel`).

    ``doorbell``: the producer also writes each descriptor into a shared-memory ring
    (:mod:`aiokv.kv.ipc._doorbell`) that the consumer polls while a ``recv_request``
    waits -- spinning its loop (``sleep(0)``) for ``doorbell_spin_s`` after the call
    began; after that a wake-up through a FIFO beside the ring brings the loop to it
    (and a timed poll, should that fail). Until a consumer's release says it took a
    descriptor from the ring, the engine carries every descriptor too; from then on
    the ring alone does, and the engine's copy follows only if no release came
    within ``doorbell_backup_s`` (docs/ipc.md, "Doorbell").

    ``driver_calls``: make the per-request CUDA calls (the ready and completion
    events' records, the ids' upload, the copy's launch) through the CUDA driver
    directly instead of through torch's and Triton's Python wrappers, which cost
    several times more on the request path (:mod:`aiokv.kv.ipc._cudrv`); the launch only
    after the probe copy through it was bit-exact.

    ``push``: push mode (docs/ipc.md, "Push"; give it both sides): the consumer also
    exports its cache to the producer, and *grants* each whole request's blocks as it
    allocates them; a producer that holds the grant when it sends copies the request
    into the consumer's blocks itself, on its own stream right after its KV writes, so
    the consumer only waits for that copy's end (no hop through its loop before the
    copy). A request without a grant in time goes by pull, as without the option.
    This lets the producer *write* the consumer's cache (pull only lets the consumer
    read the producer's): turn it on only between processes that trust each other that
    far.

    ``gpu_wait``: when the producer's ready event has not fired yet as the request
    arrives, let the consumer's copy stream wait for it on the GPU (the launch is
    queued at once) instead of polling it from the host first. Faster by one poll,
    but if the producer dies before its event fires, that stream waits forever:
    the launch itself is harmless (its abort word is set), but a device-wide
    ``torch.cuda.synchronize()`` in the consumer then never returns, nor does the
    next first launch of a kernel under lazy module loading (seen in three runs on an
    H200 host; docs/ipc.md). Off by default; consider it only where the producer's death
    also ends the consumer.

    ``event_poll_s``: a consumer's wait for a CUDA event (the producer's ready event,
    a push's end, its own copy's end) queries it on every loop pass for 2 ms, then
    every ``event_poll_s`` -- the loop's one waiter's timer serves every such wait
    (:mod:`aiokv._runtime.waiter`; the loop's own timers end on whole milliseconds). Shorter notices an event sooner (on average half of it after the
    event) at more CPU while requests wait: measured 17-24% of one core of a 2-core CI
    machine at 0.2 ms, 3-9% with the loop's 1 ms timer (docs/benchmarks.md).
    """

    trust_unauthenticated: bool = False
    grace_s: float = 1.0
    force_torch: bool = False
    gpu_wait: bool = False
    doorbell: bool = True
    doorbell_spin_s: float = 0.02
    doorbell_backup_s: float = 0.05
    driver_calls: bool = True
    push: bool = False
    event_poll_s: float = 0.0002

    def __post_init__(self) -> None:
        if not (isinstance(self.grace_s, (int, float)) and 0 < self.grace_s <= 600):
            raise ConfigError(f"grace_s must be in (0, 600], got {self.grace_s!r}")
        s = self.doorbell_spin_s
        if not (isinstance(s, (int, float)) and 0 <= s <= 1):
            raise ConfigError(f"doorbell_spin_s must be in [0, 1], got {s!r}")
        b = self.doorbell_backup_s
        if not (isinstance(b, (int, float)) and 0 < b <= 60):
            raise ConfigError(f"doorbell_backup_s must be in (0, 60], got {b!r}")
        e = self.event_poll_s
        if not (isinstance(e, (int, float)) and 0 < e <= 0.01):
            raise ConfigError(f"event_poll_s must be in (0, 0.01], got {e!r}")


@dataclass(slots=True)
class IpcStatistics:
    """Counters of one plane. ``fallbacks`` counts requests sent the ordinary way
    because IPC was unavailable, by reason."""

    requests_sent: int = 0
    requests_received: int = 0
    bytes_received: int = 0
    mappings_verified: int = 0
    mapping_failures: int = 0
    mappings_dropped: int = 0  # unmapped because their producer's process was gone
    aborted: int = 0
    lease_expired: int = 0
    stuck_streams: int = 0
    doorbell_hits: int = 0  # descriptors taken from the doorbell before the engine's
    doorbell_rejected: int = 0  # ring slots whose MAC failed (or that made no sense)
    doorbell_backups: int = 0  # producer: ring-only descriptors also sent by the engine late
    staged_launches: int = 0  # consumer: copies staged at recv_request, then launched ...
    ring_launches: int = 0  # ... of which by the ring's poll (the producer's event had fired)
    grants: int = 0  # consumer: whole requests whose blocks it granted to the producer
    pushed: int = 0  # producer: requests it copied into a consumer's granted blocks
    pushes_received: int = 0  # consumer: requests the producer pushed
    push_unsettled: int = 0  # consumer: aborted grants not known to be over in grace_s
    fallbacks: dict[str, int] = field(default_factory=dict)
