"""Registered memory an engine reads payloads into: a few buffers kept for the process's life
(registered once, grown when a payload is larger), one taken per payload while it is read and
staged. A buffer whose READ failed or timed out is never handed out again."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from weightsync_nixl.agent import Agent, Region

MIN_BYTES = 1 << 20
_GRAVE = 4                       # failed buffers kept alive a while: a late write lands in them


class Staging:
    def __init__(self, agent: Agent, device: str = "cpu") -> None:
        self.agent, self.device = agent, torch.device(device)
        self.free: list[Region] = []
        self.grave: list[Region] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def slot(self, nbytes: int) -> Iterator[torch.Tensor]:
        """A registered buffer of `nbytes` (a view of a kept one) until the block ends."""
        region = self._take(nbytes)
        ok = False
        try:
            yield region.tensor[:nbytes]
            ok = True
        finally:
            with self.lock:
                if ok:
                    self.free.append(region)
                else:
                    self._bury(region)

    def _take(self, nbytes: int) -> Region:
        with self.lock:
            fits = [r for r in self.free if r.tensor.numel() >= nbytes]
            if fits:
                r = min(fits, key=lambda r: r.tensor.numel())
                self.free.remove(r)
                return r
            if self.free:                        # grow the largest: fewer buffers, not more
                old = max(self.free, key=lambda r: r.tensor.numel())
                self.free.remove(old)
                self.agent.deregister(old)
        size = max(nbytes, MIN_BYTES)
        return self.agent.register(torch.empty(size, dtype=torch.uint8, device=self.device))

    def _bury(self, region: Region) -> None:
        try:
            self.agent.deregister(region)
        finally:
            self.grave.append(region)
            del self.grave[:-_GRAVE]


_pools: dict[tuple[str, str], Staging] = {}
_pools_lock = threading.Lock()


def staging(agent: Agent, device: str) -> Staging:
    """The process's staging buffers for `agent` on `device`."""
    with _pools_lock:
        key = (agent.name, device)
        if key not in _pools:
            _pools[key] = Staging(agent, device)
        return _pools[key]
