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

Modules: this one holds :class:`IpcPlane` with the consumer's side (mapping,
doorbell poll, staged and ordinary launches, abort rules, release);
:mod:`aiokv.kv.ipc._producer` the producer's side it inherits (export, events,
descriptor, release wait, layer-wise saving); :mod:`aiokv.kv.ipc._common` what both use
(backend, channel, trace, helpers). The plane meets its connector through
:mod:`aiokv.kv.ipc.interfaces` and settles leases by :mod:`aiokv.kv.ipc.lease`
(docs/ipc.md, "Structure").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aiokv._runtime.deadlines import _await_shielded, _time_left
from aiokv._runtime.threads import in_daemon
from aiokv._runtime.waiter import WaitEntry, waiter_for

from ..._exceptions import (
    AiokvError,
    AiokvTimeoutError,
    ConfigError,
    EngineClosedError,
    IpcUnavailableError,
    LayoutMismatchError,
    NotPublishedError,
    RemoteProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
)
from ..layouts import KVLayout, check_compatible
from ..ops import _to_device
from . import _cudrv, _doorbell, _kernel
from ._common import (
    HELLO,
    NO_OFFER,
    PREPARE_RID,
    RING,
    Backend,
    ControlChannel,
    CudaBackend,
    EngineChannel,
    _Export,
    _layer_id,
    _mark,
    _on,
    _retrieve,
    boot_id,
    check_same_host,
    log,
    unsupported_reason,
)
from ._mapping import (
    AbortWords,
    Mapper,
    _Mapping,
    _pid_alive,
)
from ._producer import _IpcSave, _ProducerSide
from ._wire import (
    LAYERS,
    PUSH,
    REVOKED,
    Descriptor,
    Offer,
    Release,
    decode_message,
    parse_revoke,
)
from ._wire_layers import LayerReady
from .interfaces import ConnectorPort
from .options import IpcOptions, IpcStatistics

#: how long the consumer polls a producer's event without sleeping (a forward pass
#: that ends within it is noticed within microseconds)
_READY_SPIN_S = 0.002
#: ring messages a consumer keeps per producer for requests that do not wait yet (the
#: producer has at most SLOTS - 1 ring-only descriptors unreleased, so this is slack)
_MAX_PENDING = 2 * _doorbell.SLOTS
#: request ids whose descriptor came by the ring, remembered (with the lease that tells
#: one send from another) so that a late engine copy of it is not taken for a new one
_MAX_TAKEN = 4096
#: the timed doorbell poll after the spin: every millisecond without a wake FIFO, a
#: safety net with one
_BELL_POLL_S = 0.001
_BELL_POLL_WAKE_S = 0.01
_REVOKED_B = bytes((REVOKED,))
#: a mapping whose producer process is gone (it is unmapped; requests fall back)
PRODUCER_GONE = "producer_gone"
#: the export's mapping did not finish before the request's deadline
MAP_TIMEOUT = "map_timeout"


@dataclass(slots=True, eq=False)
class _SlotBufs:
    """Per abort slot (consumer): the ids buffers and the two events its launches use."""

    cap: int  # int64 elements of each buffer (2 n ids fit)
    pin: torch.Tensor  # pinned host (CPU caches: the only buffer)
    dev: torch.Tensor  # device copy the kernel reads
    done: Any  # recorded after each launch of the slot's request
    order: Any  # the caller's stream, recorded before the ids' upload
    mv: memoryview  # of pin, for struct.pack_into
    streams: list[Any] = field(default_factory=list)  # dev was record_stream'ed on these


@dataclass(slots=True, eq=False)
class _Staged:
    """A whole request's copy made ready before its descriptor came (consumer): the
    abort slot, its ids buffer with the destination ids written, the caller's raw
    stream at ``recv_request``, the launch's arguments. When the descriptor comes by
    the ring and everything checks out at once, the ring's poll launches it on the
    spot (:meth:`IpcPlane._launch_staged`) instead of a loop pass later after the
    request's task decoded it again (docs/ipc.md, "Staged launches")."""

    rid: str
    m: _Mapping
    g: int
    sb: _SlotBufs
    rs: int
    n: int
    deadline: float
    programs: int
    params: Any  # the launch's parameter block (RawLaunch.params), made at staging
    t0: float = 0.0
    desc: Descriptor | None = None  # the descriptor, once the ring's poll validated it
    ready: Any = None  # ... and the producer's event it waits for
    launched: bool = False  # the copy was (or may have been) launched: abort rules apply
    error: BaseException | None = None  # a launch call that failed after the upload


async def _unless_refused(
    request_id: str, check: asyncio.Future[None], recv: Coroutine[Any, Any, str]
) -> str:
    """Run ``recv`` (a request's receive); should ``check`` (the session to its producer
    being opened) fail with :class:`~aiokv.LayoutMismatchError` first, cancel it (nothing
    was copied yet: no descriptor came) and raise that. Cancelled, the receive's own
    cancellation runs to its end before this returns."""
    task = asyncio.ensure_future(recv)
    try:
        await asyncio.wait((task, check), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait((task,))
        raise
    if not task.done():
        exc = None if check.cancelled() else check.exception()
        if isinstance(exc, LayoutMismatchError):
            task.cancel()
            await asyncio.wait((task,))
            if task.cancelled() or task.exception() is not None:
                raise LayoutMismatchError(f"IPC: request {request_id!r}: {exc}", code=exc.code)
    return await task


def _engine_first(bell: asyncio.Future[Any], _: object) -> None:
    """The engine's receive of a descriptor ended before the ring gave it."""
    if not bell.done():
        bell.set_result(None)


class IpcPlane(_ProducerSide):
    """The IPC data plane of one :class:`~aiokv.kv.KVConnector` (both roles).

    Built by the connector when it is given ``ipc=IpcOptions(...)``; the connector's
    ``send_request`` / ``recv_request`` then go through :meth:`send_request` /
    :meth:`recv_request`, which use IPC where it works and the connector's ordinary
    path otherwise (docs/ipc.md).
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
        self.port = port
        self.channel: ControlChannel = (
            channel if channel is not None else EngineChannel(self.port.engine)
        )
        self.options = options
        self.layout = self.port.layout
        self.device = self.port.device
        self.backend: Backend = backend if backend is not None else CudaBackend()
        self._clock = clock
        self._stats = IpcStatistics()
        self._boot_id = boot_id()
        cfg = getattr(self.port.engine, "config", None)
        authenticated = getattr(cfg, "curve", None) is not None
        self.disabled = (
            unsupported_reason(self.device, authenticated=authenticated, options=options)
            if backend is None
            else None
        )
        if self.disabled:
            log.info("IPC plane off for this connector: %s", self.disabled)
        # producer side
        self._export: _Export | None = None
        self._acked: set[str] = set()  # consumers that used our offer
        self._broken_to: dict[str, str] = {}  # consumer -> reason (fall back from now on)
        self._free_events: list[tuple[int, Any, bytes]] = []
        self._n_events = 0
        self._background: set[asyncio.Task[None]] = set()
        self._saves: dict[str, _IpcSave] = {}  # layer-wise requests being saved over IPC
        self._bells: dict[str, _doorbell.BellWriter | None] = {}  # consumer -> its ring
        self._ring_ok: set[str] = set()  # consumers whose last release said "by the ring"
        self._ring_only: dict[str, int] = {}  # consumer -> ring-only descriptors unreleased
        self._plain_saves: set[str] = set()  # ... and those that take the ordinary path
        # consumer side
        self._maps: dict[int, _Mapping] = {}
        self._failed_tokens: dict[int, str] = {}
        # abort words (never freed; a slot is a global number, the ids buffers are keyed
        # by it, so no two slots ever share a word) and what a launch may touch forever
        self._words = AbortWords(self.device, self.backend)
        self._keep: list[Any] = []
        # the CUDA set-up the first mapping needs (control stream, pinned sources, the
        # first abort block), made once on a daemon thread
        self._prepared: asyncio.Future[None] | None = None
        self._slotbufs: dict[int, _SlotBufs] = {}
        self._deferred: list[tuple[Descriptor, Release]] = []  # ok releases, sent soon
        # event waits still running when aclose ends fail (a dead producer's never fire)
        self._waits_ended = False
        # the driver for the per-request CUDA calls (options.driver_calls, real CUDA)
        self._opening: dict[int, asyncio.Future[_Mapping]] = {}  # exports being mapped
        self._drv = (
            _cudrv.driver()
            if backend is None and options.driver_calls and self.device.type == "cuda"
            else None
        )
        self._dev_index = self.device.index if self.device.index is not None else 0
        # slot buffers whose ids' upload may still be queued (not launched, retired):
        # freed once their event fired
        self._draining: list[_SlotBufs] = []
        # doorbell (consumer): request id -> (its waiter, the producer it must come from)
        self._bell_wait: dict[
            str,
            tuple[asyncio.Future[tuple[Descriptor, bool] | None], str | None, _Staged | None],
        ] = {}
        # the ring's poll (registered with the loop's waiter while a request waits)
        self._bell_entry: WaitEntry | None = None
        self._taken: dict[str, Any] = {}  # request id -> lease of a descriptor the ring gave
        self._closed = False
        # consumers an offer-only request is going to -> whether another hello came
        self._offering: dict[str, bool] = {}
        self._preparing: dict[str, asyncio.Future[bool]] = {}  # producer -> prepare()
        # producers whose engine accepted this engine's session, and sessions being opened
        # (only where the engines check layouts at set-up: _session_check)
        connect = getattr(self.port.engine, "connect", None)
        self._connect: Callable[..., Awaitable[None]] | None = (
            connect if getattr(cfg, "layout", None) is not None else None
        )
        self._session_up: set[str] = set()
        self._session_opening: dict[str, asyncio.Future[None]] = {}
        self._init_push()
        if not self.disabled and self.port.pull is not None:
            # consumers may ask for the offer ahead of their first request (prepare)
            with contextlib.suppress(AiokvError):
                self.port.pull.publish(HELLO, torch.zeros(1, dtype=torch.uint8), on_get=self._hello)
        self._mapper = Mapper(
            self.device,
            self.layout,
            self.port.caches,
            self.backend,
            options,
            self._drv,
            self._words,
            warm=not self.disabled and backend is None,
        )

    # ------------------------------------------------------------------ helpers

    # ------------------------------------------------------------------ consumer

    async def prepare(self, frm: str, timeout: float | None) -> bool:
        """Map and verify the export of the producer at ``frm`` ahead of its first
        request (which then waits for no mapping): GET the producer's :data:`HELLO`,
        which makes it send an offer-only request, and receive that. True when the
        export is mapped here; False when it cannot be (the plane is off on either
        side, or the request fell back: counted and logged as usual). Concurrent calls
        for one producer share one attempt."""
        if self.disabled or self.port.pull is None:
            return False
        if any(m.reply_to == frm and not m.broken for m in self._maps.values()):
            return True
        fut = self._preparing.get(frm)
        if fut is None:
            fut = asyncio.ensure_future(self._prepare(frm, timeout))
            self._preparing[frm] = fut
            fut.add_done_callback(lambda f: self._preparing.pop(frm, None))
        return await asyncio.shield(fut)

    async def _prepare(self, frm: str, timeout: float | None) -> bool:
        assert self.port.pull is not None
        deadline = self.port.deadline(timeout)
        try:
            await self.port.pull.get(HELLO, frm=frm, timeout=_time_left(deadline))
        except NotPublishedError:  # no IPC plane there
            return False
        plane = await self.recv_request(
            PREPARE_RID, (), frm=frm, timeout=_time_left(deadline), layerwise=False
        )
        return plane == "ipc"

    async def recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        """Receive a request from the producer at ``frm`` over the plane (or the ordinary
        path); returns the plane that carried it (``"ipc"`` or ``"engine"``). Until this
        engine's session to that producer is up (:meth:`_session_check`), the request
        also fails at once with the producer's refusal of it."""
        check = self._session_check(frm, timeout)
        recv = self._recv_request(
            request_id, block_ids, frm=frm, timeout=timeout, layerwise=layerwise
        )
        if check is None:
            return await recv
        return await _unless_refused(request_id, check, recv)

    def _session_check(self, frm: str | None, timeout: float | None) -> asyncio.Future[None] | None:
        """Where the engines check KV layouts at session set-up, the consumer opens its
        own session to the producer (it carries the releases) as a request from it
        begins: a producer whose layout does not match refuses it at once -- as this
        consumer's engine refuses the producer's, which only that side learns of. The
        default check compares every field but the block count, so both refuse or
        neither. None once the session was up (or without such a check). The attempt
        ends with the request's deadline at the latest (the next request tries again)."""
        if frm is None or frm in self._session_up or self._connect is None:
            return None
        fut = self._session_opening.get(frm)
        if fut is None:
            left = self.port.deadline(timeout) - time.monotonic()
            if left <= 0:
                return None
            fut = asyncio.ensure_future(self._connect(frm, timeout=left, nccl=False))
            self._session_opening[frm] = fut
            fut.add_done_callback(functools.partial(self._session_opened, frm))
        return fut

    def _session_opened(self, frm: str, fut: asyncio.Future[None]) -> None:
        if self._session_opening.get(frm) is fut:
            del self._session_opening[frm]
        if not fut.cancelled() and fut.exception() is None:
            self._session_up.add(frm)
        # (a failure is retrieved; the next request from frm tries again)

    async def _recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        deadline, host = self._begin(request_id, block_ids, timeout, unique=True, what="recv")
        n = len(host)
        rung = False
        if self.options.push and n:
            pm = self._push_source(frm)
            if pm is not None:  # push mode: grant the blocks, wait for the producer's copy
                return await self._recv_granted(
                    request_id, host, frm, deadline, pm, layerwise=layerwise
                )
        if not layerwise and any(m.bell is not None for m in self._maps.values()):
            staged = self._stage(request_id, host, frm, deadline)
            if staged is None:
                _mark(request_id, "unstaged")
            try:
                desc, plout, rung = await self._recv_desc(request_id, frm, deadline, staged)
            except BaseException as exc:
                if staged is not None and staged.desc is not None:
                    # the ring's poll took (and maybe launched) the copy, then this task
                    # was cancelled (or failed) before it resumed
                    await self._pull_staged(staged, deadline, False, exc)
                self._unstage(staged)
                raise
            if staged is not None and staged.desc is not None:
                await self._pull_staged(staged, deadline, rung, None)
                return "ipc"
            self._unstage(staged)
        else:
            raw = await self.channel.recv(
                f"{request_id}#ipc", frm=frm, timeout=_time_left(deadline)
            )
            _mark(request_id, "desc")
            desc, plout = Descriptor.from_wire(decode_message(raw))
        return await self._after_desc(
            request_id, host, desc, plout, frm, deadline, layerwise=layerwise, rung=rung
        )

    async def _after_desc(
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
    ) -> str:
        """A request's descriptor is here (not staged): check it against the request and
        copy by the plane it names, or take the ordinary path."""
        n = len(host)
        _mark(request_id, "decoded")
        if desc.rid != request_id:
            raise RemoteProtocolError(f"IPC descriptor for {desc.rid!r:.64} under {request_id!r}")
        L = self.layout.num_layers

        def drop_layers() -> None:
            if desc.plane == LAYERS:  # the layer messages the producer sends regardless
                self.port.drop(
                    request_id, [_layer_id(request_id, i) for i in range(L)], frm, deadline
                )

        if desc.n != n:
            if desc.plane != "chunks":
                self._release(desc, Release(request_id, False, reason="block count mismatch"))
                drop_layers()
            raise LayoutMismatchError(
                f"IPC: the producer sends {desc.n} blocks of {request_id!r}, "
                f"{n} were allocated here",
                code="kv_size_mismatch",
            )
        # (a push says nothing of how the producer saved it: all layers are in place)
        if desc.plane not in ("chunks", PUSH) and (desc.plane == LAYERS) != layerwise:
            self._release(desc, Release(request_id, False, reason="mode mismatch"))
            drop_layers()
            raise LayoutMismatchError(
                f"IPC: the producer sends {request_id!r} "
                + ("layer by layer (save_layer)" if desc.plane == LAYERS else "whole")
                + f" but the consumer expects {'layers' if layerwise else 'the whole request'} "
                "(send_request pairs with recv_request(layerwise=False), save_layer with "
                "layerwise=True)",
                code="kv_mode_mismatch",
            )

        if desc.plane == "chunks":
            await self._recv_plain(request_id, host, frm, deadline, layerwise)
            return "engine"
        if desc.plane == PUSH:
            # a push this request did not grant: a stale grant of an earlier request of
            # the same id (its abort word was set: it copied nothing), or a faulty peer
            return await self._refuse_push(
                desc,
                request_id,
                host,
                frm,
                deadline,
                desc.reply_to,
                "a push without a grant",
                layerwise=layerwise,
            )
        try:
            m = await self._mapping(desc, plout, deadline)
        except IpcUnavailableError as exc:
            self._count_fallback(exc.reason, desc.reply_to, str(exc))
            self._release(desc, Release(request_id, False, fallback=True, reason=exc.reason))
            drop_layers()
            await self._recv_plain(request_id, host, frm, deadline, layerwise)
            return "engine"
        except LayoutMismatchError:
            self._release(desc, Release(request_id, False, reason="layout mismatch"))
            drop_layers()
            raise
        _mark(request_id, "mapped")
        m.can_push = desc.can_push
        if n == 0:  # an offer alone (prepare): mapped and verified, nothing to copy
            self._release(desc, Release(request_id, True, push=self._offer_push(m)))
            return "ipc"
        await self._pull(m, desc, host, deadline, frm, rung=rung)
        return "ipc"

    async def _recv_desc(
        self, rid: str, frm: str | None, deadline: float, staged: _Staged | None = None
    ) -> tuple[Descriptor, KVLayout | None, bool]:
        """The request's descriptor (decoded; not yet checked against the request) and
        its inline offer's layout from whichever comes first: a producer's doorbell
        ring or the engine; and whether the ring gave it.
        When the ring wins, an engine copy (sent too, or late as a backup) is discarded
        as far as it is here or on its way, and one landing later is never taken for a
        new request of the same id (``_taken``)."""
        got = self._bell_take(rid, frm)  # read before this call (or right now)
        if got is not None:
            return self._rung(rid, *got, frm, deadline), None, True
        while True:
            # One future for both: the ring's poll sets the descriptor, the engine's
            # receive (ending first, in any way) sets None. Awaited directly, it wakes
            # this task a loop pass sooner than asyncio.wait over the two.
            bell: asyncio.Future[tuple[Descriptor, bool] | None] = (
                asyncio.get_running_loop().create_future()
            )
            self._bell_wait[rid] = (bell, frm, staged)
            self._bell_kick()
            eng = asyncio.ensure_future(
                self.channel.recv(f"{rid}#ipc", frm=frm, timeout=_time_left(deadline))
            )
            eng.add_done_callback(functools.partial(_engine_first, bell))
            try:
                got = await bell
            except BaseException:
                eng.cancel()  # (a descriptor already handed over goes back to the store)
                raise
            finally:
                w = self._bell_wait.get(rid)
                if w is not None and w[0] is bell:
                    del self._bell_wait[rid]
            if got is not None:
                if eng.done():
                    if not eng.cancelled():
                        eng.exception()  # retrieved; a descriptor it took goes with it
                else:
                    eng.cancel()
                return self._rung(rid, *got, frm, deadline), None, True
            taken = self._from_engine(rid, eng.result())
            if taken is not None:
                return taken

    def _desc_nowait(
        self, rid: str, frm: str | None, deadline: float
    ) -> tuple[Descriptor, KVLayout | None, bool] | None:
        """The request's descriptor if it is here already (ring or engine), as
        :meth:`_recv_desc` returns it; None if not yet."""
        got = self._bell_take(rid, frm)
        if got is not None:
            return self._rung(rid, *got, frm, deadline), None, True
        raw = self.channel.recv_nowait(f"{rid}#ipc", frm=frm)
        return None if raw is None else self._from_engine(rid, raw)

    def _from_engine(self, rid: str, raw: Any) -> tuple[Descriptor, KVLayout | None, bool] | None:
        """A descriptor the engine delivered for ``rid``, decoded, as :meth:`_recv_desc`
        returns it; None for a late engine copy of one the ring gave (``_taken``: it was
        collected, and is dropped)."""
        d = decode_message(raw)
        if rid in self._taken and self._taken[rid] == d.get("lease"):
            return None
        _mark(rid, "desc")
        return *Descriptor.from_wire(d), False

    def _rung(
        self, rid: str, desc: Descriptor, solo: bool, frm: str | None, deadline: float
    ) -> Descriptor:
        """A descriptor taken from the ring: count it, drop the engine's copy, remember
        its lease. The copy of a descriptor the engine carried too is collected and
        dropped as it lands (it surely comes); one sent by the ring alone (``solo``) has
        an engine copy only as a late backup: dropped where it is (landed or in flight),
        else left to land and expire -- and never taken for a new request of the same id
        (``_taken``)."""
        _mark(rid, "desc")
        self._stats.doorbell_hits += 1
        self.port.drop(rid, [f"{rid}#ipc"], frm, deadline, late=not solo)
        self._taken.pop(rid, None)
        self._taken[rid] = desc.lease
        if len(self._taken) > _MAX_TAKEN:
            del self._taken[next(iter(self._taken))]
        return desc

    def _bell_take(self, rid: str, frm: str | None) -> tuple[Descriptor, bool] | None:
        """Read the rings of the mappings from ``frm`` (every one when None) and take
        ``rid``'s descriptor if one of them had it."""
        for m in list(self._maps.values()):
            if m.bell is None or (frm is not None and frm != m.reply_to):
                continue
            self._bell_poll(m)
            got = m.pending.pop(rid, None)
            if got is not None:
                return got
        return None

    def _bell_kick(self) -> None:
        """Spin the doorbell poll for ``doorbell_spin_s`` from now (start it if needed)."""
        spin = self.options.doorbell_spin_s
        entry = self._bell_entry
        if entry is None:
            self._bell_entry = waiter_for().add(self._bell_tick, interval=_BELL_POLL_S, spin=spin)
        else:
            entry.reset(time.monotonic(), spin)
            waiter_for().reschedule()

    def _bell_tick(self, _now: float) -> bool:
        """Poll every mapped producer's ring while a request waits: a poll of the loop's
        waiter, asked on every loop pass while spinning (``doorbell_spin_s`` after the
        latest request began to wait), then on the waiter's timer -- every millisecond,
        or every 10 ms where each ring's wake FIFO wakes the loop anyway. True (done,
        unregistered) once no request waits. An error escaping it (a bug: the ring's
        poll keeps its own failures in) is the waiter's to report; the next request
        registers the poll again."""
        if not self._bell_wait or self._closed:
            self._bell_entry = None
            return True
        woken = True
        try:
            for m in list(self._maps.values()):
                if m.bell is not None:
                    self._bell_poll(m)
                    woken = woken and m.bell is not None and m.bell.wake_fd >= 0
        except BaseException:
            self._bell_entry = None
            raise
        if not self._bell_wait:
            self._bell_entry = None
            return True
        entry = self._bell_entry
        if entry is not None:  # (the interval the waiter takes next)
            entry.interval = entry.max_interval = _BELL_POLL_WAKE_S if woken else _BELL_POLL_S
        return False

    def _bell_woken(self, m: _Mapping) -> None:
        """The producer wrote into ``m``'s wake FIFO: read its ring now."""
        b = m.bell
        if b is None:
            return
        if not b.drain_wake():  # the producer closed it: the timed poll serves alone
            asyncio.get_running_loop().remove_reader(b.wake_fd)
            b.close_wake()
        self._bell_poll(m)

    def _bell_drop(self, m: _Mapping) -> None:
        """Stop reading ``m``'s ring (and watching its wake FIFO), and close our grants'
        ring to its producer."""
        gb, m.grant_bell = m.grant_bell, None
        if gb is not None:
            gb.close()
        b, m.bell = m.bell, None
        if b is None:
            return
        if b.wake_fd >= 0:
            with contextlib.suppress(Exception):  # (no loop any more at interpreter exit)
                asyncio.get_running_loop().remove_reader(b.wake_fd)
        b.close()

    def _bell_poll(self, m: _Mapping) -> None:
        """Hand the descriptors in ``m``'s ring to their waiting requests, and keep those
        of requests that do not wait yet in ``m.pending``. A message is only taken for a
        request from this producer (the caller's ``frm``), for this export, plane
        ``"ipc"``; anything else is left to the engine's copy. A record is decoded with
        the engine message's field rules (:meth:`Descriptor.from_ring`); one that does
        not decode is rejected. Checks against the request follow in ``recv_request``,
        as for the engine's."""
        b = m.bell
        assert b is not None
        before = b.rejected
        try:
            msgs = b.poll()
        except Exception as exc:  # (defensive: a ring that cannot be read is dropped)
            log.warning("aiokv IPC plane: doorbell of export %x dropped: %s", m.token, exc)
            self._bell_drop(m)
            return
        for payload in msgs:
            try:
                if payload[:1] == _REVOKED_B:  # push mode: a revoked grant never taken
                    rid, gid = parse_revoke(payload, REVOKED)
                    m.revoked[gid] = rid
                    if len(m.revoked) > _MAX_PENDING:
                        del m.revoked[next(iter(m.revoked))]
                    continue
                desc, solo = Descriptor.from_ring(payload, m.reply_to)
            except RemoteProtocolError:
                b.rejected += 1
                continue
            if desc.token != (m.token if desc.plane != PUSH else self._push_token()):
                continue
            rid = desc.rid
            w = self._bell_wait.get(rid)
            if w is not None and (w[1] is None or w[1] == m.reply_to) and not w[0].done():
                if w[2] is not None and w[2].m is m:
                    self._launch_staged(w[2], desc)
                if not w[0].done():  # (the task was not cancelled meanwhile)
                    w[0].set_result((desc, solo))
                continue
            m.pending.pop(rid, None)
            m.pending[rid] = (desc, solo)  # nobody waits yet: a later recv_request takes it
            if len(m.pending) > _MAX_PENDING:
                del m.pending[next(iter(m.pending))]
        if b.rejected != before:
            self._stats.doorbell_rejected += b.rejected - before
            log.warning(
                "aiokv IPC plane: %d doorbell slot(s) of export %x rejected (MAC or format)",
                b.rejected - before,
                m.token,
            )

    def _release(self, desc: Descriptor, rel: Release) -> None:
        try:
            self._send_msg(
                f"{desc.rid}#ipcrel", rel.to_wire(), desc.reply_to, self.options.grace_s + 30.0
            )
        except Exception as exc:  # engine closing: the producer's lease runs out instead
            log.warning("aiokv IPC plane: could not send the release of %r: %s", desc.rid, exc)

    async def _mapping(
        self, desc: Descriptor, layout: KVLayout | None, deadline: float
    ) -> _Mapping:
        """The verified mapping for the descriptor's export (made on first use, its CUDA
        IPC opens off the event loop; requests of an export being mapped wait for that
        one mapping, until their ``deadline``: then ``map_timeout``, and the mapping
        goes on for later requests)."""
        m = self._maps.get(desc.token)
        if m is not None:
            if m.broken:
                raise IpcUnavailableError(m.broken)
            return m
        why = self._failed_tokens.get(desc.token)
        if why:
            raise IpcUnavailableError(why)
        if self.disabled:
            raise IpcUnavailableError(self.disabled)
        opening = self._opening.get(desc.token)
        if opening is None:
            if desc.offer is None or layout is None:
                raise IpcUnavailableError(NO_OFFER, "the producer's export is unknown here")
            check_compatible(layout, self.layout)  # LayoutMismatchError: a real error
            opening = asyncio.ensure_future(self._open_export(desc, desc.offer, layout))
            opening.add_done_callback(_retrieve)  # (also when no request waits any more)
            self._opening[desc.token] = opening
        try:  # a cancelled or timed-out request leaves the mapping running
            mapped: _Mapping = await _await_shielded(opening, deadline - time.monotonic())
        except TimeoutError:
            raise IpcUnavailableError(
                MAP_TIMEOUT, "mapping the export took longer than the request's deadline"
            ) from None
        return mapped

    async def _open_export(self, desc: Descriptor, offer: Offer, layout: KVLayout) -> _Mapping:
        """Map one export and verify it, on a daemon thread (:meth:`_map_verified`):
        CUDA IPC opens take milliseconds per allocation, and the verification compiles
        and loads the kernel -- seconds in a fresh process (the event loop
        stalls 1.1-2.4 s when the verification runs on it) -- then register it."""
        token = desc.token
        try:
            try:
                check_same_host(offer, my_boot_id=self._boot_id, now=self._clock())
                # what the thread shares with the loop exists before it starts: the
                # control stream, the abort copies' pinned sources and the probe copies'
                # abort slots (their words zeroed; the first block made off the loop too)
                if self.device.type == "cuda":
                    if self._prepared is None:
                        self._prepared = in_daemon(self._words.prepare, "aiokv-ipc-prep")
                    await asyncio.shield(self._prepared)
                slots = [self._words.slot() for _ in range(4)] if self._mapper.use_triton() else []
                m = await in_daemon(
                    functools.partial(self._mapper.map_verified, offer, layout, slots),
                    "aiokv-ipc-map",
                )
                self._words.free += slots[0::2]  # (their copies finished, nothing set)
            except IpcUnavailableError as exc:
                self._stats.mapping_failures += 1
                self._failed_tokens[token] = exc.reason
                raise
            except Exception as exc:  # CUDA refused: other container, PID namespace...
                self._stats.mapping_failures += 1
                self._failed_tokens[token] = "map_failed"
                raise IpcUnavailableError("map_failed", f"{type(exc).__name__}: {exc}") from None
        finally:
            del self._opening[token]
        m.reply_to = desc.reply_to
        if self._closed:  # closed while mapping: nothing may keep the export mapped
            raise IpcUnavailableError("closed", "the plane was closed while mapping")
        if offer.bell and self.options.doorbell:
            try:
                m.bell = _doorbell.BellReader(offer.bell, offer.bell_key)
            except (OSError, ValueError) as exc:  # the engine path serves alone
                log.info("aiokv IPC plane: doorbell %s not used: %s", offer.bell, exc)
            else:
                if m.bell.wake_fd >= 0:
                    asyncio.get_running_loop().add_reader(m.bell.wake_fd, self._bell_woken, m)
        self._maps[token] = m
        self._stats.mappings_verified += 1
        self._sweep_mappings()
        return m

    def _sweep_mappings(self) -> None:
        """Drop the mappings of producers whose process is gone (a restarted prefill
        offers a new export): a mapping keeps the producer's whole cache allocation
        alive on its GPU, where the restarted producer needs that memory again. One with
        copies in flight is dropped when its last one ends (:meth:`_copy_ended`)."""
        for m in list(self._maps.values()):
            if m.pid and not _pid_alive(m.pid):
                m.broken = PRODUCER_GONE
                if m.inflight == 0:
                    self._drop_mapping(m)

    def _drop_mapping(self, m: _Mapping) -> None:
        if self._maps.get(m.token) is m:
            del self._maps[m.token]
            self._bell_drop(m)
            self._stats.mappings_dropped += 1
            log.info("aiokv IPC plane: export %x unmapped (its producer is gone)", m.token)

    def _copy_ended(self, m: _Mapping) -> None:
        m.inflight -= 1
        if m.inflight == 0 and m.broken == PRODUCER_GONE:
            self._drop_mapping(m)

    def _event(self, m: _Mapping, slot: int, handle: bytes) -> Any:
        """The producer's IPC event in ``slot`` (opened once per slot and handle)."""
        cached = m.events.get(slot)
        if cached is not None and cached[0] == handle:
            return cached[1]
        try:
            ev = self.backend.open_event(handle, self.device)
        except Exception as exc:
            raise IpcUnavailableError("event_failed", f"{type(exc).__name__}: {exc}") from None
        if len(m.events) >= 4096:
            m.events.clear()
        m.events[slot] = (handle, ev)
        return ev

    def _slot_bufs(self, slot: int, n: int) -> _SlotBufs:
        """The abort slot's reusable ids buffers (pinned host + device) and events.

        A slot is handed out again only after the launch that used it finished (or
        never, once its abort word was set), so its buffers can be rewritten without
        a wait: no allocation, pinning or event creation per request.
        """
        sb = self._slotbufs.get(slot)
        if sb is not None and sb.cap >= 2 * n:
            return sb
        dev = self.device
        cap, pin, dbuf, mv = self._ids_buffers(n)
        done = order = None
        if dev.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            order = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(torch.cuda.current_stream(dev))  # created now (the driver records it)
            self._draining = [d for d in self._draining if not d.done.query()]
        sb = _SlotBufs(cap, pin, dbuf, done, order, mv)
        self._slotbufs[slot] = sb
        return sb

    def _retire_slot(self, slot: int, keep: bool, upload_on: int | None = None) -> None:
        """The slot's buffers after an abort or a failed launch: never rewritten again
        (kept forever when a launch may still read them; until an event after the ids'
        upload fired when the driver queued that upload on raw stream ``upload_on``)."""
        sb = self._slotbufs.pop(slot, None)
        if sb is not None and keep:
            self._keep.append(sb)
        elif sb is not None and upload_on is not None and self._drv is not None:
            self._drv.event_record(sb.done.cuda_event, upload_on)
            self._draining.append(sb)

    def _staging_mapping(self, frm: str | None) -> _Mapping | None:
        """The mapping a whole request from ``frm`` would be staged for (one mapping
        it can come from, with a ring and a verified raw launch), or None."""
        if self._drv is None or self.options.gpu_wait or self.disabled:
            return None
        ms = [
            m
            for m in self._maps.values()
            if m.bell is not None
            and m.raw is not None
            and not m.broken
            and (frm is None or m.reply_to == frm)
        ]
        if len(ms) != 1 or not self._mapper.use_triton():
            return None
        return ms[0]

    def stages_for(self, frm: str) -> bool:
        """Whether a ``recv_request`` from ``frm`` would be staged (pull mode starts
        it beside the ticket's GET then, so that the ring's poll can launch the copy
        as soon as the producer sends)."""
        return self._staging_mapping(frm) is not None

    def _stage(
        self, rid: str, host: tuple[int, ...], frm: str | None, deadline: float
    ) -> _Staged | None:
        """Make a whole request's copy ready ahead of its descriptor, when the driver's
        launch will serve it: one mapping it can come from (``frm``'s, or the only one),
        with a ring and a verified raw launch, the caller's current stream on this
        device. Everything but the source ids is done here, off the critical path."""
        m = self._staging_mapping(frm) if host else None
        if m is None:
            return None
        rs = self._raw_stream()
        if rs is None:
            return None
        n = len(host)
        g = self._words.slot()
        ab, slot = self._words.word(g)
        sb = self._slot_bufs(g, n)
        programs, args = self._raw_args(m, sb.dev, ab, slot, n, 0, self.layout.num_layers)
        if not 0 < programs <= _kernel.MAX_PROGRAMS:
            self._words.free.append(g)
            return None
        struct.pack_into(f"<{n}q", sb.mv, 8 * n, *host)  # destination ids: second half
        assert m.raw is not None
        params = m.raw.params(args)
        return _Staged(rid, m, g, sb, rs, n, deadline, programs, params)

    def _unstage(self, st: _Staged | None) -> None:
        """A staged copy the ring's poll did not take: its slot serves again (no upload
        was queued with it)."""
        if st is not None and st.desc is None:
            self._words.free.append(st.g)

    def _launch_staged(self, st: _Staged, desc: Descriptor) -> None:
        """The ring's poll has ``st``'s descriptor (decoded): check it as
        ``recv_request`` and :meth:`_pull` would, and launch the copy now if the
        producer's event already fired. A descriptor that fails a check is left alone
        (the request's task goes the ordinary way, the same checks raising the same
        errors); one whose event has not fired yet stays checked (``st.desc``): the task
        waits for the event and launches (:meth:`_pull_staged`)."""
        _mark(st.rid, "ring")
        m = st.m
        now = time.monotonic()
        try:  # (this runs inside the ring's poll: nothing may escape into it)
            ok = not (
                desc.rid != st.rid
                or desc.plane != "ipc"
                or desc.n != st.n
                or desc.offer is not None
                or desc.token != m.token
                or self._maps.get(desc.token) is not m
                or m.broken
                or max(desc.src) >= m.layout.num_blocks
                or min(st.deadline, now + desc.lease - self._clock()) <= now
                or not self._on_device()
            )
        except Exception:
            ok = False
        if not ok:
            _mark(st.rid, "ring:check")
            return
        _mark(st.rid, "ring:checked")
        try:
            st.ready = self._event(m, desc.event_slot, desc.event)
            fired = bool(st.ready.query())
            _mark(st.rid, "ring:queried")
        except Exception:
            _mark(st.rid, "ring:event")
            return
        st.desc = desc
        if not fired:
            _mark(st.rid, "ring:not-ready")
            return
        with contextlib.suppress(Exception):  # (the upload failed: the task retries, fails)
            self._fire_staged(st)
            self._stats.ring_launches += 1

    def _fire_staged(self, st: _Staged) -> None:
        """Upload the source ids of ``st``'s validated descriptor and launch its copy on
        the caller's stream. Raises if the upload fails (then nothing was queued); a
        failed launch call after it is kept in ``st.error`` (the abort rules apply)."""
        if not self._on_device():  # (switched by other code while the task waited)
            with torch.cuda.device(self._dev_index):
                return self._fire_staged(st)
        m, sb, n, desc = st.m, st.sb, st.n, st.desc
        drv = self._drv
        assert drv is not None and m.raw is not None and sb.done is not None and desc is not None
        struct.pack_into(f"<{n}q", sb.mv, 0, *desc.src)
        st.t0 = time.perf_counter()
        drv.memcpy_htod_async(sb.dev.data_ptr(), sb.pin.data_ptr(), 16 * n, st.rs)
        _mark(st.rid, "staged")
        st.launched = True
        m.inflight += 1
        self._stats.staged_launches += 1
        try:
            m.raw.launch_with(st.programs, st.rs, st.params)
            drv.event_record(sb.done.cuda_event, st.rs)
        except Exception as exc:
            st.error = exc
        _mark(st.rid, "launched0")

    async def _pull(
        self,
        m: _Mapping,
        desc: Descriptor,
        host: tuple[int, ...],
        deadline: float,
        frm: str | None = None,
        *,
        rung: bool = False,
    ) -> None:
        """Copy the request: one launch (``plane == "ipc"``), or one per chunk of layers
        as the producer's :class:`LayerReady` messages arrive (``LAYERS``). ``rung``:
        the descriptor came by the doorbell (the ok release says so)."""
        n = len(host)
        lay = self.layout
        layerwise = desc.plane == LAYERS
        if n and max(desc.src) >= m.layout.num_blocks:  # uint32 on the wire: never < 0
            self._release(desc, Release(desc.rid, False, reason="source block id out of range"))
            raise RemoteProtocolError(
                f"IPC descriptor of {desc.rid!r}: source block ids out of [0, {m.layout.num_blocks})"
            )
        # our own deadline, and never past the producer's lease (both as time.monotonic())
        until = min(deadline, time.monotonic() + desc.lease - self._clock())
        if until <= time.monotonic():
            self._stats.lease_expired += 1
            self._release(desc, Release(desc.rid, False, reason="lease over before the copy"))
            raise TransferTimeoutError(f"IPC: the lease of {desc.rid!r} was over on arrival")
        if not layerwise:
            try:
                first = self._event(m, desc.event_slot, desc.event)
            except IpcUnavailableError as exc:
                self._count_fallback(exc.reason, desc.reply_to, str(exc))
                self._release(desc, Release(desc.rid, False, fallback=True, reason=exc.reason))
                left = max(0.0, deadline - time.monotonic())
                await self.port.recv_plain(desc.rid, host, frm=None, timeout=left, layerwise=False)
                return
        t0 = time.perf_counter()
        triton = self._mapper.use_triton()
        g = self._words.slot()
        ab, slot = self._words.word(g)
        sb = self._slot_bufs(g, n)
        _mark(desc.rid, "slot")
        dev = self.device
        # The copy runs on the caller's current stream: ordered after its work so far and
        # before its next, with no extra stream, event or switch per request. Only a
        # launch that may be queued behind the producer's event (gpu_wait) runs on the
        # mapping's own stream, so that a dead producer can only ever block that one.
        own = triton and self.options.gpu_wait and dev.type == "cuda"
        # the driver path: the caller's current stream as a raw handle, the ids' upload,
        # launch and completion record through the driver (the launch verified bit-exact)
        rs = self._raw_stream() if triton and not own and m.raw is not None else None
        if rs is not None:
            stream: Any = rs
        else:
            stream = m.stream if own or dev.type != "cuda" else torch.cuda.current_stream(dev)
        L = lay.num_layers
        nxt = 0  # layers [0, nxt) are launched
        got = 0  # layers [0, got) were announced; marks: those of [nxt, got)
        marks: deque[tuple[int, bytes, int]] = deque()
        launched = False
        awaited = False  # since `stream` was taken (other code may switch streams meanwhile)
        m.inflight += 1
        try:
            ids = self._stage_ids(stream, own, sb, desc.src, host, raw=rs is not None)
            _mark(desc.rid, "staged")
            while nxt < L:
                if layerwise:
                    awaited = True
                    if not marks:  # (then nxt == got)
                        lr = await self._next_layers(m, desc, got, frm, until)
                        marks.extend(lr.marks)
                        got = lr.hi
                    hi, handle, eslot = marks.popleft()
                    ready = self._layer_event(m, eslot, handle)
                    if marks and got == L and self._all_fired(m, marks):
                        # every later layer is written already (the consumer came
                        # after the producer's forward): one launch for all of them
                        hi = L
                        marks.clear()
                else:
                    hi, ready = L, first
                _mark(desc.rid, f"ready?{nxt}")
                gpu_wait = False
                if not bool(ready.query()):
                    if triton and self.options.gpu_wait:
                        gpu_wait = True
                    else:
                        # Not launched before the producer's event fired: a launch queued
                        # behind the event of a producer that then dies would keep its
                        # stream (and any device-wide synchronize) waiting forever.
                        awaited = True
                        await self._wait_ready(ready, until)
                _mark(desc.rid, f"ready{nxt}")
                launched = True  # (from here on a launch may be queued: abort rules apply)
                self._launch(
                    m,
                    stream,
                    ready if gpu_wait else None,
                    ids,
                    ab,
                    slot,
                    triton,
                    nxt,
                    hi,
                    sb,
                    n,
                    current=not own and not awaited,
                    raw=rs is not None,
                )
                _mark(desc.rid, f"launched{nxt}")
                nxt = hi
            done = sb.done if sb.done is not None else _Fired()
            await self._wait_done(done, until - time.monotonic())
            _mark(desc.rid, "done")
        except BaseException as exc:
            if layerwise and got < L:  # the producer's later layer messages: dropped
                self.port.drop(
                    desc.rid, [_layer_id(desc.rid, i) for i in range(got, L)], frm, deadline
                )
            if not launched:
                self._copy_ended(m)
                # nothing was launched with the slot: it may serve again, with new buffers
                # (its ids' upload may still be queued: with torch's copy the device buffer
                # is marked used by the copy stream and the pinned one by the copy; with the
                # driver's, the buffers are held until an event after the upload fired)
                self._retire_slot(g, keep=False, upload_on=rs)
                self._words.free.append(g)
                self._unlaunched_failed(desc, exc)
                raise
            await self._abort_launched(m, desc, g, sb, exc)
            raise
        self._copied(m, desc, g, sb, rs, stream, own, rung, t0)

    async def _pull_staged(
        self, st: _Staged, deadline: float, rung: bool, exc: BaseException | None
    ) -> None:
        """The rest of a request whose descriptor the ring's poll validated
        (:meth:`_launch_staged`): when its producer's event had not fired then, wait for
        it and launch; then wait for the copy. ``exc``: the request failed (was
        cancelled) after the poll took its descriptor: end it by the abort rules (a
        launched copy is settled, an unlaunched one released) and re-raise."""
        m, desc = st.m, st.desc
        assert desc is not None
        m.can_push = desc.can_push
        until = min(deadline, time.monotonic() + desc.lease - self._clock())
        if not st.launched:
            try:
                if exc is not None:
                    raise exc
                await self._wait_ready(st.ready, until)
                _mark(desc.rid, "ready0")
                self._fire_staged(st)
            except BaseException as e:
                if not st.launched:
                    self._words.free.append(st.g)  # nothing was queued with it
                    self._unlaunched_failed(desc, e)
                    raise
                exc = e  # (interrupted after the upload: the abort rules apply)
        try:
            if exc is not None:
                raise exc
            if st.error is not None:
                raise st.error
            done = st.sb.done if st.sb.done is not None else _Fired()
            await self._wait_done(done, until - time.monotonic())
            _mark(desc.rid, "done")
        except BaseException as e:
            await self._abort_launched(m, desc, st.g, st.sb, e)
            raise
        self._copied(m, desc, st.g, st.sb, st.rs, st.rs, False, rung, st.t0)

    def _unlaunched_failed(self, desc: Descriptor, exc: BaseException) -> None:
        """A request failed before its copy was launched: the producer's blocks are
        released with the reason (its event did not fire in time, cancelled, failed)."""
        if isinstance(exc, (AiokvTimeoutError, asyncio.TimeoutError, TimeoutError)):
            self._stats.lease_expired += 1
            why = "producer not ready"
        else:
            why = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
        self._release(desc, Release(desc.rid, False, reason=why))
        self.port.recv_failed()

    async def _abort_launched(
        self, m: _Mapping, desc: Descriptor, g: int, sb: _SlotBufs, exc: BaseException
    ) -> None:
        """A copy that may have been launched failed (deadline, cancellation, error):
        set its abort word, wait (bounded) until the launch is over, release the
        producer's blocks with a failure. Raises :class:`TransferTimeoutError` for a
        timeout; the caller re-raises anything else."""
        timeout = isinstance(exc, (AiokvTimeoutError, asyncio.TimeoutError, TimeoutError))
        self._words.set(g)
        self._stats.aborted += 1
        settled = await self._settle(m, sb.done if sb.done is not None else _Fired())
        self._retire_slot(g, keep=not settled)
        if not settled:  # a stuck launch keeps its mapping's tensors forever
            self._keep.append((m.src_table, m.tables, m.storages))
        self._copy_ended(m)
        reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else "deadline"
        if not (timeout or isinstance(exc, asyncio.CancelledError)):
            reason = "failed"
        self._release(desc, Release(desc.rid, False, reason=reason))
        self.port.recv_failed()
        if timeout and not isinstance(exc, TransferTimeoutError):
            raise TransferTimeoutError(
                f"IPC copy of {desc.rid!r} did not finish within its deadline/lease"
            ) from None

    def _copied(
        self,
        m: _Mapping,
        desc: Descriptor,
        g: int,
        sb: _SlotBufs,
        rs: int | None,
        stream: Any,
        own: bool,
        rung: bool,
        t0: float,
    ) -> None:
        """A copy finished: the slot serves again, the caller's current stream is
        ordered after the copy, the release goes out soon, the counters move."""
        dev = self.device
        self._copy_ended(m)
        self._words.free.append(g)
        if rs is not None:
            if self._raw_stream() != rs:
                torch.cuda.current_stream(dev).wait_event(sb.done)  # switched meanwhile
        elif sb.done is not None and (own or torch.cuda.current_stream(dev) != stream):
            # the copy ran on another stream than the caller's current one (gpu_wait, or
            # a stream switched by other code during our awaits): order the caller after it
            torch.cuda.current_stream(dev).wait_event(sb.done)
        # off the critical path: sent after the caller (woken by our return) ran
        rel = Release(desc.rid, True, reason=RING if rung else "", push=self._offer_push(m))
        self._release_soon(desc, rel)
        self._stats.requests_received += 1
        self._stats.bytes_received += self.layout.request_nbytes(desc.n)
        self.port.received(desc.rid, desc.n, t0)  # (no chunks: one copy by the plane)
        _mark(desc.rid, "return")

    async def _next_layers(
        self, m: _Mapping, desc: Descriptor, lo: int, frm: str | None, until: float
    ) -> LayerReady:
        """The producer's message for the layers starting at ``lo`` (validated)."""
        raw = await self.channel.recv(
            _layer_id(desc.rid, lo), frm=frm, timeout=max(0.0, until - time.monotonic())
        )
        _mark(desc.rid, f"layermsg{lo}")
        lr = LayerReady.from_wire(decode_message(raw), self.layout.num_layers)
        if lr.rid != desc.rid or lr.lo != lo:
            raise RemoteProtocolError(
                f"IPC layer message for {lr.rid!r:.64} layer {lr.lo} under {desc.rid!r:.64} "
                f"layer {lo}"
            )
        return lr

    def _all_fired(self, m: _Mapping, marks: deque[tuple[int, bytes, int]]) -> bool:
        """Whether the events of all ``marks`` fired (the last first: while a
        forward still runs it has not, and one query says so)."""
        return all(bool(self._layer_event(m, sl, h).query()) for _, h, sl in reversed(marks))

    def _layer_event(self, m: _Mapping, slot: int, handle: bytes) -> Any:
        try:
            return self._event(m, slot, handle)
        except IpcUnavailableError as exc:  # mid-stream: no fallback once layers were read
            raise TransferAbortedError(f"IPC: {exc}") from None

    def _release_soon(self, desc: Descriptor, rel: Release) -> None:
        """Send ``rel`` two loop passes from now: the caller of ``recv_request``, woken
        by its return in the next pass, runs before the release is encoded and sent.
        Releases of one pass go together; :meth:`aclose` sends any still waiting."""
        self._deferred.append((desc, rel))
        if len(self._deferred) == 1:
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._flush_releases)

    def _flush_releases(self) -> None:
        pending, self._deferred = self._deferred, []
        for desc, rel in pending:
            self._release(desc, rel)

    def _stage_ids(
        self,
        stream: Any,
        own: bool,
        sb: _SlotBufs,
        src: Sequence[int],
        dst: Sequence[int],
        *,
        raw: bool = False,
    ) -> torch.Tensor:
        """Write the ids (``n`` source, then ``n`` destination) into the slot's pinned
        buffer and, on a GPU, enqueue their upload on ``stream``; returns what the copy
        reads. The mapping's own stream (``own``) first waits for the caller's current
        stream (its work so far may still read the destination blocks). A few Python
        and torch calls, no allocation: each one costs tens of µs on an H200 host."""
        n = len(dst)
        if n:
            struct.pack_into(f"<{2 * n}q", sb.mv, 0, *src, *dst)
        if self.device.type != "cuda":
            return sb.pin[: 2 * n].view(2, n)
        if raw:  # ``stream`` is a raw handle; exactly the ids' bytes
            assert self._drv is not None
            self._drv.memcpy_htod_async(sb.dev.data_ptr(), sb.pin.data_ptr(), 16 * n, stream)
            return sb.dev
        if own:
            assert sb.order is not None
            sb.order.record(torch.cuda.current_stream(self.device))
            stream.wait_event(sb.order)
        # the whole buffer (at most twice the ids): no slices, two torch calls fewer; when
        # the copy runs on the caller's stream it is the current one (no check, no switch)
        with _on(stream, self.device) if own else contextlib.nullcontext():
            sb.dev.copy_(sb.pin, non_blocking=True)
        if stream not in sb.streams:
            sb.dev.record_stream(stream)  # freed (retired) only after this stream's work
            sb.streams.append(stream)
        return sb.dev

    def _tables(self, m: _Mapping, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination base-address tables of layers ``[lo, hi)`` (device)."""
        t = m.tables.get((lo, hi))
        if t is None:
            if lo == 0 and hi == self.layout.num_layers:
                t = (m.src_table, self.port.caches.ptr_table(range(lo, hi)))
            else:
                src = [x.data_ptr() for x in m.src_layers[lo:hi]]
                dst = [x.data_ptr() for x in self.port.caches.tensors[lo:hi]]
                # from pinned memory, not blocking: a copy from pageable memory first
                # waits for the stream's queued work -- a producer's forward, when a
                # layer-wise push makes its first layer's table
                both = _to_device(torch.tensor([src, dst], dtype=torch.int64), self.device)
                t = (both[0].clone(), both[1].clone())  # two allocations, both aligned
            m.tables[(lo, hi)] = t
        return t

    def _raw_args(
        self,
        m: _Mapping,
        ids: torch.Tensor,
        ab: torch.Tensor,
        slot: int,
        n: int,
        lo: int,
        hi: int,
    ) -> tuple[int, tuple[int, ...]]:
        """``(programs, arguments)`` of the raw launch copying layers ``[lo, hi)`` of
        ``n`` block pairs whose ids are in ``ids``, abort word ``ab[slot]``."""
        st, dt = self._tables(m, lo, hi)
        return _kernel.pair_copy_args(
            st.data_ptr(),
            dt.data_ptr(),
            ids.data_ptr(),
            ab.data_ptr(),
            self.device,
            slot,
            **self._mapper.geometry(m, n_pairs=n, n_layers=hi - lo, parts=self.layout.kv_parts),
        )

    def _launch(
        self,
        m: _Mapping,
        stream: Any,
        ready: Any,
        ids: torch.Tensor,
        ab: torch.Tensor,
        slot: int,
        triton: bool,
        lo: int,
        hi: int,
        sb: _SlotBufs,
        n: int,
        current: bool = False,
        raw: bool = False,
    ) -> None:
        """Enqueue the copy of layers ``[lo, hi)`` on ``stream`` (after the producer's
        event ``ready`` on the GPU, if given) and re-record the slot's completion event
        after it. ``current``: ``stream`` is known to be the current stream (taken with
        no await since), so no check (a CUDA call) is needed."""
        dev = self.device
        lay = self.layout
        whole = lo == 0 and hi == lay.num_layers
        if raw:  # ``stream`` is a raw handle; m.raw verified at mapping time
            assert m.raw is not None and self._drv is not None and sb.done is not None
            programs, args = self._raw_args(m, ids, ab, slot, n, lo, hi)
            if programs > _kernel.MAX_PROGRAMS:
                raise ConfigError("IPC: request too large for one launch")
            if programs:
                m.raw.launch(programs, stream, args)
            self._drv.event_record(sb.done.cuda_event, stream)
            return
        if dev.type != "cuda":
            dst = self.port.caches.raw(m.word)
            src = m.src_layers if whole else m.src_layers[lo:hi]
            _kernel.torch_pair_copy(
                src, dst if whole else dst[lo:hi], lay.block_dim, ids[0], ids[1]
            )
            return
        with contextlib.nullcontext() if current else _on(stream, dev):
            if ready is not None:
                stream.wait_event(ready)  # the producer's KV is written (GPU-side wait)
            if triton:
                st, dt = self._tables(m, lo, hi)
                ok = _kernel.launch_pair_copy(
                    st,
                    dt,
                    ids,
                    ab,
                    slot,
                    **self._mapper.geometry(m, n_pairs=n, n_layers=hi - lo, parts=lay.kv_parts),
                )
                if not ok:
                    raise ConfigError("IPC: request too large for one launch")
            else:
                dst = self.port.caches.raw(m.word)
                _kernel.torch_pair_copy(
                    m.src_layers[lo:hi], dst[lo:hi], lay.block_dim, ids[:n], ids[n : 2 * n]
                )
            assert sb.done is not None
            sb.done.record(stream)

    async def _event_fired(self, ev: Any, until: float) -> bool:
        """True once CUDA event ``ev`` fired, False at ``until`` (``time.monotonic``).

        A wait of the loop's one waiter (:mod:`aiokv._runtime.waiter`): asked on every
        loop pass for the first ``_READY_SPIN_S`` -- a copy or the end of a forward
        within it is noticed a pass after it -- then every ``options.event_poll_s`` on
        the waiter's one timer (a timerfd: the loop's own sleeps end on whole
        milliseconds, which noticed an event 0.5 ms late on average). Nothing stays
        registered afterwards (a dead producer's event never fires); a wait still
        running when :meth:`aclose` ends fails with :class:`~aiokv.EngineClosedError`."""
        def fired() -> bool:
            if self._waits_ended:
                raise EngineClosedError("the IPC plane closed during the wait")
            return bool(ev.query())

        return await waiter_for().wait_until(
            fired, until, spin=_READY_SPIN_S, interval=self.options.event_poll_s
        )

    async def _wait_done(self, done: Any, timeout: float) -> None:
        """Wait for a request's copy to end (:meth:`_event_fired`); ``TimeoutError``
        after ``timeout``."""
        if not await self._event_fired(done, time.monotonic() + timeout):
            raise TimeoutError

    async def _wait_ready(
        self, ev: Any, until: float, what: str = "the producer's ready event did not fire"
    ) -> None:
        """Wait for the producer's event (its ready event; push mode: its copy's
        completion; :meth:`_event_fired`), or raise :class:`~aiokv.TransferTimeoutError`
        ("IPC: ``what`` in time") at ``until`` (``time.monotonic``)."""
        if not await self._event_fired(ev, until):
            raise TransferTimeoutError(f"IPC: {what} in time")

    async def _settle(self, m: _Mapping, done: Any) -> bool:
        """After an abort: wait (bounded by the grace period) until the launch is over.
        A launch still queued then is behind an event that does not fire (a dead
        producer) and will copy nothing when it runs; its stream is retired."""
        until = time.monotonic() + self.options.grace_s
        if await waiter_for().wait_until(done.query, until, interval=self.options.event_poll_s):
            return True
        self._stats.stuck_streams += 1
        m.broken = "stuck_stream"
        log.warning(
            "aiokv IPC plane: a copy from export %x is stuck behind its producer's event; "
            "that export is no longer used",
            m.token,
        )
        return False

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self, timeout: float = 5.0) -> None:
        """Stop: wait (bounded) for background messages and in-flight copies, then unmap."""
        self._closed = True
        end = time.monotonic() + timeout
        if self.port.pull is not None:
            with contextlib.suppress(AiokvError):
                self.port.pull.unpublish(HELLO)
        self._flush_releases()
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)
        # unmap only after the copies reading the mappings are over (a launch stuck
        # behind a dead producer's event holds its mapping in self._keep instead)
        await waiter_for().wait_until(
            lambda: not any(m.inflight for m in self._maps.values()), end, interval=0.01
        )
        if self._bell_entry is not None:
            waiter_for().discard(self._bell_entry)
            self._bell_entry = None
        for m in self._maps.values():
            self._bell_drop(m)
        for bell in self._bells.values():
            if bell is not None:
                bell.close()
        self._bells.clear()
        for pm in self._push_maps.values():  # (the consumers' grants rings we read)
            self._close_push(pm)
        self._push_maps.clear()
        self._maps.clear()
        self._waits_ended = True


class _Fired:
    """A completed event (the CPU path copies synchronously)."""

    def query(self) -> bool:
        return True
