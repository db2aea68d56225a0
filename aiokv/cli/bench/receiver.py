"""The receiver child of ``aiokv bench transport`` and ``aiokv bench control``:
``python -m aiokv.cli.bench.receiver --transport tcp|nccl|control ...``, spawned by the
sender (:func:`aiokv.cli.bench.common._spawn_receiver`); it exits when its parent does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from aiokv import envs
from aiokv.cli.bench.common import _run_loop, _tcp_child
from aiokv.cli.bench.transport import _nccl_child


async def _watch_parent(pid: int | None) -> None:
    """Exit the receiver if the process that started it is gone (never leave orphans)."""
    if pid is None:
        return
    while True:
        await asyncio.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


async def _child(ns: argparse.Namespace) -> None:
    slow = envs.get("AIOKV_BENCH_SLOW_CALLBACK_MS")
    if slow:  # diagnose loop stalls: asyncio logs every callback slower than this
        import logging

        logging.basicConfig(level=logging.WARNING)
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = float(slow) / 1e3
    watcher = asyncio.create_task(_watch_parent(ns.parent_pid))
    try:
        if ns.transport == "control":
            from aiokv.cli.bench.control import CHILD_OPS

            await _tcp_child(ns, CHILD_OPS)
        else:
            await (_tcp_child(ns) if ns.transport == "tcp" else _nccl_child(ns))
    finally:
        watcher.cancel()


def _receiver_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m aiokv.cli.bench.receiver")
    p.add_argument("--transport", choices=("tcp", "nccl", "control"), required=True)
    p.add_argument("--cmd-port", type=int, required=True)
    p.add_argument("--ack-port", type=int, required=True)
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--parent-pid", type=int, default=None)
    ns = p.parse_args(argv)
    try:
        _run_loop(_child(ns), ns.loop, role="receiver")
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_receiver_main(sys.argv[1:]))
