"""Small named-tensor models with the shapes and dtypes that trip encoders up."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def sample_state_dict(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """Mixed dtypes (bf16, fp16, fp32, int64), odd shapes, a 0-d tensor and an empty one."""
    g = torch.Generator().manual_seed(seed)
    h = 32 * scale

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": r(97, h, dtype=torch.bfloat16)}
    for i in range(3):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = r(h, h, dtype=torch.bfloat16)
        sd[p + "self_attn.k_proj.weight"] = r(h // 2, h, dtype=torch.bfloat16)
        sd[p + "mlp.up_proj.weight"] = r(3 * h, h, dtype=torch.float16)
        sd[p + "input_layernorm.weight"] = r(h)
    sd["model.norm.weight"] = r(h)
    sd["model.step"] = torch.tensor(7, dtype=torch.int64)
    sd["model.empty_bias"] = torch.empty(0, dtype=torch.float32)
    sd["lm_head.weight"] = r(97, h, dtype=torch.bfloat16)
    return sd


def perturb(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A new version: every floating tensor changes (as after an optimizer step)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype)
            if v.is_floating_point() and v.numel() else v.clone() for k, v in sd.items()}


def write_weights_only_model(path: str | Path, sd: dict[str, torch.Tensor]) -> Path:
    """A model directory the reference engine serves without transformers (no config.json)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path
