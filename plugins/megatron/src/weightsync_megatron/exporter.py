"""Exporter `megatron`: a Megatron-core GPTModel (or its list of chunks), split by tensor, pipeline,
expert and expert-tensor parallelism, streamed as Buckets under the names `save_pretrained` writes.

Every rank of the trainer calls `buckets(model)` (the pipeline does this for followers); global rank
0 is the rank that pushes, and only it gets tensors. Shards are gathered only within each TP or
expert-TP group, to that group's first rank, which sends the joined HF tensors to rank 0 point to
point (`move.py`): no all-gather over the world, no rank holds more than one parameter beyond its
own shards plus, on rank 0, one bucket."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from weightsync import Bucket, Exporter
from weightsync.wire.bucket import assign_buckets, pack, pack_owned
from weightsync.config import ByteSize
from weightsync.interfaces import NameMap

from .names import architecture

__all__ = ["MegatronExporter", "MegatronExporterOptions"]

log = logging.getLogger("weightsync_megatron")


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class MegatronExporterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    architecture: str | None = Field(
        None, description="the HF model type or class (qwen3_moe, Qwen2ForCausalLM, ...)")
    vocab_size: int | None = Field(
        None, description="the HF vocabulary: rows past it (Megatron's padding) are not sent")
    hf_config: str | None = Field(
        None, description="an HF model directory or config.json: architecture and vocab_size from it")
    bucket_bytes: ByteSize = 256 * 2**20

    @field_validator("architecture")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        return architecture(v) if v is not None else None

    @model_validator(mode="after")
    def _from_config(self) -> "MegatronExporterOptions":
        if self.hf_config is not None:
            path = Path(self.hf_config)
            cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
            if self.architecture is None:
                self.architecture = architecture(str(cfg.get("model_type")))
            if self.vocab_size is None and isinstance(cfg.get("vocab_size"), int):
                self.vocab_size = cfg["vocab_size"]
        if self.architecture is None:
            raise ValueError("the megatron exporter needs `architecture` (or `hf_config`)")
        return self


class MegatronExporter(Exporter):
    name = "megatron"
    Options = MegatronExporterOptions

    def named_tensors(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) on rank 0, nothing on the other ranks (which must still run it)."""
        from .move import stream
        from .plan import make_plan
        try:
            plan = make_plan(model, self.options.architecture, self.options.vocab_size)
        except ValueError as e:
            # every rank has the same error (the plan's exchange shares them); rank 0 raises it
            # into its push, the others finish the push's protocol and get rank 0's failed report
            if _rank() == 0:
                raise
            log.error("megatron exporter: %s", e)
            return
        yield from stream(plan)

    spreads = True

    def owned(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]:
        """`senders: all`: each unit's shards gathered within its TP or expert-TP group to the
        group member the plan picked (`plan.spread`: the groups' ranks take turns by bytes), which
        sends the HF tensors itself; every rank's buckets numbered in the push's order."""
        import torch.distributed as dist
        from .move import stream_own
        from .plan import make_plan, spread
        plan = make_plan(model, self.options.architecture, self.options.vocab_size)
        plan.units = spread(plan.units)
        entries = []
        for u in plan.units:
            for n, d, shape in u.outputs:
                meta = torch.empty(shape, dtype=getattr(torch, d), device="meta")
                outs = name_map(n, meta) if name_map else [(n, meta)]
                entries += [(u.sender, m, t.numel() * t.element_size()) for m, t in outs]
        named = ((m, t) for n, tensor in stream_own(plan)
                 for m, t in (name_map(n, tensor) if name_map else ((n, tensor),)))
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return pack_owned(named, assign_buckets(entries, self.options.bucket_bytes), me)

    def buckets(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]:
        named = ((name, t) for hf_name, tensor in self.named_tensors(model)
                 for name, t in (name_map(hf_name, tensor) if name_map else ((hf_name, tensor),)))
        return pack(named, self.options.bucket_bytes)
