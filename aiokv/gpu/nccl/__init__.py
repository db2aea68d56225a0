"""NCCL / RCCL: library discovery and binding (:mod:`.library`), communicators (:mod:`.comm`)."""

from __future__ import annotations

from aiokv.gpu.nccl.comm import Communicator, get_unique_id
from aiokv.gpu.nccl.library import (
    DTYPE_MAP,
    ENV_SO_PATH,
    LoadAttempt,
    NcclConfig,
    NcclLibrary,
    NcclUniqueId,
    candidate_paths,
    find_library,
    load_library,
    nccl_dtype,
    result_name,
)

__all__ = [
    "DTYPE_MAP",
    "ENV_SO_PATH",
    "Communicator",
    "LoadAttempt",
    "NcclConfig",
    "NcclLibrary",
    "NcclUniqueId",
    "candidate_paths",
    "find_library",
    "get_unique_id",
    "load_library",
    "nccl_dtype",
    "result_name",
]
