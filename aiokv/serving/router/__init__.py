"""The disaggregated prefill/decode router: an OpenAI-compatible proxy that
speaks vLLM's disaggregation protocol (``kv_transfer_params``), with
authenticated registration + heartbeats, static worker lists, vLLM-style ZMQ
discovery, eviction, xPyD selection, retries and Prometheus metrics.

    from aiokv.serving.router import RouterConfig, create_app, serve
    app = create_app(RouterConfig(token=...))      # any ASGI server
    serve("0.0.0.0", 8000, RouterConfig(...))      # or run it here

    aiokv router --prefill http://p:8100 --decode http://d:8200   # vLLM workers
    AIOKV_ROUTER_TOKEN=... aiokv router --host 0.0.0.0            # registering workers

Endpoints: ``POST /register``, ``POST /heartbeat``, ``POST /deregister``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /instances``, ``GET /healthz``, ``GET /metrics``. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from aiokv import envs
from aiokv._exceptions import ConfigError
from aiokv.serving.router.config import TOKEN_ENV, RouterConfig, prefill_kv_params
from aiokv.serving.router.registry import (
    POLICIES,
    Instance,
    NoInstanceError,
    Policy,
    Registry,
    UnknownModelError,
)
from aiokv.serving.router.routes import create_app
from aiokv.serving.router.state import RouterState
from aiokv.serving.router.urls import UrlPolicy, UrlPolicyError

__all__ = [
    "POLICIES",
    "TOKEN_ENV",
    "Instance",
    "NoInstanceError",
    "Policy",
    "Registry",
    "RouterConfig",
    "RouterState",
    "UnknownModelError",
    "UrlPolicy",
    "UrlPolicyError",
    "add_arguments",
    "config_from_args",
    "create_app",
    "main",
    "prefill_kv_params",
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
    from aiokv.serving.lifespan import bind_socket, serve_app, socket_url
    from aiokv.serving.router.deadlines import deadline_protocol

    sock = bind_socket(host, port)
    wildcard = host in ("0.0.0.0", "::")
    url = socket_url(sock, None if not wildcard else ("::1" if host == "::" else "127.0.0.1"))
    app = create_app(config)
    bound = sock.getsockname()
    state: RouterState = app.state.router
    state.own_address = (str(bound[0]), int(bound[1]))
    for inst in state.registry:  # a static worker URL naming this router: refuse to start
        try:
            state.policy.check_url(inst.url, own=state.own_address)
        except UrlPolicyError as e:
            sock.close()
            raise ConfigError(f"static worker {inst.url}: {e}") from None

    def on_started() -> None:
        where = socket_url(sock)
        if wildcard:
            where += f" (every interface; {url} from this host)"
        logging.getLogger("aiokv.serving.router").info("router listening on %s", where)
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(url)
            os.replace(tmp, ready_file)

    watcher = asyncio.create_task(_watch_parent(parent_pid)) if parent_pid else None
    cfg = state.config
    serving = asyncio.create_task(
        serve_app(
            app,
            sock,
            log_level=log_level,
            on_started=on_started,
            http=deadline_protocol(cfg.header_timeout, cfg.body_timeout),
        )
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
    if log_level.lower() != "debug":
        # httpx logs every upstream request at info: two lines per proxied request
        logging.getLogger("httpx").setLevel(logging.WARNING)
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
    """The router's command-line options (``aiokv router``)."""
    d = RouterConfig()
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument(
        "--token",
        default=None,
        help=f"shared secret workers send as 'Authorization: Bearer TOKEN' to register "
        f"(default ${TOKEN_ENV}); without one, registration is accepted from loopback only",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a static prefill worker (http://host:port); repeatable",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a static decode worker (http://host:port); repeatable",
    )
    p.add_argument(
        "--discovery",
        default=None,
        metavar="HOST:PORT",
        help="bind a ZMQ ROUTER socket here for vLLM-style worker discovery "
        '(msgpack {"type": "P"|"D", "http_address", "zmq_address"})',
    )
    p.add_argument(
        "--discovery-allow-remote",
        action="store_true",
        help="accept discovery messages from non-loopback peers without the token "
        "(only on a network you trust)",
    )
    p.add_argument(
        "--allow-link-local",
        action="store_true",
        help="accept link-local and cloud-metadata worker addresses (refused by default)",
    )
    p.add_argument("--policy", choices=POLICIES, default=d.policy, help="instance selection")
    p.add_argument(
        "--evict-after",
        type=float,
        default=d.evict_after,
        help="seconds without heartbeat before an instance is evicted (default %(default)s)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=d.max_attempts,
        help="prefill/decode pairs tried per request (default %(default)s)",
    )
    p.add_argument(
        "--max-prompt-length",
        type=int,
        default=d.max_prompt_length,
        help="characters (or token ids) of a prompt (default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body (default %(default)s)",
    )
    p.add_argument(
        "--max-concurrent-per-client",
        type=int,
        default=d.max_concurrent_per_client,
        help="requests one client address may have in flight (default %(default)s)",
    )
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=d.upstream_timeout,
        help="seconds a worker may take to answer (default %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="seconds a client may take to send a request head; slower connections are "
        "closed (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        help="seconds a client may take to send a request body once its head is in; slower "
        "connections are closed (default %(default)s)",
    )
    p.add_argument(
        "--expose-topology",
        action="store_true",
        help="add the worker URLs, the KV transfer's host and port to responses "
        "(x-aiokv-prefill-url, x-aiokv-decode-url, kv_transfer_params); off by default",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning, error")
    p.add_argument("--ready-file", default=None, help="write the router URL here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        policy=args.policy,
        evict_after=args.evict_after,
        max_attempts=args.max_attempts,
        max_prompt_length=args.max_prompt_length,
        max_body_bytes=args.max_body_bytes,
        max_concurrent_per_client=args.max_concurrent_per_client,
        upstream_timeout=args.upstream_timeout,
        token=args.token or envs.get(TOKEN_ENV) or None,
        allow_link_local=args.allow_link_local,
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        discovery=args.discovery,
        discovery_allow_remote=args.discovery_allow_remote,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        expose_topology=args.expose_topology,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``aiokv router`` entry point."""
    p = argparse.ArgumentParser(
        prog="aiokv router",
        description="Disaggregated prefill/decode router: an OpenAI-compatible proxy speaking "
        "vLLM's disaggregation protocol (kv_transfer_params), for vLLM instances and aiokv "
        "workers alike. Workers are listed here (--prefill/--decode), register over HTTP, or "
        "announce themselves over ZMQ (--discovery).",
        epilog="Guide: docs/serving.md ('Serving with the router').",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"aiokv router: {e}", file=sys.stderr)
        return 2
    try:
        serve(
            args.host,
            args.port,
            cfg,
            log_level=args.log_level,
            ready_file=args.ready_file,
            parent_pid=args.parent_pid,
        )
    except (ConfigError, OSError) as e:
        print(f"aiokv router: {e}", file=sys.stderr)
        return 2
    return 0
