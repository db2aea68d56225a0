"""Developer and CI sessions: ``nox -s lint typecheck tests docs``.

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
    session.run("pytest", "-q", "-m", "not gpu and not multi_gpu and not slow", *session.posargs)


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
