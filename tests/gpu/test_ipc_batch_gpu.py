"""Step batches over the IPC plane on a real GPU (``gpu``): two processes, CUDA IPC on
one GPU. Batches of 1, 16 and 64 requests (``send_requests`` / ``recv_requests``) each
go as ONE plane request -- one descriptor, one copy kernel on the consumer -- and land
bit-exact, request by request, with every other block untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_ipc_gpu import run_pair

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("_ipc_batch_worker.py")


def test_batches_of_1_16_64_are_one_plane_request_each_bit_exact(tmp_path: Path) -> None:
    r = run_pair("batches", tmp_path, worker=WORKER)
    c, p = r["consumer"], r["producer"]
    assert c is not None and p is not None
    assert [b["count"] for b in c["batches"]] == [1, 16, 64]
    for i, (cb, pb) in enumerate(zip(c["batches"], p["batches"], strict=True)):
        assert cb["errors"] == [] and pb["errors"] == [], (cb, pb)
        assert cb["exact"] and cb["untouched"], cb
        assert cb["finished"] == pb["finished"] == cb["count"], (cb, pb)
        # the plane's counters: one plane request per batch, none the ordinary way
        assert cb["received"] == i + 1 and pb["sent"] == i + 1, (cb, pb)
        assert not cb["fallbacks"] and not pb["fallbacks"], (cb, pb)
        assert cb["verified"] == 1, cb
