"""Paged KV-cache layouts: FlashAttention, FlashInfer, MLA and vLLM's CPU attention.

A layout is a small frozen value object that describes ONE side's paged KV
cache: how many layers, how many blocks of how many tokens, the per-token
geometry and the element dtype. It knows the shape of each per-layer cache
tensor, the size of one transfer *block*, how to allocate and validate caches,
and how to cross the wire (:meth:`KVLayout.to_wire` / :func:`layout_from_wire`).

Per-layer tensor shapes::

    FlashAttentionLayout  [2, num_blocks, block_size, num_kv_heads, head_dim]   (K/V outermost)
    FlashInferLayout      [num_blocks, 2, block_size, num_kv_heads, head_dim]
    MLALayout             [num_blocks, block_size, latent_dim]
    CPUAttentionLayout    [num_blocks, num_kv_heads, block_size, 2 * head_dim]  (K|V per head)

The transfer unit "block ``b`` of layer ``l``" is ``cache[:, b]`` (K and V of the
block) for FlashAttention and ``cache[b]`` for the others.

Wire data is untrusted: :func:`layout_from_wire` checks the kind, every field's
type and range, and takes the dtype from an explicit allow-list (never
``getattr(torch, name)``); anything wrong raises :class:`~aiokv.ConfigError`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._config import register_default_layout_check
from .._exceptions import ConfigError, LayoutMismatchError

__all__ = [
    "DTYPES",
    "CPUAttentionLayout",
    "FlashAttentionLayout",
    "FlashInferLayout",
    "KVLayout",
    "MLALayout",
    "check_compatible",
    "engine_layout_check",
    "layout_from_wire",
]

#: The dtypes a KV cache may have, by wire name. The ONLY way a wire string becomes
#: a torch dtype.
DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

# Inclusive bounds of every integer field (also what layout_from_wire accepts).
_INT_BOUNDS: Mapping[str, tuple[int, int]] = {
    "num_layers": (1, 4096),
    "num_blocks": (1, 2**31 - 1),
    "block_size": (1, 1 << 16),
    "num_kv_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 16),
    "latent_dim": (1, 1 << 20),
}
#: one block of one layer must fit in 2 GiB; one layer's cache in 4 TiB.
MAX_BLOCK_NBYTES = 1 << 31
MAX_LAYER_NBYTES = 1 << 42


class KVLayout(abc.ABC):
    """Base of the layout kinds. Subclasses are frozen dataclasses.

    Common fields: ``num_layers``, ``num_blocks``, ``block_size`` (tokens per
    block) and ``dtype`` (a name from :data:`DTYPES`, e.g. ``"bfloat16"``).
    """

    #: wire name of the kind
    kind: ClassVar[str]
    #: index of the block dimension in the per-layer tensor
    block_dim: ClassVar[int]
    #: how many contiguous segments one transfer block has in a layer (2 for FA: K, V)
    kv_parts: ClassVar[int]

    num_layers: int
    num_blocks: int
    block_size: int
    dtype: str

    # -- geometry -----------------------------------------------------------------

    @abc.abstractmethod
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of ONE layer's cache tensor."""

    @abc.abstractmethod
    def segment_numel(self) -> int:
        """Elements of one contiguous segment of a block (a block has :attr:`kv_parts`)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    def block_numel(self) -> int:
        """Elements of one block of one layer (K and V together)."""
        return self.kv_parts * self.segment_numel()

    def block_nbytes(self) -> int:
        """Bytes of ONE block of ONE layer, K and V included."""
        return self.block_numel() * self.itemsize

    def request_nbytes(self, n_blocks: int) -> int:
        """Bytes of ``n_blocks`` blocks over ALL layers (the staging size of a request)."""
        if n_blocks < 0:
            raise ConfigError(f"n_blocks must be >= 0, got {n_blocks}")
        return self.num_layers * n_blocks * self.block_nbytes()

    def layer_nbytes(self) -> int:
        """Bytes of one layer's whole cache tensor."""
        return self.num_blocks * self.block_nbytes()

    def staging_shape(self, n_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's slice of a staging buffer holding ``n_blocks`` blocks.

        It is :meth:`layer_shape` with ``num_blocks`` replaced by ``n_blocks``: the
        slice is exactly ``cache.index_select(block_dim, ids)``.
        """
        shape = list(self.layer_shape())
        shape[self.block_dim] = n_blocks
        return tuple(shape)

    # -- validation -----------------------------------------------------------------

    def _validate_fields(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.name == "dtype":
                if not isinstance(v, str) or v not in DTYPES:
                    raise ConfigError(
                        f"{type(self).__name__}.dtype must be one of {sorted(DTYPES)}, got {v!r}"
                    )
                continue
            lo, hi = _INT_BOUNDS[f.name]
            if type(v) is not int or not (lo <= v <= hi):
                raise ConfigError(
                    f"{type(self).__name__}.{f.name} must be an int in [{lo}, {hi}], got {v!r}"
                )
        if self.block_nbytes() > MAX_BLOCK_NBYTES:
            raise ConfigError(
                f"{type(self).__name__}: one block is {self.block_nbytes()} bytes, "
                f"more than the limit {MAX_BLOCK_NBYTES}"
            )
        if self.layer_nbytes() > MAX_LAYER_NBYTES:
            raise ConfigError(
                f"{type(self).__name__}: one layer is {self.layer_nbytes()} bytes, "
                f"more than the limit {MAX_LAYER_NBYTES}"
            )

    def validate_caches(self, caches: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        """Check caches against this layout and return them as a list of per-layer tensors.

        ``caches`` is a sequence of ``num_layers`` tensors of :meth:`layer_shape`, or one
        tensor of shape ``(num_layers, *layer_shape())`` (split into per-layer views).
        Every tensor must have this layout's dtype, be contiguous and live on one device.
        Raises :class:`~aiokv.ConfigError` saying what is wrong.
        """
        name = type(self).__name__
        shape = self.layer_shape()
        dt = self.torch_dtype
        if isinstance(caches, torch.Tensor):
            want = (self.num_layers, *shape)
            if tuple(caches.shape) != want:
                raise ConfigError(
                    f"{name}: a single cache tensor must have shape {want}, "
                    f"got {tuple(caches.shape)}"
                )
            layers = list(caches.unbind(0))
        else:
            if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
                raise ConfigError(f"{name}: caches must be a sequence of tensors or one tensor")
            layers = list(caches)
            if len(layers) != self.num_layers:
                raise ConfigError(
                    f"{name}: expected {self.num_layers} layer caches, got {len(layers)}"
                )
        if not layers:
            raise ConfigError(f"{name}: no layer caches")
        device = None
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"{name}: layer {i} cache is {type(t).__name__}, not a tensor")
            if tuple(t.shape) != shape:
                raise ConfigError(
                    f"{name}: layer {i} cache has shape {tuple(t.shape)}, expected {shape}"
                )
            if t.dtype != dt:
                raise ConfigError(f"{name}: layer {i} cache has dtype {t.dtype}, expected {dt}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ConfigError(f"{name}: layer {i} cache is on {t.device}, layer 0 on {device}")
            if not t.is_contiguous():
                raise ConfigError(f"{name}: layer {i} cache is not contiguous")
        return layers

    # -- allocation -----------------------------------------------------------------

    def allocate(
        self, device: torch.device | str = "cpu", *, stacked: bool = False, zero: bool = False
    ) -> list[torch.Tensor]:
        """Allocate the per-layer caches.

        With ``stacked=True`` the layers are views into ONE allocation of shape
        ``(num_layers, *layer_shape())`` (which lets the torch path gather all layers
        in one op). ``zero=True`` zero-fills; otherwise the memory is uninitialised.
        """
        make = torch.zeros if zero else torch.empty
        if stacked:
            big = make(
                (self.num_layers, *self.layer_shape()), dtype=self.torch_dtype, device=device
            )
            return list(big.unbind(0))
        return [
            make(self.layer_shape(), dtype=self.torch_dtype, device=device)
            for _ in range(self.num_layers)
        ]

    # -- wire ------------------------------------------------------------------------

    def to_wire(self) -> dict[str, str | int]:
        """A plain (msgpack-able) dict: ``{"kind": ..., <field>: <value>, ...}``."""
        d: dict[str, str | int] = {"kind": self.kind}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            d[f.name] = getattr(self, f.name)
        return d

    def compat_fields(self) -> tuple[str, ...]:
        """Fields that must be equal on both sides (all but ``num_blocks``)."""
        return tuple(
            f.name
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.name != "num_blocks"
        )


@dataclass(frozen=True, slots=True)
class FlashAttentionLayout(KVLayout):
    """vLLM FlashAttention: per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    kind: ClassVar[str] = "flash_attention"
    block_dim: ClassVar[int] = 1
    kv_parts: ClassVar[int] = 2

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        self._validate_fields()

    def layer_shape(self) -> tuple[int, ...]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def segment_numel(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class FlashInferLayout(KVLayout):
    """FlashInfer: per layer ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``."""

    kind: ClassVar[str] = "flashinfer"
    block_dim: ClassVar[int] = 0
    kv_parts: ClassVar[int] = 1

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        self._validate_fields()

    def layer_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def segment_numel(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class MLALayout(KVLayout):
    """Multi-head latent attention (DeepSeek): per layer ``[num_blocks, block_size, latent_dim]``."""

    kind: ClassVar[str] = "mla"
    block_dim: ClassVar[int] = 0
    kv_parts: ClassVar[int] = 1

    num_layers: int
    num_blocks: int
    block_size: int
    latent_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        self._validate_fields()

    def layer_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.block_size, self.latent_dim)

    def segment_numel(self) -> int:
        return self.block_size * self.latent_dim


@dataclass(frozen=True, slots=True)
class CPUAttentionLayout(KVLayout):
    """vLLM's CPU attention backend: per layer ``[num_blocks, num_kv_heads, block_size,
    2 * head_dim]``.

    vLLM calls it ``LBHNC``; its kernels read each head's block as ``block_size`` rows
    of K followed by ``block_size`` rows of V (the tensor viewed as
    ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]``). A block is one
    contiguous run, as in FlashInfer, but the bytes inside are ordered differently,
    so the two never match (the kind differs).
    """

    kind: ClassVar[str] = "cpu_attention"
    block_dim: ClassVar[int] = 0
    kv_parts: ClassVar[int] = 1

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        self._validate_fields()

    def layer_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_dim)

    def segment_numel(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim


_KINDS: Mapping[str, type[KVLayout]] = {
    cls.kind: cls
    for cls in (FlashAttentionLayout, FlashInferLayout, MLALayout, CPUAttentionLayout)
}


def layout_from_wire(d: object) -> KVLayout:
    """Rebuild a layout from :meth:`KVLayout.to_wire` output received from a peer.

    The input is untrusted: anything but a dict with exactly the kind's fields, of
    the right types and within bounds, raises :class:`~aiokv.ConfigError` (and
    nothing else).
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"KV layout must be a dict, got {type(d).__name__}")
    try:
        kind = d.get("kind")
    except Exception:  # a hostile Mapping with unhashable-key tricks
        raise ConfigError("KV layout: unreadable dict") from None
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ConfigError(f"KV layout: unknown kind {kind!r:.64}; known: {sorted(_KINDS)}")
    cls = _KINDS[kind]
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    keys = set()
    for k in d:
        if not isinstance(k, str):
            raise ConfigError(f"KV layout: non-string key {k!r:.64}")
        keys.add(k)
    keys.discard("kind")
    missing = [n for n in names if n not in keys]
    extra = sorted(keys - set(names))
    if missing:
        raise ConfigError(f"KV layout {kind}: missing fields {missing}")
    if extra:
        raise ConfigError(f"KV layout {kind}: unknown fields {[e[:64] for e in extra[:8]]}")
    kwargs: dict[str, Any] = {}
    for n in names:
        v = d[n]
        if n == "dtype":
            if not isinstance(v, str) or v not in DTYPES:
                raise ConfigError(f"KV layout {kind}: dtype {v!r:.64} is not allowed")
        elif type(v) is not int:
            raise ConfigError(f"KV layout {kind}: {n} must be an int, got {type(v).__name__}")
        kwargs[n] = v
    return cls(**kwargs)  # __post_init__ checks the bounds (ConfigError)


def engine_layout_check(
    mine: Mapping[str, str | int], theirs: Mapping[str, str | int]
) -> str | None:
    """The engine's layout check for KV layouts (the default ``EngineConfig.layout_check``).

    The engine carries layouts as opaque wire dicts and asks this function, at each
    HELLO, whether the connecting peer's layout (``theirs``: it sends, so it is the
    producer) can land in this engine's (``mine``: the consumer). Returns None when it
    can, else why not. ``theirs`` is untrusted: anything malformed is a reason, never
    an exception. ``EngineConfig`` also calls it with its own layout twice to validate
    that layout at construction.
    """
    try:
        consumer = layout_from_wire(mine)
        producer = layout_from_wire(theirs)
        check_compatible(producer, consumer)
    except (ConfigError, LayoutMismatchError) as exc:
        return str(exc)[:500]
    return None


def check_compatible(producer: KVLayout, consumer: KVLayout) -> None:
    """Raise :class:`~aiokv.LayoutMismatchError` unless blocks of ``producer`` can land in ``consumer``.

    ``num_blocks`` may differ; the kind and every other field (layers, block size,
    heads, head/latent dim, dtype) must match. The message names the first
    differing field.
    """
    if type(producer) is not type(consumer):
        raise LayoutMismatchError(
            f"KV layout mismatch in field 'kind': producer={producer.kind!r} "
            f"consumer={consumer.kind!r}",
            code="layout_mismatch",
        )
    for name in producer.compat_fields():
        a, b = getattr(producer, name), getattr(consumer, name)
        if a != b:
            raise LayoutMismatchError(
                f"KV layout mismatch in field {name!r}: producer={a!r} consumer={b!r}",
                code="layout_mismatch",
            )


register_default_layout_check(engine_layout_check)
