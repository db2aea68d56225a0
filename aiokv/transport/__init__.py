"""Data planes. Each implements the small interface in :mod:`.base`."""

from .base import SinkLink, SourceLink
from .tcp import TcpSink, TcpSource

__all__ = ["SinkLink", "SourceLink", "TcpSink", "TcpSource"]
