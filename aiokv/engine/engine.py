"""The engine: lifecycle, the public API, its client sessions and the receive store.

An :class:`Engine` has two peer sides. Its server side (:mod:`aiokv.engine.server`)
listens on a control ROUTER (``config.listen``) and a data ROUTER of its own port,
and receives: one server session per peer that sends to it. Its client side
(:mod:`aiokv.engine.client`) opens, lazily, one *client session* per peer it sends to:
a DEALER for control messages and a second DEALER for data, connected to the
peer's two ports. Data flows client -> server inside a session; a peer that
sends back uses its own client session. Every wait is an awaited future resolved
on the loop: by the engine's tasks (the socket readers, the housekeeping loop,
the connection monitors, a poster per client session) or by the loop's waiter
(:mod:`aiokv._runtime.waiter`: CUDA events, NCCL states). Calls that block run on the
threads of :mod:`aiokv._runtime.threads` (NCCL init and abort, zmq's ``term``); the loop
never waits for them.

Its GET mode (``publish``, ``get``) is a part it owns (:mod:`aiokv.engine.getmode`).
Its sessions, its server side, its GET mode and its handles hold it as the protocols
of :mod:`aiokv.engine.interfaces`, never as an :class:`Engine`.

The rules the design keeps (see docs/design.md):

* reserve before launch: nothing is put on the wire before the receiver's
  GRANT, and the receiver grants only what fits in its byte budget, so a
  sender waits for credit rather than the receiver dropping data;
* one order per peer: data is posted in the receiver's grant order;
* cancellation is honest: before its grant a transfer is withdrawn on both
  sides; after it the transfer is committed and finishes in the background
  while the caller gets its CancelledError at once;
* every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import zmq
import zmq.asyncio

from aiokv._config import EngineConfig, advertised_address, parse_address
from aiokv._exceptions import (
    AiokvError,
    AiokvTimeoutError,
    ConfigError,
    ConnectError,
    ConnectTimeoutError,
    EngineClosedError,
    NegotiateTimeoutError,
    PeerLostError,
    TransferTimeoutError,
    UsageError,
)
from aiokv._runtime import threads as _blocking
from aiokv._runtime.deadlines import (
    _await_shielded,
    _Deadline,
    _retrieve,
)
from aiokv._runtime.zmqerr import listen_error
from aiokv.engine.client import _ClientSession
from aiokv.engine.getmode import _GetMode
from aiokv.engine.handle import TransferHandle, _XferWatch
from aiokv.engine.outgoing import _OutXfer
from aiokv.engine.server import _Server
from aiokv.engine.staging import _STRIDED, _prepare, _Staged
from aiokv.engine.statistics import EngineStatistics
from aiokv.engine.store import ReceiveStore
from aiokv.gpu.cuda import _resolve
from aiokv.protocol.codec import Codec, WireLimits
from aiokv.protocol.messages import (
    TensorSpec,
)
from aiokv.transport.tcp import as_tensor, dtype_name

if TYPE_CHECKING:
    from aiokv._runtime.watchdog import LoopWatchdog
    from aiokv.gpu.cuda import ProgressPoller

__all__ = ["Engine", "EngineStatistics", "TransferHandle"]

log = logging.getLogger("aiokv")


def _watchdog_report(why: str) -> None:
    """The loop watchdog's report (on its thread): the engine's log, at ERROR."""
    log.error("aiokv: %s", why)


# --------------------------------------------------------------------------- engine


class Engine:
    """Moves tensors between processes. Use as ``async with Engine(config) as eng``."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.engine_id = secrets.token_hex(12)
        lim = config.limits
        self._max_id = lim.max_id_length  # (the hot path's check, one attribute away)
        self._codec = Codec(
            WireLimits(
                max_frame_bytes=lim.max_frame_bytes,
                max_tensors=lim.max_tensors_per_transfer,
                max_ndim=lim.max_ndim,
                max_tensor_bytes=lim.max_tensor_bytes,
                max_id_length=lim.max_id_length,
            )
        )
        self._store = ReceiveStore(
            capacity=lim.store_bytes,
            ttl=lim.ttl,
            resolve_peer=self._resolve_peer,
            max_tensors=lim.store_tensors,
        )
        self._ctx: zmq.asyncio.Context = None  # type: ignore[assignment]
        self._sctx: zmq.Context[Any] = None  # type: ignore[assignment]
        self._address = ""
        self._clients: dict[str, _ClientSession] = {}
        self._connecting: dict[str, asyncio.Future[_ClientSession]] = {}
        self._stats = EngineStatistics()
        # GET mode: the published tensors, the GETs in flight
        self._get_mode = _GetMode(self)
        # the receiving half: sockets, peers' sessions, admission, credit, landing
        self._server = _Server(self, config, self._codec, self._store, self._stats)
        # the two the public API calls on every collected tensor: bound once
        self._collected = self._server.granting.collected
        self._pump_queue = self._server.granting.pump_queue
        self._tasks: set[asyncio.Task[Any]] = set()
        self._main_tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop  # bound by start()
        self._nccl_ok = False
        self._nccl_why = "not started"
        self._poller: ProgressPoller | None = None
        self._watchdog: LoopWatchdog | None = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._closed:
            raise EngineClosedError("engine closed: an Engine cannot be started again")
        if self._started:
            self._check_loop()
            return
        # the loop, once: asyncio.get_running_loop() makes a getpid() system call per
        # call on Python < 3.12, several times per transfer on the hot path
        self._loop = asyncio.get_running_loop()
        self._store.loop = self._loop
        self._granted_now: asyncio.Future[int] = self._loop.create_future()
        self._granted_now.set_result(0)
        dev = self.config.device
        if dev.startswith("cuda"):
            idx = torch.device(dev).index or 0
            if not torch.cuda.is_available() or idx >= torch.cuda.device_count():
                raise ConfigError(
                    f"device={dev!r} but this process has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} "
                    "usable CUDA device(s)"
                )
        self._started = True
        if self.config.gc_freeze:
            gc.freeze()
        if self.config.transport != "tcp":
            from aiokv.transport.nccl import nccl_available

            self._nccl_ok, self._nccl_why = nccl_available(self.config.device)
            if self.config.transport == "nccl" and not self._nccl_ok:
                self._started = False
                raise ConfigError(f"transport='nccl' but NCCL cannot be used: {self._nccl_why}")
            if self._nccl_ok:
                from aiokv.gpu.cuda import preload_copy_kernels
                from aiokv.gpu.nccl.library import mapped_dtypes

                # before any communicator: a first launch later could wait on NCCL kernels
                preload_copy_kernels(torch.device(self.config.device), mapped_dtypes())
        self._ctx = zmq.asyncio.Context()
        # the hot sockets are plain ones on the same zmq context, run by LoopSocket
        self._sctx = zmq.Context.shadow(self._ctx.underlying)
        try:
            bound = self._server.bind(self._loop, self._ctx, self._sctx)
        except zmq.ZMQError as exc:
            self._ctx.term()
            raise listen_error(exc, self.config.listen) from None
        # what peers are told (HELLO, WELCOME, a GET's reply_to): never a wildcard
        self._address = advertised_address(bound, self.config.listen, self.config.advertise)
        self._stats.address = self._address
        self._main_tasks = [
            asyncio.create_task(self._housekeeping(), name="aiokv-housekeeping"),
            *self._server.tasks(),
        ]

    @property
    def address(self) -> str:
        """``host:port`` peers reach this engine at (valid after start): the listen
        address, its host replaced by :attr:`EngineConfig.advertise` or, for a wildcard
        listen host, by :func:`~aiokv._config.default_advertise_host`."""
        return self._address

    async def aclose(self) -> None:
        """Close every session, fail every pending operation, release sockets (bounded time)."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._check_loop()
        self._closed = True
        exc = EngineClosedError("engine closed")
        for cs in list(self._clients.values()):
            await cs.bye()
        for f in self._connecting.values():
            if not f.done():
                f.set_exception(exc)
        self._server.close_sessions(exc)
        self._store.fail_all(exc)
        self._get_mode.fail_waiters(exc)
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._poller is not None:
            await self._poller.stop()
        for t in self._main_tasks:
            t.cancel()
        pending = [*self._main_tasks, *self._tasks]
        if pending:
            await asyncio.wait(pending, timeout=self.config.timeouts.linger + 1.0)
        self._server.close_sockets()
        ctx = self._ctx
        # term() waits for lingering sockets (forever if one never flushes): never on
        # the loop, and on a daemon thread of its own (aiokv._runtime.threads says why)
        await asyncio.wait_for(
            _blocking.in_daemon(ctx.term, "aiokv-zmq-term"),
            timeout=self.config.timeouts.linger + 1.0,
        )

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        t: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        t.add_done_callback(_retrieve)
        return t

    def _check_id(self, tensor_id: str) -> None:
        """A tensor id the peer would accept: checked here, never sent to be refused."""
        n = self.config.limits.max_id_length
        if not isinstance(tensor_id, str) or not tensor_id or len(tensor_id) > n:
            raise ConfigError(f"tensor ids are non-empty strings of at most {n} characters")

    def _timeout(self, timeout: float | None) -> float:
        """The caller's timeout (None: the configured transfer deadline), checked."""
        if timeout is None:
            return self.config.timeouts.transfer
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < float("inf")
        ):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    def _check_loop(self) -> None:
        """Raise :class:`UsageError` unless called on the loop that started the engine.

        Its futures, sockets and tasks belong to that loop: a call from another loop (or
        from a thread with none) would tie them to the wrong one, so it is refused before
        anything is touched."""
        if self._started and asyncio._get_running_loop() is not self._loop:
            raise UsageError(
                "this Engine runs on the event loop that started it; it was called from "
                "another loop or thread (one engine per loop: hand work to its loop with "
                "asyncio.run_coroutine_threadsafe)"
            )

    def _check_open(self) -> None:
        self._check_loop()
        if not self._started:
            raise EngineClosedError(
                "engine not started: use 'async with Engine(...)' or await start()"
            )
        if self._closed:
            raise EngineClosedError("engine closed")

    def _capabilities(self) -> tuple[str, ...]:
        return ("tcp", "nccl", "credit") if self._nccl_ok else ("tcp", "credit")

    def _get_poller(self) -> ProgressPoller:
        if self._poller is None:
            from aiokv.gpu.cuda import ProgressPoller

            # Spin (yielding) for 20 ms after any activity: a completion past the spin
            # waits for the waiter's next tick and a wake-up from epoll (benchmarks.md).
            # The poller registers with the loop's one waiter, which the IPC plane's
            # waits share: one timer and one spin callback for the loop, not one each.
            self._poller = ProgressPoller(spin_s=0.02)
            from aiokv._runtime.watchdog import LoopWatchdog

            poller = self._poller
            self._watchdog = LoopWatchdog(
                asyncio.get_running_loop(),
                limit=self.config.timeouts.nccl_watchdog,
                pending=lambda: poller.pending,
                report=_watchdog_report,
            )
        return self._poller

    def _apply_curve_client(self, sock: zmq.Socket[Any], address: str) -> None:
        cc = self.config.curve
        if cc is None:
            return
        server_key = cc.server_keys.get(address, cc.default_server_key)
        if server_key is None:
            raise ConfigError(f"CURVE is on but no server key is configured for {address}")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, cc.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, cc.secret_key)

    # ------------------------------------------------------------------ public API
    async def connect(
        self, peer: str, *, timeout: float | None = None, nccl: bool | None = None
    ) -> None:
        """Open the session to ``peer`` now rather than at the first send (no cold start).

        ``nccl``: also create the pair's NCCL communicator now (default: when this
        engine can use NCCL and the peer offers it), so the first CUDA transfer does
        not pay for communicator set-up.
        """
        self._check_open()
        dl = _Deadline(
            self._timeout(timeout) if timeout is not None else self.config.timeouts.connect
        )
        cs = await self._client(peer, dl)
        can = self._nccl_ok and self.config.transport != "tcp" and "nccl" in cs.peer_caps
        if nccl and not can:
            raise ConfigError(f"NCCL to {peer} is not available ({self._nccl_why})")
        if can and nccl is not False:
            await cs.nccl_plane.ensure_nccl(dl.left(self.config.timeouts.connect))

    async def send(
        self, tensor_id: str, tensor: torch.Tensor, *, to: str, timeout: float | None = None
    ) -> None:
        """PUT: return once the peer's engine holds ``tensor`` under ``tensor_id``."""
        self._check_loop()
        t = self._timeout(timeout)
        staged = self._stage_one(tensor_id, tensor)
        cs = self._hot_session(to, staged)
        if cs is not None:
            await self._await_xfer(cs, cs.start(staged.specs, staged.tensors, lean=True), t, to)
            return
        await self._transfer(to, staged, timeout)

    async def _await_xfer(self, cs: _ClientSession, x: _OutXfer, t: float, to: str) -> None:
        """``send``'s wait on a started transfer: its own ``done`` future, watched as a
        PUT_ASYNC handle's is (deadline, cancel, failure count), with no handle around it.
        The watch settles here, when this task resumes (no callback a loop pass ahead)."""
        w = _XferWatch(self, cs, x, t, to, callback=False)
        try:
            await x.done
        finally:
            w.settled(x.done)

    def send_nowait(
        self, tensor_id: str, tensor: torch.Tensor, *, to: str, timeout: float | None = None
    ) -> TransferHandle:
        """PUT_ASYNC: start the transfer, return a handle to await (or cancel) later."""
        self._check_loop()
        t = self._timeout(timeout)
        staged = self._stage_one(tensor_id, tensor)
        cs = self._hot_session(to, staged)
        if cs is not None:  # no task: a timer holds the deadline
            return self._handle(cs, cs.start(staged.specs, staged.tensors, watched=True), t, to)
        released: asyncio.Future[None] = self._loop.create_future()
        task = asyncio.create_task(self._transfer(to, staged, timeout, released))
        return TransferHandle(task, released)

    def _hot_session(self, to: str, staged: _Staged) -> _ClientSession | None:
        """The live session a transfer of CPU tensors can start on at once (the hot path:
        no connecting, no NCCL set-up, no copy to host), else None."""
        cs = self._clients.get(to)
        if cs is None or cs.dead is not None or staged.cuda or staged.strided:
            return None
        return cs

    def _handle(self, cs: _ClientSession, x: _OutXfer, t: float, to: str) -> TransferHandle:
        """A PUT_ASYNC handle on a started transfer: its own ``done`` future, a watch
        with one timer, no task."""
        w = _XferWatch(self, cs, x, t, to)
        assert x.released is not None
        return TransferHandle(x.done, x.released, w.on_cancel, retrieve=False, on_wait=w.wanted)

    async def send_many(
        self, tensors: Mapping[str, torch.Tensor], *, to: str, timeout: float | None = None
    ) -> None:
        """PUT many tensors under one negotiation; return once the peer holds all."""
        await self._transfer(to, self._stage(list(tensors.items())), timeout)

    async def recv(
        self, tensor_id: str, *, frm: str | None = None, timeout: float | None = None
    ) -> torch.Tensor:
        """Collect a tensor from the receive store, waiting for it up to ``timeout``."""
        self._check_id(tensor_id)
        return await self._recv(tensor_id, frm, self._timeout(timeout))

    async def _recv(self, tensor_id: str, frm: str | None, t: float) -> torch.Tensor:
        self._check_open()
        landed = self._take_landed(tensor_id, frm)
        if landed is not None:  # landed already (a collector behind its stream): no future
            return landed
        fut = self._store.wait_future(tensor_id, frm, looked=True)
        try:
            # Not ``wait_for(shield(fut))``: on Python <= 3.11 it returns the result
            # when the cancel and the landing meet in one loop pass, swallowing the
            # cancellation (and a cancelled KV request would then scatter its data).
            await _await_shielded(fut, t)
        except TimeoutError:
            raise TransferTimeoutError(
                f"tensor {tensor_id!r} did not arrive within {t:.3g}s"
            ) from None
        except asyncio.CancelledError:
            # Never lose a tensor to a cancelled collector: if it was handed over, put it back.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                peer, value = fut.result()
                value = as_tensor(value)
                self._store.put_back(tensor_id, peer, value, value.numel() * value.element_size())
            raise
        finally:
            if not fut.done():
                fut.cancel()
            self._store.forget_waiter(tensor_id, fut)
        peer, result = fut.result()
        self._collected(peer, tensor_id)
        self._pump_queue()
        return as_tensor(result)  # type: ignore[no-any-return]

    def recv_nowait(self, tensor_id: str, *, frm: str | None = None) -> torch.Tensor | None:
        """Collect a tensor that has landed in the receive store already, or None (no
        waiting, nothing registered; a tensor still in flight stays where it is)."""
        self._check_id(tensor_id)
        self._check_open()
        return self._take_landed(tensor_id, frm)

    def _take_landed(self, tensor_id: str, frm: str | None) -> torch.Tensor | None:
        """Collect ``tensor_id`` from the store if it has landed (counted, the admission
        queue pumped), else None."""
        got = self._store.take(tensor_id, frm)
        if got is None:
            return None
        self._collected(got[0], tensor_id)
        self._pump_queue()
        return as_tensor(got[1])  # type: ignore[no-any-return]

    async def recv_many(
        self, tensor_ids: Sequence[str], *, frm: str | None = None, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Collect several tensors under one deadline."""
        self._check_open()
        for tid in tensor_ids:
            self._check_id(tid)
        dl = _Deadline(self._timeout(timeout))
        out: dict[str, torch.Tensor] = {}
        for tid in tensor_ids:
            out[tid] = await self._recv(tid, frm, dl.left())
        return out

    def discard(self, tensor_id_or_prefix: str) -> int:
        """Drop received tensors nobody will collect (an id, or every id starting with a
        prefix that ends in ``"#"``); in-flight ones go when they land. Returns the count."""
        self._check_open()
        n = self._store.discard(tensor_id_or_prefix)
        self._pump_queue()  # the freed room may admit queued reservations
        return n

    def statistics(self) -> EngineStatistics:
        s = dataclasses.replace(self._stats, protocol_errors=dict(self._stats.protocol_errors))
        s.store = self._store.statistics()
        server_comms = self._server.statistics(s)
        s.waiting_for_credit = sum(
            1 for cs in self._clients.values() for x in cs.credit_wait if not x.abandoned
        )
        s.client_sessions = len(self._clients)
        planes = [cs.nccl_plane for cs in self._clients.values()]
        comms = [p.nccl.comm for p in planes if p.nccl is not None]
        comms += server_comms
        if comms or self._poller is not None:
            n: dict[str, float] = {
                "communicators": len(comms),
                "settles": sum(c.settles for c in comms),
                "settle_s": sum(c.settle_s for c in comms),
                "settle_max_s": max((c.settle_max_s for c in comms), default=0.0),
            }
            if self._poller is not None:
                for k, v in dataclasses.asdict(self._poller.statistics()).items():
                    if isinstance(v, int):
                        n[f"poller_{k}"] = v
            if self._watchdog is not None:
                n["watchdog_fired"] = self._watchdog.fired
            s.nccl = n
        return s

    # ------------------------------------------------------------------ GET mode
    def publish(
        self,
        tensor_id: str,
        tensor: torch.Tensor,
        *,
        once: bool = False,
        on_get: Callable[[str], None] | None = None,
    ) -> None:
        """GET mode, producer side: make ``tensor`` available to peers' :meth:`get`.

        ``once``: serve it to the first GET only (a later one gets ``not_published``);
        :meth:`wait_fetched` then says which peer took it. ``on_get``: called on the
        loop with the address of each peer whose GET of it was accepted (as
        :meth:`wait_fetched` returns it), before the tensor is sent; an
        exception it raises is logged, never the GET's."""
        self._get_mode.publish(tensor_id, tensor, once=once, on_get=on_get)

    def unpublish(self, tensor_id: str) -> bool:
        """Stop serving ``tensor_id``; whether it was published (a :meth:`wait_fetched`
        on it raises :class:`~aiokv.NotPublishedError`)."""
        return self._get_mode.unpublish(tensor_id)

    async def wait_fetched(self, tensor_id: str, *, timeout: float | None = None) -> str:
        """GET mode, producer side: wait until a peer's :meth:`get` took a tensor
        published with ``once=True`` (its GET arrived and was accepted; the tensor may
        still be on its way); return the address this engine reaches that peer at (its
        open session to the peer, else the listen address the peer's authenticated
        session holds): :meth:`send_nowait` reaches it over the same session."""
        return await self._get_mode.wait_fetched(tensor_id, timeout=timeout)

    async def get(self, tensor_id: str, *, frm: str, timeout: float | None = None) -> torch.Tensor:
        """GET mode, consumer side: ask ``frm`` for a published tensor and wait for it.

        Concurrent gets of one id from one producer share one GET: the first asks, the
        others join it and all return the same tensor (each waits at most its own
        ``timeout``, and the shared GET runs under the first one's deadline)."""
        return await self._get_mode.get(tensor_id, frm=frm, timeout=timeout)

    def _is_published(self, tensor_id: str) -> bool:
        return self._get_mode.is_published(tensor_id)

    def _claim_published(
        self, tensor_ids: Sequence[str], address: str
    ) -> list[tuple[str, torch.Tensor]]:
        return self._get_mode.claim_published(tensor_ids, address)

    # ------------------------------------------------------------------ sending
    async def _client(self, address: str, dl: _Deadline) -> _ClientSession:
        cs = self._clients.get(address)
        if cs is not None and cs.dead is None:
            return cs
        fut = self._connecting.get(address)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_retrieve)
            self._connecting[address] = fut
            self._spawn(self._open_client(address, fut, dl.left(self.config.timeouts.connect)))
        try:
            return await _await_shielded(fut, dl.left())  # type: ignore[no-any-return]
        except TimeoutError:
            raise ConnectTimeoutError(f"could not connect to {address} in time") from None

    async def _evict_lru(self) -> None:
        """Keep at most ``max_client_sessions``: close the least recently used idle ones."""
        limit = self.config.limits.max_client_sessions
        while len(self._clients) >= limit:
            idle = [c for c in self._clients.values() if not c.xfers and not c.gets]
            if not idle:
                return  # all busy: allow the overshoot rather than fail a live transfer
            lru = min(idle, key=lambda c: c.last_used)
            await lru.bye(ConnectError(f"session with {lru.address} closed to make room"))

    async def _open_client(
        self, address: str, fut: asyncio.Future[_ClientSession], timeout: float
    ) -> None:
        cs: _ClientSession | None = None
        try:
            parse_address(address)
            await self._evict_lru()
            cs = _ClientSession(self, address)
            await cs.open(timeout)
            self._clients[address] = cs
            self._stats.sessions_opened += 1
            if not fut.done():
                fut.set_result(cs)
        except BaseException as exc:
            if cs is not None:
                cs.fail(exc if isinstance(exc, AiokvError) else ConnectError(str(exc)))
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    fut.set_exception(EngineClosedError("engine closed while connecting"))
                else:
                    fut.set_exception(
                        exc if isinstance(exc, AiokvError) else ConnectError(f"{address}: {exc}")
                    )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._connecting.get(address) is fut:
                del self._connecting[address]

    def _stage_one(self, tensor_id: str, tensor: torch.Tensor) -> _Staged:
        """:meth:`_stage` of one tensor; the common case (a plain, dense, contiguous CPU
        tensor of a wire dtype) without the general path's list, set and checks."""
        if (
            type(tensor) is torch.Tensor
            and type(tensor_id) is str
            and 0 < len(tensor_id) <= self._max_id
            and tensor.is_cpu
            and not tensor.requires_grad
            and tensor.layout is _STRIDED
            and tensor.is_contiguous()
            and self._started
            and not self._closed
        ):
            name = dtype_name(tensor.dtype)
            if name is not None:
                return _Staged(
                    [TensorSpec(tensor_id, name, tuple(tensor.shape))], [tensor], None, False
                )
        return self._stage([(tensor_id, tensor)])

    def _stage(self, items: list[tuple[str, torch.Tensor]]) -> _Staged:
        """Check and prepare tensors at call time (captures the caller's CUDA stream)."""
        self._check_open()
        lim = self.config.limits
        specs, tensors = _prepare(items, lim.max_id_length, lim.max_tensors_per_transfer)
        if not any(t.is_cuda for t in tensors):
            strided = not all(t.is_contiguous() for t in tensors)
            return _Staged(specs, tensors, None, False, strided)
        cuda = [t.is_cuda for t in tensors]
        ready = None
        if any(cuda):
            if not all(cuda):
                raise ConfigError("one transfer cannot mix CPU and CUDA tensors")
            from aiokv.transport.nccl import capture_ready

            devs = {t.device for t in tensors}
            if len(devs) != 1:
                raise ConfigError("all CUDA tensors of one transfer must be on one device")
            ready = capture_ready(tensors)
        return _Staged(specs, tensors, ready, any(cuda))

    async def _to_host(self, st: _Staged) -> list[torch.Tensor]:
        """TCP fallback for CUDA tensors: copy into pinned host memory without blocking the loop."""
        from aiokv.gpu.cuda import record_event

        dev = st.tensors[0].device
        stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        stream.wait_event(st.ready)
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in st.tensors]
        with torch.cuda.stream(stream):
            for h, t in zip(hosts, st.tensors):
                h.copy_(t, non_blocking=True)
        ev = record_event(stream)
        await self._get_poller().wait(ev, keepalive=(st.tensors, hosts))
        return hosts

    async def _transfer(
        self,
        to: str,
        st: _Staged,
        timeout: float | None,
        released: asyncio.Future[None] | None = None,
    ) -> None:
        linked: list[bool] = []
        try:
            await self._transfer_inner(to, st, timeout, released, linked)
        finally:
            if released is not None and not linked and not released.done():
                released.set_result(None)  # nothing was handed to the data plane

    async def _transfer_inner(
        self,
        to: str,
        st: _Staged,
        timeout: float | None,
        released: asyncio.Future[None] | None,
        linked: list[bool],
    ) -> None:
        self._check_open()
        T = self.config.timeouts
        dl = _Deadline(self._timeout(timeout))
        cs = await self._client(to, dl)
        transport = "tcp"
        tensors = st.tensors
        if st.cuda:
            use_nccl = self._nccl_ok and "nccl" in cs.peer_caps and self.config.transport != "tcp"
            if use_nccl:
                if st.tensors[0].device != torch.device(self.config.device):
                    raise ConfigError(
                        f"tensors are on {st.tensors[0].device}, the engine's NCCL device is {self.config.device}"
                    )
                await cs.nccl_plane.ensure_nccl(dl.left(T.connect))
                transport = "nccl"
            elif self.config.transport == "nccl":
                raise ConfigError(f"transport='nccl' but {to} cannot receive over NCCL")
            else:
                tensors = await self._to_host(st)
        x = cs.start(st.specs, tensors, transport, st.ready, strided=st.strided)
        if released is not None and x.released is not None:
            linked.append(True)
            x.released.add_done_callback(lambda _f: _resolve(released))
        try:
            try:
                await _await_shielded(x.granted, dl.left(T.negotiate))
            except TimeoutError:
                raise NegotiateTimeoutError(f"{to} granted no room within the deadline") from None
            try:
                await _await_shielded(x.done, dl.left())
            except TimeoutError:
                raise TransferTimeoutError(
                    f"transfer to {to} did not complete within the deadline"
                ) from None
        except BaseException as exc:
            cs.abandon(x, deadline=isinstance(exc, AiokvTimeoutError))
            self._stats.transfers_failed += 1
            raise

    def _session_address(self, engine_id: str) -> str | None:
        """The address of a live session this engine opened to the engine that announced
        ``engine_id`` (whatever alias of its address that session was opened with)."""
        for address, cs in self._clients.items():
            w = cs.welcome
            if (
                cs.dead is None
                and w.done()
                and not w.cancelled()
                and w.exception() is None
                and w.result().engine_id == engine_id
            ):
                return address
        return None

    # ------------------------------------------------------------------ receiving
    def _resolve_peer(self, addr: str) -> str | None:
        cs = self._clients.get(addr)
        if cs is not None and cs.peer_id:
            return cs.peer_id
        return self._server.resolve_peer(addr)

    def _forget_client(self, address: str, session: object) -> None:
        """The client session ``session`` to ``address`` ended: it leaves the table
        (unless another one took its place there meanwhile)."""
        if self._clients.get(address) is session:
            del self._clients[address]

    def _count_error(self, code: str) -> None:
        pe = self._stats.protocol_errors
        pe[code] = pe.get(code, 0) + 1

    # ------------------------------------------------------------------ upkeep
    async def _housekeeping(self) -> None:
        T = self.config.timeouts
        tick = min(T.heartbeat_interval / 2, 0.25)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            idle = self.config.limits.idle_session
            for cs in list(self._clients.values()):
                if not cs.xfers and not cs.gets and now - cs.last_used > idle:
                    # idle eviction: frees the session and its communicator
                    await cs.bye(ConnectError(f"session with {cs.address} closed after being idle"))
                elif now - cs.last_recv > T.heartbeat_timeout:
                    # Judge on the second look: after a stall of this loop the peer's answers
                    # may be waiting unread, and the readers run before the next tick.
                    if cs.suspect:
                        cs.fail(
                            PeerLostError(
                                f"no heartbeat from {cs.address} for {now - cs.last_recv:.2f}s"
                            )
                        )
                    cs.suspect = True
                else:
                    cs.suspect = False
                    if now - cs.last_ping >= T.heartbeat_interval:
                        cs.ping(now)
            self._server.housekeep(now)
