#!/usr/bin/env bash
# The main job from a fresh clone, set-up included: a venv (.venv, shared with .ci/run),
# the pinned CPU torch first (an unpinned torch would pull a multi-GB CUDA build; on a GPU
# machine pre-install your CUDA torch in .venv and this keeps it), the project with its demo
# extra, then `aiokv demo` (extra arguments are passed on, e.g. --prompts 16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip prints a line per package (no -q), so a first install shows its progress; its
# progress bars go to a terminal only (in a log they are a screen of control characters)
PROGRESS=()
[[ -t 1 ]] || PROGRESS=(--progress-bar off)
if python -c "import torch" 2>/dev/null; then
    echo "== torch: already installed ($(python -c 'import torch; print(torch.__version__)'))"
else
    echo "== install 1/2: torch==2.13.0 (CPU; a few minutes on a fresh venv)"
    python -m pip install ${PROGRESS[@]+"${PROGRESS[@]}"} torch==2.13.0
fi
echo "== install 2/2: aiokv with the demo extra (-e .[demo])"
python -m pip install ${PROGRESS[@]+"${PROGRESS[@]}"} -e '.[demo]'
echo "== aiokv demo $*"
exec aiokv demo "$@"
