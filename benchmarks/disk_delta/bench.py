"""disk_delta benchmark: publish + pull + apply of a delta against writing and loading a full
safetensors checkpoint, on the same disk, in the same run.

The model is a stack of d x d linear layers (bf16 when published, fp32 master weights), trained
with real AdamW steps on a regression loss; then synthetic versions change exactly a chosen
fraction of elements by 1-4 bf16 ulps (the size of real optimizer updates).

  python benchmarks/disk_delta/bench.py                 # 256 MiB, the quick default
  python benchmarks/disk_delta/bench.py --size 1GiB     # the committed results' size

Per version it reports:
  wire bytes       bytes published (every shard, safetensors headers included; manifest not)
  ideal bytes      changed elements x (2 value bytes (bf16) + 4 index bytes (an int32 position
                   inside its tensor)): a plain sparse list with nothing wasted
  publish          WeightSync.push: export + encode + write + fsync + rename + `latest`
  pull + apply     the agent brings a host-local checkpoint from the previous version to this one:
                   reads `latest` and the manifest, reads the shards cold (their pages are dropped
                   from the page cache first, as if on another host), checks every shard and
                   tensor digest, journals and writes the changes in place
  kept patch       the trainer writes a version's changes into its kept copy after push returns,
                   in the background; here it is let finish before the pull is timed (on a fleet
                   the pull runs on another machine) and reported on its own
  baseline         save_file of the same version's full bf16 state + fsync (publish), then
                   load_file cold with every byte copied out (pull), measured right before the
                   delta of that version, so both see the same machine load
  encode ratio     encode throughput (logical bytes / encode seconds) / memcpy throughput of
                   the same bytes measured in this run

Every timing starts with no dirty pages (os.sync before the baseline and before the delta).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from weightsync import WeightSync
from weightsync_bench.measure import drop_cache
from weightsync.wire.bucket import digest_tensors
from weightsync.config import parse_bytes
from weightsync_disk_delta.agent import Agent


class Model(torch.nn.Module):
    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(layers))
        for lin in self.layers:
            torch.nn.init.normal_(lin.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def published(model: Model) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.weight": lin.weight.detach().to(torch.bfloat16)
            for i, lin in enumerate(model.layers)}


def synthetic(prev: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """Exactly `density` of the elements move by 1-4 bf16 ulps."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in prev.items():
        b = t.clone().view(torch.int16).reshape(-1)
        k = int(round(density * b.numel()))
        pos = torch.randperm(b.numel(), generator=g)[:k]
        step = torch.randint(1, 5, (k,), generator=g, dtype=torch.int16)
        sign = torch.where(torch.rand(k, generator=g) < 0.5, -1, 1).to(torch.int16)
        b[pos] = b[pos] + sign * step
        out[n] = b.view(torch.bfloat16).reshape(t.shape)
    return out


def changed_elements(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    return sum(int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a)


def memcpy_floor(state: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Bytes per second of copying the state into preallocated buffers (best of `repeats`)."""
    dst = {n: torch.empty_like(t) for n, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, t in state.items():
            dst[n].copy_(t)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def materialize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """load_file may map the file lazily; an engine copies every byte into its weights."""
    return {n: t.clone() for n, t in tensors.items()}


def baseline(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    d = work / "full-checkpoint"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    f = d / "model.safetensors"
    t0 = time.perf_counter()
    save_file(state, str(f))
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t_write = time.perf_counter() - t0
    drop_cache(f)
    t0 = time.perf_counter()
    loaded = materialize(load_file(str(f)))
    t_load = time.perf_counter() - t0
    del loaded
    shutil.rmtree(d)
    return {"write_s": t_write, "load_s": t_load, "total_s": t_write + t_load}


def summary(rows: list[dict]) -> list[dict]:
    """Per version label without its repeat number: the median of each timing and of
    the speedup, with the smallest and largest speedup."""
    import statistics
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(re.sub(r" #\d+", "", r["label"]), []).append(r)
    out = []
    for label, rs in groups.items():
        sp = [r["speedup_vs_full"] for r in rs]
        spk = [r["baseline"]["total_s"] / (r["e2e_s"] + r["kept_patch_s"]) for r in rs]
        out.append({"label": label, "n": len(rs), "density": statistics.median(r["density"] for r in rs),
                    "wire_over_ideal": statistics.median(r["wire_over_ideal"] or 0 for r in rs),
                    "publish_s": statistics.median(r["publish_s"] for r in rs),
                    "pull_apply_s": statistics.median(r["pull_apply_s"] for r in rs),
                    "full_ckpt_s": statistics.median(r["baseline"]["total_s"] for r in rs),
                    "speedup_median": statistics.median(sp), "speedup_min": min(sp), "speedup_max": max(sp),
                    "kept_patch_s": statistics.median(r["kept_patch_s"] for r in rs),
                    "speedup_incl_kept_median": statistics.median(spk),
                    "encode_over_memcpy": statistics.median(r["encode_over_memcpy"] or 0 for r in rs)})
    return out


def summary_table(result: dict) -> str:
    lines = ["| version | n | density | wire / ideal | publish s | pull+apply s | full ckpt s | "
             "speedup (median, min-max) | trainer's kept patch s | speedup counting it | encode / memcpy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        lines.append(f"| {r['label']} | {r['n']} | {r['density']:.3%} | {r['wire_over_ideal']:.2f} | "
                     f"{r['publish_s']:.2f} | {r['pull_apply_s']:.2f} | {r['full_ckpt_s']:.2f} | "
                     f"**{r['speedup_median']:.1f}x** ({r['speedup_min']:.1f}-{r['speedup_max']:.1f}) | "
                     f"{r['kept_patch_s']:.3f} | {r['speedup_incl_kept_median']:.1f}x | "
                     f"{r['encode_over_memcpy']:.3f} |")
    return "\n".join(lines)


def table(result: dict) -> str:
    """The markdown table of the README."""
    b = result["baseline"]
    lines = [f"Model {result['size_bytes'] / 2**30:.2f} GiB bf16 ({result['layers']} x {result['dim']}^2); "
             f"memcpy floor {result['memcpy_bytes_per_s'] / 1e9:.2f} GB/s; first full checkpoint "
             f"write+fsync {b['write_s']:.2f} s + cold load {b['load_s']:.2f} s. Each row's baseline "
             f"is a full checkpoint of that version written and loaded right before it.", "",
             "| version | density | wire MiB | wire / ideal | forms | publish s | pull+apply s | "
             "full ckpt s | speedup vs full | + engine reload s | encode / memcpy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        forms = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
        lines.append(f"| {r['label']} | {r['density']:.3%} | {r['wire_bytes'] / 2**20:.2f} | "
                     f"{r['wire_over_ideal']:.2f} | {forms} | {r['publish_s']:.2f} | "
                     f"{r['pull_apply_s']:.2f} | {r['baseline']['total_s']:.2f} | {r['speedup_vs_full']:.1f}x | "
                     f"{r['engine_reload_s']:.2f} | {r['encode_over_memcpy']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB", help="bf16 model size (the committed results use 1GiB)")
    p.add_argument("--dim", type=int, default=4096, help="layer width (a layer is dim x dim)")
    p.add_argument("--steps", type=int, default=1, help="real AdamW steps to publish")
    p.add_argument("--lr", type=float, default=1.5e-6, help="AdamW learning rate (RL-like)")
    p.add_argument("--densities", default="0.001,0.01,0.05,0.5")
    p.add_argument("--repeat", type=int, default=3,
                   help="versions per synthetic density; the summary reports their median")
    p.add_argument("--workdir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--no-xor-off", dest="xor_off", action="store_false",
                   help="skip the second lane (xor_min_density=1) measured where xor was used")
    args = p.parse_args()
    torch.manual_seed(0)

    layer_bytes = args.dim * args.dim * 2
    layers = max(1, round(parse_bytes(args.size) / layer_bytes))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ws-disk-delta-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Model(layers, args.dim)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    x = torch.randn(8, args.dim)
    y = torch.randn(8, args.dim).tanh()
    state = published(model)
    logical = sum(t.numel() * 2 for t in state.values())
    elements = logical // 2
    print(f"model: {layers} layers of {args.dim}x{args.dim} bf16 = {logical / 2**30:.3f} GiB; workdir {work}",
          flush=True)
    floor = memcpy_floor(state)
    base = baseline(state, work)
    print(f"memcpy floor {floor / 1e9:.2f} GB/s; full checkpoint write {base['write_s']:.2f}s + "
          f"load {base['load_s']:.2f}s", flush=True)

    # lane "default": the delta encoding as shipped; lane "xor off": xor_min_density=1 (only the
    # sparse form below the density threshold), reported where the default lane used xor
    lanes = []
    for lane, extra in (("default", {}), ("xor off", {"xor_min_density": 1.0}))[: 2 if args.xor_off else 1]:
        root, local = work / f"root-{lane.replace(' ', '-')}", work / f"local-{lane.replace(' ', '-')}"
        for d in (root, local):
            shutil.rmtree(d, ignore_errors=True)
        cfg = {"encoding": {"kind": "delta", "options": {"full_when_chain_exceeds": 0, **extra}},
               "transport": {"kind": "disk_delta", "options": {"root": str(root), "keep_full": 100}},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": "256MiB"}},
               "sync": {"progress": "off"}}
        lanes.append((lane, WeightSync.from_config(cfg), Agent(root, local), root))

    rows = []
    first_full = {}
    for lane, sync, agent, root in lanes:
        t0 = time.perf_counter()
        sync.push(state, version=1)                       # version 1: the full one hosts start from
        t_full_publish = time.perf_counter() - t0
        drop_cache(root)
        t0 = time.perf_counter()
        agent.sync_local()
        t_full_pull = time.perf_counter() - t0
        first_full.setdefault("publish_s", t_full_publish)
        first_full.setdefault("pull_s", t_full_pull)
        print(f"v1 full ({lane}): publish {t_full_publish:.2f}s, first local copy {t_full_pull:.2f}s",
              flush=True)
    prev = state
    del state
    plan = [f"adamw step {s + 1}" for s in range(args.steps)] + \
        [f"synthetic {float(d):.1%}" + (f" #{k + 1}" if args.repeat > 1 else "")
         for d in args.densities.split(",") for k in range(args.repeat)]
    v = 1
    for label in plan:
        if label.startswith("adamw"):                     # a real optimizer step
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            new = published(model)
        else:
            if model is not None:                         # free the optimizer's memory first
                model = opt = None
            new = synthetic(prev, float(label.split()[1].rstrip("%")) / 100, seed=v)
        v += 1
        changed = changed_elements(prev, new)
        want = {n: digest_tensors([(n, t)]) for n, t in new.items()}
        # every timing starts with no dirty pages: otherwise the kernel's writeback of what the
        # last version changed on the host (30 s later) lands in some later row's timing
        os.sync()
        near = baseline(new, work)                        # the full checkpoint, measured next to it
        used_xor = False
        for lane, sync, agent, root in lanes:
            os.sync()
            t0 = time.perf_counter()
            report = sync.push(new, version=v)
            t_pub = time.perf_counter() - t0
            # the trainer patches its kept copy in the background while its next step runs; on
            # this one machine it would share the two cores with the host's pull below, which
            # on a real fleet runs elsewhere: let it finish first and report it on its own
            t_kept = sync.encoding.settle()
            drop_cache(root / "versions" / f"v{v:08d}")
            t0 = time.perf_counter()
            assert agent.sync_local() == v
            t_pull = time.perf_counter() - t0
            st = agent.local.state()
            assert {n: i["digest"] for n, i in st["tensors"].items()} == want, "local checkpoint differs"
            t0 = time.perf_counter()
            files = sorted(agent.local.model_dir.glob("*.safetensors"))
            assert files, "the local checkpoint has no safetensors files"
            for f in files:
                materialize(load_file(str(f)))
            t_reload = time.perf_counter() - t0
            m = json.loads((root / "versions" / f"v{v:08d}" / "manifest.json").read_text())
            kinds: dict[str, int] = {}
            for t in m["tensors"].values():
                kinds[t["kind"]] = kinds.get(t["kind"], 0) + 1
            if lane == "default":
                used_xor = "xor" in kinds
            elif not used_xor:
                continue                                  # same forms as the default lane
            ideal = changed * (2 + 4)
            enc_s = report.seconds.get("encode", 0.0)
            name = label if lane == "default" else f"{label} ({lane})"
            row = {"version": v, "label": name, "lane": lane, "density": changed / elements,
                   "changed": changed, "logical_bytes": logical, "wire_bytes": report.wire_bytes,
                   "ideal_bytes": ideal, "wire_over_ideal": report.wire_bytes / ideal if ideal else None,
                   "publish_s": t_pub, "encode_s": enc_s, "pull_apply_s": t_pull,
                   "e2e_s": t_pub + t_pull, "engine_reload_s": t_reload, "kept_patch_s": t_kept,
                   "baseline": near,
                   "speedup_vs_full": near["total_s"] / (t_pub + t_pull),
                   "speedup_incl_reload": near["total_s"] / (t_pub + t_pull + t_reload),
                   "encode_gbps": logical / enc_s / 1e9 if enc_s else None,
                   "encode_over_memcpy": (logical / enc_s) / floor if enc_s else None,
                   "kinds": kinds, "stages": report.seconds}
            rows.append(row)
            print(f"{name:>28}: density {row['density']:.4%}  wire {report.wire_bytes / 2**20:8.2f} MiB "
                  f"({row['wire_over_ideal'] or 0:.2f}x ideal)  publish {t_pub:.2f}s  pull+apply "
                  f"{t_pull:.2f}s  -> {row['speedup_vs_full']:.1f}x vs full  (encode "
                  f"{row['encode_over_memcpy'] or 0:.3f}x memcpy; kinds {kinds})", flush=True)
        prev = new
    for _, sync, _, _ in lanes:
        sync.close()
    result = {"size_bytes": logical, "layers": layers, "dim": args.dim, "lr": args.lr,
              "memcpy_bytes_per_s": floor, "baseline": base,
              "first_full": first_full,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "torch": torch.__version__, "disk": str(work)},
              "ideal_definition": "changed elements x (2 value bytes + 4 int32 index bytes)",
              "rows": rows, "summary": summary(rows)}
    print("\n" + table(result))
    print("\n" + summary_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
