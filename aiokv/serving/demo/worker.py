"""A prefill or decode worker serving the demo model over an OpenAI-style API.

    python -m aiokv.serving.demo.worker --role prefill --router http://127.0.0.1:8000
    python -m aiokv.serving.demo.worker --role decode  --router http://127.0.0.1:8000

The app's lifespan starts an :class:`aiokv.Engine` over the model's paged
cache and keeps the worker registered with the router (:mod:`aiokv.serving`;
the router token comes from ``--router-token`` or ``$AIOKV_ROUTER_TOKEN``).

The worker speaks vLLM's disaggregation contract, so the router treats it
like a vLLM instance running NixlConnector. ``kv_transfer_params`` in a
request body select the leg:

``{"do_remote_decode": true, ...}`` (prefill, sent with ``max_tokens: 1``)
    prefill the prompt, keep its KV blocks and hold them for the decode side to
    pull (:meth:`aiokv.kv.KVConnector.serve_request`), and answer with the first
    token and ``kv_transfer_params`` ``{do_remote_prefill: true, do_remote_decode:
    false, remote_engine_id, remote_host, remote_port (the engine's address),
    remote_block_ids, remote_request_id, num_tokens, num_blocks, first_token,
    transfer_bytes, prefill_seconds}``. The blocks are freed once the decode side
    has them, when it declines them (it refused the request: it GETs the
    request's ``"#decline"`` ticket), or after ``kv_timeout`` seconds.
``{"do_remote_prefill": true, "remote_host", "remote_port", ...}`` (decode)
    allocate blocks, fetch the KV from the prefill's engine straight into them
    (:meth:`~aiokv.kv.KVConnector.fetch_request`), decode greedily (SSE when
    ``stream`` is true). The response carries ``x-aiokv-transfer-seconds`` /
    ``x-aiokv-transfer-bytes`` / ``x-aiokv-kv-plane`` (``ipc`` or ``engine``) headers.

On CUDA the connector uses the same-host IPC plane (docs/ipc.md) where it works
(both workers on one host, authenticated engines: ``--kv-secret`` or
``$AIOKV_KV_SECRET``, the same on both), else the engine's transport (NCCL or
TCP). ``--no-ipc`` turns the plane off.

The request id is the ``X-Request-Id`` header (one is made up without it).
Without ``kv_transfer_params`` the worker serves the request on its own.
Every response choice carries ``token_ids`` (the toy tokenizer is lossy).

Admission is by KV blocks: a request takes every block it will need (prompt and
``max_tokens``) before it computes, so a stream never runs out midway. When they are
not free it waits, first come first served, up to ``admit_timeout`` seconds with at
most ``max_waiting`` others, then gets 503 ``out_of_kv_blocks`` with ``Retry-After``
(the router takes that as load, not failure). A request that needs more blocks than
the cache has gets 400. A stream that fails midway ends with an error event and
``[DONE]``.
Model compute runs on one dedicated thread, so the event loop never blocks.
torch is imported only when the worker starts, so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from aiokv import envs
from aiokv.envs import engine_overrides
from aiokv.kv._triton import apply_env as apply_process_env
from aiokv.serving.demo.admission import _Admission
from aiokv.serving.demo.config import DEFAULT_MODEL_NAME, KV_SECRET_ENV, WorkerConfig
from aiokv.serving.demo.node import _Worker

__all__ = ["DEFAULT_MODEL_NAME", "KV_SECRET_ENV", "WorkerConfig", "create_app", "main"]

log = logging.getLogger("aiokv.serving.demo.worker")


def create_app(cfg: WorkerConfig, url: str = "") -> FastAPI:
    """The worker app; ``url`` is this worker's own base URL as the router should call it."""
    w = _Worker(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import aiokv
        from aiokv.kv import FlashAttentionLayout, IpcOptions, KVConnector
        from aiokv.serving.lifespan import worker_lifespan

        mc = cfg.model
        w.model = await w.run(w.mod.TinyTransformer, mc, cfg.device)
        w.layout = FlashAttentionLayout(
            num_layers=mc.num_layers,
            num_blocks=mc.num_blocks,
            block_size=mc.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype="float32",
        )
        await w.run(w.warm_model)
        w.admission = _Admission(
            w.m.allocator, w.mod.OutOfBlocksError, cfg.max_waiting, cfg.admit_timeout
        )
        # the layout is offered at connection set-up: incompatible peers are refused early
        secret = cfg.kv_secret if cfg.kv_secret is not None else envs.get(KV_SECRET_ENV) or None
        engine_cfg = aiokv.EngineConfig(
            listen=cfg.kv_listen,
            device=cfg.device,
            transport=cfg.transport,
            layout=w.layout.to_wire(),
            curve=aiokv.CurveConfig.from_secret(secret) if secret else None,
            **engine_overrides(),
        )

        use_ipc = cfg.ipc and w.m.device.type == "cuda"

        async def on_engine(engine: Any) -> None:
            w.engine = engine
            w.con = KVConnector(
                engine, w.layout, w.m.kv_caches, ipc=IpcOptions() if use_ipc else None
            )

        async def prepare(peer: str) -> None:
            # a decode worker maps each prefill's cache as soon as the router lists it
            # (IPC plane), so the first request does not wait for that
            if await w.con.prepare(peer):
                log.info("IPC plane: %s's cache mapped ahead", peer)

        try:
            async with worker_lifespan(
                engine_cfg,
                router_url=cfg.router_url,
                role=cfg.role,
                url=url,
                model=cfg.model_name,
                heartbeat_interval=cfg.heartbeat_interval,
                on_engine=on_engine,
                token=cfg.router_token,
                max_model_len=mc.max_positions,
                kv_host=cfg.advertise_host,
                after_connect=prepare if use_ipc and cfg.role == "decode" else None,
            ) as handle:
                w.warmer = handle.warmer
                log.info("%s worker up: http %s, kv %s", cfg.role, url, w.engine.address)
                try:
                    yield
                finally:
                    for t in list(w.serving):
                        t.cancel()
                    await asyncio.gather(*w.serving, return_exceptions=True)
                    await w.con.aclose()
        finally:
            w.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title=f"aiokv demo {cfg.role} worker", lifespan=lifespan)
    app.state.worker = w

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await w.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await w.handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model_name,
                        "object": "model",
                        "owned_by": "aiokv",
                        "max_model_len": cfg.model.max_positions,
                    }
                ],
            }
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "role": cfg.role,
                "kv_address": w.kv_address if w.engine else None,
                "free_blocks": w.m.allocator.num_free,
                "warm_peers": w.warmer.warm_peers if w.warmer is not None else [],
            }
        )

    @app.get("/stats")
    async def stats() -> Response:
        st = w.engine.statistics() if w.engine is not None else None
        data: dict[str, Any] = {}
        if st is not None:
            import dataclasses

            data = {
                k: v for k, v in dataclasses.asdict(st).items() if isinstance(v, (int, float, str))
            }
        adm = w.admission
        kv_blocks = (
            {
                "total": adm.allocator.num_blocks,
                "free": adm.allocator.num_free,
                "waiting": len(adm.waiters),
                "waited": adm.waited,
                "refused": adm.refused,
            }
            if adm is not None
            else {}
        )
        return JSONResponse({"role": cfg.role, "engine": data, "kv_blocks": kv_blocks})

    return app


async def _watch_parent(pid: int) -> None:
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != pid:
            break
    log.warning("parent %d is gone; exiting", pid)


async def _amain(args: argparse.Namespace) -> None:
    from aiokv.serving.lifespan import bind_socket, serve_app, socket_url

    sock = bind_socket(args.host, args.port)
    url = socket_url(sock, args.advertise_host)
    cfg = WorkerConfig(
        role=args.role,
        router_url=args.router,
        model_name=args.model_name,
        device=args.device,
        transport=args.transport,
        kv_listen=args.kv_listen or f"{args.host}:0",
        heartbeat_interval=args.heartbeat_interval,
        router_token=args.router_token,
        advertise_host=args.advertise_host,
        kv_secret=args.kv_secret,
        ipc=not args.no_ipc,
    )

    def on_started() -> None:
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(url)
            os.replace(tmp, args.ready_file)

    tasks = [
        asyncio.create_task(
            serve_app(create_app(cfg, url), sock, log_level=args.log_level, on_started=on_started)
        )
    ]
    if args.parent_pid:
        tasks.append(asyncio.create_task(_watch_parent(args.parent_pid)))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        sock.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aiokv.serving.demo.worker",
        description="A prefill or decode worker of the aiokv demo model: an OpenAI-style "
        "HTTP server (/v1/completions, /v1/chat/completions) with an aiokv engine that "
        "moves the KV cache to the decode side. It registers with the router when "
        "--router is given; the router may also list it with --prefill/--decode.",
    )
    p.add_argument(
        "--role", choices=("prefill", "decode"), required=True, help="which leg this worker serves"
    )
    p.add_argument(
        "--router", default=None, metavar="URL", help="router base URL to register with (optional)"
    )
    p.add_argument(
        "--router-token",
        default=None,
        metavar="TOKEN",
        help="the router's registration token (default $AIOKV_ROUTER_TOKEN)",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free one)")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host other machines reach this worker (HTTP and KV engine) at; needed when "
        "--host is a wildcard such as 0.0.0.0 (default: the listen address; the KV engine "
        "of a wildcard listen announces the host's outward address)",
    )
    p.add_argument(
        "--kv-listen",
        default=None,
        metavar="HOST:PORT",
        help="the engine's listen address for KV transfers (default HOST:0)",
    )
    p.add_argument(
        "--model-name", default=DEFAULT_MODEL_NAME, help="model name served (default %(default)s)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default %(default)s)")
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "tcp", "nccl"),
        help="KV transport: auto picks NCCL for CUDA tensors when both sides can",
    )
    p.add_argument(
        "--kv-secret",
        default=None,
        metavar="SECRET",
        help="shared secret of the KV engines (CURVE authentication and encryption; at least "
        f"16 bytes, the same on every worker; default ${KV_SECRET_ENV}, unset: none). The "
        "same-host IPC plane is used only between authenticated engines",
    )
    p.add_argument(
        "--no-ipc",
        action="store_true",
        help="on CUDA, never use the same-host IPC plane (NCCL or TCP only)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.5,
        help="seconds between heartbeats to the router (default %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 = reproducible)"
    )
    p.add_argument("--ready-file", default=None, help="write this worker's URL here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--log-level",
        default="warning",
        help="debug, info, warning, error (heartbeats are logged at debug)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.log_level.lower() != "debug":
        # httpx logs every request at info, heartbeats included
        logging.getLogger("httpx").setLevel(logging.WARNING)
    import torch

    apply_process_env()
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
