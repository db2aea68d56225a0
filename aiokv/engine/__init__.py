"""The engine: the façade users hold, its client and server sessions, the receive store."""

from aiokv.engine.engine import Engine, EngineStatistics
from aiokv.engine.handle import TransferHandle

__all__ = ["Engine", "EngineStatistics", "TransferHandle"]
