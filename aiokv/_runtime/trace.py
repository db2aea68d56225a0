"""Opt-in timeline of each transfer's steps, for finding where latency goes.

Set ``AIOKV_TRACE=/some/prefix`` before the process starts (or call
:func:`enable` before the first transfer): every engine in the process then records ``(step, client engine id, transfer, time)`` at the
steps below, and the process writes them to ``/some/prefix.<pid>.json`` when
it exits. Times are
``time.perf_counter()`` (CLOCK_MONOTONIC on Linux), so the files of two
processes on one host share a time base; transfer numbers are the client's,
which the server sees in RESERVE, so both ends join on them
(``benchmarks/trace_report.py``). Off by default: each call site is one bool test.

Client steps: ``start`` (RESERVE queued), ``grant`` (GRANT received),
``posted`` (data handed to the transport), ``done`` (DONE received).
Server steps: ``reserve`` (RESERVE received), ``granted`` (GRANT queued),
``landed`` (data complete in the store).

Why this one knob is still read from the environment by the library (every other
is an argument; see docs/design.md, "Engine structure"): a trace is wanted in every
process of a run at once -- benchmark children spawned by ``multiprocessing``, test
subprocesses, a user's own two scripts -- none of which pass aiokv's command line, and
it costs one module-level bool test per step when off. It changes no behaviour, only
records times.
"""

from __future__ import annotations

import atexit
import json
import os
import time

from aiokv import envs

__all__ = ["enable", "enabled", "mark"]

_PREFIX = envs.get("AIOKV_TRACE")
enabled = bool(_PREFIX)
_registered = False
_events: list[tuple[str, str, int, float]] = []
_LIMIT = 2_000_000  # bound the memory a forgotten trace can take


def mark(step: str, session: str, xfer: int) -> None:
    """Record that ``xfer`` of ``session`` reached ``step`` now."""
    if len(_events) < _LIMIT:
        _events.append((step, session, xfer, time.perf_counter()))


def _dump() -> None:
    if not _events:
        return
    with open(f"{_PREFIX}.{os.getpid()}.json", "w") as fh:
        json.dump({"pid": os.getpid(), "events": _events}, fh)


def enable(prefix: str) -> None:
    """Record from now on and write ``<prefix>.<pid>.json`` at exit (as ``AIOKV_TRACE`` does)."""
    global _PREFIX, enabled, _registered
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("enable() needs a non-empty path prefix")
    _PREFIX = prefix
    enabled = True
    if not _registered:
        _registered = True
        atexit.register(_dump)


if enabled:
    _registered = True
    atexit.register(_dump)
