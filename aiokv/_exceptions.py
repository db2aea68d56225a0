"""The whole error tree of aiokv.

Every exception aiokv raises through its public API derives from
:class:`AiokvError`; no zmq, msgpack or ctypes exception escapes. Where a
standard library base is natural it is a second base, so ``except
TimeoutError`` and ``except ConnectionError`` work as expected::

    AiokvError
    ├── ConfigError (ValueError)             bad EngineConfig / arguments
    ├── EngineClosedError                    the engine is closed or closing
    ├── UsageError (RuntimeError)            a call the engine cannot take from here (another loop)
    ├── ProtocolError
    │   ├── LocalProtocolError               we were asked to do something illegal
    │   └── RemoteProtocolError              the peer sent something malformed or illegal
    ├── AiokvTimeoutError (TimeoutError)
    │   ├── ConnectTimeoutError              session set-up did not finish in time
    │   ├── NegotiateTimeoutError            no grant from the receiver in time
    │   └── TransferTimeoutError             data did not land / tensor did not arrive in time
    ├── PeerError (ConnectionError)
    │   ├── ConnectError                     could not establish a session
    │   └── PeerLostError                    heartbeat lost / peer gone mid-transfer
    ├── TransferError
    │   ├── RefusedError                     receiver refused; ``.code`` says why
    │   │   ├── DuplicateTensorError         the tensor id is already held or pending
    │   │   └── LayoutMismatchError          KV layouts of the two sides are incompatible
    │   ├── ExpiredError                     collected after the tensor's TTL ran out
    │   ├── NotPublishedError                GET for an id the producer does not publish
    │   └── TransferAbortedError             the transport (e.g. an NCCL communicator) was aborted
    ├── IpcUnavailableError                  CUDA IPC cannot serve this peer (``.reason``)
    └── NcclError                            an NCCL call failed; ``.code`` and ``.code_name``
        └── NcclUnavailableError             no NCCL library could be loaded
"""

from __future__ import annotations

__all__ = [
    "AiokvError",
    "AiokvTimeoutError",
    "ConfigError",
    "ConnectError",
    "ConnectTimeoutError",
    "DuplicateTensorError",
    "EngineClosedError",
    "ExpiredError",
    "IpcUnavailableError",
    "LayoutMismatchError",
    "LocalProtocolError",
    "NcclError",
    "NcclUnavailableError",
    "NegotiateTimeoutError",
    "NotPublishedError",
    "PeerError",
    "PeerLostError",
    "ProtocolError",
    "RefusedError",
    "RemoteProtocolError",
    "TransferAbortedError",
    "TransferError",
    "TransferTimeoutError",
    "UsageError",
]


class AiokvError(Exception):
    """Base of every error aiokv raises."""


class ConfigError(AiokvError, ValueError):
    """An invalid configuration value or argument."""


class EngineClosedError(AiokvError):
    """The engine is closed (or closing) and cannot take this operation."""


class UsageError(AiokvError, RuntimeError):
    """A call the engine cannot take from where it was made: from an event loop (or a
    thread) other than the one that started it. Nothing was done; the engine is unharmed."""


class ProtocolError(AiokvError):
    """A violation of the aiokv wire protocol."""


class LocalProtocolError(ProtocolError):
    """This side attempted an operation the protocol state does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent malformed bytes, an unknown message or an illegal transition."""


class AiokvTimeoutError(AiokvError, TimeoutError):
    """A deadline passed."""


class ConnectTimeoutError(AiokvTimeoutError):
    """The session with a peer was not established before its deadline."""


class NegotiateTimeoutError(AiokvTimeoutError):
    """The receiver did not grant room for a transfer before its deadline."""


class TransferTimeoutError(AiokvTimeoutError):
    """Data did not land (or a tensor did not arrive) before the deadline."""


class PeerError(AiokvError, ConnectionError):
    """A problem with the connection to a peer."""


class ConnectError(PeerError):
    """A session with the peer could not be established."""


class PeerLostError(PeerError):
    """The peer stopped answering (heartbeat) or went away mid-transfer."""


class TransferError(AiokvError):
    """A transfer could not be completed."""


class RefusedError(TransferError):
    """The receiver refused the transfer. ``code`` is the wire reason code."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


class DuplicateTensorError(RefusedError):
    """A tensor with this id from this peer is already held or in flight."""


class LayoutMismatchError(RefusedError):
    """Producer and consumer KV-cache layouts are incompatible."""


class ExpiredError(TransferError):
    """The tensor arrived but was not collected before its TTL; it is gone."""


class NotPublishedError(TransferError):
    """A GET named a tensor id the producer does not publish."""


class TransferAbortedError(TransferError):
    """The data plane for this peer was aborted while the transfer was in flight."""


class IpcUnavailableError(AiokvError):
    """The KV layer's IPC plane cannot be used with this peer; the request falls back to
    the ordinary transport (``reason`` says why, and names its fallback counter)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"CUDA IPC unavailable: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


class NcclError(AiokvError):
    """An NCCL call returned an error."""

    def __init__(self, message: str, code: int = -1, code_name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.code_name = code_name


class NcclUnavailableError(NcclError):
    """No NCCL/RCCL shared library could be loaded; the message lists what was tried."""
