"""Synthetic models for `weightsync bench`: realistic decoder-LLM shapes (embeddings, q/k/v/o and
gate/up/down per layer, two norms per layer, final norm, lm_head) scaled to a byte budget, and a
"many small tensors" model for the per-tensor baselines."""

from __future__ import annotations

import torch

__all__ = ["model_bytes", "moe_model", "plan_moe_shapes", "plan_shapes", "small_tensors_model",
           "synthetic_model"]

# (hidden, intermediate, vocab): Llama/Qwen-like proportions, GQA with 4x fewer kv heads
_SHAPES = [(4096, 11008, 32000), (2048, 5632, 32000), (1024, 2816, 32000), (512, 1408, 8192),
           (256, 704, 4096), (128, 352, 2048), (64, 176, 1024)]


def _layer_params(h: int, i: int) -> int:
    return 2 * h * h + 2 * (h // 4) * h + 3 * h * i + 2 * h


def plan_shapes(nbytes: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(hidden, intermediate, vocab, layers) whose parameters come closest to `nbytes`, choosing
    the widest model that still has at least 4 layers."""
    params = max(1, nbytes // itemsize)
    for h, i, v in _SHAPES:
        rest = params - 2 * v * h - h
        layers = round(rest / _layer_params(h, i))
        if layers >= 4:
            return h, i, v, layers
    h, i, v = _SHAPES[-1]
    return h, i, v, max(1, round((params - 2 * v * h - h) / _layer_params(h, i)))


def synthetic_model(nbytes: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict of about `nbytes` with HF Llama names. Values are random (incompressible)."""
    h, inter, vocab, layers = plan_shapes(nbytes, torch.empty((), dtype=dtype).element_size())
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    kv = h // 4
    sd = {"model.embed_tokens.weight": r(vocab, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        sd[p + "self_attn.q_proj.weight"] = r(h, h)
        sd[p + "self_attn.k_proj.weight"] = r(kv, h)
        sd[p + "self_attn.v_proj.weight"] = r(kv, h)
        sd[p + "self_attn.o_proj.weight"] = r(h, h)
        sd[p + "mlp.gate_proj.weight"] = r(inter, h)
        sd[p + "mlp.up_proj.weight"] = r(inter, h)
        sd[p + "mlp.down_proj.weight"] = r(h, inter)
        sd[p + "input_layernorm.weight"] = r(h)
        sd[p + "post_attention_layernorm.weight"] = r(h)
    sd["model.norm.weight"] = r(h)
    sd["lm_head.weight"] = r(vocab, h)
    return sd


def small_tensors_model(nbytes: int, tensor_bytes: int = 16 * 1024, dtype: torch.dtype = torch.bfloat16,
                        seed: int = 1) -> dict[str, torch.Tensor]:
    """`nbytes` split into many tensors of `tensor_bytes` (biases, norms, LoRA factors, MoE
    router weights: the shape of model where per-tensor broadcasts drown in latency)."""
    g = torch.Generator().manual_seed(seed)
    item = torch.empty((), dtype=dtype).element_size()
    numel = max(1, tensor_bytes // item)
    count = max(1, nbytes // (numel * item))
    return {f"model.layers.{k // 8}.extra.{k % 8}.weight":
            torch.randn(numel, generator=g, dtype=torch.float32).to(dtype) for k in range(count)}


def model_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# MoE: (hidden, expert intermediate, vocab), Qwen3-MoE-like proportions (expert width ~3/8 hidden)
_MOE_SHAPES = [(2048, 768, 32000), (1024, 384, 32000), (512, 192, 8192), (256, 96, 4096),
               (128, 48, 2048), (64, 24, 1024)]


def _moe_dims(hidden: int) -> tuple[int, int, int]:
    """(head_dim, heads, kv_heads) for a hidden size: q/o are hidden x hidden, GQA 4:1."""
    head_dim = 128 if hidden >= 1024 else max(16, hidden // 8)
    heads = hidden // head_dim
    return head_dim, heads, max(1, heads // 4)


def _moe_layer_params(h: int, i: int, experts: int) -> int:
    head_dim, _, kv = _moe_dims(h)
    attention = 2 * h * h + 2 * kv * head_dim * h + 2 * head_dim
    return attention + experts * h + experts * 3 * i * h + 2 * h


def plan_moe_shapes(nbytes: int, experts: int = 64, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(hidden, expert intermediate, vocab, layers) whose parameters come closest to `nbytes`,
    the widest model that still has at least 4 layers."""
    params = max(1, nbytes // itemsize)
    for h, i, v in _MOE_SHAPES:
        layers = round((params - 2 * v * h - h) / _moe_layer_params(h, i, experts))
        if layers >= 4:
            return h, i, v, layers
    h, i, v = _MOE_SHAPES[-1]
    return h, i, v, max(1, round((params - 2 * v * h - h) / _moe_layer_params(h, i, experts)))


def moe_model(nbytes: int, experts: int = 64, dtype: torch.dtype = torch.bfloat16,
              seed: int = 2) -> dict[str, torch.Tensor]:
    """A state dict of about `nbytes` with the names, shapes and per-expert split of a Qwen3-MoE
    checkpoint (what engines load): per layer q/k/v/o, q/k norms, a router and `experts` experts
    of gate/up/down each, so thousands of small tensors. Values are random (incompressible)."""
    h, inter, vocab, layers = plan_moe_shapes(nbytes, experts, dtype.itemsize)
    head_dim, heads, kv = _moe_dims(h)
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    sd = {"model.embed_tokens.weight": r(vocab, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        sd[p + "self_attn.q_proj.weight"] = r(heads * head_dim, h)
        sd[p + "self_attn.k_proj.weight"] = r(kv * head_dim, h)
        sd[p + "self_attn.v_proj.weight"] = r(kv * head_dim, h)
        sd[p + "self_attn.o_proj.weight"] = r(h, heads * head_dim)
        sd[p + "self_attn.q_norm.weight"] = r(head_dim)
        sd[p + "self_attn.k_norm.weight"] = r(head_dim)
        sd[p + "mlp.gate.weight"] = r(experts, h)
        for e in range(experts):
            sd[p + f"mlp.experts.{e}.gate_proj.weight"] = r(inter, h)
            sd[p + f"mlp.experts.{e}.up_proj.weight"] = r(inter, h)
            sd[p + f"mlp.experts.{e}.down_proj.weight"] = r(h, inter)
        sd[p + "input_layernorm.weight"] = r(h)
        sd[p + "post_attention_layernorm.weight"] = r(h)
    sd["model.norm.weight"] = r(h)
    sd["lm_head.weight"] = r(vocab, h)
    return sd
