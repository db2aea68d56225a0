"""Coalescing core: gather a request's KV blocks into one staging buffer, scatter them back.

Staging packing order
---------------------
A staging buffer for ``n`` blocks over the selected layers ``L`` is the
concatenation, layer by layer in ``L`` order, of::

    cache_l.index_select(layout.block_dim, ids)      # contiguous, shape staging_shape(n)

so, per layer:

* FlashAttention: ``[2, n, block_size, heads, dim]`` -- all K segments of the n
  blocks, then all V segments (layer-major, then K/V, then block);
* FlashInfer: ``[n, 2, block_size, heads, dim]`` (layer, block, K/V);
* MLA: ``[n, block_size, latent_dim]`` (layer, block).

Each layer's slice is ``n * layout.block_nbytes()`` bytes at offset
``k * n * block_nbytes`` for the k-th selected layer (:class:`LayerChunker`).
The inverse on the consumer is ``cache_l.index_copy_(block_dim, its_ids, slice)``,
and a *contiguous* block table on either side turns each layer into at most
``kv_parts`` plain memcpys (``cache.narrow(block_dim, start, n)``).

Implementations (``impl=``)
---------------------------
``"triton"``: one kernel launch for all selected layers (CUDA + Triton);
``"stacked"``: one ``index_select``/``index_copy_`` over a stacked view, when the
layer caches are equally spaced views of one allocation;
``"per_layer"``: one ``index_select``/``index_copy_`` per layer;
``"torch"``: stacked if possible, else per layer; ``"auto"``: triton if usable,
else torch.

All paths move raw machine words (the widest of int64/int32/int16/uint8 the
geometry and alignment allow), so every dtype, fp8 included, round-trips
bit-exactly. Work is enqueued on the CURRENT CUDA stream; nothing here
synchronises the device (except building a device copy of host block ids,
which is an asynchronous copy from pinned memory).

Block ids given on the host (a sequence or a CPU tensor) are range-checked
(and, for scatter, checked for duplicates). Ids given as a device tensor are
trusted: checking them would force a device synchronisation.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .._exceptions import AiokvTimeoutError, ConfigError
from . import _triton
from .layouts import KVLayout

__all__ = [
    "BoundCaches",
    "Impl",
    "LayerChunker",
    "Lease",
    "PoolStatistics",
    "StagingPool",
    "StagingSlice",
    "gather_blocks",
    "scatter_blocks",
]

Impl = Literal["auto", "triton", "torch", "stacked", "per_layer"]
_IMPLS = ("auto", "triton", "torch", "stacked", "per_layer")

_WORDS: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
_INT_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _word_size(*quantities: int) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every quantity."""
    for w in (8, 4, 2):
        if all(q % w == 0 for q in quantities):
            return w
    return 1


class BoundCaches:
    """Per-layer caches validated once against a layout, with precomputed views.

    Build one with ``BoundCaches(layout, caches)`` and pass it instead of the raw
    list to :func:`gather_blocks` / :func:`scatter_blocks` on hot paths: validation
    and view construction are then paid once, not per call.
    """

    __slots__ = (
        "_layer_step_bytes",
        "_ptr_tables",
        "_raw",
        "_stacked",
        "device",
        "layout",
        "stacked_ok",
        "tensors",
    )

    def __init__(self, layout: KVLayout, caches: Sequence[torch.Tensor] | torch.Tensor) -> None:
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.tensors = layout.validate_caches(caches)
        self.device = self.tensors[0].device
        self._raw: dict[int, list[torch.Tensor]] = {}
        self._stacked: dict[int, torch.Tensor | None] = {}
        self._ptr_tables: dict[tuple[int, int, int], torch.Tensor] = {}
        ptrs = [t.data_ptr() for t in self.tensors]
        same_storage = all(
            t.untyped_storage().data_ptr() == self.tensors[0].untyped_storage().data_ptr()
            for t in self.tensors
        )
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else layout.layer_nbytes()
        self.stacked_ok = (
            same_storage
            and step >= layout.layer_nbytes()
            and all(ptrs[i] - ptrs[0] == i * step for i in range(len(ptrs)))
        )
        self._layer_step_bytes = step

    def max_word(self) -> int:
        lay = self.layout
        row = lay.layer_shape()[-1] * lay.itemsize
        return _word_size(row, *(t.data_ptr() for t in self.tensors))

    def raw(self, word: int) -> list[torch.Tensor]:
        """The per-layer caches viewed as ``word``-byte integers (last dim rescaled)."""
        r = self._raw.get(word)
        if r is None:
            r = [t.view(_WORDS[word]) for t in self.tensors]
            self._raw[word] = r
        return r

    def stacked(self, word: int) -> torch.Tensor | None:
        """All layers as ONE ``(num_layers, *layer_shape)`` view (word-typed), if possible."""
        if not self.stacked_ok:
            return None
        if word not in self._stacked:
            r = self.raw(word)[0]
            step_bytes = self._layer_step_bytes
            s = r.as_strided(
                (self.layout.num_layers, *r.shape),
                (step_bytes // word, *r.stride()),
                r.storage_offset(),
            )
            self._stacked[word] = s
        return self._stacked[word]

    def ptr_table(self, layers: range) -> torch.Tensor:
        """int64 device tensor of the selected layers' base addresses (cached)."""
        key = (layers.start, layers.stop, layers.step)
        t = self._ptr_tables.get(key)
        if t is None:
            host = torch.tensor([self.tensors[i].data_ptr() for i in layers], dtype=torch.int64)
            t = _to_device(host, self.device)
            if len(self._ptr_tables) >= 64:
                self._ptr_tables.pop(next(iter(self._ptr_tables)))
            self._ptr_tables[key] = t
        return t


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    try:
        pinned = host.pin_memory()
    except RuntimeError:
        return host.to(device)
    return pinned.to(device, non_blocking=True)


def _bind(
    caches: Sequence[torch.Tensor] | torch.Tensor | BoundCaches, layout: KVLayout
) -> BoundCaches:
    if isinstance(caches, BoundCaches):
        if caches.layout != layout:
            raise ConfigError("BoundCaches was bound to a different layout")
        return caches
    return BoundCaches(layout, caches)


def _select_layers(layers: range | None, num_layers: int) -> range:
    if layers is None:
        return range(num_layers)
    if not isinstance(layers, range):
        raise ConfigError(f"layers must be a range or None, got {type(layers).__name__}")
    if layers.step <= 0:
        raise ConfigError("layers must be an increasing range")
    if len(layers) and (layers[0] < 0 or layers[-1] >= num_layers):
        raise ConfigError(f"layers {layers} out of [0, {num_layers})")
    return layers


def plain_block_ids(
    block_ids: torch.Tensor | Sequence[int], num_blocks: int, *, unique: bool, what: str
) -> list[int] | None:
    """Block ids checked in Python, by the rules of the torch check (``_prepare_ids``):
    a list or tuple of ints, or a 1-D integer CPU tensor (as the list it holds), in
    ``[0, num_blocks)`` and distinct when ``unique``; ConfigError otherwise. None for
    any other form, which the caller checks with torch. (The torch calls of that check
    cost tens of µs per request on a GPU host: per-request paths use this first.)"""
    if (
        isinstance(block_ids, torch.Tensor)
        and block_ids.device.type == "cpu"
        and block_ids.dim() == 1
        and block_ids.dtype in _INT_ID_DTYPES
    ):
        block_ids = block_ids.tolist()
    if not isinstance(block_ids, (list, tuple)) or not all(type(i) is int for i in block_ids):
        return None
    ids = list(block_ids)
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise ConfigError(
            f"{what}: block ids must be in [0, {num_blocks}), got [{min(ids)}, {max(ids)}]"
        )
    if unique and len(set(ids)) != len(ids):
        raise ConfigError(f"{what}: duplicate block ids")
    return ids


@dataclass(frozen=True, slots=True)
class _Ids:
    dev: torch.Tensor  # int64 on the cache device
    n: int
    start: int | None  # first id when the ids are known to be consecutive


def _prepare_ids(
    block_ids: torch.Tensor | Sequence[int],
    num_blocks: int,
    device: torch.device,
    *,
    unique: bool,
    what: str,
) -> _Ids:
    if isinstance(block_ids, range):
        n = len(block_ids)
        if n and (
            min(block_ids[0], block_ids[-1]) < 0 or max(block_ids[0], block_ids[-1]) >= num_blocks
        ):
            raise ConfigError(f"{what}: block ids {block_ids} out of [0, {num_blocks})")
        host = torch.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=torch.int64)
        start = block_ids.start if (block_ids.step == 1 and n) else None
        if unique and block_ids.step == 0:  # pragma: no cover - range() forbids step 0
            raise ConfigError(f"{what}: duplicate block ids")
        return _Ids(_to_device(host, device), n, start)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in _INT_ID_DTYPES:
            raise ConfigError(
                f"{what}: block ids must be a 1-D integer tensor, got "
                f"{block_ids.dtype} of shape {tuple(block_ids.shape)}"
            )
        if block_ids.device.type != "cpu":
            if block_ids.device != device:
                raise ConfigError(f"{what}: block ids on {block_ids.device}, caches on {device}")
            return _Ids(block_ids.to(torch.int64), block_ids.numel(), None)
        host = block_ids.to(torch.int64)
    else:
        try:
            seq = list(block_ids)
        except TypeError:
            raise ConfigError(f"{what}: block ids must be a sequence of ints or a tensor") from None
        # plain-Python checks: a few microseconds for a request's ids, far less than torch ops
        if not all(type(i) is int for i in seq):
            raise ConfigError(f"{what}: block ids must be ints")
        n = len(seq)
        start = None
        if n:
            lo, hi = min(seq), max(seq)
            if lo < 0 or hi >= num_blocks:
                raise ConfigError(
                    f"{what}: block ids must be in [0, {num_blocks}), got [{lo}, {hi}]"
                )
            if hi - lo == n - 1 and seq == list(range(lo, hi + 1)):
                start = lo
            elif unique and len(set(seq)) != n:
                raise ConfigError(f"{what}: duplicate block ids")
        return _Ids(_to_device(torch.tensor(seq, dtype=torch.int64), device), n, start)
    n = host.numel()
    start = None
    if n:
        lo, hi = (int(v) for v in torch.aminmax(host))
        if lo < 0 or hi >= num_blocks:
            raise ConfigError(f"{what}: block ids must be in [0, {num_blocks}), got [{lo}, {hi}]")
        if hi - lo == n - 1 and (n == 1 or bool((host[1:] - host[:-1] == 1).all())):
            start = lo
        elif unique and torch.unique(host).numel() != n:
            raise ConfigError(f"{what}: duplicate block ids")
    return _Ids(_to_device(host.contiguous(), device), n, start)


def _as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() != 1 or not t.is_contiguous():
        raise ConfigError(f"{what}: staging buffer must be a contiguous 1-D tensor")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _run(
    bound: BoundCaches,
    sel: range,
    ids: _Ids,
    stage: torch.Tensor,
    *,
    scatter: bool,
    impl: str,
) -> str:
    """Copy between caches and ``stage`` (uint8, exact size). Returns the impl used."""
    lay = bound.layout
    n = ids.n
    nl = len(sel)
    if n == 0 or nl == 0:
        return "none"
    if impl not in _IMPLS:
        raise ConfigError(f"impl must be one of {_IMPLS}, got {impl!r}")
    word = min(bound.max_word(), _word_size(stage.data_ptr(), int(stage.storage_offset())))
    cuda = bound.device.type == "cuda"
    if impl == "auto":
        impl = "triton" if cuda and _triton.available() else "torch"
    if impl == "triton":
        if not (cuda and _triton.available()):
            raise ConfigError("impl='triton' needs CUDA tensors and an importable triton")
        seg_bytes = lay.segment_numel() * lay.itemsize
        w = _word_size(word, seg_bytes)
        ok = _triton.launch_copy(
            bound.ptr_table(sel),
            ids.dev,
            stage.view(_WORDS[w]),
            n_layers=nl,
            parts=lay.kv_parts,
            seg_words=seg_bytes // w,
            part_stride=lay.num_blocks * seg_bytes // w,
            block_stride=seg_bytes // w,
            scatter=scatter,
        )
        if ok:
            return "triton"
        impl = "torch"
    stage_w = stage.view(_WORDS[word])
    raw = bound.raw(word)
    shape = list(raw[0].shape)
    shape[lay.block_dim] = n
    bd = lay.block_dim
    if impl in ("torch", "stacked"):
        stacked = bound.stacked(word)
        if stacked is None:
            if impl == "stacked":
                raise ConfigError(
                    "impl='stacked' needs layer caches that are views of one allocation"
                )
        else:
            src = stacked[sel.start : sel.stop : sel.step]
            view = stage_w.view(nl, *shape)
            _copy(src, bd + 1, ids, view, scatter)
            return "stacked"
    per = stage_w.numel() // nl
    for k, li in enumerate(sel):
        view = stage_w[k * per : (k + 1) * per].view(shape)
        _copy(raw[li], bd, ids, view, scatter)
    return "per_layer"


def _copy(cache: torch.Tensor, dim: int, ids: _Ids, view: torch.Tensor, scatter: bool) -> None:
    if ids.start is not None:
        region = cache.narrow(dim, ids.start, ids.n)
        if scatter:
            region.copy_(view)
        else:
            view.copy_(region)
    elif dim > 0 and cache.device.type == "cpu":
        # CPU index_copy_/index_select along an inner dim is ~100x slower than along
        # dim 0: walk the leading dims and copy whole rows along dim 0 instead.
        lead = cache.flatten(0, dim - 1) if dim > 1 else cache
        vlead = view.flatten(0, dim - 1) if dim > 1 else view
        for k in range(lead.shape[0]):
            if scatter:
                lead[k].index_copy_(0, ids.dev, vlead[k])
            else:
                torch.index_select(lead[k], 0, ids.dev, out=vlead[k])
    elif scatter:
        cache.index_copy_(dim, ids.dev, view)
    else:
        torch.index_select(cache, dim, ids.dev, out=view)


def gather_blocks(
    caches: Sequence[torch.Tensor] | torch.Tensor | BoundCaches,
    layout: KVLayout,
    block_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor | None = None,
    layers: range | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Copy the named blocks of the selected layers into ONE contiguous staging buffer.

    ``caches``: per-layer cache tensors (or one stacked tensor, or a
    :class:`BoundCaches`). ``block_ids``: the producer's block ids (any order,
    repeats allowed). ``out``: an optional preallocated contiguous 1-D buffer
    (uint8, or the cache dtype; e.g. a :class:`StagingPool` lease) on the cache
    device, at least ``len(layers) * n * layout.block_nbytes()`` bytes; its prefix
    is used. ``layers``: an increasing ``range`` of layers (default all).

    Returns the staging region as a 1-D uint8 tensor of exactly the needed size
    (a view of ``out`` when given). Packing order: see the module docstring.
    """
    bound = _bind(caches, layout)
    sel = _select_layers(layers, layout.num_layers)
    ids = _prepare_ids(block_ids, layout.num_blocks, bound.device, unique=False, what="gather")
    nbytes = len(sel) * ids.n * layout.block_nbytes()
    if out is None:
        stage = torch.empty(nbytes, dtype=torch.uint8, device=bound.device)
    else:
        if out.device != bound.device:
            raise ConfigError(f"gather: out is on {out.device}, caches on {bound.device}")
        buf = _as_bytes(out, "gather")
        if buf.numel() < nbytes:
            raise ConfigError(f"gather: out holds {buf.numel()} bytes, {nbytes} needed")
        stage = buf[:nbytes]
    _run(bound, sel, ids, stage, scatter=False, impl=impl)
    return stage


def scatter_blocks(
    staging: torch.Tensor,
    caches: Sequence[torch.Tensor] | torch.Tensor | BoundCaches,
    layout: KVLayout,
    block_ids: torch.Tensor | Sequence[int],
    layers: range | None = None,
    *,
    impl: Impl = "auto",
) -> None:
    """Inverse of :func:`gather_blocks`: write staged blocks into ``caches`` in place.

    ``block_ids`` are THIS side's block ids (distinct; as many as were gathered);
    ``staging`` is a contiguous 1-D buffer of exactly
    ``len(layers) * n * layout.block_nbytes()`` bytes (uint8 or the cache dtype),
    packed as :func:`gather_blocks` packs it.
    """
    bound = _bind(caches, layout)
    sel = _select_layers(layers, layout.num_layers)
    ids = _prepare_ids(block_ids, layout.num_blocks, bound.device, unique=True, what="scatter")
    if staging.device != bound.device:
        raise ConfigError(f"scatter: staging is on {staging.device}, caches on {bound.device}")
    stage = _as_bytes(staging, "scatter")
    nbytes = len(sel) * ids.n * layout.block_nbytes()
    if stage.numel() != nbytes:
        raise ConfigError(
            f"scatter: staging holds {stage.numel()} bytes, {len(sel)} layers x {ids.n} blocks "
            f"need {nbytes}"
        )
    _run(bound, sel, ids, stage, scatter=True, impl=impl)


# ---------------------------------------------------------------------------------------
# Staging offsets: layer-wise streaming and chunking
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagingSlice:
    """Layers ``layers`` of a request occupy ``[offset, offset + nbytes)`` of the staging buffer."""

    layers: range
    offset: int
    nbytes: int


class LayerChunker:
    """Where each layer (or run of layers) of a request lies in its staging buffer.

    ``gather_blocks(..., layers=s.layers, out=staging[s.offset : s.offset + s.nbytes])``
    fills exactly slice ``s``; so a sender can gather chunk i+1 while chunk i is
    on the wire, and the receiver can scatter each chunk as it lands.
    """

    def __init__(self, layout: KVLayout, n_blocks: int, layers: range | None = None) -> None:
        if type(n_blocks) is not int or n_blocks < 0:
            raise ConfigError(f"n_blocks must be an int >= 0, got {n_blocks!r}")
        self.layout = layout
        self.n_blocks = n_blocks
        self.layers = _select_layers(layers, layout.num_layers)
        self.layer_nbytes = n_blocks * layout.block_nbytes()

    @property
    def nbytes(self) -> int:
        """Size of the whole staging buffer."""
        return len(self.layers) * self.layer_nbytes

    def layer_slice(self, layer: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of one layer's slice."""
        try:
            k = self.layers.index(layer)
        except ValueError:
            raise ConfigError(f"layer {layer} is not in {self.layers}") from None
        return k * self.layer_nbytes, self.layer_nbytes

    def per_layer(self) -> list[StagingSlice]:
        """One slice per layer, in staging order."""
        return [
            StagingSlice(self.layers[k : k + 1], k * self.layer_nbytes, self.layer_nbytes)
            for k in range(len(self.layers))
        ]

    def chunks(
        self, max_bytes: int | None = None, *, num_chunks: int | None = None
    ) -> list[StagingSlice]:
        """Runs of whole layers: each at most ``max_bytes`` (but at least one layer),
        or ``num_chunks`` runs of near-equal size."""
        nl = len(self.layers)
        if nl == 0:
            return []
        if num_chunks is not None:
            if num_chunks <= 0:
                raise ConfigError("num_chunks must be positive")
            per = -(-nl // min(num_chunks, nl))
        elif max_bytes is not None:
            if max_bytes <= 0:
                raise ConfigError("max_bytes must be positive")
            per = max(1, max_bytes // self.layer_nbytes) if self.layer_nbytes else nl
        else:
            per = nl
        return [
            StagingSlice(
                self.layers[k : k + per],
                k * self.layer_nbytes,
                len(self.layers[k : k + per]) * self.layer_nbytes,
            )
            for k in range(0, nl, per)
        ]


# ---------------------------------------------------------------------------------------
# StagingPool
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    capacity: int
    in_use: int
    peak: int
    fragments: int  # free ranges
    largest_free: int
    leases: int
    waiters: int


class Lease:
    """A region of a :class:`StagingPool`. ``tensor`` is a uint8 view of ``nbytes`` bytes.

    ``release()`` returns the region to the pool; it is idempotent. A lease is
    also a context manager that releases on exit.
    """

    __slots__ = ("_pool", "_size", "nbytes", "offset", "tensor")

    def __init__(self, pool: StagingPool, offset: int, size: int, nbytes: int) -> None:
        self._pool: StagingPool | None = pool
        self.offset = offset
        self._size = size  # aligned size held in the pool
        self.nbytes = nbytes
        self.tensor = pool.buffer[offset : offset + nbytes]

    @property
    def released(self) -> bool:
        return self._pool is None

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._free(self.offset, self._size)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._pool is None else "held"
        return f"<Lease offset={self.offset} nbytes={self.nbytes} {state}>"


class _Waiter:
    __slots__ = ("fut", "nbytes")

    def __init__(self, nbytes: int, fut: asyncio.Future[Lease]) -> None:
        self.nbytes = nbytes
        self.fut = fut


class StagingPool:
    """A preallocated byte buffer with a first-fit allocator (free neighbours coalesce).

    One ``torch.empty(nbytes, dtype=uint8, device=device)`` at construction;
    regions are aligned to ``alignment`` (256) bytes. :meth:`try_alloc` never
    waits; :meth:`alloc` waits (one future per waiter, strict FIFO, no polling)
    until the region frees. While anyone waits, ``try_alloc`` returns None so a
    large waiter is not starved by small requests. Not thread-safe: use it from
    one event loop.
    """

    def __init__(
        self,
        nbytes: int,
        device: torch.device | str = "cpu",
        *,
        alignment: int = 256,
        pin_memory: bool = False,
    ) -> None:
        if type(nbytes) is not int or nbytes <= 0:
            raise ConfigError(f"StagingPool size must be a positive int, got {nbytes!r}")
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {alignment!r}")
        self.alignment = alignment
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        self.capacity = nbytes
        # free ranges sorted by offset: parallel lists
        self._free_off: list[int] = [0]
        self._free_len: list[int] = [nbytes]
        self._in_use = 0
        self._peak = 0
        self._leases = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def _round(self, nbytes: int) -> int:
        a = self.alignment
        return (nbytes + a - 1) // a * a

    def _check(self, nbytes: int) -> int:
        if type(nbytes) is not int or nbytes < 0:
            raise ConfigError(f"nbytes must be an int >= 0, got {nbytes!r}")
        size = self._round(nbytes)
        if size > self.capacity:
            raise ConfigError(f"{nbytes} bytes can never fit a StagingPool of {self.capacity}")
        return size

    def _take(self, size: int, nbytes: int) -> Lease | None:
        if size == 0:
            self._leases += 1
            return Lease(self, 0, 0, nbytes)
        for i, length in enumerate(self._free_len):
            if length >= size:
                off = self._free_off[i]
                if length == size:
                    del self._free_off[i]
                    del self._free_len[i]
                else:
                    self._free_off[i] = off + size
                    self._free_len[i] = length - size
                self._in_use += size
                self._peak = max(self._peak, self._in_use)
                self._leases += 1
                return Lease(self, off, size, nbytes)
        return None

    def _free(self, off: int, size: int) -> None:
        self._leases -= 1
        if size:
            self._in_use -= size
            i = bisect.bisect_left(self._free_off, off)
            # merge with the right neighbour
            if i < len(self._free_off) and self._free_off[i] == off + size:
                size += self._free_len[i]
                del self._free_off[i]
                del self._free_len[i]
            # merge with the left neighbour
            if i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == off:
                self._free_len[i - 1] += size
            else:
                self._free_off.insert(i, off)
                self._free_len.insert(i, size)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            w = self._waiters[0]
            if w.fut.done():
                self._waiters.popleft()
                continue
            lease = self._take(self._round(w.nbytes), w.nbytes)
            if lease is None:
                return
            self._waiters.popleft()
            w.fut.set_result(lease)

    def try_alloc(self, nbytes: int) -> Lease | None:
        """A lease of ``nbytes`` now, or None (no room, or others are already waiting)."""
        size = self._check(nbytes)
        if any(not w.fut.done() for w in self._waiters):
            return None
        return self._take(size, nbytes)

    async def alloc(self, nbytes: int, timeout: float | None = None) -> Lease:
        """Wait (FIFO) for a lease of ``nbytes``. Raises :class:`~aiokv.AiokvTimeoutError`
        after ``timeout`` seconds, :class:`~aiokv.ConfigError` if it can never fit."""
        self._check(nbytes)
        if timeout is not None and not timeout >= 0:
            raise ConfigError(f"timeout must be >= 0 or None, got {timeout!r}")
        lease = self.try_alloc(nbytes)
        if lease is not None:
            await asyncio.sleep(0)  # every async call is a checkpoint
            return lease
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Lease] = loop.create_future()
        waiter = _Waiter(nbytes, fut)
        self._waiters.append(waiter)
        handle = None
        if timeout is not None:
            handle = loop.call_later(timeout, self._expire, waiter, nbytes, timeout)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()  # granted just as we were cancelled: give it back
            self._drop(waiter)
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def _drop(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        self._wake()  # a removed head may unblock those behind it

    def _expire(self, waiter: _Waiter, nbytes: int, timeout: float) -> None:
        if waiter.fut.done():
            return
        waiter.fut.set_exception(
            AiokvTimeoutError(f"no {nbytes} bytes free in the staging pool within {timeout} s")
        )
        self._drop(waiter)

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            capacity=self.capacity,
            in_use=self._in_use,
            peak=self._peak,
            fragments=len(self._free_off),
            largest_free=max(self._free_len, default=0),
            leases=self._leases,
            waiters=sum(1 for w in self._waiters if not w.fut.done()),
        )
