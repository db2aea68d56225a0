"""The ``aiokv demo``: a tiny model served disaggregated (prefill → decode) through the router.

* :mod:`aiokv.demo.model`  — deterministic toy transformer with a paged KV cache;
* :mod:`aiokv.demo.worker` — a prefill or decode worker (FastAPI + aiokv Engine + KVConnector);
* :mod:`aiokv.demo.run`    — orchestration: router + workers as processes, checks, report.

Nothing heavy is imported here; import the submodules.
"""
