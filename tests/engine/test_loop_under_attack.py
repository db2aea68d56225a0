"""Hostile inputs 9-15 measured the way load is: while a legitimate producer in another process
streams bit-exact tensors into an engine, each hostile input runs (from a third
process) against the same engine; the engine's event loop must never be busy more than 50 ms at
a stretch (its thread's CPU time between ticks) and the stream must stay intact.

The engine runs in a process of its own, as deployed (``tests/support/procs.py``'s victim). In the test runner's process a full
collection of CPython's cyclic collector also walks the heap that every earlier test left
fragmented (the engine freezes what is alive at its start, but its own objects then lie
scattered among the old ones): the ten-session flood measured 21 ms there alone, 28-32 ms
after the engine's tests and 56 ms once after the whole suite. Measured here, it is the
engine's own work and heap (21 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from support.procs import backend_name

from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
CODEC = Codec()
ROOT = Path(__file__).resolve().parents[2]
STALL_S = 0.050
STORE_BYTES = 256 << 20  # the engine under attack's receive budget
NESTED = b"\xdc\x20\x00" + (b"\xdc\x00\x78" + b"\x90" * 120) * 8192
# built once at import: the attacker's own encoding must not hold the GIL during the run
HOARD = [
    CODEC.encode(
        m.Reserve(i, "tcp", tuple(m.TensorSpec(f"z{i}.{j}", "uint8", (0,)) for j in range(1000)))
    )
    for i in range(1, 81)
]
HOARD_8000 = CODEC.encode(
    m.Reserve(99, "tcp", tuple(m.TensorSpec(f"y{j}", "uint8", (0,)) for j in range(8000)))
)
#: one zmq message of 1,000 RESERVEs of 64 zero-byte tensors each (sent by ten sessions)
SESSION_FLOOD = [
    CODEC.encode(
        m.Reserve(i, "tcp", tuple(m.TensorSpec(f"s{i}.{j}", "uint8", (0,)) for j in range(64)))
    )
    for i in range(1, 1001)
]
#: one zmq message of 4,000 RESERVEs of 200 MiB (the budget is 256 MiB: they queue) ...
QUEUE_FLOOD = [
    CODEC.encode(m.Reserve(i, "tcp", (m.TensorSpec(f"q{i}", "uint8", (200 << 20,)),)))
    for i in range(1, 4001)
]
#: ... and one of 4,000 WITHDRAWs of them
WITHDRAW_FLOOD = [CODEC.encode(m.Withdraw(i)) for i in range(1, 4001)]


@dataclass(frozen=True)
class Victim:
    """What an attacker knows of the engine (the attack runs in a process of its own, as a
    real attacker does: its own work, and its share of the GIL, are not the engine's)."""

    address: str
    store_bytes: int
    peer_ids: tuple[str, ...]
    data_port: int = 0


def _attack_main(name: str, victim: Victim, legit: str) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await ATTACKS[name](ctx, victim, legit)
        finally:
            ctx.destroy(0)

    asyncio.run(main())


def _attack_in_a_process(name: str, victim: Victim, legit: str) -> None:
    arg = json.dumps(
        [name, victim.address, victim.store_bytes, list(victim.peer_ids), legit, victim.data_port]
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    subprocess.run([sys.executable, __file__, arg], env=env, check=True, timeout=60)


async def _dealer(ctx: zmq.asyncio.Context, addr: str) -> zmq.asyncio.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{addr}")
    return s


async def _hello(ctx: zmq.asyncio.Context, addr: str, eid: str, listen: str) -> Any:
    s = await _dealer(ctx, addr)
    await s.send(CODEC.encode(m.Hello(m.PROTOCOL_VERSION, eid, listen, ("tcp",), None)))
    await asyncio.wait_for(s.recv_multipart(), 5)
    return s


async def item9(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    s = await _dealer(ctx, eng.address)
    for _ in range(10):
        await s.send(NESTED)
        await asyncio.sleep(0.01)
    s.close()


async def item10(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    import msgpack

    s = await _hello(ctx, eng.address, "ovf", "127.0.0.1:9")
    bad = [m.Reserve.KIND, 1, "tcp", [["a", "float64", [0, 1 << 40, 1 << 40]]]]
    await s.send(msgpack.packb(bad))
    await asyncio.sleep(0.2)
    s.close()


async def item11(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    # zero-byte tensors cost no bytes: only the tensor counts bound them (the hostile
    # 8,000-tensor RESERVE is over max_tensors_per_transfer now: refused at decode)
    s = await _hello(ctx, eng.address, "hoard", "127.0.0.1:9")
    for frame in HOARD:
        await s.send(frame, copy=False)
    await s.send(HOARD_8000, copy=False)
    await asyncio.sleep(0.5)
    s.close()


async def item12(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    for eid in eng.peer_ids:
        s = await _hello(ctx, eng.address, eid, legit)
        await s.send(CODEC.encode(m.Bye()))
        await asyncio.sleep(0.05)
        s.close()


async def item13(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    s = await _hello(ctx, eng.address, "getter", "127.0.0.1:9")
    for req in range(1, 301):
        await s.send(CODEC.encode(m.Get(req, ("pub",), f"127.0.0.1:{20000 + req}")))
    await asyncio.sleep(0.3)
    s.close()


async def item14(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    s = await _hello(ctx, eng.address, "big", "127.0.0.1:9")
    cap = eng.store_bytes
    await s.send(CODEC.encode(m.Reserve(1, "tcp", (m.TensorSpec("b1", "uint8", (cap // 2,)),))))
    await s.send(CODEC.encode(m.Reserve(2, "tcp", (m.TensorSpec("b2", "uint8", (cap // 2,)),))))
    for n in range(10):  # kept alive
        await s.send(CODEC.encode(m.Ping(n + 1)))
        await asyncio.sleep(0.1)
    for i in range(3, 1003):  # and a queue to withdraw
        await s.send(CODEC.encode(m.Reserve(i, "tcp", (m.TensorSpec(f"w{i}", "uint8", (1,)),))))
    for i in range(3, 1003):
        await s.send(CODEC.encode(m.Withdraw(i)))
    await asyncio.sleep(0.2)
    s.close()


async def item15(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    host, port = eng.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(200)]
    s = await _dealer(ctx, eng.address)
    await asyncio.sleep(0.1)
    with contextlib.suppress(zmq.Again):  # one 64 MiB first frame
        await s.send(memoryview(bytearray(64 << 20)), flags=zmq.NOBLOCK, copy=False)
    await asyncio.sleep(1.0)  # past the connect deadline: the idle ones are hung up
    s.close()
    for sk in idle:
        sk.close()


async def item15_data(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    # the data port without credentials, or with a made-up token: nothing gets in
    host = eng.address.rsplit(":", 1)[0]
    socks = []
    for i in range(20):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if i % 2:
            s.setsockopt(zmq.PLAIN_USERNAME, b"aiokv")
            s.setsockopt(zmq.PLAIN_PASSWORD, b"00" * 16)
        s.connect(f"tcp://{host}:{eng.data_port}")
        socks.append(s)
    await asyncio.sleep(0.2)
    for s in socks:  # a refused handshake leaves no pipe: the send would wait forever
        with contextlib.suppress(zmq.Again):
            await s.send(memoryview(bytearray(4 << 20)), flags=zmq.NOBLOCK, copy=False)
    await asyncio.sleep(1.0)
    for s in socks:
        s.close()


def _huge_handshake_frames(host: str, port: int) -> None:
    """Ten raw connections speaking ZMTP 3.0 PLAIN announce a 512 MiB HELLO command and
    stream it: zmq must hang up on the frame's header (data frames are at most 1 MiB)."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"PLAIN".ljust(20, b"\x00") + b"\x00" * 32
    chunk = b"\x00" * (256 * 1024)
    for _ in range(10):
        with socket.create_connection((host, port), timeout=2) as s:
            with contextlib.suppress(OSError):  # reset, broken pipe, or a full buffer
                s.sendall(greeting + b"\x06" + struct.pack(">Q", 512 << 20))
                for _ in range(2048):
                    s.sendall(chunk)


async def item15_data_handshake(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    host = eng.address.rsplit(":", 1)[0]
    await asyncio.to_thread(_huge_handshake_frames, host, eng.data_port)


async def flood_sessions(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    # ten sessions that never authenticated, each sends ONE message of 1,000 RESERVEs x 64
    # zero-byte tensors: 640,000 tensor specs, all in the engine's zmq queue at once
    socks = [await _hello(ctx, eng.address, f"flood{k}", "127.0.0.1:9") for k in range(10)]
    for s in socks:
        await s.send_multipart(SESSION_FLOOD, copy=False)
    for n in range(15):  # kept alive while the engine works through it
        for s in socks:
            await s.send(CODEC.encode(m.Ping(n + 1)))
        await asyncio.sleep(0.1)
    for s in socks:
        s.close()


async def idle_connections(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    # 600 connections that finish zmq's handshake and never say HELLO; zmq reconnects
    # each one the engine hangs up (every 100 ms): a standing stream of new idle ones
    socks = []
    for _ in range(600):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{eng.address}")
        socks.append(s)
    await asyncio.sleep(2.0)
    for s in socks:
        s.close()


async def flood_queue_and_withdraw(ctx: zmq.asyncio.Context, eng: Victim, legit: str) -> None:
    s = await _hello(ctx, eng.address, "queuer", "127.0.0.1:9")
    await s.send_multipart(QUEUE_FLOOD, copy=False)
    await s.send_multipart(WITHDRAW_FLOOD, copy=False)
    for n in range(10):
        await s.send(CODEC.encode(m.Ping(n + 1)))
        await asyncio.sleep(0.1)
    s.close()


ATTACKS: dict[str, Callable[[zmq.asyncio.Context, Victim, str], Awaitable[None]]] = {
    "9-nested-frames": item9,
    "10-overflowing-shape": item10,
    "11-zero-byte-hoard": item11,
    "12-claimed-identity-bye": item12,
    "13-get-reply-to-flood": item13,
    "14-big-reservation-and-withdraws": item14,
    "15-idle-and-huge-first-frame": item15,
    "15-data-port-without-a-token": item15_data,
    "15-data-port-huge-handshake-frame": item15_data_handshake,
    "flood-ten-sessions-one-message-each": flood_sessions,
    "flood-4000-queued-then-withdrawn": flood_queue_and_withdraw,
    "idle-connections-600": idle_connections,
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_hostile_input_while_a_legit_peer_streams(
    anyio_backend: Any, spawn: Any, attack: str
) -> None:
    seed, n = 12, 300
    backend = backend_name(anyio_backend)
    v = spawn(
        "victim",
        seed=seed,
        n=n,
        profile="small",
        store_bytes=STORE_BYTES,
        connect=0.5,
        backend=backend,
    )
    address = (await v.wait_event("ready", 60))["address"]
    p = spawn("producer", to=address, seed=seed, pid=1, n=n, profile="small", backend=backend)
    hello = await p.wait_event("ready", 60)  # its session is open
    v.tell("go")
    known = await v.wait_event("armed", 30)
    victim = Victim(address, STORE_BYTES, tuple(known["peer_ids"]), known["data_port"])
    p.tell("go")
    await asyncio.sleep(0.2)  # the stream is under way
    await asyncio.to_thread(_attack_in_a_process, attack, victim, str(hello.get("address", "")))
    done = await p.wait_event("done", 60)
    p.tell("quit")
    v.tell("stop")
    res = await v.wait_event("done", 60)
    v.tell("quit")
    print(f"{attack}: largest loop stall {res['worst_ms']:.1f} ms over {res['ticks']} ticks")
    assert res["n_bad"] == 0 and done["n_errors"] == 0, (res, done)
    assert res["worst_ms"] <= STALL_S * 1e3, f"{attack}: the loop stalled {res['worst_ms']:.1f} ms"


if __name__ == "__main__":
    _name, _addr, _cap, _ids, _legit, _dport = json.loads(sys.argv[1])
    _attack_main(_name, Victim(_addr, _cap, tuple(_ids), _dport), _legit)
