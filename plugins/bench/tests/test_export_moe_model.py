"""The MoE-shaped benchmark model (issue 15, item 3): about the asked size, exactly the tensor names
and shapes of a Qwen3-MoE checkpoint with the same dimensions, thousands of small per-expert
tensors that buckets pack many at a time."""

from __future__ import annotations

import pytest
import torch

from weightsync_bench.model import model_bytes, moe_model, plan_moe_shapes
from weightsync.exporters.torch import TorchExporter

MiB = 2**20


@pytest.mark.parametrize("size", [4 * MiB, 24 * MiB])
def test_size_and_many_small_tensors(size: int) -> None:
    sd = moe_model(size, experts=64)
    h, inter, vocab, layers = plan_moe_shapes(size, 64)
    assert abs(model_bytes(sd) - size) < 0.2 * size
    assert layers >= 4
    experts = [n for n in sd if ".mlp.experts." in n]
    assert len(experts) == layers * 64 * 3
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert sd["model.layers.0.mlp.experts.63.down_proj.weight"].shape == (h, inter)


def test_deterministic_per_seed() -> None:
    a, b, c = moe_model(2 * MiB, experts=8), moe_model(2 * MiB, experts=8), moe_model(2 * MiB, experts=8, seed=5)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_names_and_shapes_are_a_qwen3_moe_checkpoint() -> None:
    """The same names and shapes save_pretrained writes for a Qwen3-MoE of these dimensions
    (planned on the meta device: nothing allocated)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from weightsync_bench.model import _moe_dims
    size, experts = 4 * MiB, 16
    h, inter, vocab, layers = plan_moe_shapes(size, experts)
    head_dim, heads, kv = _moe_dims(h)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=h, moe_intermediate_size=inter,
                         intermediate_size=2 * inter, num_experts=experts, num_experts_per_tok=2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         head_dim=head_dim, tie_word_embeddings=False, mlp_only_layers=[])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    plan = TorchExporter(TorchExporter.Options()).plan(model)
    assert plan is not None
    want = {o.name: o.shape for o in plan.outputs}
    got = {n: tuple(t.shape) for n, t in moe_model(size, experts=experts).items()}
    assert got == want


def test_buckets_pack_many_expert_tensors() -> None:
    sd = moe_model(4 * MiB, experts=64)
    buckets = list(TorchExporter(TorchExporter.Options(bucket_bytes=MiB)).buckets(sd))
    assert sum(len(b.tensors) for b in buckets) == len(sd)
    assert len(buckets) <= 6 and min(len(b.tensors) for b in buckets[:-1]) > 100
