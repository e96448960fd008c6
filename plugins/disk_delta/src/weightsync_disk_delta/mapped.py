"""Writing changes into the data files of a host-local checkpoint through shared mappings (the
writes land in the page cache, the same pages an engine reads), hashing each changed tensor as
it is written (kernels.swap), so its digest is checked on the bytes now in the file at no extra
pass. The workers are joined before anything is raised or unmapped."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from weightsync.wire.bucket import dtype_from_name, tensor_header
from weightsync.errors import PayloadError

from . import kernels
from .change import Change
from weightsync.wire.digests import Digest
from .joined import map_joined
from .schema import ITEMSIZE, numel_of

_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def map_file(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    """A file's bytes as a writable uint8 tensor over a shared mapping, with the mapping itself."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def unmap_later(maps: list[tuple[mmap.mmap, torch.Tensor]]) -> threading.Thread:
    """Unmap on a thread of its own: unmapping a written GiB costs about 15 ms (page tables, TLB)
    that nothing has to wait for, the written pages stay in the page cache. Takes the caller's
    list, so the caller holds no view that would keep a mapping alive."""
    def close() -> None:
        while maps:
            mm, buf = maps.pop()
            del buf
            try:
                mm.close()
            except BufferError:       # a view is still alive somewhere; the GC unmaps it
                pass
    t = threading.Thread(target=close, name="weightsync-unmap", daemon=True)
    t.start()
    return t


def region(buf: torch.Tensor, info: Mapping[str, Any]) -> torch.Tensor:
    """One tensor's bytes inside a mapped file, as a flat integer view."""
    size = ITEMSIZE[info["dtype"]]
    numel = numel_of(info["shape"])
    off = int(info["offset"])
    r = buf[off: off + numel * size]
    if r.numel() != numel * size:
        raise PayloadError(f"local checkpoint: tensor at offset {off} runs past the end of its file")
    if off % size:
        raise PayloadError(f"local checkpoint: tensor at offset {off} is not aligned to {size} bytes")
    return r.view(_TORCH_INT[size])


def write_changes(d: Path, changes: Mapping[str, Change], state: Mapping[str, Any],
                  replaced: dict[str, torch.Tensor] | None, fsync: bool) -> list[str]:
    """Write `changes` into the data files of `d`, hashing each changed tensor as it goes;
    returns the names whose bytes then differ from `state`'s digests. `replaced`, when given,
    receives the values each write replaced as soon as it replaced them; a tensor whose write
    raised was not written (kernels.swap raises only before writing)."""
    names = sorted(changes)
    files = sorted({state["tensors"][n]["file"] for n in names})
    maps: list[tuple[mmap.mmap, torch.Tensor]] = []
    bufs: dict[str, torch.Tensor] = {}
    try:
        for f in files:                    # every file at once: one pass over all tensors
            maps.append(map_file(d / f))
            bufs[f] = maps[-1][1]

        def write_and_check(n: str) -> bool:
            info = state["tensors"][n]
            c = changes[n]
            r = region(bufs[info["file"]], info)
            view = r.view(dtype_from_name(info["dtype"])).reshape(info["shape"])
            h = Digest(tensor_header(n, view))
            if c.idx is None:
                new = c.vals.reshape(-1).view(r.dtype)
                if new.numel() != r.numel():
                    raise PayloadError(f"tensor {n!r}: {new.numel()} new elements for {r.numel()}")
                if replaced is not None:
                    replaced[n] = r.clone()
                r.copy_(new)
                # numpy's stubs give ndarray __buffer__ only on Python 3.12+
                h.update(memoryview(r.numpy()).cast("B"))  # type: ignore[arg-type]
            else:
                old = kernels.swap(r, c.idx, c.vals.view(r.dtype), h)
                if replaced is not None:
                    replaced[n] = old
            return h.hexdigest() == info["digest"]

        oks = map_joined(write_and_check, names)
        if fsync:
            for mm, _ in maps:
                mm.flush()
        return [n for n, ok in zip(names, oks) if not ok]
    finally:
        bufs.clear()
        unmap_later(maps)
