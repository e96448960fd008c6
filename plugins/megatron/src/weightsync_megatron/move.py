"""Moving the planned units to the rank that pushes (global rank 0): each unit's shards are
gathered within its TP (or expert-TP) group to that group's first rank, which joins them into HF
tensors and sends those point to point to rank 0. Every rank walks the same units in the same order
and takes part only in the moves that involve it, so the moves pair up; one unit's tensors are in
flight at a time (no rank ever holds a copy of the model)."""

from __future__ import annotations

from typing import Iterator

import torch

from .convert import to_hf
from .plan import Plan, Unit

__all__ = ["stream", "stream_own"]


def stream(plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """On rank 0: (HF name, tensor) for every unit, in plan order. On other ranks: nothing is
    yielded; the generator runs their share of the gathers and sends."""
    units = iter(plan.units)
    try:
        for unit in units:
            yield from _move(plan, unit)
    except GeneratorExit:
        # closed early on rank 0 (an abandoned sync): the other ranks are still sending, so
        # take the rest of their tensors and drop them
        for unit in units:
            for _ in _move(plan, unit):
                pass
        raise


def stream_own(plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """`senders: all`: (HF name, tensor) of the units this rank sends, in plan order; each unit's
    shards gathered within its group to its sender, nothing sent on to another rank. Closed
    early, it still joins the remaining gathers of its groups."""
    units = iter(plan.units)
    try:
        for unit in units:
            shards = _gather(plan, unit)
            if plan.ranks.me == unit.sender:
                assert shards is not None
                yield from zip((n for n, _, _ in unit.outputs), to_hf(unit.kind, shards, plan.geometry))
    except GeneratorExit:
        for unit in units:
            _gather(plan, unit)
        raise


def _move(plan: Plan, unit: Unit) -> Iterator[tuple[str, torch.Tensor]]:
    shards = _gather(plan, unit)
    me = plan.ranks.me
    if me == unit.sender:
        assert shards is not None
        outs = to_hf(unit.kind, shards, plan.geometry)
        if me == 0:
            yield from zip((n for n, _, _ in unit.outputs), outs)
        else:
            import torch.distributed as dist
            for t in outs:
                dist.send(t.contiguous(), dst=0)
    elif me == 0:
        yield from _receive(plan, unit)


def _gather(plan: Plan, unit: Unit) -> list[torch.Tensor] | None:
    """The unit's shards in group-rank order on its sender; None elsewhere. Ranks outside the
    sender's group (another stage, EP rank or data-parallel replica) do nothing."""
    ranks = plan.ranks
    group = ranks.group(unit.expert)
    if unit.sender not in group:
        return None
    mine = plan.local.get(unit.id)
    if mine is None:
        raise RuntimeError(f"rank {ranks.me} shares a group with rank {unit.sender} but does not "
                           f"hold {unit.id}; the model's layout differs between ranks")
    if unit.kind == "copy" or len(group) == 1:
        return [mine] if ranks.me == unit.sender else None
    import torch.distributed as dist
    mine = mine.contiguous()
    bucket = [torch.empty_like(mine) for _ in group] if ranks.me == unit.sender else None
    dist.gather(mine, bucket, dst=unit.sender, group=ranks.process_group(unit.expert))
    return bucket


def _receive(plan: Plan, unit: Unit) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist
    for name, dtype, shape in unit.outputs:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=plan.device)
        dist.recv(t, src=unit.sender)
        yield name, t
