"""The name tables: for each architecture the exporter knows, which Megatron-core parameter becomes
which Hugging Face tensors (as `save_pretrained` writes them) and how its TP shards join. Written
once here; `tests/test_names.py` checks them against mbridge's mappings.

Megatron names come in two families and both are accepted: the local spec (`input_layernorm`,
`pre_mlp_layernorm`, sequential experts `mlp.experts.local_experts.I.linear_fc1.weight`) and the
TransformerEngine spec (norms fused into `linear_qkv.layer_norm_weight` / `linear_fc1.
layer_norm_weight`, grouped experts `mlp.experts.linear_fc1.weightI`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "LAYER", "Rule", "architecture", "known", "parse"]

KINDS = ("copy", "col", "row", "qkv", "glu", "vocab")
"""How TP shards join: copy (replicated: take one), col (concatenate on dim 0), row (on dim 1),
qkv (col, then split per query group into q, k, v), glu (each shard is [gate; up]: split each,
then concatenate the gates and the ups), vocab (col, then trim the padded vocabulary)."""


@dataclass(frozen=True)
class Rule:
    kind: str
    hf: tuple[str, ...]       # templates: {layer} the global layer, {expert} the global expert
    expert: bool = False      # split over EP (and expert-TP) instead of TP


LAYER = "model.layers.{layer}."
EXPERT = LAYER + "mlp.experts.{expert}."

TOP: dict[str, Rule] = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}

_QKV = tuple(LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")
ATTENTION: dict[str, Rule] = {
    "input_layernorm.weight": Rule("copy", (LAYER + "input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": Rule("copy", (LAYER + "input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": Rule("qkv", _QKV),
    "self_attention.linear_proj.weight": Rule("row", (LAYER + "self_attn.o_proj.weight",)),
}
QKV_BIAS: dict[str, Rule] = {
    "self_attention.linear_qkv.bias": Rule("qkv", tuple(n[:-len("weight")] + "bias" for n in _QKV)),
}
QK_NORM: dict[str, Rule] = {
    "self_attention.q_layernorm.weight": Rule("copy", (LAYER + "self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule("copy", (LAYER + "self_attn.k_norm.weight",)),
}
_POST_NORM = (LAYER + "post_attention_layernorm.weight",)
DENSE_MLP: dict[str, Rule] = {
    "pre_mlp_layernorm.weight": Rule("copy", _POST_NORM),
    "mlp.linear_fc1.layer_norm_weight": Rule("copy", _POST_NORM),
    "mlp.linear_fc1.weight": Rule("glu", (LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": Rule("row", (LAYER + "mlp.down_proj.weight",)),
}
MOE_MLP: dict[str, Rule] = {
    "pre_mlp_layernorm.weight": Rule("copy", _POST_NORM),
    "mlp.router.weight": Rule("copy", (LAYER + "mlp.gate.weight",)),
    "mlp.experts.linear_fc1.weight": Rule("glu", (EXPERT + "gate_proj.weight", EXPERT + "up_proj.weight"),
                                          expert=True),
    "mlp.experts.linear_fc2.weight": Rule("row", (EXPERT + "down_proj.weight",), expert=True),
}

# architecture -> the per-layer table (model_type as in config.json); TOP applies to all
ARCHITECTURES: dict[str, dict[str, Rule]] = {
    "llama": {**ATTENTION, **DENSE_MLP},
    "qwen2": {**ATTENTION, **QKV_BIAS, **DENSE_MLP},
    "qwen3": {**ATTENTION, **QK_NORM, **DENSE_MLP},
    # dense layers too: Qwen3-MoE's `mlp_only_layers` keep a dense MLP
    "qwen3_moe": {**ATTENTION, **QK_NORM, **DENSE_MLP, **MOE_MLP},
}
_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3_moe"}


def known() -> list[str]:
    """What users may write as `architecture`: model types and HF class names."""
    return sorted(ARCHITECTURES) + sorted(_CLASSES)


def architecture(name: str) -> str:
    """The model type of `name` (a model type or an HF class name); refuses one not known."""
    arch = _CLASSES.get(name, name)
    if arch not in ARCHITECTURES:
        raise ValueError(f"the megatron exporter does not know the architecture {name!r}; it knows "
                         f"{known()}")
    return arch


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")


def parse(name: str) -> tuple[int | None, str, int | None]:
    """A chunk's parameter name as (local layer index or None, table key, local expert or None):
    `decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight` and the grouped
    `decoder.layers.3.mlp.experts.linear_fc1.weight1` both give (3, 'mlp.experts.linear_fc1.weight', 1)."""
    m = _LAYER.match(name)
    if m is None:
        return None, name, None
    layer, rest = int(m.group(1)), m.group(2)
    if (e := _SEQUENTIAL.match(rest)) is not None:
        return layer, "mlp.experts." + e.group(2), int(e.group(1))
    if (e := _GROUPED.match(rest)) is not None:
        return layer, "mlp.experts." + e.group(1), int(e.group(2))
    return layer, rest, None
