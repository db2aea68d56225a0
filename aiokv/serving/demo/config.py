"""A demo worker's configuration: :class:`WorkerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from aiokv.serving.demo.model import ModelConfig

__all__ = ["DEFAULT_MODEL_NAME", "KV_SECRET_ENV", "WorkerConfig"]


#: the environment variable holding the engines' shared CURVE secret
KV_SECRET_ENV = "AIOKV_KV_SECRET"


DEFAULT_MODEL_NAME = "aiokv-demo"


_MAX_BODY = 8 * 1024 * 1024  # above the router's default 4 MiB


def _default_model() -> ModelConfig:
    from aiokv.serving.demo.model import ModelConfig

    return ModelConfig()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Literal["prefill", "decode"]
    router_url: str | None = None
    model_name: str = DEFAULT_MODEL_NAME
    model: ModelConfig = field(default_factory=_default_model)
    device: str = "cpu"
    transport: str = "auto"
    kv_listen: str = "127.0.0.1:0"
    heartbeat_interval: float = 0.5
    kv_timeout: float = 30.0
    default_max_tokens: int = 16
    router_token: str | None = None  # default: $AIOKV_ROUTER_TOKEN
    #: host other machines reach the engine at (when it listens on a wildcard)
    advertise_host: str | None = None
    #: the engines' shared CURVE secret (default: $AIOKV_KV_SECRET; none: no CURVE)
    kv_secret: str | None = None
    #: on CUDA, the same-host IPC plane where it works (docs/ipc.md)
    ipc: bool = True
    #: a request waits this long for its KV blocks, with at most ``max_waiting`` others
    admit_timeout: float = 20.0
    max_waiting: int = 256
