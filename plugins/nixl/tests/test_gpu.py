"""On a GPU machine (-m gpu): send buffers and the engine's staging in CUDA memory (VRAM), one
bucket at a time between two processes on one GPU, bit-exact. UCX may then use cuda_copy and
cuda_ipc besides tcp; on a fabric with GPUDirect RDMA, `rc` or `dc` too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GPU_UCX = {"UCX_TLS": "tcp,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^efa"}
PUSH = """
import json, sys, torch
from weightsync import WeightSync
from weightsync.testing import perturb, sample_state_dict
cfg = json.loads(sys.argv[1])
sd = {n: t.cuda() for n, t in perturb(sample_state_dict(), 1).items()}
with WeightSync.from_config(cfg) as sync:
    report = sync.push(sd, version=1)
    assert report.ok and report.verified, report.summary()
print("pushed", report.buckets)
"""


def test_a_bucket_moves_between_two_processes_on_one_gpu_bit_exact(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(reason="no CUDA device")
    pytest.importorskip("nixl._api", reason="NIXL is not installed")
    from weightsync.testing import perturb, sample_state_dict, write_weights_only_model
    from weightsync_reference.processes import EngineProcess

    model = write_weights_only_model(tmp_path / "model", sample_state_dict())
    with EngineProcess(model, name="gpu-engine", log=tmp_path / "engine.log", device="cuda",
                       env=GPU_UCX) as engine:
        cfg = {"transport": {"kind": "nixl", "options": {"device": "cuda", "staging_device": "cuda"}},
               "engines": [engine.spec()], "sync": {"progress": "off"},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": 8192}}}
        out = subprocess.run([sys.executable, "-c", PUSH, json.dumps(cfg)], capture_output=True,
                             text=True, timeout=300, env={**__import__("os").environ, **GPU_UCX})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "pushed" in out.stdout
        assert engine.health()["version"] == 1
        assert engine.holds(perturb(sample_state_dict(), 1))
