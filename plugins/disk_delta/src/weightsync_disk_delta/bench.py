"""disk_delta's row of `weightsync bench` (registered through `register_bench_rows`): publish +
pull + apply of a 1 % delta against a full safetensors checkpoint, on the bench's LLM-shaped
model."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from weightsync_bench import DELTA_DENSITY, drop_cache, perturbed, timed
from weightsync_bench.model import model_bytes
from weightsync.sync.pipeline import WeightSync

from .agent import Agent


def disk_delta_rows(bench: Any, sd: dict[str, torch.Tensor]) -> None:
    """disk_delta at DELTA_DENSITY: publish (push into the shared directory) + the host
    agent's pull and apply into its local checkpoint (shards read cold, every digest
    checked), against writing a full safetensors checkpoint (fsync) and loading it cold with
    every byte copied out. The trainer's kept-version patch runs in the background after
    push; it is let finish untimed (on a fleet the pull runs on another host) and reported."""
    root, local = bench.work / "dd-root", bench.work / "dd-local"
    n = model_bytes(sd)
    cfg = {"encoding": {"kind": "delta", "options": {"full_when_chain_exceeds": 0}},
           "transport": {"kind": "disk_delta", "options": {"root": str(root), "keep_full": 100}},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": bench.bucket}},
           "sync": {"progress": "off"}}
    state: dict[str, Any] = {"model": sd, "seed": 500, "v": 1}
    ckpt = bench.work / "full-ckpt" / "model.safetensors"
    ckpt.parent.mkdir(parents=True, exist_ok=True)

    def prepare() -> None:
        state["seed"] += 1
        state["model"] = perturbed(state["model"], DELTA_DENSITY, state["seed"])
        os.sync()

    def full() -> dict[str, Any]:
        t0 = time.perf_counter()
        save_file(state["model"], str(ckpt))
        fd = os.open(ckpt, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        t_save = time.perf_counter() - t0
        drop_cache(ckpt)
        t0 = time.perf_counter()
        loaded = {k: t.clone() for k, t in load_file(str(ckpt)).items()}
        t_load = time.perf_counter() - t0
        del loaded
        return {"seconds": t_save + t_load, "save_s": round(t_save, 4), "load_s": round(t_load, 4)}
    full_row = timed("full safetensors checkpoint (save+fsync+load)", "baseline", n, 1, full,
                     bench.repeat, None, bench.log, prepare, floor="memcpy floor")
    ckpt.unlink(missing_ok=True)
    bench.rows.append(full_row)

    holder: dict[str, Any] = {}

    def setup() -> None:
        holder["sync"] = WeightSync.from_config(cfg)
        holder["agent"] = Agent(root, local)
        holder["sync"].push(state["model"], version=1)
        holder["agent"].sync_local()

    def run() -> dict[str, Any]:
        sync, agent = holder["sync"], holder["agent"]
        state["v"] += 1
        t0 = time.perf_counter()
        r = sync.push(state["model"], version=state["v"])
        t_pub = time.perf_counter() - t0
        kept = sync.encoding.settle()
        drop_cache(root / "versions")
        t0 = time.perf_counter()
        if agent.sync_local() != state["v"]:
            raise RuntimeError("the disk_delta agent did not reach the published version")
        t_pull = time.perf_counter() - t0
        return {"seconds": t_pub + t_pull, "publish_s": round(t_pub, 4), "pull_apply_s": round(t_pull, 4),
                "kept_patch_s": round(kept, 4), "wire_bytes": r.wire_bytes, "density": r.density,
                "stages": {k: round(v, 4) for k, v in r.seconds.items()}}
    try:
        row = timed(f"disk_delta {DELTA_DENSITY:.0%} (publish+pull+apply)", "transport", n, 1, run,
                    bench.repeat, setup, bench.log, prepare)
    finally:
        if "sync" in holder:
            holder["sync"].close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    row.detail.update({"transport": "disk_delta", "encoding": "delta", "baseline_row": full_row.name,
                       "speedup_vs_full": round(full_row.seconds / row.seconds, 3),
                       "wire_vs_full": round(row.detail["wire_bytes"] / n, 5)})
    bench.rows.append(row)
    bench.extra_targets["disk_delta_vs_full_checkpoint"] = {
        "value": row.detail.get("speedup_vs_full"), "target": None, "met": None,
        "wire_vs_full": row.detail.get("wire_vs_full")}
