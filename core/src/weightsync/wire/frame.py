"""Wire layouts. Tensors travel in the safetensors layout (8-byte little-endian header length,
JSON header, raw bytes), so any safetensors reader can check a payload and nothing is pickled.
HTTP frames wrap a JSON payload header around that body."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Sequence, TypeGuard

import torch

from weightsync.wire.bucket import dtype_from_name, dtype_name, tensor_bytes
from weightsync.errors import PayloadError

__all__ = ["SAFETENSORS_DTYPES", "frame", "header_entries", "header_length", "pack", "pack_digest",
           "packed_size", "parse_header", "read_file_header", "read_frame_header", "read_header",
           "safetensors_layout", "target_dtype", "unframe", "unpack"]

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
SAFETENSORS_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20
_CORRUPT = "; the payload is corrupted"


def target_dtype(t: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and t.is_floating_point() else t.dtype


def safetensors_layout(named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                       cast: torch.dtype | None = None) -> tuple[bytes, list[tuple[str, torch.Tensor, int, torch.dtype]]]:
    """The header bytes (length prefix included) and (name, tensor, data offset, dtype) per tensor.
    Largest itemsize first, so every offset stays aligned to its dtype without padding; tensors of
    one dtype are contiguous (engines that take one dtype per buffer slice runs out of it)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    placed = []
    off = 0
    for name, t in sorted(named, key=lambda nt: (-target_dtype(nt[1], cast).itemsize,
                                                  dtype_name(target_dtype(nt[1], cast)))):
        dt = target_dtype(t, cast)
        n = t.numel() * dt.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype_name(dt)], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        placed.append((name, t, off, dt))
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    # the data section starts 64-byte aligned: with a cache-line aligned buffer every tensor whose
    # size is a multiple of 64 bytes (most) sits on cache lines, so copies never split a load
    raw += b" " * (-(8 + len(raw)) % 64)
    return struct.pack("<Q", len(raw)) + raw, placed


def pack(named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
         out: torch.Tensor | None = None, cast: torch.dtype | None = None) -> torch.Tensor:
    """Write tensors into one uint8 buffer in safetensors layout; `out` lets a transport hand in
    its own (shared-memory, pinned) buffer so the bytes are written exactly once, and `cast`
    converts floating tensors on the way in (no intermediate copy)."""
    head, placed = safetensors_layout(named, metadata, cast)
    out, places = _with_head(out, head, placed)
    for (_, t, _, _), dst in zip(placed, places):
        dst.copy_(t.detach())
    return out


def _with_head(out: torch.Tensor | None, head: bytes,
               placed: list[tuple[str, torch.Tensor, int, torch.dtype]]
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The payload's buffer (`out`, or a new one) cut to size, with the safetensors header in,
    and each tensor's place in it."""
    total = len(head) + sum(t.numel() * dt.itemsize for _, t, _, dt in placed)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    elif out.numel() < total:
        raise ValueError(f"buffer of {out.numel()} bytes is smaller than the payload ({total})")
    out = out[:total]
    out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    base = len(head)
    return out, [out[base + off: base + off + t.numel() * dt.itemsize].view(dt).view(t.shape)
                 if t.numel() else torch.empty(t.shape, dtype=dt) for _, t, off, dt in placed]


def pack_digest(named: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None,
                metadata: dict[str, str] | None = None,
                layout: tuple[bytes, list[tuple[str, torch.Tensor, int, torch.dtype]]] | None = None
                ) -> tuple[torch.Tensor, dict[str, str]]:
    """`pack` and every tensor's xxh3-128 digest in one pass over the bytes (`copy_digest`, source
    mode: the trainer does not change its weights during a push). `layout`:
    `safetensors_layout(named, metadata)` when the caller computed it already."""
    from weightsync.wire.bucket import tensor_header
    from weightsync.wire.digests import copy_digest_many
    head, placed = layout if layout is not None else safetensors_layout(named, metadata)
    out, places = _with_head(out, head, placed)
    jobs = [(dst, t.detach(), tensor_header(name, t)) for (name, t, _, _), dst in zip(placed, places)]
    digests = copy_digest_many(jobs, source=True)    # the sender's own tensors: no other writer
    return out, {name: d for (name, _, _, _), d in zip(placed, digests)}


def packed_size(named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                cast: torch.dtype | None = None) -> int:
    head, placed = safetensors_layout(named, metadata, cast)
    return len(head) + sum(t.numel() * dt.itemsize for _, t, _, dt in placed)


def read_header(buf: torch.Tensor) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(start of the data section, per-tensor header entries in file order, __metadata__)."""
    hlen = header_length(bytes(buf[:8].cpu().numpy()), buf.numel())
    header = _json_object(bytes(buf[8: 8 + hlen].cpu().numpy()), "payload header", _CORRUPT)
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict):
        raise PayloadError("payload header's __metadata__ is not an object" + _CORRUPT)
    return 8 + hlen, header, meta


def _json_object(raw: bytes | memoryview, what: str, tail: str = "") -> dict[str, Any]:
    """`raw` parsed as the JSON object a header must be; PayloadError naming `what` otherwise."""
    try:
        header = json.loads(bytes(raw))
    except ValueError as e:
        raise PayloadError(f"{what} is not valid JSON ({e}){tail}") from None
    if not isinstance(header, dict):
        raise PayloadError(f"{what} is not a JSON object (a JSON {type(header).__name__}, not an "
                           f"object){tail}")
    return header


def is_int(x: Any) -> TypeGuard[int]:
    """A JSON integer: Python's bool is an int, a header's `true` is not."""
    return isinstance(x, int) and not isinstance(x, bool)


def header_entries(header: dict[str, Any], data_bytes: int) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, start, end) of every tensor in a parsed safetensors header (no
    __metadata__), each checked: a known dtype, offsets inside a `data_bytes` data section that
    match the shape."""
    out = []
    for name, info in header.items():
        try:
            dtype = dtype_from_name(SAFETENSORS_DTYPES[info["dtype"]])
            shape, offsets = list(info["shape"]), list(info["data_offsets"])
            if len(offsets) != 2 or not all(is_int(x) for x in shape + offsets):
                raise ValueError(f"shape {shape} and data_offsets {offsets} must be integers")
            start, end = offsets
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PayloadError(f"tensor {name!r}: malformed header entry ({e})") from None
        numel = 1
        for d in shape:
            if d < 0:
                raise PayloadError(f"tensor {name!r}: negative dimension in shape {shape}")
            numel *= d
        if not (0 <= start <= end <= data_bytes) or end - start != numel * dtype.itemsize:
            raise PayloadError(f"tensor {name!r}: data offsets {start}..{end} do not match "
                               f"shape {shape} {dtype_name(dtype)} in a {data_bytes}-byte body")
        out.append((name, dtype, shape, start, end))
    return out


def parse_header(raw: bytes | memoryview, total: int) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], dict[str, str]]:
    """The entries and __metadata__ of header `raw` of a `total`-byte payload (prefix included)."""
    header = _json_object(raw, "payload header", _CORRUPT)
    meta = header.pop("__metadata__", {}) or {}
    return header_entries(header, total - 8 - len(raw)), meta


def read_file_header(path: str | Path) -> tuple[int, dict[str, Any], dict[str, str]]:
    """A safetensors file's header, data unread: (data start, name -> entry, __metadata__)."""
    with open(path, "rb") as f:
        hlen = header_length(f.read(8), os.fstat(f.fileno()).st_size)
        header = _json_object(f.read(hlen), f"{path}: the safetensors header")
    meta = header.pop("__metadata__", None) or {}
    return 8 + hlen, header, meta


def header_length(prefix: bytes | memoryview, total: int, what: str = "payload") -> int:
    """The JSON header length from a payload's (or frame's) first 8 bytes, checked against its size."""
    if len(prefix) < 8:
        raise PayloadError(f"{what} is truncated: shorter than the 8-byte header length")
    (hlen,) = struct.unpack("<Q", bytes(prefix[:8]))
    if hlen > _MAX_HEADER or 8 + hlen > total:
        raise PayloadError(f"{what} header length {hlen} does not fit a {total}-byte {what}")
    return hlen


def unpack(buf: torch.Tensor | bytes | memoryview | bytearray) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Zero-copy views of the tensors in a safetensors-layout buffer, validating every offset."""
    if not isinstance(buf, torch.Tensor):
        buf = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    start, header, meta = read_header(buf)
    data = buf[start:]
    out = []
    for name, dtype, shape, a, b in header_entries(header, data.numel()):
        numel = (b - a) // dtype.itemsize
        view = data[a:b]
        if numel and (view.data_ptr() % dtype.itemsize):
            view = view.clone()
        out.append((name, view.view(dtype).reshape(shape) if numel
                    else torch.empty(shape, dtype=dtype, device=buf.device)))
    return out, meta


def frame(header: dict[str, Any], body: torch.Tensor | bytes | memoryview) -> list[memoryview | bytes]:
    """HTTP frame: u64 header length, JSON payload header, body. Returned as parts (no join copy)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if isinstance(body, torch.Tensor):
        body = tensor_bytes(body)
    return [struct.pack("<Q", len(raw)), raw, body]


def read_frame_header(read_into: Any, total: int) -> tuple[dict[str, Any], int]:
    """The JSON payload header of a frame that is still arriving (`read_into(view)` fills the
    start of `view`, returns the count) and how many body bytes follow it, reading nothing of the
    body (`ReceiveSession.apply_stream`)."""
    def exact(n: int) -> bytes:
        buf = memoryview(bytearray(n))
        got = 0
        while got < n:
            k = read_into(buf[got:])
            if not k:
                raise PayloadError(f"frame is truncated: it ended after {got} of {n} header bytes")
            got += k
        return bytes(buf)
    hlen = header_length(exact(8) if total >= 8 else b"", total, "frame")
    return _json_object(exact(hlen), "frame header"), total - 8 - hlen


def unframe(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    mv = memoryview(buf)
    hlen = header_length(mv[:8], len(mv), "frame")
    return _json_object(mv[8: 8 + hlen], "frame header"), mv[8 + hlen:]
