"""The demo on CUDA: router, prefill and decode worker processes; every request's KV must
come over the same-host IPC plane (``--require-ipc``) and every output must equal
single-process generation. One GPU: both workers on cuda:0 (``--same-gpu``); two GPUs:
cuda:0 → cuda:1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = "import sys; from aiokv.serving.demo.run import main; sys.exit(main(sys.argv[1:]))"


def _demo(*extra: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CODE,
            "--prompts",
            "8",
            "--max-tokens",
            "6",
            "--device",
            "cuda",
            *extra,
        ],
        cwd=ROOT,
        env=dict(os.environ, COLUMNS="140"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "8/8 outputs equal single-process generate" in out, out
    assert "KV plane: ipc: 8" in out, out
    return out


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_demo_on_one_gpu_chooses_ipc() -> None:
    _demo("--same-gpu", "--require-ipc")


@pytest.mark.multi_gpu
@pytest.mark.timeout(300)
def test_demo_on_two_gpus_chooses_ipc() -> None:
    _demo("--require-ipc")
