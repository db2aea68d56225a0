"""Run the aiokv disaggregated router inside your own ASGI deployment.

    uvicorn examples.router_app:app --host 0.0.0.0 --port 8000
    # or
    python examples/router_app.py --port 8000

Workers register themselves (see ``aiokv.serving.worker_lifespan`` and
``python -m aiokv.demo.worker --role prefill --router http://127.0.0.1:8000``);
clients then talk OpenAI to the router:

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
         -d '{"model": "aiokv-demo", "prompt": "hello", "max_tokens": 8}'
    curl -s localhost:8000/instances
    curl -s localhost:8000/metrics
"""

from __future__ import annotations

import os
import sys

from aiokv.router import RouterConfig, create_app, main

config = RouterConfig(
    policy="least_outstanding"
    if os.environ.get("AIOKV_POLICY") == "least_outstanding"
    else "round_robin",
    evict_after=float(os.environ.get("AIOKV_EVICT_AFTER", "3")),
    max_attempts=3,
    max_prompt_length=16_384,
)
app = create_app(config)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
