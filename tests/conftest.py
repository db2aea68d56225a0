"""Shared fixtures for the aiokv tests.

* ``anyio_backend``: every ``@pytest.mark.anyio`` test runs on asyncio (debug
  mode) and on uvloop. Test modules may override it.
* helpers (free port, seeded tensors, bit-exact compare) live in ``support/procs.py``.
* :class:`Child` / ``spawn``: run a role of ``tests/support/procs.py`` in a subprocess
  (``sys.executable``), read its JSON event lines without blocking the loop,
  and always kill it (SIGKILL) at the end of the test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():  # CPU torch without numpy warns at import (filterwarnings=error)
    warnings.simplefilter("ignore", UserWarning)
    import torch  # noqa: F401

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# tests/vllm needs vLLM, which lives in a venv of its own (``nox -s vllm``). Elsewhere
# it is not collected at all (nothing is skipped); AIOKV_REQUIRE_VLLM=1, which that
# session sets, turns a missing vLLM into an error instead. (tests/vllm itself, on the
# path as tests/ is, looks like a namespace package "vllm": it has no origin.)
_vllm = importlib.util.find_spec("vllm")
if _vllm is None or _vllm.origin is None:
    if os.environ.get("AIOKV_REQUIRE_VLLM") == "1":
        raise RuntimeError("AIOKV_REQUIRE_VLLM=1 but vLLM is not importable here")
    collect_ignore = ["vllm"]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class Child:
    """A ``tests/support/procs.py`` role in a subprocess, speaking JSON lines on stdout."""

    def __init__(self, role: str, **args: Any) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
        env["PYTHONWARNINGS"] = "ignore"
        env.setdefault("OMP_NUM_THREADS", "1")
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(TESTS / "support" / "procs.py"), role, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=str(REPO),
            env=env,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"event": "raw", "line": line.decode(errors="replace")})
        self.events.put({"event": "eof"})

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.decode(errors="replace"))

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """The next event called ``name`` (others are skipped); fails on EOF or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.role}: no {name!r} event in {timeout}s; stderr:\n{self.tail()}"
                    ) from None
                await asyncio.sleep(0.005)
                continue
            if ev.get("event") == name:
                return ev
            if ev.get("event") in ("eof", "error"):
                raise AssertionError(
                    f"{self.role}: {ev} while waiting for {name!r}; stderr:\n{self.tail()}"
                )

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def tail(self, n: int = 40) -> str:
        return "".join(self.stderr[-n:])

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        self.kill9()
        try:
            self.proc.wait(timeout=10)
        finally:
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass


@pytest.fixture
def spawn() -> Iterator[Any]:
    """``spawn(role, **args) -> Child``; every child is SIGKILLed when the test ends."""
    children: list[Child] = []

    def _spawn(role: str, **args: Any) -> Child:
        c = Child(role, **args)
        children.append(c)
        return c

    try:
        yield _spawn
    finally:
        for c in children:
            c.close()
