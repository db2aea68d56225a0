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


def test_engine_source_imports_nothing_from_the_kv_layer() -> None:
    names = _imports(ROOT / "aiokv" / "engine.py")
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
