"""Smoke run of `weightsync bench` at a tiny size: every row is there, the numbers are sane, the
JSON and the chart are written. No timing thresholds (speed is the bench's job, not the tests')."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from weightsync_bench import run_bench, table
from weightsync_bench.model import model_bytes, plan_shapes, small_tensors_model, synthetic_model

ROWS = ["memcpy floor", "shm floor (3 copies)", "memcpy (1 core)", "xxh3 + copy, one pass (1 core)",
        "xxh3 pass over memory (1 core)", "http floor (raw TCP)", "safetensors save+load (naive)",
        "gloo broadcast, 1 tensor (raw)", "gloo broadcast, 1 tensor (raw, 1 receiver)",
        "gloo broadcast, 1 receiver, verified (bare)", "gloo broadcast per tensor (naive)",
        "gloo broadcast per tensor (small tensors)",
        "gloo broadcast per tensor (MoE)", "collective", "collective (1 receiver)",
        "collective (small tensors)", "http", "shm", "delta 1% over http", "delta 1% over shm",
        "collective (verify off)", "http (verify off)", "shm (verify off)", "collective (MoE)",
        "shm (MoE)", "full safetensors checkpoint (save+fsync+load)",
        "disk_delta 1% (publish+pull+apply)"]
FLOORS = {"shm": "shm floor (3 copies)", "http": "http floor (raw TCP)",
          "collective": "gloo broadcast, 1 tensor (raw)"}
TARGETS = {"collective_vs_per_tensor_llm", "collective_1rx_vs_raw_gloo_1rx", "collective_vs_per_tensor_small",
           "shm_vs_floor", "http_vs_floor", "verification_cost", "sender_peak_extra_in_buckets"}


def test_synthetic_model_has_llm_shapes_and_size() -> None:
    sd = synthetic_model(64 * 2**20)
    assert abs(model_bytes(sd) - 64 * 2**20) / (64 * 2**20) < 0.2
    h, inter, vocab, layers = plan_shapes(64 * 2**20)
    assert layers >= 4 and sd["model.embed_tokens.weight"].shape == (vocab, h)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (h // 4, h)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (h, inter)
    assert sd["model.layers.0.input_layernorm.weight"].shape == (h,)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert plan_shapes(2**30)[:3] == (2048, 5632, 32000)          # a 1 GiB model is ~Llama-1B wide
    small = small_tensors_model(2**20, 16 * 1024)
    assert len(small) == 64 and model_bytes(small) == 2**20


PEAK_OF_A_FRESH_TENSOR = """
import torch
from weightsync_bench import PeakRss
from weightsync_bench.measure import exact_malloc
from weightsync_bench.model import synthetic_model
exact_malloc()
sd = synthetic_model(64 * 2**20)
del sd
with PeakRss() as mem:
    t = torch.ones(64 * 2**20, dtype=torch.uint8)
    del t
print(mem.extra)
"""


def test_peak_rss_sees_an_allocation() -> None:
    """In its own process, set up as the bench sets itself up (`exact_malloc`), after a model was
    built and freed as a bench row does. In a long-lived process without it, glibc may hand the
    tensor memory an earlier test freed but kept resident, which no RSS measure can see."""
    out = subprocess.run([sys.executable, "-c", PEAK_OF_A_FRESH_TENSOR], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 60 * 2**20


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "bench.json"
    args = argparse.Namespace(size="4MiB", receivers=2, transports=None, bucket="1MiB",
                              json=str(out), png=None, repeat=1, workdir=str(tmp_path / "work"))
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["rows"]]
    from weightsync.plugins import load_components
    nixl = "nixl" in load_components().transports     # an installed transport plugin gets a row
    assert [n for n in names if n.split(" (")[0] != "nixl"] == ROWS and ("nixl" in names) == nixl
    rows = {r["name"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert r["seconds"] > 0 and r["gbps"] > 0 and r["ratio_to_memcpy"] > 0, r
        assert r["peak_extra_bytes"] >= 0
        one = "1 receiver" in r["name"] or r["name"] in ("memcpy floor",) or "disk_delta" in r["name"] \
            or r["name"].startswith("full safetensors") or r["kind"] == "reference"
        assert r["receivers"] == (1 if one else 2), r["name"]
        if r["kind"] == "transport":                 # every push: its pause window, its own floor
            if "disk_delta" not in r["name"]:
                assert 0 <= r["pause_window_s"] <= r["seconds"] and r["pause_pct_of_push"] >= 0
            kind = r["detail"]["transport"]
            if kind in FLOORS and r["detail"].get("encoding") != "delta":
                floor = FLOORS[kind] if "1 receiver" not in r["name"] \
                    else "gloo broadcast, 1 tensor (raw, 1 receiver)"
                assert r["floor"] == floor and r["ratio_to_floor"] > 0
                assert r["detail"]["verify"] == ("verify off" not in r["name"])
    floor = result["rows"][0]
    assert floor["ratio_to_memcpy"] == 1.0 and abs(floor["bytes"] - 4 * 2**20) < 2**20
    assert rows["shm floor (3 copies)"]["seconds"] == pytest.approx(3 * floor["seconds"])
    for t in ("http", "shm"):                          # delta rows: wire bytes and time against raw
        d = rows[f"delta 1% over {t}"]["detail"]
        assert d["raw_row"] == t and 0 < d["wire_vs_raw"] < 0.2 and d["seconds_vs_raw"] > 0
        assert 0.005 < d["density"] < 0.02
    dd = rows["disk_delta 1% (publish+pull+apply)"]["detail"]
    assert dd["speedup_vs_full"] > 0 and dd["wire_vs_full"] < 0.2
    targets = result["targets"]
    assert set(targets) >= TARGETS
    for k in TARGETS:
        assert targets[k]["met"] in (True, False) and targets[k]["target"] is not None, k
    assert set(targets["verification_cost"]["value"]) == {"collective", "http", "shm"}
    assert targets["collective_vs_per_tensor_llm"]["floor"] > 0
    one = targets["collective_1rx_vs_raw_gloo_1rx"]      # measured against the bare verified floor
    bare = rows["gloo broadcast, 1 receiver, verified (bare)"]
    raw_1 = rows["gloo broadcast, 1 tensor (raw, 1 receiver)"]
    assert bare["floor"] == raw_1["name"] and bare["receivers"] == 1
    assert one["verified_floor"] == round(raw_1["seconds"] / bare["seconds"], 3)
    assert len(result["verdicts"]) >= len(TARGETS)
    assert all(v.startswith(("MET", "MISSED")) for v in result["verdicts"])
    assert result["copy_digest_path"] in ("numba", "ctypes", "two-pass")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert table(result).splitlines()[0] in printed and "shm_vs_floor" in printed and "verdicts:" in printed


def test_perturbed_changes_about_the_density_asked(tmp_path: Path) -> None:
    from weightsync_bench import perturbed
    sd = synthetic_model(4 * 2**20)
    new = perturbed(sd, 0.01, seed=1)
    changed = sum(int((new[n].view(torch.int16) != sd[n].view(torch.int16)).sum()) for n in sd)
    total = sum(t.numel() for t in sd.values())
    assert 0.007 < changed / total < 0.011
    assert all(new[n].shape == sd[n].shape and new[n].dtype == sd[n].dtype for n in sd)


def test_verify_off_instrument_copies_without_hashing_and_restores() -> None:
    from weightsync.wire import digests as hashing
    from weightsync_bench.workers import UNHASHED, unhashed
    src = torch.arange(1000, dtype=torch.int32)
    dst = torch.zeros_like(src)
    real = hashing.copy_digest
    with unhashed():
        assert hashing.copy_digest(dst, src, b"h") == UNHASHED and torch.equal(dst, src)
        assert hashing.Digest(b"h").hexdigest() == UNHASHED
    assert hashing.copy_digest is real and hashing.Digest(b"").address is not None


def test_gpu_targets_read_as_verdicts_and_table_lines() -> None:
    """The GPU rows' targets carry a direction and a verdict like every other target (a GPU run
    once crashed in `verdicts` on a target without one)."""
    from weightsync_bench import Row
    from weightsync_bench.verdicts import verdicts
    from weightsync_bench.gpu import gpu_targets

    def row(name: str, s: float, peak: int = 0) -> Row:
        return Row(name, "transport", 1 << 30, 2, s, [s], peak)

    rows = [row("cuda copy floor", 0.002), row("cuda ipc copy (raw, 1 receiver)", 0.004),
            row("per-tensor CUDA IPC (naive, 1 receiver)", 0.05),
            row("shm (CUDA IPC, verified)", 0.07, peak=3 << 29)]
    targets = gpu_targets(rows, bucket_unit=1 << 29)
    lines = verdicts(targets)
    assert "MISSED cuda_ipc_vs_device_copy: 0.5 (target >= 0.8)" in lines
    assert "MISSED cuda_sender_peak_extra_in_buckets: 3.0 (target <= 2.0)" in lines
    assert targets["cuda_sender_peak_extra_in_buckets"]["met"] is False
