"""The main job: a tiny causal LM trains real optimizer steps on CPU and pushes its weights after
every step into an engine running as a separate process, then checks greedy generation."""

from __future__ import annotations

import importlib
import tempfile
import time
from pathlib import Path

import torch

from .errors import SyncError


def _launch(engine: str, model_dir: Path, workdir: Path):  # noqa: ANN202
    """(engine spec dict, adapter kind, stop fn, generate fn)."""
    if engine == "reference":
        from .testing.engines import EngineProcess
        proc = EngineProcess(model_dir, log=workdir / "engine.log").start()
        return proc.spec(), "reference", proc.stop, proc.generate
    try:
        mod = importlib.import_module(f"weightsync_{engine}.demo")
    except ImportError as e:
        raise SystemExit(f"engine {engine!r} has no demo launcher ({e}); install weightsync-{engine}")
    return mod.launch(model_dir, workdir)


def run_demo(engine: str = "reference", steps: int = 5, workdir: str | None = None) -> int:
    from .pipeline import WeightSync
    from .testing.models import build_tiny_model, greedy

    work = Path(workdir or tempfile.mkdtemp(prefix="weightsync-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    arch_kw = {} if engine == "reference" else {"hidden": 256, "intermediate": 512}
    dtype = "float32" if engine == "reference" else "bfloat16"
    model = build_tiny_model(model_dir, "llama", dtype=dtype, **arch_kw)
    spec, adapter, stop, generate = _launch(engine, model_dir, work)
    print(f"engine {spec['name']} ({engine}) is up at {spec['url']}; workdir {work}")
    config = {"adapter": adapter, "engines": [spec], "exporter": {"kind": "torch",
              "options": {"bucket_bytes": "256KiB"}}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    data = torch.randint(3, model.config.vocab_size, (8, 33))
    prompt = [1, 17, 42, 99, 7]
    ok = True
    try:
        with WeightSync.from_config(config) as sync:
            for step in range(1, steps + 1):
                model.train()
                loss = model(input_ids=data[:, :-1], labels=data[:, :-1]).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                t0 = time.perf_counter()
                try:
                    r = sync.push(model, version=step)
                except SyncError as e:
                    print(f"step {step}: loss {loss.item():.4f}: SYNC FAILED: {e}")
                    ok = False
                    continue
                print(f"step {step}: loss {loss.item():.4f} | version {r.version} | "
                      f"{r.wire_bytes / 2**20:.2f} MiB in {r.buckets} buckets | "
                      f"{time.perf_counter() - t0:.3f}s (pause {r.pause_window:.3f}s) | verified {r.verified}")
                ok &= r.verified
        model.eval()
        mine = greedy(model, prompt, 12)
        theirs = generate(prompt, 12)
        same = mine == theirs["output_ids"]
        print(f"trainer greedy: {mine}\nengine  greedy: {theirs['output_ids']} (engine version "
              f"{theirs.get('version')}) -> {'IDENTICAL' if same else 'DIFFERENT'}")
        ok &= same
    finally:
        stop()
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1
