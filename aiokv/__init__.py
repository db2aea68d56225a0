"""aiokv: asyncio-native KV-cache and tensor transfer between serving processes.

The public names are imported on first use (module ``__getattr__``), so that
``import aiokv.serving.router`` or ``aiokv --help`` does not pay for importing torch.
The public subpackages load the same way: after ``import aiokv``,
``aiokv.kv.KVConnector`` and ``aiokv.serving.PeerWarmer`` work as written.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._exceptions import *  # noqa: F403
from ._exceptions import __all__ as _exc_all

if TYPE_CHECKING:
    from aiokv.engine import Engine, EngineStatistics, TransferHandle

    from ._config import CurveConfig, EngineConfig, LayoutCheck, Limits, Timeouts

__version__ = "0.1.0"

__all__ = [
    "CurveConfig",
    "Engine",
    "EngineConfig",
    "EngineStatistics",
    "LayoutCheck",
    "Limits",
    "Timeouts",
    "TransferHandle",
    "__version__",
    *_exc_all,
]

_LAZY = {
    "CurveConfig": "._config",
    "EngineConfig": "._config",
    "LayoutCheck": "._config",
    "Limits": "._config",
    "Timeouts": "._config",
    "Engine": ".engine",
    "EngineStatistics": ".engine",
    "TransferHandle": ".engine",
}
_SUBMODULES = frozenset(
    {"cli", "engine", "envs", "gpu", "kv", "protocol", "serving", "transport", "vllm"}
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # binds itself as an attribute
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiokv' has no attribute {name!r}")
    value = vars(importlib.import_module(module, __name__))[name]
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
