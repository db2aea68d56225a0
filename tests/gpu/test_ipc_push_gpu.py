"""Push mode of the IPC plane on a real GPU (``IpcOptions(push=True)``): two
processes, CUDA IPC on one GPU, scenarios in ``_ipc_push_worker.py``. Covered: the
consumer's export mapped and verified by the producer, pushed requests bit-exact on
every layout (several dtypes, odd lengths and geometry), neighbours untouched, the
push ordered after the producer's stream; a cancelled grant (before the push, and
while the push waits behind the producer's work) writes nothing; a consumer killed
with a grant out leaves the producer working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_ipc_gpu import run_pair

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("_ipc_push_worker.py")


@pytest.mark.parametrize("scenario", ["push_matrix", "push_layers_matrix"])
def test_pushed_requests_bit_exact_on_every_layout(scenario: str, tmp_path: Path) -> None:
    """Whole requests (``send_request``), and requests saved layer by layer
    (``push_layers_matrix``: the producer pushes each layer as it is saved, after its
    writes on the producer's stream, and sends one descriptor)."""
    r = run_pair(scenario, tmp_path, worker=WORKER)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert len(c["combos"]) == 16
    for combo in c["combos"]:
        assert combo["ok"] and combo["untouched"], combo
        assert combo["pushes_received"] == 3 + (combo["ordered"] is not None), combo
        assert combo["grants"] == combo["pushes_received"] and not combo["fallbacks"], combo
    assert c["combos"][0]["ordered"] is True  # the push followed the producer's stream
    for combo in p["combos"]:
        assert combo["pushed"] >= 3 and not combo["fallbacks"], combo
        assert combo["push_raw"], combo  # launched through the driver (verified)


def test_a_cancelled_grant_writes_nothing(tmp_path: Path) -> None:
    r = run_pair("push_cancel", tmp_path, worker=WORKER)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    for rid in ("k1", "k2"):
        assert c[rid + "_done_before_cancel"] is False
        assert c[rid] == "cancelled"
        assert c[rid + "_untouched_at_return"] and c[rid + "_untouched_later"], rid
    # k1: the stale grant was taken and pushed (its abort word set): no release comes
    assert p["k1"] == "TransferTimeoutError"
    assert c["k1_cancel_s"] < 1.0 + 0.5  # settled: word landed, no answer in grace_s
    # k2: the consumer's release said the request failed; the push ended only after
    # the grace period (behind the GPU sleep), and wrote nothing when it ran
    assert p["k2"] == "TransferAbortedError"
    assert p["pushed"] == 2 and c["aborted"] == 2 and c["grants"] == 2
    assert c["push_unsettled"] == 1


def test_killed_consumer_with_a_grant_out(tmp_path: Path) -> None:
    r = run_pair("push_kill_consumer", tmp_path, timeout=120, worker=WORKER)
    p = r["producer"]
    assert p is not None
    assert p["send"] == "TransferTimeoutError"
    assert p["pushed"] == 1 and p["healthy"], p


@pytest.mark.parametrize("layerwise", [False, True])
def test_bench_latency_from_the_gpu_ready(layerwise: bool) -> None:
    """``--gpu-lead-us``: the producer sends while GPU work is still queued before its
    KV counts as written; the bench reports the latency from that work's end
    (``p50_ready_ms``), which is the call's latency less the lead, request by request,
    and the pushed copies land bit-exact. ``--layerwise``: each layer saved after its
    share of the lead (3.2 ms: 0.1 ms a layer, so the host keeps ahead of the GPU)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    lead = 3200 if layerwise else 500
    r = subprocess.run(
        [sys.executable, "-m", "aiokv.cli.bench.kv", "--transport", "ipc", "--workload", "tiny",
         "--json", "--iters", "1", "--latency-n", "30", "--latency-gap-ms", "2",
         "--gpu-lead-us", str(lead), "--push", *(["--layerwise"] if layerwise else [])],
        capture_output=True, text=True, timeout=250, env=env, cwd=root,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["ok"] is True and rec["gpu_lead_us"] == lead
    assert rec["latency_layerwise"] is layerwise
    assert rec["ipc"]["pushes_received"] >= 30, rec["ipc"]
    assert 0 < rec["p50_ready_return_ms"] <= rec["p50_ready_ms"], rec
    gap = rec["p50_ms"] - rec["p50_ready_ms"]  # the lead, as the GPU ran it
    assert 0.8 * lead / 1e3 < gap < (3 if layerwise else 1.3) * lead / 1e3, rec
