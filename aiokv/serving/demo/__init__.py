"""The ``aiokv demo``: a tiny model served disaggregated (prefill → decode) through the router.

* :mod:`aiokv.serving.demo.model`  — deterministic toy transformer with a paged KV cache;
* :mod:`aiokv.serving.demo.worker` — prefill or decode worker (FastAPI + Engine; vLLM's kv_transfer_params);
* :mod:`aiokv.serving.demo.run`    — orchestration: router + workers as processes, checks, report.

Nothing heavy is imported here; import the submodules.
"""
