"""Tiny causal LMs built offline (no hub): random Llama or Qwen2 weights saved as safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

__all__ = ["build_tiny_model", "fill_deterministic", "greedy", "load_trainer_model", "row_values",
           "tiny_config", "tiny_moe_config"]


def tiny_config(arch: Literal["llama", "qwen2"] = "llama", *, vocab: int = 1024, hidden: int = 64,
                intermediate: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                dtype: str = "float32", tie: bool = False):  # noqa: ANN201
    from transformers import LlamaConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=2048, tie_word_embeddings=tie, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
    cfg.dtype = dtype
    return cfg


def build_tiny_model(path: str | Path, arch: Literal["llama", "qwen2"] = "llama", *, seed: int = 0,
                     dtype: str = "float32", **kw) -> torch.nn.Module:  # noqa: ANN003
    """Create, save (safetensors + config.json) and return a random tiny causal LM."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    cfg = tiny_config(arch, dtype=dtype, **kw)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def load_trainer_model(path: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto")


def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """The trainer's own greedy continuation, the same algorithm the reference engine runs."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits
            out.append(int(logits[0, -1].argmax()))
    return out


# -- MoE models and deterministic (sharded) values, for the export tests -----------------------

def tiny_moe_config(arch: Literal["qwen3_moe", "mixtral"] = "qwen3_moe", *, vocab: int = 1024,
                    hidden: int = 64, moe_intermediate: int = 32, experts: int = 4, top_k: int = 2,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
                    dtype: str = "float32"):  # noqa: ANN201
    """A tiny Qwen3-MoE or Mixtral config (transformers holds their experts fused)."""
    from transformers import MixtralConfig, PretrainedConfig, Qwen3MoeConfig
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_experts_per_tok=top_k, tie_word_embeddings=False)
    cfg: PretrainedConfig
    if arch == "qwen3_moe":
        # head_dim: not in Qwen3MoeConfig's typed signature; its **kwargs keep it as an attribute
        cfg = Qwen3MoeConfig(intermediate_size=2 * moe_intermediate,  # type: ignore[call-arg]
                             moe_intermediate_size=moe_intermediate, num_experts=experts,
                             head_dim=head_dim or hidden // heads, decoder_sparse_step=1,
                             mlp_only_layers=[], **common)
    else:
        cfg = MixtralConfig(intermediate_size=moe_intermediate, num_local_experts=experts,
                            head_dim=head_dim or hidden // heads, **common)
    cfg.dtype = dtype
    return cfg


def row_values(name: str, shape: tuple[int, ...], rows: range, dtype: torch.dtype,
               seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """Rows `rows` of a deterministic tensor called `name`: each element is an integer hash of
    (seed, name, its flat index), so each rank of a sharded test model fills just its own rows
    and a checker rebuilds the whole, bit for bit (integer arithmetic: no rounding differences)."""
    import zlib
    n = 1
    for d in shape[1:]:
        n *= d
    key = zlib.crc32(f"{seed}:{name}".encode())
    h = torch.arange(rows.start * n, rows.stop * n, dtype=torch.int64)
    h = ((h * 2654435761 + key) >> 16) & 0xFFFF          # Knuth's multiplicative hash, 16 bits
    v = (h.to(torch.float32) / 2**16 - 0.5) * (2 * scale)
    return v.to(dtype).reshape(len(rows), *shape[1:])


@torch.no_grad()
def fill_deterministic(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Set every parameter and persistent buffer from `row_values`, writing only the rows this
    rank holds for a DTensor (any rows-sharded or replicated layout): the same full values on
    one process or sharded over many, with no full copy on any rank."""
    for name, t in model.state_dict(keep_vars=True).items():
        if type(t).__name__ == "DTensor":
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                  t.placements)
            local = t._local_tensor  # noqa: SLF001
            if t.ndim == 0:
                local.copy_(row_values(name, (1,), range(1), t.dtype, seed).reshape(()))
                continue
            if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
                raise ValueError(f"{name}: only row-sharded or replicated DTensors are filled")
            rows = range(offset[0], offset[0] + shape[0])
            local.copy_(row_values(name, tuple(t.shape), rows, t.dtype, seed))
        elif t.ndim == 0:
            t.detach().copy_(row_values(name, (1,), range(1), t.dtype, seed).reshape(()))
        else:
            t.detach().copy_(row_values(name, tuple(t.shape), range(t.shape[0]), t.dtype, seed))
    return model
