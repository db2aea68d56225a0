"""What announcing a layer-wise request's layers costs the producer's loop: one
message per run of layers saved in one loop pass (:func:`aiokv.kv.ipc._wire.layer_messages`,
what the plane sends) against one ``LayerReady`` per layer, over two real
engines on 127.0.0.1 (the plane's :class:`EngineChannel`), no GPU.

    python3 benchmarks/layer_msgs_cost.py [--layers 32] [--rounds 200] [--uvloop]

Prints medians over the rounds: the producer's time to hand the messages to its engine
(encode + ``send_nowait``, what runs in its loop pass), and the time until the consumer
has received the last layer's message.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiokv
from aiokv.kv.ipc._common import EngineChannel
from aiokv.kv.ipc._wire_layers import LayerReady, layer_messages


async def _main(layers: int, rounds: int) -> None:
    a, b = aiokv.Engine(aiokv.EngineConfig()), aiokv.Engine(aiokv.EngineConfig())
    await a.start()
    await b.start()
    try:
        ch = EngineChannel(a)
        saved = [(i, bytes(64), i) for i in range(layers)]
        variants = {
            "one message per layer": lambda rid: [
                LayerReady(rid, i, ((i + 1, ev, s),)) for i, ev, s in saved
            ],
            "one per run (layer_messages)": lambda rid: layer_messages(rid, saved),
        }
        res: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
        for r in range(rounds + 5):
            for name, make in variants.items():
                rid = f"{r}-{len(res[name][0])}-{name[:3]}"
                t0 = time.perf_counter()
                msgs = make(rid)
                hs = [
                    ch.send(f"{rid}#ipcL{lr.lo}", lr.to_wire(), to=b.address, timeout=10)
                    for lr in msgs
                ]
                t1 = time.perf_counter()
                for lr in msgs:
                    await b.recv(f"{rid}#ipcL{lr.lo}", timeout=10)
                t2 = time.perf_counter()
                await asyncio.gather(*hs)
                if r >= 5:  # (warm-up rounds dropped)
                    res[name][0].append(t1 - t0)
                    res[name][1].append(t2 - t0)
        for name, (send, last) in res.items():
            print(
                f"{name:30s} {layers} layers: producer's loop {statistics.median(send) * 1e3:.3f} ms,"
                f" last layer's message received {statistics.median(last) * 1e3:.3f} ms"
            )
    finally:
        await a.aclose()
        await b.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--uvloop", action="store_true")
    a = ap.parse_args()
    if a.uvloop:
        import uvloop

        uvloop.run(_main(a.layers, a.rounds))
    else:
        asyncio.run(_main(a.layers, a.rounds))


if __name__ == "__main__":
    main()
