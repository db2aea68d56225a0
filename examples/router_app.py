"""Run the aiokv disaggregated router inside your own ASGI deployment.

    AIOKV_ROUTER_TOKEN=... uvicorn examples.router_app:app --host 0.0.0.0 --port 8000
    # or, with the same options as `aiokv router`:
    python examples/router_app.py --port 8000 --prefill http://p:8100 --decode http://d:8200

Settings come from the environment: ``AIOKV_ROUTER_TOKEN`` (registration
token), ``AIOKV_PREFILL`` / ``AIOKV_DECODE`` (comma-separated static worker
URLs, e.g. vLLM instances), ``AIOKV_POLICY`` (``round_robin`` or
``least_outstanding``), ``AIOKV_EVICT_AFTER`` (seconds). Registering workers
use ``aiokv.serving.worker_lifespan`` or
``python -m aiokv.serving.demo.worker --role prefill --router http://127.0.0.1:8000``.
Clients then talk OpenAI to the router:

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "aiokv-demo", "prompt": "hello", "max_tokens": 8}'
    curl -s localhost:8000/metrics

See docs/serving.md ("Serving with the router"). Under another server than
``aiokv router``, make sure it sets TCP_NODELAY on its connections (uvicorn on
a socket from ``aiokv.serving.bind_socket`` does).
"""

from __future__ import annotations

import os
import sys

from aiokv.serving.router import TOKEN_ENV, RouterConfig, create_app, main


def _urls(name: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in os.environ.get(name, "").split(",") if u.strip())


config = RouterConfig(
    policy="least_outstanding"
    if os.environ.get("AIOKV_POLICY") == "least_outstanding"
    else "round_robin",
    evict_after=float(os.environ.get("AIOKV_EVICT_AFTER", "3")),
    max_attempts=3,
    max_prompt_length=16_384,
    token=os.environ.get(TOKEN_ENV) or None,
    prefill=_urls("AIOKV_PREFILL"),
    decode=_urls("AIOKV_DECODE"),
)
app = create_app(config)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
