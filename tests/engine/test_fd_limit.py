"""Descriptor exhaustion: connections that never say HELLO cannot fill the engine's fd table.

The engine runs in a child process whose ``RLIMIT_NOFILE`` is 256. The test opens 300
idle ZMTP connections to its control port (each completes zmq's handshake and then says
nothing), then a new, legitimate engine connects and sends a tensor: it must arrive
bit-exact, the child's event loop must not stall (largest gap between two ticks of a
2 ms probe, in the loop thread's CPU time, at most 50 ms), and while the idle
connections keep reconnecting the child must keep a quarter of its descriptors free
(sampled every 10 ms for a second after the tensor arrived; the first burst of 300
connections fills the table before anyone can see them, as zmq accepts them all). Without
a cap the idle connections filled the table (about 234 of them), zmq's listener spun on
EMFILE, and the new engine got ConnectTimeoutError.

What the cap promises is a law, not a number: idle connections hold at most the cap plus
those that connected within the last 50 ms (the grace each gets to say HELLO), plus what
arrives while the loop is late. The idle sockets here reconnect 0.5 s after each hang-up
(600 connections a second): by that law, with the loop up to 0.2 s late when three busy
processes share two cores, they hold at most ~130 descriptors with the process's own,
under the three quarters asserted. At zmq's default 0.1 s (3,000 a second) the grace
alone holds ~150 and a late loop holds more: on a loaded machine the table then peaked
at 190-232 of 256, and a new engine still got in.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from support.procs import LoopProbe, backend_name, run_on, same_bytes

import aiokv

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]
ROOT = Path(__file__).resolve().parents[2]
NOFILE = 256
IDLE = 300
STALL_S = 0.050
#: an idle socket's reconnect after each hang-up (see the module docstring)
RECONNECT_MS = 500


def _tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)


def _child(loop_name: str) -> None:
    """The engine under attack: prints its address, then one JSON line with what it saw."""
    import resource
    import time

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard))

    async def main() -> None:
        async with aiokv.Engine() as eng:
            probe = LoopProbe()
            fds: list[int] = []
            stop = False

            def count_fds() -> None:  # a thread: listing them is not the engine's work
                while not stop:
                    try:
                        fds.append(len(os.listdir("/proc/self/fd")))
                    except OSError:  # EMFILE: the table is full
                        fds.append(NOFILE)
                    time.sleep(0.01)

            probe.start()
            counter = asyncio.ensure_future(asyncio.to_thread(count_fds))
            print(json.dumps({"address": eng.address}), flush=True)
            try:
                got = await eng.recv("legit", timeout=60)
                ok = same_bytes(got, _tensor())
            except aiokv.AiokvError as exc:
                ok = False
                print(json.dumps({"error": repr(exc)}), flush=True)
            during = len(fds)
            await asyncio.sleep(1.0)  # the idle connections keep coming back meanwhile
            stop = True
            worst = await probe.stop()
            await counter
            st = eng.statistics()
            print(
                json.dumps(
                    {
                        "ok": ok,
                        "max_gap_ms": worst * 1e3,
                        "max_fds": max(fds),
                        "max_fds_later": max(fds[during:]),
                        "refused": st.protocol_errors.get("unbound_cap", 0),
                    }
                ),
                flush=True,
            )

    run_on(loop_name, main())


async def _line(proc: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    assert line, "the engine's process exited"
    out: dict[str, Any] = json.loads(line)
    return out


async def test_idle_connections_never_exhaust_descriptors_nor_lock_out_a_new_engine(
    anyio_backend: Any,
) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        backend_name(anyio_backend),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    try:
        addr = (await _line(proc, 30))["address"]
        idle = []
        for _ in range(IDLE):  # zmq completes the handshake; nothing is ever sent
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            s.connect(f"tcp://{addr}")
            idle.append(s)
        await asyncio.sleep(1.0)
        async with aiokv.Engine(aiokv.EngineConfig(timeouts=aiokv.Timeouts(connect=10))) as good:
            await good.send("legit", _tensor(), to=addr, timeout=20)
        res = await _line(proc, 60)
        for s in idle:
            s.close()
    finally:
        ctx.destroy(0)
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    print(f"fd limit {NOFILE}, {IDLE} idle connections: {res}")
    assert res.get("ok") is True, res
    # a burst of connections can fill the table before anyone sees them (zmq accepts
    # them all); once seen, idle ones are hung up and the table keeps room for sessions
    assert res["max_fds_later"] < NOFILE * 3 // 4, res
    assert res["refused"] > 0, res
    assert res["max_gap_ms"] <= STALL_S * 1e3, res


if __name__ == "__main__":
    _child(sys.argv[1])
