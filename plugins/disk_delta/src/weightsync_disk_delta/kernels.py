"""The hot loops of a delta: find what changed (sender), turn positions into gaps and back, write
changes into a tensor while keeping what they replace (host). With numba installed (the plugin's
`fast` extra) each is one compiled pass over the bytes, and the tensor's digest is hashed chunk
by chunk while those bytes are still in cache; without it (or with WEIGHTSYNC_JIT=0) numpy and
torch give the same results in several passes (publishing about 2x slower). Tests run both and
compare them."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
import torch

from weightsync.wire import digests as hashing

CHUNK_BYTES = 1 << 20          # hashed per step through a Python hash object (the fallback)
FED_BYTES = 8 << 10            # hashed per step by the compiled loops (hashing.Digest): in L1

JIT = os.environ.get("WEIGHTSYNC_JIT", "1") != "0"
_jit: Any = None


def jit() -> Any:
    """The compiled kernels, or None when numba is missing or switched off."""
    global _jit, JIT
    if not JIT:
        return None
    if _jit is None:
        try:
            from . import _jit as mod
        except ImportError:          # numba missing, or not built for this Python yet
            JIT = False
            return None
        _jit = mod
    return _jit


_warmed = False


def warm() -> None:
    """Compile or load the kernels now, not inside the first sync that needs them (once per
    process)."""
    global _warmed
    k = jit()
    if k is not None and not _warmed:
        k.warm()
        _warmed = True


def _plain(a: np.ndarray) -> np.ndarray:
    """A writable, aligned array (a small copy at most): payload views are read-only and may be
    unaligned, and each such variant would be one more compiled signature."""
    return a if a.flags.writeable and a.flags.aligned and a.flags.c_contiguous else a.copy()


def _feed(hasher: Any, flat: np.ndarray, s: int, e: int) -> None:
    """Hash elements s..e of a flat array (the next chunk of the tensor's bytes)."""
    # numpy's stubs give ndarray __buffer__ only on Python 3.12+
    hasher.update(memoryview(flat[s:e]).cast("B"))  # type: ignore[arg-type]


def _fed(hasher: Any) -> int:
    """The C hash state the compiled loops can feed (hashing.Digest), else 0."""
    return getattr(hasher, "address", None) or 0


class Scan(NamedTuple):
    # a field named like tuple.count (a public name, kept): typeshed's method clashes with it
    count: int  # type: ignore[assignment]  # elements that differ
    idx: torch.Tensor | None            # their int64 positions (None: more than the limit)
    vals: torch.Tensor | None           # their new values (integer bits)
    over8: int                          # gaps between positions above 255 (0 without idx)
    over16: int                         # ... above 65535


def scan(nb: torch.Tensor, bb: torch.Tensor, limit: int, hasher: Any = None) -> Scan:
    """Where the integer views `nb` (new) and `bb` (base) differ, with the new values, while at
    most `limit` differ (-1: only count). `hasher` (a hashing.Digest, or any object with
    `update`) is fed nb's bytes."""
    a, b = nb.numpy(), bb.numpy()
    k = jit()
    if k is None:
        return _scan_numpy(nb, bb, limit, hasher)
    lanes = 8 // a.itemsize
    body = a.size - a.size % lanes
    wa, wb = a[:body].view(np.int64), b[:body].view(np.int64)
    cap = max(limit, 0) + lanes             # slack: the kernel writes a word's lanes unconditionally
    pos, vals = np.empty(cap, np.int64), np.empty(cap, a.dtype)
    st = np.zeros(1, np.int64)
    if _fed(hasher):
        k.scan_fed(wa, wb, a.itemsize, pos, vals, st, hashing.update_address(), _fed(hasher),
                   FED_BYTES // 8)
    else:
        step = wa.size if hasher is None else CHUNK_BYTES // 8
        for s in range(0, wa.size, max(step, 1)):
            e = min(s + step, wa.size)
            k.scan(wa, wb, a.itemsize, s, e, pos, vals, st)
            if hasher is not None:
                _feed(hasher, a, s * lanes, e * lanes)
    k.scan_tail(a, b, body, pos, vals, st)
    if hasher is not None:
        _feed(hasher, a, body, a.size)
    count = int(st[0])
    if limit < 0 or count > limit:
        return Scan(count, None, None, 0, 0)
    over8, over16 = k.gap_counts(pos[:count])
    return Scan(count, torch.from_numpy(pos[:count]), torch.from_numpy(vals[:count]),
                int(over8), int(over16))


def _scan_numpy(nb: torch.Tensor, bb: torch.Tensor, limit: int, hasher: Any) -> Scan:
    from .compare import changed_positions
    if hasher is not None:
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        hasher.update(memoryview(nb.numpy()).cast("B"))  # type: ignore[arg-type]
    idx, count = changed_positions(nb, bb, limit)
    if idx is None:
        return Scan(count, None, None, 0, 0)
    g = np.diff(idx.numpy(), prepend=-1)
    return Scan(count, idx, torch.take(nb, idx), int(np.count_nonzero(g > 255)),
                int(np.count_nonzero(g > 65535)))


def gaps(idx: np.ndarray, top: int, small_t: Any, far_t: Any, n_far: int) -> tuple[np.ndarray, np.ndarray]:
    """Ascending positions as gaps (`small_t`), a gap above `top` stored as 0 and appended to
    `far` (`far_t`, `n_far` of them)."""
    k = jit()
    if k is None:
        g = np.diff(idx, prepend=-1)
        big = g > top
        small = g.astype(small_t)
        small[big] = 0
        return small, g[big].astype(far_t)
    small, far = np.empty(idx.size, small_t), np.empty(n_far, far_t)
    k.gaps(idx, top, small, far)
    return small, far


def ungap(small: np.ndarray, far: np.ndarray, numel: int) -> np.ndarray | None:
    """int64 positions from gaps (unsigned) and escapes; None when they do not pair up, an
    escape is below 1 or above `numel`, or a position reaches `numel`."""
    k = jit()
    if k is None:
        g = small.astype(np.int64)
        holes = g == 0
        if int(np.count_nonzero(holes)) != far.size or \
                (far.size and (int(far.min()) < 1 or int(far.max()) > numel)):
            return None
        g[holes] = far
        out = np.cumsum(g)       # gaps in 1..numel, at most numel of them: no int64 overflow
        out -= 1                 # below 2**31.5 elements; above, the ascending check catches it
        if out.size and (int(out[-1]) >= numel or
                         (numel > 1 << 31 and not bool(np.all(out[1:] > out[:-1])))):
            return None
        return out
    out = np.empty(small.size, np.int64)
    return out if k.ungap(_plain(small), _plain(far), out, numel) else None


def _check_positions(region: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """The kernels trust their positions (ascending, validated by the caller); this cheap check
    of both ends makes a caller's mistake an error instead of a write outside the tensor."""
    if idx.dim() != 1 or vals.dim() != 1 or idx.numel() != vals.numel() or idx.dtype != torch.int64:
        raise ValueError(f"positions {idx.dtype} {list(idx.shape)} and values {list(vals.shape)} "
                         f"do not pair up")
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= region.numel()):
        raise ValueError(f"positions {int(idx[0])}..{int(idx[-1])} run outside a tensor of "
                         f"{region.numel()} elements")


def swap(region: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, hasher: Any = None) -> torch.Tensor:
    """Write `vals` at `idx` (validated) into the flat integer tensor `region`; returns the
    values they replaced. `hasher` is fed region's bytes after the write. Raises only before
    anything is written, so a caller that gets an error knows the region is as it was."""
    _check_positions(region, idx, vals)
    k = jit()
    if k is None:
        taken = torch.take(region, idx)
        region.index_put_((idx,), vals)
        if hasher is not None:
            # numpy's stubs give ndarray __buffer__ only on Python 3.12+
            hasher.update(memoryview(region.numpy()).cast("B"))  # type: ignore[arg-type]
        return taken
    r, i, v = region.numpy(), _plain(idx.numpy()), _plain(vals.numpy())
    old = np.empty_like(v)
    if _fed(hasher):
        k.swap_fed(r, i, v, old, hashing.update_address(), _fed(hasher), max(1, FED_BYTES // r.itemsize))
        return torch.from_numpy(old)
    if hasher is None:
        k.swap(r, i, v, old, 0, i.size)
        return torch.from_numpy(old)
    step = max(1, CHUNK_BYTES // r.itemsize)
    k0 = 0
    for s in range(0, max(r.size, 1), step):
        k1 = int(np.searchsorted(i, s + step)) if s + step < r.size else i.size
        k.swap(r, i, v, old, k0, k1)
        k0 = k1
        _feed(hasher, r, s, s + step)
    return torch.from_numpy(old)


def put(region: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """region[idx] = vals for a flat integer tensor and validated int64 positions."""
    _check_positions(region, idx, vals)
    k = jit()
    if k is None:
        region.index_put_((idx,), vals)
    else:
        i = _plain(idx.numpy())
        k.put(region.numpy(), i, _plain(vals.numpy()), 0, i.size)
