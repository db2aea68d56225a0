"""Pull mode's host cost per step on CPU: a producer (its own thread and event loop)
serves a step's requests with ``serve_request``; the consumer (the main thread's loop)
fetches them with ``fetch_requests`` (batched) or ``fetch_request`` one after the other.
Prints, per step size, the median CPU time of the consumer's loop thread
(``time.thread_time``) and wall time per step, every block checked bit-exactly.

    python benchmarks/pull_batch_cost.py [--steps 20] [--batch 16 64] [--loop uvloop]

Workload: requests of 2 blocks of 16 tokens (4 layers, FlashAttention, 2 KV heads x 64,
float16: 64 KiB a request), loopback TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import threading
import time
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402

from aiokv import Engine, EngineConfig  # noqa: E402
from aiokv.kv import FlashAttentionLayout, KVConnector  # noqa: E402

LAYOUT = FlashAttentionLayout(4, 2 * 64 + 8, 16, 2, 64, "float16")


def caches(seed: int) -> list[torch.Tensor]:
    out = LAYOUT.allocate()
    g = torch.Generator().manual_seed(seed)
    for t in out:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return out


class Producer:
    """An engine and connector on a loop of their own (another thread)."""

    def __init__(self, loop_factory: type[asyncio.AbstractEventLoop] | None) -> None:
        self.loop = loop_factory() if loop_factory is not None else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.p = caches(1)
        self.eng = Engine(EngineConfig())
        self.call(self.eng.start())
        self.conn = KVConnector(self.eng, LAYOUT, self.p)

    def call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def serve(self, reqs: list[tuple[str, list[int]]]) -> concurrent.futures.Future[list[str]]:
        """Serve a step; the future is done once every ticket is published."""
        published: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

        async def go() -> list[str]:
            left = [len(reqs)]

            def one() -> None:
                left[0] -= 1
                if not left[0]:
                    published.set_result([])

            return list(
                await asyncio.gather(
                    *(
                        self.conn.serve_request(rid, ids, timeout=30, on_published=one)
                        for rid, ids in reqs
                    )
                )
            )

        self.served = asyncio.run_coroutine_threadsafe(go(), self.loop)
        return published

    def close(self) -> None:
        self.call(self.eng.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


async def run(prod: Producer, n: int, steps: int, batched: bool) -> tuple[float, float]:
    src = [[2 * i, 2 * i + 1] for i in range(n)]
    dst = [[2 * (n - 1 - i), 2 * (n - 1 - i) + 1] for i in range(n)]
    c = caches(2)
    cpu, wall = [], []
    async with Engine(EngineConfig()) as b:
        cons = KVConnector(b, LAYOUT, c)
        for s in range(-2, steps):  # two warm-up steps
            reqs = [(f"s{s}r{i}", src[i]) for i in range(n)]
            await asyncio.wrap_future(prod.serve(reqs))
            c0, w0 = time.thread_time(), time.perf_counter()
            if batched:
                got = await cons.fetch_requests(
                    [(rid, dst[i]) for i, (rid, _) in enumerate(reqs)],
                    frm=prod.eng.address,
                    timeout=30,
                )
                assert all(v is None for v in got.values()), got
            else:
                for i, (rid, _) in enumerate(reqs):
                    await cons.fetch_request(rid, dst[i], frm=prod.eng.address, timeout=30)
            if s >= 0:
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - w0)
            await asyncio.wrap_future(prod.served)
            for li in range(LAYOUT.num_layers):
                for i in range(n):
                    a = prod.p[li].view(torch.uint8).index_select(1, torch.tensor(src[i]))
                    z = c[li].view(torch.uint8).index_select(1, torch.tensor(dst[i]))
                    assert torch.equal(a, z)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    args = ap.parse_args()
    factory: type[asyncio.AbstractEventLoop] | None = None
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.Loop
    prod = Producer(factory)
    try:
        for n in args.batch:
            for batched in (True, False):

                def go(n: int = n, batched: bool = batched) -> tuple[float, float]:
                    with asyncio.Runner(loop_factory=factory) as r:
                        return r.run(run(prod, n, args.steps, batched))

                cpu, wall = go()
                how = "batched   " if batched else "one by one"
                print(
                    f"{n:3d} requests {how}: loop CPU {cpu:6.2f} ms/step, wall {wall:6.2f} ms/step"
                )
    finally:
        prod.close()


if __name__ == "__main__":
    main()
