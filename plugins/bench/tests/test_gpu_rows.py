"""The bench's GPU rows, run by `make test-gpu` on a machine with a GPU (skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bench_gpu_rows(tmp_path: Path) -> None:
    import argparse
    import json

    from weightsync_bench import run_bench
    out = tmp_path / "bench.json"
    args = argparse.Namespace(size="64MiB", receivers=1, transports=None, bucket="16MiB",
                              json=str(out), png=None, repeat=1, workdir=str(tmp_path / "w"),
                              device="cuda")
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == [
        "cuda copy floor", "cuda ipc copy (raw, 1 receiver)", "per-tensor CUDA IPC (naive, 1 receiver)",
        "shm (CUDA IPC, verified)", "shm (CUDA IPC, verify off)"]
    assert all(r["seconds"] > 0 and r["detail"]["device"] == "cuda" for r in result["rows"])
    assert {"cuda_ipc_vs_device_copy", "cuda_ipc_push_vs_device_copy"} <= set(result["targets"])
    assert "H100" in result["device"] or result["device"] != "cpu"
