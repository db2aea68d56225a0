"""Same-host data plane of the KV connector: CUDA IPC between the processes of one host.

A :class:`~aiokv.kv.KVConnector` given ``ipc=IpcOptions(...)`` builds an
:class:`IpcPlane`; docs/ipc.md has the design, the wire messages, the safety rules and
the package's structure. Public here: the options and statistics
(:mod:`aiokv.kv.ipc.options`, also exported from :mod:`aiokv.kv`), the interfaces
between the plane and the connector (:mod:`aiokv.kv.ipc.interfaces`), the lease's state
table (:mod:`aiokv.kv.ipc.lease`), the wire messages and the plane itself.
"""

from __future__ import annotations

from ..._exceptions import IpcUnavailableError
from ._common import (
    HELLO,
    PREPARE_RID,
    ControlChannel,
    EngineChannel,
    check_same_host,
    take_trace,
    unsupported_reason,
)
from ._doctor import doctor_report
from ._plane import IpcPlane
from ._wire import (
    LAYERS,
    Descriptor,
    Offer,
    Release,
    StorageExport,
    decode_message,
    encode_message,
)
from ._wire_layers import LayerReady
from .options import IpcOptions, IpcStatistics

__all__ = [
    "HELLO",
    "LAYERS",
    "PREPARE_RID",
    "ControlChannel",
    "Descriptor",
    "EngineChannel",
    "IpcOptions",
    "IpcPlane",
    "IpcStatistics",
    "IpcUnavailableError",
    "LayerReady",
    "Offer",
    "Release",
    "StorageExport",
    "check_same_host",
    "decode_message",
    "doctor_report",
    "encode_message",
    "take_trace",
    "unsupported_reason",
]
