"""The engine's structure: what it may import, and the knobs it takes through its config.

The engine core carries a KV layout as opaque data and asks an injected check
(``EngineConfig.layout_check``) about a peer's; the layout rules live in ``aiokv.kv``.
"""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import aiokv
from aiokv import ConfigError, EngineConfig, LayoutMismatchError

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module an ``import`` statement anywhere in ``path`` names (relative ones resolved)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "aiokv" if node.level else ""
            mod = f"{base}.{node.module}" if node.module and base else (node.module or base)
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


#: the engine core: the engine, its two peer sides and their parts
_ENGINE_FILES = (
    *sorted(p.relative_to(ROOT / "aiokv").as_posix() for p in (ROOT / "aiokv/engine").glob("*.py")),
    "_runtime/deadlines.py",
)


def test_engine_parts_hold_their_engine_only_through_its_interfaces() -> None:
    # the sessions, the server's parts and the handle see the engine as the protocols of
    # aiokv.engine.interfaces: no import of Engine, not even for the type checker
    engine_names = {"aiokv.Engine", "aiokv.engine.Engine", "aiokv.engine.engine"}
    parts = [
        p
        for p in (ROOT / "aiokv" / "engine").glob("*.py")
        if p.name not in ("__init__.py", "engine.py")
    ]
    assert len(parts) >= 4
    reaching = {
        p.name: hits
        for p in parts
        if (
            hits := sorted(
                n for n in _imports(p) if n in engine_names or n.startswith("aiokv.engine.engine.")
            )
        )
    }
    assert reaching == {}


@pytest.mark.parametrize("name", _ENGINE_FILES)
def test_engine_source_imports_nothing_from_the_kv_layer(name: str) -> None:
    names = _imports(ROOT / "aiokv" / name)
    assert not [n for n in names if n == "aiokv.kv" or n.startswith("aiokv.kv.")]


def test_an_engine_with_an_opaque_layout_never_imports_aiokv_kv() -> None:
    # two engines with a layout of their own and a check of their own talk, refuse a
    # mismatch, and the KV layer (and its torch-heavy kernels) is never imported
    code = """
import asyncio, sys
import aiokv
from aiokv import EngineConfig, LayoutMismatchError

def check(mine, theirs):
    return None if mine["w"] == theirs["w"] else f"width {theirs['w']} != {mine['w']}"

async def main():
    a = aiokv.Engine(EngineConfig(layout={"w": 1}, layout_check=check))
    b = aiokv.Engine(EngineConfig(layout={"w": 2}, layout_check=check))
    async with a, b:
        try:
            await a.connect(b.address)
        except LayoutMismatchError as exc:
            assert "width 1 != 2" in str(exc), exc
        else:
            raise AssertionError("mismatch not refused")
    assert not [m for m in sys.modules if m == "aiokv.kv" or m.startswith("aiokv.kv.")]
    print("ok")

asyncio.run(main())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_injected_check_decides_and_a_raising_check_refuses() -> None:
    seen: list[tuple[dict[str, str | int], dict[str, str | int]]] = []

    def check(mine: Mapping[str, str | int], theirs: Mapping[str, str | int]) -> str | None:
        seen.append((dict(mine), dict(theirs)))
        if theirs.get("boom"):
            raise RuntimeError("bad input")
        return None

    def client_check(mine: Mapping[str, str | int], theirs: Mapping[str, str | int]) -> None:
        return None

    server_cfg = EngineConfig(layout={"v": 1}, layout_check=check)
    assert seen == [({"v": 1}, {"v": 1})]  # the config validated its own layout
    seen.clear()
    async with (
        aiokv.Engine(server_cfg) as server,
        aiokv.Engine(EngineConfig(layout={"v": 2}, layout_check=client_check)) as ok_client,
        aiokv.Engine(EngineConfig(layout={"boom": 1}, layout_check=client_check)) as bad_client,
    ):
        await ok_client.connect(server.address)
        assert seen == [({"v": 1}, {"v": 2})]  # the server's check, (mine, theirs)
        with pytest.raises(LayoutMismatchError, match="layout check failed: RuntimeError"):
            await bad_client.connect(server.address)
        assert server.statistics().protocol_errors.get("layout_mismatch") == 1
        await asyncio.sleep(0)


def test_layout_config_is_validated_by_its_check() -> None:
    def never(mine: Mapping[str, str | int], theirs: Mapping[str, str | int]) -> str | None:
        return "not this one"

    with pytest.raises(ConfigError, match="not this one"):
        EngineConfig(layout={"a": 1}, layout_check=never)
    with pytest.raises(ConfigError, match="callable"):
        EngineConfig(layout={"a": 1}, layout_check=5)  # type: ignore[arg-type]
    cfg = EngineConfig(layout={"a": 1}, layout_check=lambda m, t: None)
    assert cfg.layout == {"a": 1}
    assert EngineConfig().layout_check is None  # no layout: no check needed


def test_a_kv_layout_gets_the_kv_layers_check() -> None:
    from aiokv.kv import FlashAttentionLayout, engine_layout_check

    lay = FlashAttentionLayout(2, 16, 4, 8, 64, "float16")
    for given in (lay, lay.to_wire()):
        cfg = EngineConfig(layout=given)  # type: ignore[arg-type]
        assert cfg.layout == lay.to_wire() and cfg.layout_check is engine_layout_check
    other = FlashAttentionLayout(2, 99, 4, 4, 128, "float16")  # another block count is fine,
    assert engine_layout_check(lay.to_wire(), lay.to_wire()) is None
    err = engine_layout_check(lay.to_wire(), other.to_wire())  # other heads are not
    assert err is not None and "num_kv_heads" in err
    assert "unknown kind" in (engine_layout_check(lay.to_wire(), {"kind": "x"}) or "")


# -- every knob in the config; the environment is read by the entry points only --------

#: files that may touch ``os.environ``, and why
ENV_READERS = {
    "envs.py": "the registry of every AIOKV_* variable: the one place that reads them",
    "cli/bench/common.py": "entry point: hands its environment to the benchmark receiver",
    "cli/bench/kv.py": "entry point: sets AIOKV_IPC_TRACE for its benchmark processes",
    "serving/demo/run.py": "entry point: hands the token and KV secret to the demo processes",
    "gpu/nccl/library.py": "the mapping that candidate_paths reads AIOKV_NCCL_SO_PATH from",
    "gpu/cuda.py": "reports CUDA's own CUDA_MODULE_LOADING, which aiokv does not set",
    "kv/ipc/_common.py": "reports torch's own allocator settings, which aiokv does not set",
}

#: files that still read an AIOKV_* variable themselves instead of through aiokv.envs:
#: the IPC plane's trace switch (the KV layer's files move onto aiokv.envs.flag)
_DIRECT_AIOKV_READERS: set[str] = set()


def test_the_environment_is_read_only_by_entry_points() -> None:
    pkg = ROOT / "aiokv"
    readers = sorted(
        p.relative_to(pkg).as_posix()
        for p in pkg.rglob("*.py")
        if "os.environ" in p.read_text() or "getenv(" in p.read_text()
    )
    assert [r for r in readers if r not in ENV_READERS] == []


def _direct_aiokv_reads(path: Path) -> list[str]:
    """Each read of an ``AIOKV_*`` variable from an environment mapping in ``path``:
    ``environ.get(X)``, ``environ[X]`` (loaded), ``getenv(X)``, with ``X`` a literal or a
    module constant."""
    tree = ast.parse(path.read_text())
    consts = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def aiokv_name(arg: ast.expr) -> bool:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.startswith("AIOKV_")
        return isinstance(arg, ast.Name) and consts.get(arg.id, "").startswith("AIOKV_")

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and aiokv_name(node.args[0]):
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "get"
                and "environ" in ast.unparse(f.value)
            ) or ast.unparse(f).endswith("getenv"):
                out.append(ast.unparse(node))
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and "environ" in ast.unparse(node.value)
            and aiokv_name(node.slice)
        ):
            out.append(ast.unparse(node))
    return out


def test_only_the_registry_reads_aiokv_variables() -> None:
    """Every other module calls ``aiokv.envs.get`` / ``flag``, which refuse unregistered
    names; a direct ``os.environ`` read of an AIOKV_* variable would bypass the registry."""
    pkg = ROOT / "aiokv"
    direct = {
        p.relative_to(pkg).as_posix(): _direct_aiokv_reads(p)
        for p in pkg.rglob("*.py")
        if p.name != "envs.py" or p.parent != pkg
    }
    assert {k for k, v in direct.items() if v} == _DIRECT_AIOKV_READERS, direct
    from aiokv import envs

    with pytest.raises(KeyError, match="not a registered"):
        envs.get("AIOKV_NOT_A_VARIABLE")
    assert envs.get("AIOKV_TRACE", {"AIOKV_TRACE": " /tmp/x "}) == "/tmp/x"
    assert envs.flag("AIOKV_IPC_TRACE", {"AIOKV_IPC_TRACE": "0"}) is False
    assert envs.flag("AIOKV_IPC_TRACE", {"AIOKV_IPC_TRACE": "1"}) is True


def test_the_docs_list_exactly_the_registered_variables() -> None:
    import re

    from aiokv.envs import VARIABLES

    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(AIOKV_[A-Z_]+)", section, flags=re.M)
    assert len(rows) == len(set(rows)), rows
    assert sorted(rows) == sorted(VARIABLES)


def test_nccl_knobs_are_config_fields_that_the_cli_sets_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokv.envs import engine_overrides

    monkeypatch.setenv("AIOKV_NCCL_BLOCKING_OPS", "1")
    monkeypatch.setenv("AIOKV_NCCL_RECV_BATCH", "4,16")
    assert EngineConfig().nccl_blocking_ops is False  # the library ignores the environment
    cfg = EngineConfig(**engine_overrides())
    assert cfg.nccl_blocking_ops is True
    assert (cfg.nccl_recv_batch, cfg.nccl_recv_batch_bytes) == (4, 16 << 20)
    assert engine_overrides({}) == {}
    assert engine_overrides({"AIOKV_NCCL_BLOCKING_OPS": "0"}) == {"nccl_blocking_ops": False}
    with pytest.raises(ConfigError, match="nccl_blocking_ops"):
        EngineConfig(nccl_blocking_ops="yes")  # type: ignore[arg-type]


def test_triton_switch_is_an_argument_that_the_cli_sets_from_the_environment() -> None:
    from aiokv.kv import _triton, set_triton
    from aiokv.kv._triton import apply_env as apply_process_env

    try:
        set_triton(True)
        assert _triton.available() == _triton._importable()
        apply_process_env({"AIOKV_DISABLE_TRITON": "0"})
        assert _triton.available() == _triton._importable()
        apply_process_env({"AIOKV_DISABLE_TRITON": "1"})
        assert _triton.available() is False
    finally:
        set_triton(True)


def test_the_cli_applies_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.cli import main
    from aiokv.kv import _triton, set_triton

    monkeypatch.setenv("AIOKV_DISABLE_TRITON", "1")
    try:
        assert main(["doctor"]) in (0, 1)
        assert _triton.available() is False
    finally:
        set_triton(True)


# -- zmq errors are mapped onto aiokv's tree at one edge ---------------------------------


def test_zmq_errors_map_onto_the_aiokv_tree() -> None:
    import errno

    import zmq

    from aiokv import EngineClosedError, PeerLostError, TransferAbortedError
    from aiokv._runtime.zmqerr import channel_error, listen_error

    lost = channel_error(zmq.ZMQError(errno.EHOSTUNREACH), "control channel to h:1")
    assert type(lost) is PeerLostError and str(lost).startswith("control channel to h:1 failed")
    closed = channel_error(zmq.ZMQError(zmq.ETERM), "data channel to h:1")
    assert type(closed) is EngineClosedError
    aborted = channel_error(TransferAbortedError("comm aborted"), "data channel to h:1")
    assert type(aborted) is PeerLostError and "comm aborted" in str(aborted)
    bind = listen_error(zmq.ZMQError(errno.EADDRINUSE), "127.0.0.1:5")
    assert type(bind) is ConfigError and "cannot listen on 127.0.0.1:5" in str(bind)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_taken_port_is_a_config_error() -> None:
    async with aiokv.Engine() as a:
        b = aiokv.Engine(EngineConfig(listen=a.address))
        with pytest.raises(ConfigError, match="cannot listen on"):
            await b.start()


#: ZMQError handlers in the engine core that still build their aiokv error inline: in the
#: per-transfer hot path, being rewritten; it adopts channel_error when
#: that work lands
_INLINE_ZMQ_MAPPING = {"_on_grant"}


def test_engine_maps_zmq_errors_through_one_function() -> None:
    inline = set()
    fns = [
        fn
        for name in _ENGINE_FILES
        for fn in ast.walk(ast.parse((ROOT / "aiokv" / name).read_text()))
    ]
    for fn in fns:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for h in ast.walk(fn):
            if not isinstance(h, ast.ExceptHandler) or h.type is None:
                continue
            if "ZMQError" not in ast.unparse(h.type) or h.name is None:
                continue
            body = "\n".join(ast.unparse(s) for s in h.body)
            built = [n for n in ("PeerLostError(", "ConfigError(", "ConnectError(") if n in body]
            if built and "channel_error(" not in body and "listen_error(" not in body:
                inline.add(fn.name)
    assert inline == _INLINE_ZMQ_MAPPING


def _sent_by(role: Any) -> set[type]:
    """Every message type the session state machine lets ``role`` send."""
    from aiokv.protocol.session import CONN_TRANSITIONS, OPEN_MESSAGES, XFER_TRANSITIONS

    return {
        *(t for r, t in CONN_TRANSITIONS if r is role),
        *(t for r, t in XFER_TRANSITIONS if r is role),
        *OPEN_MESSAGES[role],
    }


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_each_side_dispatches_every_control_message_through_its_table() -> None:
    """Both peer sides dispatch control messages through one table keyed by message type:
    the client's covers every message a server may send; the server's every message a
    client may send on the control connection (HELLO opens the session instead, DATA
    belongs to the data connection)."""
    from aiokv.protocol.messages import DataHeader, Hello
    from aiokv.protocol.session import Role

    async with aiokv.Engine() as a, aiokv.Engine() as b:
        await a.connect(b.address, timeout=5)
        cs = a._clients[b.address]
        assert set(cs.handlers) == _sent_by(Role.SERVER)
        assert set(b._server._handlers) == _sent_by(Role.CLIENT) - {Hello, DataHeader}


# -- module size: one concern a module, small enough to read in one sitting -------------

#: the packages held to the limit (the KV layer is split separately)
_SIZED_PACKAGES = ("serving", "cli", "engine", "transport")
_MAX_MODULE_LINES = 800


def test_sized_packages_stay_under_the_size_limit() -> None:
    big = {
        p.relative_to(ROOT).as_posix(): n
        for pkg in _SIZED_PACKAGES
        for p in (ROOT / "aiokv" / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > _MAX_MODULE_LINES
    }
    assert big == {}


def test_the_kv_connector_is_composed_of_parts_under_the_size_limit() -> None:
    # KVConnector owns its parts (chunked, batched and pull paths, the plane's port) as
    # plain objects over one shared state: no class of aiokv/kv/*.py derives from
    # another class of the package, and no module there is over the limit
    kv = ROOT / "aiokv" / "kv"
    classes = {
        node.name: p.name
        for p in kv.glob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    derived = {
        f"{p.name}:{node.name}({base.id})"
        for p in kv.glob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
        for base in node.bases
        if isinstance(base, ast.Name) and base.id in classes and base.id != "KVLayout"
    }
    assert derived == set()
    big = {
        p.name: n
        for p in kv.glob("*.py")
        if (n := len(p.read_text().splitlines())) > _MAX_MODULE_LINES
    }
    assert big == {}


def test_the_lazy_subpackages_of_aiokv_are_the_real_ones() -> None:
    # ``aiokv.<name>`` loads a subpackage on first use; a name that is not one is an
    # AttributeError (hasattr works), never an ImportError of a module moved away
    code = """
import aiokv
for name in sorted(aiokv._SUBMODULES):
    getattr(aiokv, name)
for gone in ("router", "bench", "store", "nccl", "demo"):
    assert not hasattr(aiokv, gone), gone
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
