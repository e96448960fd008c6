"""Exporter `torch`: a module, a state dict or an iterator of (name, tensor) -> Buckets.

A module or a state dict is planned first from metadata (`plan.py`): a transformers (>= 5) model
goes out in the checkpoint layout `save_pretrained` writes (`layout.py`), a PEFT model merged
under the base model's names (`lora.py`). Then the planned tensors are streamed one bucket at a
time (`fetch.py`), sharded (DTensor) weights slice by slice from the rank holding each
(`gather.py`: every rank calls `buckets`, only global rank 0 gets tensors). Tensors are
referenced or sliced, not copied, wherever the model's own bytes are what is sent; a tensor
larger than `bucket_bytes` travels alone, never split, so every engine can load it with one
call. An iterator is streamed as it comes."""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from weightsync.wire.bucket import Bucket, assign_buckets, pack, pack_owned
from weightsync.config import ByteSize
from weightsync.interfaces import Exporter, NameMap
from weightsync.exporters import layout, lora
from weightsync.exporters.fetch import stream
from weightsync.exporters.names import check_names, checkpoint_names
from weightsync.exporters.plan import (Output, Plan, Source, identity, is_dtensor, mapping_items,
                                       module_items, untie)


class TorchExporterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bucket_bytes: ByteSize = 256 * 2**20
    rename: list[tuple[str, str]] = Field(default_factory=list,
                                          description="regex -> replacement, applied in order")
    skip: list[str] = Field(default_factory=list, description="regexes of names not to send")
    include_buffers: bool = True
    checkpoint_layout: bool = True
    """transformers models: send the names, layout and split `save_pretrained` writes (what
    engines load); false: the module's own state-dict names and layout."""
    expect_names_from: str | None = None
    """A model directory (or .safetensors / index file) with the engine's checkpoint: the export's
    names must match it, checked before anything is sent."""
    every_rank: bool = False
    """Sharded models: every rank gets every tensor (each shard all-gathered to every rank) instead
    of only rank 0, for code that consumes buckets on every rank. The pipeline sends from rank 0."""


def named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from a module (state dict order, persistent buffers too), a mapping or an
    iterable; tied weights are yielded once, under the first name. No checkpoint conversion."""
    if isinstance(model, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = model.state_dict(keep_vars=True).items()
    else:
        items = model.items() if isinstance(model, Mapping) else model
    seen: set[tuple] = set()
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if not is_dtensor(t) and t.numel():
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

    # -- planning ----------------------------------------------------------------------------
    def plan(self, model: Any) -> Plan | None:
        """What `buckets(model)` will send (names, shapes, dtypes, where each comes from); None
        for an iterator, which is streamed as it comes."""
        o = self.options
        hf = None
        if isinstance(model, torch.nn.Module):
            base = lora.base_model(model)
            hf = layout.transformers_model(base) if o.checkpoint_layout else None
            items = module_items(base, o.include_buffers)
            if hf is not None:
                ignored = layout.ignored_on_save(hf)
                items = [(n, t) for n, t in items if n not in ignored]
            keep = layout.tied_keeper(hf) if hf is not None else None
            sources = lora.merged_sources(base, untie(items, keep))
        elif isinstance(model, Mapping):
            sources = [Source(n, t) for n, t in untie(mapping_items(model))]
        else:
            return None
        outputs = (layout.checkpoint_outputs(hf, sources) if hf is not None
                   else [identity(s) for s in sources])
        named = [(x, self._rename(x.name)) for x in outputs]
        return Plan([x if n == x.name else x.renamed(n) for x, n in named if n is not None], hf)

    def _rename(self, name: str) -> str | None:
        """`name` after the `rename` rules; None when a `skip` regex drops it."""
        for pattern, replacement in self.options.rename:
            name = re.sub(pattern, replacement, name)
        return None if any(re.search(p, name) for p in self.options.skip) else name

    def names(self, plan: Plan, name_map: NameMap | None = None) -> list[str]:
        """The names `plan` sends after `name_map` (run on meta tensors: no data is touched)."""
        if name_map is None:
            return [x.name for x in plan.outputs]
        return [n for x in plan.outputs for n, _ in _on_meta(x, name_map)]

    def check(self, model: Any, plan: Plan, name_map: NameMap | None) -> None:
        """Refuse an export whose names are not the checkpoint's in `expect_names_from`."""
        where = self.options.expect_names_from
        assert where is not None
        try:
            sent = self.names(plan, name_map)
        except Exception as e:  # noqa: BLE001 - a name map that needs real data
            raise ValueError(f"expect_names_from needs the name_map to run on meta tensors "
                             f"(shape and dtype only); it raised {type(e).__name__}: {e}") from e
        expected = checkpoint_names(where)
        check_names(sent, expected, where=str(where), hints=self._hints(model, sent, expected),
                    skip=self.options.skip)

    def _hints(self, model: Any, sent: list[str], expected: list[str]) -> list[str]:
        """Which `checkpoint_layout` setting would have matched, when the other one does."""
        base = lora.base_model(model) if isinstance(model, torch.nn.Module) else None
        if base is None or layout.transformers_model(base) is None:
            return []
        flip = self.options.model_copy(update={
            "checkpoint_layout": not self.options.checkpoint_layout, "expect_names_from": None})
        other = type(self)(flip).plan(model)
        if other is not None and set(x.name for x in other.outputs) == set(expected):
            value = str(flip.checkpoint_layout).lower()
            why = ("the engine loads the checkpoint layout save_pretrained writes"
                   if flip.checkpoint_layout else
                   "the engine holds transformers' in-memory layout, not the checkpoint's")
            return [f"set the exporter option checkpoint_layout: {value} ({why})"]
        return []

    # -- streaming ---------------------------------------------------------------------------
    def _legacy(self, model: Any, name_map: NameMap | None) -> Iterator[tuple[str, torch.Tensor]]:
        """An iterator: renamed, skipped and name-mapped as it comes (DTensors all-gathered)."""
        for name, t in named_tensors(model):
            if is_dtensor(t):
                t = t.full_tensor()  # collective: every rank of the mesh runs the same loop
            new = self._rename(name)
            if new is not None:
                yield from (name_map(new, t) if name_map else ((new, t),))

    def _mapped(self, model: Any, name_map: NameMap | None) -> Iterator[tuple[str, torch.Tensor]]:
        plan = self.plan(model)
        if plan is None:
            yield from self._legacy(model, name_map)
            return
        if self.options.expect_names_from:
            self.check(model, plan, name_map)
        for name, t in stream(plan, self.options.bucket_bytes, self.options.every_rank):
            yield from (name_map(name, t) if name_map else ((name, t),))

    def buckets(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]:
        return pack(self._mapped(model, name_map), self.options.bucket_bytes)

    spreads = True

    def owned(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]:
        """`senders: all`: the plan's outputs split among the ranks in runs of about equal bytes
        (one source's tensors stay together); every rank gets every tensor (sharded sources
        all-gathered, as with `every_rank`) and sends only its own."""
        import torch.distributed as dist
        plan = self.plan(model)
        if plan is None:
            raise ValueError("sync.senders: all needs a module or a state dict (an iterator of "
                             "tensors cannot be planned); push one, or use senders: rank0")
        if self.options.expect_names_from:
            self.check(model, plan, name_map)
        on = dist.is_available() and dist.is_initialized()
        me, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        try:
            entries = _owners(plan, name_map, world)
            failed = None
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it (below)
            entries, failed = [], e
        if on:      # one 16-byte all-gather: a rank that could not plan stops every rank here
            mine = xxhash.xxh3_128(repr(entries).encode()).digest() if failed is None else bytes(16)
            dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
            every = [torch.empty(16, dtype=torch.uint8, device=dev) for _ in range(world)]
            dist.all_gather(every, torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(dev))
            differ = [r for r, t in enumerate(every) if not torch.equal(t, every[me])]
            if failed is None and differ:
                raise ValueError(f"trainer ranks {differ} planned another export than rank {me} "
                                 f"(or could not plan theirs: see their error)")
        if failed is not None:
            raise failed
        named = ((n, t) for name, tensor in stream(plan, self.options.bucket_bytes, every_rank=True)
                 for n, t in (name_map(name, tensor) if name_map else ((name, tensor),)))
        return pack_owned(named, assign_buckets(entries, self.options.bucket_bytes), me)


def _owners(plan: Plan, name_map: NameMap | None, world: int) -> list[tuple[int, str, int]]:
    """(owner rank, name, bytes) of every tensor a push sends: the outputs (after `name_map`, run
    on meta tensors) in runs of about equal bytes per rank, one output's tensors together."""
    groups = [[(n, t.numel() * t.element_size()) for n, t in _on_meta(x, name_map)]
              for x in plan.outputs]
    total = max(1, sum(b for g in groups for _, b in g))
    entries, acc = [], 0
    for g in groups:
        size = sum(b for _, b in g)
        owner = min(world - 1, int((acc + size / 2) * world // total))
        entries += [(owner, n, b) for n, b in g]
        acc += size
    return entries


def _on_meta(x: Output, name_map: NameMap | None) -> Iterable[tuple[str, torch.Tensor]]:
    """What `name_map` makes of output `x`, run on a meta tensor of its shape and dtype."""
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    return name_map(x.name, meta) if name_map else [(x.name, meta)]
