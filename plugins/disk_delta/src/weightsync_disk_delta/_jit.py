"""numba versions of the loops in kernels.py: one pass over the bytes where numpy needs several
(compare, collect, split into elements, gather). Imported only through kernels.py, and only when
numba is installed. Compiled once per dtype and cached next to this file.

Every kernel trusts its indices (no bounds checks): callers pass positions they found themselves
or that were validated (ascending, inside the tensor) first."""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros
from weightsync.wire.jit import hash_into, prefetch  # shared with core's copy + digest loop

# nogil: a bucket's tensors run on every core at once (weightsync.wire.pool.map_threads)
_JIT = {"nogil": True, "cache": True, "boundscheck": False}
_U = np.uint64
_AHEAD = 512                   # words (4 KiB) the compare prefetches ahead of itself


@numba.njit(inline="always")
def _lanes(wa, wb, i, pos, vals, count, room, lanes, width, mask):  # type: ignore[no-untyped-def]
    """Record the elements that differ inside word i; returns the new count. Branch-free: every
    lane is written and the count moves by the lanes that differ (which lane differs is random,
    so a branch per lane mispredicts about once per change: 1.15x). Needs `lanes` slots of slack
    past `room` in pos/vals; past `room` it only counts."""
    w = wa[i]
    x = w ^ wb[i]
    if count < room:
        for lane in range(lanes):
            pos[count] = i * lanes + lane
            vals[count] = (w >> (width * lane)) & mask
            count += ((x >> (width * lane)) & mask) != 0
    else:
        for lane in range(lanes):
            count += ((x >> (width * lane)) & mask) != 0
    return count


@numba.njit(inline="always")
def _words(wa, wb, s, e, pos, vals, st, lanes, width, mask):  # type: ignore[no-untyped-def]
    """The loop of `scan` for one element width, inlined with literal lanes/width/mask so the
    lane loop unrolls and the shifts are constants (1.5x). Words are compared 64 at a time into
    a bit mask, a loop the compiler vectorizes; only the set bits are visited (1.35x more).
    Both versions are prefetched 4 KiB ahead: visiting the changes mispredicts branches, which
    would otherwise stall the stream from memory (1.25x)."""
    count = st[0]
    room = pos.size - lanes
    pa, pb = wa.ctypes.data, wb.ctypes.data
    ahead = wa.size - _AHEAD - 64
    i = s
    while i + 64 <= e:
        if i <= ahead:
            for q in range(0, 64, 8):                    # one 64-byte line of each per step
                prefetch(pa + (i + _AHEAD + q) * 8)
                prefetch(pb + (i + _AHEAD + q) * 8)
        bits = _U(0)
        for k in range(64):
            bits |= _U(wa[i + k] != wb[i + k]) << _U(k)
        while bits != _U(0):
            count = _lanes(wa, wb, i + trailing_zeros(bits), pos, vals, count, room, lanes, width,
                           mask)
            bits &= bits - _U(1)
        i += 64
    for j in range(i, e):
        if wa[j] != wb[j]:
            count = _lanes(wa, wb, j, pos, vals, count, room, lanes, width, mask)
    st[0] = count


@numba.njit(**_JIT)
def scan(wa, wb, size, s, e, pos, vals, st):  # type: ignore[no-untyped-def]
    """Words s..e of wa/wb (8-byte views of two tensors of `size`-byte elements): record the
    position and new value (its bits, cast into `vals`) of every element that differs, while
    `pos` has room (pos/vals carry 8 // size slots of slack past it); count them all in st[0]
    (carried across calls)."""
    _scan(wa, wb, size, s, e, pos, vals, st)


@numba.njit(**_JIT)
def scan_fed(wa, wb, size, pos, vals, st, fn, state, step):  # type: ignore[no-untyped-def]
    """`scan` over all words, feeding wa's bytes to the C hash state every `step` words, while
    they are still in cache."""
    n = wa.size
    base = wa.ctypes.data
    for s in range(0, n, step):
        e = min(s + step, n)
        _scan(wa, wb, size, s, e, pos, vals, st)
        hash_into(fn, state, base + s * 8, (e - s) * 8)


@numba.njit(inline="always")
def _scan(wa, wb, size, s, e, pos, vals, st):  # type: ignore[no-untyped-def]
    if size == 2:
        _words(wa, wb, s, e, pos, vals, st, 4, 16, 0xFFFF)
    elif size == 4:
        _words(wa, wb, s, e, pos, vals, st, 2, 32, 0xFFFFFFFF)
    elif size == 1:
        _words(wa, wb, s, e, pos, vals, st, 8, 8, 0xFF)
    else:
        _words(wa, wb, s, e, pos, vals, st, 1, 0, -1)


@numba.njit(**_JIT)
def scan_tail(a, b, start, pos, vals, st):  # type: ignore[no-untyped-def]
    """The elements from `start` on that do not fill a whole word, one by one."""
    count = st[0]
    for j in range(start, a.size):
        if a[j] != b[j]:
            if count < pos.size:
                pos[count] = j
                vals[count] = a[j]
            count += 1
    st[0] = count


@numba.njit(**_JIT)
def gap_counts(pos):  # type: ignore[no-untyped-def]
    """How many gaps between ascending positions (the first from -1) exceed 255 and 65535:
    they pick the positions' form. A separate pass over the positions, not part of scan's loop,
    which it would slow by about 6 %."""
    last = -1
    over8 = 0
    over16 = 0
    for k in range(pos.size):
        g = pos[k] - last
        last = pos[k]
        over8 += g > 255
        over16 += g > 65535
    return over8, over16


@numba.njit(**_JIT)
def gaps(pos, top, small, far):  # type: ignore[no-untyped-def]
    """Ascending positions as gaps from the previous one (the first from -1); a gap above `top`
    is stored as 0 in `small` and its value appended to `far`. Returns how many went to far."""
    last = -1
    f = 0
    for k in range(pos.size):
        g = pos[k] - last
        last = pos[k]
        if g > top:
            small[k] = 0
            far[f] = g
            f += 1
        else:
            small[k] = g
    return f


@numba.njit(**_JIT)
def ungap(small, far, out, numel):  # type: ignore[no-untyped-def]
    """The inverse of gaps, checked: False when the zeros in `small` and the entries of `far`
    do not pair up one to one, a far gap is below 1 or above `numel`, or a position reaches
    `numel` (so the running position never overflows and never leaves the tensor)."""
    f = 0
    p = -1
    for k in range(small.size):
        g = small[k]
        if g == 0:
            if f >= far.size or far[f] < 1 or far[f] > numel:
                return False
            p += far[f]
            f += 1
        else:
            p += g
        if p >= numel:
            return False
        out[k] = p
    return f == far.size


@numba.njit(**_JIT)
def swap(region, idx, vals, old, k0, k1):  # type: ignore[no-untyped-def]
    """Changes k0..k1: keep the current value in `old`, write the new one."""
    for k in range(k0, k1):
        p = idx[k]
        old[k] = region[p]
        region[p] = vals[k]


@numba.njit(**_JIT)
def swap_fed(region, idx, vals, old, fn, state, step):  # type: ignore[no-untyped-def]
    """`swap` of every change, feeding the region's bytes to the C hash state every `step`
    elements, right after their changes were written. The next step is prefetched meanwhile
    (1.15x): the scattered writes would otherwise each wait for memory."""
    n = region.size
    size = region.itemsize
    base = region.ctypes.data
    k = 0
    for s in range(0, n, step):
        e = min(s + step, n)
        if e + step <= n:
            for q in range(0, step * size, 64):
                prefetch(base + e * size + q)
        while k < idx.size and idx[k] < e:
            p = idx[k]
            old[k] = region[p]
            region[p] = vals[k]
            k += 1
        hash_into(fn, state, base + s * size, (e - s) * size)


@numba.njit(**_JIT)
def put(region, idx, vals, k0, k1):  # type: ignore[no-untyped-def]
    for k in range(k0, k1):
        region[idx[k]] = vals[k]


def warm() -> None:
    """Compile (or load from the cache) the bf16/fp16 and fp32 variants before the first sync."""
    for t in (np.int16, np.int32):
        a = np.zeros(8, t)
        pos, vals = np.empty(8, np.int64), np.empty(8, t)
        st = np.zeros(1, np.int64)
        scan(a.view(np.int64), a.view(np.int64), a.itemsize, 0, 1, pos, vals, st)
        scan_fed(a[:0].view(np.int64), a[:0].view(np.int64), a.itemsize, pos, vals, st, 0, 0, 1)
        scan_tail(a, a, 0, pos, vals, st)
        gap_counts(pos)
        old = np.empty(8, t)
        swap(a, pos[:0], vals, old, 0, 0)
        swap_fed(a[:0], pos[:0], vals, old, 0, 0, 1)
        put(a, pos, vals, 0, 0)
    for u in (np.uint8, np.uint16):
        small = np.zeros(0, u)
        gaps(np.zeros(0, np.int64), 255, small, np.zeros(0, np.int32))
        ungap(small, np.zeros(0, np.int32), np.zeros(0, np.int64), 0)
