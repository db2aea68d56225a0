"""Helpers shared by the tests, and the child-process roles they spawn.

Importable (``from support.procs import ...``): deterministic tensor generation from a seed
(:func:`make_case`), a bit-exact comparison (:func:`same_bytes`),
:func:`free_port`, :func:`backend_name`, :class:`LoopProbe` (how long the loop is busy at a
stretch) and :func:`run_on` (a coroutine on a named event loop).

Run as a script (``python tests/support/procs.py ROLE JSON_ARGS``, see
``conftest.Child``): one engine in a child process that prints JSON event
lines on stdout and reads commands (``go``, ``quit``) from stdin.

Roles:

* ``producer``  {to, seed, pid, n, profile, mode, backend}: ready -> (go) ->
  sends ``n`` tensors of :func:`make_case` concurrently -> done -> (quit)
* ``putget``    {to, backend}: PUT ``pg-put``, PUT_ASYNC ``pg-async``,
  publishes ``pg-pub`` -> ready -> (quit)
* ``big``       {to, nbytes, backend}: allocates, connects -> ready -> (go) ->
  sends one big tensor ``big`` (the test kills it mid-transfer)
* ``victim``    {seed, n, profile, store_bytes, connect, backend}: an engine that others
  stream into and attack: ready -> (go) -> armed {peer_ids, data_port}, collects the ``n``
  tensors of :func:`make_case` (pid 1) while :class:`LoopProbe` ticks -> (stop) ->
  done {n_bad, worst_ms, ticks} -> (quit)
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiokv

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch

KiB = 1024
MiB = 1024 * KiB

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@asynccontextmanager
async def engines(
    *configs: aiokv.EngineConfig, close_timeout: float = 10.0
) -> AsyncIterator[list[aiokv.Engine]]:
    """Start engines for a test; close every one (bounded) afterwards."""
    import aiokv

    es = [aiokv.Engine(c) for c in configs]
    try:
        for e in es:
            await e.start()
        yield es
    finally:
        for e in es:
            await asyncio.wait_for(e.aclose(), close_timeout)


async def wait_until(pred: Any, timeout: float, what: str = "") -> None:
    """Poll ``pred()`` until true; fail the test after ``timeout`` seconds."""
    dl = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > dl:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.002)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopProbe:
    """Ticks every 2 ms on the running loop and records the loop thread's CPU time between
    two ticks: what the callbacks run in between cost. (Wall-clock lateness would also
    count the OS giving this process's core to another process: the tests that use this
    run busy processes side by side on 2 cores.)"""

    def __init__(self) -> None:
        self.busy: list[float] = []
        self._stop = False
        self._task: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not self._stop:
            t = time.thread_time()
            await asyncio.sleep(0.002)
            self.busy.append(time.thread_time() - t)

    async def stop(self) -> float:
        """Stop ticking; the longest stretch, in seconds."""
        self._stop = True
        if self._task is not None:
            await self._task
        return max(self.busy)


def run_on(loop_name: str, coro: Any) -> None:
    """Run the coroutine ``coro`` on a new ``"uvloop"`` or ``"asyncio"`` event loop."""
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


def backend_name(anyio_backend: Any) -> str:
    """'uvloop' or 'asyncio' for a value of the ``anyio_backend`` fixture."""
    if isinstance(anyio_backend, tuple) and anyio_backend[1].get("use_uvloop"):
        return "uvloop"
    return "asyncio"


def random_tensor(nbytes_hint: int, dtype: torch.dtype, flavor: int, seed: int) -> torch.Tensor:
    """A tensor of about ``nbytes_hint`` bytes with random bits; flavor 1-3 are non-contiguous."""
    es = torch.empty((), dtype=dtype).element_size()
    numel = max(1, nbytes_hint // es)
    if flavor == 0:
        base_shape: tuple[int, ...] = (numel,)
    elif flavor == 1:  # transposed 2-D
        a = max(1, int(numel**0.5))
        base_shape = (a, max(1, numel // a))
    elif flavor == 2:  # every second row of a 2-D (base twice as large)
        a = max(1, int((numel // 2) ** 0.5))
        base_shape = (2 * a, max(1, (numel // 2) // a))
    else:  # permuted 3-D
        a = max(1, int(numel ** (1 / 3)))
        base_shape = (a, a, max(1, numel // (a * a)))
    n = 1
    for d in base_shape:
        n *= d
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    base = raw.view(dtype).view(base_shape)
    if flavor == 1:
        return base.t()
    if flavor == 2:
        return base[::2]
    if flavor == 3:
        return base.permute(2, 0, 1)
    return base


def make_case(seed: int, pid: int, k: int, profile: str) -> tuple[str, torch.Tensor]:
    """Tensor number ``k`` of producer ``pid``: (id, tensor); the same on every call."""
    rng = random.Random(f"{seed}/{pid}/{k}")
    dtype = DTYPES[rng.randrange(len(DTYPES))]
    flavor = rng.randrange(4)
    if profile == "mixed":
        if k % 250 == 7:  # 2 per 500: 16..64 MiB
            size = rng.choice([16, 32, 64]) * MiB
        elif k % 25 == 3:  # 20 per 500: 1..4 MiB
            size = rng.randint(1, 4) * MiB
        else:  # the rest: 1 KiB .. 64 KiB
            size = rng.randint(1, 64) * KiB
    elif profile == "small":  # 64..256 KiB
        size = rng.randint(64, 256) * KiB
    else:
        raise ValueError(profile)
    return f"p{pid}/{k}", random_tensor(size, dtype, flavor, rng.randrange(1 << 62))


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return False
    a = got.contiguous().reshape(-1).view(torch.uint8)
    b = want.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------- child side


def emit(event: str, **kw: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **kw}) + "\n")
    sys.stdout.flush()


async def _line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _wait_for(word: str) -> None:
    while True:
        line = await _line()
        if not line or line.strip() == word:
            return


async def role_producer(a: dict[str, Any]) -> None:
    import aiokv

    cases = [make_case(a["seed"], a["pid"], k, a["profile"]) for k in range(a["n"])]
    async with aiokv.Engine(aiokv.EngineConfig()) as eng:
        await eng.connect(a["to"], timeout=10)
        emit(
            "ready", address=eng.address, nbytes=sum(t.numel() * t.element_size() for _, t in cases)
        )
        await _wait_for("go")
        t0 = time.monotonic()
        if a.get("mode") == "send_nowait":
            handles = [eng.send_nowait(tid, t, to=a["to"], timeout=120) for tid, t in cases]
            results = []
            for h in handles:
                try:
                    await h
                    results.append(None)
                except Exception as exc:
                    results.append(exc)
        else:
            results = await asyncio.gather(
                *(eng.send(tid, t, to=a["to"], timeout=120) for tid, t in cases),
                return_exceptions=True,
            )
        errors = [
            f"{tid}: {type(r).__name__}: {r}"
            for (tid, _), r in zip(cases, results)
            if r is not None
        ]
        st = eng.statistics()
        emit(
            "done",
            elapsed=time.monotonic() - t0,
            errors=errors[:20],
            n_errors=len(errors),
            tensors_sent=st.tensors_sent,
        )
        await _wait_for("quit")


async def role_putget(a: dict[str, Any]) -> None:
    import aiokv
    from support.procs import random_tensor as rt

    async with aiokv.Engine(aiokv.EngineConfig()) as eng:
        await eng.send("pg-put", rt(4096, torch.bfloat16, 1, 1), to=a["to"], timeout=20)
        h = eng.send_nowait("pg-async", rt(100_000, torch.int32, 2, 2), to=a["to"], timeout=20)
        await h
        eng.publish("pg-pub", rt(50_000, torch.float8_e5m2, 3, 3))
        emit("ready", address=eng.address)
        await _wait_for("quit")
        emit("stats", gets_served=eng.statistics().gets_served)


async def role_big(a: dict[str, Any]) -> None:
    import aiokv

    t = torch.empty(a["nbytes"], dtype=torch.uint8).fill_(7)
    async with aiokv.Engine(aiokv.EngineConfig()) as eng:
        await eng.connect(a["to"], timeout=10)
        emit("ready", address=eng.address)
        await _wait_for("go")
        await eng.send("big", t, to=a["to"], timeout=120)
        emit("done")
        await _wait_for("quit")


async def role_victim(a: dict[str, Any]) -> None:
    import aiokv

    cfg = aiokv.EngineConfig(
        limits=aiokv.Limits(store_bytes=a["store_bytes"]),
        timeouts=aiokv.Timeouts(connect=a["connect"]),
    )
    seed, n = a["seed"], a["n"]
    probe = LoopProbe()
    async with aiokv.Engine(cfg) as eng:
        emit("ready", address=eng.address)
        await _wait_for("go")
        # the ids to receive, made before the probe ticks: make_case builds each tensor
        # (64-256 KiB of random bytes), which is not the engine's work
        names = [make_case(seed, 1, k, a["profile"])[0] for k in range(n)]
        probe.start()
        eng.publish("pub", torch.ones(1000))
        peers = [ss.peer.engine_id for ss in eng._server.state.servers.values() if ss.peer]
        emit("armed", peer_ids=peers, data_port=eng._server.state.data_port)
        got = []
        for k in range(n):  # collect only: checking is not the engine's work (after)
            got.append(await eng.recv(names[k], timeout=30))
            await asyncio.sleep(0)
        await _wait_for("stop")  # the others are done
        worst = await probe.stop()
    bad = [k for k, t in enumerate(got) if not same_bytes(t, make_case(seed, 1, k, a["profile"])[1])]
    emit("done", bad=bad[:3], n_bad=len(bad), worst_ms=worst * 1e3, ticks=len(probe.busy))
    await _wait_for("quit")


ROLES = {"producer": role_producer, "putget": role_putget, "big": role_big, "victim": role_victim}


def main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    try:
        run_on(args.get("backend", "asyncio"), ROLES[role](args))
    except BaseException as exc:  # report, then exit without waiting for stdin threads
        emit("error", error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()


class LineReader:
    """The ``KEY json`` lines a worker prints, read on a thread so that waiting is bounded.

    On a timeout the worker gets SIGUSR1 — it dumps every thread's Python stack to
    stderr (faulthandler) — so a hang leaves a trace of where it was stuck.
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.q.put(line)
        self.q.put(None)

    def expect(self, key: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.q.get(timeout=max(0.0, left))
            except queue.Empty:
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGUSR1)  # stack dump of the stuck worker
                    time.sleep(1.0)
                raise AssertionError(f"timed out after {timeout:g} s waiting for {key}") from None
            if line is None:
                raise AssertionError(
                    f"worker exited (rc={self.proc.poll()}) while waiting for {key}"
                )
            k, _, v = line.partition(" ")
            if k == key:
                return json.loads(v)
