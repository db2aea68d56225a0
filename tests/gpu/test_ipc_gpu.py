"""The IPC plane on a real GPU: two processes, CUDA IPC on one GPU (``gpu``).

Each test runs ``_ipc_worker.py`` as a producer and a consumer process. Covered:
the mapping verification and every layout x dtype (bit-exact, odd lengths and
odd geometry, untouched neighbours, the kernel ordered after the producer's
stream), cancellation of a copy queued behind the producer's event, a killed
producer, a killed consumer, a restarted producer (its old mapping dropped, its
memory freed), expandable segments, and engines that refuse each other's layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import torch  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("_ipc_worker.py")
ROOT = WORKER.parent.parent.parent


def run_pair(
    scenario: str,
    tmp_path: Path,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    worker: Path = WORKER,
) -> dict[str, dict[str, Any] | None]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    e["PYTHONUNBUFFERED"] = "1"
    e.update(env or {})
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(worker), role, scenario, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=e,
        )
        for role in ("producer", "consumer")
    }
    out: dict[str, dict[str, Any] | None] = {}
    for role, p in procs.items():
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            so, se = p.communicate()
        lines = [ln for ln in so.splitlines() if ln.startswith("{")]
        out[role] = json.loads(lines[-1]) if lines else None
        print(f"--- {role} rc={p.returncode}\n{so[-4000:]}\n{se[-4000:]}")
    return out


def test_every_layout_and_dtype_bit_exact(tmp_path: Path) -> None:
    r = run_pair("matrix", tmp_path)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert len(c["combos"]) == 28
    for ci, combo in enumerate(c["combos"]):
        assert combo["ok"] and combo["untouched"], combo
        assert combo["received"] == 3 + (combo["ordered"] is not None), combo
        assert combo["verified"] == 1 and not combo["fallbacks"], combo
        # the copy launched through the driver (verified), except where the worker
        # turned driver calls off (every other combo: Triton's launch stays covered)
        assert combo["raw"] is (ci % 2 == 0), combo
    assert c["combos"][0]["ordered"] is True  # waited for the producer's stream on the GPU
    # copies staged at recv_request (driver calls, a mapped ring) and launched by the
    # ring's poll or, when the producer's event had not fired then, by the request's
    # task, were among the bit-exact ones
    assert sum(combo["staged_launches"] for combo in c["combos"]) >= 1
    assert all(combo["staged_launches"] == 0 for combo in c["combos"][1::2])  # torch calls
    for combo in p["combos"]:
        assert combo["sent"] >= 3 and not combo["fallbacks"], combo


def test_cancel_before_the_producer_is_ready_writes_nothing(tmp_path: Path) -> None:
    r = run_pair("cancel", tmp_path)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    for rid in ("c1", "c2"):  # c1: launch queued on the GPU; c2: host wait, no launch
        assert c[rid + "_done_before_cancel"] is False
        assert c[rid] == "cancelled"
        assert c[rid + "_untouched_at_return"] and c[rid + "_untouched_later"], rid
        assert p[rid] == "TransferAbortedError"  # the consumer's release said: failed
    assert c["c2_cancel_s"] < 0.5  # nothing launched: nothing to settle
    assert c["aborted"] == 1 and c["stuck"] == 0  # c1's launch ran (and copied nothing)
    assert "c1" not in c["finished"] and "c2" not in c["finished"]


def test_killed_producer(tmp_path: Path) -> None:
    """Default (host wait): nothing is launched for a producer that dies before its
    event fires; the consumer fails at the lease and its device stays usable."""
    r = run_pair("kill_producer", tmp_path, timeout=120)
    c = r["consumer"]
    assert c is not None
    assert c["recv"] == "TransferTimeoutError"
    assert c["recv_s"] < 3 + 2  # the lease (3 s), not the consumer's 30 s
    assert c["untouched_at_return"] and c["untouched_later"] and c["healthy"]
    assert c["aborted"] == 0 and c["stuck"] == 0 and c["lease_expired"] == 1
    assert c["copy_stream_idle"] and c["device_sync_returns"]


def test_killed_producer_gpu_wait(tmp_path: Path) -> None:
    """``gpu_wait=True``: the launch queued behind the dead producer's event writes
    nothing; what happens to the stream (and a device-wide sync) is reported."""
    r = run_pair("kill_producer_gpuwait", tmp_path, timeout=120)
    c = r["consumer"]
    assert c is not None
    assert c["recv"] == "TransferTimeoutError"
    assert c["recv_s"] < 3 + 1.0 + 2
    assert c["untouched_at_return"] and c["untouched_later"] and c["healthy"]
    assert c["aborted"] == 1 and c["stuck"] == 1
    print("device-wide synchronize returned:", c["device_sync_returns"])


def test_killed_consumer(tmp_path: Path) -> None:
    r = run_pair("kill_consumer", tmp_path)
    p = r["producer"]
    assert p is not None
    assert p["send"] == "TransferTimeoutError"
    assert p["send_s"] >= 3 + 1.0 - 0.1  # blocks kept until lease + grace
    assert p["lease_expired"] == 1 and p["healthy"]
    assert "q1" not in p["finished"]


def test_expandable_segments_refused(tmp_path: Path) -> None:
    r = run_pair(
        "expandable", tmp_path, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    )
    for role in ("producer", "consumer"):
        x = r[role]
        assert x is not None and x["disabled"] == "expandable_segments", x


def test_a_restarted_producers_old_mapping_is_dropped(tmp_path: Path) -> None:
    """A producer exits after one request and a new one takes over: the consumer drops
    the mapping of the one that is gone when it maps the new export, and the dead
    producer's cache allocation (512 MiB here), held alive by that mapping, is freed."""
    r = run_pair("restart_producer", tmp_path)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert p["first_exit"] == 0
    assert c["watched"] and c["received"] == 2 and c["verified"] == 2, c
    assert c["dropped"] == 1 and not c["fallbacks"], c
    assert c["freed"] >= 0.9 * c["cache_bytes"], c


@pytest.mark.timeout(120)
def test_layout_mismatch_refused_fails_both_sides_at_once(tmp_path: Path) -> None:
    """Engines with layouts and the IPC plane on both sides, head_dim 128 against 64:
    the producer's send_request and the consumer's recv_request both fail within
    seconds with LayoutMismatchError naming head_dim (not at their 120 s timeout with
    TransferTimeoutError), and nothing is written."""
    r = run_pair("layout_refused", tmp_path, timeout=100)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert p["send"] == "LayoutMismatchError", p
    assert c["recv"] == "LayoutMismatchError", c
    assert "field 'head_dim'" in p["send_msg"] and "field 'head_dim'" in c["recv_msg"]
    assert p["send_s"] < 10 and c["recv_s"] < 10, (p, c)
    assert c["untouched"] and c["received"] == 0 and c["finished"] == []
    assert p["finished"] == [] and p["sent"] == 0 and p["send_failures"] == 1
