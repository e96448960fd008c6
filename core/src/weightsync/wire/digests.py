"""A tensor's xxh3-128 digest (`weightsync.wire.bucket.tensor_digest`: a header, then the bytes)
in a hash state that C code and compiled loops feed themselves, and the one-pass copy + digest
every CPU stage of a sync is made of: each chunk is hashed while in cache instead of a copy and a
second pass over the bytes. Three paths give the same digest: numba loops (`weightsync.wire.jit`,
the `fast` extra, unless WEIGHTSYNC_JIT=0) with non-temporal stores; a Python loop of `memmove`
and the C update of the xxHash library inside the `xxhash` package; or a copy, then `xxhash`."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np
import torch
import xxhash

__all__ = ["BACK_BYTES", "CHUNK_BYTES", "Digest", "FED_BYTES", "JIT", "copy_digest",
           "copy_digest_many", "digest_at", "jit", "library", "path", "update_address", "warm"]


class _H128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


_lock = threading.Lock()
_lib: Any = None
_loaded = False

FED_BYTES = 16 << 10           # hashed from the source, then copied, per step (in L1)
BACK_BYTES = 1 << 20           # copied, then hashed from the destination, per step
CHUNK_BYTES = 128 << 10        # per step of the Python loop (in L2)


def library() -> Any:
    """The xxHash C library in the `xxhash` package; None where it lacks streaming XXH3-128."""
    global _lib, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                from xxhash import _xxhash  # type: ignore[attr-defined]  # not in xxhash's stubs
                lib = ctypes.CDLL(_xxhash.__file__)
                lib.XXH3_createState.restype = ctypes.c_void_p
                lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
                lib.XXH3_128bits_reset.argtypes = [ctypes.c_void_p]
                lib.XXH3_128bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
                lib.XXH3_128bits_digest.argtypes = [ctypes.c_void_p]
                lib.XXH3_128bits_digest.restype = _H128
                _lib = lib if _agrees(lib) else None
            except (ImportError, OSError, AttributeError):
                _lib = None
        return _lib


def _agrees(lib: Any) -> bool:
    """The C functions give the package's own digest (a check, not a trust)."""
    data = bytes(range(256)) * 5
    state = lib.XXH3_createState()
    try:
        lib.XXH3_128bits_reset(state)
        lib.XXH3_128bits_update(state, data, len(data))
        d = lib.XXH3_128bits_digest(state)
        return f"{d.high64:016x}{d.low64:016x}" == xxhash.xxh3_128(data).hexdigest()
    finally:
        lib.XXH3_freeState(state)


_update: int = 0


def update_address() -> int:
    """The address of XXH3_128bits_update(state, ptr, len), for the compiled loops."""
    global _update
    if not _update:
        lib = library()
        assert lib is not None
        _update = ctypes.cast(lib.XXH3_128bits_update, ctypes.c_void_p).value or 0
    return _update


class Digest:
    """An xxh3-128 state that has taken `header`; `address`: its C state (None: Python's)."""

    def __init__(self, header: bytes, native: bool = True) -> None:
        lib = library() if native else None
        self._lib: Any = lib                # None only when self._py holds the state
        self._py: Any = None
        self.address: int | None = None
        if lib is None:
            self._py = xxhash.xxh3_128(header)
            return
        self.address = lib.XXH3_createState()
        if not self.address:
            raise MemoryError("XXH3_createState failed")
        lib.XXH3_128bits_reset(self.address)
        lib.XXH3_128bits_update(self.address, header, len(header))

    def update(self, data: Any) -> None:
        if self._py is not None:
            self._py.update(data)
            return
        a = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if a.size:
            self._lib.XXH3_128bits_update(self.address, a.ctypes.data, a.size)

    def update_at(self, address: int, nbytes: int) -> None:
        """Feed `nbytes` of memory at `address` (the caller keeps that memory alive)."""
        if nbytes <= 0:
            return
        if self._py is not None:
            self._py.update((ctypes.c_char * nbytes).from_address(address))
            return
        self._lib.XXH3_128bits_update(self.address, address, nbytes)

    def hexdigest(self) -> str:
        if self._py is not None:
            return str(self._py.hexdigest())
        d = self._lib.XXH3_128bits_digest(self.address)
        return f"{d.high64:016x}{d.low64:016x}"

    def __del__(self) -> None:
        if self.address and self._lib is not None:
            self._lib.XXH3_freeState(self.address)
            self.address = None


# -- one-pass copy + digest -------------------------------------------------------------------
JIT = os.environ.get("WEIGHTSYNC_JIT", "1") != "0"
_jit: Any = None


def jit() -> Any:
    """The compiled loops (`weightsync.wire.jit`), or None when numba is missing or switched off."""
    global _jit, JIT
    if not JIT:
        return None
    if _jit is None:
        try:
            from weightsync.wire import jit as mod
        except ImportError:          # numba missing, or not built for this Python yet
            JIT = False
            return None
        _jit = mod
    return _jit


def warm() -> None:
    """Compile or load the copy loop now, not inside the first sync that needs it."""
    k = jit()
    if k is not None:
        k.warm()


def path() -> str:
    """Which copy + digest path this process takes: "numba", "ctypes" or "two-pass"."""
    if library() is None:
        return "two-pass"
    return "numba" if jit() is not None else "ctypes"


def _flat(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def copy_digest(dst: torch.Tensor, src: torch.Tensor, header: bytes, source: bool = False) -> str:
    """Copy `src` into `dst` (same dtype and number of elements) and return the xxh3-128 digest
    of `header` followed by the bytes copied (`tensor_digest` of `dst` when `header` is its
    `tensor_header`), in one pass on CPU, hashed from `dst`. `source=True`, for a source no one
    else writes during the copy: hashed from `src` and streamed to `dst` (fewer memory transfers).
    Other devices and layouts: copy, then hash."""
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} elements into a tensor of {dst.numel()}")
    n = dst.numel() * dst.element_size()
    if n == 0:
        return xxhash.xxh3_128(header).hexdigest()
    d = Digest(header)
    if d.address is None or dst.dtype != src.dtype or not (_flat(dst) and _flat(src)):
        dst.copy_(src)
        from weightsync.wire.bucket import tensor_bytes
        h = xxhash.xxh3_128(header)
        h.update(tensor_bytes(dst))
        return h.hexdigest()
    k = jit()
    dp, sp = dst.data_ptr(), src.data_ptr()
    if k is not None and source:
        k.hash_stream(dp, sp, n, update_address(), d.address, FED_BYTES)
    elif k is not None:
        k.stream_then_hash(dp, sp, n, update_address(), d.address, BACK_BYTES)
    else:
        move, feed, state = ctypes.memmove, d._lib.XXH3_128bits_update, d.address
        for s in range(0, n, CHUNK_BYTES):
            c = min(CHUNK_BYTES, n - s)
            move(dp + s, sp + s, c)
            feed(state, dp + s, c)
    return d.hexdigest()


def digest_at(header: bytes, address: int, nbytes: int) -> str:
    """xxh3-128 of `header` followed by `nbytes` of memory at `address`."""
    d = Digest(header)
    d.update_at(address, nbytes)
    return d.hexdigest()


def copy_digest_many(jobs: list[tuple[torch.Tensor, torch.Tensor, bytes]], source: bool = False) -> list[str]:
    """`copy_digest` of each job, in order, in one run of about equal bytes per pool worker."""
    from weightsync.wire.pool import map_threads, workers
    if not jobs:
        return []
    k = min(workers(), len(jobs))
    if k < 2:
        return [copy_digest(*j, source=source) for j in jobs]
    sizes = [j[0].numel() * j[0].element_size() for j in jobs]
    runs: list[list[int]] = [[] for _ in range(k)]
    # largest first onto the lightest run (LPT): the runs end at about the same time
    load = [0] * k
    for i in sorted(range(len(jobs)), key=lambda i: -sizes[i]):
        r = min(range(k), key=load.__getitem__)
        runs[r].append(i)
        load[r] += sizes[i]
    out: list[str] = [""] * len(jobs)

    def run(idx: list[int]) -> None:
        for i in idx:
            out[i] = copy_digest(*jobs[i], source=source)
    map_threads(run, [r for r in runs if r])
    return out
