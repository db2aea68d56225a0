"""Same-host data plane: the consumer pulls a request's blocks straight out of the
producer's paged cache (mapped by CUDA IPC) into its own, in ONE kernel.

See ``docs/ipc.md`` for the design, the wire messages and the safety rules; in short:

* **Pull.** The producer exports its cache tensors (CUDA IPC handles) once per
  consumer; the consumer maps them, verifies the mapping with a known pattern
  (and the kernel, and the abort word), and from then on copies each request with
  one launch on the caller's current stream once the producer's ready event (a
  CUDA IPC event) fired, polled from the event loop (``gpu_wait``: waited for on
  the GPU instead). The kernel writes only the consumer's own memory, so a dead
  producer can never make it write into memory somebody freed.
* **Lease.** Each request's descriptor carries a deadline (``CLOCK_MONOTONIC``,
  shared by the processes of one host). The producer keeps the blocks until the
  consumer's release message says the copy finished, or until the deadline plus
  a grace period has passed. The consumer never starts a copy after the
  deadline (the abort word) and never reports one finished after it.
* **Fallback.** Anything that keeps IPC from working (another host or
  container, a PID namespace, no peer access, expandable segments, an
  unauthenticated peer, a failed verification) sends that request -- and later
  ones to that peer -- through the connector's ordinary path (NCCL, or TCP),
  with a log line and a counter. Never silently.

* **Layer-wise.** ``save_layer`` records an event per layer and announces it
  (:class:`LayerReady`: one message per run of consecutive layers saved in one loop
  pass, each layer with its own event); the consumer copies each layer with one
  launch once its event fired -- or, finding every later layer written already, all
  of them in one launch -- under the request's one abort word and one release.

Control messages travel as small uint8 CPU tensors carrying msgpack through the
engine's public ``send_nowait``/``recv`` (tensor ids ``"{rid}#ipc"``,
``"{rid}#ipcL{first layer}"`` and ``"{rid}#ipcrel"``); every received field is checked
before use. A request's descriptor also goes through a shared-memory *doorbell*
ring (:mod:`aiokv.kv.ipc._doorbell`, named with its MAC key in the offer) that a waiting
consumer polls: it arrives ~0.35 ms sooner on an H200 host; the engine's copy
stays the authority. The per-request path avoids allocations and most torch calls (each
costs tens of µs on a GPU host); ``AIOKV_IPC_TRACE=1`` stamps its stages
(:func:`take_trace`, ``aiokv bench kv --transport ipc --trace``).

Structure: :class:`IpcPlane` (this module) owns its parts and wires them together;
they share one :class:`~aiokv.kv.ipc._state.PlaneState` (the connector's port, the
channel, the options, the backend and driver, the mappings, the counters) and see one
another only through the protocols of :mod:`aiokv.kv.ipc._parts`:
:class:`~aiokv.kv.ipc._producer.Producer` (export, events, descriptor, release wait,
layer-wise saving), :class:`~aiokv.kv.ipc._push.Pusher` (push mode's producer half),
:class:`~aiokv.kv.ipc._consumer.Consumer` (mapping, the path a request takes; it owns
the :class:`~aiokv.kv.ipc._inbox.Inbox` -- ring and engine -- and the
:class:`~aiokv.kv.ipc._copy.Copier` -- staged and ordinary launches, abort rules,
release) and :class:`~aiokv.kv.ipc._grant.Granter` (push mode's consumer half). The
plane meets its connector through :mod:`aiokv.kv.ipc.interfaces` and settles leases by
:mod:`aiokv.kv.ipc.lease` (docs/ipc.md, "Structure").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from aiokv._runtime.waiter import waiter_for

from ..layouts import KVLayout
from ._common import Backend, ControlChannel
from ._consumer import Consumer
from ._grant import Granter
from ._producer import Producer
from ._push import Pusher
from ._state import PlaneState
from .interfaces import ConnectorPort, ConsumerPlane, Plane, ProducerPlane
from .options import IpcOptions, IpcStatistics

#: how often ``aclose`` asks whether the copies reading the mappings are over
_CLOSE_POLL_S = 0.01


class IpcPlane:
    """The IPC data plane of one :class:`~aiokv.kv.KVConnector` (both roles).

    Built by the connector when it is given ``ipc=IpcOptions(...)``; the connector's
    ``send_request`` / ``recv_request`` then go through :meth:`send_request` /
    :meth:`recv_request`, which use IPC where it works and the connector's ordinary
    path otherwise (docs/ipc.md). The primitives are those of
    :class:`~aiokv.kv.ipc.interfaces.Plane`; each is its part's.
    """

    def __init__(
        self,
        port: ConnectorPort,
        options: IpcOptions,
        *,
        backend: Backend | None = None,
        channel: ControlChannel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = s = PlaneState(port, options, backend=backend, channel=channel, clock=clock)
        self.producer = Producer(s)
        self.pusher = Pusher(s)
        self.granter = Granter(s)
        self.consumer = Consumer(s, self.granter)
        self.producer.push = self.pusher
        self.pusher.producer = self.producer
        self.granter.producer = self.producer
        self.granter.consumer = self.consumer
        self.granter.inbox = self.consumer.inbox
        self.producer.publish_hello()

    @property
    def options(self) -> IpcOptions:
        return self.state.options

    @options.setter
    def options(self, options: IpcOptions) -> None:
        self.state.options = options

    @property
    def disabled(self) -> str | None:
        """Why the plane is off for this connector (None: it is on)."""
        return self.state.disabled

    @property
    def port(self) -> ConnectorPort:
        """The connector's side of the plane (:class:`ConnectorPort`)."""
        return self.state.port

    @property
    def channel(self) -> ControlChannel:
        """How the plane's control messages travel."""
        return self.state.channel

    @property
    def backend(self) -> Backend:
        return self.state.backend

    @property
    def layout(self) -> KVLayout:
        return self.state.layout

    @property
    def device(self) -> torch.device:
        return self.state.device

    def statistics(self) -> IpcStatistics:
        """A copy of the plane's counters."""
        return self.state.statistics()

    # ------------------------------------------------------------------ producer

    async def send_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        await self.producer.send_request(request_id, block_ids, to=to, timeout=timeout)

    def save_layer(
        self,
        request_id: str,
        layer: int,
        block_ids: torch.Tensor | Sequence[int],
        *,
        to: str,
        timeout: float | None,
    ) -> None:
        self.producer.save_layer(request_id, layer, block_ids, to=to, timeout=timeout)

    async def wait_saved(self, request_id: str) -> None:
        await self.producer.wait_saved(request_id)

    def owns_save(self, request_id: str) -> bool:
        """True when the layers of ``request_id`` are being saved over IPC."""
        return self.producer.owns_save(request_id)

    # ------------------------------------------------------------------ consumer

    async def recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        return await self.consumer.recv_request(
            request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
        )

    async def prepare(self, frm: str, timeout: float | None) -> bool:
        return await self.consumer.prepare(frm, timeout)

    def stages_for(self, frm: str) -> bool:
        return self.consumer.stages_for(frm)

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self, timeout: float = 5.0) -> None:
        """Stop: wait (bounded) for background messages and in-flight copies, then unmap."""
        s = self.state
        s.closed = True
        end = time.monotonic() + timeout
        self.producer.close()
        s.flush_releases()
        if s.background:
            await asyncio.wait(list(s.background), timeout=timeout)
        # unmap only after the copies reading the mappings are over (a launch stuck
        # behind a dead producer's event holds its mapping in s.keep instead)
        await waiter_for().wait_until(
            lambda: not any(m.inflight for m in s.maps.values()), end, interval=_CLOSE_POLL_S
        )
        self.consumer.close()
        self.producer.close_bells()
        self.pusher.close_all()  # (the consumers' grants rings we read)
        s.waits_ended = True


if TYPE_CHECKING:  # each role's primitives (interfaces.py) are its part's; the plane's all
    _producer_role: type[ProducerPlane] = Producer
    _consumer_role: type[ConsumerPlane] = Consumer
    _plane: type[Plane] = IpcPlane
