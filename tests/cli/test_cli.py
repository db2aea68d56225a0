"""The ``aiokv`` command: help, the TCP transport benchmark, doctor, clear errors."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the command's module (the attribute aiokv.cli.main is the console-script function)
cli = importlib.import_module("aiokv.cli.main")
KEYS = {"transport", "size_bytes", "iters", "aiokv_gbps", "raw_gbps", "ratio", "max_loop_stall_ms"}


def _aiokv(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    return subprocess.run(
        [sys.executable, "-m", "aiokv", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_help_lists_every_command() -> None:
    r = _aiokv("--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("demo", "router", "doctor", "bench"):
        assert cmd in r.stdout


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: aiokv" in capsys.readouterr().out


def test_bench_transport_help() -> None:
    r = _aiokv("bench", "transport", "--help")
    assert r.returncode == 0, r.stderr
    assert "--transport" in r.stdout and "--sizes" in r.stdout


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "transport", "--sizes", "x"])
    assert e.value.code == 2


@pytest.mark.timeout(120)
def test_bench_transport_tcp_json() -> None:
    r = _aiokv(
        "bench",
        "transport",
        "--transport",
        "tcp",
        "--json",
        "--sizes",
        "1",
        "--iters",
        "3",
        timeout=110,
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout
    row = json.loads(lines[0])
    assert KEYS <= row.keys()
    assert row["transport"] == "tcp"
    assert row["size_bytes"] == 1 << 20
    assert row["iters"] == 3
    assert row["aiokv_gbps"] > 0 and row["raw_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["aiokv_gbps"] / row["raw_gbps"], rel=0.01)
    assert len(row["aiokv_gbps_all"]) == len(row["raw_gbps_all"]) == 3


@pytest.mark.timeout(120)
def test_bench_kv_in_steps_of_batches() -> None:
    r = _aiokv(
        "bench",
        "kv",
        "--workload",
        "steps",
        "--batch",
        "16",
        "--iters",
        "2",
        "--latency-n",
        "2",
        "--latency-warmup",
        "1",
        "--json",
        timeout=110,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["ok"] is True and row["batch"] == 16 and row["one_by_one"] is False
    assert row["steps"] == 4 and row["requests"] == 64
    assert row["producer_host_ms_per_step"] > 0 and row["consumer_host_ms_per_step"] > 0
    bad = _aiokv("bench", "kv", "--one-by-one")
    assert bad.returncode == 2 and "--one-by-one needs --batch" in bad.stderr


def test_doctor_exits_zero_without_gpu() -> None:
    pytest.importorskip("aiokv.cli.doctor")
    r = _aiokv("doctor")
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout
    assert "event waits  timerfd" in r.stdout  # (Linux)


def test_missing_part_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = cli.importlib.import_module

    def fake_import(name: str, package: str | None = None) -> object:
        if name == "aiokv.cli.bench.kv":
            raise ImportError("simulated: not installed")
        return real(name, package)

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    rc = cli.main(["bench", "kv"])
    assert rc == 2
    assert "aiokv.cli.bench.kv is not available" in capsys.readouterr().err


def test_help_and_router_import_do_not_import_torch() -> None:
    """``aiokv --help`` stays fast: neither the CLI nor the router pulls in torch."""
    code = (
        "import sys, contextlib, io\n"
        "from aiokv import cli\n"
        "import aiokv.serving.router\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "from aiokv import Engine, EngineConfig, AiokvError\n"
        "import aiokv\n"
        "assert all(hasattr(aiokv, n) for n in aiokv.__all__)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_router_help_lists_its_options() -> None:
    r = _aiokv("router", "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--token", "--prefill", "--decode", "--discovery", "--allow-link-local"):
        assert opt in r.stdout
    assert "AIOKV_ROUTER_TOKEN" in r.stdout


def test_worker_help_has_texts() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aiokv.serving.demo.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"),
    )
    assert r.returncode == 0, r.stderr
    assert "which leg this worker serves" in r.stdout
    assert "router base URL to register with" in r.stdout
    assert "heartbeats are logged at debug" in r.stdout


def test_router_refuses_itself_as_a_static_worker() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _aiokv("router", "--port", str(port), "--prefill", f"http://localhost:{port}", timeout=30)
    assert r.returncode == 2
    assert "this router's own address" in r.stderr
    r = _aiokv("router", "--prefill", "http://169.254.169.254", timeout=30)
    assert r.returncode == 2
    assert "link-local" in r.stderr


def _undocumented(help_text: str) -> list[str]:
    """Options in an argparse help text that come without a help line."""
    lines = help_text.split("options:", 1)[1].splitlines()
    missing = []
    for i, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        inline = "  " in line.strip()  # the invocation, two spaces, then its help
        after = lines[i + 1] if i + 1 < len(lines) else ""
        below = after.startswith("      ") and not after.strip().startswith("-")
        if not (inline or below):
            missing.append(line.strip())
    return missing


@pytest.mark.parametrize("command", ["kv", "control", "transport"])
def test_bench_help_is_clean(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: aiokv bench {command} "), text[:80]
    assert "python -m" not in text
    assert not any(mark in text for mark in ("``", ":class:", ":mod:", ":meth:", "~aiokv")), text
    assert _undocumented(text) == [], text


@pytest.mark.timeout(120)
def test_bench_receiver_imports_the_checkout_of_its_parent(tmp_path: Path) -> None:
    """The receiver child finds this checkout's aiokv even when only the parent's sys.path
    names it (no PYTHONPATH, started from elsewhere): the sender puts the folder that holds
    the ``aiokv`` package first on the child's path."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from aiokv.cli import main\n"
        "sys.exit(main(['bench', 'transport', '--transport', 'tcp', '--json',"
        " '--sizes', '0.0625', '--iters', '2', '--reps', '1']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["transport"] == "tcp"
