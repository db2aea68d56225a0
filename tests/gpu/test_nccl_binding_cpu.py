"""CPU-only tests of the NCCL layers: discovery, binding, errors, dtypes, Communicator, poller.

No GPU and no real NCCL: the library is a fake object whose functions are plain
Python callables with the C signatures' behaviour.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():  # CPU torch without numpy warns at import (filterwarnings=error)
    warnings.simplefilter("ignore", UserWarning)
    import torch

from aiokv._exceptions import (
    AiokvTimeoutError,
    ConfigError,
    EngineClosedError,
    NcclError,
    NcclUnavailableError,
    TransferAbortedError,
)
from aiokv.gpu.cuda import ProgressPoller
from aiokv.gpu.nccl import library as L
from aiokv.gpu.nccl.comm import Communicator, get_unique_id

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


# --------------------------------------------------------------------------- fake NCCL


class FakeNccl:
    """Builds a namespace of plain functions (ctypes-like: attributes can be set on them)."""

    def __init__(self, version: int = 22809, drop: tuple[str, ...] = ()) -> None:
        self.version = version
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.init_rc = 7  # ncclInProgress
        self.states: list[int] = [7, 7, 0]  # successive ncclCommGetAsyncError answers
        self.op_rc = 0
        self.finalize_states: list[int] | None = None
        self.last_error = b"fake: peer went away"
        self.ns = types.SimpleNamespace()
        for name in [f.name for f in L.FUNCTIONS]:
            if name not in drop:
                setattr(self.ns, name, self._make(name))

    def _make(self, name: str) -> Callable[..., Any]:
        impl = getattr(self, "_" + name)

        def fn(*args: Any) -> Any:
            self.calls.append((name, args))
            return impl(*args)

        fn.__name__ = name
        return fn

    def called(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    # the C functions
    def _ncclGetVersion(self, ref: Any) -> int:
        ref._obj.value = self.version
        return 0

    def _ncclGetErrorString(self, code: int) -> bytes:
        return f"fake error string {code}".encode()

    def _ncclGetLastError(self, comm: Any) -> bytes:
        return self.last_error

    def _ncclGetUniqueId(self, ref: Any) -> int:
        ctypes.memmove(ctypes.addressof(ref._obj), bytes(range(128)), 128)
        return 0

    def _ncclCommInitRank(self, *a: Any) -> int:
        return 0

    def _ncclCommInitRankConfig(
        self, comm_ref: Any, nranks: int, uid: Any, rank: int, cfg_ref: Any
    ) -> int:
        self.config = L.NcclConfig.from_buffer_copy(cfg_ref._obj)
        comm_ref._obj.value = 0xC0FFEE
        return self.init_rc

    def _ncclSend(self, *a: Any) -> int:
        return self.op_rc

    def _ncclRecv(self, *a: Any) -> int:
        return self.op_rc

    def _ncclGroupStart(self) -> int:
        return 0

    def _ncclGroupEnd(self) -> int:
        return self.op_rc

    def _ncclCommGetAsyncError(self, comm: Any, ref: Any) -> int:
        states = self.finalize_states if self.finalize_states is not None else self.states
        ref._obj.value = states.pop(0) if len(states) > 1 else states[0]
        return 0

    def _ncclCommAbort(self, comm: Any) -> int:
        return 0

    def _ncclCommFinalize(self, comm: Any) -> int:
        if self.finalize_states is None:
            self.finalize_states = [7, 0]
        return 7

    def _ncclCommDestroy(self, comm: Any) -> int:
        return 0


def make_lib(**kw: Any) -> tuple[FakeNccl, L.NcclLibrary]:
    fake = FakeNccl(**kw)
    return fake, L.NcclLibrary(fake.ns, "/fake/libnccl.so.2")


class FakeStream:
    cuda_stream = 0x1234


async def aborted_calls(fake: FakeNccl, n: int = 1) -> int:
    """ncclCommAbort runs on a helper thread: wait (bounded) until it was called."""
    for _ in range(200):
        if fake.called("ncclCommAbort") >= n:
            break
        await asyncio.sleep(0.005)
    return fake.called("ncclCommAbort")


# --------------------------------------------------------------------------- discovery


def test_candidate_order_env_first(tmp_path: Path) -> None:
    so = tmp_path / "libnccl.so.2"
    so.write_bytes(b"")
    before = dict(os.environ)
    cands = L.candidate_paths({L.ENV_SO_PATH: str(so)})
    assert cands[0] == ("env", str(so))
    sources = [s for s, _ in cands]
    assert sources[-1] == "soname" and cands[-1][1] == "libnccl.so.2"
    # the torch-shipped locations come between the override and the soname
    assert sources.index("torch/lib") < sources.index("soname")
    wheel = [i for i, s in enumerate(sources) if s == "nvidia-nccl wheel"]
    assert all(0 < i < sources.index("torch/lib") for i in wheel)
    assert dict(os.environ) == before  # never mutated


def test_env_directory_gets_soname(tmp_path: Path) -> None:
    cands = L.candidate_paths({L.ENV_SO_PATH: str(tmp_path)})
    assert cands[0] == ("env", str(tmp_path / "libnccl.so.2"))


def test_rocm_uses_rccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    cands = L.candidate_paths({})
    assert cands[-1] == ("soname", "librccl.so.1")
    assert not any(s == "nvidia-nccl wheel" for s, _ in cands)


def test_find_library_lists_every_attempt(tmp_path: Path) -> None:
    so = tmp_path / "libnccl.so.2"
    so.write_bytes(b"not an elf")

    def loader(path: str) -> Any:
        raise OSError(f"cannot load {path}: invalid ELF header")

    with pytest.raises(NcclUnavailableError) as ei:
        L.find_library({L.ENV_SO_PATH: str(so)}, loader=loader)
    msg = str(ei.value)
    for _source, path in L.candidate_paths({L.ENV_SO_PATH: str(so)}):
        assert path in msg
    assert "invalid ELF header" in msg
    assert "[env]" in msg and "[soname]" in msg and "[torch/lib]" in msg
    assert L.ENV_SO_PATH in msg


def test_find_library_takes_first_that_loads(tmp_path: Path) -> None:
    so = tmp_path / "libnccl.so.2"
    so.write_bytes(b"")
    loaded: list[str] = []

    def loader(path: str) -> Any:
        loaded.append(path)
        return "handle"

    handle, path, attempts = L.find_library({L.ENV_SO_PATH: str(so)}, loader=loader)
    assert (handle, path) == ("handle", str(so))
    assert loaded == [str(so)] and attempts[-1].error is None


def test_missing_files_are_not_handed_to_loader(tmp_path: Path) -> None:
    seen: list[str] = []

    def loader(path: str) -> Any:
        seen.append(path)
        raise OSError("nope")

    with pytest.raises(NcclUnavailableError) as ei:
        L.find_library({L.ENV_SO_PATH: str(tmp_path / "missing.so")}, loader=loader)
    # only existing files and the bare soname ever reach the dynamic loader
    assert seen[-1] == "libnccl.so.2"
    assert all(os.path.exists(p) for p in seen[:-1])
    assert "missing.so: no such file" in str(ei.value)


# --------------------------------------------------------------------------- binding


def test_binding_sets_signatures_and_version() -> None:
    fake, lib = make_lib()
    assert lib.version == 22809 and lib.version_string == "2.28.9"
    assert lib.path == "/fake/libnccl.so.2"
    for f in L.FUNCTIONS:
        fn = getattr(fake.ns, f.name)
        assert fn.restype is f.restype
        assert fn.argtypes == list(f.argtypes)
    assert lib.supports_nonblocking()
    lib.require_nonblocking()


def test_missing_required_symbol() -> None:
    with pytest.raises(NcclUnavailableError, match="ncclSend"):
        make_lib(drop=("ncclSend",))


def test_missing_optional_symbols_and_version_gate() -> None:
    _, lib = make_lib(version=21300, drop=("ncclCommInitRankConfig", "ncclCommFinalize"))
    assert not lib.has("ncclCommInitRankConfig")
    assert not lib.supports_nonblocking()
    with pytest.raises(NcclUnavailableError, match=r"2\.13\.0.*needs NCCL >= 2\.14"):
        lib.require_nonblocking()
    with pytest.raises(NcclUnavailableError):
        lib.make_config(blocking=False)


def test_old_version_code_format() -> None:
    assert L.decode_version(2708) == (2, 7, 8)
    assert L.decode_version(21903) == (2, 19, 3)
    assert L.decode_version(22809) == (2, 28, 9)


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (1, "ncclUnhandledCudaError"),
        (2, "ncclSystemError"),
        (3, "ncclInternalError"),
        (4, "ncclInvalidArgument"),
        (5, "ncclInvalidUsage"),
        (6, "ncclRemoteError"),
    ],
)
def test_errors_carry_code_name_and_message(code: int, name: str) -> None:
    _, lib = make_lib()
    with pytest.raises(NcclError) as ei:
        lib.check(code, "ncclSend")
    e = ei.value
    assert e.code == code and e.code_name == name
    assert "ncclSend" in str(e) and f"fake error string {code}" in str(e)
    assert "fake: peer went away" in str(e)
    assert lib.check(0, "x") == 0
    assert lib.check(7, "x", allow_in_progress=True) == 7
    with pytest.raises(NcclError) as ei2:
        lib.check(7, "x")
    assert ei2.value.code_name == "ncclInProgress"


def test_error_without_get_last_error() -> None:
    _, lib = make_lib(drop=("ncclGetLastError",))
    e = lib.error(2, "ncclRecv")
    assert e.code_name == "ncclSystemError" and "last error" not in str(e)


def test_unique_id() -> None:
    _, lib = make_lib()
    uid = lib.get_unique_id()
    assert uid == bytes(range(128))
    assert get_unique_id(lib) == uid
    assert ctypes.sizeof(L.NcclUniqueId) == 128
    assert bytes(L.NcclLibrary.unique_id_from_bytes(uid)) == uid
    with pytest.raises(NcclError, match="128 bytes"):
        L.NcclLibrary.unique_id_from_bytes(b"short")


def test_config_layout_matches_nccl_header() -> None:
    C = L.NcclConfig
    assert ctypes.sizeof(C) == 80
    offs = {name: getattr(C, name).offset for name, *_ in C._fields_}
    assert offs["magic"] == 8 and offs["version"] == 12 and offs["blocking"] == 16
    assert offs["maxCTAs"] == 28 and offs["netName"] == 32 and offs["splitShare"] == 40
    assert offs["commName"] == 48 and offs["nvlinkCentricSched"] == 76
    cfg = C.initializer()
    assert cfg.size == 80 and cfg.magic == 0xCAFEBEEF and cfg.version == L.CONFIG_LAYOUT_VERSION
    assert cfg.blocking == cfg.maxCTAs == cfg.nvlsCTAs == -(2**31)
    assert cfg.netName is None and cfg.commName is None


def test_make_config_sets_per_comm_settings_not_env() -> None:
    _, lib = make_lib()
    before = dict(os.environ)
    cfg = lib.make_config(blocking=False, max_ctas=8)
    assert cfg.blocking == 0 and cfg.maxCTAs == 8 and cfg.minCTAs == -(2**31)
    assert dict(os.environ) == before
    with pytest.raises(NcclError):
        lib.make_config(blocking=False, max_ctas=0)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("dtype", "code"),
    [
        (torch.int8, 0),
        (torch.uint8, 1),
        (torch.int32, 2),
        (torch.int64, 4),
        (torch.float16, 6),
        (torch.float32, 7),
        (torch.float64, 8),
        (torch.bfloat16, 9),
        (torch.bool, 1),  # documented: bool travels as uint8 bytes
    ],
)
def test_dtype_map(dtype: torch.dtype, code: int) -> None:
    assert L.nccl_dtype(dtype, 22809) == code


def test_fp8_needs_2_24() -> None:
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert L.nccl_dtype(e4, 22400) == 10
    assert L.nccl_dtype(e5, 22809) == 11
    with pytest.raises(NcclError, match=r"2\.24") as ei:
        L.nccl_dtype(e4, 22304)
    assert ei.value.code_name == "ncclInvalidArgument"


def test_unsupported_dtype_error_names_alternatives() -> None:
    with pytest.raises(NcclError) as ei:
        L.nccl_dtype(torch.complex64, 22809)
    msg = str(ei.value)
    assert "complex64" in msg and "torch.bfloat16" in msg and "view(torch.uint8)" in msg


# --------------------------------------------------------------------------- Communicator


def cpu_comm(lib: L.NcclLibrary, timeout: float = 1.0) -> Communicator:
    return Communicator(
        lib, 0xC0FFEE, rank=0, nranks=2, device=torch.device("cpu"), timeout=timeout
    )


@pytest.mark.anyio
async def test_create_polls_non_blocking_init() -> None:
    fake, lib = make_lib()
    fake.states = [7, 7, 7, 0]
    c = await Communicator.create(
        bytes(128), 0, 2, torch.device("cuda:0"), timeout=5, max_ctas=4, lib=lib
    )
    assert c.handle == 0xC0FFEE and not c.closed
    assert fake.config.blocking == 0 and fake.config.maxCTAs == 4
    assert fake.config.magic == 0xCAFEBEEF
    assert fake.called("ncclCommGetAsyncError") >= 4


@pytest.mark.anyio
async def test_create_times_out_and_aborts() -> None:
    fake, lib = make_lib()
    fake.states = [7]
    t0 = time.monotonic()
    with pytest.raises(AiokvTimeoutError, match="did not finish within"):
        await Communicator.create(bytes(128), 1, 2, torch.device("cuda:0"), timeout=0.2, lib=lib)
    assert time.monotonic() - t0 < 2
    assert await aborted_calls(fake) == 1


@pytest.mark.anyio
async def test_create_async_error_raises_nccl_error_and_aborts() -> None:
    fake, lib = make_lib()
    fake.states = [7, 6]
    with pytest.raises(NcclError) as ei:
        await Communicator.create(bytes(128), 0, 2, torch.device("cuda:0"), timeout=5, lib=lib)
    assert ei.value.code_name == "ncclRemoteError"
    assert await aborted_calls(fake) == 1


@pytest.mark.anyio
async def test_create_immediate_failure() -> None:
    fake, lib = make_lib()
    fake.init_rc = 2
    with pytest.raises(NcclError) as ei:
        await Communicator.create(bytes(128), 0, 2, torch.device("cuda:0"), timeout=5, lib=lib)
    assert ei.value.code_name == "ncclSystemError"


@pytest.mark.anyio
async def test_create_argument_checks() -> None:
    _, lib = make_lib()
    with pytest.raises(ConfigError):
        await Communicator.create(bytes(128), 2, 2, torch.device("cuda:0"), timeout=1, lib=lib)
    with pytest.raises(ConfigError):
        await Communicator.create(bytes(128), 0, 2, torch.device("cpu"), timeout=1, lib=lib)
    with pytest.raises(NcclError, match="128 bytes"):
        await Communicator.create(b"x", 0, 2, torch.device("cuda:0"), timeout=1, lib=lib)


@pytest.mark.anyio
async def test_send_recv_enqueue_and_in_progress() -> None:
    fake, lib = make_lib()
    c = cpu_comm(lib)
    t = torch.arange(10, dtype=torch.bfloat16)
    assert c.send(t, 1, FakeStream()) == 0  # type: ignore[arg-type]
    name, args = fake.calls[-1]
    assert name == "ncclSend" and args[1:] == (10, 9, 1, 0xC0FFEE, 0x1234)
    assert args[0] == t.data_ptr()
    fake.op_rc = 7
    assert c.recv(t, 1, FakeStream()) == 7  # type: ignore[arg-type]
    assert c.pending
    fake.states = [7]
    with pytest.raises(NcclError) as ei:
        c.send(t, 1, FakeStream())  # type: ignore[arg-type]
    assert ei.value.code_name == "ncclInvalidUsage"
    fake.states = [7, 0]
    await c.wait_ready()
    assert not c.pending


def test_send_argument_errors() -> None:
    fake, lib = make_lib()
    c = cpu_comm(lib)
    with pytest.raises(ConfigError, match="contiguous"):
        c.send(torch.zeros(4, 4).t(), 1, FakeStream())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="peer"):
        c.send(torch.zeros(4), 0, FakeStream())  # type: ignore[arg-type]
    with pytest.raises(NcclError, match="complex"):
        c.send(torch.zeros(4, dtype=torch.complex64), 1, FakeStream())  # type: ignore[arg-type]
    fake.op_rc = 4
    with pytest.raises(NcclError) as ei:
        c.send(torch.zeros(4), 1, FakeStream())  # type: ignore[arg-type]
    assert ei.value.code_name == "ncclInvalidArgument"


def test_group_balances_on_error() -> None:
    fake, lib = make_lib()
    c = cpu_comm(lib)
    with pytest.raises(RuntimeError), c.group():
        c.send(torch.zeros(2), 1, FakeStream())  # type: ignore[arg-type]
        raise RuntimeError("boom")
    assert fake.called("ncclGroupStart") == fake.called("ncclGroupEnd") == 1
    fake.op_rc = 7
    with c.group():
        pass
    assert c.pending


@pytest.mark.anyio
async def test_abort_is_prompt_idempotent_and_final() -> None:
    fake, lib = make_lib()
    slow = fake.ns.ncclCommAbort

    def slow_abort(comm: Any) -> int:  # NCCL 2.28 takes ~0.5 s here
        time.sleep(0.3)
        return int(slow(comm))

    slow_abort.restype = slow.restype  # type: ignore[attr-defined]
    lib._fns["ncclCommAbort"] = slow_abort
    c = cpu_comm(lib)
    t0 = time.perf_counter()
    c.abort()
    c.abort()
    assert time.perf_counter() - t0 < 0.1  # the loop is not blocked by the C call
    assert c.aborted and c.closed and c.abort_call_s is not None and c.abort_call_s < 0.1
    assert c.async_error() == 5
    with pytest.raises(TransferAbortedError):
        c.send(torch.zeros(2), 1, FakeStream())  # type: ignore[arg-type]
    with pytest.raises(TransferAbortedError):
        c.check()
    assert not await c.wait_aborted(timeout=0.01)
    assert await c.wait_aborted(timeout=5)
    assert fake.called("ncclCommAbort") == 1
    assert c.last_abort_s is not None and c.last_abort_s >= 0.3


@pytest.mark.anyio
async def test_aclose_finalizes_then_destroys() -> None:
    fake, lib = make_lib()
    c = cpu_comm(lib)
    await c.aclose()
    assert fake.called("ncclCommFinalize") == 1 and fake.called("ncclCommDestroy") == 1
    assert fake.called("ncclCommAbort") == 0 and c.closed and not c.aborted
    await c.aclose()  # idempotent


@pytest.mark.anyio
async def test_aclose_falls_back_to_abort() -> None:
    fake, lib = make_lib()
    c = cpu_comm(lib)
    fake.finalize_states = [7]  # never quiescent: the peer does not finalize
    t0 = time.monotonic()
    await c.aclose(timeout=0.2)
    assert time.monotonic() - t0 < 2
    assert fake.called("ncclCommAbort") == 1 and fake.called("ncclCommDestroy") == 0
    assert c.aborted


# --------------------------------------------------------------------------- ProgressPoller


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class FakeComm:
    def __init__(self) -> None:
        self.state = 0
        self.aborted = False

    def async_error(self) -> int:
        return self.state


async def fire_later(ev: FakeEvent, delay: float) -> None:
    await asyncio.sleep(delay)
    ev.done = True


@pytest.mark.anyio
async def test_poller_resolves_and_parks() -> None:
    p = ProgressPoller()
    ev = FakeEvent()
    fut = p.wait(ev)
    t0 = time.perf_counter()
    task = asyncio.ensure_future(fire_later(ev, 0.01))
    await asyncio.wait_for(fut, 5)
    assert time.perf_counter() - t0 < 1
    await task
    await asyncio.sleep(0.05)
    st = p.statistics()
    assert st.completed == 1 and st.pending == 0 and st.parks >= 1
    passes = st.passes
    await asyncio.sleep(0.1)  # idle: parked, no polling at all
    assert p.statistics().passes == passes
    await p.stop()


@pytest.mark.anyio
async def test_poller_fast_path() -> None:
    p = ProgressPoller()
    await p.wait(FakeEvent(done=True))
    assert p.statistics().fast_path == 1 and not p.running
    await p.stop()


@pytest.mark.anyio
async def test_poller_backs_off_when_nothing_completes() -> None:
    p = ProgressPoller(spin_s=0.001, min_sleep_s=0.001, max_sleep_s=0.01)
    ev = FakeEvent()
    fut = p.wait(ev)
    await asyncio.sleep(0.3)
    st = p.statistics()
    # after the 1 ms spin window only backed-off naps: ~30-60 passes in 0.3 s
    assert st.sleeps >= 5 and st.passes - st.spin_passes < 100
    ev.done = True
    await asyncio.wait_for(fut, 1)
    await p.stop()


@pytest.mark.anyio
async def test_poller_expected_hint_spins_until_due() -> None:
    p = ProgressPoller(spin_s=0.0, min_sleep_s=0.05, max_sleep_s=0.05)
    ev = FakeEvent()
    fut = p.wait(ev, expected_s=0.05)
    asyncio.get_running_loop().call_later(0.02, setattr, ev, "done", True)
    t0 = time.perf_counter()
    await asyncio.wait_for(fut, 1)
    # noticed while spinning, not after a 50 ms nap
    assert time.perf_counter() - t0 < 0.045
    assert p.statistics().spin_passes > 0
    await p.stop()


@pytest.mark.anyio
async def test_poller_comm_error_fails_its_waiters_only() -> None:
    p = ProgressPoller()
    bad, good = FakeComm(), FakeComm()
    e1, e2, e3 = FakeEvent(), FakeEvent(), FakeEvent()
    f1, f2 = p.wait(e1, bad), p.wait(e2, bad)
    f3 = p.wait(e3, good)
    bad.state = 6
    for f in (f1, f2):
        with pytest.raises(NcclError) as ei:
            await asyncio.wait_for(f, 5)
        assert ei.value.code_name == "ncclRemoteError"
    assert not f3.done()
    e3.done = True
    await asyncio.wait_for(f3, 5)
    await p.stop()


@pytest.mark.anyio
async def test_poller_aborted_comm() -> None:
    p = ProgressPoller()
    comm = FakeComm()
    f = p.wait(FakeEvent(), comm)
    comm.aborted = True
    with pytest.raises(TransferAbortedError):
        await asyncio.wait_for(f, 5)
    with pytest.raises(TransferAbortedError):
        await p.wait(FakeEvent(), comm)
    await p.stop()


@pytest.mark.anyio
async def test_poller_abort_beats_event_fired_by_abort() -> None:
    """An aborted kernel exits and its event fires: that must fail, never succeed."""
    p = ProgressPoller(orphan_grace_s=0.05)
    comm = FakeComm()
    ev = FakeEvent()
    f = p.wait(ev, comm, keepalive=object())
    await asyncio.sleep(0.01)
    comm.aborted = True
    ev.done = True  # same instant: the abort made the kernel exit
    with pytest.raises(TransferAbortedError):
        await asyncio.wait_for(f, 5)
    # a failed waiter whose event never fires is dropped after the grace period
    comm2 = FakeComm()
    f2 = p.wait(FakeEvent(), comm2)
    comm2.state = 2
    with pytest.raises(NcclError):
        await asyncio.wait_for(f2, 5)
    assert p.statistics().pending == 1
    await asyncio.sleep(0.2)
    assert p.statistics().pending == 0
    await p.stop()


@pytest.mark.anyio
async def test_poller_cancelled_waiter_keeps_buffers_until_fired() -> None:
    p = ProgressPoller()
    ev = FakeEvent()
    buf = object()
    task = asyncio.ensure_future(p.wait_event(ev, keepalive=buf))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    st = p.statistics()
    assert st.pending == 1 and st.orphaned == 1
    ev.done = True
    for _ in range(200):
        await asyncio.sleep(0.005)
        if p.statistics().pending == 0:
            break
    assert p.statistics().pending == 0
    await p.stop()


@pytest.mark.anyio
async def test_poller_event_query_error() -> None:
    class Broken:
        n = 0

        def query(self) -> bool:
            self.n += 1
            if self.n > 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return False

    p = ProgressPoller()
    with pytest.raises(TransferAbortedError, match="illegal memory"):
        await asyncio.wait_for(p.wait(Broken()), 5)
    await p.stop()


@pytest.mark.anyio
async def test_poller_stop_fails_pending() -> None:
    p = ProgressPoller()
    f = p.wait(FakeEvent())
    await asyncio.sleep(0.01)
    await p.stop()
    with pytest.raises(EngineClosedError):
        await f
    with pytest.raises(EngineClosedError):
        p.wait(FakeEvent())


def test_poller_touch_spins_then_parks() -> None:
    """touch() keeps the loop spinning with nothing registered, for about its window, then parks."""
    from aiokv.gpu.cuda import ProgressPoller

    async def main() -> tuple[int, int, float]:
        p = ProgressPoller(spin_s=0.0)
        p.touch(0.02)
        t0 = time.perf_counter()
        await asyncio.sleep(0.005)
        mid = p.statistics().spin_passes
        await asyncio.sleep(0.05)
        st = p.statistics()
        await p.stop()
        return mid, st.parks, time.perf_counter() - t0

    mid, parks, _ = asyncio.run(main())
    assert mid > 0  # spinning while touched
    assert parks >= 1  # and parked after the window
