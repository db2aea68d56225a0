"""The two narrow interfaces between the IPC plane and its :class:`~aiokv.kv.KVConnector`.

:class:`ProducerPlane` and :class:`ConsumerPlane` (together :class:`Plane`) list every
primitive the connector calls on the plane, per role, before any code; the plane
implements them (:class:`~aiokv.kv.ipc.IpcPlane`). :class:`ConnectorPort` lists every
thing the plane needs of the connector -- its caches, its argument checks, its
ordinary transport path, its bookkeeping; the connector hands the plane an object that
implements it. Neither side reaches into the other's attributes, and the ordinary path
is a call of its own (``send_plain`` ...), not a flag on the public methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..layouts import KVLayout
from ..ops import BoundCaches
from .options import IpcStatistics

__all__ = ["ConnectorPort", "ConsumerPlane", "Plane", "ProducerPlane"]


class ProducerPlane(Protocol):
    """The producer's primitives: what the connector's producer methods delegate to."""

    async def send_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """Send a whole request's blocks (:meth:`KVConnector.send_request`): over IPC
        where it works -- return once the consumer's release says the copy ended --,
        else by :meth:`ConnectorPort.send_plain`. The request joins
        ``finished_sending()`` once its blocks are the producer's again."""
        ...

    def save_layer(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """Save one layer of a request (:meth:`KVConnector.save_layer`), after its KV is
        written on the current stream; never waits."""
        ...

    async def wait_saved(self, request_id: str) -> None:
        """Wait for a request saved layer by layer (:meth:`KVConnector.wait_saved`),
        whichever path carries it; :class:`~aiokv.ConfigError` for an unknown one."""
        ...


class ConsumerPlane(Protocol):
    """The consumer's primitives: what the connector's consumer methods delegate to."""

    async def recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        """Receive a request into ``block_ids`` (:meth:`KVConnector.recv_request`);
        returns the plane that carried it, ``"ipc"`` or ``"engine"``."""
        ...

    async def prepare(self, frm: str, timeout: float | None) -> bool:
        """Map and verify the export of the producer at ``frm`` ahead of its first
        request (:meth:`KVConnector.prepare`); whether it is mapped."""
        ...

    def stages_for(self, frm: str) -> bool:
        """Whether a request from ``frm`` is made ready before its descriptor comes
        (pull mode then starts the receive beside its ticket's GET)."""
        ...


class Plane(ProducerPlane, ConsumerPlane, Protocol):
    """A plane serves both roles of its connector, and closes with it."""

    def statistics(self) -> IpcStatistics:
        """A copy of the plane's counters."""
        ...

    async def aclose(self, timeout: float = 5.0) -> None:
        """Stop: settle what is in flight (bounded by ``timeout``), unmap, close."""
        ...


class ConnectorPort(Protocol):
    """What the plane needs of its connector (the connector provides it)."""

    @property
    def engine(self) -> Any:
        """The connector's engine (the control messages' channel by default)."""
        ...

    @property
    def pull(self) -> Any:
        """The engine's GET mode (``publish`` / ``get``), or None without it."""
        ...

    @property
    def layout(self) -> KVLayout:
        """The cache's layout."""
        ...

    @property
    def caches(self) -> BoundCaches:
        """The cache the plane exports (producer) or copies into (consumer)."""
        ...

    @property
    def device(self) -> torch.device:
        """The cache's device."""
        ...

    def check_request(self, request_id: str) -> None:
        """Raise unless the connector is open and ``request_id`` is a valid id."""
        ...

    def deadline(self, timeout: float | None) -> float:
        """The ``time.monotonic`` deadline of a request given ``timeout`` (None: the
        connector's default)."""
        ...

    def host_ids(
        self, block_ids: torch.Tensor | Sequence[int], *, unique: bool, what: str
    ) -> torch.Tensor:
        """Block ids checked by the connector's rules, as a CPU int64 tensor."""
        ...

    async def send_plain(
        self, request_id: str, block_ids: Sequence[int], *, to: str, timeout: float
    ) -> None:
        """Send a whole request the ordinary way (the engine's transport)."""
        ...

    def save_layer_plain(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        """Save one layer the ordinary way."""
        ...

    async def wait_saved_plain(self, request_id: str) -> None:
        """Wait for the layers saved the ordinary way (their request joins
        ``finished_sending()``)."""
        ...

    async def recv_plain(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        frm: str | None,
        timeout: float,
        layerwise: bool,
    ) -> None:
        """Receive a request the ordinary way."""
        ...

    def drop(
        self,
        request_id: str,
        names: list[str],
        frm: str | None,
        deadline: float,
        *,
        late: bool = True,
    ) -> None:
        """Free the receive store of messages of a request that no one will collect
        (``late``: also those landing until its deadline)."""
        ...

    def sent(self, request_id: str, n_blocks: int, started: float) -> None:
        """A request the plane copied is done: counted, and its blocks may be freed."""
        ...

    def received(self, request_id: str, n_blocks: int, started: float) -> None:
        """A request the plane copied landed, every block in place: counted."""
        ...

    def blocks_free(self, request_id: str) -> None:
        """A request that failed no longer has a reader: its blocks may be freed."""
        ...

    def send_failed(self) -> None:
        """Count a failed send."""
        ...

    def recv_failed(self) -> None:
        """Count a failed receive."""
        ...
