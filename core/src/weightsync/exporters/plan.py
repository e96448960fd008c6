"""What an export will send, decided from names, shapes and dtypes alone, before any byte moves.

A model's tensors are *sources* (a local tensor or a DTensor, maybe with a LoRA merge to apply);
what travels are *outputs*: checkpoint tensors, each a strided view of one source or computed by a
conversion group from whole sources. Being metadata only, the plan is the same on every rank of a
sharded trainer, and its names can be checked against an engine's checkpoint before sending."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@dataclass(eq=False)
class Source:
    """One tensor the model holds, by its state-dict name (LoRA wrappers already removed).
    `merge`, when set, turns the held value into the value to send (a LoRA merge)."""

    name: str
    tensor: torch.Tensor
    merge: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def distributed(self) -> bool:
        return is_dtensor(self.tensor)

    @property
    def strides(self) -> tuple[int, ...]:
        """The layout views are traced against: a DTensor's (or a merged value's) global layout
        is contiguous; a local tensor keeps its own strides, so views map onto its storage."""
        if self.distributed or self.merge is not None:
            return contiguous_strides(self.shape)
        return tuple(self.tensor.stride())

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device="meta")


@dataclass(eq=False)
class Group:
    """Sources a conversion turns into checkpoint tensors together (e.g. one layer's fused
    experts). `run` is transformers' own reverse converter applied to the sources' values."""

    layer_name: str
    members: list[tuple[str, str, Source]]          # (state-dict name, source pattern, source)
    run: Callable[[dict[Source, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(eq=False)
class Output:
    """One tensor as the engine must receive it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Source | None = None          # a view of this source ...
    stride: tuple[int, ...] | None = None  # ... with these strides (None: the source itself)
    offset: int = 0                        # ... starting this many elements into it
    group: Group | None = None             # or computed by this group
    key: str = ""                          # under this name in the group's result

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole(self) -> bool:
        return self.source is not None and self.stride is None

    def renamed(self, name: str) -> Output:
        return Output(name, self.shape, self.dtype, self.source, self.stride, self.offset,
                      self.group, self.key)


@dataclass
class Plan:
    """Every output in sending order, and what producing them needs."""

    outputs: list[Output]
    model: Any = None                      # the transformers model whose layout it follows

    @property
    def distributed(self) -> bool:
        return any(s.distributed for s in self.sources())

    def sources(self) -> Iterator[Source]:
        seen: set[int] = set()
        for o in self.outputs:
            for s in needed_sources(o):
                if id(s) not in seen:
                    seen.add(id(s))
                    yield s

    def batches(self, limit: int) -> Iterator[tuple[int, list[Output]]]:
        """(index of the first output, outputs) groups of at most `limit` bytes, cut exactly where
        the bucket builder cuts; an output larger than `limit` forms a batch of its own."""
        batch: list[Output] = []
        size = start = 0
        for i, o in enumerate(self.outputs):
            if batch and size + o.nbytes > limit:
                yield start, batch
                batch, size, start = [], 0, i
            batch.append(o)
            size += o.nbytes
        if batch:
            yield start, batch


def needed_sources(o: Output) -> list[Source]:
    if o.source is not None:
        return [o.source]
    assert o.group is not None
    return [s for _, _, s in o.group.members]


def identity(source: Source, name: str | None = None) -> Output:
    return Output(name or source.name, source.shape, source.dtype, source)


def storage_key(t: torch.Tensor) -> tuple | None:
    """Equal keys: the same bytes under two names (tied weights)."""
    if is_dtensor(t):
        t = t._local_tensor  # noqa: SLF001 - the shard this rank holds; tied DTensors share it
    if not t.numel() or t.device.type == "meta":
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def untie(items: Iterable[tuple[str, torch.Tensor]],
          keep: Callable[[list[tuple[str, torch.Tensor]]], set[str]] | None = None
          ) -> list[tuple[str, torch.Tensor]]:
    """Each tied tensor once. `keep` picks which names of a tied group survive (transformers'
    own rule for its models); by default the first name."""
    items = [(n, t.detach() if not is_dtensor(t) else t) for n, t in items]
    by_key: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for n, t in items:
        k = storage_key(t)
        if k is not None:
            by_key.setdefault(k, []).append((n, t))
    drop: set[str] = set()
    for group in by_key.values():
        if len(group) > 1:
            kept = (keep(group) if keep else None) or {group[0][0]}
            drop.update(n for n, _ in group if n not in kept)
            if len(kept) > 1:   # names transformers would refuse to save: keep the first only
                drop.update(sorted(kept, key=[n for n, _ in group].index)[1:])
    return [(n, t) for n, t in items if n not in drop]


def module_items(model: torch.nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """The module's state dict (persistent buffers included unless asked not to), by reference."""
    items = list(model.state_dict(keep_vars=True).items())
    if not include_buffers:
        buffers = {id(b) for b in model.buffers()}
        items = [(n, t) for n, t in items if id(t) not in buffers]
    return items


def mapping_items(model: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    items = list(model.items())
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
    return items
