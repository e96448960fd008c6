"""What the Ray tests and `examples/ray/train.py` train: a tiny policy under Hugging Face-style
names, its FSDP2 sharding and an AdamW step, plus a fault to inject into a rank. They live in the
package because Ray actors import them by name on other nodes (a test module is not importable
there)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB, HIDDEN, LAYERS = 128, 32, 2
POLICY = {"model": "weightsync_ray.testing:build_policy",
          "step": "weightsync_ray.testing:train_step",
          "shard": "weightsync_ray.testing:shard_policy"}
"""`RayTrainer(..., **POLICY)`: the tiny policy, its AdamW step and its FSDP2 sharding."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp: Any = nn.Module()         # a bare namespace: its submodules are set below
        self.mlp.up_proj = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.mlp.down_proj = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.input_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp.down_proj(torch.relu(self.mlp.up_proj(self.input_layernorm(x))))


class TinyPolicy(nn.Module):
    """model.embed_tokens, model.layers.N.{mlp.up_proj,mlp.down_proj,input_layernorm}, model.norm,
    lm_head: the names a causal LM checkpoint has."""

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = nn.Module()       # a bare namespace: its submodules are set below
        self.model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.model.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def build_policy(seed: int = 0) -> TinyPolicy:
    torch.manual_seed(seed)
    return TinyPolicy()


def shard_policy(model: TinyPolicy, mesh: Any) -> None:
    """FSDP2: each block a unit of its own, then the root."""
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_step(model: nn.Module, version: int, state: dict[str, Any]) -> float:
    """One AdamW step on a batch drawn from `version` (the same batch on every rank)."""
    if "opt" not in state:
        state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(version)
    device = next(model.parameters()).device
    ids = torch.randint(0, VOCAB, (4, 16), generator=g).to(device)
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad(set_to_none=True)
    return float(loss.detach().cpu())


def write_initial_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """The policy as it starts (version 0), as a weights-only model directory engines serve."""
    from weightsync.testing import write_weights_only_model
    sd = {k: v.detach().clone() for k, v in build_policy(seed).state_dict().items()}
    return write_weights_only_model(path, sd)


def engine_weights(url: str, api_key: str | None = None) -> dict[str, torch.Tensor]:
    """What a reference engine holds now (`GET /weights`, safetensors)."""
    import requests
    from safetensors.torch import load
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = requests.get(url.rstrip("/") + "/weights", headers=headers, timeout=60)
    r.raise_for_status()
    return load(r.content)


def mismatches(url: str, expected: dict[str, torch.Tensor], api_key: str | None = None
               ) -> list[str]:
    """Names whose tensor in the engine at `url` is not bit for bit `expected` (missing and
    extra names included); empty when the engine holds exactly `expected`."""
    got = engine_weights(url, api_key)
    bad = sorted(set(got) ^ set(expected))
    bad += [n for n, t in expected.items()
            if n in got and not (got[n].dtype == t.dtype and torch.equal(got[n], t))]
    return bad


class DieOnSend:
    """A fault for `RayTrainer.push(before=...)`: on `rank`, the process exits (as a killed rank
    would) at its `after`-th point-to-point send or receive, in the middle of the exporter's
    gather, once engines hold an open round."""

    def __init__(self, rank: int, after: int = 2) -> None:
        self.rank, self.after = rank, after

    def __call__(self, rank: int) -> None:
        if rank != self.rank:
            return
        import torch.distributed as dist
        count = [0]

        def dying(op: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                count[0] += 1
                if count[0] >= self.after:
                    os._exit(1)
                return op(*args, **kwargs)
            return run
        dist.isend = dying(dist.isend)
        dist.irecv = dying(dist.irecv)
