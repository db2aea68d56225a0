"""``examples/run_demo.sh``: pip's progress bars on a terminal only.

The script runs in a copy of the tree whose ``.venv`` holds stand-ins for
``python`` and ``aiokv`` that record how they were called (nothing is installed).
"""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$CALLS"
[[ "$1" == "-c" ]] && exit 1   # 'import torch' fails: torch gets installed
exit 0
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "run_demo.sh", tmp_path / "examples" / "run_demo.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    for name, text in (("python", FAKE_PYTHON), ("aiokv", 'echo "aiokv $*" >> "$CALLS"\n')):
        (bin_dir / name).write_text(
            text if text.startswith("#!") else "#!/usr/bin/env bash\n" + text
        )
        (bin_dir / name).chmod(0o755)
    return tmp_path


def _pip_calls(tree: Path, on_tty: bool) -> list[str]:
    calls = tree / "calls.txt"
    env = dict(os.environ, CALLS=str(calls))
    cmd = ["bash", str(tree / "examples" / "run_demo.sh"), "--prompts", "2"]
    if on_tty:
        leader, follower = pty.openpty()
        try:
            proc = subprocess.run(cmd, env=env, stdout=follower, stderr=follower, timeout=30)
        finally:
            os.close(follower)
            os.close(leader)
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, timeout=30)
    assert proc.returncode == 0
    lines = calls.read_text().splitlines()
    assert lines[-1] == "aiokv demo --prompts 2"
    calls.unlink()
    return [ln for ln in lines if " -m pip install " in ln]


@pytest.mark.timeout(60)
def test_pip_progress_bars_are_off_only_when_not_on_a_terminal(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    piped = _pip_calls(tree, on_tty=False)
    assert len(piped) == 2 and all("--progress-bar off" in c for c in piped), piped
    on_tty = _pip_calls(tree, on_tty=True)
    assert len(on_tty) == 2 and not any("--progress-bar" in c for c in on_tty), on_tty
    assert "torch==2.13.0" in on_tty[0] and "-e .[demo]" in on_tty[1]
