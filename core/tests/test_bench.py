"""Smoke run of `weightsync bench` at a tiny size: every row is there, the numbers are sane, the
JSON and the chart are written. No timing thresholds (speed is the bench's job, not the tests')."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from weightsync.bench import PeakRss, run_bench, table
from weightsync.bench_model import model_bytes, plan_shapes, small_tensors_model, synthetic_model

ROWS = ["memcpy floor", "safetensors save+load (naive)", "gloo broadcast per tensor (naive)",
        "gloo broadcast per tensor (small tensors)", "gloo broadcast, 1 tensor (raw)",
        "gloo broadcast, 1 tensor (raw, 1 receiver)", "collective", "collective (1 receiver)",
        "collective (small tensors)", "http", "shm"]


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


def test_peak_rss_sees_an_allocation() -> None:
    with PeakRss() as mem:
        t = torch.ones(64 * 2**20, dtype=torch.uint8)
        del t
    assert mem.extra >= 60 * 2**20


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "bench.json"
    args = argparse.Namespace(size="4MiB", receivers=2, transports=None, bucket="1MiB",
                              json=str(out), png=None, repeat=1, workdir=str(tmp_path / "work"))
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["rows"]]
    assert names == ROWS
    for r in result["rows"]:
        assert r["seconds"] > 0 and r["gbps"] > 0 and r["ratio_to_floor"] > 0, r
        assert r["peak_extra_bytes"] >= 0
        assert r["receivers"] == (1 if "1 receiver" in r["name"] or r["kind"] == "floor" else 2)
    floor = result["rows"][0]
    assert floor["ratio_to_floor"] == 1.0 and abs(floor["bytes"] - 4 * 2**20) < 2**20
    assert set(result["targets"]) >= {"shm_vs_floor", "collective_1rx_vs_raw_gloo_1rx",
                                      "collective_vs_per_tensor_small", "sender_peak_extra_in_buckets"}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert table(result).splitlines()[0] in printed and "shm_vs_floor" in printed
