"""The IPC plane's consumer (:class:`Consumer`, a part of
:class:`aiokv.kv.ipc.IpcPlane`): ``prepare`` and ``recv_request``, the session check,
the descriptor's checks against the request, the choice of the path that carries it,
and the producers' exports it maps and verifies (and unmaps once their process is gone).

It owns the two parts a request's copy goes through: the inbox
(:mod:`aiokv.kv.ipc._inbox`: the descriptor, by the producer's doorbell ring or the
engine) and the copier (:mod:`aiokv.kv.ipc._copy`: staged and ordinary launches, abort
rules, the release). Push mode's grants are :mod:`aiokv.kv.ipc._grant`'s.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import torch

from aiokv._runtime.deadlines import _await_shielded, _time_left
from aiokv._runtime.threads import in_daemon

from ..._exceptions import (
    IpcUnavailableError,
    LayoutMismatchError,
    NotPublishedError,
    RemoteProtocolError,
)
from ..layouts import KVLayout, check_compatible
from . import _doorbell
from ._common import (
    HELLO,
    NO_OFFER,
    PREPARE_RID,
    _layer_id,
    _mark,
    _retrieve,
    check_same_host,
    log,
)
from ._copy import Copier
from ._inbox import Inbox
from ._mapping import _Mapping, _pid_alive
from ._state import PlaneState
from ._wire import LAYERS, PUSH, Descriptor, Offer, Release, decode_message

if TYPE_CHECKING:
    from ._parts import Grants

#: a mapping whose producer process is gone (it is unmapped; requests fall back)
PRODUCER_GONE = "producer_gone"
#: the export's mapping did not finish before the request's deadline
MAP_TIMEOUT = "map_timeout"


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


class Consumer:
    """The consumer's part of a plane: the exports being mapped and those that failed,
    the sessions to producers (where engines check layouts at set-up), ``prepare``'s
    attempts; it owns its :class:`Inbox` and :class:`Copier`. ``granter`` is the
    plane's half of push mode on this side."""

    def __init__(self, s: PlaneState, granter: Grants) -> None:
        self.s = s
        self.granter = granter
        self.copier = Copier(s, self, granter)
        self.inbox = Inbox(s, self.copier, granter)
        self._failed_tokens: dict[int, str] = {}
        self._opening: dict[int, asyncio.Future[_Mapping]] = {}  # exports being mapped
        self._preparing: dict[str, asyncio.Future[bool]] = {}  # producer -> prepare()
        # producers whose engine accepted this engine's session, and sessions being opened
        # (only where the engines check layouts at set-up: _session_check)
        cfg = getattr(s.port.engine, "config", None)
        connect = getattr(s.port.engine, "connect", None)
        self._connect: Callable[..., Awaitable[None]] | None = (
            connect if getattr(cfg, "layout", None) is not None else None
        )
        self._session_up: set[str] = set()
        self._session_opening: dict[str, asyncio.Future[None]] = {}

    def close(self) -> None:
        """Stop reading the producers' rings and forget the mappings (the plane closes,
        after the copies reading them are over)."""
        self.inbox.close()
        for m in self.s.maps.values():
            self.inbox.drop(m)
        self.s.maps.clear()

    async def prepare(self, frm: str, timeout: float | None) -> bool:
        """Map and verify the export of the producer at ``frm`` ahead of its first
        request (which then waits for no mapping): GET the producer's :data:`HELLO`,
        which makes it send an offer-only request, and receive that. True when the
        export is mapped here; False when it cannot be (the plane is off on either
        side, or the request fell back: counted and logged as usual). Concurrent calls
        for one producer share one attempt."""
        if self.s.disabled or self.s.port.pull is None:
            return False
        if any(m.reply_to == frm and not m.broken for m in self.s.maps.values()):
            return True
        fut = self._preparing.get(frm)
        if fut is None:
            fut = asyncio.ensure_future(self._prepare(frm, timeout))
            self._preparing[frm] = fut
            fut.add_done_callback(lambda f: self._preparing.pop(frm, None))
        return await asyncio.shield(fut)

    async def _prepare(self, frm: str, timeout: float | None) -> bool:
        assert self.s.port.pull is not None
        deadline = self.s.port.deadline(timeout)
        try:
            await self.s.port.pull.get(HELLO, frm=frm, timeout=_time_left(deadline))
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
            left = self.s.port.deadline(timeout) - time.monotonic()
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

    async def _recv_request(
        self,
        request_id: str,
        block_ids: torch.Tensor | Sequence[int],
        *,
        frm: str | None,
        timeout: float | None,
        layerwise: bool,
    ) -> str:
        deadline, host = self.s.begin(request_id, block_ids, timeout, unique=True, what="recv")
        n = len(host)
        rung = False
        if self.s.options.push and n:
            pm = self.granter.source(frm)
            if pm is not None:  # push mode: grant the blocks, wait for the producer's copy
                return await self.granter.recv_granted(
                    request_id, host, frm, deadline, pm, layerwise=layerwise
                )
        if not layerwise and any(m.bell is not None for m in self.s.maps.values()):
            staged = self.copier.stage(request_id, host, frm, deadline)
            if staged is None:
                _mark(request_id, "unstaged")
            try:
                desc, plout, rung = await self.inbox.recv_desc(request_id, frm, deadline, staged)
            except BaseException as exc:
                if staged is not None and staged.desc is not None:
                    # the ring's poll took (and maybe launched) the copy, then this task
                    # was cancelled (or failed) before it resumed
                    await self.copier.pull_staged(staged, deadline, False, exc)
                self.copier.unstage(staged)
                raise
            if staged is not None and staged.desc is not None:
                await self.copier.pull_staged(staged, deadline, rung, None)
                return "ipc"
            self.copier.unstage(staged)
        else:
            raw = await self.s.channel.recv(
                f"{request_id}#ipc", frm=frm, timeout=_time_left(deadline)
            )
            _mark(request_id, "desc")
            desc, plout = Descriptor.from_wire(decode_message(raw))
        return await self.after_desc(
            request_id, host, desc, plout, frm, deadline, layerwise=layerwise, rung=rung
        )

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
    ) -> str:
        """A request's descriptor is here (not staged): check it against the request and
        copy by the plane it names, or take the ordinary path."""
        n = len(host)
        _mark(request_id, "decoded")
        if desc.rid != request_id:
            raise RemoteProtocolError(f"IPC descriptor for {desc.rid!r:.64} under {request_id!r}")
        L = self.s.layout.num_layers

        def drop_layers() -> None:
            if desc.plane == LAYERS:  # the layer messages the producer sends regardless
                self.s.port.drop(
                    request_id, [_layer_id(request_id, i) for i in range(L)], frm, deadline
                )

        if desc.n != n:
            if desc.plane != "chunks":
                self.s.release(desc, Release(request_id, False, reason="block count mismatch"))
                drop_layers()
            raise LayoutMismatchError(
                f"IPC: the producer sends {desc.n} blocks of {request_id!r}, "
                f"{n} were allocated here",
                code="kv_size_mismatch",
            )
        # (a push says nothing of how the producer saved it: all layers are in place)
        if desc.plane not in ("chunks", PUSH) and (desc.plane == LAYERS) != layerwise:
            self.s.release(desc, Release(request_id, False, reason="mode mismatch"))
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
            await self.s.recv_plain(request_id, host, frm, deadline, layerwise)
            return "engine"
        if desc.plane == PUSH:
            # a push this request did not grant: a stale grant of an earlier request of
            # the same id (its abort word was set: it copied nothing), or a faulty peer
            return await self.granter.refuse_push(
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
            self.s.count_fallback(exc.reason, desc.reply_to, str(exc))
            self.s.release(desc, Release(request_id, False, fallback=True, reason=exc.reason))
            drop_layers()
            await self.s.recv_plain(request_id, host, frm, deadline, layerwise)
            return "engine"
        except LayoutMismatchError:
            self.s.release(desc, Release(request_id, False, reason="layout mismatch"))
            drop_layers()
            raise
        _mark(request_id, "mapped")
        m.can_push = desc.can_push
        if n == 0:  # an offer alone (prepare): mapped and verified, nothing to copy
            self.s.release(desc, Release(request_id, True, push=self.granter.offer_push(m)))
            return "ipc"
        await self.copier.pull(m, desc, host, deadline, frm, rung=rung)
        return "ipc"

    async def _mapping(
        self, desc: Descriptor, layout: KVLayout | None, deadline: float
    ) -> _Mapping:
        """The verified mapping for the descriptor's export (made on first use, its CUDA
        IPC opens off the event loop; requests of an export being mapped wait for that
        one mapping, until their ``deadline``: then ``map_timeout``, and the mapping
        goes on for later requests)."""
        m = self.s.maps.get(desc.token)
        if m is not None:
            if m.broken:
                raise IpcUnavailableError(m.broken)
            return m
        why = self._failed_tokens.get(desc.token)
        if why:
            raise IpcUnavailableError(why)
        if self.s.disabled:
            raise IpcUnavailableError(self.s.disabled)
        opening = self._opening.get(desc.token)
        if opening is None:
            if desc.offer is None or layout is None:
                raise IpcUnavailableError(NO_OFFER, "the producer's export is unknown here")
            check_compatible(layout, self.s.layout)  # LayoutMismatchError: a real error
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
        """Map one export and verify it, on a daemon thread (:meth:`Mapper.map_verified`):
        CUDA IPC opens take milliseconds per allocation, and the verification compiles
        and loads the kernel -- seconds in a fresh process (the event loop
        stalls 1.1-2.4 s when the verification runs on it) -- then register it."""
        token = desc.token
        try:
            try:
                check_same_host(offer, my_boot_id=self.s.boot_id, now=self.s.clock())
                # what the thread shares with the loop exists before it starts: the
                # control stream, the abort copies' pinned sources and the probe copies'
                # abort slots (their words zeroed; the first block made off the loop too)
                await self.s.cuda_ready()
                slots = (
                    [self.s.words.slot() for _ in range(4)] if self.s.mapper.use_triton() else []
                )
                m = await in_daemon(
                    functools.partial(self.s.mapper.map_verified, offer, layout, slots),
                    "aiokv-ipc-map",
                )
                self.s.words.free += slots[0::2]  # (their copies finished, nothing set)
            except IpcUnavailableError as exc:
                self.s.stats.mapping_failures += 1
                self._failed_tokens[token] = exc.reason
                raise
            except Exception as exc:  # CUDA refused: other container, PID namespace...
                self.s.stats.mapping_failures += 1
                self._failed_tokens[token] = "map_failed"
                raise IpcUnavailableError("map_failed", f"{type(exc).__name__}: {exc}") from None
        finally:
            del self._opening[token]
        m.reply_to = desc.reply_to
        if self.s.closed:  # closed while mapping: nothing may keep the export mapped
            raise IpcUnavailableError("closed", "the plane was closed while mapping")
        if offer.bell and self.s.options.doorbell:
            try:
                m.bell = _doorbell.BellReader(offer.bell, offer.bell_key)
            except (OSError, ValueError) as exc:  # the engine path serves alone
                log.info("aiokv IPC plane: doorbell %s not used: %s", offer.bell, exc)
            else:
                if m.bell.wake_fd >= 0:
                    asyncio.get_running_loop().add_reader(m.bell.wake_fd, self.inbox.woken, m)
        self.s.maps[token] = m
        self.s.stats.mappings_verified += 1
        self._sweep_mappings()
        return m

    def _sweep_mappings(self) -> None:
        """Drop the mappings of producers whose process is gone (a restarted prefill
        offers a new export): a mapping keeps the producer's whole cache allocation
        alive on its GPU, where the restarted producer needs that memory again. One with
        copies in flight is dropped when its last one ends (:meth:`copy_ended`)."""
        for m in list(self.s.maps.values()):
            if m.pid and not _pid_alive(m.pid):
                m.broken = PRODUCER_GONE
                if m.inflight == 0:
                    self._drop_mapping(m)

    def _drop_mapping(self, m: _Mapping) -> None:
        if self.s.maps.get(m.token) is m:
            del self.s.maps[m.token]
            self.inbox.drop(m)
            self.s.stats.mappings_dropped += 1
            log.info("aiokv IPC plane: export %x unmapped (its producer is gone)", m.token)

    def copy_ended(self, m: _Mapping) -> None:
        m.inflight -= 1
        if m.inflight == 0 and m.broken == PRODUCER_GONE:
            self._drop_mapping(m)

    def stages_for(self, frm: str) -> bool:
        """Whether a ``recv_request`` from ``frm`` would be staged (pull mode starts
        it beside the ticket's GET then, so that the ring's poll can launch the copy
        as soon as the producer sends)."""
        return self.copier.staging_mapping(frm) is not None
