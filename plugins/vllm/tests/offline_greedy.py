"""Greedy token ids from vLLM loading a model directory from disk (its own loader, offline, in
one process): the reference a pushed engine is compared with. Run as a script by the live tests:

    python offline_greedy.py '{"models": [dir, ...], "prompt": [ids], "n": 16}'  -> {"dir": [ids], ...}
"""

from __future__ import annotations

import gc
import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    params = SamplingParams(max_tokens=spec["n"], temperature=0.0, ignore_eos=True)
    out = {}
    for model in spec["models"]:
        llm = LLM(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=256 * 2**20, distributed_executor_backend="uni")
        result = llm.generate({"prompt_token_ids": spec["prompt"]}, params, use_tqdm=False)
        out[model] = list(result[0].outputs[0].token_ids)
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
        del llm
        gc.collect()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
