"""A published version's shards, read and checked before any of their arrays is used: the
safetensors header is validated against a schema, every array belongs to a tensor the manifest
lists in that shard (nothing unlisted, nothing missing), and a full shard, which the host keeps as
its data file, is laid out as weightsync writes it (aligned, no overlaps). What a shard may weigh
follows from its tensors, so a manifest cannot make an agent read more than a model's worth."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Annotated, Any, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weightsync.errors import PayloadError
from weightsync.wire.pool import map_threads
from weightsync.wire.frame import SAFETENSORS_DTYPES, unpack

from .codec import keys
from .layout import Hook, read_shard
from .schema import ITEMSIZE, Dim, Manifest, TensorEntry, explain

_MAX_HEADER = 100 << 20
_HEADER_SLACK = 4096                    # the length prefix, "__metadata__", padding


class _HeaderEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: Annotated[str, Field(pattern="^(" + "|".join(SAFETENSORS_DTYPES) + ")$")]
    shape: Annotated[list[Dim], Field(max_length=8)]
    data_offsets: Annotated[list[Annotated[int, Field(strict=True, ge=0)]],
                            Field(min_length=2, max_length=2)]


def header_of(data: bytearray | bytes, where: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """(start of the data section, name -> {dtype (torch name), shape, start, end} in absolute
    offsets) of a safetensors file, every entry validated; PayloadError otherwise."""
    if len(data) < 8:
        raise PayloadError(f"{where} is not a safetensors file (shorter than its 8-byte header length)")
    (hlen,) = struct.unpack_from("<Q", data)
    if hlen > _MAX_HEADER or 8 + hlen > len(data):
        raise PayloadError(f"{where}: header length {hlen} does not fit a {len(data)}-byte file")
    try:
        raw = json.loads(bytes(data[8: 8 + hlen]))
    except (ValueError, RecursionError) as e:
        raise PayloadError(f"{where}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise PayloadError(f"{where}: the safetensors header is not a JSON object")
    raw.pop("__metadata__", None)
    start = 8 + hlen
    out: dict[str, dict[str, Any]] = {}
    for name, info in raw.items():
        try:
            ent = _HeaderEntry.model_validate(info)
        except ValidationError as err:
            raise PayloadError(f"{where}: header entry {name!r} is malformed: {explain(err)}") from None
        dtype = SAFETENSORS_DTYPES[ent.dtype]
        a, b = ent.data_offsets
        numel = 1
        for d in ent.shape:
            numel *= d
        if not a <= b <= len(data) - start or b - a != numel * ITEMSIZE[dtype]:
            raise PayloadError(f"{where}: array {name!r} has data offsets {a}..{b}, which do not "
                               f"match {dtype} {ent.shape} in a {len(data) - start}-byte body")
        out[name] = {"dtype": dtype, "shape": list(ent.shape), "start": start + a,
                     "end": start + b}
    return start, out


def arrays_of(data: bytearray, where: str) -> dict[str, torch.Tensor]:
    """The arrays of a checked safetensors file, as views of `data`."""
    header_of(data, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return dict(unpack(data)[0])


def shard_limit(tensors: Mapping[str, TensorEntry]) -> int:
    """The most bytes a shard holding these entries can weigh: a full tensor's bytes, a sparse
    delta's values and int64 positions for every element, an xor delta's zstd bound."""
    total = _HEADER_SLACK
    for name, t in tensors.items():
        n, size = t.numel, t.itemsize
        body = {"full": n * size, "sparse": n * (size + 8) + 16,
                "xor": n * size + (n * size >> 8) + 256}[t.kind]
        total += body + 3 * (6 * len(name) + 256) + 8
    return total


def check_keys(m: Manifest, file: str, found: set[str]) -> None:
    """The arrays in one shard are exactly those of the tensors the manifest lists in it."""
    want: set[str] = set()
    for name, t in m.shard_tensors(file).items():
        want.update(keys(name, t.kind, t.pos))
    extra, missing = sorted(found - want), sorted(want - found)
    if extra or missing:
        what = []
        if extra:
            what.append(f"arrays the manifest does not list: {extra[:3]}")
        if missing:
            what.append(f"no arrays for: {missing[:3]}")
        raise PayloadError(f"version {m.version}: shard {file} holds {'; '.join(what)}; the "
                           f"version is inconsistent and was not applied")


def full_layout(m: Manifest, file: str, data: bytearray) -> dict[str, dict[str, Any]]:
    """name -> {offset, dtype, shape} of a full shard the host keeps as its data file: each
    tensor as the manifest says, aligned to its element size, none overlapping another."""
    where = f"version {m.version}: shard {file}"
    _, header = header_of(data, where)
    check_keys(m, file, set(header))
    spans = []
    out = {}
    for name, h in header.items():
        t = m.tensors[name]
        if h["dtype"] != t.dtype or h["shape"] != t.shape:
            raise PayloadError(f"{where}: tensor {name!r} is {h['dtype']} {h['shape']} in the "
                               f"shard, {t.dtype} {t.shape} in the manifest")
        if h["start"] % t.itemsize:
            raise PayloadError(f"{where}: tensor {name!r} is not aligned to its {t.itemsize}-byte "
                               f"elements; weightsync never writes that layout")
        spans.append((h["start"], h["end"], name))
        out[name] = {"offset": h["start"], "dtype": t.dtype, "shape": list(t.shape)}
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise PayloadError(f"{where}: tensors {a!r} and {b!r} share bytes")
    return out


def load(root: Path, m: Manifest, before_read: Hook | None = None
         ) -> tuple[dict[str, bytearray], dict[str, torch.Tensor]]:
    """(file -> bytes, array name -> tensor) of a version: every shard read (size, then xxh3,
    checked against the manifest) and its arrays checked against the manifest's entries."""
    if before_read:
        before_read(str(root / "versions" / f"v{m.version:08d}"))
    data = map_threads(lambda s: read_shard(root, m.version, s), m.shards)   # side by side
    shards = {s.file: b for s, b in zip(m.shards, data)}
    arrays: dict[str, torch.Tensor] = {}
    for file, b in shards.items():
        got = arrays_of(b, f"version {m.version}: shard {file}")
        check_keys(m, file, set(got))
        arrays.update(got)
    return shards, arrays
