"""Tiny causal LMs built offline (no hub): random Llama or Qwen2 weights saved as safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch


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
