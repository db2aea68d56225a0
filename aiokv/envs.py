"""Every ``AIOKV_*`` environment variable aiokv reads, in one table.

The library takes its knobs as arguments (:class:`~aiokv.EngineConfig`, the router's and
the demo's configs); environment variables exist for the command-line entry points and
for the few process-wide switches that have to act before any code runs (tracing). Each
variable is declared here once, with its meaning; code reads it through :func:`get` or
:func:`flag`, never through ``os.environ`` directly, and docs/api.md's table is checked
against :data:`VARIABLES` by the test suite.

see :data:`VARIABLES`                      :func:`get` / :func:`flag` / :func:`engine_overrides`
========================================  ===========================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiokv._exceptions import ConfigError

__all__ = [
    "VARIABLES",
    "EnvVar",
    "engine_overrides",
    "flag",
    "get",
    "parse_recv_batch",
]


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, who reads it, and what it means."""

    name: str
    #: who reads it: ``"engine"`` (through :func:`engine_overrides` at the entry points),
    #: ``"process"`` (a process-wide switch), ``"serving"``, ``"bench"``
    scope: str
    doc: str


#: every variable aiokv reads, by name
VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "AIOKV_NCCL_SO_PATH",
            "process",
            "the NCCL/RCCL library to load: a file, or a folder holding the backend's soname "
            "(default: the NCCL that torch ships, then the system's soname)",
        ),
        EnvVar(
            "AIOKV_NCCL_BLOCKING_OPS",
            "engine",
            "``1``: EngineConfig.nccl_blocking_ops=True (NCCL calls block in a worker thread "
            "instead of being polled); ``0``: False",
        ),
        EnvVar(
            "AIOKV_NCCL_RECV_BATCH",
            "engine",
            '``"count,MiB"`` (e.g. ``"8,128"``): EngineConfig.nccl_recv_batch / '
            "nccl_recv_batch_bytes",
        ),
        EnvVar(
            "AIOKV_DISABLE_TRITON",
            "process",
            "``1``: the KV copies use torch ops instead of the Triton kernels "
            "(as :func:`aiokv.kv.set_triton` ``(False)``); applied by the entry points",
        ),
        EnvVar(
            "AIOKV_TRACE",
            "process",
            "a path prefix: record the engine's transfer steps and write "
            "``<prefix>.<pid>.json`` at exit (read at import, so it covers start-up)",
        ),
        EnvVar(
            "AIOKV_IPC_TRACE",
            "process",
            "``1``: the IPC plane stamps its stages (``aiokv bench kv --transport ipc`` "
            "reports them); read at import",
        ),
        EnvVar(
            "AIOKV_ROUTER_TOKEN",
            "serving",
            "the router's shared bearer token: the router requires it, workers send it "
            "(default of ``--token`` / ``--router-token`` / WorkerRegistration.token)",
        ),
        EnvVar(
            "AIOKV_KV_SECRET",
            "serving",
            "the demo workers' shared CURVE secret (default of ``--kv-secret``)",
        ),
        EnvVar(
            "AIOKV_BENCH_PROFILE",
            "bench",
            "a folder: ``aiokv bench transport`` writes a cProfile of each process there",
        ),
        EnvVar(
            "AIOKV_BENCH_SLOW_CALLBACK_MS",
            "bench",
            "milliseconds: ``aiokv bench transport`` runs asyncio in debug mode and logs "
            "callbacks slower than this",
        ),
    )
}


def get(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of the registered variable ``name``, stripped; ``""`` when unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a registered aiokv variable (see aiokv._env)")
    env = os.environ if environ is None else environ
    return env.get(name, "").strip()


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when the registered variable ``name`` is set to anything but ``""`` or ``"0"``."""
    return get(name, environ) not in ("", "0")


def parse_recv_batch(raw: str) -> tuple[int, int]:
    """``"count,MiB"`` (e.g. ``"8,128"``) as ``(transfers, bytes)``. Raises ConfigError."""
    try:
        count_s, mib_s = raw.split(",")
        count, mib = int(count_s), float(mib_s)
    except ValueError:
        raise ConfigError(
            f'AIOKV_NCCL_RECV_BATCH must be "count,MiB" (e.g. "8,128"), got {raw!r}'
        ) from None
    if count < 1 or not mib > 0:
        raise ConfigError(f"AIOKV_NCCL_RECV_BATCH: count >= 1 and MiB > 0, got {raw!r}")
    return count, max(1, int(mib * (1 << 20)))


def engine_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :class:`~aiokv.EngineConfig` fields the environment sets (``os.environ`` by default).

    For entry points: ``EngineConfig(..., **engine_overrides())``. Unset variables set
    nothing, so the config's own defaults apply.
    """
    out: dict[str, Any] = {}
    blocking = get("AIOKV_NCCL_BLOCKING_OPS", environ)
    if blocking:
        out["nccl_blocking_ops"] = blocking == "1"
    batch = get("AIOKV_NCCL_RECV_BATCH", environ)
    if batch:
        out["nccl_recv_batch"], out["nccl_recv_batch_bytes"] = parse_recv_batch(batch)
    return out
