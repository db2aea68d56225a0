"""The engine: the façade users hold, its client and server sessions, the receive store."""

from aiokv.engine.client import TransferHandle
from aiokv.engine.engine import Engine, EngineStatistics

__all__ = ["Engine", "EngineStatistics", "TransferHandle"]
