"""The ``aiokv`` command: ``demo``, ``router``, ``doctor``, ``bench transport``, ``bench kv``.

Every subcommand imports what it needs only when it runs, so ``aiokv --help``
is fast and one missing optional part (say, the router's FastAPI extra) never
breaks the others: it prints a clear error and exits 2 instead.

Environment variables: :mod:`aiokv.envs` lists every one; the entry points turn the
engine's into config fields (:func:`aiokv.envs.engine_overrides`) and apply the
process-wide switches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from aiokv import envs

__all__ = ["build_parser", "main"]


# torch warns on import when numpy is absent; aiokv does not need numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

_EXTRA_HINT = {
    "aiokv.serving.demo.run": "pip install 'aiokv[demo]'",
    "aiokv.serving.router": "pip install 'aiokv[router]'",
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
    from aiokv.cli.bench.transport import add_transport_arguments

    add_transport_arguments(
        bsub.add_parser(
            "transport",
            help="engine vs raw data plane (pyzmq / NCCL), two processes, same run",
        )
    )
    from aiokv.cli.bench.control import DESCRIPTION, TARGETS_TEXT, add_control_arguments

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
        return int(_load("aiokv.serving.demo.run", "main")(list(args.argv)) or 0)
    if cmd == "router":
        return int(_load("aiokv.serving.router", "main")(list(args.argv)) or 0)
    if cmd == "doctor":
        return int(_load("aiokv.cli.doctor", "doctor")() or 0)
    if cmd == "bench":
        if args.bench == "transport":
            from aiokv.cli.bench.transport import transport_main

            return transport_main(args)
        if args.bench == "control":
            from aiokv.cli.bench.control import control_main

            return control_main(args)
        if args.bench == "kv":
            return int(_load("aiokv.cli.bench.kv", "main")(list(args.argv), "aiokv bench kv") or 0)
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
    if envs.flag("AIOKV_DISABLE_TRITON"):
        from aiokv.kv._triton import apply_env  # imports torch: only when asked

        apply_env()
    try:
        return _run(args)
    except _MissingPart as exc:
        print(f"aiokv {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
