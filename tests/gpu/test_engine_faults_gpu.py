"""Fault tests of the NCCL path on two GPUs (reliability rows 2, 5 and 7 on GPU).

Results of the GPU runs are in docs/reliability.md.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import torch

from .test_engine_nccl_gpu import Worker

pytestmark = [
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture
def hub() -> Any:
    b = Worker("cuda:1")
    try:
        yield b
    finally:
        b.close()


@pytest.mark.timeout(240)
def test_sigstop_peer_mid_transfer_survivor_times_out_and_recovers(hub: Any) -> None:
    b = hub
    victim = Worker("cuda:0")
    try:
        b.cmd("mem")
        before = b.expect("MEM", 60)
        b.cmd("wait_doomed")
        victim.cmd(f"victim {b.addr}")
        victim.expect("VICTIM_SENDING", 120)
        time.sleep(2.0)
        stopped_at = time.time()
        victim.p.send_signal(signal.SIGSTOP)
        res = b.expect("DOOMED", 60)
        print("SIGSTOP", res, "detect_s", res["raised_at"] - stopped_at)
        assert res["error"] == "PeerLostError"
        assert res["raised_at"] - stopped_at <= 5.0
        assert res["kernel_ok"] and res["kernel_s"] <= 1.0
        victim.p.send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        victim.cmd("quit")  # its engine closes: aclose() must be bounded
        victim.p.wait(timeout=15)
        assert time.monotonic() - t0 <= 12.0
        # the survivor's device memory is back (communicator aborted, the receive
        # buffer freed once its aborted kernel exited): poll, and report how long
        t_mem = time.monotonic()
        while True:
            b.cmd("mem")
            after = b.expect("MEM", 60)
            if after["allocated"] <= before["allocated"] or time.monotonic() - t_mem > 40:
                break
            time.sleep(0.5)
        print("MEM", before, after, "back_after_s", round(time.monotonic() - t_mem, 2))
        assert after["allocated"] <= before["allocated"]
    finally:
        if victim.p.poll() is None:
            victim.p.send_signal(signal.SIGCONT)
            victim.p.kill()
            victim.p.wait()
        victim.close()


@pytest.mark.timeout(300)
def test_peer_restart_next_100_nccl_transfers_succeed(hub: Any) -> None:
    b = hub
    first = Worker("cuda:0")
    try:
        first.cmd(f"burst {b.addr} 10")
        assert first.expect("BURST", 120)["ok"] == 10
        first.p.send_signal(signal.SIGKILL)
        first.p.wait()
    finally:
        first.close()
    second = Worker("cuda:0")  # a new process, a new engine, a new communicator
    try:
        second.cmd(f"burst {b.addr} 100")
        res = second.expect("BURST", 240)
        print("RESTART", res)
        assert res["ok"] == 100 and not res["errors"]
    finally:
        second.close()
