"""CUDA IPC handles as JSON (they travel in the announce header): bytes fields are base64, every
field is checked on the way in, and the rebuild goes through torch's `rebuild_cuda_tensor`."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, cast

import torch

from weightsync.errors import PayloadError

_BYTES = ("handle", "ref_counter_handle", "event_handle")
_INTS = ("device", "storage_bytes", "storage_offset", "ref_counter_offset", "tensor_offset", "numel")


def share_tuple_to_json(share: tuple, tensor_offset: int, numel: int) -> dict[str, Any]:
    """`UntypedStorage._share_cuda_()`'s 8-tuple and the uint8 view, as JSON."""
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = share

    def b64(b: bytes | None) -> str | None:
        return None if b is None else base64.b64encode(bytes(b)).decode()

    return {"kind": "cuda_ipc", "device": int(device), "handle": b64(handle),
            "storage_bytes": int(size), "storage_offset": int(offset),
            "ref_counter_handle": b64(rc_handle), "ref_counter_offset": int(rc_offset),
            "event_handle": b64(ev_handle), "event_sync_required": bool(ev_sync),
            "tensor_offset": int(tensor_offset), "numel": int(numel)}


def rebuild_args(d: Mapping[str, Any]) -> tuple:
    """`rebuild_cuda_tensor`'s arguments for a `share_tuple_to_json` handle, each field checked."""
    if d.get("kind") != "cuda_ipc":
        raise PayloadError(f"not a CUDA IPC handle: kind={d.get('kind')!r}")
    raw: dict[str, Any] = {}
    for k in _INTS:
        v = d.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PayloadError(f"CUDA IPC handle field {k!r} must be a non-negative integer, got {v!r}")
    for k in _BYTES:
        v = d.get(k)
        if v is None and k == "event_handle":
            raw[k] = None
            continue
        if not isinstance(v, str):
            raise PayloadError(f"CUDA IPC handle field {k!r} must be base64 text, got {type(v).__name__}")
        try:
            raw[k] = base64.b64decode(v, validate=True)
        except ValueError:
            raise PayloadError(f"CUDA IPC handle field {k!r} is not valid base64") from None
    if d["tensor_offset"] + d["numel"] > d["storage_bytes"]:
        raise PayloadError(f"CUDA IPC view {d['tensor_offset']}+{d['numel']} exceeds the shared "
                           f"storage of {d['storage_bytes']} bytes")
    return (torch.Tensor, (d["numel"],), (1,), d["tensor_offset"], torch.UntypedStorage, torch.uint8,
            d["device"], raw["handle"], d["storage_bytes"], d["storage_offset"], False,
            raw["ref_counter_handle"], d["ref_counter_offset"], raw["event_handle"],
            bool(d.get("event_sync_required")))


def export_buffer(t: torch.Tensor) -> dict[str, Any]:
    """JSON handle of a CUDA uint8 tensor (the sender keeps `t` alive while it is in use)."""
    if not t.is_cuda or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError("export_buffer takes a contiguous uint8 CUDA tensor")
    share = t.untyped_storage()._share_cuda_()
    # a SymInt only while tracing: here an int
    return share_tuple_to_json(share, cast(int, t.storage_offset()), t.numel())


def open_buffer(d: Mapping[str, Any]) -> torch.Tensor:
    """The sender's buffer, mapped into this process (same host, same GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    t = rebuild_cuda_tensor(*rebuild_args(d))
    if t.numel() != d["numel"] or t.untyped_storage().nbytes() < d["tensor_offset"] + d["numel"]:
        raise PayloadError(f"CUDA IPC handle opened as {t.untyped_storage().nbytes()} bytes, but the "
                           f"sender announced {d['tensor_offset']}+{d['numel']}; a stale mapping "
                           f"of this handle is still alive in this process")
    return t
