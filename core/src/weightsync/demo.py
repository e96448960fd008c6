"""The main job: a tiny causal LM trains real optimizer steps on CPU and pushes its weights after
every step into engines running as separate processes, then checks greedy generation.

With the reference engine it shows what the project is for: two engines register with the
trainer's fleet registry; one is stopped in the middle of the run and started again, comes back
at an old version and catches up from its peer before the next push; every line gives the sync
time and the pause window (the time the engines could not generate); a table sums the run up.
Everything is written to a temporary directory that is removed at the end."""

from __future__ import annotations

import importlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .errors import SyncError


def _launch_plugin(engine: str, model_dir: Path, workdir: Path) -> Any:
    try:
        mod = importlib.import_module(f"weightsync_{engine}.demo")
    except ImportError as e:
        raise SystemExit(f"engine {engine!r} has no demo launcher ({e}); install weightsync-{engine}")
    return mod.launch(model_dir, workdir)


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def run_demo(engine: str = "reference", steps: int = 6, workdir: str | None = None) -> int:
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if engine == "reference":
            return _fleet_demo(work, steps)
        return _plugin_demo(engine, work, steps)
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _train_setup(model_dir: Path, **arch: Any) -> tuple[Any, Any, Any]:
    from .testing.models import build_tiny_model
    dtype = arch.pop("dtype", "float32")
    model = build_tiny_model(model_dir, "llama", dtype=dtype, **arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    data = torch.randint(3, model.config.vocab_size, (8, 33))
    return model, opt, data


def _step(model: Any, opt: Any, data: Any) -> float:
    model.train()
    loss = model(input_ids=data[:, :-1], labels=data[:, :-1]).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _train_and_push(sync: Any, model: Any, opt: Any, data: Any, step: int) -> tuple[float, Any, float]:
    """One training step and the push of its weights: (loss, report or None if it failed, s)."""
    loss = _step(model, opt, data)
    t0 = time.perf_counter()
    try:
        r = sync.push(model, version=step)
    except SyncError as e:
        print(f"step {step}: loss {loss:.4f}: SYNC FAILED: {e}")
        return loss, None, time.perf_counter() - t0
    return loss, r, time.perf_counter() - t0


def _fleet_demo(work: Path, steps: int) -> int:
    from .fleet.client import RegistryClient
    from .pipeline import WeightSync
    from .testing.engines import EngineProcess
    from .testing.models import greedy

    key = "demo-fleet-key-0123456789"
    model, opt, data = _train_setup(work / "model")
    config = {"fleet": {"kind": "registry", "options": {"lease": 2.0, "api_key": key}},
              "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
              "sync": {"progress": "off", "failure_policy": "continue"}}
    prompt = [1, 17, 42, 99, 7]
    rows: list[tuple[int, float, str, str, float, float, float]] = []
    ok = True
    with WeightSync.from_config(config) as sync:
        url = sync.fleet_url
        reg = RegistryClient(url, key)
        args = ["--fleet", url, "--fleet-key", key]
        engines = {n: EngineProcess(work / "model", name=n, log=work / f"{n}.log", extra_args=args)
                   for n in ("engine-a", "engine-b")}
        for e in engines.values():
            e.start(timeout=120)
        print(f"fleet registry at {url}; engines {', '.join(f'{n} ({e.url})' for n, e in engines.items())} "
              f"registered; workdir {work}")
        _wait(lambda: len(reg.fleet()["members"]) == 2, 30)
        stop_at, back_at = (steps + 1) // 2, (steps + 1) // 2 + 1
        try:
            for step in range(1, steps + 1):
                if step == stop_at:
                    engines["engine-b"].stop()         # SIGTERM: it deregisters
                    print(f"        engine-b stopped before step {step}")
                if step == back_at:
                    engines["engine-b"].start(timeout=120)
                    print(f"        engine-b started again at version 0: catching up from its peer ...")
                    caught = _wait(lambda: any(m["name"] == "engine-b" and m["state"] == "live"
                                               and m["version"] == step - 1
                                               for m in reg.fleet()["members"]), 60)
                    m = next((m for m in reg.fleet()["members"] if m["name"] == "engine-b"), {})
                    print(f"        engine-b caught up to version {m.get('version')} from "
                          f"{m.get('via')} (peer join, digests checked)" if caught else
                          "        engine-b did not catch up in time")
                    ok &= caught
                loss, r, took = _train_and_push(sync, model, opt, data, step)
                if r is None:
                    ok = False
                    continue
                synced = [n for n, o in r.engines.items() if o.ok]
                note = "".join(f"; {n} left" for n in r.left) + \
                    "".join(f"; {n} excluded ({why})" for n, why in r.excluded.items())
                print(f"step {step}: loss {loss:.4f} | version {r.version} -> {len(synced)} engines "
                      f"({', '.join(synced)}) | {r.wire_bytes / 2**20:.2f} MiB in {r.buckets} buckets"
                      f" | {took:.3f}s (pause {r.pause_window:.3f}s) | verified {r.verified}{note}")
                rows.append((step, loss, ",".join(synced), "yes" if r.verified else "no",
                             r.wire_bytes / 2**20, took, r.pause_window))
                ok &= r.ok and r.verified
            model.eval()
            mine = greedy(model, prompt, 12)
            print(f"trainer greedy: {mine}")
            for n, e in engines.items():
                theirs = e.generate(prompt, 12)
                same = theirs["output_ids"] == mine
                print(f"{n} greedy: {theirs['output_ids']} (version {theirs.get('weight_version')}) -> "
                      f"{'IDENTICAL' if same else 'DIFFERENT'}")
                ok &= same
        finally:
            for e in engines.values():
                e.stop()
    _table(rows)
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


def _table(rows: list[tuple[int, float, str, str, float, float, float]]) -> None:
    print("\nthe run:")
    print(f"{'step':>6} {'loss':>8} {'engines synced':<20} {'verified':>8} {'MiB':>7} {'sync s':>7} "
          f"{'pause s':>8}")
    for step, loss, synced, ver, mib, took, pause in rows:
        print(f"{step:>6} {loss:>8.4f} {synced:<20} {ver:>8} {mib:>7.2f} {took:>7.3f} {pause:>8.3f}")
    if rows:
        total = sum(r[5] for r in rows)
        pause = sum(r[6] for r in rows)
        print(f"{'total':>6} {'':>8} {'':<20} {'':>8} {'':>7} {total:>7.3f} {pause:>8.3f}  "
              f"(paused {pause / max(total, 1e-9):.1%} of the sync time)")


def _plugin_demo(engine: str, work: Path, steps: int) -> int:
    from .pipeline import WeightSync
    from .testing.models import greedy

    model, opt, data = _train_setup(work / "model", hidden=256, intermediate=512, dtype="bfloat16")
    spec, adapter, stop, generate = _launch_plugin(engine, work / "model", work)
    print(f"engine {spec['name']} ({engine}) is up at {spec['url']}; workdir {work}")
    config = {"adapter": adapter, "engines": [spec], "sync": {"progress": "off"},
              "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}}}
    prompt = [1, 17, 42, 99, 7]
    rows = []
    ok = True
    try:
        with WeightSync.from_config(config) as sync:
            for step in range(1, steps + 1):
                loss, r, took = _train_and_push(sync, model, opt, data, step)
                if r is None:
                    ok = False
                    continue
                print(f"step {step}: loss {loss:.4f} | version {r.version} | "
                      f"{r.wire_bytes / 2**20:.2f} MiB in {r.buckets} buckets | "
                      f"{took:.3f}s (pause {r.pause_window:.3f}s) | verified {r.verified}")
                rows.append((step, loss, spec["name"], "yes" if r.verified else "no",
                             r.wire_bytes / 2**20, took, r.pause_window))
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
    _table(rows)
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1
