"""How one payload is cut into LMDeploy `/update_weights` calls.

The payload body is weightsync's safetensors layout: tensors sorted by itemsize (desc) then dtype
name, so every dtype is one contiguous, aligned run of the data section. LMDeploy's
flattened_bucket takes one dtype per buffer with element indices, so each run is one call, sent
as a zero-copy view of the body. TurboMind takes only plain calls holding exactly one decoder
layer (or the misc weights), so tensors are regrouped along layer boundaries, across buckets.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Iterator

import torch

from weightsync.wire.bucket import dtype_from_name
from weightsync.errors import PayloadError
from weightsync.wire.frame import SAFETENSORS_DTYPES, unpack

from .serialize import FlattenedTensorMetadata, flattened_metadata


@dataclass
class Segment:
    """The tensors of one `/update_weights` call. `flat` is set for flattened_bucket calls."""

    named: list[tuple[str, torch.Tensor]]
    flat: torch.Tensor | None = None
    metadata: list[FlattenedTensorMetadata] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.named]


def _layout(body: torch.Tensor) -> tuple[int, list[tuple[str, str, list[int], int, int]]]:
    """Data-section start and (name, dtype, shape, start, end) per tensor, in wire order."""
    if body.numel() < 8:
        raise PayloadError("payload is truncated: no safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(body[:8].cpu().numpy()))
    header = json.loads(bytes(body[8: 8 + hlen].cpu().numpy()))
    header.pop("__metadata__", None)
    rows = [(n, SAFETENSORS_DTYPES[v["dtype"]], [int(d) for d in v["shape"]], int(v["data_offsets"][0]),
             int(v["data_offsets"][1])) for n, v in header.items()]
    rows.sort(key=lambda r: r[3])
    return 8 + hlen, rows


def flattened_runs(body: torch.Tensor) -> list[Segment]:
    """One flattened_bucket segment per dtype run: the run's bytes viewed as that dtype (no copy),
    with LMDeploy's metadata (element indices relative to the run)."""
    start, rows = _layout(body)
    named = dict(unpack(body)[0])
    data = body[start:]
    out: list[Segment] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][1] == rows[i][1]:
            j += 1
        dtype = dtype_from_name(rows[i][1])
        a, b = rows[i][3], rows[j - 1][4]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if a % itemsize:
            raise PayloadError(f"dtype run {rows[i][1]} starts at byte {a}, not a multiple of its "
                               f"itemsize; the payload is not in weightsync's wire order")
        flat = data[a:b].view(dtype)
        group = [(r[0], named[r[0]]) for r in rows[i:j]]
        out.append(Segment(group, flat, flattened_metadata(group)))
        i = j
    return out


def plain(body: torch.Tensor) -> Segment:
    """Every tensor of the payload in one plain call (PyTorch backend without flattening)."""
    return Segment(list(unpack(body)[0]))


class LayerGrouper:
    """TurboMind's rule: each call carries one whole decoder layer, or the misc weights
    (embeddings, final norm, lm_head) in a single call. A layer may straddle buckets, so the
    layer that was still open at the end of a bucket is carried to the next one; misc weights
    are held until the end. Carried tensors are copied, so no payload body outlives its send."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)
        self.open_key: int | None = None
        self.open: list[tuple[str, torch.Tensor]] = []
        self.misc: list[tuple[str, torch.Tensor]] = []
        self.done: set[int] = set()

    def layer_of(self, name: str) -> int | None:
        m = self.pattern.search(name)
        return int(m.group(1)) if m else None

    def feed(self, named: list[tuple[str, torch.Tensor]], last: bool) -> Iterator[Segment]:
        """Segments that are complete after this bucket (all remaining ones when `last`)."""
        for name, t in named:
            key = self.layer_of(name)
            if key is None:
                self.misc.append((name, t))
                continue
            if key != self.open_key:
                if self.open:
                    yield self._close()
                if key in self.done:
                    raise PayloadError(f"{name}: layer {key} came back after other layers; "
                                       f"TurboMind needs every layer's tensors in one call, so "
                                       f"export tensors layer by layer (state-dict order)")
                self.open_key = key
            self.open.append((name, t))
        if last:
            if self.open:
                yield self._close()
            if self.misc:
                misc, self.misc = self.misc, []
                yield Segment(misc)
        else:       # what stays for the next bucket must not pin this bucket's body
            self.open = [(n, t.clone()) if _is_view(t) else (n, t) for n, t in self.open]
            self.misc = [(n, t.clone()) if _is_view(t) else (n, t) for n, t in self.misc]

    def _close(self) -> Segment:
        seg = Segment(self.open)
        if self.open_key is not None:
            self.done.add(self.open_key)
        self.open, self.open_key = [], None
        return seg


def _is_view(t: torch.Tensor) -> bool:
    return t._base is not None or t.untyped_storage().nbytes() != t.numel() * t.element_size()
