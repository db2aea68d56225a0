"""An NCCL communicator's abort runs on ``aiokv._runtime.threads``'s daemon thread (fake NCCL, CPU)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from .test_nccl_binding_cpu import cpu_comm, make_lib


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.timeout(20)
async def test_nccl_abort_runs_on_the_helpers_daemon_thread() -> None:
    fake, lib = make_lib()
    real = fake.ns.ncclCommAbort
    seen: list[tuple[str, bool]] = []

    def abort(comm: Any) -> int:
        t = threading.current_thread()
        seen.append((t.name, t.daemon))
        return int(real(comm))

    abort.restype = real.restype  # type: ignore[attr-defined]
    lib._fns["ncclCommAbort"] = abort
    c = cpu_comm(lib)
    c.abort()
    assert await c.wait_aborted(timeout=5)
    assert seen == [("aiokv-nccl-abort", True)]
