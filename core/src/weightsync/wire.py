"""Wire layouts. Tensors travel in the safetensors layout (8-byte little-endian header length,
JSON header, raw bytes), so any safetensors reader can check a payload and nothing is pickled.
HTTP frames wrap a JSON payload header around that body."""

from __future__ import annotations

import json
import struct
from typing import Any, Sequence

import torch

from .bucket import dtype_from_name, dtype_name
from .errors import PayloadError

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20


def target_dtype(t: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and t.is_floating_point() else t.dtype


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize          # no tensor allocation per call (hot in per-tensor loops)


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
    for name, t in sorted(named, key=lambda nt: (-_itemsize(target_dtype(nt[1], cast)),
                                                  dtype_name(target_dtype(nt[1], cast)))):
        dt = target_dtype(t, cast)
        n = t.numel() * _itemsize(dt)
        header[name] = {"dtype": _ST_DTYPES[dtype_name(dt)], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        placed.append((name, t, off, dt))
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)          # data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, placed


def pack(named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
         out: torch.Tensor | None = None, cast: torch.dtype | None = None) -> torch.Tensor:
    """Write tensors into one uint8 buffer in safetensors layout; `out` lets a transport hand in
    its own (shared-memory, pinned) buffer so the bytes are written exactly once, and `cast`
    converts floating tensors on the way in (no intermediate copy)."""
    head, placed = safetensors_layout(named, metadata, cast)
    data = sum(t.numel() * _itemsize(dt) for _, t, _, dt in placed)
    total = len(head) + data
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    elif out.numel() < total:
        raise ValueError(f"buffer of {out.numel()} bytes is smaller than the payload ({total})")
    out = out[:total]
    out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    base = len(head)
    for _, t, off, dt in placed:
        n = t.numel() * _itemsize(dt)
        if n:
            dst = out[base + off: base + off + n].view(dt).view(t.shape)
            dst.copy_(t.detach())
    return out


def packed_size(named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                cast: torch.dtype | None = None) -> int:
    head, placed = safetensors_layout(named, metadata, cast)
    return len(head) + sum(t.numel() * _itemsize(dt) for _, t, _, dt in placed)


def read_header(buf: torch.Tensor) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(start of the data section, per-tensor header entries in file order, __metadata__)."""
    if buf.numel() < 8:
        raise PayloadError("payload is truncated: shorter than the 8-byte safetensors header length")
    (hlen,) = struct.unpack("<Q", bytes(buf[:8].cpu().numpy()))
    if hlen > _MAX_HEADER or 8 + hlen > buf.numel():
        raise PayloadError(f"payload header length {hlen} does not fit a {buf.numel()}-byte payload")
    try:
        header = json.loads(bytes(buf[8: 8 + hlen].cpu().numpy()))
    except ValueError as e:
        raise PayloadError(f"payload header is not valid JSON ({e}); the payload is corrupted") from None
    meta = header.pop("__metadata__", {}) or {}
    return 8 + hlen, header, meta


def unpack(buf: torch.Tensor | bytes | memoryview | bytearray) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Zero-copy views of the tensors in a safetensors-layout buffer, validating every offset."""
    if not isinstance(buf, torch.Tensor):
        buf = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    start, header, meta = read_header(buf)
    data = buf[start:]
    out = []
    for name, info in header.items():
        try:
            dtype = dtype_from_name(_ST_NAMES[info["dtype"]])
            shape = [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"tensor {name!r}: malformed header entry ({e})") from None
        itemsize = dtype.itemsize
        numel = 1
        for d in shape:
            numel *= d
        if not (0 <= start <= end <= data.numel()) or end - start != numel * itemsize:
            raise PayloadError(f"tensor {name!r}: data offsets {start}..{end} do not match "
                               f"shape {shape} {dtype_name(dtype)} in a {data.numel()}-byte body")
        view = data[start:end]
        if numel and (view.data_ptr() % itemsize):
            view = view.clone()
        out.append((name, view.view(dtype).reshape(shape) if numel
                    else torch.empty(shape, dtype=dtype, device=buf.device)))
    return out, meta


def frame(header: dict[str, Any], body: torch.Tensor | bytes | memoryview) -> list[memoryview | bytes]:
    """HTTP frame: u64 header length, JSON payload header, body. Returned as parts (no join copy)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if isinstance(body, torch.Tensor):
        body = memoryview(body.numpy()) if body.numel() else b""
    return [struct.pack("<Q", len(raw)), raw, body]


def unframe(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    mv = memoryview(buf)
    if len(mv) < 8:
        raise PayloadError("frame is truncated: no header length")
    (hlen,) = struct.unpack("<Q", mv[:8])
    if hlen > _MAX_HEADER or 8 + hlen > len(mv):
        raise PayloadError(f"frame header length {hlen} does not fit a {len(mv)}-byte frame")
    try:
        header = json.loads(bytes(mv[8: 8 + hlen]))
    except ValueError as e:
        raise PayloadError(f"frame header is not valid JSON ({e})") from None
    return header, mv[8 + hlen:]
