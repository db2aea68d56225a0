"""``aiokv doctor``: what this machine offers aiokv (torch, CUDA, GPUs, peer access, NCCL)."""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["doctor"]


def doctor(out: TextIO | None = None) -> int:
    """Print a plain report; return 0 (a machine without GPUs is a valid answer, not an error)."""
    stream = out if out is not None else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=stream)

    say(f"python       {sys.version.split()[0]}")
    try:
        import torch
    except ImportError as exc:
        say(f"torch        not importable ({exc}); aiokv needs torch")
        return 0
    say(f"torch        {torch.__version__}")
    cuda_v = torch.version.cuda
    hip_v = getattr(torch.version, "hip", None)
    if hip_v:
        say(f"ROCm (HIP)   {hip_v}")
    else:
        say(f"CUDA         {cuda_v if cuda_v else 'none (CPU-only torch build)'}")

    gpus = 0
    try:
        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
    except Exception as exc:  # a broken driver is a finding, not a crash
        say(f"GPUs         CUDA present but unusable: {exc}")
    if gpus == 0:
        reason = (
            "this torch build has no CUDA/ROCm support"
            if not (cuda_v or hip_v)
            else "no GPU visible (driver missing, or CUDA_VISIBLE_DEVICES empty)"
        )
        say(f"GPUs         0 ({reason})")
        say("             aiokv will use its TCP transport for CPU tensors only.")
    else:
        say(f"GPUs         {gpus}")
        for i in range(gpus):
            p = torch.cuda.get_device_properties(i)
            say(f"  cuda:{i}     {p.name}, {p.total_memory / 2**30:.0f} GiB")
        from aiokv.gpu.cuda import module_loading

        mode = module_loading()
        say(f"module load  {mode} (CUDA_MODULE_LOADING)")
        if mode != "EAGER":
            say("             a kernel's first launch while NCCL work is queued can hang: launch")
            say("             your kernels once before NCCL traffic starts, or set")
            say("             CUDA_MODULE_LOADING=EAGER (docs/reliability.md)")
        if gpus > 1:
            say("peer access  (row can read/write column directly; NVLink or PCIe P2P)")
            for i in range(gpus):
                cells = []
                for j in range(gpus):
                    if i == j:
                        cells.append("  -")
                    else:
                        ok = torch.cuda.can_device_access_peer(i, j)
                        cells.append(" yes" if ok else "  no")
                say(f"  cuda:{i}   " + "".join(cells))

    from aiokv._runtime.finesleep import TimerFd
    from aiokv.kv import IpcOptions

    if TimerFd.available():
        ms = IpcOptions().event_poll_s * 1e3
        say(f"event waits  timerfd: waits past their spin query every {ms:g} ms (event_poll_s)")
    else:
        say("event waits  no timerfd: waits past their spin query on the loop's 1 ms timer")

    if gpus:
        from aiokv.kv.ipc import doctor_report

        for line in doctor_report(gpus):
            say(line)

    from aiokv._exceptions import NcclError
    from aiokv.gpu.nccl.library import find_library, load_library

    try:
        handle, path, attempts = find_library()
        del handle
        lib = load_library()
    except NcclError as exc:
        say("NCCL         not found")
        for line in str(exc).splitlines():
            say(f"  {line}")
        if gpus:
            say("             GPU transfers need NCCL; see the list above for what was tried.")
        return 0
    say(f"NCCL         {lib.version_string} at {path}")
    for a in attempts[:-1]:
        say(f"  skipped [{a.source}] {a.path}: {a.error}")
    if lib.supports_nonblocking():
        say("             non-blocking communicators: yes")
    else:
        say("             too old: aiokv needs NCCL >= 2.14 for non-blocking communicators")
    return 0


if __name__ == "__main__":
    raise SystemExit(doctor())
