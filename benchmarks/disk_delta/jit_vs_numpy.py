"""What `weightsync-disk-delta[fast]` buys: the delta path with numba's compiled kernels against
the numpy fallback (what a plain `pip install weightsync-disk-delta` runs), in one process.

The two lanes take turns on every version (the order alternates), so a busy neighbour on the
machine slows both alike; each lane has its own published root, kept copy and host checkpoint.

  python benchmarks/disk_delta/jit_vs_numpy.py                          # 1 GiB, 1 %, 5 versions
  python benchmarks/disk_delta/jit_vs_numpy.py --size 256MiB --densities 0.001,0.01,0.05

Per lane and density it prints the medians of: publish (WeightSync.push), the trainer's kept
patch (after push, in the background on a real trainer; let finish here), pull + apply (the
host agent, shards read cold) and their sum, then the numpy lane's time over the numba lane's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Model, drop_cache, published, synthetic  # noqa: E402

from weightsync import WeightSync  # noqa: E402
from weightsync.config import parse_bytes  # noqa: E402
from weightsync_disk_delta import kernels  # noqa: E402
from weightsync_disk_delta.agent import Agent  # noqa: E402

LANES = ("numba", "numpy")


def lane(work: Path, name: str) -> tuple[WeightSync, Agent, Path]:
    root = work / f"root-{name}"
    cfg = {"encoding": {"kind": "delta", "options": {"full_when_chain_exceeds": 0}},
           "transport": {"kind": "disk_delta", "options": {"root": str(root), "keep_full": 100}},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": "256MiB"}},
           "sync": {"progress": "off"}}
    return WeightSync.from_config(cfg), Agent(root, work / f"local-{name}"), root


def use(name: str) -> None:
    kernels.JIT = name == "numba"
    assert (kernels.jit() is not None) == (name == "numba"), "numba is not importable here"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GiB", help="bf16 model size")
    p.add_argument("--dim", type=int, default=4096, help="layer width (a layer is dim x dim)")
    p.add_argument("--densities", default="0.01", help="fractions of elements changed per version")
    p.add_argument("--repeat", type=int, default=5, help="versions per density")
    p.add_argument("--workdir", default=None, help="a directory on the disk to measure")
    p.add_argument("--json", default=None, help="write the rows and medians here")
    args = p.parse_args()
    torch.manual_seed(0)
    layers = max(1, round(parse_bytes(args.size) / (args.dim * args.dim * 2)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ws-jit-vs-numpy-"))
    work.mkdir(parents=True, exist_ok=True)
    state = published(Model(layers, args.dim))
    print(f"model: {layers} layers of {args.dim}x{args.dim} bf16 = "
          f"{sum(t.numel() * 2 for t in state.values()) / 2**30:.2f} GiB; {os.cpu_count()} cores; "
          f"workdir {work}", flush=True)
    lanes = {}
    for name in LANES:
        use(name)
        lanes[name] = lane(work, name)
        lanes[name][0].push(state, version=1)
        lanes[name][1].sync_local()
    rows, v = [], 1
    for density in (float(d) for d in args.densities.split(",")):
        for k in range(args.repeat):
            v += 1
            new = synthetic(state, density, seed=v)
            order = LANES if v % 2 == 0 else LANES[::-1]
            for name in order:
                sync, agent, root = lanes[name]
                use(name)
                os.sync()
                t0 = time.perf_counter()
                sync.push(new, version=v)
                publish = time.perf_counter() - t0
                kept = sync.encoding.settle()
                drop_cache(root / "versions" / f"v{v:08d}")
                t0 = time.perf_counter()
                assert agent.sync_local() == v
                pull = time.perf_counter() - t0
                rows.append({"lane": name, "density": density, "version": v, "publish_s": publish,
                             "kept_patch_s": kept, "pull_apply_s": pull, "total_s": publish + pull})
                print(f"v{v} {density:.1%} {name:>5}: publish {publish:.3f}s  kept patch {kept:.3f}s  "
                      f"pull+apply {pull:.3f}s", flush=True)
            state = new
    medians = []
    print("\n| density | lane | publish s | kept patch s | pull+apply s | publish + pull s |")
    print("|---|---|---|---|---|---|")
    for density in sorted({r["density"] for r in rows}):
        m = {}
        for name in LANES:
            sel = [r for r in rows if r["lane"] == name and r["density"] == density]
            m[name] = {key: statistics.median(r[key] for r in sel)
                       for key in ("publish_s", "kept_patch_s", "pull_apply_s", "total_s")}
            print(f"| {density:.1%} | {name} | {m[name]['publish_s']:.3f} | {m[name]['kept_patch_s']:.3f} | "
                  f"{m[name]['pull_apply_s']:.3f} | {m[name]['total_s']:.3f} |")
        ratio = {key: m["numpy"][key] / m["numba"][key] for key in m["numba"] if m["numba"][key]}
        print(f"| {density:.1%} | numpy / numba | {ratio.get('publish_s', 0):.2f}x | "
              f"{ratio.get('kept_patch_s', 0):.2f}x | {ratio.get('pull_apply_s', 0):.2f}x | "
              f"{ratio.get('total_s', 0):.2f}x |")
        medians.append({"density": density, **{f"{n}_{k}": val for n in LANES for k, val in m[n].items()},
                        **{f"ratio_{k}": val for k, val in ratio.items()}})
    for sync, _, _ in lanes.values():
        sync.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "cores": os.cpu_count(),
                                               "rows": rows, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
