"""aiokv._runtime.threads: the threads module (daemon calls, the bounded pool, the ordered copy
thread), and the parts of aiokv that use it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from aiokv._runtime import threads as _blocking

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_in_daemon_runs_on_a_named_daemon_thread_and_hands_back_result_and_error() -> None:
    seen: list[tuple[str, bool]] = []

    def work() -> int:
        t = threading.current_thread()
        seen.append((t.name, t.daemon))
        return 42

    assert await _blocking.in_daemon(work, "aiokv-test") == 42
    assert seen == [("aiokv-test", True)]

    def boom() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await _blocking.in_daemon(boom, "aiokv-test")


@pytest.mark.anyio
@pytest.mark.timeout(10)
async def test_a_call_that_hangs_never_blocks_the_loop_and_is_dropped_when_given_up() -> None:
    release = threading.Event()
    ended = threading.Event()

    def hang() -> None:
        release.wait(5)
        ended.set()

    t0 = time.perf_counter()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_blocking.in_daemon(hang, "aiokv-hang"), 0.05)
    assert time.perf_counter() - t0 < 1.0
    release.set()  # the call ends later; its result goes nowhere, without an error
    assert await asyncio.get_running_loop().run_in_executor(None, ended.wait, 5)
    await asyncio.sleep(0.01)


def test_start_daemon_needs_no_loop_and_a_result_after_the_loop_closed_is_dropped() -> None:
    fut = _blocking.start_daemon(lambda: 7, "aiokv-test")
    assert fut.result(timeout=5) == 7
    release = threading.Event()

    async def give_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(_blocking.in_daemon(lambda: release.wait(5), "aiokv-late")), 0.01
            )

    asyncio.run(give_up())  # the loop is closed while the call still runs
    release.set()
    time.sleep(0.05)  # the late result meets a closed loop: dropped, no exception


@pytest.mark.anyio
@pytest.mark.timeout(20)
async def test_the_pool_is_shared_and_bounded() -> None:
    lock = threading.Lock()
    running, peak, names = 0, 0, set()

    def work() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            names.add(threading.current_thread().name)
        time.sleep(0.02)
        with lock:
            running -= 1

    await asyncio.gather(*(_blocking.in_pool(work) for _ in range(4 * _blocking.POOL_WORKERS)))
    assert 1 <= peak <= _blocking.POOL_WORKERS
    assert all(n.startswith("aiokv-cpu") for n in names)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_ordered_copies_run_one_at_a_time_in_call_order_on_one_thread() -> None:
    lock = threading.Lock()
    running, peak, order, names = 0, 0, [], set()

    def work(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            names.add(threading.current_thread().name)
        time.sleep(0.005)
        order.append(i)
        with lock:
            running -= 1
        return i

    got = await asyncio.gather(*(_blocking.in_order(lambda i=i: work(i)) for i in range(12)))
    assert got == list(range(12)) and order == list(range(12)) and peak == 1
    assert len(names) == 1 and next(iter(names)).startswith("aiokv-assemble")


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_kv_connectors_copy_on_the_shared_pool_not_pools_of_their_own() -> None:
    from support.kvutil import filled

    from aiokv import Engine
    from aiokv.kv import KVConnector, MLALayout

    lay = MLALayout(2, 64, 16, 256, "float32")
    async with Engine() as a, Engine() as b:
        prod = KVConnector(a, lay, filled(lay, 1), thread_min_bytes=1)
        cons = [KVConnector(b, lay, filled(lay, 2), thread_min_bytes=1) for _ in range(3)]
        for i, c in enumerate(cons):
            await asyncio.gather(
                prod.send_request(f"r{i}", [1, 2, 3], to=b.address),
                c.recv_request(f"r{i}", [4, 5, 6], timeout=10),
            )
        names = {t.name for t in threading.enumerate()}
        assert not [n for n in names if n.startswith("aiokv-kv")]  # no per-connector pool
        assert 1 <= sum(n.startswith("aiokv-cpu") for n in names) <= _blocking.POOL_WORKERS
        for c in (prod, *cons):
            await c.aclose()


def test_blocking_work_goes_through_the_helper_only() -> None:
    pkg = ROOT / "aiokv"
    library = [
        p
        for p in pkg.rglob("*.py")
        if "bench" not in p.parts and "demo" not in p.parts and p.relative_to(pkg).as_posix() != "_runtime/threads.py"
    ]
    offenders = []
    for p in library:
        text = p.read_text()
        for needle in (
            "run_in_executor(",
            "ThreadPoolExecutor(",
            "threading.Thread(",
            "to_thread(",
        ):
            if needle in text:
                offenders.append(f"{p.relative_to(pkg)}: {needle}")
    # the loop watchdog is a monitor that lives as long as the engine, not blocking work
    # (aiokv._runtime.threads's docstring lists it); the TCP frame assembler is _blocking.in_order
    # and the vLLM connector's worker runs the engine's event loop on a thread of its own
    # (vLLM calls the connector synchronously from its forward)
    assert sorted(offenders) == [
        "_runtime/watchdog.py: threading.Thread(",
        "vllm/_loop.py: threading.Thread(",
    ]
