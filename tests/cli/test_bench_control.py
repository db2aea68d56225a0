"""``aiokv bench control``: the real two-process benchmark, tiny counts, checked field by field."""

from __future__ import annotations

import io
import json
import math
import os
import pstats
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiokv import cli
from aiokv.cli.bench.control import TARGETS, WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--reps", "2", "--lat-iters", "20", "--rate-iters", "60", "--stream-iters", "8"]
TINY += ["--window", "8"]


def _aiokv(*args: str, timeout: float = 25) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    return subprocess.run(
        [sys.executable, "-m", "aiokv", "bench", "control", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _positive_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(30)
def test_json_has_every_workload_with_sane_ratios() -> None:
    r = _aiokv("--json", *TINY)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert [row["workload"] for row in rows] == list(WORKLOADS)
    for row in rows:
        w = row["workload"]
        assert row["bench"] == "control" and row["loop"] == "uvloop"  # uvloop is the default
        assert row["reps"] == 2
        assert len(row["raw_all"]) == len(row["engine_all"]) == 2  # the warm-up pair is dropped
        for key in ("raw", "engine", "ratio", "ratio_paired_median"):
            assert _positive_finite(row[key]), (w, key, row[key])
        assert row["ratio"] == pytest.approx(row["engine"] / row["raw"], rel=0.01)
        op, bound = TARGETS[w]
        assert row["target"] == f"{op} {bound}"
        assert row["pass"] is (row["ratio"] <= bound if op == "<=" else row["ratio"] >= bound)
        for key in ("sender_max_stall_ms", "receiver_max_stall_ms"):
            assert math.isfinite(row[key]) and row[key] >= 0
        for key in ("sender_gc_us_per_transfer", "receiver_gc_us_per_transfer"):
            assert math.isfinite(row[key]) and row[key] >= 0
        assert isinstance(row["sender_gc_collections"], int)
    send, rate, stream = rows
    assert send["size_bytes"] == 4096 and send["iters"] == 20 and send["window"] == 1
    assert send["unit"] == "us"
    assert _positive_finite(send["ratio_p99"])
    assert send["raw_p99"] >= send["raw"] and send["engine_p99"] >= send["engine"]
    assert rate["size_bytes"] == 4096 and rate["iters"] == 60 and rate["window"] == 8
    assert rate["unit"] == "transfers/s"
    assert rate["raw_gbps"] == pytest.approx(rate["raw"] * 4096 / 1e9, rel=0.01)
    assert stream["size_bytes"] == 1 << 20 and stream["iters"] == 8
    assert stream["unit"] == "bytes/s"
    assert stream["engine_gbps"] == pytest.approx(stream["engine"] / 1e9, rel=0.01)


@pytest.mark.timeout(30)
def test_table_on_asyncio_with_profiles(tmp_path: Path) -> None:
    r = _aiokv("--loop", "asyncio", "--workloads", "send4k", "--profile", str(tmp_path), *TINY)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["workload", "metric", "raw", "engine"]
    assert lines[1].startswith("send4k") and "p50 us" in lines[1]
    assert "p99 us" in lines[2]
    assert "loop asyncio" in lines[-1]
    for side in ("sender", "receiver"):
        text = (tmp_path / f"profile-send4k-{side}.txt").read_text()
        assert "function calls" in text and "cumulative" in text
        # the engine's own code ran under the profiler: the sender's send, the receiver's recv
        out = io.StringIO()
        stats = pstats.Stats(str(tmp_path / f"profile-send4k-{side}.prof"), stream=out)
        fn = "send" if side == "sender" else "recv"
        stats.print_stats(rf"aiokv[/\\]engine[/\\]engine\.py:\d+\({fn}\)")
        assert re.search(rf"engine\.py:\d+\({fn}\)", out.getvalue()), out.getvalue()


def test_bad_workload_is_refused() -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "control", "--workloads", "send4k,nope"])
    assert e.value.code == 2


def _row(workload: str, ratio: float) -> dict[str, Any]:
    from aiokv.cli.bench.control import _passed

    op, bound = TARGETS[workload]
    return {
        "workload": workload,
        "ratio": ratio,
        "target": f"{op} {bound}",
        "pass": _passed(workload, ratio),
    }


@pytest.mark.timeout(30)
def test_check_turns_a_missed_target_into_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import aiokv.cli.bench.control as bc

    rows = [_row("send4k", 1.1), _row("rate4k", 0.2)]  # rate4k misses its >= 0.5

    def fake_run(coro: Any, loop: str) -> list[dict[str, Any]]:
        coro.close()  # the real run is not needed: the exit status is under test
        return rows

    monkeypatch.setattr(bc, "_run_loop", fake_run)
    assert cli.main(["bench", "control", "--json"]) == 0  # reports only
    assert cli.main(["bench", "control", "--json", "--check"]) == 1
    err = capsys.readouterr().err
    assert "rate4k missed its target" in err and "send4k" not in err
    rows[1] = _row("rate4k", 0.9)
    assert cli.main(["bench", "control", "--json", "--check"]) == 0


def test_help_says_what_the_targets_mean(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "control", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ratio = engine / raw" in text and "--check" in text
    assert f"at most {TARGETS['send4k'][1]}x raw" in text
