"""Serving: lifespan helpers for a worker, the router and the demo.

The subpackages load on first use (module ``__getattr__``): after ``import aiokv``,
``aiokv.serving.router.create_app`` works as written, and importing the lifespan helpers
does not import the router's or the demo's dependencies.
"""

import importlib
from typing import Any

from aiokv.serving.lifespan import (
    TOKEN_ENV,
    PeerWarmer,
    WorkerHandle,
    WorkerRegistration,
    bind_socket,
    deregister,
    register_with_router,
    serve_app,
    socket_url,
    worker_lifespan,
)

__all__ = [
    "TOKEN_ENV",
    "PeerWarmer",
    "WorkerHandle",
    "WorkerRegistration",
    "bind_socket",
    "deregister",
    "register_with_router",
    "serve_app",
    "socket_url",
    "worker_lifespan",
]

_SUBPACKAGES = frozenset({"demo", "router"})


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)  # binds itself as an attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
