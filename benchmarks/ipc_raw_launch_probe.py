"""Device probe (session 13): the IPC copy kernel through RawLaunch against Triton's JIT
launch (bit-exact, abort word honoured), the compiled kernel's signature and launch
metadata, and the hot cost of the driver calls against torch's.

On the GPU machine, in the repository root (aiokv importable, e.g. ``PYTHONPATH=.``):
``python3 benchmarks/ipc_raw_launch_probe.py``
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from aiokv.kv.ipc import _cudrv
from aiokv.kv.ipc import _kernel as K


def timeit(f: Callable[[], Any], n: int = 2000) -> float:
    """Median µs of ``n`` calls (after 50 warm-ups), the device synchronised around."""
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(xs) * 1e6, 2)


def main() -> None:
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    drv = _cudrv.driver()
    assert drv is not None, "libcuda.so.1 did not load"
    seg, nb, word, layers, n = 16 * 8 * 128 * 2, 64, 8, 4, 16  # block 16, 8 heads, dim 128
    src = [
        torch.randint(0, 255, (2 * nb * seg,), dtype=torch.uint8, device=dev) for _ in range(layers)
    ]
    dst = [torch.zeros(2 * nb * seg, dtype=torch.uint8, device=dev) for _ in range(layers)]
    dst2 = [torch.zeros_like(t) for t in dst]

    def table(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)

    st, dt, dt2 = table(src), table(dst), table(dst2)
    ids = torch.tensor([*range(3, 3 + n), *range(40, 40 + n)], dtype=torch.int64, device=dev)
    ab = torch.zeros(4096, dtype=torch.int32, device=dev)
    kw: dict[str, Any] = dict(
        n_pairs=n, word=word, n_layers=layers, parts=2, seg_words=seg // word,
        src_part_stride=nb * seg // word, dst_part_stride=nb * seg // word,
        block_stride=seg // word, base_align=16,
    )  # fmt: skip
    compiled = K.launch_pair_copy(st, dt, ids, ab, 5, **kw)
    torch.cuda.synchronize()
    print("signature", dict(compiled.src.signature), flush=True)
    print("constants", dict(getattr(compiled.src, "constants", {})), flush=True)
    print("metadata", compiled.metadata._asdict(), flush=True)
    rl = K.RawLaunch(compiled, drv)
    stream = torch._C._cuda_getCurrentRawStream(0)

    def raw_args(slot: int) -> tuple[int, tuple[int, ...]]:
        return K.pair_copy_args(
            st.data_ptr(), dt2.data_ptr(), ids.data_ptr(), ab.data_ptr(), dev, slot, **kw
        )

    programs, args = raw_args(5)
    rl.launch(programs, stream, args)
    torch.cuda.synchronize()
    print("raw bit-exact:", all(torch.equal(a, b) for a, b in zip(dst, dst2, strict=True)))
    for t in dst2:
        t.zero_()
    ab[7] = 1
    programs, args = raw_args(7)
    rl.launch(programs, stream, args)
    torch.cuda.synchronize()
    print("raw with its abort word set wrote nothing:", not any(bool(t.any()) for t in dst2))
    programs, args = raw_args(5)
    print("us jit launch", timeit(lambda: K.launch_pair_copy(st, dt2, ids, ab, 5, **kw), 500))
    print(
        "us raw launch",
        timeit(lambda: rl.launch(programs, torch._C._cuda_getCurrentRawStream(0), args), 500),
    )
    ev = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
    ev.record()
    print("us torch ev.record()", timeit(lambda: ev.record()))
    print(
        "us drv record",
        timeit(lambda: drv.event_record(ev.cuda_event, torch._C._cuda_getCurrentRawStream(0))),
    )
    pin = torch.empty(64, dtype=torch.int64, pin_memory=True)
    d = torch.empty(64, dtype=torch.int64, device=dev)
    print("us torch copy_ H2D", timeit(lambda: d.copy_(pin, non_blocking=True)))
    print(
        "us drv memcpy H2D",
        timeit(
            lambda: drv.memcpy_htod_async(
                d.data_ptr(), pin.data_ptr(), 256, torch._C._cuda_getCurrentRawStream(0)
            )
        ),
    )
    print("us current_stream()", timeit(lambda: torch.cuda.current_stream(dev)))
    print("us raw stream", timeit(lambda: torch._C._cuda_getCurrentRawStream(0)))


if __name__ == "__main__":
    main()
