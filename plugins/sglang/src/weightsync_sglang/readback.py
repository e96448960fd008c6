"""Read-back of what SGLang holds after a commit. SGLang cannot hash what it loaded, so a sync to
it is only acknowledged; with read-back on, the adapter keeps the first rows of a few tensors it
sent (reservoir-sampled over the sync, so every tensor has the same chance) and, after commit,
asks SGLang's `/get_weights_by_name` for them: equal values make the outcome `verified` (by
sample), different values fail the engine."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from weightsync.interfaces import Payload
from weightsync.wire.frame import unpack


class ReadbackPicks:
    """Up to `k` (name, first `rows` rows as float32 lists) from the payloads of one sync."""

    def __init__(self, k: int, rows: int, seed: int = 0) -> None:
        self.k, self.rows = k, rows
        self.rng = random.Random(seed)
        self.seen = 0
        self.samples: dict[str, Any] = {}

    def reset(self, seed: int) -> None:
        self.rng.seed(seed)
        self.seen = 0
        self.samples = {}

    def observe(self, payload: Payload) -> None:
        if self.k <= 0 or payload.encoding not in ("raw", "cast"):
            return
        for name, t in unpack(payload.body)[0]:
            if t.dim() == 0 or t.numel() == 0 or not t.is_floating_point():
                continue
            self.seen += 1
            if len(self.samples) < self.k:
                self.samples[name] = _rows(t, self.rows)
            else:
                j = self.rng.randrange(self.seen)
                if j < self.k:
                    drop = list(self.samples)[j]
                    del self.samples[drop]
                    self.samples[name] = _rows(t, self.rows)


def _rows(t: torch.Tensor, rows: int) -> Any:
    """What SGLang's route answers for a tensor: `t.float().tolist()[:rows]`."""
    return t[:rows].detach().to("cpu", torch.float32).tolist()


def same(want: Any, got: Any) -> bool:
    """Exact equality of nested float lists (NaN equals NaN: a NaN weight sent is a NaN held)."""
    if isinstance(want, list):
        return isinstance(got, list) and len(want) == len(got) and all(map(same, want, got))
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return False
    return (math.isnan(want) and math.isnan(got)) or float(want) == float(got)


def depth(x: Any) -> int:
    """Nesting depth of a list answer (a data-parallel SGLang answers one list per rank)."""
    n = 0
    while isinstance(x, list) and x:
        x, n = x[0], n + 1
    return n
