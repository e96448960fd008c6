"""Loading a model directory for the reference engine: an HF causal LM when `config.json` and
transformers are there, otherwise the safetensors weights alone (a weights-only engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from weightsync.receive import DictStore, ModuleStore


class LoadedModel:
    def __init__(self, store: Any, module: torch.nn.Module | None, kind: str) -> None:
        self.store = store
        self.module = module
        self.kind = kind

    @torch.no_grad()
    def next_token(self, ids: list[int]) -> int:
        assert self.module is not None
        device = next(self.module.parameters()).device
        logits = self.module(torch.tensor([ids], device=device)).logits
        return int(logits[0, -1].argmax())


def load_model(path: str | Path, device: str = "cpu") -> LoadedModel:
    """The model in `path`, its weights on `device` ("cpu", "cuda", "cuda:1")."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    files = sorted(path.glob("*.safetensors"))
    if (path / "config.json").exists():
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise SystemExit("this model directory needs transformers to run; "
                             "pip install transformers") from None
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        model = model.to(device)  # type: ignore[arg-type]  # transformers types .to as unbound
        model.eval()
        return LoadedModel(ModuleStore(model), model, type(model).__name__)
    if not files:
        raise FileNotFoundError(f"{path} has neither config.json nor *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f, device=str(device)))
    return LoadedModel(DictStore(tensors), None, "weights-only")
