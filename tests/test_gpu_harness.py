"""The GPU tests' worker harness on CPU: bounded waits and a stack dump on a hang.

tests/gpu/ only runs on a GPU host; its line reader (tests/support/procs.py) is
plain Python, so it is checked here, where CI runs.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support.procs import LineReader

CHILD = r"""
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
print('ADDR {"a": 1}', flush=True)
print('NOISE x', flush=True)
print('READY [2]', flush=True)
def stuck_here():
    time.sleep(60)
stuck_here()
"""


@pytest.mark.timeout(30)
def test_line_reader_finds_keys_and_bounds_a_hang() -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        r = LineReader(p)
        assert r.expect("ADDR", 10) == {"a": 1}
        assert r.expect("READY", 10) == [2]  # other lines are skipped
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match=r"timed out after 0\.5 s waiting for NEVER"):
            r.expect("NEVER", 0.5)
        assert time.monotonic() - t0 < 5.0
    finally:
        p.kill()
        _out, err = p.communicate(timeout=10)
    assert "stuck_here" in err  # the SIGUSR1 stack dump names where it hung


@pytest.mark.timeout(30)
def test_line_reader_reports_a_dead_worker() -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", "print('ADDR 1')"],
        stdout=subprocess.PIPE,
        text=True,
    )
    r = LineReader(p)
    assert r.expect("ADDR", 10) == 1
    with pytest.raises(AssertionError, match="worker exited"):
        r.expect("BIDIR", 10)
    p.wait(timeout=10)
    assert p.stdout is not None
    p.stdout.close()
