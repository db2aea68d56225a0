"""One role of the IPC step-batch scenario (run by test_ipc_batch_gpu.py); same
conventions as ``_ipc_worker.py`` (whose helpers it uses): ``python
_ipc_batch_worker.py ROLE batches DIR``, the last stdout line is a JSON object.

The producer sends batches of 1, 16 and 64 requests (``send_requests``), the consumer
receives each (``recv_requests``, its requests listed in reverse order) and checks every
request's blocks bit-exact against the producer's cache (regenerated from its seed) and
the blocks no request wrote untouched; both report the plane's request counters after
each batch.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import torch
from _ipc_worker import OPTS, addresses, blocks, device, engine, fill, say, stats, zeroed

from aiokv.kv import FlashAttentionLayout, KVConnector

BATCHES = [1, 16, 64]
PB, CB = 1400, 1300  # producer / consumer num_blocks
SEED = 4242


def layout(num_blocks: int) -> FlashAttentionLayout:
    return FlashAttentionLayout(4, num_blocks, 16, 2, 64, "bfloat16")


def tables(count: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint block tables of 1..20 blocks (16 on average: 256-token requests)."""
    sizes = [1 + (i * 7) % 20 for i in range(count)]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in sizes:
        out.append(perm[at : at + n])
        at += n
    return out


async def batches(role: str, d: str) -> dict[str, Any]:
    dev = device(role)
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {"batches": []}
    async with engine(dev) as eng:
        peer = await addresses(d, role, eng)
        if role == "producer":
            _, caches = fill(layout(PB), dev, SEED)
            con = KVConnector(eng, layout(PB), caches, ipc=OPTS)
            for bi, count in enumerate(BATCHES):
                src = tables(count, PB, bi)
                reqs = [(f"b{bi}r{i}", s) for i, s in enumerate(src)]
                res = await con.send_requests(reqs, to=peer, timeout=60)
                out["batches"].append(
                    {
                        "count": count,
                        "errors": [repr(e) for e in res.values() if e is not None],
                        "finished": len(con.finished_sending()),
                        **stats(con),
                    }
                )
        else:
            big = zeroed(layout(CB), dev)
            con = KVConnector(eng, layout(CB), list(big.unbind(0)), ipc=OPTS)
            src_big, _ = fill(layout(PB), dev, SEED)
            touched: set[int] = set()
            for bi, count in enumerate(BATCHES):
                src, dst = tables(count, PB, bi), tables(count, CB, 100 + bi)
                reqs = [(f"b{bi}r{i}", t) for i, t in enumerate(dst)]
                res = await con.recv_requests(reqs[::-1], frm=peer, timeout=60)
                torch.cuda.synchronize(dev)
                exact = all(
                    torch.equal(blocks(src_big, layout(PB), s), blocks(big, layout(CB), t))
                    for s, t in zip(src, dst, strict=True)
                )
                for t in dst:
                    touched |= set(t)
                rest = [b for b in range(CB) if b not in touched]
                out["batches"].append(
                    {
                        "count": count,
                        "blocks": sum(len(t) for t in dst),
                        "errors": [repr(e) for e in res.values() if e is not None],
                        "exact": exact,
                        "untouched": not bool(blocks(big, layout(CB), rest).any()),
                        "finished": len(con.finished_receiving()),
                        **stats(con),
                    }
                )
        await con.aclose()
    return out


def main() -> None:
    role, scenario, d = sys.argv[1:4]
    out = asyncio.run({"batches": batches}[scenario](role, d))
    say(role=role, **out)


if __name__ == "__main__":
    main()
