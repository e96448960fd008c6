"""The one place of the push that knows the trainer's ranks: whether the push runs in a
torch.distributed job, and which rank this process is. Every part of the push that behaves
differently on rank 0 (the pipeline, the round, the probe) asks here."""

from __future__ import annotations

from typing import Any

__all__ = ["device_of", "distributed", "rank", "share_int", "world"]


def world() -> Any:
    """`torch.distributed` when this process is in an initialized group, else None."""
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def distributed() -> bool:
    """True when the trainer runs as several ranks (an initialized torch.distributed group)."""
    return world() is not None


def rank() -> int:
    """This process's rank in the trainer's group; 0 when it is not distributed."""
    dist = world()
    return dist.get_rank() if dist is not None else 0


def device_of(dist: Any) -> Any:
    """Where the group's collectives run: the current CUDA device under nccl, else the CPU."""
    import torch
    gpu = dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if gpu else "cpu"


def share_int(value: int | None) -> int:
    """Rank 0's `value` on every rank of the trainer's default group (the others pass None)."""
    import torch
    dist = world()
    assert dist is not None
    t = torch.tensor([value if value is not None else 0], dtype=torch.int64, device=device_of(dist))
    dist.broadcast(t, 0)
    return int(t.item())
