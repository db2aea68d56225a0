"""The disaggregated prefill/decode router: an OpenAI-compatible proxy with
instance discovery (register + heartbeat), eviction, xPyD selection, retries
and Prometheus metrics.

    from aiokv.router import RouterConfig, create_app, serve
    app = create_app(RouterConfig(policy="least_outstanding"))   # any ASGI server
    serve("0.0.0.0", 8000)                                         # or run it here

Endpoints: ``POST /register``, ``POST /heartbeat``, ``POST /deregister``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /instances``, ``GET /healthz``, ``GET /metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from .app import RouterConfig, RouterState, create_app
from .registry import POLICIES, Instance, NoInstanceError, Policy, Registry, UnknownModelError

__all__ = [
    "POLICIES",
    "Instance",
    "NoInstanceError",
    "Policy",
    "Registry",
    "RouterConfig",
    "RouterState",
    "UnknownModelError",
    "add_arguments",
    "config_from_args",
    "create_app",
    "main",
    "serve",
]


async def _watch_parent(pid: int) -> None:
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != pid:
            raise SystemExit(0)


async def serve_async(
    host: str = "127.0.0.1",
    port: int = 8000,
    config: RouterConfig | None = None,
    *,
    log_level: str = "info",
    ready_file: str | None = None,
    parent_pid: int | None = None,
) -> None:
    """Run the router until cancelled or signalled (SIGINT/SIGTERM).

    ``port=0`` picks a free port. ``ready_file``: once serving, the router's
    URL is written there (atomically). ``parent_pid``: exit when that
    process is no longer our parent (for supervisors that may die hard).
    """
    from ..serving import bind_socket, serve_app, socket_url

    sock = bind_socket(host, port)
    url = socket_url(sock, None if host not in ("0.0.0.0", "::") else "127.0.0.1")

    def on_started() -> None:
        logging.getLogger("aiokv.router").info("router listening on %s", url)
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(url)
            os.replace(tmp, ready_file)

    watcher = asyncio.create_task(_watch_parent(parent_pid)) if parent_pid else None
    serving = asyncio.create_task(
        serve_app(create_app(config), sock, log_level=log_level, on_started=on_started)
    )
    try:
        waiting: set[asyncio.Task[None]] = {serving} | ({watcher} if watcher else set())
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
    finally:
        for t in (watcher, serving):
            if t is not None and not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        sock.close()


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    config: RouterConfig | None = None,
    *,
    log_level: str = "info",
    ready_file: str | None = None,
    parent_pid: int | None = None,
) -> None:
    """Blocking: run the router with uvicorn on ``host:port`` (see :func:`serve_async`)."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve_async(
                host,
                port,
                config,
                log_level=log_level,
                ready_file=ready_file,
                parent_pid=parent_pid,
            )
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The router's command-line options (shared with ``aiokv router``)."""
    d = RouterConfig()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--policy", choices=POLICIES, default=d.policy)
    p.add_argument(
        "--evict-after",
        type=float,
        default=d.evict_after,
        help="seconds without heartbeat before an instance is evicted",
    )
    p.add_argument("--max-attempts", type=int, default=d.max_attempts)
    p.add_argument("--max-prompt-length", type=int, default=d.max_prompt_length)
    p.add_argument("--upstream-timeout", type=float, default=d.upstream_timeout)
    p.add_argument("--log-level", default="info")
    p.add_argument("--ready-file", default=None, help="write the router URL here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        policy=args.policy,
        evict_after=args.evict_after,
        max_attempts=args.max_attempts,
        max_prompt_length=args.max_prompt_length,
        upstream_timeout=args.upstream_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``aiokv router`` entry point."""
    p = argparse.ArgumentParser(
        prog="aiokv router", description="disaggregated prefill/decode router"
    )
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"aiokv router: {e}", file=sys.stderr)
        return 2
    serve(
        args.host,
        args.port,
        cfg,
        log_level=args.log_level,
        ready_file=args.ready_file,
        parent_pid=args.parent_pid,
    )
    return 0
