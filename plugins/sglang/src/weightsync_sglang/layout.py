"""SGLang 0.5.23's flattened_bucket layout, read straight off a weightsync payload.

A payload body is safetensors: 8-byte header length, JSON header, then the data section with the
tensors back to back, largest itemsize first (so every offset stays aligned to its dtype). That
data section *is* SGLang's new flattened layout (docs/engines.md, SGLang): one uint8 buffer, mixed
dtypes, no padding, byte offsets. So nothing is copied: the flattened tensor is a view of the body.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
from weightsync.wire.bucket import dtype_from_name
from weightsync.errors import PayloadError

_ST_TO_TORCH = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True)
class FlatEntry:
    """One tensor of a flattened bucket; offsets count bytes from the start of the data section."""

    name: str
    dtype: str          # bare torch name, as SGLang's `dtypes` field wants it
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass
class FlatBucket:
    """The data section of one payload (uint8 view, same device as the body) and its entries in
    wire order."""

    data: torch.Tensor
    entries: list[FlatEntry]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def flat_bucket(body: torch.Tensor) -> FlatBucket:
    """Split a safetensors-layout body into its data section and entries (checked, zero-copy)."""
    if body.dtype != torch.uint8 or body.dim() != 1:
        raise PayloadError("payload body must be a 1-d uint8 tensor")
    if body.numel() < 8:
        raise PayloadError("payload is truncated: shorter than the 8-byte safetensors header length")
    (hlen,) = struct.unpack("<Q", bytes(body[:8].cpu().numpy()))
    if 8 + hlen > body.numel():
        raise PayloadError(f"payload header length {hlen} does not fit a {body.numel()}-byte payload")
    try:
        header = json.loads(bytes(body[8: 8 + hlen].cpu().numpy()))
    except ValueError as e:
        raise PayloadError(f"payload header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    data = body[8 + hlen:]
    entries = []
    for name, info in header.items():
        try:
            dtype = _ST_TO_TORCH[info["dtype"]]
            start, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"tensor {name!r}: malformed payload header entry ({e})") from None
        entries.append(FlatEntry(name, dtype, shape, start, end))
    entries.sort(key=lambda e: (e.start, e.end))
    pos = 0
    for ent in entries:
        numel = 1
        for d in ent.shape:
            numel *= d
        itemsize = ent.torch_dtype.itemsize
        if ent.start != pos or ent.end - ent.start != numel * itemsize:
            raise PayloadError(f"tensor {ent.name!r}: bytes {ent.start}..{ent.end} are not "
                               f"contiguous in wire order; SGLang's flattened_bucket needs them "
                               f"back to back")
        if ent.start % itemsize:
            raise PayloadError(f"tensor {ent.name!r}: byte offset {ent.start} is not a multiple "
                               f"of its itemsize {itemsize} (SGLang rejects it as unaligned)")
        pos = ent.end
    if pos != data.numel():
        raise PayloadError(f"payload data section holds {data.numel()} bytes, its header {pos}")
    return FlatBucket(data, entries)
