"""An NCCL communicator driven from an asyncio event loop.

Nothing here blocks the loop: the communicator is created non-blocking
(``ncclConfig_t.blocking = 0``) and its state is polled with
``ncclCommGetAsyncError`` by the loop's waiter (:mod:`aiokv._runtime.waiter`).
``send``/``recv`` only enqueue work on a CUDA stream and return at once;
completion is found by recording a CUDA event after them (see
:class:`aiokv.gpu.cuda.ProgressPoller`). Blocking calls (a blocking init, the warm-up,
``ncclCommAbort``) run on daemon threads of :mod:`aiokv._runtime.threads`.

Non-blocking mode detail: an enqueue call (or ``ncclGroupEnd``) may return
``ncclInProgress`` — typically the first operation to a peer, while NCCL
connects to it in the background. Until :meth:`Communicator.wait_ready`
returns, the kernel is not on the stream yet, so record the completion event
only after that (and post no other call on this communicator meanwhile;
``send``/``recv`` refuse with ``ncclInvalidUsage``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import time
from collections.abc import Iterator
from typing import Any

import torch

from aiokv._exceptions import AiokvTimeoutError, ConfigError, NcclError, TransferAbortedError
from aiokv._runtime.threads import in_daemon, start_daemon
from aiokv._runtime.waiter import waiter_for
from aiokv.gpu.nccl.library import IN_PROGRESS, SUCCESS, NcclLibrary, load_library, result_name

__all__ = ["Communicator", "get_unique_id"]

# the waiter's back-off while NCCL works in its own threads (init, connect, finalize)
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.02
_ABORTED = 5  # ncclInvalidUsage: what async_error() reports for a dead communicator


def get_unique_id(lib: NcclLibrary | None = None) -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) for rank 0 to hand to its peers."""
    return (lib or load_library()).get_unique_id()


class Communicator:
    """One NCCL communicator (in aiokv: a pair of ranks) bound to one CUDA device.

    Create with :meth:`create`; close with :meth:`aclose` (or :meth:`abort`).
    Not thread-safe: use it from one event loop.
    """

    def __init__(
        self,
        lib: NcclLibrary,
        handle: int,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        timeout: float,
    ) -> None:
        self._lib = lib
        self._handle: int | None = handle
        self.rank = rank
        self.nranks = nranks
        self.device = device
        self.timeout = timeout
        self._pending = False  # an enqueue returned ncclInProgress
        self._aborted = False
        self._dead_code = SUCCESS
        self._abort_done: concurrent.futures.Future[None] | None = None
        #: seconds ``ncclCommAbort`` took on its daemon thread (None until one finished)
        self.last_abort_s: float | None = None
        #: seconds :meth:`abort` blocked its caller (None until called)
        self.abort_call_s: float | None = None
        #: enqueues that returned ncclInProgress and were awaited, and the time spent settling
        self.settles = 0
        self.settle_s = 0.0
        self.settle_max_s = 0.0

    # ------------------------------------------------------------------ creation
    @classmethod
    async def create(
        cls,
        unique_id: bytes,
        rank: int,
        nranks: int,
        device: torch.device,
        *,
        timeout: float,
        max_ctas: int | None = None,
        lib: NcclLibrary | None = None,
        blocking_ops: bool = False,
    ) -> Communicator:
        """``ncclCommInitRankConfig`` with ``blocking = 0``, polled from the loop.

        ``blocking_ops=True`` makes a *blocking* communicator instead, whose
        init runs on a worker thread (awaited, bounded by ``timeout``): its
        enqueue calls then never return ``ncclInProgress``, so posting needs
        no settle-polling. Call :meth:`warmup` on both ranks before the first
        real operation so that NCCL's lazy connection set-up happens on a
        thread too, not inside an enqueue on the event loop.

        Raises :class:`AiokvTimeoutError` (after aborting the half-made
        communicator) when init does not finish within ``timeout`` seconds —
        e.g. the peer never joins — and :class:`NcclError` when it fails.
        ``max_ctas`` caps the CTAs (channels) this communicator's kernels use.
        """
        if not 0 <= rank < nranks:
            raise ConfigError(f"rank {rank} is outside 0..{nranks - 1}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        device = torch.device(device)
        if device.type != "cuda" or device.index is None:
            raise ConfigError(f"an NCCL communicator needs an indexed CUDA device, got {device}")
        lib = lib or load_library()
        lib.require_nonblocking()
        uid = lib.unique_id_from_bytes(unique_id)
        if blocking_ops:
            return await cls._create_blocking(lib, uid, rank, nranks, device, timeout, max_ctas)
        config = lib.make_config(blocking=False, max_ctas=max_ctas)
        handle = ctypes.c_void_p(None)
        deadline = time.monotonic() + timeout
        # NCCL binds the communicator to the current device (no-op context for fakes on CPU)
        ctx = torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext()
        with ctx:
            rc = int(
                lib.ncclCommInitRankConfig(
                    ctypes.byref(handle), nranks, uid, rank, ctypes.byref(config)
                )
            )
        if handle.value is None:
            lib.check(rc, "ncclCommInitRankConfig")
            raise NcclError(
                "ncclCommInitRankConfig returned no communicator",
                code=3,
                code_name="ncclInternalError",
            )
        self = cls(lib, handle.value, rank=rank, nranks=nranks, device=device, timeout=timeout)
        if rc not in (SUCCESS, IN_PROGRESS):
            err = lib.error(rc, "ncclCommInitRankConfig", handle.value)
            self.abort()
            raise err
        try:
            await self._poll_until_settled(
                deadline, f"NCCL communicator init (rank {rank} of {nranks} on {device})"
            )
        except BaseException:
            self.abort()
            raise
        return self

    @classmethod
    async def _create_blocking(
        cls,
        lib: NcclLibrary,
        uid: Any,
        rank: int,
        nranks: int,
        device: torch.device,
        timeout: float,
        max_ctas: int | None,
    ) -> Communicator:
        config = lib.make_config(blocking=True, max_ctas=max_ctas)
        handle = ctypes.c_void_p(None)

        def init() -> int:
            with torch.cuda.device(device):
                return int(
                    lib.ncclCommInitRankConfig(
                        ctypes.byref(handle), nranks, uid, rank, ctypes.byref(config)
                    )
                )

        # init waits for the peer rank, forever if it never comes: a daemon thread
        call = start_daemon(init, "aiokv-nccl-init")
        try:
            rc = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call)), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            # The thread is inside NCCL's init and cannot be interrupted; when it
            # returns, the communicator it made is aborted (on that thread, not the loop).
            def cleanup(f: concurrent.futures.Future[int]) -> None:
                if handle.value is not None:
                    with contextlib.suppress(Exception):
                        lib.ncclCommAbort(handle.value)

            call.add_done_callback(cleanup)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise AiokvTimeoutError(
                f"NCCL communicator init (rank {rank} of {nranks} on {device}) did not finish "
                f"within {timeout:g} s"
            ) from None
        if rc != SUCCESS or handle.value is None:
            if handle.value is not None:
                with contextlib.suppress(Exception):
                    lib.ncclCommAbort(handle.value)
            lib.check(rc, "ncclCommInitRankConfig")
            raise NcclError(
                "ncclCommInitRankConfig returned no communicator",
                code=3,
                code_name="ncclInternalError",
            )
        return cls(lib, handle.value, rank=rank, nranks=nranks, device=device, timeout=timeout)

    async def warmup(self, timeout: float | None = None) -> None:
        """Exchange one byte with the peer rank on a worker thread (connects NCCL's p2p).

        Both ranks must call it. Bounded by ``timeout``; on timeout the
        communicator is aborted (which also releases the thread) and
        :class:`AiokvTimeoutError` is raised.
        """
        if self.nranks != 2:
            return
        peer = 1 - self.rank
        buf = torch.zeros(1, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

        def run() -> None:
            with torch.cuda.device(self.device):
                with self.group():
                    if self.rank == 0:
                        self.send(buf, peer, stream)
                    else:
                        self.recv(buf, peer, stream)
                stream.synchronize()

        limit = self.timeout if timeout is None else timeout
        # waits for the peer rank: a daemon thread (the abort on timeout releases it)
        fut = in_daemon(run, "aiokv-nccl-warmup")
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit)
        except asyncio.TimeoutError:
            self.abort()
            raise AiokvTimeoutError(
                f"NCCL warm-up with rank {peer} did not finish within {limit:g} s"
            ) from None

    async def _poll_until_settled(self, deadline: float, what: str, spin_s: float = 0.0) -> None:
        """Wait (the loop's :mod:`~aiokv._runtime.waiter`) until ``ncclCommGetAsyncError``
        is no longer in progress; raise its error, or :class:`AiokvTimeoutError` at
        ``deadline``.

        ``spin_s``: asked on every loop pass for this long first. An enqueue that
        returned ``ncclInProgress`` settles within microseconds, and a
        millisecond-granular timer sleep would add ~1 ms to every post.
        """
        state = IN_PROGRESS

        def settled_now() -> bool:
            nonlocal state
            state = self.async_error()
            return state != IN_PROGRESS

        settled = await waiter_for().wait_until(
            settled_now,
            deadline,
            spin=spin_s,
            interval=_POLL_MIN_S,
            max_interval=_POLL_MAX_S,
        )
        if not settled:
            raise AiokvTimeoutError(
                f"{what} did not finish within {self.timeout:g} s; communicator aborted"
            )
        if state != SUCCESS:
            raise self._lib.error(state, what, self._handle)

    # ------------------------------------------------------------------ state
    @property
    def handle(self) -> int | None:
        """The raw ``ncclComm_t`` (None once aborted or closed)."""
        return self._handle

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def closed(self) -> bool:
        """True once aborted or closed: no call may be posted any more."""
        return self._handle is None

    @property
    def pending(self) -> bool:
        """True while an enqueue that returned ``ncclInProgress`` has not settled."""
        return self._pending

    @property
    def lib(self) -> NcclLibrary:
        return self._lib

    def async_error(self) -> int:
        """``ncclCommGetAsyncError``: 0 fine, 7 in progress, else the error code.

        A dead communicator reports the error that killed it, or
        ``ncclInvalidUsage`` (5) when it was aborted / closed by us.
        """
        if self._handle is None:
            return self._dead_code or _ABORTED
        state = self._lib.comm_async_error(self._handle)
        if state == SUCCESS:
            self._pending = False
        return state

    def check(self) -> None:
        """Raise :class:`NcclError` if the communicator has an asynchronous error."""
        state = self.async_error()
        if state not in (SUCCESS, IN_PROGRESS):
            if self._handle is None:
                raise TransferAbortedError(f"NCCL communicator on {self.device} was aborted")
            raise self._lib.error(state, "NCCL communicator", self._handle)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until a pending enqueue (``ncclInProgress``) has settled; raise on error."""
        if not self._pending:
            return
        limit = self.timeout if timeout is None else timeout
        t0 = time.perf_counter()
        await self._poll_until_settled(time.monotonic() + limit, "NCCL enqueue", spin_s=0.05)
        dt = time.perf_counter() - t0
        self.settles += 1
        self.settle_s += dt
        self.settle_max_s = max(self.settle_max_s, dt)
        self._pending = False

    def _live_handle(self, what: str) -> int:
        h = self._handle
        if h is None:
            raise TransferAbortedError(
                f"{what}: the NCCL communicator on {self.device} is "
                f"{'aborted' if self._aborted else 'closed'}"
            )
        if self._pending and self.async_error() == IN_PROGRESS:
            raise NcclError(
                f"{what}: a previous NCCL call is still in progress; await wait_ready() first",
                code=5,
                code_name="ncclInvalidUsage",
            )
        return h

    # ------------------------------------------------------------------ data
    def _args(self, tensor: torch.Tensor, peer: int, what: str) -> tuple[int, int, int]:
        if not 0 <= peer < self.nranks or peer == self.rank:
            raise ConfigError(f"{what}: peer {peer} is not another rank of 0..{self.nranks - 1}")
        if tensor.device != self.device:
            raise ConfigError(
                f"{what}: tensor is on {tensor.device}, communicator on {self.device}"
            )
        if not tensor.is_contiguous():
            raise ConfigError(f"{what}: tensor must be contiguous")
        return tensor.data_ptr(), tensor.numel(), self._lib.dtype(tensor.dtype)

    def _enqueue(
        self, fn_name: str, tensor: torch.Tensor, peer: int, stream: torch.cuda.Stream
    ) -> int:
        handle = self._live_handle(fn_name)
        ptr, count, dt = self._args(tensor, peer, fn_name)
        rc = int(getattr(self._lib, fn_name)(ptr, count, dt, peer, handle, stream.cuda_stream))
        if rc == IN_PROGRESS:
            self._pending = True
        return self._lib.check(rc, fn_name, handle, allow_in_progress=True)

    def send(self, tensor: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> int:
        """Enqueue ``ncclSend`` of a contiguous tensor on ``stream``; returns at once.

        Returns 0, or ``ncclInProgress`` (7): then await :meth:`wait_ready`
        before recording the completion event.
        """
        return self._enqueue("ncclSend", tensor, peer, stream)

    def recv(self, tensor: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> int:
        """Enqueue ``ncclRecv`` into a contiguous tensor on ``stream``; see :meth:`send`."""
        return self._enqueue("ncclRecv", tensor, peer, stream)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """``ncclGroupStart`` … ``ncclGroupEnd``: the sends/recvs inside launch together.

        ``ncclGroupEnd`` runs even when the body raises (NCCL needs the pair
        balanced). If it returns ``ncclInProgress``, :attr:`pending` is set.
        """
        self._live_handle("ncclGroupStart")
        self._lib.check(self._lib.ncclGroupStart(), "ncclGroupStart")
        try:
            yield
        finally:
            rc = int(self._lib.ncclGroupEnd())
            if rc == IN_PROGRESS:
                self._pending = True
            self._lib.check(rc, "ncclGroupEnd", self._handle, allow_in_progress=True)

    # ------------------------------------------------------------------ teardown
    def abort(self) -> None:
        """Abort: the communicator is dead at once; ``ncclCommAbort`` runs on a helper thread.

        Measured on 2x H200 / NCCL 2.28.9, ``ncclCommAbort`` itself takes ~0.5 s
        (it tears down NCCL's proxy and bootstrap threads), far too long to run
        on the event loop. So this marks the communicator aborted (every later
        call raises :class:`TransferAbortedError`, the poller fails its waiters),
        starts the C call on a daemon thread (ctypes releases the GIL) and
        returns within microseconds. The abort flag NCCL sets first stops any
        kernel spinning on a missing peer; await :meth:`wait_aborted` for the
        teardown to finish. Idempotent; never raises. :attr:`abort_call_s` is
        how long this method blocked, :attr:`last_abort_s` how long
        ``ncclCommAbort`` took.
        """
        h = self._handle
        if h is None:
            return
        t0 = time.perf_counter()
        if self._dead_code == SUCCESS:
            try:
                state = self._lib.comm_async_error(h)
            except NcclError:
                state = SUCCESS
            if state not in (SUCCESS, IN_PROGRESS):
                self._dead_code = state
        self._handle = None
        self._aborted = True
        self._pending = False
        self._abort_done = start_daemon(lambda: self._abort_in_thread(h), "aiokv-nccl-abort")
        self.abort_call_s = time.perf_counter() - t0

    def _abort_in_thread(self, handle: int) -> None:
        t0 = time.perf_counter()
        try:
            self._lib.ncclCommAbort(handle)
        except Exception:  # nothing to report to: the communicator is already dead
            pass
        finally:
            self.last_abort_s = time.perf_counter() - t0

    async def wait_aborted(self, timeout: float = 10.0) -> bool:
        """Wait (polling, never blocking the loop) until ``ncclCommAbort`` returned.

        True when it did (or no abort is running), False after ``timeout``.
        """
        done = self._abort_done
        if done is None:
            return True
        return await waiter_for().wait_until(
            done.done,
            time.monotonic() + timeout,
            interval=_POLL_MIN_S,
            max_interval=_POLL_MAX_S,
        )

    async def aclose(self, timeout: float | None = None) -> None:
        """Finalize then destroy, polled from the loop; aborts instead past ``timeout``.

        ``ncclCommFinalize`` flushes what was posted, which needs the peer to
        match it; when that does not happen within ``timeout`` (default: the
        communicator's), or anything fails, the communicator is aborted.
        Cancellation aborts too, then propagates.
        """
        h = self._handle
        if h is None:
            return
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        try:
            rc = int(self._lib.ncclCommFinalize(h))
            self._lib.check(rc, "ncclCommFinalize", h, allow_in_progress=True)
            await self._poll_until_settled(deadline, "ncclCommFinalize")
        except (AiokvTimeoutError, NcclError):
            self.abort()  # the bounded fallback; aclose() itself does not raise for it
            await self.wait_aborted(timeout=max(1.0, limit))
            return
        except BaseException:
            self.abort()
            raise
        # quiescent: destroy only frees local resources and cannot hang on the peer
        self._handle = None
        with contextlib.suppress(Exception):
            self._lib.ncclCommDestroy(h)

    def __repr__(self) -> str:
        state = "aborted" if self._aborted else ("closed" if self._handle is None else "open")
        return (
            f"<Communicator rank={self.rank}/{self.nranks} device={self.device} {state}"
            f"{' dead=' + result_name(self._dead_code) if self._dead_code else ''}>"
        )
