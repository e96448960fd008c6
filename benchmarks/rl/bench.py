"""The RL loop's numbers on the demo's model, side by side in one run:

1. the reference engine's generation throughput (tokens/s) on the demo model: 256 sequences of
   32 tokens sent at once through the rollout client to two engines, and one sequence alone;
2. the same GRPO loop run sync and async (one step off-policy) against the same two engines:
   wall time, how much of each push the engines spent generating, and the share of the run they
   were idle, per mode.

    .venv/bin/python benchmarks/rl/bench.py --steps 12 --json benchmarks/rl/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from weightsync import WeightSync
from weightsync.rl import CountingTask, RLLoop
from weightsync.rl.task import VOCAB
from weightsync.rollout import RolloutClient, SamplingParams
from weightsync.testing import EngineProcess
from weightsync.testing.engines import start_all
from weightsync.testing.models import build_tiny_model


def throughput(client: RolloutClient) -> dict[str, float]:
    prompts = [[1, 2 + i % 10] for i in range(32)]
    params = SamplingParams(n=8, max_new_tokens=32, seed=0)
    client.sample(prompts[:2], params)                       # warm up both engines
    t = time.perf_counter()
    out = client.sample(prompts, params)
    batched = sum(len(s.token_ids) for s in out) / (time.perf_counter() - t)
    t = time.perf_counter()
    one = client.sample(prompts[:1], SamplingParams(max_new_tokens=32, seed=0))
    single = len(one[0].token_ids) / (time.perf_counter() - t)
    return {"batched_tokens_per_s": round(batched, 1), "single_sequence_tokens_per_s": round(single, 1),
            "sequences": len(out)}


def loop(mode: str, steps: int, model_dir: Path, work: Path) -> dict[str, Any]:
    """The GRPO loop in `mode` against two fresh engines (version 0), as the demo runs it."""
    from weightsync.testing.models import load_trainer_model
    torch.manual_seed(0)
    model = load_trainer_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    engines = start_all([EngineProcess(model_dir, name=n, log=work / f"{mode}-{n}.log")
                         for n in ("a", "b")])
    try:
        cfg = {"engines": [e.spec() for e in engines], "sync": {"progress": "off"}}
        with WeightSync.from_config(cfg) as sync, sync.rollout_client() as client:
            tput = throughput(client) if mode == "sync" else None
            rl = RLLoop(model, opt, sync, client.sample, CountingTask(seed=1),
                        SamplingParams(n=8, max_new_tokens=4, seed=1), prompts_per_step=32,
                        mode=mode, epochs=4,
                        busy=lambda: {a.engine_name: a.busy_seconds() for a in sync.adapters})
            stats = list(rl.run(steps))
    finally:
        for e in engines:
            e.stop()
    pushes = [min(s.busy_in_push.values()) for s in stats if s.busy_in_push]
    return {"mode": mode, "steps": steps, "wall_s": round(rl.wall, 3),
            "seconds_per_step": round(rl.wall / steps, 3),
            "sync_s_per_step": round(sum(s.sync_seconds for s in stats) / steps, 4),
            "trainer_waited_s_per_step": round(sum(s.rollout_seconds for s in stats) / steps, 4),
            "generating_during_push": round(sum(pushes) / max(len(pushes), 1), 3),
            "idle_fraction": {k: round(v, 3) for k, v in rl.idle_fraction().items()},
            "mean_staleness": round(sum(s.staleness for s in stats) / steps, 3),
            "reward_first_last": [round(stats[0].reward, 3), round(stats[-1].reward, 3)],
            "throughput": tput}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ws-rl-bench-"))
    build_tiny_model(work / "m", "llama", vocab=VOCAB, hidden=64, intermediate=128)
    rows = [loop("sync", args.steps, work / "m", work), loop("async", args.steps, work / "m", work)]
    tput = rows[0].pop("throughput")
    rows[1].pop("throughput")
    print(f"reference engine, demo model, two engines: {tput['batched_tokens_per_s']} tokens/s "
          f"batched ({tput['sequences']} sequences of 32 tokens at once), "
          f"{tput['single_sequence_tokens_per_s']} tokens/s for one sequence alone")
    print(f"\n{'mode':<6} {'s/step':>7} {'sync s':>7} {'waited s':>8} {'gen. in push':>12} "
          f"{'idle (a, b)':>14} {'staleness':>9}")
    for r in rows:
        idle = ", ".join(f"{v:.0%}" for v in r["idle_fraction"].values())
        print(f"{r['mode']:<6} {r['seconds_per_step']:>7.3f} {r['sync_s_per_step']:>7.3f} "
              f"{r['trainer_waited_s_per_step']:>8.3f} {r['generating_during_push']:>12.0%} "
              f"{idle:>14} {r['mean_staleness']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                                               "throughput": tput, "loops": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
