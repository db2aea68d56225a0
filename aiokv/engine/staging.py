"""Staging: a transfer's tensors checked and described at call time, before any I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from aiokv._exceptions import ConfigError
from aiokv.protocol.messages import TensorSpec
from aiokv.transport.tcp import dtype_name

__all__: list[str] = []

_STRIDED = torch.strided


def _prepare(
    items: Iterable[tuple[str, torch.Tensor]], max_id: int, max_tensors: int = 1 << 30
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    seen: set[str] = set()
    for tid, t in items:
        if not isinstance(tid, str) or not tid or len(tid) > max_id:
            raise ConfigError(f"tensor ids are non-empty strings of at most {max_id} characters")
        if tid in seen:
            raise ConfigError(f"tensor id {tid!r} given twice in one transfer")
        seen.add(tid)
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{tid!r}: expected a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cpu or t.is_cuda) or t.layout is not torch.strided:
            # a meta tensor has no memory (zmq would read address 0); sparse ones no flat bytes
            raise ConfigError(
                f"{tid!r}: only dense CPU or CUDA tensors can be sent, "
                f"got a {t.layout} tensor on {t.device}"
            )
        name = dtype_name(t.dtype)
        if name is None:
            raise ConfigError(f"{tid!r}: dtype {t.dtype} cannot be sent")
        c = t.detach() if t.requires_grad else t  # (a new tensor object costs a little)
        if c.is_cuda and not c.is_contiguous():
            c = c.contiguous()  # on the caller's stream, before its ready event
        # A strided CPU view (an expanded one may stand for gigabytes) is copied only
        # when posted, after the receiver granted room for its size (numel * element
        # size, in its spec): a transfer it refuses copies nothing.
        specs.append(TensorSpec(tid, name, tuple(c.shape)))
        tensors.append(c)
    if not specs:
        raise ConfigError("nothing to send")
    if len(specs) > max_tensors:
        raise ConfigError(
            f"{len(specs)} tensors in one transfer; at most {max_tensors} "
            "(Limits.max_tensors_per_transfer, both ends)"
        )
    return specs, tensors


@dataclass(slots=True)
class _Staged:
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    ready: Any  # torch.cuda.Event for CUDA tensors
    cuda: bool
    strided: bool = False  # a CPU tensor is a non-contiguous view, made dense when posted
