"""Sharded sources (DTensors) brought to the sending rank one batch at a time, point to point.

`DTensor.full_tensor()` all-gathers a whole tensor onto every rank: for a fused experts tensor that
is every expert on every rank. Here only the sending rank (global rank 0) receives, and only the
slices of the current batch, each from one holder; no rank holds more than its own shards plus
about one batch. Handled layouts: rows (dim 0) split along one mesh dimension (FSDP2's `Shard(0)`,
expert parallelism), other mesh dimensions replicated (HSDP), or fully replicated. Anything else
(`Shard(1)`, tensor-parallel strided shards, `Partial`) falls back to `full_tensor()`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SENDER = 0
_ALIGN = 16


@dataclass(frozen=True)
class Rows:
    """Where a DTensor's rows live: global rank `ranks[i]` holds rows `starts[i]:starts[i+1]`."""

    ranks: tuple[int, ...]
    starts: tuple[int, ...]
    row_numel: int

    def holders(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(index, rank, first row, end row) of every holder of rows [lo, hi)."""
        spans = [(i, r, max(lo, self.starts[i]), min(hi, self.starts[i + 1]))
                 for i, r in enumerate(self.ranks)]
        return [(i, r, a, b) for i, r, a, b in spans if a < b]


def rows_of(t: Any, me: int) -> Rows | None:
    """The row layout of DTensor `t`, or None when it is not one this module handles (or this
    rank's shard does not look as that layout says; the plan check then stops every rank)."""
    from torch.distributed.tensor import Replicate, Shard
    placements = tuple(t.placements)
    shard = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == 0]
    if len(shard) > 1 or any(i not in shard and not isinstance(p, Replicate)
                             for i, p in enumerate(placements)):
        return None
    grid = t.device_mesh.mesh
    hits = (grid == SENDER).nonzero()
    coord = hits[0].tolist() if len(hits) else [0] * grid.ndim
    if shard:
        d = shard[0]
        line = [int(grid[(*coord[:d], j, *coord[d + 1:])]) for j in range(grid.shape[d])]
    else:
        line = [int(grid[tuple(coord)])]
    shape = tuple(t.shape) or (1,)
    n = shape[0]
    per = math.ceil(n / len(line)) if n else 0            # torch.chunk's split, as DTensor's
    starts = tuple(min(i * per, n) for i in range(len(line) + 1))
    local = t._local_tensor  # noqa: SLF001
    if me in line:
        i = line.index(me)
        want = (starts[i + 1] - starts[i], *shape[1:]) if t.ndim else ()
        if tuple(local.shape) != want or not local.is_contiguous():
            return None
    return Rows(tuple(line), starts, math.prod(shape[1:]))


@dataclass
class Request:
    """A strided view (in the global tensor's contiguous layout) of a row-sharded DTensor."""

    tensor: Any
    rows: Rows
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span(self) -> tuple[int, int]:
        """The rows [lo, hi) the view touches."""
        last = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        rn = max(self.rows.row_numel, 1)
        return self.offset // rn, last // rn + 1

    def local_view(self, index: int) -> torch.Tensor:
        """This view cut from holder `index`'s shard (which holds all of it)."""
        local = self.tensor._local_tensor  # noqa: SLF001
        start = self.offset - self.rows.starts[index] * self.rows.row_numel
        return local.as_strided(self.shape, self.stride, local.storage_offset() + start)

    def local_rows(self, index: int, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of holder `index`'s shard: a contiguous slice, sent without a copy."""
        local = self.tensor._local_tensor  # noqa: SLF001
        s = self.rows.starts[index]
        return local.reshape(-1, *self.tensor.shape[1:])[a - s:b - s]

    def device(self) -> torch.device:
        return self.tensor._local_tensor.device  # noqa: SLF001


class _Batch:
    """One batch's traffic, laid out identically on every rank from the same requests: per
    holding rank, its whole views packed into one message (tag 0), then one message per row
    block of a view that several ranks share (tags 1, 2, ...)."""

    def __init__(self, requests: list[Request], me: int) -> None:
        self.requests, self.me = requests, me
        self.out: list[torch.Tensor | None] = [None] * len(requests)
        self.packed: dict[int, list[int]] = {}                         # rank -> requests
        self.blocks: dict[int, list[torch.Tensor]] = {}                # rank -> recv/send tensors
        self.rows: dict[int, torch.Tensor] = {}                        # sender: assembled rows
        self.own: list[tuple[int, torch.Tensor, int]] = []             # sender's own row blocks
        for k, req in enumerate(requests):
            self._plan(k, req)

    @property
    def sending(self) -> bool:
        return self.me == SENDER

    def _plan(self, k: int, req: Request) -> None:
        if req.numel == 0:
            if self.sending:
                self.out[k] = torch.empty(req.shape, dtype=req.dtype, device=req.device())
            return
        lo, hi = req.span()
        holders = req.rows.holders(lo, hi)
        if len(holders) == 1:
            i, rank, _, _ = holders[0]
            if rank != SENDER:
                self.packed.setdefault(rank, []).append(k)
            elif self.sending:
                self.out[k] = req.local_view(i)          # the sender's own: a view, no copy
            return
        if self.sending:
            self.rows[k] = torch.empty((hi - lo, *req.tensor.shape[1:]), dtype=req.dtype,
                                       device=req.device())
        for i, rank, a, b in holders:
            if rank == SENDER:
                if self.sending:
                    self.own.append((k, req.local_rows(i, a, b), a - lo))
            elif self.sending:
                self.blocks.setdefault(rank, []).append(self.rows[k][a - lo:b - lo])
            elif self.me == rank:
                self.blocks.setdefault(rank, []).append(req.local_rows(i, a, b))

    def _pack(self, rank: int) -> torch.Tensor:
        """The packed message of `rank`: the holder fills it, the sender's views point into it."""
        items = self.packed[rank]
        offsets, total = [], 0
        for k in items:
            offsets.append(total)
            nbytes = self.requests[k].numel * self.requests[k].dtype.itemsize
            total += -(-nbytes // _ALIGN) * _ALIGN          # each slot starts 16-byte aligned
        buf = torch.empty(total, dtype=torch.uint8, device=self.requests[items[0]].device())
        for k, off in zip(items, offsets):
            req = self.requests[k]
            slot = buf[off: off + req.numel * req.dtype.itemsize].view(req.dtype).view(req.shape)
            if self.sending:
                self.out[k] = slot
            else:
                slot.copy_(req.local_view(req.rows.ranks.index(rank)))
        return buf

    def run(self) -> list[torch.Tensor | None]:
        import torch.distributed as dist

        def op(t: torch.Tensor, rank: int, tag: int) -> Any:
            return (dist.irecv(t, src=rank, tag=tag) if self.sending
                    else dist.isend(t, dst=SENDER, tag=tag))

        ops, buffers = [], []
        for rank in self.packed:
            if self.me in (SENDER, rank):
                buffers.append(self._pack(rank))
                ops.append(op(buffers[-1], rank, 0))
        for rank, blocks in self.blocks.items():
            ops.extend(op(t.reshape(-1).view(torch.uint8), rank, tag)
                       for tag, t in enumerate(blocks, start=1))
        for k, t, at in self.own:
            self.rows[k][at: at + t.shape[0]].copy_(t)
        for o in ops:
            o.wait()
        for k, buf in self.rows.items():
            req = self.requests[k]
            start = req.offset - req.span()[0] * req.rows.row_numel
            self.out[k] = buf.as_strided(req.shape, req.stride, buf.storage_offset() + start)
        return self.out


def exchange(requests: list[Request], me: int) -> list[torch.Tensor | None]:
    """Each request's view on the sending rank (None elsewhere), each piece sent by its holder: one
    message per holding rank for its whole views, one per row block of a view ranks share."""
    return _Batch(requests, me).run()
