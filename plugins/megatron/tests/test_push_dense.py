"""Dense models (Llama, Qwen2, Qwen3 with tied embeddings) at TP2xPP2 on 4 real gloo ranks, pushed
into reference engines (the session's one launch, `pushed` in conftest.py): each engine ends byte
for byte with what save_pretrained wrote, an HF model built from its weights gives Megatron's own
logits within 1e-4 (fp32), only rank 0 receives, and a naive gate/up join (the negative control)
fails the same check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_holds_the_checkpoint_and_megatrons_logits(pushed: tuple[Path, list], kit: Any,
                                                          arch: str) -> None:
    tmp, rows = pushed
    assert kit.problems(tmp / f"{arch}.pushed.safetensors", tmp / f"{arch}-hf",
                        tmp / f"{arch}.logits.safetensors", torch.tensor(kit.IDS)) == []
    kit.check_traffic(rows, arch)


@pytest.mark.slow
def test_a_naive_gate_up_join_fails_the_check(pushed: tuple[Path, list], kit: Any) -> None:
    tmp, _ = pushed
    found = kit.problems(tmp / "llama.negative.safetensors", tmp / "llama-hf",
                         tmp / "llama.logits.safetensors", torch.tensor(kit.IDS))
    assert any("gate_proj" in p for p in found) and any("up_proj" in p for p in found)
    assert any(p.startswith("logits differ") for p in found), found


@pytest.mark.slow
def test_a_model_the_table_does_not_fit_is_refused_on_every_rank(pushed: tuple[Path, list]) -> None:
    """Qwen3 exported as Llama: every rank's push fails (none waits forever), naming the parameter
    the Llama table lacks; the engine kept what it had."""
    tmp, rows = pushed
    told = {r["rank"]: r["refused"] for r in rows if r["case"] == "refused"}
    assert set(told) == {0, 1, 2, 3}
    assert all("q_layernorm" in said and "llama" in said for said in told.values()), told
    from safetensors.torch import load_file
    after, want = load_file(tmp / "refused.after.safetensors"), load_file(tmp / "qwen3-hf/model.safetensors")
    assert set(after) == set(want) and all(torch.equal(after[n], want[n]) for n in want)
