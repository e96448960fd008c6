"""What a delta does to one tensor of the host-local checkpoint, and the check that it fits that
tensor (element size, count, positions inside it) before it is journalled or written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from weightsync.errors import PayloadError

from . import positions
from .schema import ITEMSIZE, numel_of


@dataclass
class Change:
    """What a delta does to one tensor of the local checkpoint."""
    idx: torch.Tensor | None                 # validated int64 positions (None: `vals` is whole)
    vals: torch.Tensor                       # the new values as integer bits, or the whole tensor
    stored: dict[str, torch.Tensor] = field(default_factory=dict)  # positions as journalled
    form: str = "idx"                        # their positions.py form

    @classmethod
    def of(cls, idx: torch.Tensor | None, vals: torch.Tensor, numel: int,
           stored: tuple[str, dict[str, torch.Tensor]] | None = None) -> Change:
        """A change; its positions are gap-coded for the journal unless `stored` has them."""
        if idx is None:
            return cls(None, vals)
        form, arrays = stored or positions.encode(idx, numel)
        return cls(idx, vals, arrays, form)


def check_changes(changes: Mapping[str, Change], tensors: Mapping[str, Mapping[str, Any]],
                  version: int) -> None:
    """Every change fits its tensor in `tensors` (a local state's): a whole tensor has its byte
    size, values have its element size and pair up with positions, and the positions (ascending,
    as decoding checked) lie inside it. PayloadError before anything is written otherwise."""
    for n, c in changes.items():
        info = tensors.get(n)
        if info is None:
            raise PayloadError(f"version {version}: tensor {n!r} is not in the local checkpoint")
        size, numel = ITEMSIZE[info["dtype"]], numel_of(info["shape"])
        where = f"version {version}: tensor {n!r} ({info['dtype']} {list(info['shape'])} locally)"
        if c.idx is None:
            if c.vals.numel() * c.vals.element_size() != numel * size:
                raise PayloadError(f"{where}: the new tensor has {c.vals.numel()} elements of "
                                   f"{c.vals.element_size()} bytes")
            continue
        if c.idx.dtype != torch.int64 or c.idx.dim() != 1 or c.vals.dim() != 1 \
                or c.vals.numel() != c.idx.numel() or c.vals.element_size() != size:
            raise PayloadError(f"{where}: {c.idx.numel()} positions and {c.vals.numel()} values of "
                               f"{c.vals.element_size()} bytes do not pair up")
        if c.idx.numel() and (int(c.idx[0]) < 0 or int(c.idx[-1]) >= numel):
            raise PayloadError(f"{where}: positions {int(c.idx[0])}..{int(c.idx[-1])} run outside "
                               f"its {numel} elements")
