"""Layer-wise streaming over the IPC plane on a real GPU (``gpu``): two processes, CUDA
IPC on one GPU (``_ipc_worker.py`` scenarios ``layers`` and ``layers_cancel``).

Covered: every layout (FlashAttention, FlashInfer, MLA, and an odd geometry) in bf16,
plus fp8 and fp32, bit-exact, with each layer written on the producer's stream only
after GPU sleep and saved at once (a copy not ordered after that layer's event reads
the previous request's bytes); neighbours untouched; nothing taking the ordinary path;
cancellation mid-stream (later layers never written, also after their events fired;
the producer's wait_saved fails; the blocks take the next request at once).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_ipc_gpu import run_pair

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_layerwise_every_layout_bit_exact(tmp_path: Path) -> None:
    r = run_pair("layers", tmp_path)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert len(c["combos"]) == 6
    for combo in c["combos"]:
        assert combo["ok"] and combo["untouched"], combo
        assert combo["received"] == 3 and combo["ordinary_chunks"] == 0, combo
        assert combo["verified"] == 1 and not combo["fallbacks"], combo
    for combo in p["combos"]:
        assert combo["sent"] == 3 and not combo["fallbacks"], combo


def test_layerwise_cancel_mid_stream(tmp_path: Path) -> None:
    r = run_pair("layers_cancel", tmp_path)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert c["lc"] == "cancelled" and not c["done_before_cancel"], c
    assert c["cancel_s"] < 1.0, c  # nothing queued behind the pending events (host wait)
    assert c["first_layers_landed"], c
    assert c["untouched_at_return"] and c["untouched_later"], c
    assert c["after_ok"] and c["finished"] == ["after", "warm"], c
    assert c["aborted"] == 1 and not c["fallbacks"], c
    assert p["lc"] == "TransferAbortedError", p
    assert p["finished"] == ["after", "warm"], p
