"""Fixtures: the LMDeploy stand-in server as a real separate process (see lmd_standin.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from lmd_process import Standin  # noqa: E402


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Any]:
    """Factory: standin(model, tp=1, backend="pytorch", api_key=None) -> a started Standin."""
    started: list[Standin] = []

    def make(model: dict[str, torch.Tensor], **kw: Any) -> Standin:
        s = Standin(tmp_path, model, **kw).start()
        started.append(s)
        return s

    try:
        yield make
    finally:
        for s in started:
            s.stop()


def tiny_model(seed: int = 0, layers: int = 2) -> dict[str, torch.Tensor]:
    """A tiny Llama-shaped state dict with mixed dtypes (bf16 weights, fp32 norms, an fp16 and
    an int64 tensor), so flattened calls come in several dtype runs."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": r(64, 16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = r(16, 16)
        sd[p + "self_attn.k_proj.weight"] = r(8, 16)
        sd[p + "mlp.up_proj.weight"] = r(32, 16, dtype=torch.float16)
        sd[p + "input_layernorm.weight"] = r(16, dtype=torch.float32)
    sd["model.norm.weight"] = r(16, dtype=torch.float32)
    sd["model.rotary.step"] = torch.tensor([3], dtype=torch.int64)
    sd["lm_head.weight"] = r(64, 16)
    return sd


def next_version(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {k: ((v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype)
                if v.is_floating_point() else v + seed) for k, v in sd.items()}


@pytest.fixture
def model_factory() -> Any:
    return tiny_model


@pytest.fixture
def version_factory() -> Any:
    return next_version
