"""``aiokv doctor``'s IPC lines: whether CUDA IPC works from each visible GPU to each
(a child process exports a known pattern; this process maps and compares it), and
what would keep the plane off here."""

from __future__ import annotations

import contextlib
import secrets
import sys

import torch

from . import _kernel
from ._common import CudaBackend, unsupported_reason
from ._wire import StorageExport, probe_pattern
from .options import IpcOptions

_PROBE_BYTES = 1 << 16


def _export_probe_main() -> None:
    """Child of :func:`doctor_report`: export a probe on ``cuda:ARGV1`` and hold it until
    stdin closes (an export is only valid while its process lives)."""
    import json

    idx, nonce = int(sys.argv[1]), int(sys.argv[2])
    dev = torch.device("cuda", idx)
    t = probe_pattern(nonce, _PROBE_BYTES, dev)
    torch.cuda.synchronize(dev)
    e = CudaBackend().export(t.untyped_storage())
    w = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in e.to_wire().items()}
    print(json.dumps(w), flush=True)
    sys.stdin.read()


def doctor_report(gpus: int, *, timeout: float = 60.0) -> list[str]:
    """Lines for ``aiokv doctor``: whether CUDA IPC works from each visible GPU to each
    (a child process exports a known pattern; this process maps it on every GPU and
    compares), and what would keep the IPC plane off here."""
    import json
    import subprocess

    lines = []
    why = unsupported_reason(torch.device("cuda", 0), authenticated=True, options=IpcOptions())
    lines.append(
        "IPC plane    "
        + ("usable here" if why is None else f"off: {why}")
        + ("" if _kernel.available() else " (no Triton: torch-ops copy, host-waited)")
    )
    lines.append("             (row exports, column maps and reads a known pattern)")
    nonce = secrets.randbits(40)
    want_cache: dict[int, torch.Tensor] = {}
    for i in range(gpus):
        cells = []
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from aiokv.kv.ipc._doctor import _export_probe_main as m; m()",
                str(i),
                str(nonce),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            raw = json.loads(line) if line.startswith("{") else None
            export = None
            if raw is not None:
                export = StorageExport.from_wire(
                    {k: (bytes.fromhex(v) if isinstance(v, str) else v) for k, v in raw.items()}
                )
            for j in range(gpus):
                if export is None:
                    cells.append("  export failed")
                    continue
                dev = torch.device("cuda", j)
                try:
                    t = CudaBackend().open(export, dev)
                    want = want_cache.get(j)
                    if want is None:
                        want = want_cache[j] = probe_pattern(nonce, _PROBE_BYTES, dev)
                    ok = bool(torch.equal(t[:_PROBE_BYTES].clone(), want))
                    cells.append(" yes" if ok else " WRONG DATA")
                    del t
                except Exception as exc:
                    cells.append(f"  no ({type(exc).__name__}: {str(exc)[:60]})")
        finally:
            with contextlib.suppress(Exception):
                proc.communicate(input="", timeout=timeout)
            if proc.poll() is None:
                proc.kill()
        lines.append(f"  cuda:{i}   " + "".join(cells))
    return lines
