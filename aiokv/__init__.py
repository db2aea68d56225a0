"""aiokv: asyncio-native KV-cache and tensor transfer between serving processes."""

from ._config import CurveConfig, EngineConfig, Limits, Timeouts
from ._exceptions import *  # noqa: F403
from ._exceptions import __all__ as _exc_all
from .engine import Engine, EngineStatistics, TransferHandle

__version__ = "0.1.0"

__all__ = [
    "CurveConfig",
    "Engine",
    "EngineConfig",
    "EngineStatistics",
    "Limits",
    "Timeouts",
    "TransferHandle",
    "__version__",
    *_exc_all,
]
