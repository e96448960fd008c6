"""Exporter `torch`: a module, a state dict or an iterator of (name, tensor) -> Buckets.

Streams: at most one bucket is assembled at a time and tensors are referenced, not copied, so the
exporter itself adds no memory beyond gathered DTensor shards of the bucket being built. A tensor
larger than `bucket_bytes` travels alone in a bucket of its own (it is never split, so every engine
can load it with one call)."""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..bucket import Bucket
from ..config import ByteSize
from ..interfaces import Exporter, NameMap


class TorchExporterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bucket_bytes: ByteSize = 256 * 2**20
    rename: list[tuple[str, str]] = Field(default_factory=list,
                                          description="regex -> replacement, applied in order")
    skip: list[str] = Field(default_factory=list, description="regexes of names not to send")
    include_buffers: bool = True


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from a module (state dict order, persistent buffers too), a mapping or an
    iterable; tied weights are yielded once, under the first name."""
    if isinstance(model, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = model.state_dict(keep_vars=True).items()
    elif isinstance(model, Mapping):
        items = model.items()
    else:
        items = model
    seen: set[tuple] = set()
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if not _is_dtensor(t) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                continue
            seen.add(key)
        yield name, t


def split_fused(tensor: torch.Tensor, names: list[str], sizes: list[int], dim: int = 0
                ) -> list[tuple[str, torch.Tensor]]:
    """For a name map: split a fused trainer weight (e.g. qkv) into HF tensors."""
    return list(zip(names, torch.split(tensor, sizes, dim=dim)))


class TorchExporter(Exporter):
    name = "torch"
    Options = TorchExporterOptions

    def _mapped(self, model: Any, name_map: NameMap | None) -> Iterator[tuple[str, torch.Tensor]]:
        rename = [(re.compile(p), r) for p, r in self.options.rename]
        skip = [re.compile(p) for p in self.options.skip]
        buffers = None
        if isinstance(model, torch.nn.Module) and not self.options.include_buffers:
            buffers = {n for n, _ in model.named_buffers()}
        for name, t in named_tensors(model):
            if buffers and name in buffers:
                continue
            if _is_dtensor(t):
                t = t.full_tensor()  # collective: every rank of the mesh runs the same loop
            for pat, rep in rename:
                name = pat.sub(rep, name)
            if any(p.search(name) for p in skip):
                continue
            pairs = name_map(name, t) if name_map else ((name, t),)
            for n, x in pairs:
                yield n, x

    def buckets(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]:
        limit = self.options.bucket_bytes
        current: list[tuple[str, torch.Tensor]] = []
        size = 0
        index = 0
        names: set[str] = set()
        for name, t in self._mapped(model, name_map):
            if name in names:
                raise ValueError(f"two tensors map to the name {name!r}; fix the name map")
            names.add(name)
            n = t.numel() * t.element_size()
            if current and size + n > limit:
                yield Bucket(index, current)   # a tensor follows, so this one is not the last
                index += 1
                current, size = [], 0
            current.append((name, t))
            size += n
        if current:
            yield Bucket(index, current, last=True)
