"""The sender's shared buffers for transport `shm`: names that carry the sender's pid and a
random token, created exclusively, registered with the resource tracker (which unlinks them if
the sender dies), and the generation counter in a CPU segment's tail."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("weightsync.transports.shm")
SHM_DIR = "/dev/shm"
PREFIX = "weightsync-"
GEN_BYTES = 64                   # a CPU segment's tail: the buffer's generation (u64 little-endian)
NAME_RE = re.compile(r"^weightsync-[0-9]+-[0-9a-f]+-[0-9]+$")


def _tracker(op: str, name: str) -> None:
    """Register/unregister `name` with the resource tracker (it unlinks it if this process dies)."""
    from multiprocessing import resource_tracker
    try:
        getattr(resource_tracker, op)("/" + name, "shared_memory")
    except Exception as e:  # noqa: BLE001 - the tracker is a safety net, not a requirement
        log.warning("resource tracker %s of %s failed: %s", op, name, e)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


@dataclass
class Segment:
    """One shared buffer of the sender, and whether an engine may still be reading it."""

    index: int
    name: str | None = None
    size: int = 0
    tensor: torch.Tensor | None = None
    mm: mmap.mmap | None = None
    ipc: dict[str, Any] | None = None
    free: threading.Event = field(default_factory=threading.Event)
    readers: dict[str, Any] = field(default_factory=dict)   # engine -> its announce's Future
    generation: int = 0

    def __post_init__(self) -> None:
        self.free.set()

    def contains(self, t: torch.Tensor) -> bool:
        if self.tensor is None or t.device != self.tensor.device:
            return False
        base = self.tensor.data_ptr()
        return base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + self.size

    def drop(self) -> None:
        """Unlink the name (CPU) and let go of the memory."""
        if self.name is not None:
            unlink(self.name)
            _tracker("unregister", self.name)
        self.tensor, self.ipc, self.name, self.size = None, None, None, 0
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # a payload view holds it; GC unmaps it later
                self.mm.close()
            self.mm = None


def create_cpu_segment(name: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _tracker("register", name)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink(name)
        _tracker("unregister", name)
        raise
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)
