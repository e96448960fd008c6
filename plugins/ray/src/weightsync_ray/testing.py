"""What the Ray tests and `examples/ray/train.py` train: a tiny policy under Hugging Face-style
names, its FSDP2 sharding and an AdamW step; a tiny Llama causal LM (`CAUSAL_POLICY`) for the
tests the probe must run in; a fault to inject into a rank and a count of its probe passes. They
live in the package because Ray actors import them by name on other nodes (a test module is not
importable there)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, LAYERS = 128, 32, 2
POLICY = {"model": "weightsync_ray.testing:build_policy",
          "step": "weightsync_ray.testing:train_step",
          "shard": "weightsync_ray.testing:shard_policy"}
"""`RayTrainer(..., **POLICY)`: the tiny policy, its AdamW step and its FSDP2 sharding."""
CAUSAL_POLICY = {"model": "weightsync_ray.testing:build_causal_policy",
                 "step": "weightsync_ray.testing:causal_train_step",
                 "shard": "weightsync_ray.testing:shard_policy"}
"""`RayTrainer(..., **CAUSAL_POLICY)`: a tiny transformers Llama (a causal LM, so the probe runs
on every push), its AdamW step on the LM loss and the same FSDP2 sharding (per decoder layer)."""


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


def shard_policy(model: Any, mesh: Any) -> None:
    """FSDP2: each block (decoder layer) a unit of its own, then the root: `model.model.layers`
    is where both policies keep them."""
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _batch(model: nn.Module, version: int) -> torch.Tensor:
    """Token ids drawn from `version`: the same batch on every rank."""
    g = torch.Generator().manual_seed(version)
    return torch.randint(0, VOCAB, (4, 16), generator=g).to(next(model.parameters()).device)


def _adamw(model: nn.Module, state: dict[str, Any], loss: torch.Tensor) -> float:
    """One AdamW step on `loss`; the optimizer lives in the rank's `state` across versions."""
    if "opt" not in state:
        state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad(set_to_none=True)
    return float(loss.detach().cpu())


def train_step(model: nn.Module, version: int, state: dict[str, Any]) -> float:
    """One AdamW step on a batch drawn from `version` (the same batch on every rank)."""
    ids = _batch(model, version)
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return _adamw(model, state, loss)


# -- a causal LM: what the probe scores --------------------------------------------------------

def causal_config() -> LlamaConfig:
    """A tiny Llama (float32, untied head): small enough for CPU ranks, real enough that the
    reference engine loads it with transformers and answers `/score`."""
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=2 * HIDDEN, intermediate_size=4 * HIDDEN,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    cfg.dtype = "float32"
    return cfg


def build_causal_policy(seed: int = 0) -> LlamaForCausalLM:
    """The causal policy as it starts (version 0): the same weights for a seed in every process,
    so the ranks and `write_causal_checkpoint` agree."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(causal_config()).float()


def causal_train_step(model: Any, version: int, state: dict[str, Any]) -> float:
    """One AdamW step on the next-token loss of a batch drawn from `version`."""
    ids = _batch(model, version)
    return _adamw(model, state, model(input_ids=ids, labels=ids).loss)


def write_causal_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """The causal policy at version 0 as a Hugging Face model directory (config.json and
    safetensors): what the reference engine loads as a model it can run and score with."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_causal_policy(seed).save_pretrained(path)
    return path


def count_eval_forwards(worker: Any) -> None:
    """Through `rank_actor.__ray_call__`: count, in `worker.state["eval_forwards"]`, the forward
    passes this rank's model runs in eval mode. Training runs in train mode, so these are the
    probe's: a follower's count shows it joined the sharded forward rank 0 compares with."""
    worker.state["eval_forwards"] = 0

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            worker.state["eval_forwards"] += 1
    worker.model.register_forward_hook(hook)


def eval_forwards(worker: Any) -> int:
    """Through `rank_actor.__ray_call__`: the count `count_eval_forwards` keeps."""
    return int(worker.state.get("eval_forwards", -1))


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
