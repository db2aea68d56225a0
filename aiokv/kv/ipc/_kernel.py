"""The IPC plane's copy: a request's blocks, every layer, K and V, in ONE launch.

The kernel reads block ``src_ids[j]`` of every layer from the producer's paged
cache (mapped into this process by CUDA IPC) and writes it to block
``dst_ids[j]`` of the consumer's paged cache: no staging buffer, no second pass.
It is the pair-wise sibling of :mod:`aiokv.kv._triton` (gather/scatter through
staging): same raw-word copies, so every dtype, fp8 included, is bit-exact.

Work decomposition: a *unit* is one contiguous segment (FlashAttention: K or V;
FlashInfer and MLA: the whole block) of one block pair of one layer; each
program copies ``BLOCK`` words of one unit (32 KiB by default, the CTA size
measured fastest). Unit ``u = (li, p, j)``: layer ``li`` (base addresses from the
two int64 tables), part ``p``, pair ``j``. Source and destination have their own
part stride (FlashAttention's K/V halves are ``num_blocks`` blocks apart and the
two sides' ``num_blocks`` differ); the block stride is the segment.

Abort word: every program first reads ``abort[slot]`` (a volatile load) and
copies nothing when it is set. The consumer sets it (from another stream) when a
request is cancelled or its lease runs out, so a launch that has not started yet
-- e.g. one queued behind the producer's ready event of a producer that died --
can never write into blocks the consumer has since handed to another request.

Without Triton (:func:`aiokv.kv.set_triton` ``(False)``, which ``AIOKV_DISABLE_TRITON=1``
does for the command-line tools, or not installed) :func:`torch_pair_copy`
does the same copy with torch ops, one gather and one scatter per layer. It
cannot see the abort word, so the plane then waits for the producer's event on
the host before it enqueues anything (see :mod:`aiokv.kv.ipc`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any, TypedDict

import torch

from .. import _triton

__all__ = [
    "WORDS",
    "CopyGeometry",
    "RawLaunch",
    "available",
    "base_alignment",
    "launch_pair_copy",
    "pair_copy_args",
    "torch_pair_copy",
    "warm_pair_copy",
    "word_size",
]

#: words the kernel moves, by size in bytes
WORDS: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_PROGRAM_BYTES = 32768
_MAX_PROGRAMS = 2**31 - 1
MAX_PROGRAMS = _MAX_PROGRAMS  # the grid's limit (one dimension)


class CopyGeometry(TypedDict):
    """The copy's geometry keywords of :func:`launch_pair_copy` / :func:`pair_copy_args`
    (strides and sizes in words)."""

    n_pairs: int
    word: int
    n_layers: int
    parts: int
    seg_words: int
    src_part_stride: int
    dst_part_stride: int
    block_stride: int
    base_align: int


def word_size(*quantities: int) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every quantity (addresses, strides)."""
    for w in (8, 4, 2):
        if all(q % w == 0 for q in quantities):
            return w
    return 1


def base_alignment(*addresses: int) -> int:
    """The largest power of two up to 16 dividing every address (the vector bound)."""
    for a in (16, 8, 4, 2):
        if all(x % a == 0 for x in addresses):
            return a
    return 1


def available() -> bool:
    """True when the Triton kernel can be used (Triton imports, not disabled)."""
    return _triton.available()


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # The per-request scalars are not specialised: a 1-pair request must not compile
    # (and, under lazy module loading, load) a second variant while another stream may
    # be waiting on a peer. The geometry (segment, strides) is fixed per connector and
    # IS specialised: its divisibility lets the masked copies use 16-byte vectors.
    @triton.jit(  # type: ignore[untyped-decorator]
        do_not_specialize=["slot", "n_pairs", "parts"]
    )
    def pair_copy_kernel(  # type: ignore[no-untyped-def]
        src_table,
        dst_table,
        ids_ptr,
        abort_ptr,
        word_ref,
        slot,
        n_pairs,
        parts,
        seg_words,
        src_part_stride,
        dst_part_stride,
        block_stride,
        chunks,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
        WORD: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        unit = pid // chunks
        chunk = pid - unit * chunks
        j = unit % n_pairs
        t = unit // n_pairs
        p = t % parts
        li = t // parts
        stop = tl.load(abort_ptr + slot, volatile=True)
        sid = tl.load(ids_ptr + j)
        did = tl.load(ids_ptr + n_pairs + j)
        # Addresses as word offsets from word_ref (16-byte aligned, so Triton knows it):
        # with the offsets' divisibility hinted, loads and stores become 16-byte vectors.
        ref = word_ref.to(tl.int64, bitcast=True)
        start = chunk * BLOCK
        s_off = (tl.load(src_table + li) - ref) // WORD
        d_off = (tl.load(dst_table + li) - ref) // WORD
        s_off = tl.multiple_of(s_off + p * src_part_stride + sid * block_stride + start, VEC)
        d_off = tl.multiple_of(d_off + p * dst_part_stride + did * block_stride + start, VEC)
        offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), VEC), BLOCK)
        mask = (start + offs < seg_words) & (stop == 0)
        v = tl.load(word_ref + s_off + offs, mask=mask)
        tl.store(word_ref + d_off + offs, v, mask=mask)

    return pair_copy_kernel


@functools.lru_cache(maxsize=64)
def _geometry(
    word: int,
    seg_words: int,
    src_part_stride: int,
    dst_part_stride: int,
    base_align: int,
    program_bytes: int,
) -> tuple[int, int, int, int]:
    """Program size (words), programs per segment, vector width and warps of a geometry
    (fixed per mapping: computed once, not per launch)."""
    block = max(1, program_bytes // word)
    block = min(block, 1 << max(0, (seg_words - 1).bit_length()))
    chunks = -(-seg_words // block)
    vec = max(1, min(max(1, min(16, base_align) // word), block))
    while vec > 1 and (seg_words % vec or src_part_stride % vec or dst_part_stride % vec):
        vec //= 2
    num_warps = 8 if block * word >= 16384 else 4 if block * word >= 4096 else 1
    return block, chunks, vec, num_warps


_WORD_REFS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _word_ref(device: torch.device, word: int) -> torch.Tensor:
    """The kernel's (never read or written) base pointer of ``word`` type on ``device``:
    one tiny allocation per device and word for the process, not one per launch."""
    t = _WORD_REFS.get((device, word))
    if t is None:
        t = _WORD_REFS[(device, word)] = torch.empty(1, dtype=WORDS[word], device=device)
    return t


def launch_pair_copy(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    ids: torch.Tensor,
    abort: torch.Tensor,
    slot: int,
    *,
    n_pairs: int | None = None,
    word: int,
    n_layers: int,
    parts: int,
    seg_words: int,
    src_part_stride: int,
    dst_part_stride: int,
    block_stride: int,
    base_align: int,
    program_bytes: int = _PROGRAM_BYTES,
    warm_only: bool = False,
) -> Any:
    """Launch the fused copy on the CURRENT stream. False when the grid would be too big,
    else the compiled kernel Triton launched (for :class:`RawLaunch`; True if none).
    ``warm_only``: compile, do not launch (:func:`warm_pair_copy`).

    ``src_table``/``dst_table``: ``n_layers`` int64 base addresses (device tensors),
    aligned to ``word``. ``ids``: int64 device tensor ``[2, n]`` (source ids, then
    destination ids; or, with ``n_pairs``, any int64 device buffer whose first
    ``2 n_pairs`` elements are the source then destination ids). ``abort``: int32
    device tensor; ``abort[slot]`` non-zero makes
    the launch copy nothing. Strides and sizes are in words. ``base_align``: a power of
    two (bytes) dividing every base address in both tables; with the strides it decides
    the vector width (up to 16 bytes). ``program_bytes``: bytes per program (CTA), a
    power of two (the default, 32 KiB, is what the plane uses).
    """
    if n_pairs is None:
        n_pairs = ids.shape[1]
    block, chunks, vec, num_warps = _geometry(
        word, seg_words, src_part_stride, dst_part_stride, base_align, program_bytes
    )
    programs = n_layers * parts * n_pairs * chunks
    if programs == 0:
        return True
    if programs > _MAX_PROGRAMS:
        return False
    word_ref = _word_ref(ids.device, word)
    kernel = _kernel()
    run = functools.partial(kernel.warmup, grid=(programs,)) if warm_only else kernel[(programs,)]
    compiled = run(
        src_table,
        dst_table,
        ids,
        abort,
        word_ref,
        slot,
        n_pairs,
        parts,
        seg_words,
        src_part_stride,
        dst_part_stride,
        block_stride,
        chunks,
        BLOCK=block,
        VEC=vec,
        WORD=word,
        num_warps=num_warps,
    )
    return compiled if compiled is not None else True


def warm_pair_copy(
    device: torch.device,
    *,
    word: int,
    seg_words: int,
    src_part_stride: int,
    dst_part_stride: int,
    block_stride: int,
    base_align: int,
    program_bytes: int = _PROGRAM_BYTES,
) -> Any:
    """Compile, without launching, the specialisation :func:`launch_pair_copy` uses for
    this geometry (Triton's ``warmup``: same argument types, alignments and
    specialised values; the per-request values are not specialised), so that a later
    launch finds it in Triton's cache. Returns the compiled kernel."""
    # fresh allocations: aligned like the plane's tables, ids and abort blocks
    table = torch.empty(1, dtype=torch.int64, device=device)
    ids = torch.empty(2, dtype=torch.int64, device=device)
    abort = torch.empty(1, dtype=torch.int32, device=device)
    return launch_pair_copy(
        table, table, ids, abort, 0, n_pairs=1, word=word, n_layers=1, parts=1,
        seg_words=seg_words, src_part_stride=src_part_stride,
        dst_part_stride=dst_part_stride, block_stride=block_stride, base_align=base_align,
        program_bytes=program_bytes, warm_only=True,
    )  # fmt: skip


class RawLaunch:
    """One compiled specialisation of the copy kernel, launched with ``cuLaunchKernel``.

    ``launch_pair_copy`` goes through ``JITFunction.run``: binding and hashing the
    arguments, the cache look-up, the launcher's Python wrapper -- ~25 µs hot and
    ~70-180 µs on the request path of an H200 host (docs/benchmarks.md). The kernel's
    per-request values (the ids buffer, the abort slot, the pair count, the grid) do
    not change what it was compiled for (they are not specialised), so the plane keeps
    the compiled function and launches it through the driver with its parameters in
    ctypes values set in place. The parameter list is derived from the compiled
    kernel's signature: its non-constexpr arguments in order, then the scratch pointers
    Triton appends (global, and profile from Triton 3.5; both unused here, NULL).
    Raises ``ValueError`` for a kernel this cannot launch (scratch memory, clusters,
    cooperative or PDL launches, a parameter type it does not know). The plane uses it
    only after the same probe copy through it was bit-exact (``aiokv.kv.ipc``).
    """

    _CTYPES = {
        "i1": ctypes.c_int8,
        "i8": ctypes.c_int8,
        "i16": ctypes.c_int16,
        "i32": ctypes.c_int32,
        "i64": ctypes.c_int64,
        "u1": ctypes.c_uint8,
        "u8": ctypes.c_uint8,
        "u16": ctypes.c_uint16,
        "u32": ctypes.c_uint32,
        "u64": ctypes.c_uint64,
    }

    def __init__(self, compiled: Any, drv: Any) -> None:
        md: dict[str, Any] = compiled.metadata._asdict()  # (a namedtuple in Triton 3.x)
        if (
            md.get("global_scratch_size", 0)
            or md.get("profile_scratch_size", 0)
            or md.get("num_ctas", 1) != 1
            or md.get("launch_cooperative_grid", False)
            or md.get("launch_pdl", False)
            or md.get("tensordesc_meta", None)
        ):
            raise ValueError("kernel needs a launch feature the raw path does not set up")
        src = compiled.src
        names = list(src.fn.arg_names)
        sig = dict(src.signature)
        self.compiled = compiled
        self._drv = drv
        self._vals: list[Any] = []
        self._index: list[int] = []
        for i, name in enumerate(names):
            ty = sig[name] if name in sig else sig[i]
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                v: Any = ctypes.c_uint64()
            elif ty in self._CTYPES:
                v = self._CTYPES[ty]()
            else:
                raise ValueError(f"parameter {name!r} of type {ty!r}")
            self._vals.append(v)
            self._index.append(i)
        extra = [ctypes.c_uint64(0) for a in ("global_scratch_size", "profile_scratch_size")
                 if a in md]  # fmt: skip
        self._n_extra = len(extra)
        self._keep = self._vals + extra
        self._params = (ctypes.c_void_p * len(self._keep))(
            *(ctypes.addressof(v) for v in self._keep)
        )
        self._function = ctypes.c_void_p(compiled.function)
        self._threads = 32 * int(md["num_warps"])
        self._shared = int(md["shared"])
        self._launch = drv.launch_raw

    def launch(self, programs: int, stream: int, args: Sequence[int]) -> None:
        """Launch ``programs`` programs on ``stream`` (a raw handle) with ``args`` (the
        kernel's arguments in order, pointers as addresses; constexprs ignored)."""
        for v, i in zip(self._vals, self._index, strict=True):
            v.value = args[i]
        rc = self._launch(
            self._function, programs, 1, 1, self._threads, 1, 1, self._shared, stream,
            self._params, None,
        )  # fmt: skip
        if rc:
            self._drv.check(rc, "cuLaunchKernel")

    def params(self, args: Sequence[int]) -> Any:
        """A parameter block of its own for ``args`` (as :meth:`launch` takes them), for
        :meth:`launch_with`: the ``ctypes`` values are made once, ahead of the launch
        (a staged request's arguments are known before its descriptor comes)."""
        vals = [type(v)(args[i]) for v, i in zip(self._vals, self._index, strict=True)]
        keep = vals + [ctypes.c_uint64(0) for _ in range(self._n_extra)]
        block = (ctypes.c_void_p * len(keep))(*(ctypes.addressof(v) for v in keep))
        return (block, keep)  # the values stay alive with the block

    def launch_with(self, programs: int, stream: int, params: Any) -> None:
        """Launch with a block from :meth:`params` (the driver copies the values)."""
        rc = self._launch(
            self._function, programs, 1, 1, self._threads, 1, 1, self._shared, stream,
            params[0], None,
        )  # fmt: skip
        if rc:
            self._drv.check(rc, "cuLaunchKernel")


def pair_copy_args(
    src_table: int,
    dst_table: int,
    ids: int,
    abort: int,
    device: torch.device,
    slot: int,
    *,
    n_pairs: int,
    word: int,
    n_layers: int,
    parts: int,
    seg_words: int,
    src_part_stride: int,
    dst_part_stride: int,
    block_stride: int,
    base_align: int,
    program_bytes: int = _PROGRAM_BYTES,
) -> tuple[int, tuple[int, ...]]:
    """``(programs, arguments)`` of the launch :func:`launch_pair_copy` would make with
    these values (pointers as addresses), for :meth:`RawLaunch.launch`."""
    block, chunks, vec, _ = _geometry(
        word, seg_words, src_part_stride, dst_part_stride, base_align, program_bytes
    )
    programs = n_layers * parts * n_pairs * chunks
    ref = _word_ref(device, word).data_ptr()
    return programs, (
        src_table, dst_table, ids, abort, ref, slot, n_pairs, parts, seg_words,
        src_part_stride, dst_part_stride, block_stride, chunks, block, vec, word,
    )  # fmt: skip


def torch_pair_copy(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    block_dim: int,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """The same copy with torch ops (one gather + one scatter per layer), on the current stream.

    ``src_layers``/``dst_layers`` are per-layer caches of one layout (word-typed views
    are fine); ids are int64 tensors on the caches' device. Used without Triton and
    on CPU (the plane's CPU tests).
    """
    for s, d in zip(src_layers, dst_layers, strict=True):
        d.index_copy_(block_dim, dst_ids, s.index_select(block_dim, src_ids))
