"""A few CUDA driver calls for the IPC plane's per-request path, through ``ctypes``.

On an H200 host each torch CUDA call on the request path cost 10-70 µs (its
dispatcher, Stream objects, the caching host allocator's bookkeeping; 2-4x more
after the process sat idle), against a few µs for the driver call underneath
(docs/benchmarks.md, "IPC plane: per-request host cost"). The plane makes exactly these calls itself,
on handles torch created and owns:

* ``cuEventRecord`` -- the producer's ready event, the consumer's completion event;
* ``cuMemcpyHtoDAsync`` -- a request's block ids into the slot's device buffer;
* ``cuLaunchKernel`` -- the Triton copy kernel's compiled function (see
  :class:`aiokv.kv.ipc._kernel.RawLaunch`).

Streams are torch's (``torch._C._cuda_getCurrentRawStream``), so ordering is the
caller's current stream exactly as with torch's own calls. ``libcuda.so.1`` is the
driver every CUDA process has loaded; where it cannot be loaded (no driver, ROCm)
:func:`driver` returns None and the plane uses torch's calls.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["CudaDriverError", "Driver", "driver"]


class CudaDriverError(RuntimeError):
    """A driver call returned an error (its ``CUresult`` name in the message)."""


class Driver:
    """The calls above, each raising :class:`CudaDriverError` on a non-zero result."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        c = ctypes
        lib.cuEventRecord.argtypes = [c.c_void_p, c.c_void_p]
        lib.cuEventRecord.restype = c.c_int
        lib.cuMemcpyHtoDAsync_v2.argtypes = [c.c_uint64, c.c_void_p, c.c_size_t, c.c_void_p]
        lib.cuMemcpyHtoDAsync_v2.restype = c.c_int
        lib.cuLaunchKernel.argtypes = [
            c.c_void_p,
            c.c_uint,
            c.c_uint,
            c.c_uint,
            c.c_uint,
            c.c_uint,
            c.c_uint,
            c.c_uint,
            c.c_void_p,
            c.c_void_p,
            c.c_void_p,
        ]
        lib.cuLaunchKernel.restype = c.c_int
        lib.cuGetErrorName.argtypes = [c.c_int, c.POINTER(c.c_char_p)]
        lib.cuGetErrorName.restype = c.c_int
        self.event_record_raw = lib.cuEventRecord
        self.memcpy_htod_raw = lib.cuMemcpyHtoDAsync_v2
        self.launch_raw = lib.cuLaunchKernel

    def check(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            label = name.value.decode() if name.value else str(rc)
            raise CudaDriverError(f"{what}: {label}")

    def event_record(self, event: int, stream: int) -> None:
        self.check(self.event_record_raw(event, stream), "cuEventRecord")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.memcpy_htod_raw(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


@functools.lru_cache(maxsize=1)
def driver() -> Driver | None:
    """The driver library, or None where it does not load."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
