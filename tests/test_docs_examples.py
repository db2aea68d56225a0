"""The code blocks of README.md and docs/*.md run as written.

Every ```` ```python ```` and ```` ```bash ```` block is extracted with pytest-codeblocks
and run in a fresh process on CPU (a python block with ``python -c``, a bash block with
``bash -euo pipefail -c``), in an empty directory, with a deadline; it must exit 0
without a traceback on stderr. A block that cannot run here (it installs packages,
starts servers that run until stopped, needs a GPU, or lists fields rather than being
a program) carries pytest-codeblocks' mark right above it, with the reason::

    <!--pytest.mark.skip(reason="fragment: needs ...")-->

and ``test_every_fragment_says_why`` holds every such mark to that form. The same
blocks run with ``pytest --codeblocks README.md docs`` (in this process, no deadline).
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_codeblocks import CodeBlock, extract_from_file

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNS = {"python", "bash", "sh"}  # what pytest-codeblocks runs
# other names of the same languages: a block under one of them would be skipped silently
ALIASES = {"py", "python3", "pycon", "shell", "console", "zsh", "sh-session"}
DEADLINE = 45.0  # seconds per block; the slowest takes ~2 s on an idle 2-core machine


def _blocks() -> list[tuple[str, CodeBlock]]:
    return [
        (f"{path.relative_to(ROOT)}:{block.lineno}", block)
        for path in DOCS
        for block in extract_from_file(path)
        if block.syntax in RUNS
    ]


BLOCKS = _blocks()


def _skip_reason(mark: str) -> str | None:
    """The reason of ``pytest.mark.skip(reason="...")``, else None."""
    try:
        call = ast.parse(mark, mode="eval").body
    except SyntaxError:
        return None
    if (
        isinstance(call, ast.Call)
        and ast.unparse(call.func) == "pytest.mark.skip"
        and not call.args
        and len(call.keywords) == 1
        and call.keywords[0].arg == "reason"
        and isinstance(call.keywords[0].value, ast.Constant)
        and isinstance(call.keywords[0].value.value, str)
    ):
        return call.keywords[0].value.value
    return None


def _params() -> list[object]:
    out: list[object] = []
    for name, block in BLOCKS:
        reasons = [_skip_reason(m) for m in block.marks]
        marks = [pytest.mark.skip(reason=r) for r in reasons if r]
        out.append(pytest.param(block, id=name, marks=marks))
    return out


def test_every_fragment_says_why() -> None:
    assert len(BLOCKS) >= 20, "the extraction found too few blocks"
    ran = 0
    for name, block in BLOCKS:
        assert len(block.marks) <= 1, f"{name}: one mark per block"
        for mark in block.marks:
            reason = _skip_reason(mark)
            assert reason is not None, f"{name}: {mark!r} is not pytest.mark.skip(reason=...)"
            assert reason.startswith("fragment: ") and len(reason) > 20, (
                f"{name}: the reason must say what the fragment needs: {reason!r}"
            )
        ran += not block.marks
    assert ran >= 8, "most examples must run"


def test_no_block_hides_under_another_language_name() -> None:
    for path in DOCS:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"\s*```+\s*([\w-]+)", line)
            assert not (m and m.group(1) in ALIASES), (
                f"{path.name}:{lineno}: ```{m and m.group(1)} is not run; use python or bash"
            )


@pytest.mark.timeout(DEADLINE + 15)
@pytest.mark.parametrize("block", _params())
def test_block_runs(block: CodeBlock, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOKV_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["AIOKV_ROUTER_TOKEN"] = secrets.token_urlsafe(24)  # what a deployment exports
    if block.syntax == "python":
        argv = [sys.executable, "-c", block.code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    # a session of its own: whatever the block leaves running (a server started with `&`)
    # is killed with it
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    for sign in ("Traceback", "never retrieved", "Exception ignored"):
        assert sign not in err, err
