"""One vLLM ``LLM`` with AiokvConnector, driven over stdin / stdout (JSON lines).

Run as ``python _llm_proc.py '<json config>'``. The engine core and the worker run
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``), so the
commands can read the scheduler's block pool and the worker's connector. Answers
are the stdout lines that start with ``@@``; everything else is vLLM's logging.

Commands (one JSON object a line): ``generate`` (prompts, max_tokens, params),
``abort_while_loading`` (one request that is aborted after ``after`` seconds),
``step_until_free`` (steps until ``free`` blocks are free, at most ``seconds``),
``state`` (free blocks, requests the scheduler holds, connector counters).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def answer(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import logging

    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("aiokv %(levelname)s %(message)s"))
    logging.getLogger("aiokv").addHandler(h)
    logging.getLogger("aiokv").setLevel(logging.DEBUG)
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_memory_bytes=16 << 20,
        distributed_executor_backend="uni",
        enable_prefix_caching=cfg.get("prefix_caching", True),
        seed=0,
        kv_transfer_config={
            "kv_connector": "AiokvConnector",
            "kv_connector_module_path": "aiokv.vllm",
            "kv_role": cfg["role"],
            "kv_connector_extra_config": cfg.get("extra", {}),
            "kv_load_failure_policy": cfg.get("failure_policy", "recompute"),
        },
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler

    def sp(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def out(o: Any) -> dict[str, Any]:
        c = o.outputs[0]
        return {
            "tokens": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "kv_transfer_params": o.kv_transfer_params,
            "num_cached_tokens": o.num_cached_tokens,
        }

    def state() -> dict[str, Any]:
        pool = scheduler.kv_cache_manager.block_pool
        return {
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks,
            "requests": len(scheduler.requests),
            "connector": get_kv_transfer_group().statistics(),
        }

    answer({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "generate":
                params = cmd.get("params") or [None] * len(cmd["prompts"])
                sps = []
                for p in params:
                    s = sp(cmd["max_tokens"])
                    if p is not None:
                        s.extra_args = {"kv_transfer_params": p}
                    sps.append(s)
                t0 = time.monotonic()
                res = llm.generate(
                    [{"prompt_token_ids": p} for p in cmd["prompts"]], sps, use_tqdm=False
                )
                answer({"outputs": [out(o) for o in res], "seconds": time.monotonic() - t0})
            elif op == "abort_while_loading":
                s = sp(cmd["max_tokens"])
                s.extra_args = {"kv_transfer_params": cmd["params"]}
                engine.add_request("doomed", {"prompt_token_ids": cmd["prompt"]}, s)
                t0 = time.monotonic()
                outs: list[Any] = []
                while time.monotonic() - t0 < cmd["after"]:
                    outs += engine.step()
                    time.sleep(0.01)
                waiting = len(scheduler.requests)
                engine.abort_request(["doomed"])
                t1 = time.monotonic()
                while (engine.has_unfinished_requests() or scheduler.requests) and (
                    time.monotonic() - t1 < 30
                ):
                    outs += engine.step()
                    time.sleep(0.01)
                answer(
                    {
                        "held_while_loading": waiting,
                        "finished_early": [o.request_id for o in outs if o.finished],
                        "drain_seconds": time.monotonic() - t1,
                        "state": state(),
                    }
                )
            elif op == "step_until_free":
                # step the engine (it hears from its worker only in steps) until it has
                # ``free`` free blocks, at most ``seconds``
                t0 = time.monotonic()
                pool = scheduler.kv_cache_manager.block_pool
                while pool.get_num_free_blocks() < cmd["free"] and (
                    time.monotonic() - t0 < cmd["seconds"]
                ):
                    engine.step()
                    time.sleep(0.01)
                answer({**state(), "seconds": time.monotonic() - t0})
            elif op == "state":
                answer(state())
            else:
                answer({"error": f"unknown op {op}"})
        except Exception:
            answer({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
