"""Per-tensor delta coding, lossless. Works on the tensors' bit patterns (an integer view of the
same width), so bf16, fp16, fp32 and fp8 round-trip bit for bit and NaNs are no special case.

Three kinds per tensor:
  full    the new tensor itself (under its own name, so a full shard is a loadable checkpoint)
  sparse  positions (as gaps of 1 or 2 bytes where that is smaller, see positions.py) + new values
  xor     zstd(new XOR base), for denser changes where runs of zeros compress better

This module is the library call that applies a delta (issue item 4): the encoding's decode on an
engine goes through `apply_entry`, the pull agent on a rollout host through `entry_changes`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import zstandard

from weightsync.wire.bucket import dtype_name, tensor_digest, tensor_header
from weightsync.errors import PayloadError

from . import kernels, positions
from .compare import changed_positions
from weightsync.wire.digests import Digest

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
IDX_SEP = "::"


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a contiguous CPU tensor's bytes (no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()])


def keys(name: str, kind: str, pos: str = "idx") -> list[str]:
    """Names of the arrays a tensor's entry occupies in a payload body (`pos`: how a sparse
    entry stores its positions, see positions.py)."""
    if kind == "full":
        return [name]
    if kind == "sparse":
        return [name + IDX_SEP + s for s in positions.arrays_of(pos)] + [name + IDX_SEP + "val"]
    if kind == "xor":
        return [name + IDX_SEP + "xor"]
    raise PayloadError(f"tensor {name!r}: unknown delta kind {kind!r}")


@dataclass
class Encoded:
    entry: dict[str, Any]                       # JSON: kind, changed, numel, ...
    arrays: list[tuple[str, torch.Tensor]]      # what goes into the payload body
    changed: int
    digest: str                                 # the new tensor's (weightsync.wire.bucket.tensor_digest)
    idx: torch.Tensor | None = None             # int64 changed positions (None: all / unknown)
    vals: torch.Tensor | None = None            # their new values, as integer bits


def encode_tensor(name: str, new: torch.Tensor, base: torch.Tensor | None, *,
                  density_threshold: float, zstd_level: int, xor_min_density: float,
                  xor_max_ratio: float = 0.7, force_full: bool = False) -> Encoded:
    """Pick the cheapest lossless form of `new` given `base` (the receiver's current tensor).
    The compare and the digest of `new` share one pass over its bytes (kernels.scan)."""
    new = new.detach().cpu().contiguous()
    numel = new.numel()
    full_bytes = numel * new.element_size()
    if base is None or tuple(base.shape) != tuple(new.shape) or base.dtype != new.dtype:
        return Encoded({"kind": "full", "changed": numel}, [(name, new)], numel, tensor_digest(name, new))
    nb, bb = bits(new), bits(base)
    hasher = Digest(tensor_header(name, new))
    found = kernels.scan(nb, bb, -1 if force_full else int(density_threshold * numel), hasher)
    idx, vals, changed, digest = found.idx, found.vals, found.count, hasher.hexdigest()
    if idx is None or vals is None or numel == 0:
        return Encoded({"kind": "full", "changed": changed}, [(name, new)], changed, digest)
    pos, pos_arrays = positions.encode(idx, numel, (found.over8, found.over16))
    sparse_bytes = changed * new.element_size() + sum(a.numel() * a.element_size()
                                                      for a in pos_arrays.values())
    best = "sparse"
    best_bytes = sparse_bytes
    z = None
    if changed and changed >= xor_min_density * numel \
            and _xor_estimate(nb, bb, zstd_level) < xor_max_ratio * best_bytes:
        x = torch.bitwise_xor(nb, bb)
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        z = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True).compress(
            memoryview(x.numpy()).cast("B"))  # type: ignore[arg-type]
        del x
        if len(z) < xor_max_ratio * best_bytes:
            best, best_bytes = "xor", len(z)
    if full_bytes <= best_bytes:
        return Encoded({"kind": "full", "changed": changed}, [(name, new)], changed, digest, idx, vals)
    if best == "xor":
        assert z is not None
        zt = torch.frombuffer(bytearray(z), dtype=torch.uint8)
        return Encoded({"kind": "xor", "changed": changed}, [(keys(name, "xor")[0], zt)], changed,
                       digest, idx, vals)
    arrays = [(name + IDX_SEP + k, a) for k, a in pos_arrays.items()]
    arrays.append((name + IDX_SEP + "val", vals.view(new.dtype)))
    return Encoded({"kind": "sparse", "changed": changed, "pos": pos}, arrays, changed, digest, idx, vals)


def _xor_estimate(nb: torch.Tensor, bb: torch.Tensor, level: int) -> float:
    """Compressed size of new XOR base, from 8 evenly spaced slices of a large tensor (so the
    full compression only runs where it is likely to win)."""
    numel = nb.numel()
    cz = zstandard.ZstdCompressor(level=level)
    if numel <= 8 * (1 << 16):
        x = torch.bitwise_xor(nb, bb)
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        return len(cz.compress(memoryview(x.numpy()).cast("B")))  # type: ignore[arg-type]
    span = max(1 << 16, numel // 64)
    total = 0
    for k in range(8):
        s = (numel - span) * k // 7
        x = torch.bitwise_xor(nb[s: s + span], bb[s: s + span])
        total += len(cz.compress(memoryview(x.numpy()).cast("B")))  # type: ignore[arg-type]
    return total * numel / (8 * span)


def sparse_parts(name: str, entry: Mapping[str, Any], arrays: Mapping[str, torch.Tensor], dtype: str,
                 shape: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse entry's (int64 positions, strictly ascending and in range; values as integer
    bits), validated so a corrupt payload cannot write out of place."""
    pos = str(entry.get("pos", "idx"))
    ks = keys(name, "sparse", pos)
    try:
        parts = {k.rpartition(IDX_SEP)[2]: arrays[k] for k in ks}
    except KeyError as e:
        raise PayloadError(f"tensor {name!r}: array {e} is missing from the payload") from None
    vals = parts.pop("val")
    numel = 1
    for d in shape:
        numel *= int(d)
    if vals.dim() != 1 or dtype_name(vals.dtype) != dtype:
        raise PayloadError(f"tensor {name!r}: malformed sparse delta (values "
                           f"{dtype_name(vals.dtype)} {list(vals.shape)}, expected {dtype})")
    idx = positions.decode(name, pos, parts, vals.numel(), numel)
    return idx, bits(vals)


def check_like(name: str, t: torch.Tensor, dtype: str, shape: list[int] | tuple[int, ...]) -> None:
    if dtype_name(t.dtype) != dtype or list(t.shape) != list(shape):
        raise PayloadError(f"tensor {name!r}: payload holds {dtype_name(t.dtype)} {list(t.shape)}, "
                           f"the manifest says {dtype} {list(shape)}; the payload is corrupted")


def entry_changes(name: str, entry: Mapping[str, Any], arrays: Mapping[str, torch.Tensor],
                  base: Callable[[], torch.Tensor] | None, dtype: str, shape: list[int] | tuple[int, ...]
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What an entry changes: (int64 positions, their new values as integer bits), or (None,
    the whole new tensor) for a full entry. `base()` gives the current tensor; only the xor form
    reads it. Validated, so a corrupt payload cannot write out of place."""
    kind = entry.get("kind")
    if kind == "sparse":
        return sparse_parts(name, entry, arrays, dtype, shape)
    try:
        parts = [arrays[k] for k in keys(name, str(kind))]
    except KeyError as e:
        raise PayloadError(f"tensor {name!r}: array {e} is missing from the payload") from None
    if kind == "full":
        check_like(name, parts[0], dtype, shape)
        return None, parts[0]
    if base is None:
        raise PayloadError(f"tensor {name!r}: a {kind} delta needs the current tensor, which the "
                           f"receiver does not have")
    if parts[0].dtype != torch.uint8 or parts[0].dim() != 1:
        raise PayloadError(f"tensor {name!r}: malformed xor delta ({parts[0].dtype} "
                           f"{list(parts[0].shape)}, expected uint8 bytes)")
    cur = base()
    check_like(name, cur, dtype, shape)
    bb = bits(cur)
    nbytes = bb.numel() * bb.element_size()
    try:
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        raw = zstandard.ZstdDecompressor().decompress(
            memoryview(parts[0].contiguous().numpy()).cast("B"),  # type: ignore[arg-type]
            max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise PayloadError(f"tensor {name!r}: xor delta does not decompress ({e}); the payload "
                           f"is corrupted") from None
    if len(raw) != nbytes:
        raise PayloadError(f"tensor {name!r}: xor delta holds {len(raw)} bytes, expected {nbytes}")
    with warnings.catch_warnings():               # read-only bytes: only read below
        warnings.simplefilter("ignore", UserWarning)
        x = torch.frombuffer(raw, dtype=bb.dtype) if nbytes else bb.new_empty(0)
    idx, _ = changed_positions(x, None, bb.numel())
    assert idx is not None
    return idx, torch.bitwise_xor(torch.take(bb, idx), torch.take(x, idx))


def apply_entry(name: str, entry: Mapping[str, Any], arrays: Mapping[str, torch.Tensor],
                base: torch.Tensor | None, dtype: str, shape: list[int] | tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rebuild the new tensor from its entry and `base`. Returns (new, changed positions int64,
    their new values) — positions/values are None for a full tensor. Never modifies `base`."""
    if entry.get("kind") != "full" and base is not None:
        check_like(name, base, dtype, shape)
    idx, vals = entry_changes(name, entry, arrays, None if base is None else (lambda: base),
                              dtype, shape)
    if idx is None:
        return vals, None, None
    if base is None:
        raise PayloadError(f"tensor {name!r}: a {entry.get('kind')} delta needs the current tensor, "
                           f"which the receiver does not have")
    out = bits(base).clone()
    kernels.put(out, idx, vals)
    return out.view(base.dtype).reshape(tuple(shape)), idx, vals
