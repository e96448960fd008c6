"""The pieces verl's CheckpointEngineManager drives in the Ray test, importable by Ray's worker
processes (the test puts this directory on their PYTHONPATH).

- `ActorWorker`: a verl `Worker` holding a tiny causal LM (the policy). Its
  `execute_checkpoint_engine` and `update_weights` are those of verl's actor worker
  (verl/workers/engine_workers.py: the checkpoint engine built from the rollout config,
  `send_weights(per-tensor params, global_steps)`), with the model's state dict in place of a
  training engine's `get_per_tensor_param()` (verl's FSDP/Megatron engines are not run here).
- `HFServerAdapter`: the server adapter verl's own `CheckpointEngineWorker` feeds
  (`server_adapter.update_weights(checkpoint_engine.receive_weights(...))`): it loads the
  tensors into a transformers model of its own and generates greedily with it, standing in for
  the vLLM server a GPU run has (verl 0.9.1's vLLM rollout needs CUDA and a vLLM verl accepts).
- `CpuReplica`: a verl `RolloutReplica` whose one worker is verl's `CheckpointEngineWorker` on a
  CPU resource pool (verl's own replicas ask for GPUs)."""

from __future__ import annotations

from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout import BaseRollout, RolloutReplica


def load_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model: Any, ids: list[int], n: int = 8) -> list[int]:
    x = torch.tensor([ids])
    for _ in range(n):
        x = torch.cat([x, model(input_ids=x).logits[:, -1:].argmax(-1)], 1)
    return [int(t) for t in x[0, len(ids):]]


class ActorWorker(Worker):
    def __init__(self, model_path: str, checkpoint_engine: dict[str, Any]) -> None:
        super().__init__()
        self.model = load_model(model_path)
        cfg = checkpoint_engine
        import_external_libs(cfg["custom_backend_module"])
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            cfg["backend"], is_master=self.rank == 0,
            bucket_size=cfg["update_weights_bucket_megabytes"] << 20,
            **cfg["engine_kwargs"].get(cfg["backend"], {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @torch.no_grad()
    def train_step(self, step: int) -> dict[str, Any]:
        """A deterministic change of every weight; returns what the policy generates now."""
        g = torch.Generator().manual_seed(step)
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        return {"tokens": greedy(self.model, [1, 2, 3, 4]), "state": self.fingerprint()}

    def fingerprint(self) -> dict[str, str]:
        import hashlib
        return {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in self.model.state_dict().items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        metrics = await self.checkpoint_engine.send_weights(iter(self.model.state_dict().items()),
                                                            global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class HFServerAdapter(BaseRollout):
    def __init__(self, model_path: str, corrupt: bool = False) -> None:  # noqa: D107
        self.model_path, self.corrupt = model_path, corrupt
        self.model: Any = None
        self.version: int | None = None
        self.loaded: dict[str, str] = {}

    async def resume(self, tags: list[str]) -> None:
        """Nothing to resume: the model stays in memory."""

    async def release(self) -> None:
        """Nothing to release."""

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:
        import hashlib
        assert wire_format == "named_tensors", wire_format
        if self.model is None:
            self.model = load_model(self.model_path)
        params = self.model.state_dict()
        seen = {}
        async for name, t in weights:
            with torch.no_grad():
                params[name].copy_(t)
            seen[name] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        if self.corrupt:           # a load path that mangles a weight after the sync
            with torch.no_grad():
                next(iter(self.model.parameters())).mul_(3.0)
        self.loaded, self.version = seen, kwargs.get("global_steps")

    def serve(self, ids: list[int]) -> dict[str, Any]:
        return {"tokens": greedy(self.model, ids), "version": self.version, "loaded": self.loaded}


def serve(worker: Any, ids: list[int]) -> dict[str, Any]:
    """Run in the CheckpointEngineWorker's process (Ray's __ray_call__): what its server serves."""
    return worker.server_adapter.serve(ids)


class CpuReplica(RolloutReplica):
    async def launch_servers(self) -> None:
        """No separate server: the adapter serves in the worker's process."""

    def start(self, model_path: str, corrupt: bool = False) -> "CpuReplica":
        cls = RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker), rollout_config=self.config,
                                   model_config=None,
                                   server_adapter=HFServerAdapter(model_path, corrupt))
        wg = RayWorkerGroup(resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1),
                            ray_cls_with_init=cls, use_gpu=False,
                            name_prefix=f"replica{self.replica_rank}")
        self.workers = wg.workers
        return self
