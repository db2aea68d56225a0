#!/usr/bin/env bash
# Download (here, with registry access) the wheels the GPU machine lacks, for Python 3.12:
# .whl = pyzmq (the engine), .whl2 = what the demo's router/workers need.
# Both folders are git-ignored; name them in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl pyzmq==27.3.0
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl2 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.54.0 \
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  prometheus_client==0.26.0 typing-inspection==0.4.5 annotated-types==0.8.0 click==8.5.1 \
  idna==3.20 certifi typing_extensions==4.16.0 opentelemetry-api==1.45.2 annotated-doc \
  pygments==2.21.0
ls .whl .whl2
