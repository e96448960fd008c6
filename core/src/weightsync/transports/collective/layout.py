"""How one payload is cut into broadcasts for an engine's `Adapter.layout`."""

from __future__ import annotations

from typing import Any

import torch

from weightsync.wire.bucket import dtype_from_name


def body_layout(body: torch.Tensor) -> tuple[int, list[tuple[str, str, list[int], int, int]]]:
    """Start of the data section and (name, dtype, shape, start, end) per tensor, wire order."""
    from weightsync.wire.frame import SAFETENSORS_DTYPES, read_header
    start, entries, _ = read_header(body)
    out = [(n, SAFETENSORS_DTYPES[v["dtype"]], list(v["shape"]), int(v["data_offsets"][0]), int(v["data_offsets"][1]))
           for n, v in entries.items()]
    return start, out


def split_payload(body: torch.Tensor, layout: str) -> list[tuple[torch.Tensor, str, list[dict[str, Any]]]]:
    """(tensor to broadcast, its dtype name, tensors it carries) for one payload and layout."""
    start, tensors = body_layout(body)
    specs = [{"name": n, "dtype": d, "shape": s} for n, d, s, _, _ in tensors]
    if layout == "safetensors":
        return [(body, "uint8", specs)]
    data = body[start:]
    if layout == "flat":
        return [(data, "uint8", specs)]
    runs: list[tuple[torch.Tensor, str, list[dict[str, Any]]]] = []
    i = 0
    while i < len(tensors):
        j = i
        while j < len(tensors) and tensors[j][1] == tensors[i][1]:
            j += 1
        a, b = tensors[i][3], tensors[j - 1][4]
        dt = tensors[i][1]
        runs.append((data[a:b].view(dtype_from_name(dt)), dt, specs[i:j]))
        i = j
    return runs
