"""Serving: lifespan helpers for a worker, the router and the demo."""

from aiokv.serving.lifespan import (
    TOKEN_ENV,
    PeerWarmer,
    WorkerHandle,
    WorkerRegistration,
    bind_socket,
    deregister,
    register_with_router,
    serve_app,
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
    "worker_lifespan",
]
