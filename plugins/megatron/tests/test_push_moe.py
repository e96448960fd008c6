"""Qwen3-MoE (8 experts, top 2, qk-norm) on 4 real gloo ranks in four layouts, run in the session's
one process group (`pushed` in conftest.py): PP2xEP2, TP2xEP2 with expert-TP 1 and with expert-TP
2, and TP2xPP2, each pushed into the same reference engine as the next version. After each, the
engine holds byte for byte what save_pretrained wrote (per-expert names), an HF model built from it
gives Megatron's own logits within 1e-4 (fp32), and only rank 0 receives. A naive gate/up join of
expert-TP shards (the negative control) fails the check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2_ep2", "tp2_ep2_etp1", "tp2_ep2_etp2", "tp2_pp2"])
def test_engine_holds_the_checkpoint_and_megatrons_logits(pushed: tuple[Path, list], kit: Any,
                                                          layout: str) -> None:
    tmp, rows = pushed
    assert kit.problems(tmp / f"{layout}.pushed.safetensors", tmp / "qwen3_moe-hf",
                        tmp / f"{layout}.logits.safetensors", torch.tensor(kit.IDS)) == []
    kit.check_traffic(rows, layout)


@pytest.mark.slow
def test_a_naive_expert_gate_up_join_fails_the_check(pushed: tuple[Path, list], kit: Any) -> None:
    tmp, _ = pushed
    found = kit.problems(tmp / "tp2_ep2_etp2.negative.safetensors", tmp / "qwen3_moe-hf",
                         tmp / "tp2_ep2_etp2.logits.safetensors", torch.tensor(kit.IDS))
    assert any("experts" in p and "gate_proj" in p for p in found), found
    assert any(p.startswith("logits differ") for p in found), found
