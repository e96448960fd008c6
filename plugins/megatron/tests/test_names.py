"""The name tables and layout conversions, checked against mbridge (an independent implementation of
the same mapping) and against their own inverse; no processes."""

from __future__ import annotations

import pytest
import torch

from weightsync_megatron.convert import Geometry, shard_from_hf, to_hf
from weightsync_megatron.names import ARCHITECTURES, TOP, architecture, known, parse

# local-spec names and the TE names mbridge's tables are written for
TE_NAME = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
           "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# what mbridge has no entry for (checked to be exactly these, so nothing is skipped silently)
NOT_IN_MBRIDGE = {"qwen3_moe": {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
                                "mlp.linear_fc1.layer_norm_weight"}}
GEO = Geometry(query_groups=2, heads=4, head_dim=16, vocab=120)


def _bridge(arch: str):  # noqa: ANN202 - mbridge's class, its name tables without a model
    pytest.importorskip("mbridge")
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig
    bridge = _MODEL_REGISTRY[arch].__new__(_MODEL_REGISTRY[arch])
    bridge.hf_config = AutoConfig.for_model(arch, num_attention_heads=GEO.heads, hidden_size=64,
                                            num_key_value_heads=GEO.query_groups, head_dim=GEO.head_dim)
    bridge.make_vocab_size_divisible_by = None
    return bridge


def _megatron_name(key: str, arch: str) -> str:
    if key.startswith("mlp.experts."):
        return f"decoder.layers.3.{key}5"                # grouped experts: expert 5
    if key == "pre_mlp_layernorm.weight" and arch == "qwen3_moe":
        return "decoder.layers.3.pre_mlp_layernorm.weight"   # mbridge's MoE key
    return f"decoder.layers.3.{TE_NAME.get(key, key)}"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_name_agrees_with_mbridge(arch: str) -> None:
    bridge = _bridge(arch)
    unchecked = set()
    for key, rule in {**TOP, **ARCHITECTURES[arch]}.items():
        name = key if key in TOP else _megatron_name(key, arch)
        try:
            theirs = bridge._weight_name_mapping_mcore_to_hf(name)
        except NotImplementedError:
            unchecked.add(key)
            continue
        ours = [t.format(layer=3, expert=5) for t in rule.hf]
        assert ours == theirs, (arch, key)
    assert unchecked == NOT_IN_MBRIDGE.get(arch, set())


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_and_gate_up_split_as_mbridge_splits_them(bias: bool) -> None:
    """mbridge splits the whole (TP 1) tensors; ours must give the same bytes."""
    bridge = _bridge("qwen2")
    rows = GEO.query_groups * (GEO.per_group + 2) * GEO.head_dim
    fused = torch.randn(rows) if bias else torch.randn(rows, 64)
    suffix = "bias" if bias else "weight"
    _, theirs = bridge._weight_to_hf_format(f"decoder.layers.0.self_attention.linear_qkv.{suffix}", fused)
    assert all(torch.equal(a, b) for a, b in zip(to_hf("qkv", [fused], GEO), theirs, strict=True))
    fc1 = torch.randn(256, 64)
    _, theirs = bridge._weight_to_hf_format("decoder.layers.0.mlp.linear_fc1.weight", fc1)
    assert all(torch.equal(a, b) for a, b in zip(to_hf("glu", [fc1], GEO), theirs, strict=True))


CASES = {"copy": [(64,)], "col": [(128, 64)], "row": [(64, 128)], "glu": [(128, 64), (128, 64)],
         "qkv": [(64, 64), (32, 64), (32, 64)], "vocab": [(120, 64)]}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("size", [1, 2])
def test_shards_join_back_bit_exact(kind: str, size: int) -> None:
    hf = [torch.randn(s) for s in CASES[kind]]
    shards = [shard_from_hf(kind, hf, GEO, r, size, padded_vocab=128) for r in range(size)]
    back = to_hf(kind, shards if kind != "copy" else shards[:1], GEO)
    assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(back, hf))
    if kind == "glu" and size > 1:          # the naive join is wrong: what the negative control uses
        naive = torch.cat(shards).chunk(2)
        assert not torch.equal(naive[0], hf[0])


def test_names_of_both_families_parse_alike() -> None:
    seq = parse("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight")
    assert seq == parse("decoder.layers.3.mlp.experts.linear_fc1.weight1") == (
        3, "mlp.experts.linear_fc1.weight", 1)
    assert parse("output_layer.weight") == (None, "output_layer.weight", None)


def test_an_unknown_architecture_is_refused_with_the_known_ones() -> None:
    assert architecture("Qwen3MoeForCausalLM") == "qwen3_moe"
    with pytest.raises(ValueError, match="does not know the architecture 'deepseek_v3'") as e:
        architecture("deepseek_v3")
    assert all(k in str(e.value) for k in known())
