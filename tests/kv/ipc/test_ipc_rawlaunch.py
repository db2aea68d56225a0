"""The IPC plane's driver path on CPU: the raw launch's parameter list from a compiled
kernel's signature, what it refuses, and the driver's absence handled. (That the raw
launch is bit-exact and honours the abort word is checked on the GPU: the plane's
probe copy through it, and tests/gpu/test_ipc_gpu.py's matrix.)"""

from __future__ import annotations

import ctypes
from collections import namedtuple
from types import SimpleNamespace
from typing import Any

import pytest

from aiokv.kv.ipc import _cudrv
from aiokv.kv.ipc._kernel import RawLaunch, pair_copy_args

NAMES = ["a_ptr", "b_ptr", "n", "big", "one", "K"]


def _compiled(**md: Any) -> Any:
    sig = {"a_ptr": "*i64", "b_ptr": "*u8", "n": "i32", "big": "i64", "one": "constexpr",
           "K": "constexpr"}  # fmt: skip
    meta = dict(
        num_warps=4, shared=128, num_ctas=1, global_scratch_size=0, profile_scratch_size=0,
        launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=[],
    )  # fmt: skip
    meta.update(md)
    for k in [k for k, v in meta.items() if v is _ABSENT]:
        del meta[k]
    return SimpleNamespace(
        src=SimpleNamespace(fn=SimpleNamespace(arg_names=NAMES), signature=sig),
        metadata=namedtuple("KernelMetadata", sorted(meta))(**meta),  # as Triton makes it
        function=0x1234,
    )


_ABSENT = object()


class FakeDriver:
    def __init__(self, rc: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.rc = rc

    def launch_raw(self, *args: Any) -> int:
        f, gx, gy, gz, bx, by, bz, shared, stream, params, extra = args
        assert (gy, gz, by, bz) == (1, 1, 1, 1)
        n = len(params)
        types = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64]
        types += [ctypes.c_uint64] * (n - len(types))
        vals = [ctypes.cast(params[i], ctypes.POINTER(types[i])).contents.value for i in range(n)]
        self.calls.append((f.value, gx, bx, shared, stream, n, vals, extra))
        return self.rc

    def check(self, rc: int, what: str) -> None:
        raise _cudrv.CudaDriverError(f"{what}: {rc}")


def test_parameters_follow_the_signature() -> None:
    drv = FakeDriver()
    rl = RawLaunch(_compiled(), drv)
    rl.launch(96, 0xBEEF, (0x1000, 0x2000, 7, 1 << 40, 1, 64))
    rl.launch(3, 0xBEEF, (0x1010, 0x2020, 2, 5, 1, 64))
    f, grid, threads, shared, stream, n, vals, extra = drv.calls[0]
    assert (f, grid, threads, shared, stream, extra) == (0x1234, 96, 128, 128, 0xBEEF, None)
    # a, b, n, big; constexprs skipped; global and profile scratch appended (NULL)
    assert n == 6
    assert vals[:2] == [0x1000, 0x2000] and vals[4:] == [0, 0]
    assert vals[2] == 7 and vals[3] == 1 << 40
    _, grid, *_, vals = drv.calls[1][:7]
    assert grid == 3 and vals[:3] == [0x1010, 0x2020, 2]


@pytest.mark.parametrize("profile", [0, _ABSENT])
def test_a_prepared_parameter_block_launches_as_launch_does(profile: object) -> None:
    """params() makes a block of its own per request (a staged one, ahead of its
    launch): launching with it passes exactly what launch() passes, and blocks made
    for two requests do not share values."""
    c = _compiled(profile_scratch_size=profile)
    a, b = (0x1000, 0x2000, 7, 1 << 40, 1, 64), (0x1010, 0x2020, 2, 5, 1, 64)
    direct, prepared = FakeDriver(), FakeDriver()
    rl = RawLaunch(c, direct)
    rl.launch(96, 0xBEEF, a)
    rl.launch(3, 0xBEEF, b)
    rp = RawLaunch(c, prepared)
    pa, pb = rp.params(a), rp.params(b)
    rp.launch_with(96, 0xBEEF, pa)
    rp.launch_with(3, 0xBEEF, pb)
    assert prepared.calls == direct.calls
    with pytest.raises(_cudrv.CudaDriverError):
        RawLaunch(c, FakeDriver(rc=700)).launch_with(1, 0, pa)


def test_an_older_triton_without_profile_scratch() -> None:
    c = _compiled(profile_scratch_size=_ABSENT)
    drv = FakeDriver()
    RawLaunch(c, drv).launch(1, 0, (1, 2, 3, 4, 1, 64))
    assert drv.calls[0][5] == 5  # four parameters and the global scratch


@pytest.mark.parametrize(
    "md",
    [
        {"global_scratch_size": 64},
        {"profile_scratch_size": 8},
        {"num_ctas": 2},
        {"launch_cooperative_grid": True},
        {"launch_pdl": True},
        {"tensordesc_meta": [{"x": 1}]},
    ],
)
def test_kernels_it_cannot_launch_are_refused(md: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RawLaunch(_compiled(**md), FakeDriver())


def test_unknown_parameter_types_are_refused() -> None:
    c = _compiled()
    c.src.signature["n"] = "fp32"
    with pytest.raises(ValueError):
        RawLaunch(c, FakeDriver())


def test_a_failed_launch_raises() -> None:
    rl = RawLaunch(_compiled(), FakeDriver(rc=700))
    with pytest.raises(_cudrv.CudaDriverError):
        rl.launch(1, 0, (1, 2, 3, 4, 1, 64))


def test_copy_arguments_match_the_kernel() -> None:
    import torch

    programs, args = pair_copy_args(
        1, 2, 3, 4, torch.device("cpu"), 9, n_pairs=16, word=8, n_layers=32, parts=2,
        seg_words=4096, src_part_stride=4096 * 100, dst_part_stride=4096 * 90,
        block_stride=4096, base_align=16,
    )  # fmt: skip
    # 32 KiB programs of 8-byte words: one per 32 KiB segment
    assert programs == 32 * 2 * 16 * 1
    assert args[:4] == (1, 2, 3, 4) and args[5:9] == (9, 16, 2, 4096)
    assert len(args) == 16  # 13 arguments and BLOCK, VEC, WORD


def test_no_driver_is_not_an_error() -> None:
    d = _cudrv.driver()
    assert d is None or isinstance(d, _cudrv.Driver)
