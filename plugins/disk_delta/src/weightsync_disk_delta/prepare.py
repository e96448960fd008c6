"""From a published version's checked arrays to what the host writes: the changes of a delta
(positions decoded and bounded by the local tensor's size, not the manifest's) and the digests
of a full version's tensors (checked before anything is written)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from weightsync.wire.bucket import tensor_digest
from weightsync.errors import PayloadError
from weightsync.wire.pool import map_threads

from .change import Change
from .codec import IDX_SEP, apply_entry, entry_changes
from .positions import arrays_of
from .schema import Manifest, numel_of


def check_like_local(m: Manifest, tensors: Mapping[str, Mapping[str, Any]]) -> None:
    """Every tensor a delta names is in `tensors` with the same dtype and shape."""
    for name, t in m.tensors.items():
        info = tensors.get(name)
        if info is None:
            raise PayloadError(f"version {m.version} names tensor {name!r}, which the local "
                               f"checkpoint does not have")
        if info["dtype"] != t.dtype or list(info["shape"]) != t.shape:
            raise PayloadError(f"version {m.version}: tensor {name!r} is {t.dtype} {t.shape} in "
                               f"the manifest, but {info['dtype']} {list(info['shape'])} in the "
                               f"local checkpoint; a delta cannot change a tensor's dtype or shape "
                               f"(publish a full version for that)")


def delta_changes(m: Manifest, arrays: Mapping[str, torch.Tensor],
                  tensors: Mapping[str, Mapping[str, Any]],
                  read: Callable[[Mapping[str, Any]], torch.Tensor]) -> dict[str, Change]:
    """name -> Change of every tensor the delta changes; `read(info)` gives a local tensor
    (only the xor form needs it). Validated against the local dtypes and shapes."""
    check_like_local(m, tensors)

    def one(item: tuple[str, Any]) -> Change:
        name, t = item
        info = tensors[name]
        shape = list(info["shape"])
        idx, vals = entry_changes(name, t.coding(), arrays, lambda: read(info), info["dtype"], shape)
        if idx is not None and idx.numel() == 0 and t.digest != info["digest"]:
            raise PayloadError(f"version {m.version}: tensor {name!r} is unchanged, but its digest "
                               f"differs from the local one; the manifest is corrupted")
        stored = None
        if idx is not None and t.kind == "sparse":          # journal the delta's own form
            stored = (t.pos, {k: arrays[name + IDX_SEP + k] for k in arrays_of(t.pos)})
        return Change.of(idx, vals, numel_of(shape), stored)

    items = list(m.tensors.items())
    return {name: c for (name, _), c in zip(items, map_threads(one, items))
            if c.idx is None or c.idx.numel()}


def full_digests(m: Manifest, arrays: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> digest of a full version's tensors, each checked on the bytes read."""
    def check(item: tuple[str, Any]) -> str:
        name, t = item
        new, _, _ = apply_entry(name, t.coding(), arrays, None, t.dtype, t.shape)
        if tensor_digest(name, new) != t.digest:
            raise PayloadError(f"version {m.version}: tensor {name!r} does not match its digest; "
                               f"the version was not installed")
        return t.digest
    items = list(m.tensors.items())
    return dict(zip((n for n, _ in items), map_threads(check, items)))
