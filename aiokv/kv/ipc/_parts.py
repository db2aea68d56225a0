"""What the parts of an :class:`~aiokv.kv.ipc.IpcPlane` may call on one another.

The plane owns its parts -- the producer (:mod:`._producer`), the push sender
(:mod:`._push`), the consumer (:mod:`._consumer`, which owns its :mod:`._inbox` and
:mod:`._copy`), the grants' side (:mod:`._grant`) -- and wires them together; they share
one :class:`~aiokv.kv.ipc._state.PlaneState`. Each part sees another only through the
protocol here that lists the few calls it makes on it (docs/ipc.md, "Structure").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..layouts import KVLayout
    from ._common import _Export
    from ._copy import _Staged
    from ._doorbell import BellWriter
    from ._mapping import _Mapping
    from ._push import _IpcSave, _PushSave
    from ._wire import Descriptor, Grant, PushOffer

__all__ = ["Arrivals", "Copies", "Grants", "Producing", "Pushing", "Receiving"]


class Producing(Protocol):
    """The producer, as the push sender and the grants' side call it."""

    #: consumer -> its doorbell ring (a revoked grant is answered there)
    bells: dict[str, BellWriter | None]
    #: the producer's IPC events that serve again
    free_events: list[tuple[int, Any, bytes]]

    def make_export(self) -> _Export: ...

    def take_event(self) -> tuple[int, Any, bytes]: ...

    def record(self, ev: Any) -> None: ...

    async def post(
        self,
        request_id: str,
        desc: Descriptor,
        to: str,
        lease: float,
        events: list[tuple[int, Any, bytes]],
    ) -> bool: ...

    async def save_plain(self, request_id: str, sv: _IpcSave) -> None: ...


class Pushing(Protocol):
    """The push sender, as the producer calls it."""

    #: consumer -> its verified push export
    maps: dict[str, _Mapping]

    def take_grant(
        self, rid: str, to: str, pm: _Mapping, n: int, deadline: float
    ) -> tuple[Grant, Any] | None: ...

    async def push(
        self,
        request_id: str,
        host: tuple[int, ...],
        to: str,
        deadline: float,
        pm: _Mapping,
        g: Grant,
        ab: torch.Tensor,
    ) -> bool: ...

    def first_layer(
        self,
        request_id: str,
        layer: int,
        host: tuple[int, ...],
        to: str,
        deadline: float,
        lease: float,
        pm: _Mapping | None,
    ) -> _IpcSave | None: ...

    def next_layer(self, sv: _IpcSave, ps: _PushSave, request_id: str, layer: int) -> None: ...

    async def saved(self, request_id: str, sv: _IpcSave, ps: _PushSave) -> None: ...

    def received(self, to: str, po: PushOffer) -> None: ...

    def close(self, pm: _Mapping) -> None: ...


class Receiving(Protocol):
    """The consumer, as its copier and the grants' side call it."""

    async def after_desc(
        self,
        request_id: str,
        host: tuple[int, ...],
        desc: Descriptor,
        plout: KVLayout | None,
        frm: str | None,
        deadline: float,
        *,
        layerwise: bool,
        rung: bool,
    ) -> str: ...

    def copy_ended(self, m: _Mapping) -> None: ...


class Arrivals(Protocol):
    """The consumer's inbox (descriptors by the ring or the engine), as the consumer
    and the grants' side call it."""

    async def recv_desc(
        self, rid: str, frm: str | None, deadline: float, staged: _Staged | None = None
    ) -> tuple[Descriptor, KVLayout | None, bool]: ...

    def desc_nowait(
        self, rid: str, frm: str | None, deadline: float
    ) -> tuple[Descriptor, KVLayout | None, bool] | None: ...

    def woken(self, m: _Mapping) -> None: ...

    def drop(self, m: _Mapping) -> None: ...


class Copies(Protocol):
    """The consumer's copier, as the consumer and its inbox call it."""

    def staging_mapping(self, frm: str | None) -> _Mapping | None: ...

    def stage(
        self, rid: str, host: tuple[int, ...], frm: str | None, deadline: float
    ) -> _Staged | None: ...

    def unstage(self, st: _Staged | None) -> None: ...

    def launch_staged(self, st: _Staged, desc: Descriptor) -> None: ...

    async def pull(
        self,
        m: _Mapping,
        desc: Descriptor,
        host: tuple[int, ...],
        deadline: float,
        frm: str | None = None,
        *,
        rung: bool = False,
    ) -> None: ...

    async def pull_staged(
        self, st: _Staged, deadline: float, rung: bool, exc: BaseException | None
    ) -> None: ...


class Grants(Protocol):
    """The consumer's half of push mode, as the consumer, its inbox and its copier
    call it."""

    def token(self) -> int: ...

    def source(self, frm: str | None) -> _Mapping | None: ...

    def offer_push(self, m: _Mapping) -> PushOffer | None: ...

    async def recv_granted(
        self,
        rid: str,
        host: tuple[int, ...],
        frm: str | None,
        deadline: float,
        m: _Mapping,
        *,
        layerwise: bool,
    ) -> str: ...

    async def refuse_push(
        self,
        desc: Descriptor,
        rid: str,
        host: tuple[int, ...],
        frm: str | None,
        deadline: float,
        peer: str,
        detail: str,
        *,
        layerwise: bool = False,
    ) -> str: ...
