"""Engine configuration: :class:`EngineConfig`, :class:`Timeouts`, :class:`Limits`."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ._exceptions import ConfigError

__all__ = ["CurveConfig", "EngineConfig", "LayoutCheck", "Limits", "Timeouts", "parse_address"]

#: ``check(mine, theirs)``: None when a peer offering layout ``theirs`` may send into an
#: engine holding ``mine``, else the reason (see :attr:`EngineConfig.layout_check`)
LayoutCheck = Callable[[Mapping[str, str | int], Mapping[str, str | int]], str | None]

#: the default :data:`LayoutCheck`, registered by :mod:`aiokv.kv.layouts` at its import
_DEFAULT_LAYOUT_CHECK: dict[str, LayoutCheck] = {}


def register_default_layout_check(check: LayoutCheck) -> None:
    """Make ``check`` the layout check of configs that set a layout but no check."""
    _DEFAULT_LAYOUT_CHECK["kv"] = check

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: default of :attr:`Limits.store_tensors`
DEFAULT_STORE_TENSORS = 65536
#: defaults of :attr:`EngineConfig.nccl_recv_batch` and ``nccl_recv_batch_bytes``
DEFAULT_NCCL_RECV_BATCH = 8
DEFAULT_NCCL_RECV_BATCH_BYTES = 128 * MiB
#: the shortest secret :meth:`CurveConfig.from_secret` accepts (UTF-8 bytes of a str)
_MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds. ``transfer`` bounds a whole operation (negotiation included)."""

    connect: float = 5.0
    #: connecting gives up (ConnectError) once every attempt for this long was refused
    #: (nothing listens on the peer's port): a peer that comes up meanwhile is reached
    connect_retry: float = 0.5
    negotiate: float = 10.0
    transfer: float = 60.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.5
    linger: float = 1.0
    #: the event loop stuck this long while NCCL work is queued: log an error naming where
    nccl_watchdog: float = 30.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"Timeouts.{f.name} must be a positive number, got {v!r}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("Timeouts.heartbeat_timeout must exceed heartbeat_interval")


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits. Wire data is checked against these before anything is allocated."""

    max_frame_bytes: int = 1 * MiB  # one control message
    # one RESERVE/PUT costs the receiver work per tensor before anything else can run:
    # bounded so that one message stays within a few milliseconds
    max_tensors_per_transfer: int = 1024
    max_ndim: int = 8
    max_tensor_bytes: int = 16 * GiB
    max_id_length: int = 512
    store_bytes: int = 2 * GiB  # receive-store budget (granted + held, all peers)
    # receive-store tensor count (granted + held, all peers): empty tensors use no bytes
    store_tensors: int = DEFAULT_STORE_TENSORS
    max_pending_reserves: int = 4096  # queued reservations per session
    ttl: float = 120.0  # uncollected tensors expire after this many seconds
    max_published: int = 100_000
    idle_session: float = 600.0  # close a session (and its communicator) unused this long
    max_client_sessions: int = 256  # beyond this, the least recently used idle session is closed
    # protocol v2: the standing window each peer session is granted (at most a quarter of
    # the store's budget); a transfer larger than the window asks with RESERVE instead
    credit_bytes: int = 64 * MiB
    credit_tensors: int = 4096

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"Limits.{f.name} must be positive, got {v!r}")
        if self.store_tensors < self.max_tensors_per_transfer:
            raise ConfigError(
                f"Limits.store_tensors ({self.store_tensors}) must be at least "
                f"max_tensors_per_transfer ({self.max_tensors_per_transfer}): a transfer "
                "that can never fit would wait forever"
            )


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """CURVE keys (z85-encoded, 40 characters).

    ``allowed_clients`` None means *any* client key is served: the connection is
    encrypted but the client is not authenticated. ``server_keys`` maps the
    addresses this engine connects to onto their public keys; ``default_server_key``
    is used for an address not listed. For a whole cluster behind one shared
    secret use :meth:`from_secret`.
    """

    public_key: bytes
    secret_key: bytes
    allowed_clients: frozenset[bytes] | None = None
    # server public keys by address, for the peers this engine connects to
    server_keys: dict[str, bytes] = field(default_factory=dict)
    default_server_key: bytes | None = None

    @classmethod
    def from_secret(cls, secret: str | bytes) -> CurveConfig:
        """One key pair for every engine that knows ``secret`` (at least 16 bytes).

        Each such engine serves only clients with that key and expects it of every
        server it connects to: authentication and encryption for a cluster in one
        setting. The key pair is derived with SHA-256 (domain-separated); keep the
        secret as you would a private key.
        """
        import hashlib

        import zmq
        from zmq.utils import z85

        # only text or bytes: bytes(12345) would be a secret of 12,345 zeros
        if isinstance(secret, str):
            raw = secret.encode()
        elif isinstance(secret, (bytes, bytearray)):
            raw = bytes(secret)
        else:
            raise ConfigError(
                "CurveConfig.from_secret takes a str or bytes secret of at least "
                f"{_MIN_SECRET_BYTES} bytes, got {type(secret).__name__}"
            )
        if len(raw) < _MIN_SECRET_BYTES:
            raise ConfigError(
                "CurveConfig.from_secret needs a str or bytes secret of at least "
                f"{_MIN_SECRET_BYTES} bytes, got {len(raw)}"
            )
        if not zmq.has("curve"):
            raise ConfigError("this libzmq has no CURVE support")
        sk = z85.encode(hashlib.sha256(b"aiokv curve key v1\x00" + raw).digest())
        pk = zmq.curve_public(sk)
        return cls(pk, sk, frozenset({pk}), {}, pk)


@runtime_checkable
class _HasWireForm(Protocol):
    """What :attr:`EngineConfig.layout` accepts besides a dict: an object with a wire form."""

    def to_wire(self) -> object: ...


def parse_address(addr: str) -> tuple[str, int]:
    """Split ``host:port`` and check it. Raises :class:`ConfigError`."""
    if not isinstance(addr, str) or ":" not in addr:
        raise ConfigError(f"address must look like 'host:port', got {addr!r}")
    host, _, port_s = addr.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"bad port in address {addr!r}") from None
    if not host or not (0 <= port < 65536):
        raise ConfigError(f"bad address {addr!r}")
    return host, port


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is an unspecified (listen-on-every-interface) address."""
    h = host.strip("[]")
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return h in ("", "*")


def default_advertise_host(listen_host: str) -> str:
    """The host a wildcard listener announces when :attr:`EngineConfig.advertise` is None:
    the local address the host routes outward from (found with an unconnected UDP
    socket: no packet is sent), or the loopback address where there is no route."""
    v6 = ":" in listen_host
    fam, probe, loop = (
        (socket.AF_INET6, "2001:db8::1", "::1")
        if v6
        else (socket.AF_INET, "192.0.2.1", "127.0.0.1")
    )
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            host = str(s.getsockname()[0])
    except OSError:
        return loop
    return loop if is_wildcard(host) else host


def advertised_address(bound: str, listen: str, advertise: str | None) -> str:
    """``host:port`` announced for a listener bound at ``bound`` (its port is kept)."""
    _, port = parse_address(bound)
    host, _ = parse_address(listen)
    if advertise is not None:
        host = advertise.strip("[]")
    elif is_wildcard(host):
        host = default_advertise_host(host)
    else:
        return bound
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an :class:`aiokv.Engine` listens, where its tensors live and its limits.

    ``listen`` is ``host:port`` (port 0 picks a free one; the engine's
    ``address`` tells which). ``advertise`` is the host peers reach it by: the
    engine announces ``advertise:port`` (its ``address``), never a wildcard. Left
    None, a concrete listen host is announced as it is, and a wildcard one
    (``0.0.0.0``, ``::``) as :func:`default_advertise_host`. ``device`` is where received tensors land:
    ``"cpu"`` or ``"cuda:N"``. ``transport`` is ``"auto"`` (NCCL for CUDA
    tensors when both sides can, TCP otherwise), ``"tcp"`` or ``"nccl"``.
    """

    listen: str = "127.0.0.1:0"
    #: the host (name or IP literal, no port) announced to peers; see the class doc
    advertise: str | None = None
    device: str = "cpu"
    transport: str = "auto"
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    curve: CurveConfig | None = None
    nccl_max_channels: int | None = None
    #: Blocking NCCL communicators (init and a warm-up exchange on a worker thread) make
    #: every later enqueue a plain launch; non-blocking ones (the default) need
    #: settle-polling after enqueues. The command-line tools set it from
    #: ``AIOKV_NCCL_BLOCKING_OPS=1``.
    nccl_blocking_ops: bool = False
    #: NCCL receives are posted in groups of at most this many transfers and
    #: ``nccl_recv_batch_bytes`` bytes (one completion event per group; see
    #: docs/design.md). The command-line tools set both from
    #: ``AIOKV_NCCL_RECV_BATCH="count,MiB"``.
    nccl_recv_batch: int = DEFAULT_NCCL_RECV_BATCH
    nccl_recv_batch_bytes: int = DEFAULT_NCCL_RECV_BATCH_BYTES
    #: KV layout offered at HELLO: opaque to the engine, which only carries it (in its
    #: wire form, a flat dict) and asks :attr:`layout_check` about a peer's. Pass a
    #: :class:`~aiokv.kv.KVLayout` or its wire form (``layout.to_wire()``); checked here
    #: and stored in the wire form. (Type checkers see the wire form: pass
    #: ``layout.to_wire()`` if yours objects to a KVLayout.)
    layout: dict[str, str | int] | None = None
    #: whether a peer's layout is compatible with :attr:`layout` (see :data:`LayoutCheck`);
    #: None with a layout set: the KV layer's :func:`aiokv.kv.engine_layout_check`, which
    #: :mod:`aiokv.kv` registers when imported (ConfigError if it is not). It
    #: also validates :attr:`layout` itself at construction (``check(layout, layout)``).
    layout_check: LayoutCheck | None = None
    # gc.freeze() at start: everything alive then (torch's ~170k objects, the app's) leaves
    # the collector's view, so a full collection under load scans only what came after
    # (measured: 84 ms -> 28 ms per gen-2 pass with 65k tensors held). Process-wide.
    gc_freeze: bool = True
    # the data connections' port (announced to peers in WELCOME); 0 picks a free one.
    # Fix it where a firewall or a container opens only known ports.
    data_port: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.nccl_blocking_ops, bool):
            raise ConfigError(f"nccl_blocking_ops must be a bool, got {self.nccl_blocking_ops!r}")
        for name, v in (
            ("nccl_recv_batch", self.nccl_recv_batch),
            ("nccl_recv_batch_bytes", self.nccl_recv_batch_bytes),
        ):
            if type(v) is not int or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.data_port, int) or not 0 <= self.data_port < 65536:
            raise ConfigError(f"data_port must be 0..65535, got {self.data_port!r}")
        parse_address(self.listen)
        if self.advertise is not None:
            a = self.advertise
            if not isinstance(a, str) or not a.strip("[]") or any(c in a for c in "/ \t"):
                raise ConfigError(f"advertise must be a host name or IP literal, got {a!r}")
            if is_wildcard(a):
                raise ConfigError(
                    f"advertise {a!r} is a wildcard: name the host peers reach this engine by"
                )
            if a.count(":") == 1:
                raise ConfigError(f"advertise is a host without a port, got {a!r}")
        if self.layout is not None:
            self._set_layout()
        if self.transport not in ("auto", "tcp", "nccl"):
            raise ConfigError(f"transport must be 'auto', 'tcp' or 'nccl', got {self.transport!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def _set_layout(self) -> None:
        """Store :attr:`layout` in its wire form, pick the check, validate the layout with it."""
        lay: object = self.layout
        if not isinstance(lay, dict):
            if not isinstance(lay, _HasWireForm):  # a KVLayout, or anything like one
                raise ConfigError(
                    f"layout must be a KVLayout or its to_wire() dict, got {type(lay).__name__}"
                )
            lay = lay.to_wire()
            if not isinstance(lay, dict):
                raise ConfigError(f"layout.to_wire() must give a dict, got {type(lay).__name__}")
        check = self.layout_check
        if check is None:
            # the default is the KV layer's, which registers itself when aiokv.kv is
            # imported (a KVLayout comes from there); the engine never imports aiokv.kv
            check = _DEFAULT_LAYOUT_CHECK.get("kv")
            if check is None:
                raise ConfigError(
                    "layout given without layout_check: import aiokv.kv (its "
                    "engine_layout_check is the default) or pass layout_check="
                )
        elif not callable(check):
            raise ConfigError(f"layout_check must be callable, got {type(check).__name__}")
        err = check(lay, lay)
        if err is not None:
            raise ConfigError(f"layout: {err}")
        object.__setattr__(self, "layout", dict(lay))
        object.__setattr__(self, "layout_check", check)
