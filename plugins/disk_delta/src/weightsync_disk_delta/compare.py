"""Where two integer views of a tensor differ, in numpy (the compiled kernels' fallback, and the
read of a tensor's nonzero positions when a delta is applied). Its own module so that `kernels`
and `codec` both use it without importing each other."""

from __future__ import annotations

import numpy as np
import torch

_WORDS = 1 << 16
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def changed_positions(nb: torch.Tensor, bb: torch.Tensor | None, limit: int = -1
                      ) -> tuple[torch.Tensor | None, int]:
    """(ascending int64 positions where two integer views differ (`bb` None: where `nb` is not
    zero), how many). Past `limit` changes (-1: at once) it only counts and returns no positions
    (the tensor ships whole).

    Compares 8-byte words in cache-sized chunks, then splits only the words that differ into
    elements: numpy's nonzero costs per element scanned, so scanning words instead of bf16
    elements is 4x fewer steps, and the mask never grows to the size of the model. The last
    few elements that do not fill a word are compared one by one."""
    a = nb.numpy()
    b = bb.numpy() if bb is not None else None
    size = a.itemsize
    lanes = 8 // size
    body = a.size - a.size % lanes
    wa = a[:body].view(np.int64)
    wb = b[:body].view(np.int64) if b is not None else None
    shift = lanes.bit_length() - 1
    lane_t = _UINT_OF_SIZE[size]
    mask = np.empty(min(_WORDS, wa.size), dtype=bool)
    parts: list[np.ndarray] = []
    count = 0
    for s in range(0, wa.size, _WORDS):
        e = min(s + _WORDS, wa.size)
        if limit < 0 or count > limit:            # ships whole: only count what is left
            count += int(np.count_nonzero(a[s * lanes: e * lanes] != (0 if b is None else
                                                                        b[s * lanes: e * lanes])))
            continue
        m = mask[: e - s]
        np.not_equal(wa[s:e], 0 if wb is None else wb[s:e], out=m)
        w = np.flatnonzero(m)
        if not w.size:
            continue
        x = wa[s:e][w] if wb is None else np.bitwise_xor(wa[s:e][w], wb[s:e][w])
        k = np.flatnonzero(x.view(lane_t) != 0)
        count += k.size
        parts.append(((w[k >> shift] + s) << shift) | (k & (lanes - 1)))
    tail = np.flatnonzero(a[body:] != (0 if b is None else b[body:])) + body
    count += tail.size
    if limit < 0 or count > limit:
        return None, count
    idx = np.concatenate([*parts, tail])
    return torch.from_numpy(idx.astype(np.int64, copy=False)), count
