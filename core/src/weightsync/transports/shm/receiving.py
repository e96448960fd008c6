"""The engine's half of transport `shm`: map the sender's segment read-only (cached), check its
generation before and after staging, and return a zero-copy view of the payload body."""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.errors import PayloadError
from weightsync.interfaces import TransportReceiver
from weightsync.transports.shm.segments import GEN_BYTES, NAME_RE, SHM_DIR

_MAPS: OrderedDict[str, tuple[Any, torch.Tensor]] = OrderedDict()
_MAPS_LOCK = threading.Lock()
_MAX_MAPS = 8


def _open_cpu(name: str) -> torch.Tensor:
    if not NAME_RE.match(name):
        raise PayloadError(f"shm segment name {name!r} is not a weightsync segment")
    with _MAPS_LOCK:
        hit = _MAPS.get(name)
        if hit is not None:
            _MAPS.move_to_end(name)
            return hit[1]
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        raise PayloadError(f"shm segment {name} does not exist; the sender is gone or runs on "
                           f"another host (use transport 'collective' or 'http' there)") from None
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # read-only buffer: the receiver never writes
        t = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    with _MAPS_LOCK:
        _MAPS[name] = (mm, t)
        while len(_MAPS) > _MAX_MAPS:
            _MAPS.popitem(last=False)             # unmapped when the last view is dropped
    return t


def _open_cuda(handle: Mapping[str, Any]) -> torch.Tensor:
    """The sender's CUDA buffer, cached under its whole geometry: a grown allocation keeps its IPC
    handle, so a stale mapping of the same handle is dropped before the new one is opened."""
    from weightsync.transports.shm.cuda_ipc import open_buffer
    geometry = tuple(handle.get(k) for k in ("handle", "storage_offset", "storage_bytes",
                                              "tensor_offset", "numel"))
    key = "cuda:" + ":".join(map(str, geometry))
    with _MAPS_LOCK:
        hit = _MAPS.get(key)
        if hit is not None:
            _MAPS.move_to_end(key)
            return hit[1]
        stale = f"cuda:{geometry[0]}:{geometry[1]}:"
        for k in [k for k in _MAPS if k.startswith(stale)]:
            del _MAPS[k]
    t = open_buffer(handle)
    with _MAPS_LOCK:
        _MAPS[key] = (None, t)
        while len(_MAPS) > _MAX_MAPS:
            _MAPS.popitem(last=False)
    return t


def _generation(buf: torch.Tensor) -> int:
    tail = buf[buf.numel() - GEN_BYTES: buf.numel() - GEN_BYTES + 8]
    return int.from_bytes(bytes(tail.numpy()), "little")


class ShmReceiver(TransportReceiver):
    """Maps the sender's segments (cached: the same buffers recur) and returns zero-copy views."""

    def hash_source(self, header: Mapping[str, Any]) -> bool:
        """Hashed as it is read: its buffer has a generation that `unchanged` checks after."""
        tr = header.get("transport") or {}
        return "generation" in tr and "cuda_ipc" not in tr

    def unchanged(self, header: Mapping[str, Any]) -> None:
        """After staging: the sender did not start rewriting the buffer meanwhile."""
        tr = header.get("transport") or {}
        if "generation" in tr and "cuda_ipc" not in tr:
            if _generation(_open_cpu(str(tr.get("segment")))) != int(tr["generation"]):
                raise PayloadError(f"bucket {header.get('index')}: the sender rewrote shm buffer "
                                   f"{tr.get('segment')} while this engine read it; nothing was "
                                   f"staged (resend it)")

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        tr = header.get("transport") or {}
        try:
            offset, nbytes = int(tr["offset"]), int(tr["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise PayloadError("shm announce header lacks transport.offset/nbytes") from None
        if nbytes != int(header.get("nbytes", nbytes)):
            raise PayloadError(f"bucket {header.get('index')}: transport says {nbytes} bytes, "
                               f"payload says {header.get('nbytes')}")
        buf = _open_cuda(tr["cuda_ipc"]) if "cuda_ipc" in tr else _open_cpu(str(tr.get("segment")))
        room = buf.numel()
        if "generation" in tr and "cuda_ipc" not in tr:
            room -= GEN_BYTES
            if room < 0 or _generation(buf) != int(tr["generation"]):
                raise PayloadError(f"bucket {header.get('index')}: shm buffer {tr.get('segment')} "
                                   f"was already reused by the sender; nothing was staged")
        if offset < 0 or offset + nbytes > room:
            raise PayloadError(f"shm view {offset}+{nbytes} exceeds segment of {room} bytes")
        return buf[offset: offset + nbytes]


def forget_mappings() -> None:
    """Drop every cached mapping (tests; an engine switching trainers)."""
    with _MAPS_LOCK:
        _MAPS.clear()
