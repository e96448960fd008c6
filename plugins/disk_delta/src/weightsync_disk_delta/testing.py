"""Helpers shared by this plugin's tests and benchmark: a tiny model trained with a real
optimizer, and a bit-exact comparison."""

from __future__ import annotations

from pathlib import Path

import torch


class Trainer:
    """A tiny Llama saved in bf16 (what the engines start from), trained in fp32 master weights
    with AdamW and published as bf16, like a mixed-precision RL trainer: real optimizer steps,
    so which elements change is real, and the learning rate sets how many."""

    def __init__(self, model_dir: Path, lr: float = 3e-6, seed: int = 0, **arch) -> None:
        from weightsync.testing.models import build_tiny_model
        self.model = build_tiny_model(model_dir, "llama", dtype="bfloat16", seed=seed, **arch).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed + 1)
        self.data = torch.randint(3, self.model.config.vocab_size, (4, 17), generator=g)

    def step(self) -> None:
        torch.set_num_threads(1)       # a tiny model: threads only add contention on small hosts
        self.model.train()
        loss = self.model(input_ids=self.data, labels=self.data).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        """The published weights: bf16 copies of the fp32 master weights."""
        return {n: t.detach().to(torch.bfloat16) for n, t in self.model.state_dict().items()}


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ (or are missing on one side); [] means bit-equal."""
    bad = sorted(set(a) ^ set(b))
    for n in set(a) & set(b):
        x, y = a[n], b[n]
        if x.dtype != y.dtype or x.shape != y.shape or \
                not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            bad.append(n)
    return bad


def publish_config(root: Path, **enc) -> dict:
    """A trainer-side config that publishes into `root` with the delta encoding."""
    return {"encoding": {"kind": "delta", "options": enc},
            "transport": {"kind": "disk_delta", "options": {"root": str(root)}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
            "sync": {"progress": "off"}}


def weights_only(model_dir: Path, out: Path) -> Path:
    """A copy of a model's safetensors without config.json: a reference engine on it starts fast
    (no transformers) and holds the same tensors."""
    import shutil
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).glob("*.safetensors"):
        shutil.copy(f, out / f.name)
    return out


HOOK_CALLS: list[str] = []


def record_hook(path: str) -> None:
    """A before_read/after_write hook for tests: records every path it is called with."""
    HOOK_CALLS.append(path)
