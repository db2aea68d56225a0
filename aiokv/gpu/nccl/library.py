"""Find the NCCL / RCCL shared library and bind the part of its C API aiokv uses.

Discovery order (first that loads wins; :func:`find_library` records every
attempt and why it failed, and :class:`NcclUnavailableError` lists them all):

1. ``AIOKV_NCCL_SO_PATH`` — a file, or a directory holding the backend's soname;
2. the NCCL that the installed torch ships: ``nvidia/nccl/lib/libnccl.so.2`` of
   the ``nvidia-nccl-cu*`` wheel (found through importlib, ``site`` and
   ``sys.path``), then ``torch/lib``;
3. the plain soname through the dynamic loader: ``libnccl.so.2`` for CUDA,
   ``librccl.so.1`` for ROCm (``torch.version.hip``).

The binding is a declarative table (:data:`FUNCTIONS`): name, result type,
argument types, and whether the symbol may be missing in older releases.
Every call result is checked; a failure raises :class:`~aiokv.NcclError`
carrying the result's name (``ncclSystemError``, ...) and NCCL's own message
(``ncclGetLastError``, else ``ncclGetErrorString``).

Per-communicator settings travel in :class:`NcclConfig` (``ncclConfig_t``);
this module never reads-for-writing or mutates ``os.environ``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import site
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiokv._exceptions import NcclError, NcclUnavailableError

__all__ = [
    "CONFIG_LAYOUT_VERSION",
    "DTYPE_MAP",
    "ENV_SO_PATH",
    "FP8_MIN_VERSION",
    "FUNCTIONS",
    "MIN_NONBLOCKING_VERSION",
    "RESULT_NAMES",
    "CFunction",
    "LoadAttempt",
    "NcclConfig",
    "NcclLibrary",
    "NcclUniqueId",
    "candidate_paths",
    "decode_version",
    "find_library",
    "load_library",
    "mapped_dtypes",
    "nccl_dtype",
    "result_name",
]

ENV_SO_PATH = "AIOKV_NCCL_SO_PATH"

# --------------------------------------------------------------------------- C types

ncclResult_t = ctypes.c_int
ncclDataType_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p

NCCL_UNIQUE_ID_BYTES = 128
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
NCCL_API_MAGIC = 0xCAFEBEEF


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclConfig(ctypes.Structure):
    """``ncclConfig_t`` with the field order of NCCL 2.28's ``ncclConfig_v22800``.

    NCCL's config is append-only and versioned: the library copies
    ``min(size, sizeof its own struct)`` bytes and resets fields newer than
    ``version`` to their defaults, so this layout works with any NCCL ≥ 2.14.
    Build one with :meth:`initializer` (what ``NCCL_CONFIG_INITIALIZER`` does).
    """

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
        ("nChannelsPerNetPeer", ctypes.c_int),
        ("nvlinkCentricSched", ctypes.c_int),
    ]

    @classmethod
    def initializer(cls) -> NcclConfig:
        """Every user field unset (``NCCL_CONFIG_UNDEF_INT`` / NULL), header fields set."""
        cfg = cls()
        cfg.size = ctypes.sizeof(cls)
        cfg.magic = NCCL_API_MAGIC
        cfg.version = CONFIG_LAYOUT_VERSION
        for field in cls._fields_[3:]:
            name, ctype = field[0], field[1]
            if ctype is ctypes.c_int:
                setattr(cfg, name, NCCL_CONFIG_UNDEF_INT)
            else:
                setattr(cfg, name, None)
        return cfg


#: ``NCCL_VERSION_CODE`` of the header whose ``ncclConfig_t`` layout :class:`NcclConfig` mirrors.
CONFIG_LAYOUT_VERSION = 22800
#: ncclCommInitRankConfig, ``blocking = 0`` and ncclCommFinalize appeared in 2.14.
MIN_NONBLOCKING_VERSION = 21400
#: ncclFloat8e4m3 / ncclFloat8e5m2.
FP8_MIN_VERSION = 22400

# ncclResult_t
SUCCESS = 0
IN_PROGRESS = 7
RESULT_NAMES: dict[int, str] = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}


def result_name(code: int) -> str:
    return RESULT_NAMES.get(code, f"ncclResult({code})")


# --------------------------------------------------------------------------- dtypes

# ncclDataType_t values
_INT8, _UINT8, _INT32, _UINT32, _INT64, _UINT64 = 0, 1, 2, 3, 4, 5
_FLOAT16, _FLOAT32, _FLOAT64, _BFLOAT16, _FP8_E4M3, _FP8_E5M2 = 6, 7, 8, 9, 10, 11

#: torch dtype → ncclDataType_t. ``torch.bool`` travels as ``ncclUint8`` (one byte
#: per element on both sides; point-to-point moves bytes, nothing is reduced).
DTYPE_MAP: dict[torch.dtype, int] = {
    torch.int8: _INT8,
    torch.uint8: _UINT8,
    torch.bool: _UINT8,
    torch.int32: _INT32,
    torch.int64: _INT64,
    torch.float16: _FLOAT16,
    torch.float32: _FLOAT32,
    torch.float64: _FLOAT64,
    torch.bfloat16: _BFLOAT16,
}
_FP8_MAP: dict[torch.dtype, int] = {}
for _name, _code in (("float8_e4m3fn", _FP8_E4M3), ("float8_e5m2", _FP8_E5M2)):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _FP8_MAP[_dt] = _code
for _name, _code in (("uint32", _UINT32), ("uint64", _UINT64)):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_MAP[_dt] = _code


def mapped_dtypes() -> tuple[torch.dtype, ...]:
    """Every torch dtype with an NCCL mapping (fp8 ones need NCCL >= 2.24 to be sent)."""
    return (*DTYPE_MAP, *_FP8_MAP)


def nccl_dtype(dtype: torch.dtype, version: int) -> int:
    """The ``ncclDataType_t`` for ``dtype`` on an NCCL of ``version`` (a version code).

    fp8 (e4m3fn, e5m2) needs NCCL ≥ 2.24. Anything else not in :data:`DTYPE_MAP`
    raises :class:`NcclError` (``ncclInvalidArgument``); send such a tensor as
    ``tensor.view(torch.uint8)`` instead.
    """
    code = DTYPE_MAP.get(dtype)
    if code is not None:
        return code
    code = _FP8_MAP.get(dtype)
    if code is not None:
        if version >= FP8_MIN_VERSION:
            return code
        raise NcclError(
            f"{dtype} needs NCCL >= 2.24 (this library is {_fmt_version(version)}); "
            "send tensor.view(torch.uint8) instead",
            code=4,
            code_name="ncclInvalidArgument",
        )
    supported = sorted(str(d) for d in (*DTYPE_MAP, *_FP8_MAP))
    raise NcclError(
        f"NCCL has no data type for {dtype}; supported: {', '.join(supported)}. "
        "Send tensor.view(torch.uint8) to move its raw bytes.",
        code=4,
        code_name="ncclInvalidArgument",
    )


def decode_version(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE → (major, minor, patch); before 2.9 the code was X*1000+Y*100+Z."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def _fmt_version(code: int) -> str:
    major, minor, patch = decode_version(code)
    return f"{major}.{minor}.{patch}"


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class CFunction:
    """One C function of the binding: its signature and when it appeared."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    optional: bool = False  # missing in older releases; callers check NcclLibrary.has()


_P = ctypes.POINTER

FUNCTIONS: tuple[CFunction, ...] = (
    CFunction("ncclGetVersion", ncclResult_t, (_P(ctypes.c_int),)),
    CFunction("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    CFunction("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,), optional=True),  # 2.13
    CFunction("ncclGetUniqueId", ncclResult_t, (_P(NcclUniqueId),)),
    CFunction(
        "ncclCommInitRank",
        ncclResult_t,
        (_P(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int),
    ),
    CFunction(
        "ncclCommInitRankConfig",  # 2.14
        ncclResult_t,
        (_P(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int, _P(NcclConfig)),
        optional=True,
    ),
    CFunction(
        "ncclSend",
        ncclResult_t,
        (ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    CFunction(
        "ncclRecv",
        ncclResult_t,
        (ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t),
    ),
    CFunction("ncclGroupStart", ncclResult_t, ()),
    CFunction("ncclGroupEnd", ncclResult_t, ()),
    CFunction("ncclCommGetAsyncError", ncclResult_t, (ncclComm_t, _P(ncclResult_t))),
    CFunction("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
    CFunction("ncclCommFinalize", ncclResult_t, (ncclComm_t,), optional=True),  # 2.14
    CFunction("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
)


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True, slots=True)
class LoadAttempt:
    """One place :func:`find_library` looked, and what happened there."""

    source: str  # "env", "nvidia-nccl wheel", "torch/lib", "soname"
    path: str
    error: str | None  # None: loaded


def _is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def _soname() -> str:
    return "librccl.so.1" if _is_rocm() else "libnccl.so.2"


def _site_dirs() -> Iterator[Path]:
    seen: set[str] = set()
    dirs: list[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # some virtualenv flavours
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    # other sys.path entries only where they are package directories (venvs, --target dirs)
    dirs.extend(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")))
    for d in dirs:
        if d and d not in seen and os.path.isdir(d):
            seen.add(d)
            yield Path(d)


def _wheel_dirs() -> list[Path]:
    """``.../nvidia/nccl/lib`` (CUDA) or ``.../rccl/lib`` candidates, best first."""
    out: list[Path] = []
    if not _is_rocm():
        try:
            spec = importlib.util.find_spec("nvidia.nccl")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            out.extend(Path(p) / "lib" for p in spec.submodule_search_locations)
        out.extend(d / "nvidia" / "nccl" / "lib" for d in _site_dirs())
    # de-duplicate, keep order
    uniq: list[Path] = []
    for p in out:
        if p not in uniq:
            uniq.append(p)
    return uniq


def _torch_lib_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def candidate_paths(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(source, path)`` pairs in discovery order; a soname is loaded through the loader.

    ``env`` defaults to ``os.environ`` (read only).
    """
    environ = os.environ if env is None else env
    soname = _soname()
    out: list[tuple[str, str]] = []
    override = importlib.import_module("aiokv.envs").get(ENV_SO_PATH, environ)
    if override:
        p = Path(override)
        out.append(("env", str(p / soname) if p.is_dir() else override))
    for d in _wheel_dirs():
        out.append(("nvidia-nccl wheel", str(d / soname)))
    tl = _torch_lib_dir()
    if tl is not None:
        out.append(("torch/lib", str(tl / soname)))
    out.append(("soname", soname))
    return out


Loader = Callable[[str], Any]


def _default_loader(path: str) -> Any:
    return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def find_library(
    env: dict[str, str] | None = None, loader: Loader = _default_loader
) -> tuple[Any, str, list[LoadAttempt]]:
    """Load the first candidate that works: ``(handle, path, attempts)``.

    Raises :class:`NcclUnavailableError` naming every path tried and why it failed.
    Files that do not exist are reported without asking the loader.
    """
    attempts: list[LoadAttempt] = []
    for source, path in candidate_paths(env):
        if source != "soname" and not os.path.exists(path):
            attempts.append(LoadAttempt(source, path, "no such file"))
            continue
        try:
            handle = loader(path)
        except OSError as exc:
            attempts.append(LoadAttempt(source, path, str(exc) or type(exc).__name__))
            continue
        attempts.append(LoadAttempt(source, path, None))
        return handle, path, attempts
    raise NcclUnavailableError(_unavailable_message(attempts))


def _unavailable_message(attempts: list[LoadAttempt]) -> str:
    lib = "RCCL" if _is_rocm() else "NCCL"
    lines = [f"no {lib} library could be loaded; tried, in order:"]
    for a in attempts:
        lines.append(f"  [{a.source}] {a.path}: {a.error}")
    lines.append(
        f"Install the NCCL your torch build expects (pip wheel nvidia-nccl-cu12/cu13) or set "
        f"{ENV_SO_PATH} to the library file."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- binding


class NcclLibrary:
    """A loaded NCCL with the :data:`FUNCTIONS` table bound and its version known.

    ``handle`` is a ``ctypes.CDLL`` or any object with those attributes (tests
    pass a fake). Raw functions are reachable as attributes
    (``lib.ncclSend(...)``); the checked helpers below are what aiokv uses.
    """

    def __init__(self, handle: Any, path: str = "<unknown>") -> None:
        self.path = path
        self._handle = handle
        self._fns: dict[str, Any] = {}
        missing: list[str] = []
        for fn in FUNCTIONS:
            try:
                f = getattr(handle, fn.name)
            except AttributeError:
                if fn.optional:
                    continue
                missing.append(fn.name)
                continue
            f.restype = fn.restype
            f.argtypes = list(fn.argtypes)
            self._fns[fn.name] = f
        if missing:
            raise NcclUnavailableError(
                f"{path} lacks required NCCL symbols: {', '.join(missing)} (not an NCCL library?)"
            )
        v = ctypes.c_int(0)
        rc = int(self._fns["ncclGetVersion"](ctypes.byref(v)))
        if rc != SUCCESS:
            raise NcclUnavailableError(
                f"ncclGetVersion failed in {path}: {result_name(rc)}",
                code=rc,
                code_name=result_name(rc),
            )
        self.version: int = int(v.value)

    def __getattr__(self, name: str) -> Any:
        fns = self.__dict__.get("_fns")
        if fns is not None and name in fns:
            return fns[name]
        raise AttributeError(name)

    # ---------------------------------------------------------------- info
    @property
    def version_string(self) -> str:
        return _fmt_version(self.version)

    def has(self, name: str) -> bool:
        return name in self._fns

    def supports_nonblocking(self) -> bool:
        return (
            self.version >= MIN_NONBLOCKING_VERSION
            and self.has("ncclCommInitRankConfig")
            and self.has("ncclCommFinalize")
        )

    def require_nonblocking(self) -> None:
        """Raise unless this NCCL has config-based, non-blocking communicators (≥ 2.14)."""
        if not self.supports_nonblocking():
            raise NcclUnavailableError(
                f"NCCL {self.version_string} at {self.path} is too old: aiokv needs NCCL >= 2.14 "
                "(ncclCommInitRankConfig, non-blocking communicators, ncclCommFinalize). "
                f"Point {ENV_SO_PATH} at a newer libnccl.so.2."
            )

    def dtype(self, dtype: torch.dtype) -> int:
        return nccl_dtype(dtype, self.version)

    # ---------------------------------------------------------------- errors
    def error_string(self, code: int) -> str:
        try:
            s = self._fns["ncclGetErrorString"](code)
        except Exception:  # never mask the original failure
            return ""
        return s.decode(errors="replace") if isinstance(s, bytes) else str(s or "")

    def last_error(self, comm: int | None = None) -> str:
        f = self._fns.get("ncclGetLastError")
        if f is None:
            return ""
        try:
            s = f(comm)
        except Exception:
            return ""
        return s.decode(errors="replace") if isinstance(s, bytes) else str(s or "")

    def error(self, code: int, what: str, comm: int | None = None) -> NcclError:
        """The :class:`NcclError` for result ``code`` of ``what``, with NCCL's messages."""
        name = result_name(code)
        parts = [f"{what} failed: {name} ({code})"]
        es = self.error_string(code)
        if es:
            parts.append(es)
        last = self.last_error(comm)
        if last and last != es:
            parts.append(f"last error: {last}")
        return NcclError(": ".join(parts), code=code, code_name=name)

    def check(
        self, code: int, what: str, comm: int | None = None, *, allow_in_progress: bool = False
    ) -> int:
        """Return ``code`` if it is success (or in-progress when allowed), else raise."""
        code = int(code)
        if code == SUCCESS or (allow_in_progress and code == IN_PROGRESS):
            return code
        raise self.error(code, what, comm)

    # ---------------------------------------------------------------- checked calls
    def get_unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self._fns["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES))

    @staticmethod
    def unique_id_from_bytes(data: bytes) -> NcclUniqueId:
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise NcclError(
                f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}",
                code=4,
                code_name="ncclInvalidArgument",
            )
        uid = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), data, NCCL_UNIQUE_ID_BYTES)
        return uid

    def make_config(
        self,
        *,
        blocking: bool,
        max_ctas: int | None = None,
        min_ctas: int | None = None,
        comm_name: bytes | None = None,
    ) -> NcclConfig:
        """An ``ncclConfig_t`` as ``NCCL_CONFIG_INITIALIZER`` builds it, plus our settings."""
        self.require_nonblocking()
        cfg = NcclConfig.initializer()
        cfg.blocking = 1 if blocking else 0
        if max_ctas is not None:
            if max_ctas < 1:
                raise NcclError(
                    f"max_ctas must be >= 1, got {max_ctas}",
                    code=4,
                    code_name="ncclInvalidArgument",
                )
            cfg.maxCTAs = max_ctas
        if min_ctas is not None:
            cfg.minCTAs = min_ctas
        if comm_name is not None:
            cfg.commName = comm_name
        return cfg

    def comm_async_error(self, comm: int) -> int:
        """``ncclCommGetAsyncError``: the comm's state (0, ncclInProgress, or an error)."""
        state = ncclResult_t(0)
        self.check(
            self._fns["ncclCommGetAsyncError"](comm, ctypes.byref(state)),
            "ncclCommGetAsyncError",
            comm,
        )
        return int(state.value)


_lock = threading.Lock()
_cache: dict[str | None, NcclLibrary] = {}


def load_library(path: str | None = None) -> NcclLibrary:
    """The process-wide :class:`NcclLibrary` (discovered once), or the one at ``path``."""
    with _lock:
        lib = _cache.get(path)
        if lib is not None:
            return lib
        if path is None:
            handle, found, _ = find_library()
        else:
            try:
                handle = _default_loader(path)
            except OSError as exc:
                raise NcclUnavailableError(f"could not load {path}: {exc}") from exc
            found = path
        lib = NcclLibrary(handle, found)
        _cache[path] = lib
        return lib
