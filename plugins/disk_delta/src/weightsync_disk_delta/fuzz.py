"""Hypothesis strategies that make and break what weightsync readers parse: JSON documents
(manifests, `latest`, payload metadata), safetensors files (shards, payload bodies) and raw
bytes. Generic ones mutate any document or file; the manifest ones know its fields and produce
the near misses a broken publisher would (another shape, dtype, kind, positions form, base
version, a tensor moved to another shard). For tests only: it needs `hypothesis`, which is not a
runtime dependency.

    from weightsync_disk_delta import fuzz
    doc = data.draw(fuzz.mutated_json(manifest))          # inside @given(st.data())
    body = data.draw(fuzz.mutated_safetensors(body))      # header and arrays, still parseable
"""

from __future__ import annotations

import copy
import functools
import json
import math
import struct
from typing import Any

import torch
from hypothesis import strategies as st

from weightsync.wire.bucket import DTYPES

INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**53,
                    2**62, 2**63 - 1, 2**63, 2**64, -2**63, 10**30]
INTERESTING_TEXT = ["", ".", "..", "../", "../../etc/passwd", "/dev/zero", "a::val", "::",
                    "\x00", "\n", "é", "shard-00000.safetensors", "shard-99999.safetensors",
                    "v00000001", "full", "delta", "sparse", "xor", "idx", "gap8", "gap16",
                    "bfloat16", "float32", "BF16", "0" * 32, "f" * 32]
ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3",
             "F8_E5M2"]


@functools.cache
def json_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.sampled_from(INTERESTING_INTS),
                     st.integers(-1000, 1000), st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from(INTERESTING_TEXT), st.text(max_size=12))


@functools.cache
def json_values(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value, nested a little."""
    return st.recursive(json_scalars(),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=max_leaves)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside `doc`, the root included."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _near(value: Any) -> st.SearchStrategy[Any]:
    """Values close to `value`, of its own type mostly: what a bug rather than noise makes."""
    if isinstance(value, bool):
        return st.sampled_from([not value, int(value), str(value).lower(), None])
    if isinstance(value, int):
        return st.one_of(st.sampled_from([value - 1, value + 1, value * 2, -value, str(value),
                                          float(value)]), st.sampled_from(INTERESTING_INTS))
    if isinstance(value, str):
        return st.one_of(st.sampled_from([value[:-1], value + "x", "../" + value, value.upper(),
                                          value + "::val", value * 2]),
                         st.sampled_from(INTERESTING_TEXT))
    if isinstance(value, list):
        return st.one_of(st.just([]), st.just(value[:-1]), st.just(value + value[-1:]),
                         st.just(list(reversed(value))), st.just([value]),
                         st.lists(st.sampled_from(INTERESTING_INTS), max_size=4))
    if isinstance(value, dict):
        return st.one_of(st.just({}), st.just([value]), st.just(list(value)))
    return json_values()


@st.composite
def mutated_json(draw: st.DrawFn, doc: Any, max_edits: int = 3) -> Any:
    """`doc` with 1..max_edits edits anywhere: a value replaced by a near one or by any JSON
    value, a key deleted or added, a list element dropped or repeated."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_edits))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["near", "near", "any", "delete", "add"]))
        if not path:
            if op in ("near", "any"):
                doc = draw(_near(doc) if op == "near" else json_values())
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if op == "near":
            parent[key] = draw(_near(parent[key]))
        elif op == "any":
            parent[key] = draw(json_values())
        elif op == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(INTERESTING_TEXT) | st.text(max_size=6))] = draw(json_values())
        else:
            parent.insert(key, copy.deepcopy(parent[key]))
    return doc


@st.composite
def manifest_edit(draw: st.DrawFn, manifest: dict[str, Any]) -> dict[str, Any]:
    """One near miss of a disk_delta manifest that still parses as JSON of the right shape:
    another shape, dtype, kind, positions form, digest, base or version number, shard; a tensor
    dropped, renamed or added; a shard's size or checksum off by a little."""
    try:
        return _manifest_edit(draw, copy.deepcopy(manifest))
    except (TypeError, AttributeError, KeyError, IndexError, ValueError):
        return draw(mutated_json(manifest))       # not a manifest's shape any more: any edit


def _manifest_edit(draw: st.DrawFn, m: Any) -> Any:
    names = sorted(m.get("tensors", {}))
    what = draw(st.sampled_from(["shape", "dtype", "kind", "pos", "digest", "base_digest",
                                 "base_version", "version", "kind_of_version", "shard_of",
                                 "drop", "rename", "add", "bytes", "xxh3", "format"]))
    if names and what in ("shape", "dtype", "kind", "pos", "digest", "base_digest", "shard_of",
                          "drop", "rename", "add"):
        name = draw(st.sampled_from(names))
        t = m["tensors"][name]
        if what == "shape":
            shape = list(t.get("shape", []))
            t["shape"] = draw(st.sampled_from([shape[::-1], shape + [1], shape[:-1], [4096],
                                               [d + 1 for d in shape], [0], [], [2**40, 2**40],
                                               [max(d - 1, 0) for d in shape]]))
        elif what == "dtype":
            t["dtype"] = draw(st.sampled_from(sorted(DTYPES)))
        elif what == "kind":
            t["kind"] = draw(st.sampled_from(["full", "sparse", "xor"]))
        elif what == "pos":
            t["pos"] = draw(st.sampled_from(["idx", "gap8", "gap16"]))
        elif what in ("digest", "base_digest"):
            others = [m["tensors"][n].get("digest") for n in names]
            t[what] = draw(st.sampled_from(others + ["0" * 32, None]))
        elif what == "shard_of":
            shards = [s.get("file") for s in m.get("shards", [])]
            if shards:
                t["shard"] = draw(st.sampled_from(shards))
        elif what == "drop":
            del m["tensors"][name]
        elif what == "rename":
            m["tensors"][draw(st.sampled_from(names + [name + "x", name + "::val", "x"]))] = \
                m["tensors"].pop(name)
        else:
            m["tensors"][name + ".extra"] = copy.deepcopy(t)
    elif what == "base_version":
        m["base_version"] = draw(st.sampled_from([None, 0, m.get("version", 1) - 2,
                                                  m.get("version", 1), m.get("version", 1) + 1]))
    elif what == "version":
        m["version"] = m.get("version", 1) + draw(st.sampled_from([-1, 1, 1000]))
    elif what == "kind_of_version":
        m["kind"] = "full" if m.get("kind") == "delta" else "delta"
    elif what == "format":
        m["format"] = draw(st.sampled_from(["weightsync-disk-delta/1", "weightsync-disk-delta/3", ""]))
    elif m.get("shards"):
        s = draw(st.sampled_from(m["shards"]))
        if what == "bytes":
            s["bytes"] = s.get("bytes", 0) + draw(st.sampled_from([-1, 1, 2**30, -2**31]))
        else:
            s["xxh3"] = "0" * 32
    return m


def safetensors_bytes(arrays: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file holding `arrays` (weightsync's layout: aligned, no padding)."""
    from weightsync.wire.frame import pack
    return bytes(pack(sorted(arrays.items())).numpy())


@st.composite
def arrays(draw: st.DrawFn, names: list[str], max_numel: int = 64) -> dict[str, torch.Tensor]:
    """Arrays of any dtype, shape and bytes under `names`."""
    out = {}
    for name in names:
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = draw(st.lists(st.integers(0, 8), min_size=0, max_size=3))
        numel = math.prod(shape)
        if numel > max_numel:
            shape, numel = [max_numel], max_numel
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    return out


@st.composite
def positions_like(draw: st.DrawFn, count: int, numel: int) -> torch.Tensor:
    """`count` int32/int64 positions near a tensor of `numel` elements: ascending or not, in
    range or just past it, or wild."""
    kind = draw(st.sampled_from(["ascending", "past", "shuffled", "wild", "negative"]))
    n = max(count, 0)
    if kind == "ascending":
        vals = sorted(draw(st.lists(st.integers(0, max(numel - 1, 0)), min_size=n, max_size=n, unique=True))) \
            if numel >= n else list(range(n))
    elif kind == "past":
        vals = list(range(max(numel - n + 2, 0), max(numel - n + 2, 0) + n))
    elif kind == "shuffled":
        vals = draw(st.permutations(list(range(n))))
    elif kind == "negative":
        vals = [-1] + list(range(1, n))[: max(n - 1, 0)] if n else []
    else:
        vals = draw(st.lists(st.sampled_from(INTERESTING_INTS[:16] + [numel, numel - 1, numel + 1]),
                             min_size=n, max_size=n))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    vals = [max(min(v, 2**31 - 1), -2**31) if dtype == torch.int32 else v for v in vals]
    vals = [max(min(v, 2**63 - 1), -2**63) for v in vals]
    return torch.tensor(vals, dtype=dtype)


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with bytes flipped, cut, appended, spliced or zeroed."""
    b = bytearray(data)
    op = draw(st.sampled_from(["flip", "flip", "truncate", "append", "splice", "zero", "empty"]))
    if op == "flip" and b:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
    elif op == "truncate" and b:
        b = b[: draw(st.integers(0, len(b) - 1))]
    elif op == "append":
        b += draw(st.binary(min_size=1, max_size=64))
    elif op == "splice" and b:
        i = draw(st.integers(0, len(b)))
        b[i:i + draw(st.integers(0, 16))] = draw(st.binary(max_size=16))
    elif op == "zero" and b:
        i = draw(st.integers(0, len(b) - 1))
        b[i:i + draw(st.integers(1, 64))] = bytes(min(64, len(b) - i))
    elif op == "empty":
        b = bytearray()
    return bytes(b)


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header JSON, data section) of a safetensors file (ValueError when it is not one)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header length")
    (hlen,) = struct.unpack_from("<Q", data)
    try:
        header = json.loads(data[8: 8 + hlen])
    except RecursionError:
        raise ValueError("header nested too deep") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, data[8 + hlen:]


def join_safetensors(header: Any, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@st.composite
def mutated_safetensors(draw: st.DrawFn, data: bytes) -> bytes:
    """A safetensors file with its header edited (dtypes, shapes, offsets, names; or any JSON
    mutation), or its data section mutated: still a header a reader parses, so the checks after
    parsing are reached."""
    header, body = split_safetensors(data)
    if draw(st.booleans()):
        names = [k for k in header if k != "__metadata__" and isinstance(header[k], dict)]
        if bool(names) and draw(st.booleans()):
            name = draw(st.sampled_from(names))
            entry = header[name]
            field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "name"]))
            if field == "dtype":
                entry["dtype"] = draw(st.sampled_from(ST_DTYPES + ["Q9"]))
            elif field == "shape":
                entry["shape"] = draw(_near(entry.get("shape", [])))
            elif field == "data_offsets":
                offsets = entry.get("data_offsets")
                if isinstance(offsets, list) and len(offsets) == 2 and \
                        all(isinstance(x, int) for x in offsets):
                    a, b = offsets
                    entry["data_offsets"] = draw(st.sampled_from(
                        [[a, b + 1], [a + 1, b], [b, a], [0, b - a], [a, len(body) + 8], [-1, b]]))
                else:
                    entry["data_offsets"] = draw(json_values())
            else:
                header[draw(st.sampled_from(INTERESTING_TEXT) | st.text(max_size=8))] = header.pop(name)
        else:
            header = draw(mutated_json(header, max_edits=2))
        return join_safetensors(header, body)
    return join_safetensors(header, draw(mutated_bytes(body)))
