"""A zmq socket driven from the asyncio loop by its file descriptor.

pyzmq's asyncio layer (``zmq.asyncio``) makes a future, a poller registration
and a dozen enum operations for every message; profiled, that was about 45 %
of the engine's CPU per small transfer (docs/benchmarks.md). A
:class:`LoopSocket` instead

* drains every queued message in one callback when the socket's FD becomes
  readable (zmq's FD is edge-triggered: we read until ``EVENTS`` has no
  ``POLLIN`` left, and look again after every send, which can consume an edge);
* sends at once with ``NOBLOCK``; only a send that would block is kept, in
  call order, until the socket is writable again — so messages never overtake
  each other.

Nothing here blocks, and nothing here allocates a future per message.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

__all__ = ["CURVE_FRAME_OVERHEAD", "LoopSocket", "max_msg_size", "monitor_socket"]

#: What CURVE adds to each frame on the wire: libzmq sends every frame as an encrypted
#: MESSAGE command (its name and nonce, 16 bytes; the box's MAC, 16; a flags byte) -- 33
#: bytes in libzmq 4.x, rounded up here. zmq checks ``MAXMSGSIZE`` against the frame as
#: it arrives, before decrypting it, so a limit meant for the payload must include this.
CURVE_FRAME_OVERHEAD = 64


def max_msg_size(payload: int, curve: bool) -> int:
    """The ``MAXMSGSIZE`` that lets frames of ``payload`` bytes through (with CURVE on:
    plus :data:`CURVE_FRAME_OVERHEAD`, which is what zmq measures)."""
    return payload + CURVE_FRAME_OVERHEAD if curve else payload


_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_SNDMORE = int(zmq.SNDMORE)
_monitor_ids = itertools.count(1)

# pyzmq's ``send_multipart``/``recv_multipart`` wrap the backend's per-frame calls with
# enum arithmetic and a type pass: ~3 µs per small PUT on each end (measured
# on a 2-core VM). These two call the backend directly with integer flags.
_send_frame = zmq.backend.Socket.send
_recv_frame = zmq.backend.Socket.recv
_SENDABLE = (bytes, memoryview, zmq.Frame)


def send_parts(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int, copy: bool) -> None:
    """``sock.send_multipart(frames, flags, copy=copy)`` without its wrapper's overhead.

    Every part is checked to be sendable before the first goes out, as pyzmq does, so
    a bad part can never leave half a multipart message queued on the socket.
    """
    for f in frames:
        if type(f) not in _SENDABLE:
            memoryview(f)  # a TypeError here, before anything was sent
    last = len(frames) - 1
    more = flags | _SNDMORE
    for i in range(last):
        _send_frame(sock, frames[i], more, copy)
    _send_frame(sock, frames[last], flags, copy)


def recv_parts(sock: zmq.Socket[Any], flags: int) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)`` without its wrapper's overhead."""
    f = _recv_frame(sock, flags, False)
    parts = [f]
    while f.more:
        f = _recv_frame(sock, flags, False)
        parts.append(f)
    return parts


def _ignore(_frames: list[zmq.Frame]) -> None:
    return None


class LoopSocket:
    """Run a (synchronous) zmq socket from the running loop.

    ``on_message(frames)`` is called for every received multipart message, in
    order, with ``zmq.Frame`` objects (zero-copy). ``on_error(exc)`` is called
    when receiving or a deferred send fails; the owner decides whether to close.
    At most ``max_batch`` messages, and messages for at most ``max_busy_s``
    seconds, are handled per callback before yielding to the loop, so a flood
    (or a run of expensive messages) cannot starve other tasks. ``on_drained()``
    is called after each such run that handled a message: the owner can answer
    everything that arrived together at once (one reply per run, not per message,
    without waiting for the end of the loop pass).
    """

    __slots__ = (
        "_backlog",
        "_fd",
        "_loop",
        "_scheduled",
        "closed",
        "max_batch",
        "max_busy_s",
        "on_drained",
        "on_error",
        "on_message",
        "sock",
    )

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[zmq.Frame]], None] | None = None,
        on_error: Callable[[zmq.ZMQError], None] | None = None,
        *,
        max_batch: int = 128,
        max_busy_s: float = 0.005,
        on_drained: Callable[[], None] | None = None,
    ) -> None:
        self.sock = sock
        self.on_message = on_message or _ignore
        self.on_error = on_error
        self.on_drained = on_drained
        self.max_batch = max_batch
        self.max_busy_s = max_busy_s
        self.closed = False
        self._backlog: deque[tuple[Sequence[Any], bool, asyncio.Future[None] | None]] = deque()
        self._scheduled = False
        self._loop = asyncio.get_running_loop()
        self._fd: int = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._readable)
        self._check_soon()  # messages may already be queued: the FD only signals edges

    # ------------------------------------------------------------------ sending
    def send(self, frames: Sequence[Any], *, copy: bool = True) -> None:
        """Send now, or queue behind earlier sends that would block.

        Raises :class:`zmq.ZMQError` for a failure other than "would block"
        (e.g. ``EHOSTUNREACH`` on a ROUTER with ``ROUTER_MANDATORY``).
        """
        if not self._send_now(frames, copy):
            self._backlog.append((frames, copy, None))

    async def send_wait(self, frames: Sequence[Any], *, copy: bool = True) -> None:
        """Like :meth:`send`, and wait until zmq took the message (e.g. a peer connected)."""
        if self._send_now(frames, copy):
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._backlog.append((frames, copy, fut))
        await fut

    def _send_now(self, frames: Sequence[Any], copy: bool) -> bool:
        """Hand the message to zmq unless earlier ones wait or it would block; True if taken."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        if self._backlog:
            return False
        try:
            send_parts(self.sock, frames, _NOBLOCK, copy)
        except zmq.Again:
            self._check_soon()  # a blocked send needs POLLOUT
            return False
        except BaseException:
            self._check_soon()
            raise
        if self.on_message is not _ignore:
            # a send can consume the FD's edge of a message that arrived meanwhile (not
            # worth a look for a socket that only sends: one system call per send)
            self._check_soon()
        return True

    def _flush(self) -> bool:
        """Send queued messages until one would block; True if any left."""
        sent = False
        while self._backlog:
            frames, copy, fut = self._backlog[0]
            if fut is not None and fut.done():  # its waiter gave up: drop it
                self._backlog.popleft()
                continue
            try:
                send_parts(self.sock, frames, _NOBLOCK, copy)
            except zmq.Again:
                return sent
            self._backlog.popleft()
            sent = True
            if fut is not None:
                fut.set_result(None)
        return sent

    # ------------------------------------------------------------------ receiving
    def _check_soon(self) -> None:
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self._loop.call_soon(self._ready)

    def _readable(self) -> None:
        """The FD's event. A run already queued for this loop pass (``_check_soon``)
        looks at the socket anyway: a second run in the same pass would only give a
        flood two budgets per pass, and everything waiting on a timer -- two passes
        from its deadline to its task -- twice the wait."""
        if not self._scheduled:
            self._ready()

    def _ready(self) -> None:
        self._scheduled = False
        n = 0
        sock = self.sock
        prev = time.perf_counter()
        until = prev + self.max_busy_s
        try:
            while not self.closed:
                ev = cast(int, sock.getsockopt(_EVENTS))
                progressed = False
                if self._backlog and ev & _POLLOUT:
                    progressed = self._flush()
                if ev & _POLLIN:
                    frames = recv_parts(sock, _NOBLOCK)
                    n += 1
                    try:
                        self.on_message(frames)
                    except Exception:
                        # the FD's edge is spent: without a new look, messages
                        # already queued would wait for one that never comes
                        self._check_soon()
                        raise
                    progressed = True
                    # stop when the next message, costing what this one did, would end
                    # past the budget (not only once past it: a run of expensive
                    # messages then overshoots by one message less)
                    now = time.perf_counter()
                    if n >= self.max_batch or now + (now - prev) > until:
                        self._check_soon()
                        return
                    prev = now
                if not progressed:
                    return
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if not self.closed and self.on_error is not None:
                self.on_error(exc)  # the owner decides: close, or keep serving
        finally:
            if n and self.on_drained is not None:
                self.on_drained()

    # ------------------------------------------------------------------ closing
    def close(self, linger: int | None = None) -> None:
        """Stop reading, fail queued sends' waiters, close the socket (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        while self._backlog:
            _frames, _copy, fut = self._backlog.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "socket closed"))
        self.sock.close(linger)


def monitor_socket(sock: zmq.Socket[Any], actx: Any, events: int) -> Any:
    """An asyncio PAIR socket (of ``actx``) receiving ``sock``'s connection events.

    ``sock`` must belong to the same underlying zmq context as ``actx``.
    """
    addr = f"inproc://aiokv-monitor-{id(actx):x}-{next(_monitor_ids)}"
    sock.monitor(addr, events)
    mon = actx.socket(zmq.PAIR)
    mon.connect(addr)
    return mon


class Outbox:
    """Messages queued on one connection during a loop pass, sent as few zmq messages.

    The cost of a small zmq message is the hand-off to zmq's I/O thread, not its
    bytes, so frames queued in one loop pass leave together: at the end of the pass,
    or at once with ``now`` (a caller waiting on exactly this message), or as soon as
    ``batch_frames`` frames / ``batch_bytes`` bytes are queued (a pipelining peer then
    answers the first batch while the rest is written). ``max_frames`` splits a flush
    into messages of at most that many frames; with ``max_frames=None`` every flush is
    one message (frames that must stay together, like a PUT and its tensors). Sent
    on ``sock`` after ``prefix`` (a ROUTER's routing id), zero-copy unless ``copy``.
    A send that fails calls ``on_error`` once; a closed outbox drops what it gets.
    """

    __slots__ = (
        "_bytes",
        "_frames",
        "_loop",
        "batch_bytes",
        "batch_frames",
        "closed",
        "copy",
        "max_frames",
        "on_error",
        "prefix",
        "sock",
    )

    def __init__(
        self,
        sock: LoopSocket,
        on_error: Callable[[zmq.ZMQError], None],
        *,
        prefix: bytes | None = None,
        copy: bool = True,
        max_frames: int | None = None,
        batch_frames: int | None = None,
        batch_bytes: int | None = None,
    ) -> None:
        self.sock = sock
        self.on_error = on_error
        self.prefix = prefix
        self.copy = copy
        self.max_frames = max_frames
        self.batch_frames = batch_frames
        self.batch_bytes = batch_bytes
        self.closed = False
        self._loop = sock._loop
        self._frames: list[Any] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, frames: Sequence[Any], *, nbytes: int = 0, now: bool = False) -> None:
        """Queue ``frames`` (``nbytes`` of payload among them); see the class docstring."""
        if self.closed:
            return
        out = self._frames
        if now and not out:  # nothing queued before it: at once, without the queue
            self._send(frames)
            return
        was_empty = not out
        out.extend(frames)
        self._bytes += nbytes
        if (
            now
            or (self.batch_frames is not None and len(out) >= self.batch_frames)
            or (self.batch_bytes is not None and self._bytes >= self.batch_bytes)
        ):
            self.flush()
        elif was_empty:
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send everything queued now (a no-op when empty)."""
        frames, self._frames = self._frames, []
        self._bytes = 0
        self._send(frames)

    def _send(self, frames: Sequence[Any]) -> None:
        """``frames`` as messages of at most ``max_frames`` frames, after ``prefix``."""
        if not frames or self.closed or self.sock.closed:
            return
        step = self.max_frames or len(frames)
        try:
            for i in range(0, len(frames), step):
                part = frames[i : i + step]
                if self.prefix is not None:
                    part = [self.prefix, *part]
                self.sock.send(part, copy=self.copy)
        except zmq.ZMQError as exc:
            self.close()
            self.on_error(exc)

    def close(self) -> None:
        """Drop what is queued; later puts are dropped too."""
        self.closed = True
        self._frames = []
        self._bytes = 0
