"""Per-tensor delta coding, lossless. Works on the tensors' bit patterns (an integer view of the
same width), so bf16, fp16, fp32 and fp8 round-trip bit for bit and NaNs are no special case.

Three kinds per tensor:
  full    the new tensor itself (under its own name, so a full shard is a loadable checkpoint)
  sparse  positions (int32, or int64 past 2**31 elements) + new values
  xor     zstd(new XOR base), for denser changes where runs of zeros compress better

This module is the library call that applies a delta (issue item 4): the encoding's decode on an
engine, and the pull agent on a rollout host, both go through `apply_entry`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import zstandard

from weightsync.bucket import dtype_name
from weightsync.errors import PayloadError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
IDX_SEP = "::"


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a contiguous CPU tensor's bytes (no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()])


def keys(name: str, kind: str) -> list[str]:
    """Names of the arrays a tensor's entry occupies in a payload body."""
    if kind == "full":
        return [name]
    if kind == "sparse":
        return [name + IDX_SEP + "idx", name + IDX_SEP + "val"]
    if kind == "xor":
        return [name + IDX_SEP + "xor"]
    raise PayloadError(f"tensor {name!r}: unknown delta kind {kind!r}")


@dataclass
class Encoded:
    entry: dict[str, Any]                       # JSON: kind, changed, numel, ...
    arrays: list[tuple[str, torch.Tensor]]      # what goes into the payload body
    changed: int
    idx: torch.Tensor | None = None             # int64 changed positions (None: all / unknown)


def encode_tensor(name: str, new: torch.Tensor, base: torch.Tensor | None, *,
                  density_threshold: float, zstd_level: int, xor_min_density: float,
                  force_full: bool = False) -> Encoded:
    """Pick the cheapest lossless form of `new` given `base` (the receiver's current tensor)."""
    new = new.detach().cpu().contiguous()
    numel = new.numel()
    full_bytes = numel * new.element_size()
    if base is None or tuple(base.shape) != tuple(new.shape) or base.dtype != new.dtype:
        return Encoded({"kind": "full", "changed": numel}, [(name, new)], numel)
    nb, bb = bits(new), bits(base)
    limit = -1 if force_full else int(density_threshold * numel)
    idx, changed = changed_positions(nb, bb, limit)
    if idx is None or numel == 0:
        return Encoded({"kind": "full", "changed": changed}, [(name, new)], changed, None)
    idx_dtype = torch.int32 if numel < 2**31 else torch.int64
    sparse_bytes = changed * (new.element_size() + (4 if idx_dtype == torch.int32 else 8))
    best = "sparse"
    best_bytes = sparse_bytes
    z = None
    if changed and changed >= xor_min_density * numel \
            and _xor_estimate(nb, bb, zstd_level) < 0.9 * best_bytes:
        x = torch.bitwise_xor(nb, bb)
        z = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True).compress(
            memoryview(x.numpy()).cast("B"))
        del x
        if len(z) < best_bytes:
            best, best_bytes = "xor", len(z)
    if full_bytes <= best_bytes:
        return Encoded({"kind": "full", "changed": changed}, [(name, new)], changed, idx)
    if best == "xor":
        assert z is not None
        zt = torch.frombuffer(bytearray(z), dtype=torch.uint8)
        return Encoded({"kind": "xor", "changed": changed}, [(keys(name, "xor")[0], zt)], changed, idx)
    i_key, v_key = keys(name, "sparse")
    idx_np = idx.numpy()
    vals = torch.from_numpy(nb.numpy()[idx_np]).view(new.dtype)        # numpy: faster gathers
    return Encoded({"kind": "sparse", "changed": changed},
                   [(i_key, torch.from_numpy(idx_np.astype(np.int32 if idx_dtype == torch.int32
                                                           else np.int64))), (v_key, vals)],
                   changed, idx)


_CHUNK = 1 << 20


def changed_positions(nb: torch.Tensor, bb: torch.Tensor, limit: int = -1
                      ) -> tuple[torch.Tensor | None, int]:
    """(ascending int64 positions where two integer views differ, how many). Chunked, so the
    mask stays in cache instead of making a model-sized bool tensor (numpy's flatnonzero is
    several times faster than torch's nonzero here). Past `limit` changes (-1: none) it only
    counts and returns no positions (the tensor ships whole)."""
    a, b = nb.numpy(), bb.numpy()
    numel = a.size
    parts: list[np.ndarray] = []
    count = 0
    for s in range(0, max(numel, 1), _CHUNK):
        mask = a[s: s + _CHUNK] != b[s: s + _CHUNK]
        if limit >= 0 and count <= limit:
            p = np.flatnonzero(mask)
            count += p.size
            if p.size:
                parts.append(p + s)
        else:
            count += int(np.count_nonzero(mask))
    if limit >= 0 and count <= limit:
        idx = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return torch.from_numpy(idx.astype(np.int64, copy=False)), count
    return None, count


def _xor_estimate(nb: torch.Tensor, bb: torch.Tensor, level: int) -> float:
    """Compressed size of new XOR base, from 8 evenly spaced slices of a large tensor (so the
    full compression only runs where it is likely to win)."""
    numel = nb.numel()
    cz = zstandard.ZstdCompressor(level=level)
    if numel <= 8 * (1 << 16):
        x = torch.bitwise_xor(nb, bb)
        return len(cz.compress(memoryview(x.numpy()).cast("B")))
    span = max(1 << 16, numel // 64)
    total = 0
    for k in range(8):
        s = (numel - span) * k // 7
        x = torch.bitwise_xor(nb[s: s + span], bb[s: s + span])
        total += len(cz.compress(memoryview(x.numpy()).cast("B")))
    return total * numel / (8 * span)


def sparse_parts(name: str, arrays: Mapping[str, torch.Tensor], dtype: str,
                 shape: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse entry's (int64 positions, strictly ascending and in range; values as integer
    bits), validated so a corrupt payload cannot write out of place."""
    i_key, v_key = keys(name, "sparse")
    try:
        idx, vals = arrays[i_key], arrays[v_key]
    except KeyError as e:
        raise PayloadError(f"tensor {name!r}: array {e} is missing from the payload") from None
    numel = 1
    for d in shape:
        numel *= int(d)
    if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1 or vals.dim() != 1 \
            or vals.numel() != idx.numel() or dtype_name(vals.dtype) != dtype:
        raise PayloadError(f"tensor {name!r}: malformed sparse delta (positions "
                           f"{dtype_name(idx.dtype)} {list(idx.shape)}, values "
                           f"{dtype_name(vals.dtype)} {list(vals.shape)})")
    idx = idx.to(torch.int64)
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= numel
                        or not bool((idx[1:] > idx[:-1]).all())):
        raise PayloadError(f"tensor {name!r}: sparse delta positions are out of range 0..{numel - 1} "
                           f"or not ascending; the payload is corrupted")
    return idx, bits(vals)


def check_like(name: str, t: torch.Tensor, dtype: str, shape: list[int] | tuple[int, ...]) -> None:
    if dtype_name(t.dtype) != dtype or list(t.shape) != list(shape):
        raise PayloadError(f"tensor {name!r}: payload holds {dtype_name(t.dtype)} {list(t.shape)}, "
                           f"the manifest says {dtype} {list(shape)}; the payload is corrupted")


def apply_entry(name: str, entry: Mapping[str, Any], arrays: Mapping[str, torch.Tensor],
                base: torch.Tensor | None, dtype: str, shape: list[int] | tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rebuild the new tensor from its entry and `base`. Returns (new, changed positions int64,
    their new values) — positions/values are None for a full tensor. Never modifies `base`."""
    kind = entry.get("kind")
    try:
        ks = keys(name, str(kind))
        parts = [arrays[k] for k in ks]
    except KeyError as e:
        raise PayloadError(f"tensor {name!r}: array {e} is missing from the payload") from None
    numel = 1
    for d in shape:
        numel *= int(d)
    if kind == "full":
        t = parts[0]
        check_like(name, t, dtype, shape)
        return t, None, None
    if base is None:
        raise PayloadError(f"tensor {name!r}: a {kind} delta needs the current tensor, which the "
                           f"receiver does not have")
    check_like(name, base, dtype, shape)
    bb = bits(base)
    if kind == "sparse":
        idx, vb = sparse_parts(name, arrays, dtype, shape)
        out = bb.clone()
        out.numpy()[idx.numpy()] = vb.numpy()
        return out.view(base.dtype).reshape(tuple(shape)), idx, vb
    if kind == "xor":
        z = parts[0]
        nbytes = numel * base.element_size()
        try:
            raw = zstandard.ZstdDecompressor().decompress(memoryview(z.contiguous().numpy()).cast("B"),
                                                          max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise PayloadError(f"tensor {name!r}: xor delta does not decompress ({e}); the payload "
                               f"is corrupted") from None
        if len(raw) != nbytes:
            raise PayloadError(f"tensor {name!r}: xor delta holds {len(raw)} bytes, expected {nbytes}")
        x = np.frombuffer(raw, dtype=bb.numpy().dtype)                # no copy: only read
        out_np = np.bitwise_xor(bb.numpy(), x)
        parts = [p + s for s in range(0, x.size, _CHUNK) if (p := np.flatnonzero(x[s: s + _CHUNK])).size]
        idx_np = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        out = torch.from_numpy(out_np)
        return out.view(base.dtype).reshape(tuple(shape)), torch.from_numpy(idx_np.astype(np.int64)), \
            torch.from_numpy(out_np[idx_np])
    raise PayloadError(f"tensor {name!r}: unknown delta kind {kind!r}")
