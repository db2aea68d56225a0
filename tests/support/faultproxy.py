"""Fault-injecting proxies for the reliability tests (loopback only).

:class:`FaultProxy` is an asyncio zmq proxy between an aiokv client and an
engine: a ROUTER bound on its own port; for each routing id that connects it
opens a DEALER to the real engine and forwards both ways. Every control
message is decoded with the aiokv codec (read-only) so faults can target one
message kind in one direction:

* ``drop``      the frame is not forwarded;
* ``duplicate`` the frame is forwarded twice;
* ``delay``     the frame (its whole zmq message) is forwarded ``seconds`` later;
* ``cut``       from this frame on, nothing more is forwarded in either
  direction (``close=True`` also closes the DEALERs to the engine).

A client corks several control messages into one multipart zmq message; the
proxy applies control faults frame by frame. A data message (``[DATA header,
tensor frames...]``) is treated as one unit.

Data connections go to the engine's data port, which WELCOME announces as the
capability ``data:<port>``: the proxy rewrites it to a second port of its own
(a PLAIN server that lets every client in) and forwards each data connection to
the engine's data port with the PLAIN credentials (the session token) taken from
the connection's DATA_HELLO; the same faults apply there.

:class:`TcpRelay` is a byte-level TCP relay that keeps a copy of everything it
relays (for the clear-text capture test under CURVE).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from aiokv._exceptions import RemoteProtocolError
from aiokv.protocol.codec import Codec, WireLimits
from aiokv.protocol.messages import DataHeader, DataHello, Message, Welcome

C2S, S2C = "c2s", "s2c"
_codec = Codec(WireLimits(max_frame_bytes=1 << 30))


def kind_of(frame: bytes | memoryview) -> str:
    """NAME of the message in a control frame, or ``"?"`` when it does not decode."""
    try:
        return _codec.decode(frame).NAME
    except RemoteProtocolError:
        return "?"


@dataclass
class Fault:
    """One rule. ``kind`` is a message NAME (``"GRANT"``, ``"DATA"``, ...) or None for any.

    The rule fires on matches number ``after`` .. ``after + times - 1`` (``times``
    None = every later match).
    """

    direction: str
    kind: str | None
    action: str  # drop | duplicate | delay | cut
    after: int = 0
    times: int | None = 1
    seconds: float = 0.0
    close: bool = False
    seen: int = 0
    fired: int = 0

    def matches(self, direction: str, kind: str) -> bool:
        if direction != self.direction or (self.kind is not None and kind != self.kind):
            return False
        n = self.seen
        self.seen += 1
        if n < self.after or (self.times is not None and n >= self.after + self.times):
            return False
        self.fired += 1
        return True


@dataclass
class _Conn:
    rid: bytes
    dealer: zmq.asyncio.Socket
    task: asyncio.Task[None] | None = None


@dataclass
class FaultProxy:
    """``FaultProxy(target="127.0.0.1:PORT")``; ``await start()``; connect clients to ``address``."""

    target: str
    faults: list[Fault] = field(default_factory=list)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    cut_now: bool = False

    def __post_init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._data_router: zmq.asyncio.Socket | None = None
        self._zap: zmq.asyncio.Socket | None = None
        self._conns: dict[bytes, _Conn] = {}
        self._data_conns: dict[bytes, _Conn] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.address = ""
        self.data_port = 0  # the proxy's data port (announced to clients)
        self.target_data_port = 0  # the engine's, from its WELCOME

    async def start(self) -> FaultProxy:
        self._ctx = zmq.asyncio.Context()
        # PLAIN needs a ZAP handler: this one lets every data connection in (the engine
        # checks the token when the proxy connects onwards)
        self._zap = self._ctx.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind("inproc://zeromq.zap.01")
        self._spawn(self._zap_all())
        r = self._router_socket()
        port = r.bind_to_random_port("tcp://127.0.0.1")
        self._router = r
        self.address = f"127.0.0.1:{port}"
        d = self._router_socket()
        d.setsockopt(zmq.PLAIN_SERVER, 1)
        self.data_port = d.bind_to_random_port("tcp://127.0.0.1")
        self._data_router = d
        self._spawn(self._front(r, self._conns, self._open_ctrl))
        self._spawn(self._front(d, self._data_conns, self._open_data))
        return self

    def _router_socket(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        r = self._ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.RCVHWM, 0)
        r.setsockopt(zmq.SNDHWM, 0)
        return r

    async def _zap_all(self) -> None:
        assert self._zap is not None
        with contextlib.suppress(zmq.ZMQError):
            while True:
                f = await self._zap.recv_multipart()
                await self._zap.send_multipart([f[0], b"", b"1.0", f[3], b"200", b"OK", b"", b""])

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def add(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    def cut(self, close: bool = False) -> None:
        """Stop forwarding in both directions (a black hole); ``close`` also drops the engine side."""
        self.cut_now = True
        if close:
            for c in [*self._conns.values(), *self._data_conns.values()]:
                c.dealer.close(0)

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in [*self._conns.values(), *self._data_conns.values()]:
            if not c.dealer.closed:
                c.dealer.close(0)
        for sock in (self._router, self._data_router, self._zap):
            if sock is not None:
                sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---------------------------------------------------------------- internals
    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _actions(self, direction: str, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.matches(direction, kind)]

    def _filter(self, direction: str, frames: list[bytes]) -> tuple[list[bytes], float]:
        """Apply the faults to one zmq message; returns the frames to forward and a delay."""
        if self.cut_now:
            return [], 0.0
        first = kind_of(frames[0]) if frames else "?"
        delay = 0.0
        if first in (DataHeader.NAME, "PUT", "RETURN"):  # a data message: one unit
            unit = "DATA" if first == DataHeader.NAME else first
            self.counts[(direction, unit)] += 1
            out = frames
            for f in self._actions(direction, unit):
                if f.action == "drop":
                    out = []
                elif f.action == "duplicate":
                    out = frames  # sent twice below
                    delay = -1.0
                elif f.action == "delay":
                    delay = max(delay, f.seconds)
                elif f.action == "cut":
                    self.cut(f.close)
                    return [], 0.0
            return out, delay
        out: list[bytes] = []
        for fr in frames:
            k = kind_of(fr)
            self.counts[(direction, k)] += 1
            copies = 1
            for f in self._actions(direction, k):
                if f.action == "drop":
                    copies = 0
                elif f.action == "duplicate":
                    copies = 2
                elif f.action == "delay":
                    delay = max(delay, f.seconds)
                elif f.action == "cut":
                    self.cut(f.close)
                    return out, delay
            out.extend([fr] * copies)
        return out, delay

    async def _forward(
        self, sock: zmq.asyncio.Socket, prefix: list[bytes], frames: list[bytes], delay: float
    ) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        if sock.closed or (self.cut_now and delay > 0):
            return
        with contextlib.suppress(zmq.ZMQError):
            await sock.send_multipart(prefix + frames, copy=False)
            if delay < 0:  # duplicated data message
                await sock.send_multipart(prefix + frames, copy=False)

    def _dealer(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 0)
        d.setsockopt(zmq.SNDHWM, 0)
        return d

    def _open_ctrl(self, first: list[bytes]) -> zmq.asyncio.Socket | None:
        d = self._dealer()
        d.connect(f"tcp://{self.target}")
        return d

    def _open_data(self, first: list[bytes]) -> zmq.asyncio.Socket | None:
        """A data connection: onwards to the engine's data port with its DATA_HELLO's token."""
        try:
            hello = _codec.decode(first[0]) if len(first) == 1 else None
        except RemoteProtocolError:
            hello = None
        if not isinstance(hello, DataHello) or not self.target_data_port:
            return None
        d = self._dealer()
        d.setsockopt(zmq.PLAIN_USERNAME, b"aiokv")
        d.setsockopt(zmq.PLAIN_PASSWORD, hello.token.hex().encode())
        host = self.target.rsplit(":", 1)[0]
        d.connect(f"tcp://{host}:{self.target_data_port}")
        return d

    def _rewrite_welcome(self, frames: list[bytes]) -> list[bytes]:
        """Announce the proxy's data port in place of the engine's."""
        out = []
        for fr in frames:
            try:
                msg = _codec.decode(fr)
            except RemoteProtocolError:
                msg = None
            if isinstance(msg, Welcome):
                caps = []
                for c in msg.capabilities:
                    if c.startswith("data:"):
                        self.target_data_port = int(c[5:])
                        c = f"data:{self.data_port}"
                    caps.append(c)
                fr = _codec.encode(dataclasses.replace(msg, capabilities=tuple(caps)))
            out.append(fr)
        return out

    async def _front(
        self,
        router: zmq.asyncio.Socket,
        conns: dict[bytes, _Conn],
        open_back: Any,
    ) -> None:
        while True:
            parts = await router.recv_multipart()
            rid, frames = parts[0], parts[1:]
            conn = conns.get(rid)
            if conn is None:
                if self.cut_now:
                    continue
                d = open_back(frames)
                if d is None:
                    continue
                conn = _Conn(rid, d)
                conns[rid] = conn
                conn.task = asyncio.ensure_future(self._back(router, conn))
                self._tasks.add(conn.task)
                conn.task.add_done_callback(self._tasks.discard)
            if conn.dealer.closed:
                continue
            out, delay = self._filter(C2S, frames)
            if not out:
                continue
            if delay:
                self._spawn(self._forward(conn.dealer, [], out, delay))
            else:
                await self._forward(conn.dealer, [], out, 0.0)

    async def _back(self, router: zmq.asyncio.Socket, conn: _Conn) -> None:
        with contextlib.suppress(zmq.ZMQError):
            while not conn.dealer.closed:
                frames = self._rewrite_welcome(await conn.dealer.recv_multipart())
                out, delay = self._filter(S2C, frames)
                if not out:
                    continue
                if delay:
                    self._spawn(self._forward(router, [conn.rid], out, delay))
                else:
                    await self._forward(router, [conn.rid], out, 0.0)


def decode_all(frames: list[bytes]) -> list[Message]:
    return [_codec.decode(f) for f in frames]


class TcpRelay:
    """A byte-level TCP relay ``127.0.0.1:port -> target`` that records every byte both ways.

    ``same_ports``: also relay ``127.0.0.1:p -> target host:p`` for each (an engine's data
    port, which its WELCOME announces for the host the client connected to: the target
    must then listen on another loopback address, e.g. 127.0.0.2).
    """

    def __init__(self, target: str, same_ports: tuple[int, ...] = ()) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.same_ports = same_ports
        self._extra: list[asyncio.base_events.Server] = []
        self.c2s = bytearray()
        self.s2c = bytearray()
        self.address = ""
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        for p in self.same_ports:
            target = (self.target[0], p)

            async def handle(
                r: asyncio.StreamReader, w: asyncio.StreamWriter, t: tuple[str, int] = target
            ) -> None:
                await self._handle(r, w, t)

            self._extra.append(await asyncio.start_server(handle, "127.0.0.1", p))
        return self

    async def __aenter__(self) -> TcpRelay:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def captured(self) -> bytes:
        return bytes(self.c2s) + bytes(self.s2c)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, buf: bytearray) -> None:
        try:
            while True:
                data = await r.read(1 << 16)
                if not data:
                    break
                buf += data
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    async def _handle(
        self,
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
        target: tuple[str, int] | None = None,
    ) -> None:
        try:
            ur, uw = await asyncio.open_connection(*(target or self.target))
        except OSError:
            w.close()
            return
        self._writers += [w, uw]
        t1 = asyncio.ensure_future(self._pipe(r, uw, self.c2s))
        t2 = asyncio.ensure_future(self._pipe(ur, w, self.s2c))
        self._tasks.update((t1, t2))
        await asyncio.gather(t1, t2, return_exceptions=True)

    async def aclose(self) -> None:
        for extra in self._extra:
            extra.close()
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            with contextlib.suppress(Exception):
                w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
