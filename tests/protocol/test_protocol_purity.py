"""The protocol package is sans-IO, and no wire data is ever unpickled or evaluated."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

PKG = Path(__file__).resolve().parents[2] / "aiokv"
PROTOCOL = PKG / "protocol"
FORBIDDEN_IN_PROTOCOL = {
    "zmq",
    "torch",
    "asyncio",
    "pickle",
    "cloudpickle",
    "dill",
    "marshal",
    "socket",
    "threading",
}
FORBIDDEN_ANYWHERE = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}


def _py(root: Path) -> list[Path]:
    files = sorted(root.rglob("*.py"))
    assert files, root
    return files


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ):
            out.add("__import__")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
        ):
            out.add("importlib.import_module")
    return out


@pytest.mark.parametrize("path", _py(PROTOCOL), ids=lambda p: p.name)
def test_protocol_imports_no_io(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    bad = _imports(tree) & (FORBIDDEN_IN_PROTOCOL | {"__import__", "importlib.import_module"})
    assert not bad, f"{path.name} imports {sorted(bad)}"
    # relative imports stay inside the protocol package or reach only the exception module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 2:
            assert node.module == "_exceptions", (
                f"{path.name}: from {'.' * node.level}{node.module} import ..."
            )


def test_protocol_package_imports_cleanly_without_io_modules() -> None:
    """Importing aiokv.protocol alone pulls in none of zmq/torch/asyncio."""
    import subprocess
    import sys

    code = (
        (  # noqa: UP031
            "import sys, importlib.util\n"
            "spec = importlib.util.spec_from_file_location('aiokv', %r, submodule_search_locations=[%r])\n"
            "pkg = importlib.util.module_from_spec(spec); sys.modules['aiokv'] = pkg\n"  # skip aiokv/__init__ (it imports the engine)
            "import aiokv.protocol\n"
            "bad = sorted(m for m in ('zmq', 'torch', 'asyncio', 'pickle') if m in sys.modules)\n"
            "print(','.join(bad))\n"
        )
        % (str(PKG / "__init__.py"), str(PKG))
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"aiokv.protocol imported {r.stdout.strip()}"


@pytest.mark.parametrize("path", _py(PKG), ids=lambda p: str(p.relative_to(PKG)))
def test_no_pickle_eval_exec_marshal_anywhere(path: Path) -> None:
    src = path.read_text()
    tree = ast.parse(src, str(path))
    bad = _imports(tree) & FORBIDDEN_ANYWHERE
    assert not bad, f"{path}: imports {sorted(bad)}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ("eval", "exec", "compile", "__import__"), (
                f"{path}:{node.lineno}: {node.func.id}()"
            )
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("loads", "load")
            and isinstance(node.value, ast.Name)
        ):
            assert node.value.id not in FORBIDDEN_ANYWHERE, (
                f"{path}:{node.lineno}: {node.value.id}.{node.attr}"
            )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("recv_pyobj", "recv_serialized")
        ):
            raise AssertionError(f"{path}:{node.lineno}: {node.func.attr} unpickles wire data")
    # and the plain grep the docs promise
    code_only = re.sub(r'("""|\'\'\')[\s\S]*?\1', "", src)  # docstrings may *say* "never pickle"
    code_only = re.sub(r"#.*", "", code_only)
    for word in (
        r"\bpickle\b",
        r"(?<![\w.])eval\(",
        r"(?<![\w.])exec\(",
        r"\bmarshal\b",
        r"recv_pyobj",
    ):
        assert not re.search(word, code_only), f"{path}: matches {word}"


def _decode_paths() -> list[tuple[str, ast.FunctionDef]]:
    """The functions that see wire data: every check in codec.py, Codec.decode, Session.receive*."""
    out = []
    for name in ("codec.py", "session.py"):
        tree = ast.parse((PROTOCOL / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name not in (
                "encode",
                "_to_wire",
                "send",
            ):
                out.append((f"{name}:{node.name}", node))
    return out


@pytest.mark.parametrize("where,fn", _decode_paths(), ids=lambda v: v if isinstance(v, str) else "")
def test_no_getattr_on_wire_data(where: str, fn: ast.FunctionDef) -> None:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ("getattr", "setattr", "eval", "exec", "__import__"), (
                f"{where}:{node.lineno}"
            )


def test_dtype_from_wire_is_looked_up_in_a_table() -> None:
    """Where wire data is handled, dtype names map through a dict, never getattr(torch, name)."""
    wire_side = [
        *_py(PROTOCOL),
        *_py(PKG / "transport"),
        *_py(PKG / "engine"),
    ]
    for path in wire_side:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "torch"
            ):
                raise AssertionError(f"{path}:{node.lineno}: getattr(torch, ...)")
