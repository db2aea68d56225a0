"""AIOKV_TRACE: both ends' steps recorded, written at exit, joined by benchmarks/trace_report.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import asyncio, sys, torch, aiokv

async def main():
    # argv[1] "reserve": the receiver's window is 1 byte, every transfer asks (v1 path)
    lim = aiokv.Limits(credit_bytes=1) if sys.argv[1] == "reserve" else aiokv.Limits()
    async with aiokv.Engine() as a, aiokv.Engine(aiokv.EngineConfig(limits=lim)) as b:
        for i in range(5):
            await a.send(f"t{i}", torch.full((256,), float(i)), to=b.address)
            await b.recv(f"t{i}", timeout=10)

asyncio.run(main())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["reserve", "credit"])
def test_trace_records_every_step_of_both_ends_and_the_report_joins_them(
    tmp_path: Path, path: str
) -> None:
    prefix = tmp_path / "tr"
    env = dict(os.environ, AIOKV_TRACE=str(prefix))
    subprocess.run([sys.executable, "-c", CHILD, path], env=env, check=True, timeout=50)
    files = sorted(tmp_path.glob("tr.*.json"))
    assert len(files) == 1  # one process, written once at exit
    events = json.loads(files[0].read_text())["events"]
    steps: dict[int, set[str]] = {}
    for step, _session, xfer, _t in events:
        steps.setdefault(xfer, set()).add(step)
    assert len(steps) == 5
    want = (
        {"start", "reserve", "granted", "grant", "posted", "landed", "done"}
        if path == "reserve"
        else {"start", "posted", "landed", "done"}  # protocol v2: one message, then the ACK
    )
    assert all(s == want for s in steps.values()), steps
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_report.py"), "--json", str(files[0])],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    rows = {r["hop"]: r for r in map(json.loads, out.splitlines())}
    hops = ["posted->landed", "landed->done", "start->done"]
    if path == "reserve":
        hops += ["start->reserve", "granted->grant"]
    for hop in hops:
        assert rows[hop]["n"] == 5 and rows[hop]["median_us"] >= 0
    assert rows["start->done"]["median_us"] >= rows["posted->landed"]["median_us"]
    assert rows["overlap"]["n"] == 5


@pytest.mark.timeout(60)
def test_no_trace_without_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIOKV_TRACE"}
    code = "import aiokv._runtime.trace as t; print(t.enabled)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert out.stdout.strip() == "False"
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_enable_from_code_traces_without_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIOKV_TRACE"}
    prefix = tmp_path / "fn"
    code = "import sys, aiokv._runtime.trace as t; t.enable(sys.argv[2]); " + CHILD.replace(
        "import asyncio, sys, torch, aiokv", "import asyncio, torch, aiokv"
    )
    subprocess.run(
        [sys.executable, "-c", code, "credit", str(prefix)], env=env, check=True, timeout=50
    )
    files = sorted(tmp_path.glob("fn.*.json"))
    assert len(files) == 1
    steps = {e[0] for e in json.loads(files[0].read_text())["events"]}
    assert steps == {"start", "posted", "landed", "done"}
