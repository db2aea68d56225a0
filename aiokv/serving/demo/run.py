"""``aiokv demo``: disaggregated prefill → decode of a tiny model, checked token for token.

Starts the router, one prefill and one decode worker as separate processes
(uvicorn on free loopback ports), waits until both registered, sends the
prompts through the router (streaming), checks that every output equals the
single-process :meth:`TinyTransformer.generate` computed here, prints per
request TTFT and KV transfer time/rate, and exits non-zero on any mismatch
or failure. Children are always torn down (also on Ctrl-C and errors).

CPU and TCP by default; with two or more CUDA GPUs, prefill runs on cuda:0,
decode on cuda:1, and the KV moves over the same-host IPC plane (the decode
worker copies the prefill's blocks straight into its cache, one kernel per
request; docs/ipc.md), NCCL where that does not work. ``--same-gpu`` puts both
workers on cuda:0 (IPC, else TCP: NCCL cannot put two ranks on one GPU). The
engines authenticate each other with a fresh shared secret (CURVE).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aiokv.serving.demo.model import TinyTransformer, detokenize, tokenize
from aiokv.serving.demo.worker import DEFAULT_MODEL_NAME

__all__ = ["RequestResult", "main", "make_prompts"]

_ROUTER_CODE = "import sys; from aiokv.serving.router import main; sys.exit(main(sys.argv[1:]))"
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill from decode.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "NCCL moves tensors between GPUs without touching the host.",
    "asyncio lets one thread wait on many things at once.",
]


def make_prompts(n: int) -> list[str]:
    """``n`` deterministic prompts of varied length (one to several KV blocks)."""
    return [
        f"Prompt {i}: " + " ".join(_SENTENCES[(i + k) % len(_SENTENCES)] for k in range(1 + i % 3))
        for i in range(n)
    ]


@dataclass(slots=True)
class RequestResult:
    index: int
    prompt: str
    expected: list[int]
    tokens: list[int] = field(default_factory=list)
    ttft: float | None = None
    latency: float | None = None
    transfer_seconds: float | None = None
    transfer_bytes: int | None = None
    plane: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens == self.expected


class Children:
    """Child processes started by the demo; :meth:`teardown` never leaves one behind."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[object] = []
        # the router and the workers share a fresh registration token, as a deployment would
        self.token = secrets.token_urlsafe(24)
        # ... and the KV engines a fresh CURVE secret (the IPC plane needs authenticated peers)
        self.kv_secret = secrets.token_urlsafe(32)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logdir / f"{name}.log", "wb")  # closed in teardown
        self._logs.append(log)
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            AIOKV_ROUTER_TOKEN=self.token,
            AIOKV_KV_SECRET=self.kv_secret,
        )
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children ourselves
        )
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode}\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.logdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(f"  [{name}] {line}" for line in text.splitlines()[-lines:])

    def teardown(self, grace: float = 5.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(timeout=5)
        for f in self._logs:
            close = getattr(f, "close", None)
            if close is not None:
                close()
        self._logs.clear()


async def _wait_file(path: Path, children: Children, within: float) -> str:
    deadline = time.monotonic() + within
    apath = anyio.Path(path)
    while True:
        if await apath.exists():
            return (await apath.read_text()).strip()
        children.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {within:.0f}s")
        await asyncio.sleep(0.05)


async def _wait_ready(client: httpx.AsyncClient, children: Children, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        children.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get("/healthz")
            if r.status_code == 200 and r.json().get("ready"):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not register with the router within {within:.0f}s")
        await asyncio.sleep(0.1)


async def _wait_warm(client: httpx.AsyncClient, token: str, within: float = 5.0) -> bool:
    """Wait (bounded) until every registered worker has warmed a session to a peer.

    The workers open their engine sessions as soon as the router lists their peers
    (``aiokv.serving.PeerWarmer``), which takes a few tens of milliseconds after both
    registered; waiting for it here, as a readiness probe would, keeps the first
    request from racing the warm-up. Returns False if not warm in time (the demo then
    goes on: the first request opens its sessions itself).
    """
    deadline = time.monotonic() + within
    auth = {"authorization": f"Bearer {token}"}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            listing = (await client.get("/instances", headers=auth)).json()["instances"]
            warm = [
                bool((await client.get(str(i["url"]) + "/healthz")).json().get("warm_peers"))
                for i in listing
            ]
            if warm and all(warm):
                return True
        await asyncio.sleep(0.02)
    return False


def _float(h: httpx.Headers, key: str) -> float | None:
    try:
        return float(h[key])
    except (KeyError, ValueError):
        return None


async def _one(client: httpx.AsyncClient, res: RequestResult, max_tokens: int) -> None:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "prompt": res.prompt,
        "max_tokens": max_tokens,
        "stream": True,
    }
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = (
                    f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                )
                return
            res.transfer_seconds = _float(r.headers, "x-aiokv-transfer-seconds")
            tb = _float(r.headers, "x-aiokv-transfer-bytes")
            res.transfer_bytes = int(tb) if tb is not None else None
            res.plane = r.headers.get("x-aiokv-kv-plane")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    res.error = str(data["error"].get("message"))
                    return
                if res.ttft is None:
                    res.ttft = time.perf_counter() - t0
                res.tokens.extend(data["choices"][0]["token_ids"])
    except (httpx.HTTPError, ValueError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - t0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _rate(nbytes: int | None, secs: float | None, unit: bool = True) -> str:
    if not nbytes or not secs:
        return "-"
    return f"{nbytes / secs / 1e6:.1f}" + (" MB/s" if unit else "")


def _report(console: Console, results: list[RequestResult], wall: float, mode: str) -> None:
    table = Table(title=f"aiokv demo — disaggregated prefill → decode ({mode})")
    for col, just in [
        ("#", "right"),
        ("prompt", "right"),
        ("output", "left"),
        ("TTFT ms", "right"),
        ("KV ms", "right"),
        ("KV KiB", "right"),
        ("MB/s", "right"),
        ("ok", "center"),
    ]:
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in results:
        mark = "[green]✓[/]" if r.ok else ("[red]error[/]" if r.error else "[red]✗[/]")
        table.add_row(
            str(r.index),
            str(len(tokenize(r.prompt))),
            detokenize(r.tokens)[:12] or (r.error or "")[:12],
            _ms(r.ttft),
            _ms(r.transfer_seconds),
            "-" if r.transfer_bytes is None else f"{r.transfer_bytes / 1024:.0f}",
            _rate(r.transfer_bytes, r.transfer_seconds, unit=False),
            mark,
        )
    console.print(table)
    ok = sum(r.ok for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    xfer = [r.transfer_seconds for r in results if r.transfer_seconds]
    nbytes = sum(r.transfer_bytes or 0 for r in results)
    console.print(
        f"{ok}/{len(results)} outputs equal single-process generate · wall {wall:.2f}s · "
        f"TTFT mean {_ms(statistics.fmean(ttfts) if ttfts else None)} ms, "
        f"p50 {_ms(statistics.median(ttfts) if ttfts else None)} ms · "
        f"KV moved {nbytes / 1e6:.2f} MB in {_ms(sum(xfer) if xfer else None)} ms "
        f"({_rate(nbytes, sum(xfer) if xfer else None)})"
    )
    planes = collections.Counter(r.plane or "unknown" for r in results if r.error is None)
    console.print("KV plane: " + ", ".join(f"{name}: {n}" for name, n in sorted(planes.items())))
    for r in results:
        if r.error:
            console.print(f"[red]request {r.index} failed:[/] {r.error}")
        elif not r.ok:
            console.print(
                f"[red]request {r.index} differs:[/] got {r.tokens} expected {r.expected}"
            )


async def _run(args: argparse.Namespace, children: Children, console: Console) -> int:
    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    need = 1 if args.same_gpu else 2
    if args.device == "cuda" and gpus < need:
        console.print(f"[red]--device cuda needs {need} CUDA GPU(s)[/]")
        return 2
    if args.same_gpu and gpus >= 1:
        # NCCL cannot put two ranks on one GPU: the fallback is TCP
        devices, transport, mode = ("cuda:0", "cuda:0"), "tcp", "cuda:0 → cuda:0, IPC or TCP"
    elif gpus >= 2 and not args.same_gpu:
        devices, transport, mode = ("cuda:0", "cuda:1"), "nccl", "cuda:0 → cuda:1, IPC or NCCL"
    else:
        devices, transport, mode = ("cpu", "cpu"), "tcp", "CPU, TCP"
    ref_device = devices[0]
    if args.no_ipc and devices[0] != "cpu":
        mode = mode.replace("IPC or ", "")
    pid = str(os.getpid())
    ready = children.logdir / "router.url"
    children.start(
        "router",
        [
            sys.executable,
            "-c",
            _ROUTER_CODE,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--parent-pid",
            pid,
            "--log-level",
            "warning",
            "--policy",
            args.policy,
        ],
    )
    router_url = await _wait_file(ready, children, args.startup_timeout)
    for role, dev in zip(("prefill", "decode"), devices, strict=True):
        children.start(
            role,
            [
                sys.executable,
                "-m",
                "aiokv.serving.demo.worker",
                "--role",
                role,
                "--router",
                router_url,
                "--device",
                dev,
                "--transport",
                transport,
                "--parent-pid",
                pid,
                "--log-level",
                "warning",
                *(["--no-ipc"] if args.no_ipc else []),
            ],
        )
    console.print(
        f"router {router_url} · prefill on {devices[0]} · decode on {devices[1]} · {mode}"
    )

    # the reference, computed here while the workers start
    prompts = make_prompts(args.prompts)
    model = TinyTransformer(device=ref_device)
    results = [
        RequestResult(i, p, model.generate(tokenize(p), args.max_tokens))
        for i, p in enumerate(prompts)
    ]

    timeout = httpx.Timeout(args.request_timeout, connect=5.0)
    async with httpx.AsyncClient(base_url=router_url, timeout=timeout, trust_env=False) as client:
        await _wait_ready(client, children, args.startup_timeout)
        if not await _wait_warm(client, children.token):
            console.print("[yellow]the workers did not warm their sessions in 5 s[/]")
        sem = asyncio.Semaphore(args.concurrency)
        t0 = time.perf_counter()
        with Progress(
            TextColumn("[bold]requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("requests", total=len(results))

            async def go(r: RequestResult) -> None:
                async with sem:
                    await _one(client, r, args.max_tokens)
                progress.advance(task)

            await asyncio.gather(*(go(r) for r in results))
        wall = time.perf_counter() - t0
    _report(console, results, wall, mode)
    if args.require_ipc and any(r.plane != "ipc" for r in results):
        console.print("[bold red]FAILED[/]: --require-ipc, but not every request came over IPC")
        return 1
    if all(r.ok for r in results):
        console.print(
            "[bold green]OK[/]: disaggregated outputs are identical to single-process generation"
        )
        return 0
    console.print("[bold red]FAILED[/]")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="aiokv demo", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--prompts", type=int, default=8, help="number of prompts (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: two GPUs → IPC (NCCL fallback), else CPU/TCP",
    )
    p.add_argument(
        "--same-gpu",
        action="store_true",
        help="both workers on cuda:0 (IPC between two processes on one GPU, TCP fallback)",
    )
    p.add_argument("--no-ipc", action="store_true", help="never the IPC plane (NCCL or TCP)")
    p.add_argument(
        "--require-ipc",
        action="store_true",
        help="fail unless every request's KV came over the IPC plane (a check for GPU hosts)",
    )
    p.add_argument("--policy", choices=("round_robin", "least_outstanding"), default="round_robin")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--keep-logs", action="store_true", help="keep the children's log folder")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.concurrency < 1:
        p.error("--prompts, --max-tokens and --concurrency must be >= 1")
    console = Console()
    torch.set_num_threads(1)  # same intra-op threading as the workers: bitwise-reproducible on CPU
    logdir = Path(tempfile.mkdtemp(prefix="aiokv-demo-"))
    children = Children(logdir)
    rc = 1

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # tear down like Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        rc = asyncio.run(_run(args, children, console))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        rc = 130
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as e:
        console.print(f"[red]demo failed:[/] {e}")
        for name in children.procs:
            tail = children.tail(name)
            if tail:
                console.print(tail, markup=False, highlight=False)
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        children.teardown()
        if args.keep_logs or rc not in (0, 130):
            console.print(f"logs: {logdir}")
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
