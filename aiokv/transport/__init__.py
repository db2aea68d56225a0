"""Data planes. Each implements the small interface in :mod:`.base`."""

from .base import (
    DeviceSink,
    DeviceSource,
    MessageSink,
    MessageSource,
    SettleCounters,
    SinkLink,
    SourceLink,
)
from .tcp import TcpSink, TcpSource

__all__ = [
    "DeviceSink",
    "DeviceSource",
    "MessageSink",
    "MessageSource",
    "SettleCounters",
    "SinkLink",
    "SourceLink",
    "TcpSink",
    "TcpSource",
]
