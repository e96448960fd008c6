"""The RL loop's numbers on the demo's model, side by side in one run:

1. the reference engine's generation throughput (tokens/s) on the demo model: 256 sequences of
   32 tokens sent at once through the rollout client to two engines, and one sequence alone;
2. the same GRPO loop run sync and async (one step off-policy) against fresh engines, on two
   workloads (the demo's 4-token completions, where a step's generation is shorter than its
   training, and 64-token completions trained for one epoch, where generation dominates the step
   as in real RL): wall time, how much of each push the engines spent generating (steady state:
   the first and last push left out), and the share of the run they were idle, per mode.

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
from weightsync_rl.demo import LR, build_demo_model
from weightsync_rl import CountingTask, RLLoop
from weightsync_rl.rollout import RolloutClient, SamplingParams
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import start_all


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


# (completion tokens, epochs): the demo's shape, where a step's generation is shorter than its
# training, and one where generation dominates the step, as in real RL (long completions)
WORKLOADS = {"demo": (4, 4), "long": (64, 1)}


def loop(mode: str, steps: int, model_dir: Path, work: Path, workload: str = "demo",
         threads: int = 1) -> dict[str, Any]:
    """The GRPO loop in `mode` against two fresh engines (version 0), as the demo runs it, with
    `workload`'s completion length and epochs (the demo's task scores the first 4 tokens)."""
    tokens, epochs = WORKLOADS[workload]
    from weightsync_reference.models import load_trainer_model
    torch.manual_seed(0)
    model = load_trainer_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    # each engine computes on `threads` threads: the trainer and two engines share the cores
    env = {"OMP_NUM_THREADS": str(threads)}
    engines = start_all([EngineProcess(model_dir, name=n, log=work / f"{mode}-{n}.log", env=env)
                         for n in ("a", "b")])
    try:
        # the async loop keeps generation that spans the swap going (as the demo does)
        cfg = {"engines": [e.spec() for e in engines],
               "sync": {"progress": "off", **({"pause_mode": "keep"} if mode == "async" else {})}}
        with WeightSync.from_config(cfg) as sync, RolloutClient.of(sync) as client:
            tput = throughput(client) if mode == "sync" and workload == "demo" else None
            rl = RLLoop(model, opt, sync, client.sample, CountingTask(seed=1),
                        SamplingParams(n=8, max_new_tokens=tokens, seed=1), prompts_per_step=32,
                        mode=mode, epochs=epochs,
                        busy=lambda: {a.engine_name: a.busy_seconds() for a in sync.adapters})
            stats = list(rl.run(steps))
    finally:
        for e in engines:
            e.stop()
    # per push, the least busy engine's share of it spent generating; the steady state leaves
    # out the first push (the first training step warms up and outlasts any generation) and the
    # last (the run ends: there is no next step to generate for)
    pushes = [min(s.busy_in_push.values()) if s.busy_in_push else 0.0 for s in stats]
    steady = pushes[1:-1] or pushes
    # the pushes that began while the next step's rollouts were still being generated
    outstanding = [x for x, st in zip(pushes, stats) if st.rollouts_in_push]
    return {"mode": mode, "workload": workload, "tokens": tokens, "epochs": epochs, "steps": steps, "wall_s": round(rl.wall, 3),
            "seconds_per_step": round(rl.wall / steps, 3),
            "sync_s_per_step": round(sum(s.sync_seconds for s in stats) / steps, 4),
            "trainer_waited_s_per_step": round(sum(s.rollout_seconds for s in stats) / steps, 4),
            "generating_during_push": round(sum(steady) / max(len(steady), 1), 3),
            "generating_during_each_push": [round(x, 3) for x in pushes],
            "pushes_with_rollouts_outstanding": len(outstanding),
            "generating_while_outstanding": (round(sum(outstanding) / len(outstanding), 3)
                                             if outstanding else None),
            "waited_each_step": [round(s.rollout_seconds, 3) for s in stats],
            "pause_s_per_step": round(sum(s.pause_window for s in stats) / steps, 4),
            "idle_fraction": {k: round(v, 3) for k, v in rl.idle_fraction().items()},
            "mean_staleness": round(sum(s.staleness for s in stats) / steps, 3),
            "spanning_a_swap": sum(s.mixed for s in stats),
            "samples": sum(s.samples for s in stats),
            "reward_first_last": [round(stats[0].reward, 3), round(stats[-1].reward, 3)],
            "throughput": tput}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workloads", default="demo,long",
                    help=f"which of {WORKLOADS} (completion tokens, epochs) to run both loops on")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="torch threads of each engine process (default 1: the trainer and two "
                         "engines share the machine's cores)")
    ap.add_argument("--trainer-threads", type=int, default=1,
                    help="torch threads of the trainer (this process); default 1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.trainer_threads)
    work = Path(tempfile.mkdtemp(prefix="ws-rl-bench-"))
    build_demo_model(work / "m")
    rows = [loop(mode, args.steps, work / "m", work, w, args.engine_threads)
            for w in args.workloads.split(",") for mode in ("sync", "async")]
    tput = next((r["throughput"] for r in rows if r["throughput"]), None)
    for r in rows:
        r.pop("throughput")
    if tput:
        print(f"reference engine, demo model, two engines: {tput['batched_tokens_per_s']} tokens/s "
              f"batched ({tput['sequences']} sequences of 32 tokens at once), "
              f"{tput['single_sequence_tokens_per_s']} tokens/s for one sequence alone")
    print(f"\n{'workload':<8} {'mode':<6} {'s/step':>7} {'sync s':>7} {'waited s':>8} {'gen. in push':>12} "
          f"{'idle (a, b)':>14} {'staleness':>9} {'across swap':>11}")
    for r in rows:
        idle = ", ".join(f"{v:.0%}" for v in r["idle_fraction"].values())
        print(f"{r['workload']:<8} {r['mode']:<6} {r['seconds_per_step']:>7.3f} {r['sync_s_per_step']:>7.3f} "
              f"{r['trainer_waited_s_per_step']:>8.3f} {r['generating_during_push']:>12.0%} "
              f"{idle:>14} {r['mean_staleness']:>9.2f} {r['spanning_a_swap']:>11}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                                               "engine_threads": args.engine_threads,
                                               "trainer_threads": args.trainer_threads,
                                               "throughput": tput, "loops": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
