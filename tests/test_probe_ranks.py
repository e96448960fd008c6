"""The probe runs wherever a push runs (issue 40 item 3): a two-rank FSDP2 trainer on gloo (every
weight row-sharded, so the trainer's forward pass is a collective every rank joins) pushes into a
reference engine and into one whose load path corrupts a weight after commit. Every rank runs the
probe's forward pass and rank 0 compares: the first engine passes with a float-noise gap, the
second fails at stage `probe` on both ranks' reports and then serves no gated request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from weightsync.net.server import free_port
from weightsync_reference.models import build_tiny_model
from weightsync_reference.processes import EngineProcess, start_all

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
FAULTY = ROOT / "plugins" / "rl" / "tests" / "faulty_engine.py"

RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from weightsync import SyncError, WeightSync

    engines, model_dir = json.loads(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for version, spec in enumerate(engines, 1):
        cfg = {"engines": [spec], "sync": {"progress": "off"},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": "64KiB"}}}
        with WeightSync.from_config(cfg) as sync:
            try:
                report = sync.push(model, version=version)
            except SyncError as e:
                report = e.report
        (o,) = report.engines.values()
        print(json.dumps({"rank": dist.get_rank(), "engine": o.engine, "ok": o.ok,
                          "stage": o.stage, "error": o.error, "probe": o.probe,
                          "summary": report.probe}), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_an_fsdp2_trainers_push_is_probed_by_every_rank(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    build_tiny_model(model_dir, "llama", vocab=128)
    good = EngineProcess(model_dir, name="good", log=tmp_path / "good.log")
    faulty = EngineProcess(model_dir, name="faulty", log=tmp_path / "faulty.log",
                           program=[sys.executable, str(FAULTY)])
    start_all([good, faulty])
    try:
        script = tmp_path / "rank.py"
        script.write_text(RANK)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, str(script), json.dumps([good.spec(), faulty.spec()]),
                                   str(model_dir)],
                                  env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err[-4000:]
        rows = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
        for r in (0, 1):                    # both ranks' reports (rank 0's, shared) say the same
            g, f = (next(x for x in rows if x["rank"] == r and x["engine"] == e) for e in ("good", "faulty"))
            assert g["ok"] and g["summary"] == "1 engines probed with 24 tokens"
            assert g["probe"]["version"] == 1 and g["probe"]["max"] < 1e-4
            assert not f["ok"] and f["stage"] == "probe" and f["probe"]["max"] > 0.05
            assert "does not compute with the pushed weights" in f["error"]
        assert good.health()["distrusted"] is None
        assert faulty.health()["distrusted"]["version"] == 2
    finally:
        good.stop()
        faulty.stop()
