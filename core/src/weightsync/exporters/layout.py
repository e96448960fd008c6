"""The checkpoint layout of a transformers (>= 5) model, from transformers' own conversion.

transformers 5 holds some weights in another layout than its checkpoints (fused experts, renamed
modules), and engines load checkpoints. The reverse conversion `save_pretrained` applies is run
here on meta tensors, so the plan knows every checkpoint tensor and, commonly, which strided slice
of which model tensor it is: no converted copy is made, and a sharded expert is sent from the rank
that holds it. A conversion whose result is not a slice (a concatenation) runs for real, one group
at a time. transformers is imported only when the model is one of its models."""

from __future__ import annotations

import copy
import sys
from contextlib import nullcontext
from typing import Any, Callable, cast

import torch
from torch.overrides import TorchFunctionMode

from weightsync.exporters.plan import Group, Output, Source, identity, is_dtensor


def transformers_model(model: Any) -> Any | None:
    """`model` when it is a transformers PreTrainedModel, else None; never imports transformers."""
    mod = sys.modules.get("transformers.modeling_utils")
    return model if mod is not None and isinstance(model, mod.PreTrainedModel) else None


def conversions(model: Any) -> list | None:
    """The transforms `save_pretrained` reverses, picked as `revert_weight_conversion` picks them:
    those used when the model was loaded, else the model type's registered ones (prefix changes
    dropped, since a model built from a config never had the prefix)."""
    from transformers.core_model_loading import PrefixChange
    found = getattr(model, "_weight_conversions", None)
    if found is None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        found = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                 if not isinstance(t, PrefixChange)]
    return found or None


def ignored_on_save(model: Any) -> set[str]:
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def tied_keeper(model: Any) -> Callable[[list[tuple[str, torch.Tensor]]], set[str]]:
    """transformers' choice of which name of a tied group a checkpoint keeps."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    def keep(group: list[tuple[str, torch.Tensor]]) -> set[str]:
        sd = {n: (t._local_tensor if is_dtensor(t) else t) for n, t in group}  # noqa: SLF001
        try:
            return set(remove_tied_weights_from_state_dict(sd, model))
        except RuntimeError:      # ties transformers does not know about: keep the first name
            return {group[0][0]}
    return keep


class _KeepStrides(TorchFunctionMode):
    """`contiguous()` returns its input unchanged: transformers' reverse ops copy each chunk to
    make it contiguous, which would turn every expert slice into a copy. The values are the same;
    the bucket packing copies each tensor once anyway."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return args[0] if func is torch.Tensor.contiguous else func(*args, **(kwargs or {}))


def _group(converter: Any, layer_name: str, model: Any) -> Group:
    """A group whose `run` applies `converter` (a fresh copy per run, as `save_pretrained` gives
    each target key its own) to its members' values."""
    group = Group(layer_name, [], lambda values: {})

    def run(values: dict[Source, torch.Tensor]) -> dict[str, torch.Tensor]:
        conv = copy.deepcopy(converter)
        for key, pattern, src in group.members:
            conv.add_tensor(layer_name, key, pattern, values[src])
        with torch.no_grad():
            out = conv.convert(layer_name, model=model, config=model.config)
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    group.run = run
    return group


def checkpoint_outputs(model: Any, sources: list[Source]) -> list[Output]:
    """The checkpoint tensors `save_pretrained` would write for these sources, in the sources'
    order (a converted group sits where its first member was)."""
    found = conversions(model)
    if not found:
        return [identity(s) for s in sources]
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                 rename_source_key)
    reverse = [t.reverse_transform() for t in found[::-1]]   # sub-models' conversions first
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    renamed = {}       # in the order save_pretrained renames in: some renamings keep state
    for name in sorted((s.name for s in sources), key=dot_natural_key):
        renamed[name] = rename_source_key(name, renamings, converters, reverse=True)
    slots: list[Output | Group] = []
    groups: dict[str, Group] = {}
    for s in sources:
        key, pattern = renamed[s.name]
        if pattern is None:
            slots.append(identity(s, key))
            continue
        group = groups.get(key)
        if group is None:
            group = groups[key] = _group(by_pattern[pattern], key, model)
            slots.append(group)
        group.members.append((s.name, pattern, s))
    for group in groups.values():       # save_pretrained hands a converter its tensors in this order
        group.members.sort(key=lambda m: dot_natural_key(m[0]))
    return [o for slot in slots for o in (trace(slot) if isinstance(slot, Group) else [slot])]


def trace(group: Group) -> list[Output]:
    """Run the group's conversion on meta tensors: each result that is a view of one source
    becomes a strided slice of it; anything else is computed from the group when needed."""
    metas = {s: s.meta() for _, _, s in group.members}
    owner = {id(m): s for s, m in metas.items()}
    error: Exception | None = None
    for mode in (_KeepStrides, nullcontext):
        try:
            with mode():
                result = group.run(metas)
            break
        except Exception as e:  # noqa: BLE001 - retried without the mode, then reported
            error = e
    else:
        raise ValueError(f"transformers' conversion of {group.layer_name!r} cannot be planned "
                         f"({type(error).__name__}: {error}); set the exporter option "
                         f"checkpoint_layout: false and pass a name_map") from error
    outs = []
    for name, t in result.items():
        base = t if id(t) in owner else t._base  # noqa: SLF001
        src = owner.get(id(base)) if base is not None else None
        shape = tuple(t.shape)
        if src is None or t.dtype != src.dtype:
            outs.append(Output(name, shape, t.dtype, group=group, key=name))
        elif shape == src.shape and tuple(t.stride()) == src.strides and t.storage_offset() == 0:
            outs.append(identity(src, name))
        else:
            offset = cast(int, t.storage_offset())      # a SymInt only while tracing
            outs.append(Output(name, shape, t.dtype, src, tuple(t.stride()), offset))
    return outs
