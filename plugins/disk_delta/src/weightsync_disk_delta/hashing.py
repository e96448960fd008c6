"""A tensor's digest (weightsync.bucket.tensor_digest: xxh3-128 over a header and the bytes) in a
hash state the compiled loops can feed themselves.

The loops that compare (sender) or write (host) a tensor go over its bytes anyway; hashing each
few KiB right after the loop went over them, while they are still in the core's first-level
caches, makes the digest almost free (a 1 GiB compare + digest: 0.14 s -> 0.10 s on 2 cores).
Feeding a Python hash object in chunks cannot do that: every call costs microseconds, so chunks
must be large and are out of cache again by the time they are hashed.

The state lives in C memory and is fed by the xxHash library that the `xxhash` package is built
from (its extension module exports XXH3_128bits_*). Where those symbols are missing, `Digest`
wraps an `xxhash.xxh3_128` object and the loops feed it in chunks: the same digest, slower."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import xxhash


class _H128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


_lock = threading.Lock()
_lib: Any = None
_loaded = False


def library() -> Any:
    """The xxHash C library inside the `xxhash` package, or None where it does not export the
    streaming XXH3-128 functions."""
    global _lib, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                from xxhash import _xxhash
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
    """An xxh3-128 state that has taken `header`. `address` is its C state (None: a Python
    xxhash object holds it, fed through `update`)."""

    def __init__(self, header: bytes, native: bool = True) -> None:
        lib = library() if native else None
        self._lib = lib
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

    def hexdigest(self) -> str:
        if self._py is not None:
            return str(self._py.hexdigest())
        d = self._lib.XXH3_128bits_digest(self.address)
        return f"{d.high64:016x}{d.low64:016x}"

    def __del__(self) -> None:
        if self.address and self._lib is not None:
            self._lib.XXH3_freeState(self.address)
            self.address = None
