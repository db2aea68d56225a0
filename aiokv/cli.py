"""The ``aiokv`` command: ``demo``, ``router``, ``doctor``, ``bench transport``, ``bench kv``.

Every subcommand imports what it needs only when it runs, so ``aiokv --help``
is fast and one missing optional part (say, the router's FastAPI extra) never
breaks the others: it prints a clear error and exits 2 instead.

Environment variables are read here and by the other command-line entry points
(benchmarks, demo worker, router) only; the library takes every knob as an
argument. :func:`engine_overrides` turns the engine's variables into
:class:`~aiokv.EngineConfig` fields and :func:`apply_process_env` applies the
process-wide switches:

``AIOKV_NCCL_BLOCKING_OPS=1``
    ``EngineConfig.nccl_blocking_ops=True``
``AIOKV_NCCL_RECV_BATCH="count,MiB"``
    ``EngineConfig.nccl_recv_batch`` / ``nccl_recv_batch_bytes``
``AIOKV_DISABLE_TRITON=1``
    :func:`aiokv.kv.set_triton` ``(False)``: the torch-ops copies instead of the Triton kernels
``AIOKV_TRACE=prefix``
    read by :mod:`aiokv._trace` itself at import (see there why); ``aiokv._trace.enable``
    does the same from code
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "ENV_DISABLE_TRITON",
    "ENV_NCCL_BLOCKING_OPS",
    "ENV_NCCL_RECV_BATCH",
    "apply_process_env",
    "build_parser",
    "engine_overrides",
    "main",
    "parse_recv_batch",
]

ENV_NCCL_BLOCKING_OPS = "AIOKV_NCCL_BLOCKING_OPS"
ENV_NCCL_RECV_BATCH = "AIOKV_NCCL_RECV_BATCH"
ENV_DISABLE_TRITON = "AIOKV_DISABLE_TRITON"


def parse_recv_batch(raw: str) -> tuple[int, int]:
    """``"count,MiB"`` (e.g. ``"8,128"``) as ``(transfers, bytes)``. Raises ConfigError."""
    from ._exceptions import ConfigError

    try:
        count_s, mib_s = raw.split(",")
        count, mib = int(count_s), float(mib_s)
    except ValueError:
        raise ConfigError(
            f'{ENV_NCCL_RECV_BATCH} must be "count,MiB" (e.g. "8,128"), got {raw!r}'
        ) from None
    if count < 1 or not mib > 0:
        raise ConfigError(f"{ENV_NCCL_RECV_BATCH}: count >= 1 and MiB > 0, got {raw!r}")
    return count, max(1, int(mib * (1 << 20)))


def engine_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :class:`~aiokv.EngineConfig` fields the environment sets (``os.environ`` by default).

    For entry points: ``EngineConfig(..., **engine_overrides())``. Unset variables set
    nothing, so the config's own defaults apply.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    blocking = env.get(ENV_NCCL_BLOCKING_OPS, "").strip()
    if blocking:
        out["nccl_blocking_ops"] = blocking == "1"
    batch = env.get(ENV_NCCL_RECV_BATCH, "").strip()
    if batch:
        out["nccl_recv_batch"], out["nccl_recv_batch_bytes"] = parse_recv_batch(batch)
    return out


def apply_process_env(environ: Mapping[str, str] | None = None) -> None:
    """Apply the process-wide switches the environment sets (``AIOKV_DISABLE_TRITON``)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_DISABLE_TRITON, "") not in ("", "0"):
        from .kv._triton import set_enabled  # imported only when asked: it needs torch

        set_enabled(False)


# torch warns on import when numpy is absent; aiokv does not need numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

_EXTRA_HINT = {
    "aiokv.demo.run": "pip install 'aiokv[demo]'",
    "aiokv.router": "pip install 'aiokv[router]'",
}


class _MissingPart(Exception):
    pass


def _load(module: str, attr: str) -> Callable[..., Any]:
    """Import ``module.attr`` lazily, turning an ImportError into a clear message."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        hint = _EXTRA_HINT.get(module)
        more = f" (try: {hint})" if hint else ""
        raise _MissingPart(f"{module} is not available: {exc}{more}") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise _MissingPart(f"{module} has no {attr}(); this aiokv build lacks that command")
    return fn  # type: ignore[no-any-return]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("aiokv")
    except Exception:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``aiokv`` (exposed for tests and docs)."""
    p = argparse.ArgumentParser(
        prog="aiokv",
        description="asyncio-native KV-cache and tensor transfer between processes "
        "(NCCL on GPUs, TCP on CPU)",
    )
    p.add_argument("--version", action="version", version=f"aiokv {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="disaggregated prefill -> decode of a tiny model, checked token for token",
        add_help=False,
    )
    demo.add_argument("argv", nargs="*", help="arguments of the demo (see 'aiokv demo --help')")

    router = sub.add_parser(
        "router",
        help="run the disaggregated prefill/decode router (see 'aiokv router --help')",
        add_help=False,
    )
    router.add_argument("argv", nargs="*", help="arguments of the router")

    sub.add_parser("doctor", help="what this machine offers aiokv (torch, CUDA, GPUs, NCCL)")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", metavar="WHAT")
    bsub.required = True
    from .bench import add_transport_arguments

    add_transport_arguments(
        bsub.add_parser(
            "transport",
            help="engine vs raw data plane (pyzmq / NCCL), two processes, same run",
        )
    )
    from .bench_control import DESCRIPTION, TARGETS_TEXT, add_control_arguments

    add_control_arguments(
        bsub.add_parser(
            "control",
            help="engine control path vs raw zmq.asyncio (CPU, loopback)",
            description=DESCRIPTION,
            epilog=TARGETS_TEXT,
        )
    )
    kv = bsub.add_parser(
        "kv", help="KV-cache workloads (see 'aiokv bench kv --help')", add_help=False
    )
    kv.add_argument("argv", nargs="*")
    return p


def _run(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "demo":
        return int(_load("aiokv.demo.run", "main")(list(args.argv)) or 0)
    if cmd == "router":
        return int(_load("aiokv.router", "main")(list(args.argv)) or 0)
    if cmd == "doctor":
        return int(_load("aiokv.doctor", "doctor")() or 0)
    if cmd == "bench":
        if args.bench == "transport":
            from .bench import transport_main

            return transport_main(args)
        if args.bench == "control":
            from .bench_control import control_main

            return control_main(args)
        if args.bench == "kv":
            return int(_load("aiokv.kv.bench", "main")(list(args.argv), "aiokv bench kv") or 0)
    raise AssertionError(f"unhandled command {cmd!r}")  # pragma: no cover


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aiokv`` console script; returns the exit status."""
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Pass-through commands hand every later argument (``--help`` included) to their own parser.
    if raw[:1] in (["demo"], ["router"]):
        args = argparse.Namespace(command=raw[0], argv=raw[1:])
    elif raw[:2] == ["bench", "kv"]:
        args = argparse.Namespace(command="bench", bench="kv", argv=raw[2:])
    else:
        args = parser.parse_args(raw)
    if args.command is None:
        parser.print_help()
        return 2
    apply_process_env()
    try:
        return _run(args)
    except _MissingPart as exc:
        print(f"aiokv {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
